//! The XTML prompt renderer: Moonshot's `encoding_k3` semantics (spec §6.4–§6.5).
//!
//! A prompt is built as a list of [`Segment`]s. Control segments (`<|open|>`, `<|close|>`,
//! `<|sep|>`, `<|end_of_msg|>`, image prompts) are encoded with special names recognised; every
//! other piece (tag names, ` key`, `="`, escaped attribute values, `"`, message text) is
//! BPE-encoded on its own with special names treated as plain text, so user text can never
//! produce a control token. Empty pieces are dropped.
//!
//! Order: the `tool-declare` system message (tools deep key-sorted, compact JSON), the
//! `thinking-effort` system message, the messages (tool results first re-sorted into the order
//! of the preceding assistant's `tool_calls` by `tool_call_id`), the `tool-choice` note, the
//! `response-format` note, and the generation stub `open(message role=assistant)` +
//! `open(think)` (thinking) or `open(response)`.
//!
//! Image parts take the next `image_prompts` entry (see [`image_prompt`]) as a control segment,
//! or the literal `<|kimi_image_placeholder|>` when no prompts are given; video parts
//! (`video_url`, `video`) likewise take the next entry (the whole video's chunk blocks) or
//! `<|kimi_k25_video_placeholder|>`. When prompts are given
//! the literal placeholder inside text is also replaced, as in the reference; the count check
//! (prompts given = placeholders consumed) then rejects text that tries to inject an image slot.
//! `developer` messages render as `system`.

use crate::chat::{ChatRequest, RenderOptions};
use crate::error::{Error, Result};
use crate::json::Json;
use crate::pretok::py_isspace;
use crate::tokenizer::Tokenizer;

/// `<|open|>`: starts an XTML open tag.
pub const OPEN: &str = "<|open|>";
/// `<|close|>`: starts an XTML close tag.
pub const CLOSE: &str = "<|close|>";
/// `<|sep|>`: ends an XTML tag.
pub const SEP: &str = "<|sep|>";
/// `<|end_of_msg|>`: ends a message; the model's stop token.
pub const END_OF_MSG: &str = "<|end_of_msg|>";
/// The renderer's image placeholder string (not a vocabulary token).
pub const IMAGE_PLACEHOLDER: &str = "<|kimi_image_placeholder|>";
/// The renderer's video placeholder string (K2.5's name; not a vocabulary token).
pub const VIDEO_PLACEHOLDER: &str = "<|kimi_k25_video_placeholder|>";

/// One piece of a rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// The text.
    pub text: String,
    /// `true`: encoded with special names recognised; `false`: special names are plain text.
    pub control: bool,
}

/// A rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendered {
    /// The prompt text (`apply_chat_template(tokenize=False)`).
    pub text: String,
    /// The prompt ids (each segment encoded on its own).
    pub ids: Vec<u32>,
    /// The segments, in order.
    pub segments: Vec<Segment>,
}

/// The image block for one image, for use as an `image_prompts` entry (spec §3.9):
/// `<|media_begin|>image {W}x{H}<|media_content|>` + `<|media_pad|>` × `n_pads` + `<|media_end|>`,
/// with the original upload width and height.
pub fn image_prompt(width: u32, height: u32, n_pads: usize) -> String {
    format!("<|media_begin|>image {width}x{height}<|media_content|>{}<|media_end|>", "<|media_pad|>".repeat(n_pads))
}

/// Renders `request` and encodes it segment by segment with `tok`.
pub fn render_chat(tok: &Tokenizer, request: &ChatRequest) -> Result<Rendered> {
    for name in [OPEN, CLOSE, SEP, END_OF_MSG] {
        if tok.special_id(name).is_none() {
            return Err(Error::MissingSpecial(name.to_owned()));
        }
    }
    let segments = build_segments(request)?;
    let mut text = String::new();
    let mut ids = Vec::new();
    for s in &segments {
        text.push_str(&s.text);
        tok.encode_into(&s.text, s.control, &mut ids);
    }
    Ok(Rendered { text, ids, segments })
}

