//! Request-body validation shared by `/v1/chat/completions` and `/v1/completions`.
//!
//! Bodies are read as raw bytes (so that the size limit, bad UTF-8 and malformed JSON each get
//! their own clear answer), parsed to a JSON object, checked for unknown fields, and then read
//! field by field with typed getters whose errors name the field. The sampling fields become a
//! [`GenParams`]; range checks are left to the engine, whose errors already name the parameter.

use k3_engine::SamplingParams;
use serde_json::{Map, Value};

use crate::error::{bad_param, bad_request, Result};

/// Fields both endpoints accept.
const COMMON: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "user",
    "logit_bias",
    "best_of",
    "metadata",
    "store",
    "service_tier",
];

/// Parses a body into a JSON object: bad UTF-8 and malformed JSON are 400s.
pub fn parse_body(body: &[u8]) -> Result<Map<String, Value>> {
    let text = std::str::from_utf8(body).map_err(|e| bad_request(format!("the request body is not valid UTF-8: {e}")))?;
    let v: Value = serde_json::from_str(text).map_err(|e| bad_request(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(bad_request("the request body must be a JSON object")),
    }
}

/// Typed, field-naming access to a request object.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl<'a> Fields<'a> {
    /// Rejects any field outside `COMMON` and `extra`.
    pub fn check_known(&self, extra: &[&str]) -> Result<()> {
        for k in self.0.keys() {
            if !COMMON.contains(&k.as_str()) && !extra.contains(&k.as_str()) {
                return Err(bad_param(k.clone(), "unrecognized request argument"));
            }
        }
        Ok(())
    }

    /// The value, with JSON `null` read as absent.
    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub fn f32(&self, k: &str) -> Result<Option<f32>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| bad_param(k, "must be a number")),
        }
    }

    pub fn i64(&self, k: &str) -> Result<Option<i64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_i64()
                .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0 && f.abs() < 9e15).map(|f| f as i64))
                .map(Some)
                .ok_or_else(|| bad_param(k, "must be an integer")),
        }
    }

    /// A non-negative integer.
    pub fn usize(&self, k: &str) -> Result<Option<usize>> {
        match self.i64(k)? {
            None => Ok(None),
            Some(n) if n < 0 => Err(bad_param(k, format!("{n} is negative"))),
            Some(n) => Ok(Some(n as usize)),
        }
    }

    pub fn bool(&self, k: &str) -> Result<Option<bool>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| bad_param(k, "must be true or false")),
        }
    }

    pub fn str(&self, k: &str) -> Result<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| bad_param(k, "must be a string")),
        }
    }

    pub fn object(&self, k: &str) -> Result<Option<Fields<'a>>> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Object(m)) => Ok(Some(Fields(m))),
            Some(_) => Err(bad_param(k, "must be an object")),
        }
    }

    /// `stop`: a string or a list of (at most 16) strings.
    pub fn stop(&self) -> Result<Vec<String>> {
        match self.get("stop") {
            None => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(a)) => {
                if a.len() > 16 {
                    return Err(bad_param("stop", "at most 16 stop strings are allowed"));
                }
                a.iter().map(|s| s.as_str().map(str::to_owned).ok_or_else(|| bad_param("stop", "must be a string or a list of strings"))).collect()
            }
            Some(_) => Err(bad_param("stop", "must be a string or a list of strings")),
        }
    }

    /// A list of non-negative integers (token ids).
    pub fn ids(&self, k: &str) -> Result<Vec<u32>> {
        match self.get(k) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => ids_of(a).ok_or_else(|| bad_param(k, "must be a list of token ids (non-negative integers)")),
            Some(_) => Err(bad_param(k, "must be a list of token ids")),
        }
    }
}

/// A JSON array of token ids, or `None` if any element is not one.
pub fn ids_of(a: &[Value]) -> Option<Vec<u32>> {
    a.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok())).collect()
}

/// The generation settings of a request, before the engine checks their ranges.
#[derive(Debug, Clone)]
pub struct GenParams {
    pub model: Option<String>,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    /// The spelling of the output limit the request used (for error messages).
    pub max_tokens_param: &'static str,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub stream: bool,
    /// `stream_options`: where a stream reports usage.
    pub usage: StreamUsage,
}

/// Where a stream reports usage (`stream_options`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StreamUsage {
    /// Nowhere (no `include_usage`).
    Off,
    /// `include_usage`: `"usage": null` on every chunk, then a last chunk with the totals.
    Final,
    /// `include_usage` and vLLM's `continuous_usage_stats`: every chunk carries the usage so
    /// far, and the last chunk the totals.
    EveryChunk,
}

