//! Grammar-constrained decoding (docs/structured-outputs.md). A [`GrammarEnv`] is built once per
//! tokenizer: llguidance's token trie over every id's bytes (special ids as `\xFF` + their name, so
//! a grammar names them `<|open|>`; ids past the tokenizer, padding the model's vocabulary, are
//! empty and never allowed) and its parser factory. [`GrammarEnv::compile`] turns a
//! [`GrammarSpec`] (JSON Schema, regex, choice, Lark, or a Lark grammar with named sub-grammars)
//! into a [`Constraint`], the per-request matcher, or an error message for the client.
//!
//! The engine drives a constraint through [`Guide`]: the allowed-token mask of the next token is
//! computed on a [`MaskPool`] worker while the forward pass runs (the mask depends only on the
//! tokens already committed, the logits only on the forward), so sampling waits for it only
//! when it takes longer than the forward. The mask is applied to the logits before the sampler's
//! penalties and filters ([`crate::sampler::Sampler::sample_masked`]): greedy takes the
//! highest-logit allowed token. The grammar's end of sentence stands for the request's stop
//! tokens: they are allowed exactly when the grammar is accepting. After each sampled token is
//! committed, a grammar that can take nothing more (accepting and complete) ends the sequence.
//! Per-sequence counters ([`GuideStats`]) give the mask cost: compute time and the time the
//! sampler actually waited.

use std::collections::HashMap;
use std::sync::mpsc::{channel, sync_channel, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k3_tokenizer::Tokenizer;
use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
pub use llguidance::regex_to_lark;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use crate::error::{EngineError, Result};

/// What a request's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON Schema (the subset llguidance compiles: docs/structured-outputs.md). Its top-level
    /// `x-guidance` object sets the whitespace; [`GrammarSpec::json`] makes it compact.
    JsonSchema(Value),
    /// A regular expression (Rust `regex` syntax) the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// An llguidance Lark grammar (`start:` rule; special tokens as `<|name|>`; `%json {…}`).
    Lark(String),
    /// A Lark grammar that references the named sub-grammars as `@name`.
    Composite { lark: String, subs: Vec<(String, GrammarSpec)> },
}

impl GrammarSpec {
    /// A JSON Schema with compact output (`,` and `:` separators, no other whitespace) unless the
    /// schema sets its own `x-guidance`: free whitespace lets a sampled model wander off in
    /// newlines and never close the value.
    pub fn json(schema: Value) -> GrammarSpec {
        GrammarSpec::JsonSchema(with_whitespace(schema, ",", ":"))
    }

    fn to_llg(&self, name: Option<&str>) -> Vec<GrammarWithLexer> {
        let mut g = match self {
            GrammarSpec::JsonSchema(v) => vec![GrammarWithLexer::from_json_schema(v.clone())],
            GrammarSpec::Regex(r) => vec![GrammarWithLexer::from_regex(r)],
            GrammarSpec::Choice(c) => vec![GrammarWithLexer::from_lark(format!("start: {}", choice_rule(c)))],
            GrammarSpec::Lark(l) => vec![GrammarWithLexer::from_lark(l.clone())],
            GrammarSpec::Composite { lark, subs } => {
                let mut v = vec![GrammarWithLexer::from_lark(lark.clone())];
                for (n, s) in subs {
                    v.extend(s.to_llg(Some(n)));
                }
                v
            }
        };
        if let Some(n) = name {
            g[0].name = Some(n.to_owned());
        }
        g
    }
}

/// `schema` with `x-guidance` separators (and no other whitespace) unless it has its own.
pub fn with_whitespace(mut schema: Value, item: &str, key: &str) -> Value {
    if let Value::Object(o) = &mut schema {
        o.entry("x-guidance").or_insert_with(|| serde_json::json!({"item_separator": item, "key_separator": key, "whitespace_flexible": false}));
    }
    schema
}

/// A Lark string literal (JSON string syntax; DEL written as an escape, which the Lark lexer wants).
pub fn lark_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default().replace('\u{7f}', "\\u007f")
}

/// `"a" | "b" | …` (an empty choice list can match nothing: callers refuse it first).
pub fn choice_rule(choices: &[String]) -> String {
    choices.iter().map(|c| lark_str(c)).collect::<Vec<_>>().join(" | ")
}

/// Our tokenizer as llguidance sees it.
struct TokEnvK3 {
    trie: TokTrie,
    tok: Arc<Tokenizer>,
}

