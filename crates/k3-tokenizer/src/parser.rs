//! The output parser: generated ids → `reasoning_content`, `content`, `tool_calls` (spec §7.2–§7.3).
//!
//! The parser works on ids, token by token, so a marker is only ever a real special id:
//! `<|open|>` or `<|close|>`, a tag header in BPE text (`think`, `call tool="f" index="1"`, ...;
//! whitespace around it is tolerated), then `<|sep|>`. The same text typed as plain BPE is text.
//! [`OutputParser`] streams deltas; [`parse_output`] runs it over a whole output.
//!
//! Agreed behaviour of vLLM 0.33 and SGLang 0.5.23, followed exactly: with thinking on, output
//! starts inside reasoning, which ends at the first `<|close|>think<|sep|>`; the response wrapper
//! is stripped; a truncated response keeps its body and a truncated reasoning is all reasoning;
//! a call needs `tool="…"` and its `<|close|>call<|sep|>`, and an argument needs its
//! `<|close|>argument<|sep|>`; `type="string"` values stay raw, other values are JSON-decoded
//! with the raw string as fallback; attributes are unescaped `&quot;` first, then `&amp;`.
//!
//! Where the two engines disagree we choose, in the user's interest:
//! 1. think never closed, then `<|open|>response<|sep|>`: the text before it is reasoning and the
//!    body is content (SGLang; vLLM loses the reasoning).
//! 2. a `tools` channel when no tools were declared (or `tool_choice=none`): the channel is
//!    dropped and content is the response body (vLLM; SGLang leaks raw XTML into content).
//! 3. a length stop inside a marker (e.g. after `<|close|>response`): the partial marker is
//!    dropped (SGLang).
//! 4. thinking on and `<|close|>response<|sep|>` arrives while think was never closed: the text
//!    was the answer, so [`ParsedOutput`] reports it as content (SGLang). A streaming client has
//!    already received it as reasoning deltas; the final aggregate moves it.
//! 5. `<|open|>tools<|sep|>` while think is still open: reasoning ends there and the calls are
//!    parsed (SGLang).
//!
//! Further choices: spec §7.3's `json` block (`<|open|>json type="object"<|sep|>RAW…`) yields RAW
//! (re-serialised) when RAW is a JSON object, else `"{}"` as both engines return. Markup that is
//! not understood never reaches `content`; inside reasoning and argument values it is kept as
//! literal text, so nothing the model wrote in those channels is lost. Other special ids
//! (`[EOS]`, media, reserved) are dropped; `<|end_of_msg|>` and `<|close|>message<|sep|>` end parsing.

use crate::json::{insert_ordered, Json};
use crate::stream::Utf8Stream;
use crate::tokenizer::Tokenizer;
use crate::xtml::{CLOSE, END_OF_MSG, OPEN, SEP};

/// Longest tag header (bytes between `<|open|>`/`<|close|>` and `<|sep|>`) taken as a marker.
const MAX_HEADER: usize = 1024;

/// One parsed tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// An id unique within the output: the parser's prefix + the call's position.
    pub id: String,
    /// 0-based position among the calls of this output (the OpenAI streaming `index`).
    pub index: usize,
    /// The function name (unescaped `tool` attribute).
    pub name: String,
    /// The arguments as a JSON object string, Python `json.dumps` style, in emitted order.
    pub arguments: String,
}

/// The parse of a whole output.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParsedOutput {
    /// The think channel, `None` when empty.
    pub reasoning_content: Option<String>,
    /// The response channel, `None` when empty.
    pub content: Option<String>,
    /// Well-formed tool calls (only when tools were declared).
    pub tool_calls: Vec<ToolCall>,
}

/// A streaming event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputDelta {
    /// More reasoning text.
    Reasoning(String),
    /// More content text.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// Parses a complete output. `thinking`: the prompt's stub opened `think` (else `response`).
