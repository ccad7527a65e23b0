//! A generation's model state as bytes, for a planned handoff (CONTRACT §7): the KV cache of
//! every layer plus the logits of the last fed position, exactly as the source holds them, so the
//! destination continues with the very numbers the source would have used (exact mode stays
//! exact: no re-prefill, no second batching).
//!
//! A [`CacheExport`] knows nothing of candle: blocks are dtype names, shapes and little-endian
//! bytes. Its checksum ([`CacheExport::sha256`]) covers every block's header and bytes in order
//! and the logits; the manifest in the log names it, and the destination recomputes it before it
//! says it is ready.

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::model::Logits;

/// Which half of a layer's cache a block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Keys,
    Values,
}

impl BlockKind {
    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Keys => "k",
            BlockKind::Values => "v",
        }
    }

    pub fn parse(s: &str) -> Option<BlockKind> {
        match s {
            "k" => Some(BlockKind::Keys),
            "v" => Some(BlockKind::Values),
            _ => None,
        }
    }
}

/// One tensor of a cache: contiguous, row-major, little endian.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheBlock {
    pub layer: u32,
    pub kind: BlockKind,
    /// The element type's name (`f32`, `f16`, `bf16`, or `u64` for the fake model).
    pub dtype: String,
    pub shape: Vec<u32>,
    pub data: Vec<u8>,
}

impl CacheBlock {
    /// Bytes of one element of `dtype`, or `None` for a type this build does not know.
    pub fn dtype_bytes(dtype: &str) -> Option<usize> {
        match dtype {
            "f32" | "u32" => Some(4),
            "f16" | "bf16" => Some(2),
            "u64" | "f64" => Some(8),
            _ => None,
        }
    }

    /// Checks that the bytes fit the shape and dtype.
    pub fn check(&self) -> Result<()> {
        let width = Self::dtype_bytes(&self.dtype)
            .ok_or_else(|| Error::Invalid(format!("cache block of unknown dtype {:?}", self.dtype)))?;
        // Shapes come from another process: no overflow on the way.
        let needed = self
            .shape
            .iter()
            .try_fold(width as u64, |n, &d| n.checked_mul(u64::from(d)))
            .ok_or_else(|| Error::Invalid(format!("cache block shape {:?} is too large", self.shape)))?;
        if needed != self.data.len() as u64 {
            return Err(Error::Invalid(format!(
                "cache block of layer {} ({}): shape {:?} of {} needs {} bytes, it has {}",
                self.layer,
                self.kind.name(),
                self.shape,
                self.dtype,
                needed,
                self.data.len()
            )));
        }
        Ok(())
    }
}

/// Blocks of a cache copy still to be built ([`CacheCopy`]).
pub type BlocksLater = Box<dyn FnOnce() -> Result<Vec<CacheBlock>> + Send>;

/// A copy of a sequence's cache whose blocks may still have to be built: a copy taken between
/// two steps holds what it needs (the CPU engine: its chunks of positions, shared, not copied)
/// and is turned into blocks later, off the step ([`CacheCopy::export`]).
pub struct CacheCopy {
    pub format: String,
    pub positions: u32,
    pub blocks: BlocksLater,
    pub logits: Logits,
}

impl CacheCopy {
    /// Builds the blocks (a memory copy of the whole cache).
    pub fn export(self) -> Result<CacheExport> {
        Ok(CacheExport {
            format: self.format,
            positions: self.positions,
            blocks: (self.blocks)()?,
            logits: self.logits,
        })
    }
}

impl From<CacheExport> for CacheCopy {
    fn from(c: CacheExport) -> Self {
        let blocks = c.blocks;
        CacheCopy {
            format: c.format,
            positions: c.positions,
            blocks: Box::new(move || Ok(blocks)),
            logits: c.logits,
        }
    }
}