/// Builds the segment list of `request` (the tokenizer-independent half of [`render_chat`]).
pub fn build_segments(request: &ChatRequest) -> Result<Vec<Segment>> {
    let opts = request.options()?;
    let messages = reorder_tool_results(&request.messages);
    let mut b = Builder { out: Vec::new(), prompts: opts.image_prompts.clone(), consumed: 0 };

    if let Some(tools) = request.tools.as_ref().filter(|t| !t.is_empty()) {
        b.tool_declare(&Json::Array(tools.clone()).deep_sorted(), false);
    }
    if let Some(effort) = &opts.thinking_effort {
        b.system_note(
            "thinking-effort",
            &format!(
                "`thinking_effort` guides on how much to think in your thinking channel (not including the response \
                 channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with \
                 `thinking_effort={effort}`."
            ),
        );
    }
    b.messages(&messages, opts.thinking)?;
    notes(&mut b, &opts);
    if opts.add_generation_prompt {
        b.open("message", &[("role", "assistant".into())]);
        b.open(if opts.thinking { "think" } else { "response" }, &[]);
    }
    if let Some(p) = &b.prompts {
        if b.consumed != p.len() {
            return Err(Error::request("image_prompts", format!("{} image prompts were given but the messages hold {} images", p.len(), b.consumed)));
        }
    }
    Ok(b.out)
}