/// `tools_declared`: the request declared tools and `tool_choice` is not `none`.
pub fn parse_output(tok: &Tokenizer, ids: &[u32], thinking: bool, tools_declared: bool) -> ParsedOutput {
    let mut p = OutputParser::new(tok, thinking, tools_declared);
    for &id in ids {
        p.push(id);
    }
    p.finish();
    p.result()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Reasoning,
    Between,
    Response,
    Tools,
    Call,
    Argument,
    Json,
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Open,
    Close,
}

#[derive(Debug, Clone)]
struct CallBuilder {
    name: Option<String>,
    args: Vec<(String, Json)>,
    json_raw: Option<String>,
}

/// A streaming output parser (see the module docs). Feed ids with [`OutputParser::push`], end
/// with [`OutputParser::finish`]; [`OutputParser::result`] gives the aggregate.
#[derive(Debug, Clone)]
pub struct OutputParser<'a> {
    tok: &'a Tokenizer,
    ids: [Option<u32>; 4], // open, close, sep, end_of_msg
    tools_declared: bool,
    id_prefix: String,
    phase: Phase,
    /// A marker whose header is being read: kind and header bytes.
    header: Option<(Marker, Vec<u8>)>,
    reasoning_stream: Utf8Stream,
    content_stream: Utf8Stream,
    /// Key, type and value bytes of the open argument (or raw bytes of a json block).
    arg: Option<(Option<String>, Option<String>, Vec<u8>)>,
    call: Option<CallBuilder>,
    out: ParsedOutput,
    reasoning: String,
    content: String,
    pending: Vec<OutputDelta>,
}

impl<'a> OutputParser<'a> {
    /// A parser for one output (arguments as for [`parse_output`]).
    pub fn new(tok: &'a Tokenizer, thinking: bool, tools_declared: bool) -> Self {
        OutputParser {
            tok,
            ids: [OPEN, CLOSE, SEP, END_OF_MSG].map(|n| tok.special_id(n)),
            tools_declared,
            id_prefix: "call_".into(),
            phase: if thinking { Phase::Reasoning } else { Phase::Response },
            header: None,
            reasoning_stream: Utf8Stream::new(),
            content_stream: Utf8Stream::new(),
            arg: None,
            call: None,
            out: ParsedOutput::default(),
            reasoning: String::new(),
            content: String::new(),
            pending: Vec::new(),
        }
    }

