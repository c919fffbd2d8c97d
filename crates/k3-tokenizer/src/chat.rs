//! The chat request accepted by the renderer, and how its options resolve (spec §6.4, §7.1).
//!
//! A [`ChatRequest`] is read from an OpenAI-style chat request: `messages`, `tools`,
//! `tool_choice`, `response_format`, `reasoning_effort` and `chat_template_kwargs`. The renderer
//! options `thinking`, `enable_thinking`, `thinking_effort`, `add_generation_prompt`,
//! `image_prompts` (and `tool_choice`, `response_format`, `response_schema`) may appear either at
//! the top level or inside `chat_template_kwargs`; the `chat_template_kwargs` value wins when both
//! are given, because it is the explicit template argument. Other fields (`model`,
//! `temperature`, ...) are ignored.
//!
//! Option resolution ([`ChatRequest::options`]), as serving layers map requests onto
//! `encoding_k3.build_chat_segments`:
//! - `thinking` (else `enable_thinking`) defaults to `true`; `reasoning_effort: "none"` turns it off.
//! - `thinking_effort` defaults to `reasoning_effort`, else to `max`. An explicit
//!   `thinking_effort: null` means "no effort message".
//! - While thinking is on, the effort must be `low`, `high` or `max`; anything else (including
//!   `medium`) is rejected with an error that names the field it came from. With thinking off
//!   the effort is unused and not checked, as in the reference renderer.

use crate::error::{Error, Result};
use crate::json::Json;
use serde::de::{Deserialize, Deserializer};

/// The thinking efforts K3 accepts.
pub const VALID_EFFORTS: [&str; 3] = ["low", "high", "max"];

/// A chat request, as parsed from JSON. Messages and schemas stay as ordered JSON, so that
/// every shape the reference renderer accepts (string or part-list content, arguments as an
/// object or a JSON string, ...) is kept exactly.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    /// The conversation (`messages`), each an object with a `role`.
    pub messages: Vec<Json>,
    /// Tool declarations (`tools`), OpenAI format.
    pub tools: Option<Vec<Json>>,
    /// The whole request object, for option lookup.
    raw: Json,
}

/// The renderer options after resolution (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct RenderOptions {
    /// Whether the think channel is rendered and the generation stub opens `think`.
    pub thinking: bool,
    /// The effort written in the `thinking-effort` system message; `None` omits the message.
    pub thinking_effort: Option<String>,
    /// Whether to append the generation stub.
    pub add_generation_prompt: bool,
    /// Replacement for each image part, in order (`None`: the literal placeholder string).
    pub image_prompts: Option<Vec<String>>,
    /// `tool_choice` (`"required"` and `"none"` add a system note).
    pub tool_choice: Option<Json>,
    /// `response_format` (`json_object` / `json_schema` add a system note).
    pub response_format: Option<Json>,
    /// An explicit `response_schema`, overriding the one inside `response_format`.
    pub response_schema: Option<Json>,
}

impl ChatRequest {
    /// Parses a request from JSON text.
    pub fn from_json_str(text: &str) -> Result<ChatRequest> {
        let raw: Json = serde_json::from_str(text).map_err(|e| Error::request("<request>", format!("not valid JSON: {e}")))?;
        ChatRequest::from_json(raw)
    }

    /// Builds a request from an already parsed JSON object.
    pub fn from_json(raw: Json) -> Result<ChatRequest> {
        if !matches!(raw, Json::Object(_)) {
            return Err(Error::request("<request>", "the request must be a JSON object"));
        }
        let messages = match raw.get("messages") {
            Some(Json::Array(m)) => m.clone(),
            Some(_) => return Err(Error::request("messages", "must be an array of message objects")),
            None => return Err(Error::request("messages", "is required")),
        };
        let tools = match raw.get("tools") {
            None | Some(Json::Null) => None,
            Some(Json::Array(t)) => Some(t.clone()),
            Some(_) => return Err(Error::request("tools", "must be an array of tool declarations")),
        };
        let request = ChatRequest { messages, tools, raw };
        request.options()?; // reject invalid options at parse time
        Ok(request)
    }

