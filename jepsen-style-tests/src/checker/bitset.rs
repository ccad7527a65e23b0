//! A fixed-size bitset (which operations are linearized) and a fast hasher for the cache.

use std::hash::{BuildHasherDefault, Hasher};

const WORD_BITS: usize = 64;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Bitset(Box<[u64]>);

impl Bitset {
    pub fn new(bits: usize) -> Self {
        Bitset(vec![0; bits.div_ceil(WORD_BITS)].into_boxed_slice())
    }

    pub fn set(&mut self, i: usize) {
        self.0[i / WORD_BITS] |= 1 << (i % WORD_BITS);
    }

    pub fn get(&self, i: usize) -> bool {
        self.0[i / WORD_BITS] & (1 << (i % WORD_BITS)) != 0
    }

    pub fn clear(&mut self, i: usize) {
        self.0[i / WORD_BITS] &= !(1 << (i % WORD_BITS));
    }
}

/// FxHash (rustc's hasher): much faster than SipHash for the cache's small integer keys.
#[derive(Default, Clone, Copy)]
pub struct FxHasher(u64);

const FX_SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(FX_SEED);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.add(u64::from_le_bytes(buf));
        }
    }

    fn write_u8(&mut self, i: u8) {
        self.add(i.into());
    }

    fn write_u32(&mut self, i: u32) {
        self.add(i.into());
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

pub type FxBuildHasher = BuildHasherDefault<FxHasher>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_and_clear() {
        let mut a = Bitset::new(130);
        let b = Bitset::new(130);
        a.set(129);
        a.set(3);
        assert_ne!(a, b);
        a.clear(129);
        a.clear(3);
        assert_eq!(a, b);
    }
}
