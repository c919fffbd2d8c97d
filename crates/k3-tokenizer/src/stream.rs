//! Incremental detokenisation that never emits broken UTF-8 (spec §6.3, issue 6).
//!
//! A token may end in the middle of a multi-byte character. [`Utf8Stream`] holds back an
//! incomplete trailing sequence until the bytes that complete it arrive, emits U+FFFD as soon as a
//! sequence is known to be invalid (one per maximal invalid subpart, like Python's incremental
//! decoder with `errors="replace"` and Rust's `from_utf8_lossy`), and turns a still-incomplete
//! tail into one U+FFFD on [`Utf8Stream::finish`]. [`StreamDecoder`] feeds it token ids.

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;

/// An incremental UTF-8 decoder over arbitrary byte chunks.
#[derive(Debug, Default, Clone)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// A decoder with nothing pending.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `bytes` and returns the text that is now certain.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix is valid UTF-8 by construction.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..start + valid]));
                    start += valid;
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += bad;
                        }
                        None => break, // incomplete tail: wait for more bytes
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Whether an incomplete sequence is being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Ends the stream: a held-back incomplete sequence becomes U+FFFD.
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }
}

/// Detokenises one id at a time.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    utf8: Utf8Stream,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder; `skip_special` drops ids as [`Tokenizer::decode`] does.
    pub fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder { tokenizer, skip_special, utf8: Utf8Stream::new() }
    }

    /// Adds one id and returns the text it completes (possibly empty).
    /// An unknown id is an error and leaves the decoder unchanged.
    pub fn push(&mut self, id: u32) -> Result<String> {
        let bytes = self.tokenizer.token_bytes(id).ok_or(Error::UnknownId { id, vocab_size: self.tokenizer.vocab_size() })?;
        if self.skip_special && self.tokenizer.skips_on_decode(id) {
            return Ok(String::new());
        }
        Ok(self.utf8.push(bytes))
    }

    /// Flushes a held-back incomplete sequence (as U+FFFD) at the end of the stream.
    pub fn finish(&mut self) -> String {
        self.utf8.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_then_completes() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&[0xe4]), "");
        assert_eq!(s.push(&[0xbd]), "");
        assert_eq!(s.push(&[0xa0, b'x']), "你x");
        assert_eq!(s.finish(), "");
    }

    #[test]
    fn invalid_bytes_are_replaced_immediately() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&[0xc0]), "\u{FFFD}");
        assert_eq!(s.push(&[0x80]), "\u{FFFD}");
        assert_eq!(s.push(&[0xe4, 0xbd, b'A']), "\u{FFFD}A");
        assert_eq!(s.push(&[0xf0, 0x9f]), "");
        assert_eq!(s.finish(), "\u{FFFD}");
    }
}