impl StreamUsage {
    pub fn on(self) -> bool {
        self != StreamUsage::Off
    }

    /// Sets a stream chunk's `usage`: absent, `null`, or the usage so far (`so_far`: completion
    /// tokens and cached prompt tokens over the request's choices).
    pub fn put(self, chunk: &mut Value, prompt: usize, so_far: (usize, usize)) {
        match self {
            StreamUsage::Off => {}
            StreamUsage::Final => chunk["usage"] = Value::Null,
            StreamUsage::EveryChunk => chunk["usage"] = usage(prompt, so_far.0, so_far.1),
        }
    }
}

/// OpenAI's usage object; `cached`: prompt tokens restored from the prefix cache.
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    serde_json::json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}})
}

impl GenParams {
    /// Reads the common fields. `max_token_keys` lists the accepted spellings of the output
    /// limit (the first one present wins).
    pub fn read(f: &Fields, max_token_keys: &[&'static str]) -> Result<GenParams> {
        if let Some(b) = f.i64("best_of")? {
            if b != 1 {
                return Err(bad_param("best_of", "only best_of=1 is supported"));
            }
        }
        let logit_bias = logit_bias(f.get("logit_bias"))?;
        let model = f.str("model")?.map(str::to_owned);
        let _ = f.str("user")?;
        let mut max_tokens = None;
        let mut max_tokens_param = max_token_keys.last().copied().unwrap_or("max_tokens");
        for k in max_token_keys {
            if let Some(n) = f.usize(k)? {
                if n == 0 {
                    return Err(bad_param(*k, "must be at least 1"));
                }
                if max_tokens.is_none() {
                    max_tokens = Some(n);
                    max_tokens_param = k;
                }
            }
        }
        let d = SamplingParams::default();
        let top_k = match f.i64("top_k")? {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k < 0 => return Err(bad_param("top_k", format!("{k} must be -1 (off), 0 (off) or positive"))),
            Some(k) => k as usize,
        };
        let seed = f.i64("seed")?.map(|s| s as u64);
        let sampling = SamplingParams {
            temperature: f.f32("temperature")?.unwrap_or(d.temperature),
            top_k,
            top_p: f.f32("top_p")?.unwrap_or(d.top_p),
            min_p: f.f32("min_p")?.unwrap_or(d.min_p),
            repetition_penalty: f.f32("repetition_penalty")?.unwrap_or(d.repetition_penalty),
            presence_penalty: f.f32("presence_penalty")?.unwrap_or(d.presence_penalty),
            frequency_penalty: f.f32("frequency_penalty")?.unwrap_or(d.frequency_penalty),
            seed,
            logprobs: None,
            logit_bias,
            prompt_logprobs: None,
        };
        let stream = f.bool("stream")?.unwrap_or(false);
        let usage = match f.object("stream_options")? {
            None => StreamUsage::Off,
            Some(o) => {
                for k in o.0.keys() {
                    if k != "include_usage" && k != "continuous_usage_stats" {
                        return Err(bad_param(format!("stream_options.{k}"), "unrecognized stream option"));
                    }
                }
                let flag = |k: &str| o.bool(k).map_err(|_| bad_param(format!("stream_options.{k}"), "must be true or false")).map(|v| v.unwrap_or(false));
                match (flag("include_usage")?, flag("continuous_usage_stats")?) {
                    (false, _) => StreamUsage::Off,
                    (true, false) => StreamUsage::Final,
                    (true, true) => StreamUsage::EveryChunk,
                }
            }
        };
        Ok(GenParams {
            model,
            sampling,
            max_tokens,
            max_tokens_param,
            stop: f.stop()?,
            stop_token_ids: f.ids("stop_token_ids")?,
            ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
            stream,
            usage,
        })
    }
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to biases in [−100, 100],
/// returned as `(id, bias)` ascending. Ids past the vocabulary are refused by the engine.
fn logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>> {
    let m = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad_param("logit_bias", "must be an object mapping token ids (as strings) to biases in [-100, 100]")),
    };
    let mut out = Vec::with_capacity(m.len());
    for (k, b) in m {
        let field = || format!("logit_bias.{k}");
        let id: u32 = k.trim().parse().map_err(|_| bad_param(field(), "keys must be token ids: non-negative integers written as strings"))?;
        let b = b.as_f64().filter(|b| b.is_finite() && b.abs() <= 100.0).ok_or_else(|| bad_param(field(), format!("{b} is not a number in [-100, 100]")))?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|e| e.0);
    if let Some(w) = out.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(bad_param("logit_bias", format!("token {} is given twice", w[0].0)));
    }
    Ok(out)
}
