//! Grammar-constrained decoding through the engine on the embedded k3-nano, a Shakespeare model
//! that never writes JSON of its own accord (so every valid output is the constraint's doing):
//! random schemas within the supported subset and hand-written hard cases (nested objects, enums,
//! bounded arrays, anyOf, patterns, `$ref`), sampled at temperature 1 over several seeds and
//! greedy, all parse and validate (`tests/support/json_schema.rs`, a validator independent of
//! llguidance); greedy picks the highest-logit allowed id at every step; regex, choice and Lark
//! constraints hold; a complete grammar ends the sequence; the mask cost is counted.

use std::path::PathBuf;
use std::sync::Arc;

use k3_engine::{Engine, EngineConfig, FinishReason, GrammarEnv, GrammarSpec, Request, SamplingParams};
use k3_model::{Checkpoint, ForwardOpts, Model};
use k3_tokenizer::Tokenizer;
use rand::SeedableRng;
use serde_json::{json, Value};

#[path = "../../../tests/support/json_schema.rs"]
mod json_schema;
use json_schema::{random_object, validate};

fn nano() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/k3-nano")
}

struct Nano {
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    env: GrammarEnv,
}

fn load() -> Nano {
    let model = Arc::new(Model::load(&Checkpoint::open(&nano()).unwrap()).unwrap());
    let tok = Arc::new(Tokenizer::from_dir(&nano()).unwrap());
    let cfg = &model.config;
    let env = GrammarEnv::new(tok.clone(), cfg.text.vocab_size, cfg.eos_token_ids[0]).unwrap();
    Nano { model, tok, env }
}

fn engine(n: &Nano) -> Engine {
    Engine::new(n.model.clone(), Some(n.tok.clone()), EngineConfig { max_batch: 64, ..Default::default() })
}

/// Greedy and three seeds at temperature 1.
fn samplings() -> Vec<SamplingParams> {
    let mut v = vec![SamplingParams::greedy()];
    v.extend((1..=3).map(|s| SamplingParams { temperature: 1.0, seed: Some(s), ..Default::default() }));
    v
}

/// Runs every (spec, sampling) pair as one batch; returns (spec index, text, finish).
fn run_batch(n: &Nano, specs: &[GrammarSpec], max_tokens: usize) -> Vec<(usize, String, FinishReason)> {
    let mut e = engine(n);
    let prompt = n.tok.encode("ROMEO.\nWhat say you, in JSON?\n", false);
    let mut ids = Vec::new();
    for (i, spec) in specs.iter().enumerate() {
        let c = n.env.compile(spec).unwrap_or_else(|err| panic!("spec {i} does not compile: {err}\n{spec:?}"));
        for p in samplings() {
            let mut r = Request::new(prompt.clone(), p, max_tokens);
            r.constraint = Some(c.clone());
            ids.push((e.add(r).unwrap(), i));
        }
    }
    let mut out: Vec<(usize, Vec<u32>, Option<FinishReason>)> = ids.iter().map(|&(_, i)| (i, Vec::new(), None)).collect();
    while e.has_work() {
        for ev in e.step().unwrap() {
            assert!(ev.error.is_none(), "grammar error: {:?}", ev.error);
            let k = ids.iter().position(|&(id, _)| id == ev.seq).unwrap();
            out[k].1.push(ev.token);
            out[k].2 = ev.finish;
        }
    }
    let eos = &n.model.config.eos_token_ids;
    out.into_iter()
        .map(|(i, toks, f)| {
            let body: Vec<u32> = toks.into_iter().filter(|t| !eos.contains(t)).collect();
            (i, n.tok.decode(&body, false).unwrap(), f.expect("finished"))
        })
        .collect()
}