    /// A request with just these messages and default options.
    pub fn from_messages(messages: Vec<Json>) -> ChatRequest {
        let raw = Json::Object(vec![("messages".into(), Json::Array(messages.clone()))]);
        ChatRequest { messages, tools: None, raw }
    }

    /// Sets the `image_prompts` option (a serving layer that encodes the images itself decides
    /// them): any value the client gave, at the top level or in `chat_template_kwargs`, is
    /// dropped; `None` leaves image parts as the literal placeholder.
    pub fn set_image_prompts(&mut self, prompts: Option<Vec<String>>) {
        if let Json::Object(fields) = &mut self.raw {
            fields.retain(|(k, _)| k != "image_prompts");
            for (k, v) in fields.iter_mut() {
                if let (true, Json::Object(kw)) = (k == "chat_template_kwargs", v) {
                    kw.retain(|(k, _)| k != "image_prompts");
                }
            }
            if let Some(p) = prompts {
                fields.push(("image_prompts".into(), Json::Array(p.into_iter().map(Json::Str).collect())));
            }
        }
    }

    /// Looks an option up in `chat_template_kwargs`, then at the top level.
    /// Returns the value and the field path it came from.
    fn lookup(&self, key: &str) -> Option<(&Json, String)> {
        if let Some(v) = self.raw.get("chat_template_kwargs").and_then(|kw| kw.get(key)) {
            return Some((v, format!("chat_template_kwargs.{key}")));
        }
        self.raw.get(key).map(|v| (v, key.to_owned()))
    }

    fn lookup_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.lookup(key) {
            None | Some((Json::Null, _)) => Ok(None),
            Some((Json::Bool(b), _)) => Ok(Some(*b)),
            Some((_, field)) => Err(Error::request(field, "must be true or false")),
        }
    }

    fn lookup_opt_string(&self, key: &str) -> Result<Option<(Option<String>, String)>> {
        match self.lookup(key) {
            None => Ok(None),
            Some((Json::Null, field)) => Ok(Some((None, field))),
            Some((Json::Str(s), field)) => Ok(Some((Some(s.clone()), field))),
            Some((_, field)) => Err(Error::request(field, "must be a string")),
        }
    }

    /// Resolves the renderer options (see the module docs for the rules).
    pub fn options(&self) -> Result<RenderOptions> {
        let mut thinking = match self.lookup_bool("thinking")? {
            Some(t) => t,
            None => self.lookup_bool("enable_thinking")?.unwrap_or(true),
        };
        let reasoning_effort = self.lookup_opt_string("reasoning_effort")?;
        let mut effort: (Option<String>, String) = (Some("max".into()), "thinking_effort".into());
        match &reasoning_effort {
            Some((Some(e), _)) if e == "none" => thinking = false,
            Some((Some(e), field)) => effort = (Some(e.clone()), field.clone()),
            _ => {}
        }
        if let Some(explicit) = self.lookup_opt_string("thinking_effort")? {
            effort = explicit;
        }
        if thinking {
            if let (Some(e), field) = &effort {
                if !VALID_EFFORTS.contains(&e.as_str()) {
                    return Err(Error::request(field.clone(), format!("unsupported thinking effort {e:?}; K3 supports low, high and max")));
                }
            }
        }
        let image_prompts = match self.lookup("image_prompts") {
            None | Some((Json::Null, _)) => None,
            Some((Json::Array(items), field)) => Some(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, p)| p.as_str().map(str::to_owned).ok_or_else(|| Error::request(format!("{field}[{i}]"), "must be a string")))
                    .collect::<Result<Vec<_>>>()?,
            ),
            Some((_, field)) => return Err(Error::request(field, "must be an array of strings")),
        };
        let non_null = |key: &str| self.lookup(key).map(|(v, _)| v.clone()).filter(|v| *v != Json::Null);
        Ok(RenderOptions {
            thinking,
            thinking_effort: if thinking { effort.0 } else { None },
            add_generation_prompt: self.lookup_bool("add_generation_prompt")?.unwrap_or(true),
            image_prompts,
            tool_choice: non_null("tool_choice"),
            response_format: non_null("response_format"),
            response_schema: non_null("response_schema"),
        })
    }

    /// Whether the output parser should return tool calls: `tools` is non-empty and
    /// `tool_choice` is not `"none"`.
    pub fn tools_declared(&self) -> bool {
        let none = matches!(self.lookup("tool_choice"), Some((Json::Str(s), _)) if s == "none");
        self.tools.as_ref().is_some_and(|t| !t.is_empty()) && !none
    }
}

