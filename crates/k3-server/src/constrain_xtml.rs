//! The Lark grammar of an XTML tools block (spec §6.4), as the renderer writes one and the output
//! parser reads it back: `<|open|>tools<|sep|>`, then calls `<|open|>call tool="NAME"
//! index="i"<|sep|>` (i = 1, 2, … in order) holding one `<|open|>argument key="K" type="T"<|sep|>
//! VALUE<|close|>argument<|sep|>` per argument and closed by `<|close|>call<|sep|>`, then
//! `<|close|>tools<|sep|>`. Attribute values are escaped as the renderer does (`&` → `&amp;`,
//! `"` → `&quot;`).
//!
//! The arguments follow the tool's `parameters` schema: its `properties` in the schema's key
//! order (the sorted order the model sees in the tool declaration), each required one present,
//! each optional one present or not, and no undeclared key; a schema without `properties` takes
//! no argument unless its `additionalProperties` is `true` or a schema (then any keys). A VALUE's `type` attribute is the JSON type of the
//! value: for each type the property's schema admits there is one branch, a `string` branch as
//! raw text (the renderer's form) held to the schema's `enum`/`const`, `pattern`, length and
//! `format`, every other branch as JSON (`json.dumps` separators, as in rendered history) held to
//! the schema restricted to that type.

use std::collections::BTreeSet;

use k3_engine::grammar::{lark_str, with_whitespace};
use k3_engine::GrammarSpec;
use serde_json::{json, Map, Value};

use crate::error::{bad_param, Result};

/// JSON types as the `type` attribute spells them (integers are `number`).
const TYPES: [&str; 6] = ["string", "number", "boolean", "null", "object", "array"];

/// Deepest `$ref` / combinator nesting followed when typing a schema.
const MAX_DEPTH: usize = 32;

/// One declared tool.
pub struct ToolDecl {
    pub name: String,
    /// `parameters`, if given.
    pub parameters: Option<Value>,
    /// Its field path, for errors (`tools[i].function.parameters`).
    pub param: String,
}

impl ToolDecl {
    /// The tool at `tools[i]` (already validated by `crate::tools`).
    pub fn from_json(i: usize, t: &Value) -> Option<ToolDecl> {
        let f = t.get("function")?;
        let name = f.get("name")?.as_str()?.to_owned();
        let parameters = f.get("parameters").filter(|p| !p.is_null()).cloned();
        Some(ToolDecl { name, parameters, param: format!("tools[{i}].function.parameters") })
    }
}

fn escape_attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;")
}

/// A rule-name fragment for `s` (letters, digits and `_` only, kept unique by `n`).
fn ident(n: usize, s: &str) -> String {
    let clean: String = s.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '_' }).take(24).collect();
    format!("{clean}_{n}")
}

/// The JSON schemas of argument values, each with the field it comes from (compiled alone
/// first, so that one the engine cannot enforce is a 400 naming its property).
pub type Checks = Vec<(String, GrammarSpec)>;

/// The rules of `tools: <|open|>tools<|sep|> call_1 … <|close|>tools<|sep|>` with 1..=`max`
/// calls of `decls`.
pub fn tools_block(decls: &[&ToolDecl], max: usize, checks: &mut Checks) -> Result<String> {
    let mut out = String::new();
    let mut heads = Vec::new();
    for (n, d) in decls.iter().enumerate() {
        let fid = ident(n, &d.name);
        let (rules, has_args) = args_rules(&fid, d, checks)?;
        out.push_str(&rules);
        heads.push((escape_attr(&d.name), if has_args { format!(" args_{fid}") } else { String::new() }));
    }
    for i in 1..=max {
        let alts: Vec<String> =
            heads.iter().map(|(name, args)| format!("{} <|sep|>{args}", lark_str(&format!("call tool=\"{name}\" index=\"{i}\"")))).collect();
        out.push_str(&format!("call_{i}: <|open|> ({}) <|close|> \"call\" <|sep|>\n", alts.join(" | ")));
        let rest = if i < max { format!(" calls_{}?", i + 1) } else { String::new() };
        out.push_str(&format!("calls_{i}: call_{i}{rest}\n"));
    }
    out.push_str("tools: <|open|> \"tools\" <|sep|> calls_1 <|close|> \"tools\" <|sep|>\n");
    Ok(out)
}

