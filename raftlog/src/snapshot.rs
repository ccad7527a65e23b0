//! Snapshot files: how the in-memory state machine becomes durable (together with the Raft log
//! after it), and what travels to a follower that is too far behind.
//!
//! A node keeps its snapshots in `<data dir>/snapshots/`, normally exactly one. A file is
//!
//! | bytes           | content                                                      |
//! |-----------------|--------------------------------------------------------------|
//! | 8               | magic `TLSNAP10` (format version 10; 3 to 9 are still read)   |
//! | 4               | length M of the meta (little endian)                          |
//! | M               | the snapshot's meta: last log id, membership (bincode)       |
//! | C               | the cold section: records of sealed generations, one frame    |
//! |                 | (bincode `Vec<Record>`) per generation, found by a `ColdRef`  |
//! |                 | (empty in the files a node writes itself, see below)         |
//! | B               | the body: the state machine at that log id (bincode)         |
//! | 8               | where the body starts (little endian)                         |
//! | 32              | SHA-256 of every byte before it                              |
//!
//! Formats 3 to 8 have no cold section and no body offset: the body runs from the meta to the
//! checksum. Format 9 is format 10's layout, its `ColdRef`s naming no segment.
//!
//! **Cold segments** (format 10). The records of sealed generations live in immutable segment
//! files, `<snapshots>/cold/segment-{id:020}.seg` (magic `TLCOLD10`, then frames), each frame
//! found by a `ColdRef` (segment id, offset, length, CRC-32, record count) in the body of the
//! snapshot that refers to it. A snapshot build writes one new segment with the generations
//! sealed since the last one and refers to the older segments as they are: it writes each
//! record once, not once per snapshot. A segment whose live frames (generations not pruned yet)
//! fall under half its bytes is rewritten into the new one, so dead bytes stay under the live
//! ones. A segment is durable before a snapshot names it, and is removed only once no snapshot
//! in place names it. A snapshot sent to a follower must carry its records: it is exported
//! self-contained (every frame in its own cold section, segment 0) as
//! `transfer-{index:020}.snap` ([`write_transfer`]), and a node that installs one keeps reading
//! those records from the installed file until its next build moves them into a segment.
//!
//! It is written aside (`*.partial`), fsynced, renamed to `snapshot-{index:020}.snap` and the
//! directory fsynced: a crash at any point leaves the old snapshot or the new one, never a mix.
//! Older snapshots are removed only after the new one is durable. Nothing is decoded before
//! its checksum has been verified, and decoding is bounded by the file's length.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bincode::Options;
use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::raft_types::SnapshotMeta;
use crate::types::{ColdRef, Record};

const MAGIC: &[u8; 8] = b"TLSNAP10";
/// Format 9: format 10's layout, cold references without a segment (read, never written).
const MAGIC_V9: &[u8; 8] = b"TLSNAP09";
/// Format 8: no cold section, no body offset (read, never written).
const MAGIC_V8: &[u8; 8] = b"TLSNAP08";
/// Format 7: the same layout, a body without the hot standbys (read, never written).
const MAGIC_V7: &[u8; 8] = b"TLSNAP07";
/// Format 6: the same layout, a body without the stage registrations (read, never written).
const MAGIC_V6: &[u8; 8] = b"TLSNAP06";
/// Format 5: the same layout, a body without the pipeline compositions (read, never written).
const MAGIC_V5: &[u8; 8] = b"TLSNAP05";
/// Format 4: the same layout, a body without the handoff table and the decoders' handoff
/// addresses (read, never written).
const MAGIC_V4: &[u8; 8] = b"TLSNAP04";
/// Format 3: as format 4, and without the tokenizer and session tables (read, never written).
const MAGIC_V3: &[u8; 8] = b"TLSNAP03";
/// The format version this build writes.
pub const FORMAT: u8 = 10;
const HEADER_BYTES: u64 = 12;
const TRAILER_BYTES: u64 = 32;
/// Format 9 keeps the body's offset just before the checksum.
const BODY_OFFSET_BYTES: u64 = 8;
/// Largest meta accepted (membership of a cluster: a few hundred bytes in practice).
const META_BYTES_MAX: u32 = 1 << 20;
const PARTIAL_SUFFIX: &str = ".partial";

/// Why a snapshot file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },
    /// The file is not a snapshot of this format, is cut short, or fails its checksum.
    #[error("{path}: {what}")]
    Corrupt { path: String, what: String },
}

impl SnapshotError {
    pub fn corrupt(path: &Path, what: impl Into<String>) -> Self {
        SnapshotError::Corrupt {
            path: path.display().to_string(),
            what: what.into(),
        }
    }