/// Every output of every schema finishes, parses and validates.
fn check_schemas(n: &Nano, schemas: &[Value], max_tokens: usize) {
    let specs: Vec<GrammarSpec> = schemas.iter().map(|s| GrammarSpec::json(s.clone())).collect();
    let mut failures = Vec::new();
    for (i, text, fin) in run_batch(n, &specs, max_tokens) {
        let verdict = match (fin, serde_json::from_str::<Value>(&text)) {
            (FinishReason::Stop, Ok(v)) => validate(&schemas[i], &v),
            (f, Ok(_)) => Err(format!("finished with {f:?}")),
            (f, Err(e)) => Err(format!("not JSON ({e}), finished with {f:?}")),
        };
        if let Err(why) = verdict {
            failures.push(format!("schema {i} {}\n  output {text:?}\n  {why}", schemas[i]));
        }
    }
    assert!(failures.is_empty(), "{} invalid outputs:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn random_schemas_validate() {
    let n = load();
    let mut rng = rand::rngs::StdRng::seed_from_u64(29);
    let schemas: Vec<Value> = (0..12).map(|_| random_object(&mut rng, 2)).collect();
    check_schemas(&n, &schemas, 320);
}

#[test]
fn hard_cases_validate() {
    let n = load();
    let schemas = [
        // Nested objects, an enum, a bounded array of objects.
        json!({"type": "object", "properties": {
            "speaker": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 12},
                "house": {"enum": ["Montague", "Capulet", "Escalus"]}},
                "required": ["name", "house"], "additionalProperties": false},
            "lines": {"type": "array", "minItems": 2, "maxItems": 3, "items": {"type": "object", "properties": {
                "act": {"type": "integer", "minimum": 1, "maximum": 5},
                "text": {"type": "string", "maxLength": 10}}, "required": ["act", "text"], "additionalProperties": false}}},
            "required": ["speaker", "lines"], "additionalProperties": false}),
        // anyOf over differently shaped branches, const, null.
        json!({"type": "object", "properties": {
            "answer": {"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "num"}, "value": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["kind", "value"], "additionalProperties": false},
                {"type": "object", "properties": {"kind": {"const": "word"}, "value": {"type": "string", "pattern": "^[a-z]{2,6}$"}}, "required": ["kind", "value"], "additionalProperties": false},
                {"type": "null"}]}},
            "required": ["answer"], "additionalProperties": false}),
        // String patterns and formats, an exact-length array of booleans.
        json!({"type": "object", "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "day": {"type": "string", "format": "date"},
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}},
            "required": ["code", "day", "flags"], "additionalProperties": false}),
        // $ref into $defs, recursion bounded by depth of the data only through maxItems.
        json!({"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["x", "y"], "additionalProperties": false}},
            "type": "object", "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}, "via": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2}},
            "required": ["from", "to"], "additionalProperties": false}),
        // Optional properties only, integers or null, an enum of mixed types.
        json!({"type": "object", "properties": {"a": {"type": ["integer", "null"], "minimum": 0, "maximum": 3}, "b": {"enum": [1, "two", true, null]}, "c": {"type": "boolean"}}, "additionalProperties": false}),
    ];
    let specs: Vec<GrammarSpec> = schemas.iter().map(|s| GrammarSpec::json(s.clone())).collect();
    let mut failures = Vec::new();
    for (i, text, fin) in run_batch(&n, &specs, 320) {
        let v: Result<Value, _> = serde_json::from_str(&text);
        let verdict = match (fin, v) {
            (FinishReason::Stop, Ok(v)) => validate(&schemas[i], &v),
            (f, r) => Err(format!("finished with {f:?}, parse {:?}", r.err())),
        };
        if let Err(why) = verdict {
            failures.push(format!("case {i}: {text:?}: {why}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn greedy_takes_the_best_allowed_token() {
    let n = load();
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "minimum": 0, "maximum": 50}}, "required": ["name", "n"], "additionalProperties": false});
    let c = n.env.compile(&GrammarSpec::json(schema)).unwrap();
    let prompt = n.tok.encode("ROMEO.\n", false);
    let mut req = Request::new(prompt.clone(), SamplingParams::greedy(), 64);
    req.constraint = Some(c.clone());
    let mut e = engine(&n);
    let (out, fin, stats) = e.generate(req, |_| {}).unwrap();
    assert_eq!(fin, FinishReason::Stop);
    assert_eq!(stats.mask.masks, out.len(), "one mask per sampled token");
    let eos = n.model.config.eos_token_ids.clone();
    let mut seq = prompt.clone();
    let mut unconstrained_differs = false;
    for (i, &tok) in out.iter().enumerate() {
        let lg = n.model.forward(&seq, &mut n.model.new_state(), ForwardOpts { last_only: true, ..Default::default() }, None).unwrap();
        let words = c.allowed_after(&out[..i]).unwrap();
        let allowed = |t: usize| words.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1);
        let eos_ok = allowed(eos[0] as usize);
        let best =
            (0..lg.len()).filter(|&t| allowed(t) || (eos_ok && eos.contains(&(t as u32)))).max_by(|&a, &b| lg[a].total_cmp(&lg[b]).then(b.cmp(&a))).unwrap();
        assert_eq!(best as u32, tok, "step {i}");
        unconstrained_differs |= k3_engine::sampler::argmax(&lg) != best;
        seq.push(tok);
    }
    assert!(unconstrained_differs, "the model wrote this JSON unconstrained: the test shows nothing");
}

#[test]
fn regex_choice_and_lark() {
    let n = load();
    let choices = vec!["to be".to_owned(), "not to be".to_owned(), "that is the question".to_owned()];
    let specs = vec![
        GrammarSpec::Regex(r"[A-Z][a-z]{2,8} [0-9]{2}\.".into()),
        GrammarSpec::Choice(choices.clone()),
        GrammarSpec::Lark("start: \"Act \" NUM \", scene \" NUM\nNUM: /[ivx]{1,4}/".into()),
    ];
    let rx = regex::Regex::new(r"^[A-Z][a-z]{2,8} [0-9]{2}\.$").unwrap();
    let lark = regex::Regex::new(r"^Act [ivx]{1,4}, scene [ivx]{1,4}$").unwrap();
    for (i, text, fin) in run_batch(&n, &specs, 48) {
        assert_eq!(fin, FinishReason::Stop, "{i}: {text:?}");
        match i {
            0 => assert!(rx.is_match(&text), "{text:?}"),
            1 => assert!(choices.contains(&text), "{text:?}"),
            _ => assert!(lark.is_match(&text), "{text:?}"),
        }
    }
}

#[test]
fn compile_errors_are_messages() {
    let n = load();
    for spec in [
        GrammarSpec::json(json!({"type": "string", "pattern": "(?<=a)b"})),
        GrammarSpec::json(json!({"type": "integer", "minimum": 5, "maximum": 2})),
        GrammarSpec::Regex("([".into()),
        GrammarSpec::Lark("start: nothing_defined".into()),
        GrammarSpec::Choice(Vec::new()),
    ] {
        let e = n.env.compile(&spec).err().unwrap_or_else(|| panic!("{spec:?} compiled"));
        assert!(!e.is_empty());
    }
}
