//! Pre-tokenisation: the Kimi long-input pre-split and the `pat_str` regex (spec §6.1, §6.2).
//!
//! Before BPE, text is cut in two stages, exactly as `tokenization_kimi.py` does:
//! 1. [`presplit`]: chunks of at most 400,000 characters, and inside each chunk every run of more
//!    than 25,000 consecutive whitespace (or non-whitespace) characters is cut, with Python's
//!    `str.isspace()` as the whitespace test. Each resulting piece is encoded on its own.
//! 2. [`Pretokenizer`]: the Kimi `pat_str` splits a piece into words; each word is then BPE-merged.
//!
//! `pat_str` needs a look-ahead (`\s+(?!\S)`), which the linear-time `regex` crate lacks. The
//! production matcher runs the pattern without that alternative and corrects its match afterwards:
//! a whitespace-only match without `\r`/`\n`, at least two characters long and followed by a
//! non-whitespace character, gives back its last character (which is exactly what `\s+(?!\S)`
//! would have matched instead of the trailing `\s+`). [`ReferencePretokenizer`] runs the verbatim
//! pattern through `fancy-regex` (the engine tiktoken uses); the test suite checks that the two agree.

use crate::error::{Error, Result};
use std::path::PathBuf;

/// The Kimi pre-tokenisation pattern, verbatim from spec §6.2 (alternatives joined with `|`).
pub const KIMI_PAT_STR: &str = concat!(
    r"[\p{Han}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}",
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"|\s*[\r\n]+",
    r"|\s+(?!\S)",
    r"|\s+",
);

/// Texts are cut into chunks of this many characters before anything else.
pub const MAX_CHUNK_CHARS: usize = 400_000;
/// Runs of more than this many whitespace (or non-whitespace) characters are cut.
pub const MAX_RUN_CHARS: usize = 25_000;

/// Python's `str.isspace()`: Rust's `char::is_whitespace` plus U+001C..U+001F.
pub fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Splits `text` into the pieces `tokenization_kimi.py` encodes separately (see module docs).
///
/// The empty text gives one empty piece. Concatenating the pieces gives back `text`.
pub fn presplit(text: &str) -> Vec<&str> {
    let mut pieces = Vec::new();
    // Fast path: nothing to cut when the text is shorter than one run limit.
    if text.len() <= MAX_RUN_CHARS {
        pieces.push(text);
        return pieces;
    }
    let mut slice_start = 0; // byte offset of the current piece
    let mut chunk_chars = 0; // characters seen in the current 400k chunk
    let mut run_len = 0; // length of the current run, in characters
    let mut run_is_space = false;
    for (pos, c) in text.char_indices() {
        if chunk_chars == MAX_CHUNK_CHARS {
            pieces.push(&text[slice_start..pos]);
            slice_start = pos;
            chunk_chars = 0;
        }
        let is_space = py_isspace(c);
        if chunk_chars == 0 || is_space != run_is_space {
            run_is_space = is_space;
            run_len = 1;
        } else {
            run_len += 1;
            if run_len > MAX_RUN_CHARS {
                pieces.push(&text[slice_start..pos]);
                slice_start = pos;
                run_len = 1;
            }
        }
        chunk_chars += 1;
    }
    pieces.push(&text[slice_start..]);
    pieces
}

fn regex_error(e: impl std::fmt::Display) -> Error {
    Error::BadVocab { path: PathBuf::from("<pat_str>"), reason: format!("cannot compile the pre-tokenisation regex: {e}") }
}

/// The production pre-tokenizer: `pat_str` on the linear-time `regex` engine (see module docs).
#[derive(Debug, Clone)]
pub struct Pretokenizer {
    re: regex::Regex,
}

impl Pretokenizer {
    /// Compiles the Kimi pattern.
    pub fn new() -> Result<Self> {
        let without_lookahead = KIMI_PAT_STR.replace(r"|\s+(?!\S)", "");
        let re = regex::Regex::new(&without_lookahead).map_err(regex_error)?;
        Ok(Pretokenizer { re })
    }