    pub fn io(path: &Path, source: io::Error) -> Self {
        SnapshotError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}

impl From<SnapshotError> for io::Error {
    fn from(e: SnapshotError) -> Self {
        match e {
            SnapshotError::Io { source, .. } => source,
            e @ SnapshotError::Corrupt { .. } => io::Error::new(io::ErrorKind::InvalidData, e.to_string()),
        }
    }
}

fn bincode_opts(limit: u64) -> impl Options {
    bincode::options()
        .with_fixint_encoding()
        .allow_trailing_bytes()
        .with_limit(limit)
}

/// A snapshot file, open for reading. Cheap to clone; reads use positioned I/O, so clones do not
/// share a cursor, and a file removed while a clone still streams it stays readable.
#[derive(Clone, Debug)]
pub struct SnapshotFile {
    path: PathBuf,
    file: Arc<File>,
    len: u64,
    /// The cold section's byte range, read from the header and trailer once (every frame read
    /// is bounded by it).
    cold: Arc<std::sync::OnceLock<std::ops::Range<u64>>>,
}

impl SnapshotFile {
    pub fn open(path: &Path) -> Result<Self, SnapshotError> {
        let io = |source| SnapshotError::io(path, source);
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        Ok(SnapshotFile {
            path: path.to_path_buf(),
            file: Arc::new(file),
            len,
            cold: Default::default(),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `other` is a clone of this open file (not merely the same path).
    pub fn same_file(&self, other: &SnapshotFile) -> bool {
        Arc::ptr_eq(&self.file, &other.file)
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Reads up to `buf.len()` bytes at `offset`; 0 at the end.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<usize> {
        self.file.read_at(buf, offset)
    }

    fn corrupt(&self, what: impl Into<String>) -> SnapshotError {
        SnapshotError::corrupt(&self.path, what)
    }

    fn io(&self, source: io::Error) -> SnapshotError {
        SnapshotError::io(&self.path, source)
    }

    /// The format version of the file from its magic, and the meta, the byte range of the
    /// cold section and of the body, from the header and trailer alone (no checksum check).
    fn layout(&self) -> Result<Layout, SnapshotError> {
        if self.len < HEADER_BYTES + TRAILER_BYTES {
            return Err(self.corrupt(format!("{} bytes: too short for a snapshot", self.len)));
        }
        let mut header = [0u8; HEADER_BYTES as usize];
        self.file.read_exact_at(&mut header, 0).map_err(|e| self.io(e))?;
        let format = match &header[..8] {
            m if m == MAGIC => FORMAT,
            m if m == MAGIC_V9 => 9,
            m if m == MAGIC_V8 => 8,
            m if m == MAGIC_V7 => 7,
            m if m == MAGIC_V6 => 6,
            m if m == MAGIC_V5 => 5,
            m if m == MAGIC_V4 => 4,
            m if m == MAGIC_V3 => 3,
            _ => {
                return Err(self.corrupt(format!("not a tokenlog snapshot of format 3 to {FORMAT} (bad magic)")));
            }
        };
        let trailer = TRAILER_BYTES + if format >= 9 { BODY_OFFSET_BYTES } else { 0 };
        let meta_len = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        if meta_len > META_BYTES_MAX || HEADER_BYTES + meta_len as u64 + trailer > self.len {
            return Err(self.corrupt(format!("meta length {meta_len} does not fit the file")));
        }
        let mut meta = vec![0u8; meta_len as usize];
        self.file
            .read_exact_at(&mut meta, HEADER_BYTES)
            .map_err(|e| self.io(e))?;
        let meta: SnapshotMeta = bincode_opts(meta_len as u64)
            .deserialize(&meta)
            .map_err(|e| self.corrupt(format!("meta does not decode: {e}")))?;
        let cold_start = HEADER_BYTES + meta_len as u64;
        let body_end = self.len - trailer;
        let body_start = if format >= 9 {
            let mut b = [0u8; 8];
            self.file.read_exact_at(&mut b, body_end).map_err(|e| self.io(e))?;
            let start = u64::from_le_bytes(b);
            if start < cold_start || start > body_end {
                return Err(self.corrupt(format!("body offset {start} does not fit the file")));
            }
            start
        } else {
            cold_start
        };
        Ok(Layout {
            format,
            meta,
            cold: cold_start..body_start,
            body: body_start..body_end,
            hashed_end: self.len - TRAILER_BYTES,
        })
    }

    /// The format version of the file (3 to 9, or [`FORMAT`]), from its magic (no checksum check).
    pub fn format(&self) -> Result<u8, SnapshotError> {
        Ok(self.layout()?.format)
    }

    /// The snapshot's meta, read from the header. Use [`SnapshotFile::verify`] before trusting
    /// anything else in the file.
    pub fn meta(&self) -> Result<SnapshotMeta, SnapshotError> {
        Ok(self.layout()?.meta)
    }

    /// Checks the whole file against its checksum and returns its meta.
    pub fn verify(&self) -> Result<SnapshotMeta, SnapshotError> {
        Ok(self.verified_layout()?.meta)
    }

    /// [`SnapshotFile::layout`], after checking the whole file against its checksum.
    fn verified_layout(&self) -> Result<Layout, SnapshotError> {
        let layout = self.layout()?;
        let end = layout.hashed_end;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut off = 0u64;
        while off < end {
            let want = buf.len().min((end - off) as usize);
            self.file.read_exact_at(&mut buf[..want], off).map_err(|e| self.io(e))?;
            hasher.update(&buf[..want]);
            off += want as u64;
        }
        let mut stored = [0u8; 32];
        self.file.read_exact_at(&mut stored, end).map_err(|e| self.io(e))?;
        if hasher.finalize().as_slice() != stored {
            return Err(self.corrupt("checksum mismatch: the file was changed or damaged after it was written"));
        }
        Ok(layout)
    }

    /// Verifies the checksum, then decodes the body (bounded by its length).
    pub fn load<T: DeserializeOwned>(&self) -> Result<(SnapshotMeta, T), SnapshotError> {
        let layout = self.verified_layout()?;
        let range = RangeReader {
            file: &self.file,
            pos: layout.body.start,
            end: layout.body.end,
        };
        let mut reader = io::BufReader::with_capacity(1 << 20, range);
        let body: T = bincode_opts(layout.body.end - layout.body.start)
            .deserialize_from(&mut reader)
            .map_err(|e| self.corrupt(format!("body does not decode: {e}")))?;
        Ok((layout.meta, body))
    }

    /// The bytes a [`ColdRef`] names, bounded by the cold section and checked against its CRC.
    pub fn read_frame(&self, r: &ColdRef) -> Result<Vec<u8>, SnapshotError> {
        let cold = match self.cold.get() {
            Some(c) => c.clone(),
            None => {
                let c = self.layout()?.cold;
                self.cold.get_or_init(|| c).clone()
            }
        };
        read_frame_in(&self.file, &self.path, cold, r)
    }
}

/// The frame `r` of `file`, which must lie inside `range` and match its CRC.
fn read_frame_in(file: &File, path: &Path, range: std::ops::Range<u64>, r: &ColdRef) -> Result<Vec<u8>, SnapshotError> {
    let corrupt = |what: String| SnapshotError::corrupt(path, what);
    let end = r.offset.checked_add(r.bytes);
    if r.offset < range.start || end.is_none_or(|e| e > range.end) || r.bytes > COLD_FRAME_BYTES_MAX {
        return Err(corrupt(format!(
            "cold records at {}+{} are outside its cold section {}..{}",
            r.offset, r.bytes, range.start, range.end
        )));
    }
    let mut buf = vec![0u8; r.bytes as usize];
    file.read_exact_at(&mut buf, r.offset)
        .map_err(|source| SnapshotError::io(path, source))?;
    if crc32fast::hash(&buf) != r.crc {
        return Err(corrupt(format!("cold records at {}: CRC mismatch", r.offset)));
    }
    Ok(buf)
}

/// The records of a frame `r` named (bounded by its length, their count checked).
pub(crate) fn decode_frame(buf: &[u8], r: &ColdRef) -> Result<Vec<Record>, String> {
    let records: Vec<Record> = bincode_opts(r.bytes)
        .deserialize(buf)
        .map_err(|e| format!("cold records at {} do not decode: {e}", r.offset))?;
    if records.len() as u64 != r.records as u64 {
        return Err(format!(
            "cold records at {}: {} of them, {} expected",
            r.offset,
            records.len(),
            r.records
        ));
    }
    Ok(records)
}

fn encode_frame(records: &[Record]) -> io::Result<Vec<u8>> {
    bincode_opts(u64::MAX)
        .serialize(records)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

const SEGMENT_MAGIC: &[u8; 8] = b"TLCOLD10";
const SEGMENT_HEADER_BYTES: u64 = 8;
/// The directory of the cold segments, inside the snapshots directory.
pub const COLD_DIR: &str = "cold";

/// Where segment `id` of the snapshots in `snapshot_dir` is.
pub fn segment_path(snapshot_dir: &Path, id: u64) -> PathBuf {
    snapshot_dir.join(COLD_DIR).join(format!("segment-{id:020}.seg"))
}

fn segment_id_of(name: &str) -> Option<u64> {
    name.strip_prefix("segment-")?.strip_suffix(".seg")?.parse().ok()
}

/// An immutable file of cold frames that snapshots refer to (see the module doc). Cheap to
/// clone; a removed segment stays readable through the clones still open.
#[derive(Clone, Debug)]
pub struct Segment {
    id: u64,
    path: PathBuf,
    file: Arc<File>,
    len: u64,
}

impl Segment {
    /// Opens segment `id` at `path`; its magic is checked, its frames when they are read.
    pub fn open(path: &Path, id: u64) -> Result<Self, SnapshotError> {
        let io = |source| SnapshotError::io(path, source);
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut magic = [0u8; SEGMENT_HEADER_BYTES as usize];
        if len < SEGMENT_HEADER_BYTES || file.read_exact_at(&mut magic, 0).is_err() || &magic != SEGMENT_MAGIC {
            return Err(SnapshotError::corrupt(
                path,
                "not a tokenlog cold segment (bad magic or too short)",
            ));
        }
        Ok(Segment {
            id,
            path: path.to_path_buf(),
            file: Arc::new(file),
            len,
        })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len <= SEGMENT_HEADER_BYTES
    }

    /// The bytes of its frames (all of them, live or not).
    pub fn frame_bytes(&self) -> u64 {
        self.len - SEGMENT_HEADER_BYTES
    }

    /// The bytes of frame `r` (bounded by the file, checked against its CRC).
    pub fn read_frame(&self, r: &ColdRef) -> Result<Vec<u8>, SnapshotError> {
        read_frame_in(&self.file, &self.path, SEGMENT_HEADER_BYTES..self.len, r)
    }
}

/// A segment being written ([`SnapshotDir::new_segment`]): removed on drop unless finished.
pub struct SegmentWriter {
    id: u64,
    partial: PathBuf,
    dest: PathBuf,
    w: Option<BufWriter<File>>,
    offset: u64,
}

impl SegmentWriter {
    /// Appends one generation's records as a frame and says where it is.
    pub fn put(&mut self, records: &[Record]) -> io::Result<ColdRef> {
        let bytes = encode_frame(records)?;
        self.put_frame(&bytes, records.len() as crate::types::Seq)
    }

    /// Appends a frame read (and CRC-checked) elsewhere, as it is.
    pub fn put_frame(&mut self, bytes: &[u8], records: crate::types::Seq) -> io::Result<ColdRef> {
        self.w.as_mut().expect("segment open").write_all(bytes)?;
        Ok(next_frame(self.id, &mut self.offset, bytes, records))
    }

    pub fn is_empty(&self) -> bool {
        self.offset == SEGMENT_HEADER_BYTES
    }

    /// Makes the segment durable under its final name (fsync, rename, directory fsync) and
    /// opens it; an empty one is removed instead (`None`).
    pub fn finish(mut self) -> io::Result<Option<Segment>> {
        let w = self.w.take().expect("segment open");
        if self.is_empty() {
            drop(w);
            return Ok(None); // dropped: the partial file is removed
        }
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        drop(file);
        fs::rename(&self.partial, &self.dest)?;
        self.partial = PathBuf::new();
        if let Some(dir) = self.dest.parent() {
            File::open(dir)?.sync_all()?;
        }
        Segment::open(&self.dest, self.id).map(Some).map_err(io::Error::from)
    }
}

impl Drop for SegmentWriter {
    fn drop(&mut self) {
        if !self.partial.as_os_str().is_empty() {
            let _ = fs::remove_file(&self.partial);
        }
    }
}

/// Where the parts of a snapshot file are.
struct Layout {
    format: u8,
    meta: SnapshotMeta,
    cold: std::ops::Range<u64>,
    body: std::ops::Range<u64>,
    /// The checksum covers every byte before this offset.
    hashed_end: u64,
}

/// The largest cold frame read back: a generation's records at the largest `max_tokens`
/// (8 bytes of length, 20 per record), with room to spare.
const COLD_FRAME_BYTES_MAX: u64 = 8 + 32 * crate::limits::GENERATION_TOKENS_MAX as u64;

/// The cold section of a snapshot being written: [`ColdSection::put`] appends one generation's
/// records and says where they are.
pub struct ColdSection<'a> {
    w: &'a mut HashWriter<BufWriter<File>>,
    offset: u64,
}

impl ColdSection<'_> {
    pub fn put(&mut self, records: &[Record]) -> io::Result<ColdRef> {
        let bytes = encode_frame(records)?;
        self.put_frame(&bytes, records.len() as crate::types::Seq)
    }

    /// Appends a frame read (and CRC-checked) elsewhere, as it is.
    pub fn put_frame(&mut self, bytes: &[u8], records: crate::types::Seq) -> io::Result<ColdRef> {
        self.w.write_all(bytes)?;
        Ok(next_frame(0, &mut self.offset, bytes, records))
    }
}

/// The reference to `bytes`, just written at `*offset` of `segment` (0: a snapshot's own cold
/// section), and the offset after it.
fn next_frame(segment: u64, offset: &mut u64, bytes: &[u8], records: crate::types::Seq) -> ColdRef {
    let r = ColdRef {
        segment,
        offset: *offset,
        bytes: bytes.len() as u64,
        crc: crc32fast::hash(bytes),
        records,
    };
    *offset += bytes.len() as u64;
    r
}

/// Reads `pos..end` of a file with positioned reads (clones of a `SnapshotFile` share no cursor).
struct RangeReader<'a> {
    file: &'a File,
    pos: u64,
    end: u64,
}

impl Read for RangeReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let want = buf.len().min((self.end - self.pos) as usize);
        if want == 0 {
            return Ok(0);
        }
        let n = self.file.read_at(&mut buf[..want], self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// Writes through to `inner` and hashes every byte.
struct HashWriter<W: Write> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> Write for HashWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

/// SHA-256 of `body` in the snapshot body's encoding (bincode, fixed-width integers), written
/// nowhere: the same state always gives the same digest, on every replica.
pub fn digest<T: Serialize>(body: &T) -> io::Result<[u8; 32]> {
    let mut w = HashWriter {
        inner: io::sink(),
        hasher: Sha256::new(),
    };
    bincode_opts(u64::MAX)
        .serialize_into(&mut w, body)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(w.hasher.finalize().into())
}

/// The steps of putting a snapshot in place, named so that tests can crash between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// The partial file is written and fsynced.
    Written,
    /// It is renamed to its final name (not yet durable: the directory is not synced).
    Renamed,
    /// The directory is fsynced: the new snapshot is the one a restart loads.
    DirSynced,
    /// Older snapshots are removed.
    OldRemoved,
}

impl Step {
    pub const ALL: [Step; 4] = [Step::Written, Step::Renamed, Step::DirSynced, Step::OldRemoved];
}

/// The directory of a node's snapshots.
#[derive(Debug)]
pub struct SnapshotDir {
    dir: PathBuf,
    /// Unique names for partial files of this process.
    next_partial: AtomicU64,
    /// The id the next cold segment gets: above every segment in `cold/` at open.
    next_segment: AtomicU64,
    /// Tests only: stop (as a crash would) right after this step.
    crash_after: Option<Step>,
    /// One snapshot is put in place at a time (a build and an install may overlap).
    placing: std::sync::Mutex<()>,
    /// Tests only: see [`SnapshotDir::between_list_and_open`].
    #[cfg(test)]
    between_list_and_open: TestHook,
}

/// Tests only: a function run once at a point of interest.
#[cfg(test)]
#[derive(Default)]
struct TestHook(std::sync::Mutex<Option<Box<dyn FnOnce() + Send>>>);

#[cfg(test)]
impl std::fmt::Debug for TestHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestHook")
    }
}

/// How often [`SnapshotDir::newest`] lists again when the file it listed was replaced: each
/// time a newer snapshot was put in place meanwhile, so a few suffice.
const NEWEST_TRIES: u32 = 8;

impl SnapshotDir {
    /// Opens (creating) `dir` and its `cold/`, and removes partial files a crash left behind
    /// and exports made for followers (made again when needed).
    pub fn open(dir: &Path) -> io::Result<Self> {
        let cold = dir.join(COLD_DIR);
        fs::create_dir_all(&cold)?;
        // `cold/` is an entry of `dir`: durable once `dir` is synced.
        File::open(dir)?.sync_all()?;
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(PARTIAL_SUFFIX) || transfer_index_of(&name).is_some() {
                fs::remove_file(entry.path())?;
            }
        }
        let mut next_segment = 1;
        for entry in fs::read_dir(&cold)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(PARTIAL_SUFFIX) {
                fs::remove_file(entry.path())?;
            } else if let Some(id) = segment_id_of(&name) {
                next_segment = next_segment.max(id + 1);
            }
        }
        Ok(SnapshotDir {
            dir: dir.to_path_buf(),
            next_partial: AtomicU64::new(0),
            next_segment: AtomicU64::new(next_segment),
            crash_after: None,
            placing: Default::default(),
            #[cfg(test)]
            between_list_and_open: Default::default(),
        })
    }

    /// A view of `dir` for reading only (`tokenlog verify`): nothing is created or removed.
    pub fn open_read_only(dir: &Path) -> Self {
        SnapshotDir {
            dir: dir.to_path_buf(),
            next_partial: AtomicU64::new(0),
            next_segment: AtomicU64::new(u64::MAX),
            crash_after: None,
            placing: Default::default(),
            #[cfg(test)]
            between_list_and_open: Default::default(),
        }
    }

    /// Tests only: every later `put_in_place` returns an error right after `step`, leaving the
    /// directory as a crash at that point would.
    pub fn crash_after(&mut self, step: Option<Step>) {
        self.crash_after = step;
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn final_name(index: u64) -> String {
        format!("snapshot-{index:020}.snap")
    }

    fn index_of(name: &str) -> Option<u64> {
        name.strip_prefix("snapshot-")?.strip_suffix(".snap")?.parse().ok()
    }

    /// The snapshot files here, newest (highest index) first.
    pub fn list(&self) -> io::Result<Vec<(u64, PathBuf)>> {
        let mut out = Vec::new();
        let entries = match fs::read_dir(&self.dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            r => r?,
        };
        for entry in entries {
            let entry = entry?;
            if let Some(i) = Self::index_of(&entry.file_name().to_string_lossy()) {
                out.push((i, entry.path()));
            }
        }
        out.sort_by_key(|e| std::cmp::Reverse(e.0));
        Ok(out)
    }

    /// The newest snapshot, unverified. A build or an install that puts a newer one in place
    /// between the listing and the open removes the one listed: then the listing is read
    /// again (a file is removed only once a newer one is in place). That open failed with
    /// "not found", and openraft's state-machine worker, asked for the current snapshot for a
    /// follower, ended on the storage error: the node's Raft stopped until a restart.
    pub fn newest(&self) -> io::Result<Option<SnapshotFile>> {
        let mut tries = 0;
        loop {
            let listed = self.list()?;
            #[cfg(test)]
            if let Some(between) = self.between_list_and_open.0.lock().expect("lock").take() {
                between();
            }
            let Some((_, p)) = listed.into_iter().next() else {
                return Ok(None);
            };
            match SnapshotFile::open(&p) {
                Err(SnapshotError::Io { source, .. })
                    if source.kind() == io::ErrorKind::NotFound && tries < NEWEST_TRIES =>
                {
                    tries += 1
                }
                r => return r.map(Some).map_err(io::Error::from),
            }
        }
    }

    /// Tests only: `f` runs once, in the next `newest`, between its listing and its open.
    #[cfg(test)]
    fn between_list_and_open(&self, f: impl FnOnce() + Send + 'static) {
        *self.between_list_and_open.0.lock().expect("lock") = Some(Box::new(f));
    }

    /// A new partial file in this directory, for a snapshot being written or received.
    pub fn partial(&self) -> io::Result<PartialSnapshot> {
        let n = self.next_partial.fetch_add(1, Ordering::Relaxed);
        let path = self
            .dir
            .join(format!("incoming-{}-{n}{PARTIAL_SUFFIX}", std::process::id()));
        let file = fs::OpenOptions::new().write(true).create_new(true).open(&path)?;
        Ok(PartialSnapshot {
            path,
            file: Some(file),
            written: 0,
        })
    }

    /// A new cold segment, written aside in `cold/` until [`SegmentWriter::finish`].
    pub fn new_segment(&self) -> io::Result<SegmentWriter> {
        let id = self.next_segment.fetch_add(1, Ordering::Relaxed);
        assert!(id != u64::MAX, "a read-only snapshot directory writes no segment");
        let dest = segment_path(&self.dir, id);
        let partial = dest.with_extension(format!("seg{PARTIAL_SUFFIX}"));
        let mut w = BufWriter::with_capacity(1 << 20, fs::File::create_new(&partial)?);
        w.write_all(SEGMENT_MAGIC)?;
        Ok(SegmentWriter {
            id,
            partial,
            dest,
            w: Some(w),
            offset: SEGMENT_HEADER_BYTES,
        })
    }

    /// The ids of the cold segments in `cold/`.
    pub fn segments(&self) -> io::Result<Vec<u64>> {
        let mut out = Vec::new();
        let entries = match fs::read_dir(self.dir.join(COLD_DIR)) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            r => r?,
        };
        for entry in entries {
            if let Some(id) = segment_id_of(&entry?.file_name().to_string_lossy()) {
                out.push(id);
            }
        }
        out.sort_unstable();
        Ok(out)
    }

    /// Removes every cold segment but `keep` (call it once the snapshot in place names only
    /// those); returns how many were removed. Readers holding one open still read it.
    pub fn remove_segments_except(&self, keep: &std::collections::BTreeSet<u64>) -> io::Result<usize> {
        let mut removed = 0;
        for id in self.segments()? {
            if !keep.contains(&id) {
                fs::remove_file(segment_path(&self.dir, id))?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Writes a snapshot of `body` at `meta` with no cold section and puts it in place.
    pub fn write<T: Serialize>(&self, meta: &SnapshotMeta, body: &T) -> io::Result<SnapshotFile> {
        self.write_with_cold(meta, |_| Ok(body))
    }

    /// Writes a snapshot at `meta` and puts it in place: `fill` writes the cold section and
    /// returns the body (which names where in it the records are).
    pub fn write_with_cold<B: Serialize>(
        &self,
        meta: &SnapshotMeta,
        fill: impl FnOnce(&mut ColdSection<'_>) -> io::Result<B>,
    ) -> io::Result<SnapshotFile> {
        let mut partial = self.partial()?;
        let file = partial.file.take().expect("a new partial file is open");
        partial.file = Some(write_snapshot_to(file, meta, fill)?);
        self.put_in_place(partial, meta)
    }

    /// Makes `src` (a snapshot received, or another node's file) this directory's current
    /// snapshot: a partial file of this directory is renamed, anything else is copied. The caller
    /// has verified `src` ([`SnapshotFile::load`]); a file that no longer reads as a snapshot is
    /// refused (and removed, if it was a partial file of this directory).
    pub fn install(&self, src: &SnapshotFile) -> Result<(SnapshotMeta, SnapshotFile), SnapshotError> {
        let ours =
            src.path.parent() == Some(self.dir.as_path()) && src.path.to_string_lossy().ends_with(PARTIAL_SUFFIX);
        let meta = match src.meta() {
            Ok(m) => m,
            Err(e) => {
                if ours {
                    let _ = fs::remove_file(&src.path);
                }
                return Err(e);
            }
        };
        let io = |source| SnapshotError::io(&self.dir, source);
        let partial = if ours {
            PartialSnapshot {
                path: src.path.clone(),
                file: Some(File::options().write(true).open(&src.path).map_err(io)?),
                written: src.len,
            }
        } else {
            let mut p = self.partial().map_err(io)?;
            let mut buf = vec![0u8; 1 << 20];
            let mut off = 0;
            while off < src.len {
                let n = src.read_at(off, &mut buf).map_err(io)?;
                if n == 0 {
                    return Err(src.corrupt("shorter than when it was verified"));
                }
                p.write(&buf[..n]).map_err(io)?;
                off += n as u64;
            }
            p
        };
        let file = self.put_in_place(partial, &meta).map_err(io)?;
        Ok((meta, file))
    }

    /// fsync, rename to the final name, fsync the directory, remove older snapshots (only older
    /// ones: a newer snapshot put in place meanwhile stays the newest).
    fn put_in_place(&self, mut partial: PartialSnapshot, meta: &SnapshotMeta) -> io::Result<SnapshotFile> {
        let _one_at_a_time = self.placing.lock().unwrap_or_else(|p| p.into_inner());
        let crash = |step: Step| -> io::Result<()> {
            if self.crash_after == Some(step) {
                return Err(io::Error::other(format!("simulated crash after {step:?}")));
            }
            Ok(())
        };
        let file = partial.file.take().expect("partial file open");
        file.sync_all()?;
        drop(file);
        crash(Step::Written)?;
        let index = meta.last_log_id.map_or(0, |l| l.index);
        let dest = self.dir.join(Self::final_name(index));
        fs::rename(&partial.path, &dest)?;
        partial.path = PathBuf::new(); // renamed: nothing to clean up
        crash(Step::Renamed)?;
        File::open(&self.dir)?.sync_all()?;
        crash(Step::DirSynced)?;
        for (i, p) in self.list()? {
            if i < index {
                fs::remove_file(p)?;
            }
        }
        for entry in fs::read_dir(&self.dir)? {
            let entry = entry?;
            if transfer_index_of(&entry.file_name().to_string_lossy()).is_some_and(|i| i < index) {
                fs::remove_file(entry.path())?;
            }
        }
        crash(Step::OldRemoved)?;
        SnapshotFile::open(&dest).map_err(io::Error::from)
    }
}

/// Writes a whole snapshot (header, meta, the cold section `fill` writes, the body it returns,
/// the body offset, the checksum) into `file`, and returns it flushed (not yet synced).
fn write_snapshot_to<B: Serialize>(
    file: File,
    meta: &SnapshotMeta,
    fill: impl FnOnce(&mut ColdSection<'_>) -> io::Result<B>,
) -> io::Result<File> {
    let mut w = HashWriter {
        inner: BufWriter::with_capacity(1 << 20, file),
        hasher: Sha256::new(),
    };
    let meta_bytes = bincode_opts(u64::MAX)
        .serialize(meta)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    w.write_all(MAGIC)?;
    w.write_all(&(meta_bytes.len() as u32).to_le_bytes())?;
    w.write_all(&meta_bytes)?;
    let mut cold = ColdSection {
        w: &mut w,
        offset: HEADER_BYTES + meta_bytes.len() as u64,
    };
    let body = fill(&mut cold)?;
    let body_start = cold.offset;
    bincode_opts(u64::MAX)
        .serialize_into(&mut w, &body)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    w.write_all(&body_start.to_le_bytes())?;
    let digest = w.hasher.finalize();
    let mut inner = w.inner;
    inner.write_all(&digest)?;
    inner.into_inner().map_err(|e| e.into_error())
}

fn transfer_name(index: u64) -> String {
    format!("transfer-{index:020}.snap")
}

fn transfer_index_of(name: &str) -> Option<u64> {
    name.strip_prefix("transfer-")?.strip_suffix(".snap")?.parse().ok()
}

/// The self-contained export of the snapshot at `meta` for a follower, in `dir` (a snapshots
/// directory): the one made before if it is there, else written now (aside, fsynced, renamed)
/// with the cold section `fill` writes. Removed with the snapshot it copies.
pub fn write_transfer<B: Serialize>(
    dir: &Path,
    meta: &SnapshotMeta,
    fill: impl FnOnce(&mut ColdSection<'_>) -> io::Result<B>,
) -> io::Result<SnapshotFile> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let index = meta.last_log_id.map_or(0, |l| l.index);
    let dest = dir.join(transfer_name(index));
    if let Ok(f) = SnapshotFile::open(&dest) {
        // Checked whole: a damaged export would otherwise be sent, and refused, for ever.
        if f.verify().is_ok_and(|m| &m == meta) {
            return Ok(f);
        }
    }
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut partial = PartialSnapshot {
        path: dir.join(format!("export-{}-{n}{PARTIAL_SUFFIX}", std::process::id())),
        file: None,
        written: 0,
    };
    let file = write_snapshot_to(File::create_new(&partial.path)?, meta, fill)?;
    file.sync_all()?;
    drop(file);
    fs::rename(&partial.path, &dest)?;
    partial.path = PathBuf::new(); // renamed: nothing to clean up
    File::open(dir)?.sync_all()?;
    SnapshotFile::open(&dest).map_err(io::Error::from)
}

/// A snapshot file being written or received; removed on drop unless put in place.
pub struct PartialSnapshot {
    path: PathBuf,
    file: Option<File>,
    written: u64,
}

impl PartialSnapshot {
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.file.as_mut().expect("partial file open").write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    pub fn written(&self) -> u64 {
        self.written
    }

    /// Syncs the bytes written and opens the file for reading (not yet in place: install it).
    pub fn finish(mut self) -> io::Result<SnapshotFile> {
        let file = self.file.take().expect("partial file open");
        file.sync_all()?;
        drop(file);
        let f = SnapshotFile::open(&self.path)?;
        // Ownership of the path passes to the SnapshotFile; installing renames it.
        self.path = PathBuf::new();
        Ok(f)
    }
}

impl Drop for PartialSnapshot {
    fn drop(&mut self) {
        if !self.path.as_os_str().is_empty() {
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::raft_types::{StoredMembership, TypeConfig};
    use openraft::testing::log_id;

    fn meta(index: u64) -> SnapshotMeta {
        SnapshotMeta {
            last_log_id: Some(log_id::<TypeConfig>(1, 1, index)),
            last_membership: StoredMembership::default(),
        }
    }

    #[test]
    fn the_digest_depends_on_the_state_only() {
        let a: std::collections::BTreeMap<u64, Vec<u32>> = [(2, vec![7, 8]), (1, vec![9])].into();
        let mut b = std::collections::BTreeMap::new();
        b.insert(1u64, vec![9u32]);
        b.insert(2, vec![7, 8]);
        assert_eq!(
            digest(&a).unwrap(),
            digest(&b).unwrap(),
            "insertion order does not matter"
        );
        b.get_mut(&2).unwrap()[1] = 9;
        assert_ne!(digest(&a).unwrap(), digest(&b).unwrap());
    }

    #[test]
    fn write_then_load_round_trips_and_keeps_only_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        dir.write(&meta(5), &vec![1u32, 2, 3]).unwrap();
        let f = dir.write(&meta(9), &vec![4u32, 5]).unwrap();
        let (m, body): (_, Vec<u32>) = f.load().unwrap();
        assert_eq!(m, meta(9));
        assert_eq!(body, vec![4, 5]);
        let names: Vec<u64> = dir.list().unwrap().into_iter().map(|(i, _)| i).collect();
        assert_eq!(names, vec![9]);
    }

    #[test]
    fn an_older_snapshot_finishing_late_does_not_replace_a_newer_one() {
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        dir.write(&meta(9), &9u32).unwrap();
        dir.write(&meta(5), &5u32).unwrap();
        let (m, v): (_, u32) = dir.newest().unwrap().unwrap().load().unwrap();
        assert_eq!((m, v), (meta(9), 9));
    }

    /// A newer snapshot put in place (and the listed one removed) between `newest`'s listing
    /// and its open: the newer one is found. The open failed with "not found", which ended
    /// openraft's state-machine worker (a follower's snapshot asked for during a build).
    #[test]
    fn the_newest_is_found_when_a_newer_one_replaced_it_meanwhile() {
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        dir.write(&meta(5), &5u32).unwrap();
        let other = SnapshotDir::open(d.path()).unwrap();
        dir.between_list_and_open(move || {
            other.write(&meta(9), &9u32).unwrap();
        });
        let (m, v): (_, u32) = dir.newest().unwrap().expect("a snapshot").load().unwrap();
        assert_eq!((m, v), (meta(9), 9));
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let f = dir.write(&meta(3), &(0..50u32).collect::<Vec<_>>()).unwrap();
        let clean = fs::read(f.path()).unwrap();
        for i in 0..clean.len() {
            let mut bad = clean.clone();
            bad[i] ^= 0x10;
            fs::write(f.path(), &bad).unwrap();
            let g = SnapshotFile::open(f.path()).unwrap();
            assert!(g.load::<Vec<u32>>().is_err(), "flipped byte {i} not detected");
        }
        let mut short = clean.clone();
        short.truncate(clean.len() - 1);
        fs::write(f.path(), &short).unwrap();
        assert!(SnapshotFile::open(f.path()).unwrap().load::<Vec<u32>>().is_err());
    }

    #[test]
    fn a_huge_length_in_a_verified_body_does_not_allocate_it() {
        // A body whose checksum is right but whose length prefix lies (a bug, not a disk error)
        // fails to decode instead of reserving the claimed size.
        let d = tempfile::tempdir().unwrap();
        let dir = SnapshotDir::open(d.path()).unwrap();
        let f = dir.write(&meta(1), &u64::MAX).unwrap();
        assert!(f.load::<Vec<u8>>().is_err());
    }

    #[test]
    fn a_crash_at_any_step_leaves_the_old_or_the_new_snapshot() {
        for step in Step::ALL {
            let d = tempfile::tempdir().unwrap();
            let mut dir = SnapshotDir::open(d.path()).unwrap();
            dir.write(&meta(1), &1u32).unwrap();
            dir.crash_after(Some(step));
            assert!(dir.write(&meta(2), &2u32).is_err());
            let reopened = SnapshotDir::open(d.path()).unwrap();
            let (m, v): (_, u32) = reopened.newest().unwrap().unwrap().load().unwrap();
            let index = m.last_log_id.unwrap().index;
            assert_eq!(index as u32, v, "after {step:?}: meta and body disagree");
            if step == Step::Written {
                assert_eq!(index, 1, "nothing in place yet after {step:?}");
            } else {
                assert_eq!(index, 2, "renamed before {step:?}");
            }
            let leftovers = fs::read_dir(d.path())
                .unwrap()
                .filter(|e| e.as_ref().unwrap().file_type().unwrap().is_file())
                .count();
            assert!(leftovers <= 2, "after {step:?}: {leftovers} files");
        }
    }
}