/// The `tool-choice` and `response-format` system notes.
fn notes(b: &mut Builder, opts: &RenderOptions) {
    match opts.tool_choice.as_ref().and_then(Json::as_str) {
        Some("required") => b.system_note("tool-choice", "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."),
        Some("none") => b.system_note("tool-choice", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."),
        _ => {}
    }
    let rf = opts.response_format.as_ref();
    let rf_type = match rf {
        Some(Json::Object(_)) => rf.and_then(|r| r.get("type")).and_then(Json::as_str),
        Some(Json::Str(s)) => Some(s.as_str()),
        _ => None,
    };
    const RAW_JSON: &str = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";
    match rf_type {
        Some("json_object") => b.system_note("response-format", &format!("The system is invoked with `response_format=json_object`.\n{RAW_JSON}")),
        Some("json_schema") => {
            let schema = opts.response_schema.clone().or_else(|| rf.and_then(response_schema)).unwrap_or(Json::Null);
            b.system_note(
                "response-format",
                &format!(
                    "The system is invoked with `response_format=json_schema`.\n{RAW_JSON}\nThe JSON data must match the \
                     following schema:\n```json\n{}\n```",
                    schema.deep_sorted().dumps_compact()
                ),
            )
        }
        _ => {}
    }
}

/// `response_format.json_schema.schema` (or `.json_schema`, or the `json_schema` object itself).
fn response_schema(rf: &Json) -> Option<Json> {
    let js = rf.get("json_schema").filter(|j| **j != Json::Null)?;
    if !matches!(js, Json::Object(_)) {
        return Some(js.clone());
    }
    Some(js.get("schema").or_else(|| js.get("json_schema")).unwrap_or(js).clone())
}

/// `&` → `&amp;`, then `"` → `&quot;`.
pub fn escape_attr(value: &str) -> String {
    value.replace('&', "&amp;").replace('"', "&quot;")
}

/// Python `str.strip()`.
fn py_strip(s: &str) -> &str {
    s.trim_matches(py_isspace)
}

fn field_err(field: String, reason: &str) -> Error {
    Error::request(field, reason)
}

/// Re-sorts each run of tool messages into the order of the preceding assistant `tool_calls`,
/// matched by `tool_call_id` (falling back to `id`). A run with any unmatched message is left as
/// is. A matched message's `tool` (and `name`, if present) is set to the matched call's name.
fn reorder_tool_results(messages: &[Json]) -> Vec<Json> {
    let mut out = Vec::with_capacity(messages.len());
    let mut index: Vec<(String, usize, Option<Json>)> = Vec::new(); // (id, 1-based position, name)
    let mut i = 0;
    while i < messages.len() {
        let role = messages[i].get("role").and_then(Json::as_str);
        if role != Some("tool") {
            if role == Some("assistant") {
                index.clear();
                if let Some(Json::Array(calls)) = messages[i].get("tool_calls") {
                    for (pos, call) in calls.iter().enumerate() {
                        let Some(id) = call.get("id").filter(|v| **v != Json::Null).map(Json::python_str) else {
                            continue;
                        };
                        if index.iter().any(|(k, _, _)| *k == id) {
                            continue;
                        }
                        let f = call.get("function").filter(|f| matches!(f, Json::Object(_))).unwrap_or(call);
                        index.push((id, pos + 1, f.get("name").cloned()));
                    }
                }
            }
            out.push(messages[i].clone());
            i += 1;
            continue;
        }
        let start = i;
        while i < messages.len() && messages[i].get("role").and_then(Json::as_str) == Some("tool") {
            i += 1;
        }
        let run = &messages[start..i];
        let matched: Option<Vec<(usize, usize, Option<Json>)>> = run
            .iter()
            .enumerate()
            .map(|(offset, m)| {
                let id = m.get("tool_call_id").or_else(|| m.get("id")).filter(|v| **v != Json::Null)?.python_str();
                index.iter().find(|(k, _, _)| *k == id).map(|(_, pos, name)| (*pos, offset, name.clone()))
            })
            .collect();
        let Some(mut matched) = matched else {
            out.extend(run.iter().cloned());
            continue;
        };
        matched.sort_by_key(|(pos, offset, _)| (*pos, *offset));
        for (_, offset, name) in matched {
            let mut m = run[offset].clone();
            if let (Some(name), Json::Object(fields)) = (name.filter(|n| *n != Json::Null), &mut m) {
                crate::json::insert_ordered(fields, "tool".into(), name.clone());
                if let Some(slot) = fields.iter_mut().find(|(k, _)| k == "name") {
                    slot.1 = name;
                }
            }
            out.push(m);
        }
    }
    out
}

/// Arguments after normalisation: an ordered object, or raw text for a `json` block.
enum Arguments {
    Object(Vec<(String, Json)>),
    RawJson(String),
}

fn normalize_arguments(args: Option<&Json>, field: String) -> Result<Arguments> {
    match args {
        None | Some(Json::Null) => Ok(Arguments::Object(Vec::new())),
        Some(Json::Object(fields)) => Ok(Arguments::Object(fields.clone())),
        Some(Json::Str(s)) if py_strip(s).is_empty() => Ok(Arguments::Object(Vec::new())),
        Some(Json::Str(s)) => match Json::parse(s) {
            Some(Json::Object(fields)) => Ok(Arguments::Object(fields)),
            Some(_) => Err(field_err(field, "must be a JSON object (or a string holding one)")),
            None => Ok(Arguments::RawJson(s.clone())),
        },
        Some(_) => Err(field_err(field, "must be an object or a JSON object string")),
    }
}

fn xtml_type(v: &Json) -> &'static str {
    match v {
        Json::Bool(_) => "boolean",
        Json::Null => "null",
        Json::Int(_) | Json::Float(_) => "number",
        Json::Str(_) => "string",
        Json::Object(_) => "object",
        Json::Array(_) => "array",
    }
}

struct Builder {
    out: Vec<Segment>,
    prompts: Option<Vec<String>>,
    consumed: usize,
}

impl Builder {
    fn seg(&mut self, text: &str, control: bool) {
        if !text.is_empty() {
            self.out.push(Segment { text: text.to_owned(), control });
        }
    }

    fn open(&mut self, tag: &str, attrs: &[(&str, String)]) {
        self.seg(OPEN, true);
        self.seg(tag, false);
        for (key, value) in attrs {
            self.seg(&format!(" {key}"), false);
            self.seg("=\"", false);
            self.seg(&escape_attr(value), false);
            self.seg("\"", false);
        }
        self.seg(SEP, true);
    }

