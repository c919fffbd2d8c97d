//! Output constraints of a request (docs/structured-outputs.md): `response_format` (`json_object`,
//! `json_schema`), `response_schema`, vLLM's `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar`, and — for chat — `tool_choice` over the declared `tools`, become one
//! [`GrammarSpec`] that the engine enforces token by token.
//!
//! A chat grammar covers the assistant message after the generation stub: with thinking on,
//! free reasoning up to `<|close|>think<|sep|>` then `<|open|>response<|sep|>`; the response body
//! (the content constraint, or free text); `<|close|>response<|sep|>`; the XTML tools block
//! ([`crate::constrain_xtml`]); `<|close|>message<|sep|>`. `tool_choice: "required"` or a named
//! function forces an empty response and a tools block of declared calls (exactly one call of
//! the named tool); `auto` leaves the text free and any stop allowed, and enforces a call's
//! framing and arguments once the model opens the tools block. A completion grammar is the
//! content constraint alone.
//!
//! Every schema or grammar the client wrote is first compiled on its own, so that a 400 names
//! its exact field (`response_format.json_schema.schema`, `tools[1].function.parameters`, …);
//! compiling runs on a blocking thread.

use std::sync::Arc;

use k3_engine::{Constraint, GrammarEnv, GrammarSpec};
use serde_json::{json, Value};

use crate::constrain_xtml::{tools_block, ToolDecl};
use crate::error::{bad_param, Result, ServerError};
use crate::params::Fields;

/// Request fields of the vLLM guided-decoding extensions (both endpoints).
pub const GUIDED_FIELDS: &[&str] = &["guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern"];

/// Most calls one constrained tools block may hold (`parallel_tool_calls: false`: one).
pub const MAX_CALLS: usize = 8;

/// A grammar to compile, and the client's own pieces to check first (field, spec).
pub struct Plan {
    pub spec: GrammarSpec,
    /// The field named when the composed grammar fails to compile.
    pub param: String,
    pub checks: Vec<(String, GrammarSpec)>,
}

/// The content constraint and the field it came from.
struct Content {
    spec: GrammarSpec,
    param: String,
}

/// Looks `key` up in `chat_template_kwargs` first (as the renderer does), then at the top level.
fn lookup<'a>(f: &Fields<'a>, key: &str, chat: bool) -> Option<(&'a Value, String)> {
    if chat {
        if let Some(v) = f.get("chat_template_kwargs").and_then(|k| k.get(key)).filter(|v| !v.is_null()) {
            return Some((v, format!("chat_template_kwargs.{key}")));
        }
    }
    f.get(key).map(|v| (v, key.to_owned()))
}

/// The schema of a `guided_json` / `response_schema` value (an object, or a string holding one).
fn schema_value(v: &Value, param: &str) -> Result<Value> {
    match v {
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        Value::String(s) => serde_json::from_str(s).map_err(|e| bad_param(param, format!("is not valid JSON: {e}"))),
        _ => Err(bad_param(param, "must be a JSON Schema (an object, or a string holding one)")),
    }
}

