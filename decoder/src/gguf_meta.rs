//! A reader for the metadata block of a GGUF file (the key/value pairs before the tensor infos),
//! without candle: what the text layer needs (the tokenizer's vocabulary, merges, special ids and
//! chat template) so that a gateway can read a model's tokenizer without linking any model code.
//!
//! Format (little-endian): magic `GGUF`, `u32` version, tensor count, metadata count, then that
//! many `(string key, u32 type, value)`. Strings are a length and bytes (trailing NULs dropped,
//! invalid UTF-8 replaced, as candle's reader does); arrays are a `u32` element type, a count
//! and the elements (arrays may nest). Counts and lengths are `u64` in v2 and v3, `u32` in v1.
//! Every length is checked against [`limits`], and nothing is reserved ahead of the bytes that
//! back it, so a corrupt or hostile file gives an error, not an allocation of its claimed size.

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::Path;

use crate::error::{Error, Result};

/// Bounds on what the reader accepts; a file past them is refused as malformed.
pub mod limits {
    /// Most metadata pairs (SmolLM2 has 34; large models a few hundred).
    pub const METADATA_PAIRS_MAX: u64 = 65_536;
    /// Longest string (a chat template is a few KiB; a vocabulary entry a few bytes).
    pub const STRING_BYTES_MAX: u64 = 16 << 20;
    /// Arrays inside arrays (candle reads nested arrays; real files have none).
    pub const NESTING_MAX: u32 = 8;
    /// Most elements of one array (vocabularies and merge lists: up to a few hundred thousand).
    pub const ARRAY_LEN_MAX: u64 = 16 << 20;
}

