//! The Kimi K3 tokenizer: `tiktoken.model` + `tokenizer_config.json` (spec §6.1–§6.3).
//!
//! `tiktoken.model` has one `base64(token_bytes) rank` line per token, and the rank is the id.
//! After the `n` ranks come 256 special ids `n..n+256`: each is named by
//! `tokenizer_config.json` → `added_tokens_decoder`, or else `<|reserved_token_{id}|>`.
//! Encoding pre-splits long inputs ([`crate::pretok::presplit`]), pre-tokenises with the Kimi
//! `pat_str`, and rank-BPE-merges each word ([`crate::bpe`]). With `allow_special`, every special
//! name in the text (including reserved names) becomes its id; without it, special names are
//! plain text. Decoding joins token bytes (special ids decode to their names) and replaces
//! invalid UTF-8 as Python's `errors="replace"` does. `skip_special` drops the ids whose
//! `added_tokens_decoder` entry says `"special": true`, so `<|close|>`, `<|sep|>` and the
//! unnamed reserved ids are kept.

use crate::bpe::{Bpe, FxHashMap};
use crate::error::{Error, Result};
use crate::pretok::{presplit, Pretokenizer};
use base64::Engine as _;
use std::path::{Path, PathBuf};

/// How many special ids follow the ranks (`num_reserved_special_tokens`).
pub const NUM_SPECIAL_TOKENS: usize = 256;

/// One of the 256 special ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpecialToken {
    /// The id (`n_ranks + offset`).
    pub id: u32,
    /// The name, which is also its decoded text.
    pub name: String,
    /// `added_tokens_decoder[id].special`; `false` for unnamed reserved ids.
    pub skip_on_decode: bool,
}

/// A loaded tokenizer. Cheap to share by reference; all methods take `&self`.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    bpe: Bpe,
    pretok: Pretokenizer,
    /// id → token bytes, for ranks and specials alike.
    token_bytes: Vec<Box<[u8]>>,
    n_ranks: usize,
    specials: Vec<SpecialToken>,
    special_by_name: FxHashMap<Vec<u8>, u32>,
    /// Distinct byte lengths of the special names, ascending.
    special_lens: Vec<usize>,
    /// Which bytes can start a special name.
    special_first: [bool; 256],
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

impl Tokenizer {
    /// Loads `dir/tiktoken.model` and `dir/tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        Tokenizer::from_files(&dir.join("tiktoken.model"), &dir.join("tokenizer_config.json"))
    }

    /// Loads from explicit file paths.
    pub fn from_files(model: &Path, config: &Path) -> Result<Tokenizer> {
        let model_text = read(model)?;
        let config_text = read(config)?;
        let names = parse_added_tokens(&config_text, config)?;
        Tokenizer::from_parts(&model_text, model, &names)
    }

    /// Builds from the text of `tiktoken.model` (`model_path` is only used in messages) and
    /// the `added_tokens_decoder` entries as `(id, name, special)`.
    pub fn from_parts(model_text: &str, model_path: &Path, added: &[(u32, String, bool)]) -> Result<Tokenizer> {
        let (bpe, mut token_bytes) = parse_model(model_text, model_path)?;
        let n_ranks = token_bytes.len();
        let mut specials = Vec::with_capacity(NUM_SPECIAL_TOKENS);
        for offset in 0..NUM_SPECIAL_TOKENS {
            let id = (n_ranks + offset) as u32;
            let (name, skip) = match added.iter().find(|(i, _, _)| *i == id) {
                Some((_, name, special)) => (name.clone(), *special),
                None => (format!("<|reserved_token_{id}|>"), false),
            };
            specials.push(SpecialToken { id, name, skip_on_decode: skip });
        }
        let mut special_by_name: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
        let mut special_first = [false; 256];
        let mut special_lens = Vec::new();
        for s in &specials {
            let bytes = s.name.as_bytes();
            if bytes.is_empty() {
                return Err(Error::BadConfig { path: PathBuf::from("tokenizer_config.json"), reason: format!("special token {} has an empty name", s.id) });
            }
            special_by_name.insert(bytes.to_vec(), s.id);
            special_first[bytes[0] as usize] = true;
            if !special_lens.contains(&bytes.len()) {
                special_lens.push(bytes.len());
            }
            token_bytes.push(bytes.to_vec().into_boxed_slice());
        }
        special_lens.sort_unstable();
        Ok(Tokenizer { bpe, pretok: Pretokenizer::new()?, token_bytes, n_ranks, specials, special_by_name, special_lens, special_first })
    }

    /// Number of ids: ranks plus the 256 special ids.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Number of BPE ranks (= the first special id).
    pub fn n_ranks(&self) -> usize {
        self.n_ranks
    }

    /// The id of a special token by name, e.g. `special_id("<|end_of_msg|>")`.
    pub fn special_id(&self, name: &str) -> Option<u32> {
        self.special_by_name.get(name.as_bytes()).copied()
    }

    /// The special-token table, in id order.
    pub fn specials(&self) -> &[SpecialToken] {
        &self.specials
    }

    /// Whether `id` is one of the 256 special ids.
    pub fn is_special(&self, id: u32) -> bool {
        (id as usize) >= self.n_ranks && (id as usize) < self.token_bytes.len()
    }

    /// Whether `decode(.., skip_special = true)` drops `id`.
    pub fn skips_on_decode(&self, id: u32) -> bool {
        self.is_special(id) && self.specials[id as usize - self.n_ranks].skip_on_decode
    }

    /// The bytes of one token (a special id gives its name), or `None` for an unknown id.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(|b| &b[..])
    }

    /// Encodes `text`. With `allow_special`, special-token names in the text become their ids;
    /// otherwise they are BPE-encoded as plain text. No BOS/EOS is added.
    pub fn encode(&self, text: &str, allow_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_into(text, allow_special, &mut out);
        out
    }

    /// Like [`Tokenizer::encode`], appending to `out`.
    pub fn encode_into(&self, text: &str, allow_special: bool, out: &mut Vec<u32>) {
        for piece in presplit(text) {
            if allow_special {
                self.encode_with_specials(piece, out);
            } else {
                self.encode_ordinary(piece, out);
            }
        }
    }

    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        self.pretok.for_each(text, |word| self.bpe.encode_word(word.as_bytes(), out));
    }

    fn encode_with_specials(&self, text: &str, out: &mut Vec<u32>) {
        let bytes = text.as_bytes();
        let mut plain_start = 0;
        let mut pos = 0;
        while pos < bytes.len() {
            if self.special_first[bytes[pos] as usize] {
                if let Some((id, len)) = self.special_at(&bytes[pos..]) {
                    // Both ends are char boundaries: a special name is valid UTF-8 that starts
                    // at a lead byte.
                    self.encode_ordinary(&text[plain_start..pos], out);
                    out.push(id);
                    pos += len;
                    plain_start = pos;
                    continue;
                }
            }
            pos += 1;
        }
        self.encode_ordinary(&text[plain_start..], out);
    }

    /// The longest special name that `rest` starts with.
    fn special_at(&self, rest: &[u8]) -> Option<(u32, usize)> {
        self.special_lens.iter().rev().filter(|&&len| len <= rest.len()).find_map(|&len| self.special_by_name.get(&rest[..len]).map(|&id| (id, len)))
    }

    /// The concatenated bytes of `ids`. Errors on an id outside the vocabulary.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            let bytes = self.token_bytes(id).ok_or(Error::UnknownId { id, vocab_size: self.vocab_size() })?;
            if !(skip_special && self.skips_on_decode(id)) {
                out.extend_from_slice(bytes);
            }
        }
        Ok(out)
    }

    /// Decodes `ids` to text; invalid UTF-8 becomes U+FFFD per maximal invalid subpart.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

