//! Output constraints end to end through HTTP on the real engine with the embedded k3-nano (a
//! Shakespeare model: whatever valid JSON or tool call comes out is the constraint's doing):
//! `response_format` json_schema / json_object content parses and validates; `tool_choice`
//! naming a function always yields exactly that tool, `required` always yields calls, each with
//! arguments that validate against the tool's `parameters` (greedy and sampled at temperature 1,
//! streamed and not, with no XTML in `content`); the `guided_*` extensions on both endpoints; and a
//! schema or grammar that cannot be enforced is a 400 naming its field.

mod common;

use common::*;
use k3_engine::EngineConfig;
use k3_server::BackgroundServer;
use serde_json::{json, Value};

#[path = "../../../tests/support/json_schema.rs"]
mod json_schema;
use json_schema::validate;

fn start() -> BackgroundServer {
    nano_server(EngineConfig::default().prefix, 8, 32)
}

fn weather() -> Value {
    json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false})
}

fn calculator() -> Value {
    json!({"type": "object", "properties": {"expression": {"type": "string", "pattern": "^[0-9][0-9+*/ -]{0,15}$"}, "precise": {"type": ["boolean", "null"]}},
        "required": ["expression"], "additionalProperties": false})
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": weather()}},
        {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic", "parameters": calculator()}},
        {"type": "function", "function": {"name": "ping", "description": "No arguments"}},
    ])
}

/// Greedy, then temperature 1 with three seeds.
fn samplings() -> Vec<Value> {
    let mut v = vec![json!({"temperature": 0})];
    v.extend((1..=3).map(|s| json!({"temperature": 1.0, "seed": s})));
    v
}

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": "k3-nano", "messages": [{"role": "user", "content": "What is the weather in Verona, and what is 12*7?"}],
        "reasoning_effort": "none", "max_tokens": 200});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The tool calls of a non-streamed answer, after checking that nothing of XTML leaked.
fn calls_of(v: &Value) -> Vec<(String, Value)> {
    let m = &v["choices"][0]["message"];
    if let Some(c) = m["content"].as_str() {
        assert!(!c.contains("<|"), "XTML in content: {c:?}");
    }
    m["tool_calls"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|c| (c["function"]["name"].as_str().unwrap().to_owned(), serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap()))
                .collect()
        })
        .unwrap_or_default()
}

fn schema_of(name: &str) -> Value {
    match name {
        "get_weather" => weather(),
        "calculator" => calculator(),
        "ping" => json!({"type": "object", "properties": {}}),
        n => panic!("undeclared tool {n:?}"),
    }
}

#[test]
fn named_and_required_tool_choice() {
    let srv = start();
    for s in samplings() {
        for name in ["get_weather", "calculator", "ping"] {
            let mut extra = json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": name}}});
            extra.as_object_mut().unwrap().extend(s.as_object().unwrap().clone());
            let r = post(srv.addr, "/v1/chat/completions", &chat(extra));
            assert_eq!(r.status, 200, "{}", r.text());
            let v = r.json();
            let calls = calls_of(&v);
            assert_eq!(calls.len(), 1, "{name} {s}: {v}");
            assert_eq!(calls[0].0, name);
            validate(&schema_of(name), &calls[0].1).unwrap_or_else(|e| panic!("{name} {s}: {e}: {}", calls[0].1));
            assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        }
        let mut extra = json!({"tools": tools(), "tool_choice": "required"});
        extra.as_object_mut().unwrap().extend(s.as_object().unwrap().clone());
        let v = post(srv.addr, "/v1/chat/completions", &chat(extra)).json();
        let calls = calls_of(&v);
        assert!(!calls.is_empty(), "required gave no call: {v}");
        for (n, args) in &calls {
            validate(&schema_of(n), args).unwrap_or_else(|e| panic!("{n}: {e}: {args}"));
        }
    }
}

