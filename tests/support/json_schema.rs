//! A JSON Schema validator for the subset the constrained-decoding tests use, written here so that
//! the check is independent of the grammar engine it checks (llguidance): `type` (one or a list;
//! `integer` = a number without a fraction), `enum`, `const`, `properties`, `required`,
//! `additionalProperties` (false or a schema), `items`, `minItems`, `maxItems`, `minLength`,
//! `maxLength` (in characters), `pattern` (a search, as JSON Schema says), `minimum`, `maximum`,
//! `exclusiveMinimum`, `exclusiveMaximum`, `anyOf`, `oneOf` (exactly one), `allOf`, local `$ref`,
//! and `format` date / date-time / uuid. A keyword outside the subset is an error, so a test
//! cannot pass by ignoring one. Also a seeded generator of random schemas within the subset, each
//! bounded so that a complete value is a few dozen tokens.
#![allow(dead_code)]

use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Map, Value};

const KNOWN: &[&str] = &[
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "items",
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "definitions",
    "format",
    "title",
    "description",
    "x-guidance",
];

/// Checks `v` against `schema` (whose own root holds any `$defs`); the error names the path.
pub fn validate(schema: &Value, v: &Value) -> Result<(), String> {
    check(schema, schema, v, "$")
}

fn type_ok(t: &str, v: &Value) -> bool {
    match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        _ => false,
    }
}

fn check(s: &Value, root: &Value, v: &Value, at: &str) -> Result<(), String> {
    let o = match s {
        Value::Bool(true) => return Ok(()),
        Value::Bool(false) => return Err(format!("{at}: the schema `false` admits nothing")),
        Value::Object(o) => o,
        _ => return Err(format!("{at}: not a schema: {s}")),
    };
    if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(format!("{at}: keyword {k:?} is outside the validator's subset"));
    }
    if let Some(r) = o.get("$ref").and_then(Value::as_str) {
        let target = r.strip_prefix('#').and_then(|p| root.pointer(p)).ok_or_else(|| format!("{at}: bad $ref {r}"))?;
        check(target, root, v, at)?;
    }
    if let Some(t) = o.get("type") {
        let ok = match t {
            Value::String(t) => type_ok(t, v),
            Value::Array(ts) => ts.iter().filter_map(Value::as_str).any(|t| type_ok(t, v)),
            _ => false,
        };
        if !ok {
            return Err(format!("{at}: {v} is not of type {t}"));
        }
    }
    if let Some(c) = o.get("const") {
        if !json_eq(c, v) {
            return Err(format!("{at}: {v} is not the const {c}"));
        }
    }
    if let Some(Value::Array(e)) = o.get("enum") {
        if !e.iter().any(|x| json_eq(x, v)) {
            return Err(format!("{at}: {v} is not in the enum {}", Value::Array(e.clone())));
        }
    }
    if let Value::String(st) = v {
        let n = st.chars().count() as u64;
        if o.get("minLength").and_then(Value::as_u64).is_some_and(|m| n < m) || o.get("maxLength").and_then(Value::as_u64).is_some_and(|m| n > m) {
            return Err(format!("{at}: {st:?} has a length ({n}) outside the bounds"));
        }
        if let Some(p) = o.get("pattern").and_then(Value::as_str) {
            let rx = regex::Regex::new(p).map_err(|e| format!("{at}: pattern {p}: {e}"))?;
            if !rx.is_match(st) {
                return Err(format!("{at}: {st:?} does not match the pattern {p:?}"));
            }
        }
        if let Some(f) = o.get("format").and_then(Value::as_str) {
            let rx = match f {
                "date" => r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])$",
                "date-time" => {
                    r"^\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])[Tt]([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)$"
                }
                "uuid" => r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
                _ => return Err(format!("{at}: format {f:?} is outside the validator's subset")),
            };
            if !regex::Regex::new(rx).unwrap().is_match(st) {
                return Err(format!("{at}: {st:?} is not a {f}"));
            }
        }
    }
    if let Some(x) = v.as_f64() {
        let num = |k: &str| o.get(k).and_then(Value::as_f64);
        let bad = num("minimum").is_some_and(|m| x < m)
            || num("maximum").is_some_and(|m| x > m)
            || num("exclusiveMinimum").is_some_and(|m| x <= m)
            || num("exclusiveMaximum").is_some_and(|m| x >= m);
        if bad {
            return Err(format!("{at}: {x} is outside the numeric bounds"));
        }
    }
    if let Value::Array(items) = v {
        let n = items.len() as u64;
        if o.get("minItems").and_then(Value::as_u64).is_some_and(|m| n < m) || o.get("maxItems").and_then(Value::as_u64).is_some_and(|m| n > m) {
            return Err(format!("{at}: {n} items, outside the bounds"));
        }
        if let Some(it) = o.get("items") {
            for (i, x) in items.iter().enumerate() {
                check(it, root, x, &format!("{at}[{i}]"))?;
            }
        }
    }
    if let Value::Object(m) = v {
        let props = o.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(req)) = o.get("required") {
            for r in req.iter().filter_map(Value::as_str) {
                if !m.contains_key(r) {
                    return Err(format!("{at}: required property {r:?} is missing"));
                }
            }
        }
        for (k, x) in m {
            match props.and_then(|p| p.get(k)) {
                Some(ps) => check(ps, root, x, &format!("{at}.{k}"))?,
                None => match o.get("additionalProperties") {
                    Some(Value::Bool(false)) => return Err(format!("{at}: property {k:?} is not allowed")),
                    Some(ap @ Value::Object(_)) => check(ap, root, x, &format!("{at}.{k}"))?,
                    _ => {}
                },
            }
        }
    }
    if let Some(Value::Array(bs)) = o.get("anyOf") {
        if !bs.iter().any(|b| check(b, root, v, at).is_ok()) {
            return Err(format!("{at}: {v} matches no anyOf branch"));
        }
    }
    if let Some(Value::Array(bs)) = o.get("oneOf") {
        let n = bs.iter().filter(|b| check(b, root, v, at).is_ok()).count();
        if n != 1 {
            return Err(format!("{at}: {v} matches {n} oneOf branches"));
        }
    }
    if let Some(Value::Array(bs)) = o.get("allOf") {
        for b in bs {
            check(b, root, v, at)?;
        }
    }
    Ok(())
}

