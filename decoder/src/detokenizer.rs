//! [`IncrementalDetokenizer`]: committed token ids to valid UTF-8 text deltas, holding back the
//! bytes of a character split across tokens. Part of the text layer (no candle).

use std::sync::Arc;

/// Turns token ids, one at a time, into UTF-8 text deltas.
///
/// Bytes of a character that is split across tokens are held back until the character is
/// complete; a byte sequence that can never become valid UTF-8 is emitted as U+FFFD. At most 3
/// bytes are ever pending. Rebuilding from a committed prefix is feeding the prefix again.
#[derive(Clone, Debug)]
pub struct IncrementalDetokenizer {
    token_bytes: Arc<[Box<[u8]>]>,
    special: Arc<[bool]>,
    skip_special: bool,
    /// Bytes of an incomplete character at the end of the text so far.
    pending: Vec<u8>,
}

impl IncrementalDetokenizer {
    pub(crate) fn new(token_bytes: Arc<[Box<[u8]>]>, special: Arc<[bool]>, skip_special: bool) -> Self {
        IncrementalDetokenizer {
            token_bytes,
            special,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one token; returns the text that became complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let idx = id as usize;
        let Some(bytes) = self.token_bytes.get(idx) else {
            return self.flush_with('\u{FFFD}');
        };
        if self.skip_special && self.special[idx] {
            return String::new();
        }
        self.pending.extend_from_slice(bytes);
        self.drain_complete()
    }

    /// Bytes held back because their character is not complete yet.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: pending bytes (an incomplete character) become U+FFFD.
    pub fn finish(&mut self) -> String {
        if self.pending.is_empty() {
            String::new()
        } else {
            self.pending.clear();
            "\u{FFFD}".to_string()
        }
    }

    fn flush_with(&mut self, c: char) -> String {
        let mut out = self.finish();
        out.push(c);
        out
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let (valid, tail) = rest.split_at(e.valid_up_to());
                    out.push_str(std::str::from_utf8(valid).expect("checked valid prefix"));
                    match e.error_len() {
                        // Incomplete character at the end: keep it for the next token.
                        None => {
                            rest = tail;
                            break;
                        }
                        Some(n) => {
                            out.push('\u{FFFD}');
                            rest = &tail[n..];
                        }
                    }
                }
            }
        }
        assert!(rest.len() < 4, "at most 3 bytes of a character are pending");
        self.pending = rest.to_vec();
        out
    }
}