/// `args_F: arg… ` for one tool, and whether it takes any argument (else there is no rule).
fn args_rules(fid: &str, d: &ToolDecl, checks: &mut Checks) -> Result<(String, bool)> {
    let root = d.parameters.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    let obj = resolve(&root, &root, &d.param)?;
    let props: Option<&Map<String, Value>> = obj.get("properties").and_then(Value::as_object);
    // Extra keys only where the schema asks for them: `additionalProperties` true or a schema.
    let open = matches!(obj.get("additionalProperties"), Some(Value::Bool(true) | Value::Object(_)));
    let required: BTreeSet<&str> = obj.get("required").and_then(Value::as_array).map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let mut out = String::new();
    let mut seq = Vec::new();
    match props {
        Some(props) if !props.is_empty() => {
            for (k, (key, schema)) in props.iter().enumerate() {
                let at = format!("{}.properties.{key}", d.param);
                let rule = format!("arg_{fid}_{k}");
                out.push_str(&arg_rule(&rule, &format!("STR_{}_{k}", fid.to_uppercase()), key, schema, &root, &at, checks)?);
                seq.push(if required.contains(key.as_str()) { rule } else { format!("{rule}?") });
            }
            if let Some(missing) = required.iter().find(|r| !props.contains_key(**r)) {
                return Err(bad_param(format!("{}.required", d.param), format!("names {missing:?}, which is not in `properties`")));
            }
        }
        _ if !required.is_empty() => {
            return Err(bad_param(format!("{}.required", d.param), "lists properties the schema does not declare in `properties`"));
        }
        _ if !open => {} // no arguments
        _ => {
            // No declared properties, extra keys allowed: any keys with any JSON values.
            let rule = format!("anyarg_{fid}");
            let branches = any_value_branches(&format!("STR_{}_ANY", fid.to_uppercase()), &mut out);
            out.push_str(&format!("{rule}: <|open|> \"argument key=\\\"\" ANYKEY \"\\\" type=\\\"\" ({branches}) <|close|> \"argument\" <|sep|>\n"));
            out.push_str("ANYKEY: /[A-Za-z_][A-Za-z0-9_.\\-]{0,63}/\n");
            seq.push(format!("{rule}*"));
        }
    }
    if !seq.is_empty() {
        out.push_str(&format!("args_{fid}: {}\n", seq.join(" ")));
    }
    Ok((out, !seq.is_empty()))
}

/// Branches for a value of any type (the `STR` terminal is added to `out`).
fn any_value_branches(str_term: &str, out: &mut String) -> String {
    out.push_str(&format!("{str_term}: /(?s:.*)/\n"));
    TYPES
        .iter()
        .map(|t| match *t {
            "string" => format!("\"string\\\"\" <|sep|> {str_term}"),
            t => format!("\"{t}\\\"\" <|sep|> %json {}", arg_json(json!({"type": t}), &Value::Null)),
        })
        .collect::<Vec<_>>()
        .join(" | ")
}

/// An argument value's schema (with the root's definitions, python separators).
fn arg_json(mut s: Value, root: &Value) -> Value {
    if let (Value::Object(o), Value::Object(r)) = (&mut s, root) {
        for k in ["$defs", "definitions"] {
            if let Some(d) = r.get(k) {
                o.entry(k).or_insert_with(|| d.clone());
            }
        }
    }
    with_whitespace(s, ", ", ": ")
}

