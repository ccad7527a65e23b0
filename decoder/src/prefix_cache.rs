//! A decoder's KV prefix cache (issue 15 item 6) and seed 004's reload-loop guard.
//!
//! - **What it holds.** The KV cache (and next logits) of a run of token ids, keyed by the ids
//!   and the cache format, never by text: entries come from prompt prefills (a new generation
//!   whose prompt was prefilled here stores it). A takeover, and a new generation, whose prompt
//!   and committed prefix begin with an entry's ids loads the entry and prefills only the rest
//!   ([`crate::DecodeState::resume_from_cache`]); the numbers are the same as a full prefill on
//!   a grouping-invariant sequence, so exact mode stays exact.
//! - **Where.** In memory, at most [`PREFIX_CACHE_BYTES_MAX`] (least recently used out first),
//!   and, with a directory, one checksummed file per entry, so that a restarted decoder finds
//!   them again. A file that fails its checksum or does not decode is removed, with the reason
//!   logged, and never used.
//! - **The reload-loop guard.** An entry whose restore kills the process (seed 004: a poisoned
//!   cache, restored after every restart, crashed the decoder every time) must not be restored
//!   for ever. Before a restore the cache records, durably with a directory, which entry it
//!   restores for which generation at which committed frontier. A restore of the same entry
//!   for the same generation at the same frontier as the last one, twice in a row without
//!   progress in between, is refused: the entry is discarded (unlinked, reason logged) and the
//!   next candidate, or a cold prefill, is used. Any real progress (records committed past the
//!   frontier) clears the generation's record.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use prost::Message;
use sha2::{Digest, Sha256};
use tokenlog_proto::decoder as dpb;

use crate::cache::{f32s_from_bytes, f32s_to_bytes, BlockKind, CacheBlock, CacheExport};
use crate::error::{Error, Result};
use crate::limits::{PREFIX_CACHE_BYTES_MAX, PREFIX_CACHE_ENTRIES_MAX, PREFIX_CACHE_FILE_BYTES_MAX};

const ENTRY_SUFFIX: &str = "tlpc";
const RESTORES_FILE: &str = "restores.pb";

/// An entry found for a restore.
#[derive(Clone, Debug)]
pub struct Restore {
    /// The entry's key (its file name without the suffix).
    pub key: String,
    pub cache: Arc<CacheExport>,
}

struct Entry {
    tokens: Vec<u32>,
    cache: Arc<CacheExport>,
    /// When it was last used (the cache's own counter): the least recent goes first.
    used: u64,
}

/// A decoder's prefix cache (see the module's doc).
pub struct PrefixCache {
    /// The model's cache format: entries of another format are never stored or loaded.
    format: String,
    dir: Option<PathBuf>,
    entries: BTreeMap<String, Entry>,
    bytes: u64,
    clock: u64,
    /// The last restore of each generation: the entry and the committed frontier.
    restores: BTreeMap<u64, (String, u32)>,
}

