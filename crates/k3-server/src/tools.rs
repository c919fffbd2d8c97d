//! Validation of the chat request's tool and output-format options, as OpenAI does it: `tools`
//! (each a `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`
//! with a unique name and a JSON-Schema-shaped `parameters`), `tool_choice` (`none`, `auto`,
//! `required`, or `{"type": "function", "function": {"name": N}}` naming a declared tool),
//! `response_format` (`text`, `json_object`, or `json_schema` with its `json_schema.name` and
//! `json_schema.schema`) and `response_schema`. The same rules apply to the copies the renderer
//! reads from `chat_template_kwargs` (which win over the top level there), so they cannot slip
//! past the top-level checks. Every error is a 400 naming the exact path, e.g.
//! `tools[0].function.parameters.type`.

use serde_json::{Map, Value};

use crate::error::{bad_param, Result};
use crate::params::Fields;

const SCHEMA_TYPES: &[&str] = &["object", "array", "string", "number", "integer", "boolean", "null"];

/// Checks `tools`, `tool_choice`, `response_format` and `response_schema`, at the top level and
/// inside `chat_template_kwargs`.
pub fn check_chat_options(f: &Fields) -> Result<()> {
    let names = check_tools(f.get("tools"))?;
    let kwargs = f.object("chat_template_kwargs")?;
    let scopes: Vec<(&Map<String, Value>, &str)> = std::iter::once((f.0, "")).chain(kwargs.map(|k| (k.0, "chat_template_kwargs."))).collect();
    for (m, prefix) in scopes {
        let get = |k: &str| m.get(k).filter(|v| !v.is_null());
        if let Some(v) = get("tool_choice") {
            check_tool_choice(v, &names, &format!("{prefix}tool_choice"))?;
        }
        if let Some(v) = get("response_format") {
            check_response_format(v, &format!("{prefix}response_format"))?;
        }
        if let Some(v) = get("response_schema") {
            check_schema(v, &format!("{prefix}response_schema"))?;
        }
        for k in ["thinking", "enable_thinking", "add_generation_prompt"] {
            if get(k).is_some_and(|v| !v.is_boolean()) {
                return Err(bad_param(format!("{prefix}{k}"), "must be true or false"));
            }
        }
    }
    Ok(())
}

/// The declared tool names, after checking every declaration.
fn check_tools(tools: Option<&Value>) -> Result<Vec<String>> {
    let tools = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(bad_param("tools", "must be an array of tool declarations")),
    };
    let mut names: Vec<String> = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let at = |k: &str| format!("tools[{i}]{k}");
        let Value::Object(t) = t else { return Err(bad_param(at(""), "must be an object {\"type\": \"function\", \"function\": {...}}")) };
        match t.get("type") {
            Some(Value::String(s)) if s == "function" => {}
            Some(Value::String(s)) => return Err(bad_param(at(".type"), format!("unsupported tool type {s:?}; only \"function\" is supported"))),
            Some(_) => return Err(bad_param(at(".type"), "must be the string \"function\"")),
            None => return Err(bad_param(at(".type"), "is required (\"function\")")),
        }
        let Some(Value::Object(fun)) = t.get("function") else {
            return Err(bad_param(at(".function"), "is required: an object with `name` and optional `description`, `parameters`, `strict`"));
        };
        let name = match fun.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n,
            _ => return Err(bad_param(at(".function.name"), "is required (a non-empty string)")),
        };
        if name.len() > 64 || !name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c)) {
            return Err(bad_param(at(".function.name"), format!("{name:?} is invalid: use at most 64 letters, digits, `_`, `-` or `.`")));
        }
        if names.contains(name) {
            return Err(bad_param(at(".function.name"), format!("the tool {name:?} is declared twice")));
        }
        if fun.get("description").is_some_and(|d| !d.is_string() && !d.is_null()) {
            return Err(bad_param(at(".function.description"), "must be a string"));
        }
        if fun.get("strict").is_some_and(|d| !d.is_boolean() && !d.is_null()) {
            return Err(bad_param(at(".function.strict"), "must be true or false"));
        }
        if let Some(p) = fun.get("parameters").filter(|p| !p.is_null()) {
            check_schema(p, &at(".function.parameters"))?;
        }
        names.push(name.clone());
    }
    Ok(names)
}