impl TokenizerEnv for TokEnvK3 {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    /// Plain text, canonically (our BPE; special names stay text); bytes that are not UTF-8 fall
    /// back to the trie's greedy split.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(t) => self.tok.encode(t, false),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiled grammars kept for reuse (requests repeat their tools and schemas).
const CACHE_ENTRIES: usize = 256;

/// The token trie and parser factory of one tokenizer and vocabulary.
pub struct GrammarEnv {
    factory: ParserFactory,
    eos: u32,
    vocab: usize,
    /// Compile results by grammar (a full cache is emptied, not evicted one by one).
    cache: Mutex<HashMap<String, std::result::Result<Constraint, String>>>,
}

impl std::fmt::Debug for GrammarEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarEnv").field("vocab", &self.vocab).field("eos", &self.eos).finish()
    }
}

impl GrammarEnv {
    /// The environment for a model of `vocab_size` ids (≥ the tokenizer's) whose end of sentence
    /// is `eos` (it stands for every stop token in masks).
    pub fn new(tok: Arc<Tokenizer>, vocab_size: usize, eos: u32) -> Result<GrammarEnv> {
        let n = tok.vocab_size();
        if vocab_size < n || (eos as usize) >= vocab_size {
            return Err(EngineError::Internal(format!("grammar: vocabulary {vocab_size} smaller than the tokenizer's {n}, or eos {eos} outside it")));
        }
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tok.token_bytes(id) {
                Some(b) if tok.is_special(id) => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], b].concat(),
                Some(b) => b.to_vec(),
                None => Vec::new(),
            })
            .collect();
        let trie = TokTrie::from(&TokRxInfo::new(vocab_size as u32, eos), &words);
        let env: TokEnv = Arc::new(TokEnvK3 { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| EngineError::Internal(format!("grammar: {e}")))?;
        factory.quiet();
        Ok(GrammarEnv { factory, eos, vocab: vocab_size, cache: Mutex::new(HashMap::new()) })
    }

    /// The vocabulary the masks cover.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Compiles a constraint (or takes it from the cache of recent grammars); the error is the
    /// grammar compiler's message.
    pub fn compile(&self, spec: &GrammarSpec) -> std::result::Result<Constraint, String> {
        let key = format!("{spec:?}");
        if let Some(hit) = self.cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
            return hit;
        }
        let r = self.compile_uncached(spec);
        if let Ok(mut c) = self.cache.lock() {
            if c.len() >= CACHE_ENTRIES {
                c.clear();
            }
            c.insert(key, r.clone());
        }
        r
    }

    fn compile_uncached(&self, spec: &GrammarSpec) -> std::result::Result<Constraint, String> {
        if let GrammarSpec::Choice(c) = spec {
            if c.is_empty() {
                return Err("the list of choices is empty".into());
            }
        }
        let top = TopLevelGrammar { grammars: spec.to_llg(None), max_tokens: None };
        let t = Instant::now();
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Constraint { matcher, eos: self.eos, vocab: self.vocab, compile_time: t.elapsed() })
    }
}

/// A compiled constraint for one request, at its start.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    eos: u32,
    vocab: usize,
    /// How long [`GrammarEnv::compile`] took.
    pub compile_time: Duration,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("compile_time", &self.compile_time).finish_non_exhaustive()
    }
}

impl Constraint {
    /// A copy at the same start with a matcher of its own (its own lexer cache), for another
    /// sequence of the same request (`n` choices) — a plain clone shares one.
    pub fn fork(&self) -> Constraint {
        Constraint { matcher: self.matcher.deep_clone(), eos: self.eos, vocab: self.vocab, compile_time: self.compile_time }
    }

    /// The vocabulary it was compiled for.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// The ids the grammar allows after `tokens` (bit `t % 32` of word `t / 32`; its end of
    /// sentence stands for the stops, unfolded), for tests and tools.
    pub fn allowed_after(&self, tokens: &[u32]) -> std::result::Result<Vec<u32>, String> {
        let mut m = self.matcher.deep_clone();
        m.consume_tokens(tokens).map_err(|e| e.to_string())?;
        Ok(m.compute_mask().map_err(|e| e.to_string())?.as_slice().to_vec())
    }

    /// Whether `tokens`, fed in order, are all allowed (a check for tests and tools).
    pub fn accepts_prefix(&self, tokens: &[u32]) -> bool {
        let mut m = self.matcher.deep_clone();
        m.validate_tokens(tokens).is_ok_and(|n| n == tokens.len())
    }
}

