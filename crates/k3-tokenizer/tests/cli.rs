//! The `k3` subcommand logic, driven through clap exactly as the binary will parse it.

mod common;
use clap::Parser;
use common::golden_dir;
use k3_tokenizer::cli::*;
use serde_json::json;

#[derive(Parser)]
enum Cmd {
    Tokenize(TokenizeArgs),
    Detokenize(DetokenizeArgs),
    RenderChat(RenderChatArgs),
    ParseOutput(ParseOutputArgs),
}

fn run(args: &[&str]) -> k3_tokenizer::Result<serde_json::Value> {
    let dir = golden_dir().join("tokenizer");
    let mut argv = vec!["k3".to_owned()];
    argv.extend(args.iter().map(|s| s.to_string()));
    argv.extend(["--tokenizer".to_owned(), dir.display().to_string()]);
    match Cmd::try_parse_from(argv).unwrap_or_else(|e| panic!("{e}")) {
        Cmd::Tokenize(a) => run_tokenize(&a),
        Cmd::Detokenize(a) => run_detokenize(&a),
        Cmd::RenderChat(a) => run_render_chat(&a),
        Cmd::ParseOutput(a) => run_parse_output(&a),
    }
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let plain = run(&["tokenize", "Hi<|end_of_msg|>"]).unwrap();
    let special = run(&["tokenize", "--allow-special", "Hi<|end_of_msg|>"]).unwrap();
    assert_eq!(special, json!({"ids": [39, 72, 8194]}));
    assert!(plain["ids"].as_array().unwrap().len() > 3);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.txt");
    std::fs::write(&file, "Hello world").unwrap();
    let from_file = run(&["tokenize", "--file", file.to_str().unwrap()]).unwrap();
    assert_eq!(from_file, run(&["tokenize", "Hello world"]).unwrap());
    let ids: Vec<String> = from_file["ids"].as_array().unwrap().iter().map(|v| v.to_string()).collect();
    assert_eq!(run(&["detokenize", "--ids", &ids.join(",")]).unwrap(), json!({"text": "Hello world"}));
    assert_eq!(run(&["detokenize", "--skip-special", "--ids", "39,72,8194"]).unwrap(), json!({"text": "Hi"}));
    assert!(run(&["detokenize", "--ids", "1,x"]).unwrap_err().to_string().contains("\"x\""));
}

#[test]
fn render_chat_and_reject_invalid_effort() {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("r.json");
    std::fs::write(&req, r#"{"messages":[{"role":"user","content":"Hello"}],"thinking":false}"#).unwrap();
    let out = run(&["render-chat", "--request", req.to_str().unwrap()]).unwrap();
    assert_eq!(out["ids"].as_array().unwrap().len(), 22); // spec §6.5 check
    assert!(out["text"].as_str().unwrap().ends_with("<|open|>response<|sep|>"));
    std::fs::write(&req, r#"{"messages":[],"reasoning_effort":"ultra"}"#).unwrap();
    let err = run(&["render-chat", "--request", req.to_str().unwrap()]).unwrap_err();
    assert!(err.to_string().contains("reasoning_effort"), "{err}");
}

#[test]
fn parse_output_flags() {
    // "Hi" then a `<|close|>` cut off by a length stop: the partial marker is dropped.
    let out = run(&["parse-output", "--ids", "39,72,8196"]).unwrap();
    assert_eq!(out, json!({"reasoning_content": "Hi", "content": null, "tool_calls": []}));
    let out = run(&["parse-output", "--ids", "39,72", "--thinking", "false"]).unwrap();
    assert_eq!(out, json!({"reasoning_content": null, "content": "Hi", "tool_calls": []}));
    let out = run(&["parse-output", "--ids", "39,72", "--thinking", "true", "--tools-declared", "true"]).unwrap();
    assert_eq!(out["reasoning_content"], json!("Hi"));
}

/// An id outside the vocabulary is refused by `parse-output` as by `detokenize` (issue 28,
/// item 13), not dropped.
#[test]
fn parse_output_refuses_ids_outside_the_vocabulary() {
    let d = run(&["detokenize", "--ids", "39,99999"]).unwrap_err().to_string();
    let p = run(&["parse-output", "--ids", "39,99999"]).unwrap_err().to_string();
    assert!(p.contains("99999") && p.contains("outside the vocabulary"), "{p}");
    assert_eq!(p, d);
}