/// `rule: <|open|> "argument key=\"K\" type=\"" (branches) <|close|> "argument" <|sep|>`.
fn arg_rule(rule: &str, str_term: &str, key: &str, schema: &Value, root: &Value, at: &str, checks: &mut Checks) -> Result<String> {
    let types = json_types(schema, root, 0);
    if types.is_empty() {
        return Err(bad_param(at, "admits no value"));
    }
    let mut out = String::new();
    let mut branches = Vec::new();
    for t in TYPES.iter().filter(|t| types.contains(**t)) {
        if *t == "string" {
            let term = raw_string(schema, root, at, 0)?;
            out.push_str(&format!("{str_term}: {term}\n"));
            branches.push(format!("\"string\\\"\" <|sep|> {str_term}"));
        } else {
            let js = arg_json(restrict(schema, t, &types), root);
            branches.push(format!("\"{t}\\\"\" <|sep|> %json {js}"));
            checks.push((at.to_owned(), GrammarSpec::JsonSchema(js)));
        }
    }
    let head = lark_str(&format!("argument key=\"{}\" type=\"", escape_attr(key)));
    out.push_str(&format!("{rule}: <|open|> {head} ({}) <|close|> \"argument\" <|sep|>\n", branches.join(" | ")));
    Ok(out)
}

/// `schema` held to one JSON type: itself when that is its only type, else intersected.
fn restrict(schema: &Value, t: &str, types: &BTreeSet<&'static str>) -> Value {
    if types.len() == 1 {
        return schema.clone();
    }
    let ty = if t == "number" { json!(["number", "integer"]) } else { json!(t) };
    json!({"type": ty, "allOf": [schema]})
}

/// Follows a local `$ref` (`#/…`) at the top of `s`.
fn resolve<'a>(s: &'a Value, root: &'a Value, at: &str) -> Result<&'a Value> {
    let mut cur = s;
    for _ in 0..MAX_DEPTH {
        match cur.get("$ref").and_then(Value::as_str) {
            None => return Ok(cur),
            Some(r) => {
                let ptr = r.strip_prefix('#').ok_or_else(|| bad_param(format!("{at}.$ref"), format!("{r:?}: only local references (#/…) are supported")))?;
                cur = root.pointer(ptr).ok_or_else(|| bad_param(format!("{at}.$ref"), format!("{r:?} points at nothing in the schema")))?;
            }
        }
    }
    Err(bad_param(format!("{at}.$ref"), "references nest too deep (a cycle?)"))
}

fn type_of(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "string",
        Value::Number(_) => "number",
        Value::Bool(_) => "boolean",
        Value::Null => "null",
        Value::Object(_) => "object",
        Value::Array(_) => "array",
    }
}

/// The JSON types a schema admits (a superset where it cannot tell).
fn json_types(s: &Value, root: &Value, depth: usize) -> BTreeSet<&'static str> {
    let all: BTreeSet<&'static str> = TYPES.into_iter().collect();
    if depth > MAX_DEPTH {
        return all;
    }
    let o = match s {
        Value::Bool(false) => return BTreeSet::new(),
        Value::Object(o) => o,
        _ => return all,
    };
    let mut set = all.clone();
    if let Some(t) = o.get("type") {
        let names: Vec<&str> = match t {
            Value::String(x) => vec![x.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let mapped: BTreeSet<&'static str> = TYPES.into_iter().filter(|ty| names.iter().any(|n| n == ty || (*ty == "number" && *n == "integer"))).collect();
        set = &set & &mapped;
    }
    if let Some(c) = o.get("const") {
        set.retain(|t| *t == type_of(c));
    }
    if let Some(Value::Array(e)) = o.get("enum") {
        let es: BTreeSet<&'static str> = e.iter().map(type_of).collect();
        set = &set & &es;
    }
    for k in ["anyOf", "oneOf"] {
        if let Some(Value::Array(bs)) = o.get(k) {
            let u: BTreeSet<&'static str> = bs.iter().flat_map(|b| json_types(b, root, depth + 1)).collect();
            set = &set & &u;
        }
    }
    if let Some(Value::Array(bs)) = o.get("allOf") {
        for b in bs {
            set = &set & &json_types(b, root, depth + 1);
        }
    }
    if let Some(r) = o.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')).and_then(|p| root.pointer(p)) {
        set = &set & &json_types(r, root, depth + 1);
    }
    set
}