/// The content constraint of a request, if any (at most one source may be given).
fn content(f: &Fields, chat: bool) -> Result<Option<Content>> {
    let mut found: Vec<Content> = Vec::new();
    let ws = f.str("guided_whitespace_pattern")?;
    let json_spec = |schema: Value| match ws {
        None => GrammarSpec::json(schema),
        Some(p) => GrammarSpec::JsonSchema(match schema {
            Value::Object(mut o) => {
                o.entry("x-guidance").or_insert_with(|| json!({"whitespace_pattern": p}));
                Value::Object(o)
            }
            other => other,
        }),
    };
    if let Some((v, param)) = lookup(f, "response_format", chat) {
        match v.get("type").and_then(Value::as_str) {
            Some("json_object") => found.push(Content { spec: json_spec(json!({"type": "object"})), param }),
            Some("json_schema") => {
                let p = format!("{param}.json_schema.schema");
                let schema = v.get("json_schema").and_then(|j| j.get("schema")).ok_or_else(|| bad_param(p.clone(), "is required"))?;
                found.push(Content { spec: json_spec(schema.clone()), param: p });
            }
            Some("text") | None => {}
            Some(t) => return Err(bad_param(format!("{param}.type"), format!("unsupported type {t:?} (text, json_object or json_schema)"))),
        }
    }
    if let Some((v, param)) = lookup(f, "response_schema", chat) {
        // An explicit schema overrides the one inside response_format (as the renderer does).
        let s = schema_value(v, &param)?;
        found.retain(|c| !c.param.starts_with("response_format") && !c.param.starts_with("chat_template_kwargs.response_format"));
        found.push(Content { spec: json_spec(s), param });
    }
    if let Some(v) = f.get("guided_json") {
        found.push(Content { spec: json_spec(schema_value(v, "guided_json")?), param: "guided_json".into() });
    }
    if let Some(r) = f.str("guided_regex")? {
        found.push(Content { spec: GrammarSpec::Regex(r.to_owned()), param: "guided_regex".into() });
    }
    if let Some(v) = f.get("guided_choice") {
        let choices = v
            .as_array()
            .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_owned)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| bad_param("guided_choice", "must be a list of strings"))?;
        if choices.is_empty() {
            return Err(bad_param("guided_choice", "must hold at least one string"));
        }
        found.push(Content { spec: GrammarSpec::Choice(choices), param: "guided_choice".into() });
    }
    if let Some(g) = f.str("guided_grammar")? {
        if g.trim().is_empty() {
            return Err(bad_param("guided_grammar", "is empty"));
        }
        found.push(Content { spec: GrammarSpec::Lark(g.to_owned()), param: "guided_grammar".into() });
    }
    match f.str("guided_decoding_backend")? {
        None | Some("auto" | "guidance" | "llguidance") => {}
        Some(b) => {
            return Err(bad_param(
                "guided_decoding_backend",
                format!("{b:?} is not available; this server uses llguidance (\"auto\", \"guidance\" or \"llguidance\")"),
            ))
        }
    }
    if found.len() > 1 {
        return Err(bad_param(found[1].param.clone(), format!("conflicts with `{}`: give one output constraint", found[0].param)));
    }
    Ok(found.pop())
}

/// The constraint of a `/v1/completions` request.
pub fn completion_plan(f: &Fields) -> Result<Option<Plan>> {
    Ok(content(f, false)?.map(|c| Plan { spec: c.spec.clone(), param: c.param.clone(), checks: Vec::new() }))
}

/// What `tool_choice` asks for.
enum Choice {
    Auto,
    Required,
    Named(String),
}

