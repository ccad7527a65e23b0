//! A reader for the metadata block of a GGUF file (the key/value pairs before the tensor infos),
//! without candle: what the text layer needs (the tokenizer's vocabulary, merges, special ids and
//! chat template) so that a gateway can read a model's tokenizer without linking any model code.
//!
//! Format (GGUF v2 and v3, little-endian): magic `GGUF`, `u32` version, `u64` tensor count, `u64`
//! metadata count, then that many `(string key, u32 type, value)`. Strings are a `u64` length and
//! UTF-8 bytes; arrays are a `u32` element type, a `u64` count and the elements. Every length is
//! checked against [`limits`] before anything is allocated, so a corrupt or hostile file gives an
//! error, not an allocation of its claimed size.

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
    /// The value as an integer, for any integer type.
    fn integer(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as a `u32`, for any integer type whose value fits.
    pub fn to_u32(&self) -> Option<u32> {
        self.integer().and_then(|v| u32::try_from(v).ok())
    }

    /// The value as an `i32`, for any integer type whose value fits.
    pub fn to_i32(&self) -> Option<i32> {
        self.integer().and_then(|v| i32::try_from(v).ok())
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
        let mut rd = Reader { r };
        let mut magic = [0u8; 4];
        rd.exact(&mut magic)?;
        if &magic != MAGIC {
            return Err(malformed(format!("not a GGUF file (magic {magic:02x?})")));
        }
        let version = rd.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::Unsupported(format!("GGUF version {version} (2 and 3 are read)")));
        }
        let _tensor_count = rd.u64()?;
        let pairs = rd.u64()?;
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
}

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

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > limits::STRING_BYTES_MAX {
            return Err(malformed(format!(
                "a string of {len} bytes (at most {})",
                limits::STRING_BYTES_MAX
            )));
        }
        let mut buf = vec![0u8; len as usize];
        self.exact(&mut buf)?;
        String::from_utf8(buf).map_err(|_| malformed("a string is not UTF-8".into()))
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
                if elem == 9 {
                    return Err(malformed("nested arrays".into()));
                }
                let n = self.u64()?;
                if n > limits::ARRAY_LEN_MAX {
                    return Err(malformed(format!(
                        "an array of {n} elements (at most {})",
                        limits::ARRAY_LEN_MAX
                    )));
                }
                let mut out = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    out.push(self.value(elem)?);
                }
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