const MAGIC: &[u8; 4] = b"GGUF";

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value of a `U32` (only: the same rule candle's reader applies, so a tokenizer read
    /// here is the one a GGUF decoder reads, down to its digest).
    pub fn to_u32(&self) -> Option<u32> {
        match *self {
            MetaValue::U32(v) => Some(v),
            _ => None,
        }
    }

    /// The value of an `I32` (only; see [`MetaValue::to_u32`]).
    pub fn to_i32(&self) -> Option<i32> {
        match *self {
            MetaValue::I32(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// The metadata of one GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufMetadata {
    pub version: u32,
    pub values: HashMap<String, MetaValue>,
}

impl GgufMetadata {
    /// Reads the metadata block of the file at `path` (not the tensors).
    pub fn read_file(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        Self::read(&mut BufReader::new(file)).map_err(|e| match e {
            Error::Invalid(m) => Error::Invalid(format!("{}: {m}", path.display())),
            e => e,
        })
    }

    /// Reads a metadata block from `r`, positioned at the start of the file.
    pub fn read(r: &mut impl Read) -> Result<Self> {
        let mut rd = Reader {
            r,
            wide: true,
            depth: 0,
        };
        let mut magic = [0u8; 4];
        rd.exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(malformed(format!("not a GGUF file (magic {magic:02x?})")));
        }
        let version = rd.u32()?;
        if !(1..=3).contains(&version) {
            return Err(Error::Unsupported(format!("GGUF version {version} (1 to 3 are read)")));
        }
        rd.wide = version >= 2;
        let _tensor_count = rd.len()?;
        let pairs = rd.len()?;
        if pairs > limits::METADATA_PAIRS_MAX {
            return Err(malformed(format!(
                "{pairs} metadata pairs (at most {})",
                limits::METADATA_PAIRS_MAX
            )));
        }
        let mut values = HashMap::with_capacity(pairs as usize);
        for _ in 0..pairs {
            let key = rd.string()?;
            let ty = rd.u32()?;
            let value = rd.value(ty)?;
            values.insert(key, value);
        }
        Ok(GgufMetadata { version, values })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.values.get(key)
    }
}

fn malformed(m: String) -> Error {
    Error::Invalid(format!("malformed GGUF metadata: {m}"))
}

struct Reader<'a, R: Read> {
    r: &'a mut R,
    /// Lengths and counts are `u64` (v2, v3), not `u32` (v1).
    wide: bool,
    /// Arrays open around the value being read.
    depth: u32,
}

/// Elements reserved ahead of reading them (more grow as they arrive).
const RESERVE_MAX: usize = 4_096;

impl<R: Read> Reader<'_, R> {
    fn exact(&mut self, buf: &mut [u8]) -> Result<()> {
        self.r.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => malformed("the file ends inside the metadata".into()),
            _ => Error::Io {
                path: "<gguf>".into(),
                source: e,
            },
        })
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.exact(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A length or count: `u64`, or `u32` in v1.
    fn len(&mut self) -> Result<u64> {
        if self.wide {
            self.u64()
        } else {
            Ok(u64::from(self.u32()?))
        }
    }

    fn string(&mut self) -> Result<String> {
        let len = self.len()?;
        if len > limits::STRING_BYTES_MAX {
            return Err(malformed(format!(
                "a string of {len} bytes (at most {})",
                limits::STRING_BYTES_MAX
            )));
        }
        let mut buf = Vec::with_capacity((len as usize).min(RESERVE_MAX));
        let got = (&mut *self.r).take(len).read_to_end(&mut buf).map_err(|e| Error::Io {
            path: "<gguf>".into(),
            source: e,
        })?;
        if got as u64 != len {
            return Err(malformed("the file ends inside the metadata".into()));
        }
        while buf.last() == Some(&0) {
            buf.pop();
        }
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }

    fn value(&mut self, ty: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(u8::from_le_bytes(self.array()?)),
            1 => MetaValue::I8(i8::from_le_bytes(self.array()?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => MetaValue::Bool(u8::from_le_bytes(self.array()?) != 0),
            8 => MetaValue::String(self.string()?),
            9 => {
                let elem = self.u32()?;
                let n = self.len()?;
                if self.depth >= limits::NESTING_MAX {
                    return Err(malformed(format!("arrays nested deeper than {}", limits::NESTING_MAX)));
                }
                if n > limits::ARRAY_LEN_MAX {
                    return Err(malformed(format!(
                        "an array of {n} elements (at most {})",
                        limits::ARRAY_LEN_MAX
                    )));
                }
                let mut out = Vec::with_capacity((n as usize).min(RESERVE_MAX));
                self.depth += 1;
                for _ in 0..n {
                    out.push(self.value(elem)?);
                }
                self.depth -= 1;
                MetaValue::Array(out)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            t => return Err(malformed(format!("unknown value type {t}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(out: &mut Vec<u8>, s: &str) {
        out.extend((s.len() as u64).to_le_bytes());
        out.extend(s.as_bytes());
    }

    fn header(pairs: u64) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend(0u64.to_le_bytes());
        out.extend(pairs.to_le_bytes());
        out
    }

    #[test]
    fn reads_scalars_strings_and_arrays() {
        let mut f = header(3);
        string(&mut f, "a.u32");
        f.extend(4u32.to_le_bytes());
        f.extend(7u32.to_le_bytes());
        string(&mut f, "a.name");
        f.extend(8u32.to_le_bytes());
        string(&mut f, "héllo");
        string(&mut f, "a.list");
        f.extend(9u32.to_le_bytes());
        f.extend(8u32.to_le_bytes());
        f.extend(2u64.to_le_bytes());
        string(&mut f, "x");
        string(&mut f, "y z");
        let md = GgufMetadata::read(&mut f.as_slice()).unwrap();
        assert_eq!(md.get("a.u32").and_then(MetaValue::to_u32), Some(7));
        assert_eq!(md.get("a.name").and_then(MetaValue::as_str), Some("héllo"));
        let list: Vec<_> = md
            .get("a.list")
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v.as_str())
            .collect();
        assert_eq!(list, ["x", "y z"]);
    }

    #[test]
    fn strips_trailing_nuls_reads_nested_arrays_and_v1() {
        let mut f = header(2);
        string(&mut f, "s");
        f.extend(8u32.to_le_bytes());
        string(&mut f, "ab\0\0");
        string(&mut f, "nested");
        f.extend(9u32.to_le_bytes());
        f.extend(9u32.to_le_bytes());
        f.extend(1u64.to_le_bytes());
        f.extend(4u32.to_le_bytes());
        f.extend(1u64.to_le_bytes());
        f.extend(5u32.to_le_bytes());
        let md = GgufMetadata::read(&mut f.as_slice()).unwrap();
        assert_eq!(md.get("s").and_then(MetaValue::as_str), Some("ab"));
        let inner = md.get("nested").unwrap().as_array().unwrap()[0].as_array().unwrap();
        assert_eq!(inner[0].to_u32(), Some(5));
        // v1: u32 counts and lengths.
        let mut v1 = MAGIC.to_vec();
        v1.extend(1u32.to_le_bytes());
        v1.extend(0u32.to_le_bytes());
        v1.extend(1u32.to_le_bytes());
        v1.extend(1u32.to_le_bytes());
        v1.push(b'k');
        v1.extend(5u32.to_le_bytes());
        v1.extend((-3i32).to_le_bytes());
        let md = GgufMetadata::read(&mut v1.as_slice()).unwrap();
        assert_eq!(md.get("k").and_then(MetaValue::to_i32), Some(-3));
        assert_eq!(md.get("k").and_then(MetaValue::to_u32), None, "only a U32 reads as u32");
    }

    #[test]
    fn refuses_bad_magic_truncation_and_huge_lengths() {
        let e = GgufMetadata::read(&mut &b"GGML\x03\0\0\0"[..]).unwrap_err().to_string();
        assert!(e.contains("not a GGUF file"), "{e}");
        let mut f = header(1);
        string(&mut f, "k");
        f.extend(8u32.to_le_bytes());
        f.extend(u64::MAX.to_le_bytes());
        let e = GgufMetadata::read(&mut f.as_slice()).unwrap_err().to_string();
        assert!(e.contains("a string of"), "{e}");
        let f = header(2);
        let e = GgufMetadata::read(&mut f.as_slice()).unwrap_err().to_string();
        assert!(e.contains("ends inside"), "{e}");
        let mut f = header(1);
        string(&mut f, "k");
        f.extend(42u32.to_le_bytes());
        let e = GgufMetadata::read(&mut f.as_slice()).unwrap_err().to_string();
        assert!(e.contains("unknown value type 42"), "{e}");
    }
}