/// A sequence's cache, exported: what a planned handoff moves.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheExport {
    /// The cache layout and device class (e.g. `llama-kv/cpu`); the destination must hold its
    /// cache in the same format.
    pub format: String,
    /// Positions the cache holds (prompt and fed tokens).
    pub positions: u32,
    pub blocks: Vec<CacheBlock>,
    /// The logits of the last fed position.
    pub logits: Logits,
}

impl CacheExport {
    /// Lowercase hex SHA-256 of the format, the positions, every block (layer, kind, dtype,
    /// shape, bytes) in order and the logits.
    pub fn sha256(&self) -> String {
        let mut h = Sha256::new();
        let field = |h: &mut Sha256, b: &[u8]| {
            h.update((b.len() as u64).to_le_bytes());
            h.update(b);
        };
        field(&mut h, self.format.as_bytes());
        h.update(self.positions.to_le_bytes());
        h.update((self.blocks.len() as u64).to_le_bytes());
        for b in &self.blocks {
            h.update(b.layer.to_le_bytes());
            field(&mut h, b.kind.name().as_bytes());
            field(&mut h, b.dtype.as_bytes());
            h.update((b.shape.len() as u64).to_le_bytes());
            for d in &b.shape {
                h.update(d.to_le_bytes());
            }
            field(&mut h, &b.data);
        }
        h.update((self.logits.len() as u64).to_le_bytes());
        for l in &self.logits {
            h.update(l.to_le_bytes());
        }
        hex(&h.finalize())
    }

    /// Bytes the blocks and logits take.
    pub fn bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.data.len() as u64).sum::<u64>() + 4 * self.logits.len() as u64
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// f32s as little-endian bytes: logits (a transfer carries them as one more tensor) and the
/// blocks of an f32 cache.
pub fn f32s_to_bytes(l: &[f32]) -> Vec<u8> {
    l.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn f32s_from_bytes(b: &[u8]) -> Result<Vec<f32>> {
    if !b.len().is_multiple_of(4) {
        return Err(Error::Invalid(format!(
            "{} bytes is not a whole number of f32",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export() -> CacheExport {
        CacheExport {
            format: "fake/cpu".into(),
            positions: 3,
            blocks: vec![CacheBlock {
                layer: 0,
                kind: BlockKind::Keys,
                dtype: "u64".into(),
                shape: vec![1],
                data: 7u64.to_le_bytes().to_vec(),
            }],
            logits: vec![0.5, -1.0],
        }
    }

    #[test]
    fn the_checksum_covers_every_part() {
        let a = export();
        let base = a.sha256();
        assert_eq!(base.len(), 64);
        let mut changed = Vec::new();
        let mut b = a.clone();
        b.positions = 4;
        changed.push(b);
        let mut b = a.clone();
        b.blocks[0].data[0] ^= 1;
        changed.push(b);
        let mut b = a.clone();
        b.blocks[0].kind = BlockKind::Values;
        changed.push(b);
        let mut b = a.clone();
        b.blocks[0].shape = vec![1, 1];
        changed.push(b);
        let mut b = a.clone();
        b.logits[1] = -1.5;
        changed.push(b);
        let mut b = a.clone();
        b.format = "fake/cuda".into();
        changed.push(b);
        for c in changed {
            assert_ne!(c.sha256(), base, "{c:?}");
        }
        assert_eq!(a.bytes(), 8 + 8);
    }

    #[test]
    fn a_block_whose_bytes_do_not_fit_its_shape_is_refused() {
        let mut b = export().blocks.remove(0);
        b.check().unwrap();
        b.shape = vec![2];
        assert!(b.check().is_err());
        b.shape = vec![u32::MAX, u32::MAX, u32::MAX];
        assert!(b.check().is_err(), "an overflowing shape is refused, not a panic");
        b.dtype = "q9".into();
        assert!(b.check().is_err());
        let l = vec![1.0f32, f32::MIN, 3.25];
        assert_eq!(f32s_from_bytes(&f32s_to_bytes(&l)).unwrap(), l);
        assert!(f32s_from_bytes(&[0, 1, 2]).is_err());
    }
}