#[test]
fn streamed_tool_call_and_no_xtml_in_content() {
    let srv = start();
    for seed in [1, 2] {
        let body = chat(json!({"tools": tools(), "tool_choice": "required", "stream": true, "temperature": 1.0, "seed": seed, "parallel_tool_calls": false}));
        let r = post(srv.addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200);
        let mut calls = Vec::new();
        let mut finish = None;
        for ev in r.sse() {
            if ev == "[DONE]" {
                continue;
            }
            let c: Value = serde_json::from_str(&ev).unwrap();
            let d = &c["choices"][0]["delta"];
            if let Some(t) = d["content"].as_str().or(d["reasoning_content"].as_str()) {
                assert!(!t.contains("<|"), "XTML streamed: {t:?}");
            }
            if let Some(tc) = d["tool_calls"].as_array() {
                calls.extend(tc.iter().cloned());
            }
            if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
        assert_eq!(calls.len(), 1, "parallel_tool_calls false: one call");
        let name = calls[0]["function"]["name"].as_str().unwrap();
        let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        validate(&schema_of(name), &args).unwrap();
        assert_eq!(finish.as_deref(), Some("tool_calls"));
    }
}

#[test]
fn response_format_and_guided_extensions() {
    let srv = start();
    let schema = json!({"type": "object", "properties": {
        "character": {"type": "string", "maxLength": 12},
        "act": {"type": "integer", "minimum": 1, "maximum": 5},
        "mood": {"enum": ["merry", "grave"]},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 2}},
        "required": ["character", "act", "mood", "lines"], "additionalProperties": false});
    for s in samplings() {
        let mut extra = json!({"response_format": {"type": "json_schema", "json_schema": {"name": "scene", "strict": true, "schema": schema}}});
        extra.as_object_mut().unwrap().extend(s.as_object().unwrap().clone());
        let v = post(srv.addr, "/v1/chat/completions", &chat(extra)).json();
        let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_else(|| panic!("no content: {v}"));
        let got: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content:?}"));
        validate(&schema, &got).unwrap_or_else(|e| panic!("{e}: {content}"));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
    let choices = ["Montague", "Capulet"];
    let v = post(srv.addr, "/v1/chat/completions", &chat(json!({"guided_choice": choices}))).json();
    assert!(choices.contains(&v["choices"][0]["message"]["content"].as_str().unwrap()), "{v}");
    for (extra, check) in [
        (json!({"guided_regex": "[A-Z]{3}-[0-9]{2}"}), r"^[A-Z]{3}-[0-9]{2}$"),
        (json!({"guided_choice": ["yes", "no"]}), "^(yes|no)$"),
        (json!({"guided_grammar": "start: \"Act \" N \".\"\nN: /[ivx]{1,3}/"}), r"^Act [ivx]{1,3}\.$"),
        (
            json!({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false}}),
            r#"^\{"n":[0-9]\}$"#,
        ),
    ] {
        let mut body = json!({"model": "k3-nano", "prompt": "ROMEO.\n", "max_tokens": 32, "temperature": 1.0, "seed": 5});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let v = post(srv.addr, "/v1/completions", &body).json();
        let text = v["choices"][0]["text"].as_str().unwrap_or_else(|| panic!("{v}"));
        assert!(regex::Regex::new(check).unwrap().is_match(text), "{extra}: {text:?}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn unenforceable_constraints_are_400_naming_the_field() {
    let srv = start();
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let bad_tool = |params: Value| json!([{"type": "function", "function": {"name": "f", "parameters": params}}]);
    for (body, field) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"chat_template_kwargs": {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}}),
            "chat_template_kwargs.response_format.json_schema.schema",
        ),
        (json!({"guided_json": {"type": "string", "format": "no-such-format"}}), "guided_json"),
        (json!({"guided_json": "{not json"}), "guided_json"),
        (json!({"guided_regex": "(["}), "guided_regex"),
        (json!({"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
        (json!({"guided_decoding_backend": "outlines", "guided_regex": "a"}), "guided_decoding_backend"),
        (json!({"tools": bad_tool(json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}))}), "tools[0].function.parameters"),
        (
            json!({"tools": bad_tool(json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 2}}}))}),
            "tools[0].function.parameters.properties.n",
        ),
        (
            json!({"tools": bad_tool(json!({"type": "object", "properties": {"d": {"type": "string", "format": "no-such-format"}}}))}),
            "tools[0].function.parameters.properties.d.format",
        ),
        (
            json!({"tools": bad_tool(json!({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]})), "tool_choice": "required"}),
            "tools[0].function.parameters.required",
        ),
    ] {
        let mut b = body.clone();
        b["messages"] = msgs.clone();
        let r = post(srv.addr, "/v1/chat/completions", &b);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let e = r.json();
        assert_eq!(e["error"]["param"], field, "{body}: {e}");
        assert!(e["error"]["message"].as_str().unwrap().contains(field), "{e}");
    }
    let r = post(srv.addr, "/v1/completions", &json!({"prompt": "x", "guided_regex": "(["}));
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "guided_regex");
}