/// Mask cost counters of one sequence.
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq)]
pub struct GuideStats {
    /// Masks computed.
    pub masks: usize,
    /// Total compute time of those masks (on the workers, or inline).
    pub compute: Duration,
    /// Time the sampler blocked waiting for a mask (the part on the critical path).
    pub wait: Duration,
    /// The slowest mask.
    pub max: Duration,
}

/// A computed mask: the grammar's allowed ids with the stop tokens folded in.
pub struct Mask {
    bits: SimpleVob,
}

impl Mask {
    /// Bit `t % 32` of word `t / 32` is set when id `t` is allowed.
    pub fn words(&self) -> &[u32] {
        self.bits.as_slice()
    }
    pub fn allows(&self, t: u32) -> bool {
        (t as usize) < self.bits.len() && self.bits.is_allowed(t)
    }
}

type Done = (Matcher, std::result::Result<SimpleVob, String>, Duration);
type Job = (Matcher, SyncSender<Done>);

/// Worker threads that compute masks while the forward pass runs.
pub struct MaskPool {
    jobs: Sender<Job>,
}

impl MaskPool {
    /// `threads` workers (at least one).
    pub fn new(threads: usize) -> MaskPool {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new().name(format!("k3-mask-{i}")).spawn(move || loop {
                let job = match rx.lock() {
                    Ok(r) => r.recv(),
                    Err(_) => return,
                };
                match job {
                    Ok((m, tx)) => {
                        let _ = tx.send(compute(m)); // a cancelled sequence no longer listens
                    }
                    Err(_) => return, // the pool was dropped
                }
            });
            if spawned.is_err() {
                break; // fewer workers; `Guide::mask` computes inline if none runs
            }
        }
        MaskPool { jobs: tx }
    }
}

fn compute(mut m: Matcher) -> Done {
    let t = Instant::now();
    let r = m.compute_mask().map_err(|e| e.to_string());
    (m, r, t.elapsed())
}

/// The engine's per-sequence driver of a [`Constraint`].
pub struct Guide {
    /// `None` while a worker holds it.
    matcher: Option<Matcher>,
    pending: Option<Receiver<Done>>,
    eos: u32,
    /// The request's stop ids: allowed when the grammar allows its end of sentence.
    stops: Vec<u32>,
    pub stats: GuideStats,
}

impl Guide {
    pub fn new(c: Constraint, stops: Vec<u32>) -> Guide {
        Guide { matcher: Some(c.matcher), pending: None, eos: c.eos, stops, stats: GuideStats::default() }
    }

    /// Starts computing the next mask on the pool (no-op if one is pending).
    pub fn prefetch(&mut self, pool: &MaskPool) {
        if self.pending.is_some() {
            return;
        }
        let Some(m) = self.matcher.take() else { return };
        let (tx, rx) = sync_channel(1);
        match pool.jobs.send((m, tx)) {
            Ok(()) => self.pending = Some(rx),
            // No worker left: keep the matcher; `mask` computes inline.
            Err(e) => self.matcher = Some(e.0 .0),
        }
    }

    /// The mask for the next token: the pending one, or computed now.
    pub fn mask(&mut self) -> std::result::Result<Mask, String> {
        let (m, r, took) = match self.pending.take() {
            Some(rx) => {
                let t = Instant::now();
                let done = rx.recv().map_err(|_| "the mask worker stopped".to_string())?;
                self.stats.wait += t.elapsed();
                done
            }
            None => {
                let m = self.matcher.take().ok_or("the grammar state was lost")?;
                let t = Instant::now();
                let d = compute(m);
                self.stats.wait += t.elapsed();
                d
            }
        };
        self.matcher = Some(m);
        self.stats.masks += 1;
        self.stats.compute += took;
        self.stats.max = self.stats.max.max(took);
        let mut bits = r?;
        if bits.len() > (self.eos as usize) && bits.is_allowed(self.eos) {
            for &s in &self.stops {
                if (s as usize) < bits.len() {
                    bits.allow_token(s);
                }
            }
        }
        if bits.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        Ok(Mask { bits })
    }

    /// Commits a sampled id that is not one of the stops. Returns whether the grammar is now
    /// complete (nothing more can follow).
    pub fn commit(&mut self, tok: u32) -> std::result::Result<bool, String> {
        let m = self.matcher.as_mut().ok_or("the grammar state was lost")?;
        m.consume_token(tok).map_err(|e| e.to_string())?;
        Ok(m.is_stopped())
    }
}