    /// Calls `f` with each pre-token of `text`, in order.
    pub fn for_each<'t>(&self, text: &'t str, mut f: impl FnMut(&'t str)) {
        let mut pos = 0;
        while pos < text.len() {
            let Some(m) = self.re.find_at(text, pos) else {
                break;
            };
            let mut end = m.end();
            if end < text.len() {
                end = lookahead_fixup(text, m.start(), end);
            }
            f(&text[m.start()..end]);
            pos = end;
        }
    }

    /// The pre-tokens of `text`.
    pub fn split<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut out = Vec::new();
        self.for_each(text, |p| out.push(p));
        out
    }
}

/// Emulates the `\s+(?!\S)` alternative for a match `start..end` that is followed by text.
fn lookahead_fixup(text: &str, start: usize, end: usize) -> usize {
    let Some(next) = text[end..].chars().next() else {
        return end;
    };
    if next.is_whitespace() {
        return end;
    }
    let m = &text[start..end];
    let mut chars = m.char_indices().rev();
    let Some((last_pos, last)) = chars.next() else {
        return end;
    };
    if !last.is_whitespace() || last_pos == 0 {
        return end;
    }
    if m.chars().all(|c| c.is_whitespace() && c != '\r' && c != '\n') {
        start + last_pos
    } else {
        end
    }
}

/// The verbatim pattern on `fancy-regex`; slower, used to cross-check [`Pretokenizer`].
#[derive(Debug, Clone)]
pub struct ReferencePretokenizer {
    re: fancy_regex::Regex,
}

impl ReferencePretokenizer {
    /// Compiles the verbatim Kimi pattern.
    pub fn new() -> Result<Self> {
        let re = fancy_regex::Regex::new(KIMI_PAT_STR).map_err(regex_error)?;
        Ok(ReferencePretokenizer { re })
    }

    /// The pre-tokens of `text`. A match error (backtrack limit) ends the split early with an
    /// error instead of silently dropping text.
    pub fn split<'t>(&self, text: &'t str) -> Result<Vec<&'t str>> {
        let mut out = Vec::new();
        for m in self.re.find_iter(text) {
            out.push(m.map_err(regex_error)?.as_str());
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn isspace_matches_python_on_file_separators() {
        for c in ['\u{1c}', '\u{1d}', '\u{1e}', '\u{1f}', ' ', '\u{3000}', '\u{85}'] {
            assert!(py_isspace(c), "{:?}", c);
        }
        assert!(!py_isspace('\u{200b}'));
        assert!(!py_isspace('a'));
    }

    #[test]
    fn presplit_cuts_long_runs_only() {
        let text = format!("{}x{}", " ".repeat(30_000), "y".repeat(26_000));
        let pieces = presplit(&text);
        let lens: Vec<usize> = pieces.iter().map(|p| p.chars().count()).collect();
        assert_eq!(lens, vec![25_000, 5_000 + 25_000, 1_001]);
        assert_eq!(pieces.concat(), text);
        assert_eq!(presplit("short"), vec!["short"]);
        assert_eq!(presplit(""), vec![""]);
    }

    #[test]
    fn presplit_counts_characters_not_bytes() {
        // 20,000 three-byte characters: 60 KB but only 20,000 characters, so no cut.
        let text = "中".repeat(20_000);
        assert_eq!(presplit(&text).len(), 1);
    }

    #[test]
    fn fast_matches_reference_on_tricky_whitespace() {
        let fast = Pretokenizer::new().unwrap();
        let slow = ReferencePretokenizer::new().unwrap();
        for text in ["a  b   c\t\td\n\n e \r\n  \n f", "   x", "x   ", " \u{3000}y", "\t \n", "a \u{a0}b"] {
            assert_eq!(fast.split(text), slow.split(text).unwrap(), "{text:?}");
        }
    }
}