impl PrefixCache {
    /// A cache for sequences of cache format `format`; with `dir`, the entries and restore
    /// records found there are loaded (bad files are removed) and new ones are written there.
    pub fn open(format: &str, dir: Option<&Path>) -> Result<PrefixCache> {
        let mut c = PrefixCache {
            format: format.to_string(),
            dir: dir.map(Path::to_path_buf),
            entries: BTreeMap::new(),
            bytes: 0,
            clock: 0,
            restores: BTreeMap::new(),
        };
        let Some(dir) = dir else {
            return Ok(c);
        };
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| io(dir, e))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == ENTRY_SUFFIX))
            .collect();
        names.sort();
        for path in names {
            match read_entry(&path) {
                Ok((tokens, cache)) if cache.format == c.format && key_of(&c.format, &tokens) == stem(&path) => {
                    c.remember(tokens, Arc::new(cache));
                }
                Ok(_) => {
                    tracing::info!(path = %path.display(), "prefix cache entry of another model or format: left alone")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "prefix cache entry removed: it cannot be used");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        let restores = dir.join(RESTORES_FILE);
        if let Ok(bytes) = std::fs::read(&restores) {
            match dpb::PrefixRestores::decode(&bytes[..]) {
                Ok(r) => {
                    c.restores = r
                        .restores
                        .into_iter()
                        .map(|r| (r.generation_id, (r.entry, r.frontier)))
                        .collect()
                }
                Err(e) => {
                    tracing::warn!(path = %restores.display(), error = %e, "prefix cache restore records unreadable: starting without them")
                }
            }
        }
        Ok(c)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Stores the cache of positions `tokens` (already there: nothing). Entries over the byte
    /// or count bound go, least recently used first; a failed write is logged (the entry stays
    /// in memory).
    pub fn insert(&mut self, tokens: &[u32], cache: CacheExport) {
        if cache.format != self.format || cache.positions as usize != tokens.len() || tokens.is_empty() {
            return;
        }
        let key = key_of(&self.format, tokens);
        if self.entries.contains_key(&key) || cache.bytes() > PREFIX_CACHE_BYTES_MAX {
            return;
        }
        if let Some(dir) = &self.dir {
            if let Err(e) = write_entry(&dir.join(format!("{key}.{ENTRY_SUFFIX}")), tokens, &cache) {
                tracing::warn!(error = %e, "prefix cache entry not written to disk");
            }
        }
        self.remember(tokens.to_vec(), Arc::new(cache));
    }

    fn remember(&mut self, tokens: Vec<u32>, cache: Arc<CacheExport>) {
        let key = key_of(&self.format, &tokens);
        self.clock += 1;
        self.bytes += cache.bytes();
        self.entries.insert(
            key,
            Entry {
                tokens,
                cache,
                used: self.clock,
            },
        );
        while self.bytes > PREFIX_CACHE_BYTES_MAX || self.entries.len() > PREFIX_CACHE_ENTRIES_MAX {
            let oldest = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
                .expect("over a bound, so not empty");
            self.remove(&oldest);
        }
    }

    fn remove(&mut self, key: &str) {
        if let Some(e) = self.entries.remove(key) {
            self.bytes -= e.cache.bytes();
            if let Some(dir) = &self.dir {
                let _ = std::fs::remove_file(dir.join(format!("{key}.{ENTRY_SUFFIX}")));
            }
        }
    }

    /// The entry to restore generation `generation` from, whose ids `tokens` (prompt and
    /// committed prefix, `frontier` records) are needed: the longest entry they begin with,
    /// passing over (and discarding) one that the last restore of this generation used at this
    /// same frontier. The restore is recorded (on disk first, with a directory) before it is
    /// returned. `None`: nothing usable; prefill cold.
    pub fn restore_for(&mut self, generation: u64, tokens: &[u32], frontier: u32) -> Option<Restore> {
        loop {
            let key = self
                .entries
                .iter()
                .filter(|(_, e)| e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens))
                .max_by_key(|(_, e)| e.tokens.len())
                .map(|(k, _)| k.clone())?;
            if self.restores.get(&generation) == Some(&(key.clone(), frontier)) {
                tracing::warn!(
                    generation,
                    frontier,
                    entry = %key,
                    "prefix cache entry discarded: it was restored for this generation at this frontier before, and nothing was committed since (a reload loop)"
                );
                self.remove(&key);
                self.restores.remove(&generation);
                self.save_restores();
                continue;
            }
            self.restores.insert(generation, (key.clone(), frontier));
            self.save_restores();
            self.clock += 1;
            let e = self.entries.get_mut(&key).expect("found above");
            e.used = self.clock;
            return Some(Restore {
                key,
                cache: e.cache.clone(),
            });
        }
    }

    /// Generation `generation` has `frontier` records committed: a restore recorded at a lower
    /// frontier made progress, and its record goes.
    pub fn progress(&mut self, generation: u64, frontier: u32) {
        if self.restores.get(&generation).is_some_and(|(_, f)| *f < frontier) {
            self.restores.remove(&generation);
            self.save_restores();
        }
    }

    /// Whether generation `generation` has a restore recorded (not yet cleared by progress).
    pub fn restore_recorded(&self, generation: u64) -> bool {
        self.restores.contains_key(&generation)
    }

    fn save_restores(&self) {
        let Some(dir) = &self.dir else {
            return;
        };
        let msg = dpb::PrefixRestores {
            restores: self
                .restores
                .iter()
                .map(|(g, (e, f))| dpb::PrefixRestore {
                    generation_id: *g,
                    entry: e.clone(),
                    frontier: *f,
                })
                .collect(),
        };
        if let Err(e) = write_durably(&dir.join(RESTORES_FILE), &msg.encode_to_vec()) {
            tracing::warn!(error = %e, "prefix cache restore records not written: the reload-loop guard cannot see past a crash");
        }
    }
}