/// The grammar of a chat request's assistant message, if it is constrained; `auto_tools`:
/// whether `tool_choice: "auto"` is enforced ([`crate::ServerConfig::tool_grammar`]).
pub fn chat_plan(f: &Fields, thinking: bool, add_generation_prompt: bool, auto_tools: bool) -> Result<Option<Plan>> {
    let content = content(f, true)?;
    let tools: Vec<ToolDecl> = match f.get("tools") {
        Some(Value::Array(t)) => t.iter().enumerate().filter_map(|(i, t)| ToolDecl::from_json(i, t)).collect(),
        _ => Vec::new(),
    };
    let choice = match lookup(f, "tool_choice", true) {
        _ if tools.is_empty() => None,
        None if !auto_tools => None,
        None => Some(Choice::Auto),
        Some((Value::String(s), _)) if s == "none" => None,
        Some((Value::String(s), _)) if s == "auto" && !auto_tools => None,
        Some((Value::String(s), _)) if s == "required" => Some(Choice::Required),
        Some((Value::Object(o), _)) => o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).map(|n| Choice::Named(n.to_owned())),
        Some(_) => Some(Choice::Auto),
    };
    if content.is_none() && choice.is_none() {
        return Ok(None);
    }
    if !add_generation_prompt {
        return Err(bad_param(
            "add_generation_prompt",
            "must be true (the default) with an output constraint or tools: the constraint starts after the generation prompt",
        ));
    }
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let max_calls = if parallel { MAX_CALLS } else { 1 };
    let mut checks = Vec::new();
    let mut subs = Vec::new();
    let mut lark = String::from("%llguidance {}\nTEXT: /(?s:.*)/\nresp_close: <|close|> \"response\" <|sep|>\nmsg_close: <|close|> \"message\" <|sep|>\n");
    let mut param = "tools".to_owned();
    if let Some(c) = &content {
        checks.push((c.param.clone(), c.spec.clone()));
        subs.push(("content".to_owned(), c.spec.clone()));
        param = c.param.clone();
    }
    let calls = match &choice {
        None => None,
        Some(ch) => {
            for t in &tools {
                if let Some(p) = &t.parameters {
                    checks.push((t.param.clone(), GrammarSpec::json(p.clone())));
                }
            }
            let (names, min): (Vec<&ToolDecl>, usize) = match ch {
                Choice::Named(n) => (tools.iter().filter(|t| &t.name == n).collect(), 1),
                Choice::Required => (tools.iter().collect(), 1),
                Choice::Auto => (tools.iter().collect(), 0),
            };
            if names.is_empty() {
                return Err(bad_param("tool_choice.function.name", "is not a declared tool"));
            }
            let max = if matches!(ch, Choice::Named(_)) { 1 } else { max_calls };
            lark.push_str(&tools_block(&names, max, &mut checks)?);
            Some(min)
        }
    };
    // The response body and what follows it.
    let body = match (&content, calls) {
        (None, None) => unreachable!("returned above"),
        (Some(_), None) => "body: @content resp_close msg_close".to_owned(),
        (None, Some(0)) => "body: TEXT (resp_close tools? msg_close?)?".to_owned(),
        (Some(_), Some(0)) => "body: (@content resp_close | resp_close tools) msg_close".to_owned(),
        (_, Some(_)) => "body: resp_close tools msg_close".to_owned(),
    };
    lark.push_str(&body);
    lark.push('\n');
    let free_end = content.is_none() && calls == Some(0);
    let start = match (thinking, free_end) {
        (false, _) => "start: body",
        (true, false) => "start: TEXT <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> body",
        (true, true) => "start: TEXT (<|close|> \"think\" <|sep|> (<|open|> \"response\" <|sep|> body)?)?",
    };
    lark.push_str(start);
    lark.push('\n');
    Ok(Some(Plan { spec: GrammarSpec::Composite { lark, subs }, param, checks }))
}

/// Compiles a plan on a blocking thread: each client piece alone first (its failure names its
/// field), then the whole grammar.
pub async fn compile(env: &Arc<GrammarEnv>, plan: Plan) -> Result<Constraint> {
    let env = env.clone();
    let job = tokio::task::spawn_blocking(move || -> Result<Constraint> {
        for (param, spec) in &plan.checks {
            env.compile(spec).map_err(|e| bad_param(param.clone(), format!("cannot be enforced: {}", one_line(&e))))?;
        }
        env.compile(&plan.spec).map_err(|e| bad_param(plan.param.clone(), format!("cannot be enforced: {}", one_line(&e))))
    });
    job.await.map_err(|e| ServerError::Internal(format!("the grammar compiler failed: {e}")))?
}

/// A compiler message on one line, bounded (they can quote a whole schema).
fn one_line(e: &str) -> String {
    let l = e.split_whitespace().collect::<Vec<_>>().join(" ");
    if l.chars().count() > 400 {
        format!("{}…", l.chars().take(400).collect::<String>())
    } else {
        l.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(body: Value, auto_tools: bool) -> Option<Plan> {
        chat_plan(&Fields(body.as_object().unwrap()), false, true, auto_tools).unwrap()
    }

    /// `--no-tool-grammar` leaves `auto` free and still enforces `required` / a named tool.
    #[test]
    fn auto_tools_is_a_switch_and_explicit_choices_are_not() {
        let tools = json!([{"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}}]);
        let with = |choice: Option<Value>| {
            let mut b = json!({"tools": tools.clone()});
            if let Some(c) = choice {
                b["tool_choice"] = c;
            }
            b
        };
        assert!(plan(with(None), true).is_some());
        assert!(plan(with(Some(json!("auto"))), true).is_some());
        assert!(plan(with(None), false).is_none());
        assert!(plan(with(Some(json!("auto"))), false).is_none());
        assert!(plan(with(Some(json!("required"))), false).is_some());
        assert!(plan(with(Some(json!({"type": "function", "function": {"name": "calc"}}))), false).is_some());
    }
}
