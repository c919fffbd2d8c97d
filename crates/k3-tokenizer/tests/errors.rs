//! Error cases: every message names what the user has to fix.

mod common;
use common::{golden_dir, tokenizer};
use k3_tokenizer::{render_chat, ChatRequest, Error, StreamDecoder, Tokenizer};
use std::fs;

fn golden_config() -> String {
    fs::read_to_string(golden_dir().join("tokenizer/tokenizer_config.json")).unwrap()
}

#[test]
fn missing_file_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, Error::Io { .. }));
    assert!(err.to_string().contains("tiktoken.model"), "{err}");
    fs::copy(golden_dir().join("tokenizer/tiktoken.model"), dir.path().join("tiktoken.model")).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn bad_model_line_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("tokenizer_config.json"), golden_config()).unwrap();
    let good = fs::read_to_string(golden_dir().join("tokenizer/tiktoken.model")).unwrap();
    let mut lines: Vec<String> = good.lines().map(str::to_owned).collect();
    for (bad_line, fragment) in [("!!notbase64 7", "base64"), ("QQ== x", "rank"), ("QQ==", "expected")] {
        let mut l = lines.clone();
        l[6] = bad_line.to_owned();
        fs::write(dir.path().join("tiktoken.model"), l.join("\n")).unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, Error::BadModelLine { line: 7, .. }), "{msg}");
        assert!(msg.contains("tiktoken.model:7:") && msg.contains(fragment), "{msg}");
    }
    // A missing single-byte token is a vocabulary error, reported at load time.
    lines.retain(|l| !l.ends_with(" 0"));
    fs::write(dir.path().join("tiktoken.model"), lines.join("\n")).unwrap();
    let msg = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("rank 0 is missing"), "{msg}");
}

#[test]
fn bad_config_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    fs::copy(golden_dir().join("tokenizer/tiktoken.model"), dir.path().join("tiktoken.model")).unwrap();
    fs::write(dir.path().join("tokenizer_config.json"), "{\"added_tokens_decoder\": {\"x\": {}}}").unwrap();
    let msg = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
    assert!(msg.contains("tokenizer_config.json") && msg.contains("\"x\""), "{msg}");
}

#[test]
fn effort_ultra_is_rejected_naming_the_field() {
    let msg = ChatRequest::from_json_str(r#"{"messages":[{"role":"user","content":"hi"}],"thinking_effort":"ultra"}"#).unwrap_err().to_string();
    assert!(msg.contains("`thinking_effort`") && msg.contains("ultra"), "{msg}");
}

#[test]
fn invalid_messages_name_the_message() {
    let tok = tokenizer();
    for (body, field) in [
        (r#"{"messages":[{"role":"user","content":"a"},{"role":"wizard","content":"b"}]}"#, "messages[1].role"),
        (r#"{"messages":[{"role":"tool","content":"x"}]}"#, "messages[0]"),
        (r#"{"messages":[{"role":"user","content":[{"type":"input_audio"}]}]}"#, "messages[0].content[0]"),
        (r#"{"messages":[{"role":"assistant","tool_calls":[{"function":{"name":"f","arguments":"[1]"}}]}]}"#, "messages[0].tool_calls[0].function.arguments"),
        (r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}],"image_prompts":[]}"#, "messages[0].content[0]"),
        (r#"{"messages":[{"role":"user","content":"x"}],"image_prompts":["<|media_pad|>"]}"#, "image_prompts"),
    ] {
        let err = ChatRequest::from_json_str(body).and_then(|r| render_chat(&tok, &r)).unwrap_err();
        assert!(err.to_string().contains(&format!("`{field}`")), "{body}: {err}");
    }
}

#[test]
fn unknown_ids_are_errors_not_panics() {
    let tok = tokenizer();
    let big = tok.vocab_size() as u32;
    assert!(matches!(tok.decode(&[1, big], false), Err(Error::UnknownId { id, .. }) if id == big));
    let mut s = StreamDecoder::new(&tok, false);
    assert!(s.push(big).is_err());
    assert_eq!(s.push(39).unwrap(), "H");
}