    fn close(&mut self, tag: &str) {
        self.seg(CLOSE, true);
        self.seg(tag, false);
        self.seg(SEP, true);
    }

    fn end_message(&mut self) {
        self.close("message");
        self.seg(END_OF_MSG, true);
    }

    fn next_image(&mut self, field: &str, video: bool) -> Result<String> {
        let Some(prompts) = &self.prompts else {
            return Ok(if video { VIDEO_PLACEHOLDER } else { IMAGE_PLACEHOLDER }.to_owned());
        };
        let p = prompts
            .get(self.consumed)
            .cloned()
            .ok_or_else(|| field_err(field.to_owned(), &format!("more images than the {} image prompts given", prompts.len())))?;
        self.consumed += 1;
        Ok(p)
    }

    /// Message text: plain, except that the placeholder is replaced when prompts are given.
    fn text(&mut self, text: &str, field: &str) -> Result<()> {
        if self.prompts.is_none() || !text.contains(IMAGE_PLACEHOLDER) {
            self.seg(text, false);
            return Ok(());
        }
        let mut parts = text.split(IMAGE_PLACEHOLDER).peekable();
        while let Some(part) = parts.next() {
            self.seg(part, false);
            if parts.peek().is_some() {
                let p = self.next_image(field, false)?;
                self.seg(&p, true);
            }
        }
        Ok(())
    }

    fn content(&mut self, content: Option<&Json>, field: &str) -> Result<()> {
        match content {
            None | Some(Json::Null) => Ok(()),
            Some(Json::Str(s)) => self.text(s, field),
            Some(Json::Array(parts)) => {
                for (i, part) in parts.iter().enumerate() {
                    let pf = format!("{field}[{i}]");
                    let kind = part.get("type").and_then(Json::as_str);
                    if matches!(kind, Some("image" | "image_url" | "video" | "video_url")) {
                        let p = self.next_image(&pf, matches!(kind, Some("video" | "video_url")))?;
                        self.seg(&p, true);
                    } else if let Some(t) = part.get("text").filter(|t| **t != Json::Null) {
                        self.text(&t.python_str(), &pf)?;
                    } else {
                        let why =
                            format!("a content part of type {:?} needs `text` (only text, image and video parts are supported)", kind.unwrap_or("<none>"));
                        return Err(field_err(pf, &why));
                    }
                }
                Ok(())
            }
            Some(_) => Err(field_err(field.to_owned(), "must be a string, an array of content parts, or null")),
        }
    }

    fn system_note(&mut self, kind: &str, body: &str) {
        self.open("message", &[("role", "system".into()), ("type", kind.into())]);
        self.seg(py_strip(body), false);
        self.end_message();
    }

    fn tool_declare(&mut self, tools: &Json, dynamic: bool) {
        let json = tools.dumps_compact();
        let body = if dynamic {
            format!(
                "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\nYou have access to \
                 all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n{json}\n```"
            )
        } else {
            format!("# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{json}\n```")
        };
        self.open("message", &[("role", "system".into()), ("type", "tool-declare".into())]);
        self.seg(&body, false);
        self.end_message();
    }