/// An entry's key: SHA-256 of the format and the token ids (hex).
fn key_of(format: &str, tokens: &[u32]) -> String {
    let mut h = Sha256::new();
    h.update((format.len() as u64).to_le_bytes());
    h.update(format.as_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    hex::encode(h.finalize())
}

fn stem(p: &Path) -> String {
    p.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn io(p: &Path, e: std::io::Error) -> Error {
    Error::Invalid(format!("{}: {e}", p.display()))
}

/// Writes `bytes` aside, fsyncs, renames into place and fsyncs the directory.
fn write_durably(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("partial");
    let mut f = std::fs::File::create(&tmp).map_err(|e| io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io(&tmp, e))?;
    f.sync_all().map_err(|e| io(&tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(path, e))?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io(dir, e))?;
    }
    Ok(())
}

fn write_entry(path: &Path, tokens: &[u32], cache: &CacheExport) -> Result<()> {
    let mut tensors: Vec<dpb::KvTensor> = cache
        .blocks
        .iter()
        .map(|b| dpb::KvTensor {
            layer: b.layer,
            kind: b.kind.name().into(),
            dtype: b.dtype.clone(),
            shape: b.shape.clone(),
            data: b.data.clone(),
        })
        .collect();
    tensors.push(dpb::KvTensor {
        layer: 0,
        kind: "logits".into(),
        dtype: "f32".into(),
        shape: vec![cache.logits.len() as u32],
        data: f32s_to_bytes(&cache.logits),
    });
    let msg = dpb::PrefixCacheEntry {
        tokens: tokens.to_vec(),
        format: cache.format.clone(),
        tensors,
        cache_sha256: cache.sha256(),
    };
    write_durably(path, &msg.encode_to_vec())
}

/// Reads and checks an entry file: bounded size, decodes, every block fits its shape, and the
/// checksum of what it holds is the one it names.
fn read_entry(path: &Path) -> Result<(Vec<u32>, CacheExport)> {
    let len = std::fs::metadata(path).map_err(|e| io(path, e))?.len();
    if len > PREFIX_CACHE_FILE_BYTES_MAX {
        return Err(Error::Invalid(format!("{len} bytes: larger than any entry")));
    }
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let msg = dpb::PrefixCacheEntry::decode(&bytes[..]).map_err(|e| Error::Invalid(format!("does not decode: {e}")))?;
    let mut blocks = Vec::new();
    let mut logits = Vec::new();
    for t in msg.tensors {
        if t.kind == "logits" {
            logits = f32s_from_bytes(&t.data)?;
            continue;
        }
        let kind =
            BlockKind::parse(&t.kind).ok_or_else(|| Error::Invalid(format!("unknown tensor kind {:?}", t.kind)))?;
        let b = CacheBlock {
            layer: t.layer,
            kind,
            dtype: t.dtype,
            shape: t.shape,
            data: t.data,
        };
        b.check()?;
        blocks.push(b);
    }
    let cache = CacheExport {
        format: msg.format,
        positions: msg.tokens.len() as u32,
        blocks,
        logits,
    };
    if cache.sha256() != msg.cache_sha256 {
        return Err(Error::Invalid("its checksum does not match what it holds".into()));
    }
    Ok((msg.tokens, cache))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(positions: u32, tag: u8) -> CacheExport {
        CacheExport {
            format: "f".into(),
            positions,
            blocks: vec![CacheBlock {
                layer: 0,
                kind: BlockKind::Keys,
                dtype: "u64".into(),
                shape: vec![1],
                data: u64::from(tag).to_le_bytes().to_vec(),
            }],
            logits: vec![0.25, f32::from(tag)],
        }
    }

    #[test]
    fn the_longest_entry_a_run_begins_with_is_restored_and_survives_a_restart() {
        let d = tempfile::tempdir().unwrap();
        let mut c = PrefixCache::open("f", Some(d.path())).unwrap();
        c.insert(&[1, 2], cache(2, 1));
        c.insert(&[1, 2, 3], cache(3, 2));
        c.insert(&[9], cache(1, 3));
        c.insert(&[1, 2, 3], cache(3, 4)); // already there
        c.insert(&[5, 5], cache(1, 4)); // positions do not match the ids: refused
        assert_eq!(c.len(), 3);
        let r = c.restore_for(7, &[1, 2, 3, 4], 1).unwrap();
        assert_eq!(r.cache.positions, 3);
        assert_eq!(r.cache.logits[1], 2.0);
        assert!(c.restore_for(8, &[2, 2], 0).is_none());
        // Another format's cache is not kept.
        c.insert(
            &[4],
            CacheExport {
                format: "g".into(),
                ..cache(1, 5)
            },
        );
        assert_eq!(c.len(), 3);
        drop(c);
        let mut again = PrefixCache::open("f", Some(d.path())).unwrap();
        assert_eq!(again.len(), 3);
        assert!(again.restore_recorded(7));
        assert_eq!(again.restore_for(9, &[1, 2, 3], 0).unwrap().cache.logits[1], 2.0);
        // A flipped byte: the file is removed at the next open, never used.
        let victim = d.path().join(format!("{}.{ENTRY_SUFFIX}", key_of("f", &[9])));
        let mut bytes = std::fs::read(&victim).unwrap();
        let n = bytes.len();
        bytes[n - 70] ^= 1;
        std::fs::write(&victim, bytes).unwrap();
        let third = PrefixCache::open("f", Some(d.path())).unwrap();
        assert_eq!(third.len(), 2);
        assert!(!victim.exists());
    }

    /// Seed 004: the same entry restored for the same generation at the same frontier a second
    /// time in a row is discarded, across a restart, and the next candidate is used; progress
    /// clears the record.
    #[test]
    fn a_second_restore_of_one_entry_at_one_frontier_discards_it() {
        let d = tempfile::tempdir().unwrap();
        let mut c = PrefixCache::open("f", Some(d.path())).unwrap();
        c.insert(&[1], cache(1, 1));
        c.insert(&[1, 2], cache(2, 2));
        let first = c.restore_for(5, &[1, 2, 3], 1).unwrap();
        assert_eq!(first.cache.positions, 2);
        // The process dies during that restore; its successor tries again.
        drop(c);
        let mut c = PrefixCache::open("f", Some(d.path())).unwrap();
        let second = c.restore_for(5, &[1, 2, 3], 1).unwrap();
        assert_eq!(
            second.cache.positions, 1,
            "the looping entry is passed over for the next one"
        );
        assert_eq!(c.len(), 1, "and discarded");
        assert!(!d.path().join(format!("{}.{ENTRY_SUFFIX}", first.key)).exists());
        // Once more at the same frontier: the last candidate goes too, a cold prefill follows.
        assert!(c.restore_for(5, &[1, 2, 3], 1).is_none());
        assert!(c.is_empty());
        // Progress clears the record: a later restore at a new frontier is allowed.
        c.insert(&[1], cache(1, 1));
        c.restore_for(6, &[1, 2], 1).unwrap();
        c.progress(6, 1);
        assert!(c.restore_recorded(6), "no progress past the frontier yet");
        c.progress(6, 2);
        assert!(!c.restore_recorded(6));
        assert!(
            c.restore_for(6, &[1, 2], 1).is_some(),
            "after progress the entry is fine again"
        );
    }

    #[test]
    fn the_cache_keeps_to_its_bounds() {
        let mut c = PrefixCache::open("f", None).unwrap();
        for i in 0..(PREFIX_CACHE_ENTRIES_MAX as u32 + 10) {
            c.insert(&[i], cache(1, 0));
        }
        assert_eq!(c.len(), PREFIX_CACHE_ENTRIES_MAX);
        assert!(c.restore_for(1, &[0], 0).is_none(), "the oldest went first");
        assert!(c.restore_for(1, &[PREFIX_CACHE_ENTRIES_MAX as u32 + 9], 0).is_some());
    }
}