    /// Sets the tool-call id prefix (default `call_`); ids are prefix + position.
    pub fn with_id_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.id_prefix = prefix.into();
        self
    }

    /// Adds one generated id; returns the deltas it completes. Unknown ids are ignored.
    pub fn push(&mut self, id: u32) -> Vec<OutputDelta> {
        let [open, close, sep, eom] = self.ids;
        let is = |x: Option<u32>| x == Some(id);
        if is(open) || is(close) {
            self.abort_header();
            self.header = Some((if is(open) { Marker::Open } else { Marker::Close }, Vec::new()));
        } else if is(sep) {
            match self.header.take() {
                Some((kind, bytes)) => self.tag(kind, &bytes),
                None => self.literal(SEP.as_bytes()),
            }
        } else if is(eom) {
            self.abort_header();
            self.end();
        } else if self.tok.is_special(id) {
            // Other special ids carry no text the user should see.
        } else if let Some(bytes) = self.tok.token_bytes(id) {
            match &mut self.header {
                Some((_, h)) if h.len() + bytes.len() <= MAX_HEADER => h.extend_from_slice(bytes),
                Some(_) => {
                    self.abort_header();
                    self.text(bytes);
                }
                None => self.text(bytes),
            }
        }
        std::mem::take(&mut self.pending)
    }

    /// Ends the output: flushes held-back text, drops a partial marker and any unfinished call.
    pub fn finish(&mut self) -> Vec<OutputDelta> {
        self.header = None;
        self.flush_streams();
        self.arg = None;
        self.call = None;
        self.phase = Phase::Done;
        std::mem::take(&mut self.pending)
    }

    /// The aggregate so far (complete after [`OutputParser::finish`]).
    pub fn result(&self) -> ParsedOutput {
        let mut out = self.out.clone();
        out.reasoning_content = Some(self.reasoning.clone()).filter(|s| !s.is_empty());
        out.content = Some(self.content.clone()).filter(|s| !s.is_empty());
        out
    }

    fn emit_reasoning(&mut self, s: String) {
        if !s.is_empty() {
            self.reasoning.push_str(&s);
            self.pending.push(OutputDelta::Reasoning(s));
        }
    }

    fn emit_content(&mut self, s: String) {
        if !s.is_empty() {
            self.content.push_str(&s);
            self.pending.push(OutputDelta::Content(s));
        }
    }

    fn flush_streams(&mut self) {
        let r = self.reasoning_stream.finish();
        self.emit_reasoning(r);
        let c = self.content_stream.finish();
        self.emit_content(c);
    }

    fn set_phase(&mut self, phase: Phase) {
        if phase != self.phase {
            self.flush_streams();
            self.phase = phase;
        }
    }

    /// Plain text bytes in the current phase.
    fn text(&mut self, bytes: &[u8]) {
        match self.phase {
            Phase::Reasoning => {
                let s = self.reasoning_stream.push(bytes);
                self.emit_reasoning(s);
            }
            Phase::Between if bytes.iter().all(u8::is_ascii_whitespace) => {}
            Phase::Response | Phase::Between => {
                self.phase = Phase::Response;
                let s = self.content_stream.push(bytes);
                self.emit_content(s);
            }
            Phase::Argument | Phase::Json => {
                if let Some((_, _, v)) = &mut self.arg {
                    v.extend_from_slice(bytes);
                }
            }
            Phase::Tools | Phase::Call | Phase::Done => {}
        }
    }

    /// Markup that is not understood: literal text in reasoning and argument values, else dropped.
    fn literal(&mut self, bytes: &[u8]) {
        if matches!(self.phase, Phase::Reasoning | Phase::Argument | Phase::Json) {
            self.text(bytes);
        }
    }

    fn marker_text(kind: Marker, header: &[u8], with_sep: bool) -> Vec<u8> {
        let mut v = if kind == Marker::Open { OPEN } else { CLOSE }.as_bytes().to_vec();
        v.extend_from_slice(header);
        if with_sep {
            v.extend_from_slice(SEP.as_bytes());
        }
        v
    }

    /// A marker interrupted before its `<|sep|>`: not a marker after all.
    fn abort_header(&mut self) {
        if let Some((kind, h)) = self.header.take() {
            self.literal(&Self::marker_text(kind, &h, false));
        }
    }

    fn end(&mut self) {
        self.arg = None;
        self.call = None;
        self.set_phase(Phase::Done);
    }

    /// A complete marker `kind header <|sep|>`.
    fn tag(&mut self, kind: Marker, header: &[u8]) {
        let header_text = String::from_utf8_lossy(header);
        let (name, attrs) = parse_header(&header_text);
        use Marker::{Close, Open};
        use Phase::*;
        match (self.phase, kind, name) {
            (Done, _, _) => {}
            // Inside a value only its own close (or the call's) is structure.
            (Argument, Close, "argument") => self.finish_argument(),
            (Json, Close, "json") => {
                if let (Some((_, _, raw)), Some(call)) = (self.arg.take(), self.call.as_mut()) {
                    call.json_raw = Some(String::from_utf8_lossy(&raw).into_owned());
                }
                self.set_phase(Call);
            }
            (Argument | Json, Close, "call") => {
                self.arg = None;
                self.finish_call();
            }
            (Argument | Json, _, _) => self.text(&Self::marker_text(kind, header, true)),
            // Reasoning.
            (Reasoning, Close, "think") => self.set_phase(Between),
            (Reasoning, Open, "response") => self.set_phase(Response),
            (Reasoning, Open, "tools") => self.set_phase(Tools),
            (Reasoning, Close, "response") => {
                // Choice 4: what looked like reasoning was the answer (only before any content).
                self.set_phase(Between);
                if self.content.is_empty() {
                    self.content = std::mem::take(&mut self.reasoning);
                }
            }
            (Reasoning, Close, "message") => self.end(),
            (Reasoning, Open, "think") => {}
            (Reasoning, _, _) => self.text(&Self::marker_text(kind, header, true)),
            // Channels.
            (_, Close, "message") => self.end(),
            (Between | Response, Open, "think") => self.set_phase(Reasoning),
            (_, Open, "response") => {
                self.call = None;
                self.set_phase(Response);
            }
            (Response, Close, "response") => self.set_phase(Between),
            (Between | Response, Open, "tools") => self.set_phase(Tools),
            (Tools | Call, Close, "tools") => {
                self.call = None;
                self.set_phase(Between);
            }
            (Tools | Call | Between | Response, Open, "call") => {
                let name = attr(&attrs, "tool");
                self.call = Some(CallBuilder { name, args: Vec::new(), json_raw: None });
                self.set_phase(Call);
            }
            (Call, Open, "argument") => {
                self.arg = Some((attr(&attrs, "key"), attr(&attrs, "type"), Vec::new()));
                self.set_phase(Argument);
            }
            (Call, Open, "json") => {
                self.arg = Some((None, None, Vec::new()));
                self.set_phase(Json);
            }
            (Call, Close, "call") => self.finish_call(),
            _ => {} // markup that means nothing here never reaches content
        }
    }

    fn finish_argument(&mut self) {
        if let (Some((Some(key), ty, raw)), Some(call)) = (self.arg.take(), self.call.as_mut()) {
            let raw = String::from_utf8_lossy(&raw).into_owned();
            let value = match ty.as_deref() {
                Some("string") => Json::Str(raw),
                _ => Json::parse(&raw).unwrap_or(Json::Str(raw)),
            };
            insert_ordered(&mut call.args, key, value);
        }
        self.arg = None;
        self.set_phase(Phase::Call);
    }

    fn finish_call(&mut self) {
        self.set_phase(Phase::Tools);
        let Some(call) = self.call.take() else { return };
        let Some(name) = call.name else { return };
        if !self.tools_declared {
            return;
        }
        let arguments = match (call.args.is_empty(), call.json_raw.as_deref().and_then(Json::parse)) {
            (true, Some(obj @ Json::Object(_))) => obj.dumps(),
            _ => Json::Object(call.args).dumps(),
        };
        let index = self.out.tool_calls.len();
        let tc = ToolCall { id: format!("{}{index}", self.id_prefix), index, name, arguments };
        self.out.tool_calls.push(tc.clone());
        self.pending.push(OutputDelta::ToolCall(tc));
    }
}