impl<'de> Deserialize<'de> for ChatRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let raw = Json::deserialize(deserializer)?;
        ChatRequest::from_json(raw).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(text: &str) -> Result<ChatRequest> {
        ChatRequest::from_json_str(text)
    }

    #[test]
    fn set_image_prompts_overrides_the_client() {
        let mut r = req(r#"{"messages": [], "image_prompts": ["a"], "chat_template_kwargs": {"image_prompts": ["b"], "thinking": false}}"#).unwrap();
        r.set_image_prompts(Some(vec!["x".into(), "y".into()]));
        let o = r.options().unwrap();
        assert_eq!(o.image_prompts, Some(vec!["x".to_owned(), "y".to_owned()]));
        assert!(!o.thinking);
        r.set_image_prompts(None);
        assert_eq!(r.options().unwrap().image_prompts, None);
    }

    #[test]
    fn defaults_thinking_on_effort_max() {
        let o = req(r#"{"messages": []}"#).unwrap().options().unwrap();
        assert!(o.thinking && o.add_generation_prompt);
        assert_eq!(o.thinking_effort.as_deref(), Some("max"));
    }

    #[test]
    fn ultra_is_rejected_naming_the_field() {
        for (body, field) in [
            (r#"{"messages": [], "thinking_effort": "ultra"}"#, "`thinking_effort`"),
            (r#"{"messages": [], "reasoning_effort": "ultra"}"#, "`reasoning_effort`"),
            (r#"{"messages": [], "chat_template_kwargs": {"thinking_effort": "medium"}}"#, "`chat_template_kwargs.thinking_effort`"),
        ] {
            let msg = req(body).unwrap_err().to_string();
            assert!(msg.contains(field), "{msg}");
        }
    }

    #[test]
    fn effort_sources_and_overrides() {
        let o = req(r#"{"messages": [], "reasoning_effort": "low"}"#).unwrap().options().unwrap();
        assert_eq!(o.thinking_effort.as_deref(), Some("low"));
        let o = req(r#"{"messages": [], "reasoning_effort": "none"}"#).unwrap().options().unwrap();
        assert!(!o.thinking);
        let o = req(r#"{"messages": [], "thinking_effort": null}"#).unwrap().options().unwrap();
        assert_eq!(o.thinking_effort, None);
        let o =
            req(r#"{"messages": [], "thinking": true, "chat_template_kwargs": {"thinking": false, "thinking_effort": "bogus"}}"#).unwrap().options().unwrap();
        assert!(!o.thinking);
    }

    #[test]
    fn bad_shapes_name_their_field() {
        assert!(req(r#"{"messages": [], "thinking": "yes"}"#).unwrap_err().to_string().contains("`thinking`"));
        assert!(req(r#"{"tools": []}"#).unwrap_err().to_string().contains("`messages`"));
        assert!(req(r#"{"messages": [], "image_prompts": [1]}"#).unwrap_err().to_string().contains("image_prompts[0]"));
    }
}