/// A Lark terminal for a raw (unquoted) string argument held to the string part of `s`.
fn raw_string(s: &Value, root: &Value, at: &str, depth: usize) -> Result<String> {
    let s = resolve(s, root, at)?;
    let Value::Object(o) = s else { return Ok("/(?s:.*)/".into()) };
    if depth > MAX_DEPTH {
        return Err(bad_param(at, "nests too deep"));
    }
    let mut parts: Vec<String> = Vec::new();
    let lits = |vals: &[Value]| -> Option<String> {
        let l: Vec<String> = vals.iter().filter_map(Value::as_str).map(lark_str).collect();
        (!l.is_empty()).then(|| format!("({})", l.join(" | ")))
    };
    if let Some(c) = o.get("const") {
        parts.push(lits(std::slice::from_ref(c)).ok_or_else(|| bad_param(format!("{at}.const"), "is not a string"))?);
    }
    if let Some(Value::Array(e)) = o.get("enum") {
        parts.push(lits(e).ok_or_else(|| bad_param(format!("{at}.enum"), "holds no string"))?);
    }
    if let Some(p) = o.get("pattern").and_then(Value::as_str) {
        parts.push(format!("/{}/", search_regex(p)));
    }
    let min = o.get("minLength").and_then(Value::as_u64);
    let max = o.get("maxLength").and_then(Value::as_u64);
    if min.is_some() || max.is_some() {
        parts.push(format!("/(?s:.{{{},{}}})/", min.unwrap_or(0), max.map(|m| m.to_string()).unwrap_or_default()));
    }
    if let Some(f) = o.get("format").and_then(Value::as_str) {
        let rx = format_regex(f).ok_or_else(|| {
            bad_param(format!("{at}.format"), format!("{f:?} is not a supported string format (date-time, date, time, uuid, email, ipv4, hostname, uri)"))
        })?;
        parts.push(format!("/{rx}/"));
    }
    for k in ["anyOf", "oneOf"] {
        if let Some(Value::Array(bs)) = o.get(k) {
            let alts: Vec<String> = bs
                .iter()
                .enumerate()
                .filter(|(_, b)| json_types(b, root, depth + 1).contains("string"))
                .map(|(i, b)| raw_string(b, root, &format!("{at}.{k}[{i}]"), depth + 1))
                .collect::<Result<_>>()?;
            if !alts.is_empty() {
                parts.push(format!("({})", alts.join(" | ")));
            }
        }
    }
    if let Some(Value::Array(bs)) = o.get("allOf") {
        for (i, b) in bs.iter().enumerate() {
            parts.push(format!("({})", raw_string(b, root, &format!("{at}.allOf[{i}]"), depth + 1)?));
        }
    }
    Ok(if parts.is_empty() { "/(?s:.*)/".into() } else { parts.join(" & ") })
}

/// A JSON Schema `pattern` (a search, anchored only by its own `^`/`$`) as the body of `/…/`.
fn search_regex(p: &str) -> String {
    let (start, body) = match p.strip_prefix('^') {
        Some(b) => ("", b),
        None => ("(?s:.*)", p),
    };
    let anchored_end = body.ends_with('$') && !body.ends_with("\\$");
    let body = if anchored_end { &body[..body.len() - 1] } else { body };
    let end = if anchored_end { "" } else { "(?s:.*)" };
    format!("{start}(?:{}){end}", llguidance_regex(body))
}

fn llguidance_regex(rx: &str) -> String {
    k3_engine::grammar::regex_to_lark(rx, "dw")
}

/// Regexes of the string formats accepted for raw string arguments.
fn format_regex(f: &str) -> Option<&'static str> {
    Some(match f {
        "date" => r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
        "time" => r"([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])",
        "date-time" => {
            r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
        }
        "uuid" => r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
        "email" => r"[A-Za-z0-9.!#$%&'*+=?^_`{|}~\-]+@[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)*",
        "ipv4" => r"((25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])",
        "hostname" => r"[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9\-]{0,61}[A-Za-z0-9])?)*",
        "uri" => r"[A-Za-z][A-Za-z0-9+.\-]*:[^ \t\r\n]*",
        _ => return None,
    })
}