/// Splits a tag header into its name and `key="value"` attributes (values unescaped).
fn parse_header(header: &str) -> (&str, Vec<(String, String)>) {
    let header = header.trim();
    let (name, mut rest) = header.split_once(char::is_whitespace).unwrap_or((header, ""));
    let mut attrs = Vec::new();
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim();
        let after = rest[eq + 1..].trim_start();
        let Some(value_start) = after.strip_prefix('"') else {
            break;
        };
        let Some(end) = value_start.find('"') else {
            break;
        };
        attrs.push((key.to_owned(), unescape_attr(&value_start[..end])));
        rest = &value_start[end + 1..];
    }
    (name, attrs)
}

fn attr(attrs: &[(String, String)], key: &str) -> Option<String> {
    attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

/// `&quot;` → `"`, then `&amp;` → `&` (the reverse of the renderer's escaping).
pub fn unescape_attr(value: &str) -> String {
    value.replace("&quot;", "\"").replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_parsing_tolerates_whitespace_and_unescapes() {
        let (name, attrs) = parse_header(" call  tool = \"a&amp;b&quot;c\" index=\"1\" ");
        assert_eq!(name, "call");
        assert_eq!(attrs, vec![("tool".into(), "a&b\"c".into()), ("index".into(), "1".into())]);
        assert_eq!(parse_header("think").0, "think");
        assert_eq!(unescape_attr("&amp;quot;"), "&quot;");
    }
}