    fn messages(&mut self, messages: &[Json], thinking: bool) -> Result<()> {
        let mut last_calls: Option<&Vec<Json>> = None;
        let mut tool_index = 0usize;
        for (i, m) in messages.iter().enumerate() {
            let field = format!("messages[{i}]");
            if !matches!(m, Json::Object(_)) {
                return Err(field_err(field, "must be an object"));
            }
            let role = m.get("role").and_then(Json::as_str).ok_or_else(|| field_err(format!("{field}.role"), "is required"))?;
            let name = m.get("name").filter(|n| n.truthy()).map(Json::python_str);
            let content_field = format!("{field}.content");
            match role {
                "system" | "developer" if m.get("tools").is_some_and(Json::truthy) => {
                    let tools = m.get("tools").map(Json::deep_sorted).unwrap_or(Json::Null);
                    self.tool_declare(&tools, true);
                }
                "user" | "system" | "developer" => {
                    let role = if role == "user" { "user" } else { "system" };
                    let mut attrs = vec![("role", role.to_owned())];
                    attrs.extend(name.map(|n| ("name", n)));
                    self.open("message", &attrs);
                    self.content(m.get("content"), &content_field)?;
                    self.end_message();
                }
                "tool" => {
                    tool_index += 1;
                    let explicit = m.get("tool").or_else(|| m.get("name")).filter(|n| **n != Json::Null);
                    let tool_name = match explicit {
                        Some(n) => n.python_str(),
                        None => {
                            let call = last_calls.and_then(|c| c.get(tool_index - 1));
                            let f = call.map(|c| c.get("function").unwrap_or(c));
                            f.and_then(|f| f.get("name"))
                                .map(Json::python_str)
                                .ok_or_else(|| field_err(field.clone(), "a tool message needs `tool`/`name` or a matching assistant tool_call"))?
                        }
                    };
                    self.open("message", &[("role", "tool".into()), ("tool", tool_name), ("index", tool_index.to_string())]);
                    self.content(m.get("content"), &content_field)?;
                    self.end_message();
                }
                "assistant" => {
                    last_calls = match m.get("tool_calls") {
                        Some(Json::Array(c)) => Some(c),
                        _ => None,
                    };
                    tool_index = 0;
                    let mut attrs = vec![("role", "assistant".to_owned())];
                    attrs.extend(name.map(|n| ("name", n)));
                    self.open("message", &attrs);
                    self.assistant(m, thinking, &field)?;
                    self.end_message();
                }
                other => return Err(field_err(format!("{field}.role"), &format!("unsupported role {other:?}"))),
            }
        }
        Ok(())
    }

    fn assistant(&mut self, m: &Json, thinking: bool, field: &str) -> Result<()> {
        if thinking {
            let reasoning = m.get("reasoning_content").filter(|r| r.truthy()).or_else(|| m.get("reasoning"));
            self.open("think", &[]);
            if let Some(r) = reasoning.filter(|r| **r != Json::Null) {
                let r = r.python_str();
                if !py_strip(&r).is_empty() {
                    self.text(&r, &format!("{field}.reasoning_content"))?;
                }
            }
            self.close("think");
        }
        self.open("response", &[]);
        self.content(m.get("content"), &format!("{field}.content"))?;
        self.close("response");
        let calls = match m.get("tool_calls") {
            None | Some(Json::Null) => return Ok(()),
            Some(Json::Array(c)) if c.is_empty() => return Ok(()),
            Some(Json::Array(c)) => c,
            Some(_) => return Err(field_err(format!("{field}.tool_calls"), "must be an array")),
        };
        self.open("tools", &[]);
        for (i, call) in calls.iter().enumerate() {
            let cf = format!("{field}.tool_calls[{i}]");
            if !matches!(call, Json::Object(_)) {
                return Err(field_err(cf, "must be an object"));
            }
            let (f, ff) = match call.get("function") {
                Some(f @ Json::Object(_)) => (f, format!("{cf}.function")),
                _ => (call, cf.clone()),
            };
            let name = f.get("name").filter(|n| **n != Json::Null).ok_or_else(|| field_err(format!("{ff}.name"), "is required"))?;
            let args = normalize_arguments(f.get("arguments"), format!("{ff}.arguments"))?;
            self.open("call", &[("tool", name.python_str()), ("index", (i + 1).to_string())]);
            match args {
                Arguments::RawJson(raw) => {
                    self.open("json", &[("type", "object".into())]);
                    self.text(&raw, &ff)?;
                    self.close("json");
                }
                Arguments::Object(fields) => {
                    for (key, value) in fields {
                        self.open("argument", &[("key", key), ("type", xtml_type(&value).into())]);
                        let text = match &value {
                            Json::Str(s) => s.clone(),
                            other => other.dumps(),
                        };
                        self.text(&text, &ff)?;
                        self.close("argument");
                    }
                }
            }
            self.close("call");
        }
        self.close("tools");
        Ok(())
    }
}