/// JSON equality with numbers compared by value (1 = 1.0).
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => x.as_f64() == y.as_f64(),
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_eq(p, q)),
        (Value::Object(x), Value::Object(y)) => x.len() == y.len() && x.iter().all(|(k, p)| y.get(k).is_some_and(|q| json_eq(p, q))),
        _ => a == b,
    }
}

const WORDS: &[&str] = &["alpha", "beta", "king", "queen", "rose", "sword", "night", "ghost", "x", "long name"];

/// A random schema within the subset, bounded: strings ≤ 8 characters (or an enum / pattern),
/// integers and numbers in a range, arrays of ≤ 3 items, objects of ≤ 3 properties, depth ≤ `depth`.
pub fn random_schema(rng: &mut StdRng, depth: usize) -> Value {
    let pick = if depth == 0 { rng.random_range(0..6) } else { rng.random_range(0..9) };
    match pick {
        0 => json!({"type": "string", "maxLength": rng.random_range(0..9), "minLength": rng.random_range(0..2)}),
        1 => {
            let lo: i64 = rng.random_range(-50..50);
            json!({"type": "integer", "minimum": lo, "maximum": lo + rng.random_range(0..200)})
        }
        2 => json!({"type": "boolean"}),
        3 => {
            let n = rng.random_range(1..4);
            let vals: Vec<Value> = (0..n).map(|_| json!(WORDS[rng.random_range(0..WORDS.len())])).collect();
            json!({"enum": vals})
        }
        4 => {
            let p = ["^[A-Z]{2}[0-9]{2}$", "^(yes|no)$", "^[a-z]{1,5}$"][rng.random_range(0..3)];
            json!({"type": "string", "pattern": p})
        }
        5 => json!({"type": ["integer", "null"], "minimum": 0, "maximum": 9}),
        6 => {
            let lo = rng.random_range(0..2);
            json!({"type": "array", "items": random_schema(rng, depth - 1), "minItems": lo, "maxItems": lo + rng.random_range(0..3)})
        }
        7 => json!({"anyOf": [random_schema(rng, depth - 1), random_schema(rng, depth - 1)]}),
        _ => random_object(rng, depth - 1),
    }
}

/// A random object schema (closed, some properties required).
pub fn random_object(rng: &mut StdRng, depth: usize) -> Value {
    let n = rng.random_range(1..4);
    let mut props = Map::new();
    let mut req = Vec::new();
    for i in 0..n {
        let k = format!("{}{i}", WORDS[rng.random_range(0..WORDS.len())].replace(' ', "_"));
        props.insert(k.clone(), random_schema(rng, depth));
        if rng.random_bool(0.6) {
            req.push(json!(k));
        }
    }
    json!({"type": "object", "properties": props, "required": req, "additionalProperties": false})
}
