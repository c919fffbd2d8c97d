//! The documented parser choices where vLLM and SGLang disagree (see `parser` module docs), and
//! other robustness rules. Outputs are written as text and encoded with specials recognised,
//! which gives the same ids the model emits (markers are special ids, tag names BPE text).

mod common;
use common::tokenizer;
use k3_tokenizer::parser::{parse_output, ParsedOutput};

fn parse(text: &str, thinking: bool, tools: bool) -> ParsedOutput {
    let tok = tokenizer();
    parse_output(&tok, &tok.encode(text, true), thinking, tools)
}

const CALL: &str = "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>argument key=\"x\" type=\"number\"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";

#[test]
fn choice1_unclosed_think_then_response_keeps_reasoning() {
    let p = parse("mulling<|open|>response<|sep|>Answer.<|close|>response<|sep|><|close|>message<|sep|>", true, false);
    assert_eq!(p.reasoning_content.as_deref(), Some("mulling"));
    assert_eq!(p.content.as_deref(), Some("Answer."));
}

#[test]
fn choice2_undeclared_tools_channel_is_dropped_not_leaked() {
    let text = format!("r<|close|>think<|sep|><|open|>response<|sep|>Calling.<|close|>response<|sep|>{CALL}<|close|>message<|sep|>");
    let p = parse(&text, true, false);
    assert_eq!(p.content.as_deref(), Some("Calling."));
    assert!(p.tool_calls.is_empty());
    let p = parse(&text, true, true);
    assert_eq!(p.tool_calls.len(), 1);
    assert_eq!((p.tool_calls[0].name.as_str(), p.tool_calls[0].arguments.as_str()), ("f", "{\"x\": 2}"));
}

#[test]
fn choice3_partial_marker_at_length_stop_is_dropped() {
    let p = parse("r<|close|>think<|sep|><|open|>response<|sep|>Body<|close|>response", true, false);
    assert_eq!(p.content.as_deref(), Some("Body"));
    let p = parse("thinking hard<|close|>thi", true, false);
    assert_eq!(p.reasoning_content.as_deref(), Some("thinking hard"));
}

#[test]
fn choice4_answer_closed_as_response_without_think_close_is_content() {
    let p = parse("Direct answer.<|close|>response<|sep|><|close|>message<|sep|>", true, false);
    assert_eq!(p.reasoning_content, None);
    assert_eq!(p.content.as_deref(), Some("Direct answer."));
}

#[test]
fn choice5_tools_before_think_close_ends_reasoning_and_parses_calls() {
    let p = parse(&format!("plan{CALL}<|close|>message<|sep|>"), true, true);
    assert_eq!(p.reasoning_content.as_deref(), Some("plan"));
    assert_eq!(p.tool_calls.len(), 1);
}

#[test]
fn json_block_object_is_used_and_broken_block_gives_empty_object() {
    let block = |raw: &str| {
        format!("r<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"g\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>{raw}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>")
    };
    assert_eq!(parse(&block("{\"b\":1,\"a\":[true]}"), true, true).tool_calls[0].arguments, "{\"b\": 1, \"a\": [true]}");
    assert_eq!(parse(&block("{\"b\":"), true, true).tool_calls[0].arguments, "{}");
}

#[test]
fn literal_markup_typed_as_text_is_text() {
    // The same characters as BPE text (specials not recognised) are not markers.
    let tok = tokenizer();
    let ids = tok.encode("a<|close|>think<|sep|>b", false);
    let p = parse_output(&tok, &ids, true, false);
    assert_eq!(p.reasoning_content.as_deref(), Some("a<|close|>think<|sep|>b"));
}

#[test]
fn tolerant_whitespace_in_markers_and_ids_are_sequential() {
    let text = "r<|close|> think <|sep|><|open|> response<|sep|>ok<|close|>response <|sep|><|open|>tools<|sep|>\
        <|open|>call tool=\"a\"<|sep|><|close|>call<|sep|><|open|>call index=\"2\"<|sep|><|close|>call<|sep|>\
        <|open|>call tool=\"b\"<|sep|><|open|>argument key=\"s\" type=\"string\"<|sep|> 007 <|close|>argument<|sep|><|close|>call<|sep|>";
    let p = parse(text, true, true);
    assert_eq!(p.content.as_deref(), Some("ok"));
    let calls: Vec<(&str, &str, &str)> = p.tool_calls.iter().map(|c| (c.id.as_str(), c.name.as_str(), c.arguments.as_str())).collect();
    // The call without `tool=` is dropped; string values stay raw (spaces and leading zeros).
    assert_eq!(calls, vec![("call_0", "a", "{}"), ("call_1", "b", "{\"s\": \" 007 \"}")]);
}