/// Parses `tiktoken.model`: returns the BPE table and the id → bytes list for the ranks.
fn parse_model(text: &str, path: &Path) -> Result<(Bpe, Vec<Box<[u8]>>)> {
    let bad = |line: usize, reason: String| Error::BadModelLine { path: path.to_path_buf(), line, reason };
    let mut ranks: FxHashMap<Vec<u8>, u32> = FxHashMap::default();
    let mut by_rank: Vec<Option<Box<[u8]>>> = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line_no = n + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let (Some(b64), Some(rank_text), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(bad(line_no, format!("expected `base64_token rank`, got {line:?}")));
        };
        let token = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|e| bad(line_no, format!("invalid base64 {b64:?}: {e}")))?;
        let rank: u32 = rank_text.parse().map_err(|_| bad(line_no, format!("invalid rank {rank_text:?}")))?;
        if token.is_empty() {
            return Err(bad(line_no, "empty token".into()));
        }
        if let Some(prev) = ranks.insert(token.clone(), rank) {
            return Err(bad(line_no, format!("token {b64:?} already has rank {prev}")));
        }
        let idx = rank as usize;
        if idx >= by_rank.len() {
            by_rank.resize(idx + 1, None);
        }
        if by_rank[idx].is_some() {
            return Err(bad(line_no, format!("rank {rank} is given twice")));
        }
        by_rank[idx] = Some(token.into_boxed_slice());
    }
    let vocab_err = |reason: String| Error::BadVocab { path: path.to_path_buf(), reason };
    let mut token_bytes = Vec::with_capacity(by_rank.len() + NUM_SPECIAL_TOKENS);
    for (rank, t) in by_rank.into_iter().enumerate() {
        token_bytes.push(t.ok_or_else(|| vocab_err(format!("rank {rank} is missing (ranks must be 0..n, the ids)")))?);
    }
    if token_bytes.is_empty() {
        return Err(vocab_err("no tokens".into()));
    }
    let mut byte_rank = [0u32; 256];
    for b in 0..=255u8 {
        byte_rank[b as usize] = *ranks.get(&[b][..]).ok_or_else(|| vocab_err(format!("no single-byte token for byte 0x{b:02x}")))?;
    }
    Ok((Bpe::new(ranks, byte_rank), token_bytes))
}

/// Reads `added_tokens_decoder` as `(id, content, special)`.
fn parse_added_tokens(text: &str, path: &Path) -> Result<Vec<(u32, String, bool)>> {
    let bad = |reason: String| Error::BadConfig { path: PathBuf::from(path), reason };
    let config: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    let Some(decoder) = config.get("added_tokens_decoder") else {
        return Ok(Vec::new());
    };
    let decoder = decoder.as_object().ok_or_else(|| bad("`added_tokens_decoder` is not an object".into()))?;
    let mut out = Vec::with_capacity(decoder.len());
    for (key, entry) in decoder {
        let id: u32 = key.parse().map_err(|_| bad(format!("`added_tokens_decoder` key {key:?} is not an id")))?;
        let content =
            entry.get("content").and_then(|c| c.as_str()).ok_or_else(|| bad(format!("`added_tokens_decoder.{key}.content` is missing or not a string")))?;
        let special = entry.get("special").and_then(|s| s.as_bool()).unwrap_or(false);
        out.push((id, content.to_owned(), special));
    }
    Ok(out)
}