fn check_tool_choice(v: &Value, names: &[String], param: &str) -> Result<()> {
    let need_tools = |what: &str| bad_param(param, format!("{what} needs `tools`: declare the functions the model may call"));
    match v {
        Value::String(s) if s == "none" || s == "auto" => Ok(()),
        Value::String(s) if s == "required" => {
            if names.is_empty() {
                return Err(need_tools("\"required\""));
            }
            Ok(())
        }
        Value::Object(o) => {
            match o.get("type") {
                Some(Value::String(t)) if t == "function" => {}
                _ => return Err(bad_param(format!("{param}.type"), "is required and must be \"function\"")),
            }
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            let Some(name) = name.filter(|n| !n.is_empty()) else {
                return Err(bad_param(format!("{param}.function.name"), "is required: the name of a declared tool"));
            };
            if names.is_empty() {
                return Err(need_tools("a named function"));
            }
            if !names.iter().any(|n| n == name) {
                return Err(bad_param(format!("{param}.function.name"), format!("{name:?} is not a declared tool (declared: {})", names.join(", "))));
            }
            Ok(())
        }
        _ => Err(bad_param(param, "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")),
    }
}

fn check_response_format(v: &Value, param: &str) -> Result<()> {
    let Value::Object(o) = v else { return Err(bad_param(param, "must be an object with `type`")) };
    match o.get("type") {
        Some(Value::String(t)) if t == "text" || t == "json_object" => Ok(()),
        Some(Value::String(t)) if t == "json_schema" => {
            let js = format!("{param}.json_schema");
            let Some(Value::Object(s)) = o.get("json_schema") else {
                return Err(bad_param(js, "is required for type json_schema: an object with `name` and `schema`"));
            };
            match s.get("name") {
                Some(Value::String(n)) if !n.is_empty() => {}
                _ => return Err(bad_param(format!("{js}.name"), "is required (a non-empty string)")),
            }
            if s.get("strict").is_some_and(|d| !d.is_boolean() && !d.is_null()) {
                return Err(bad_param(format!("{js}.strict"), "must be true or false"));
            }
            match s.get("schema") {
                Some(schema) if !schema.is_null() => check_schema(schema, &format!("{js}.schema")),
                _ => Err(bad_param(format!("{js}.schema"), "is required: the JSON Schema the output must follow")),
            }
        }
        Some(Value::String(t)) => Err(bad_param(format!("{param}.type"), format!("unsupported type {t:?} (text, json_object or json_schema)"))),
        Some(_) => Err(bad_param(format!("{param}.type"), "must be a string")),
        None => Err(bad_param(format!("{param}.type"), "is required")),
    }
}

/// The shape of a JSON Schema: an object whose `type`, `properties`, `items`, `required`,
/// `enum` and combinators have the right kinds, recursively.
fn check_schema(v: &Value, param: &str) -> Result<()> {
    check_schema_depth(v, param, 0)
}

fn check_schema_depth(v: &Value, param: &str, depth: usize) -> Result<()> {
    if depth > 32 {
        return Err(bad_param(param, "the schema is nested more than 32 levels deep"));
    }
    let Value::Object(o) = v else {
        return Err(bad_param(param, "must be a JSON Schema object (e.g. {\"type\": \"object\", \"properties\": {...}})"));
    };
    let at = |k: &str| format!("{param}.{k}");
    match o.get("type") {
        None => {}
        Some(Value::String(t)) if SCHEMA_TYPES.contains(&t.as_str()) => {}
        Some(Value::Array(ts)) if ts.iter().all(|t| t.as_str().is_some_and(|t| SCHEMA_TYPES.contains(&t))) => {}
        Some(_) => return Err(bad_param(at("type"), format!("must be one of {} (or a list of them)", SCHEMA_TYPES.join(", ")))),
    }
    match o.get("properties") {
        None => {}
        Some(Value::Object(props)) => {
            for (k, p) in props {
                check_schema_depth(p, &format!("{param}.properties.{k}"), depth + 1)?;
            }
        }
        Some(_) => return Err(bad_param(at("properties"), "must be an object mapping names to schemas")),
    }
    match o.get("items") {
        None | Some(Value::Bool(_)) => {}
        Some(Value::Array(items)) => {
            for (i, p) in items.iter().enumerate() {
                check_schema_depth(p, &format!("{param}.items[{i}]"), depth + 1)?;
            }
        }
        Some(p) => check_schema_depth(p, &at("items"), depth + 1)?,
    }
    if let Some(r) = o.get("required") {
        if !r.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
            return Err(bad_param(at("required"), "must be a list of property names"));
        }
    }
    if o.get("enum").is_some_and(|e| !e.is_array()) {
        return Err(bad_param(at("enum"), "must be a list of values"));
    }
    for k in ["anyOf", "oneOf", "allOf"] {
        match o.get(k) {
            None => {}
            Some(Value::Array(a)) => {
                for (i, p) in a.iter().enumerate() {
                    check_schema_depth(p, &format!("{param}.{k}[{i}]"), depth + 1)?;
                }
            }
            Some(_) => return Err(bad_param(at(k), "must be a list of schemas")),
        }
    }
    Ok(())
}
