//! Every case of `golden/chat/cases.json` through the public API: the request's `messages` and
//! `tools` with its `chat_kwargs` merged at the top level, as the CLI receives it.

mod common;
use common::*;
use k3_tokenizer::chat::ChatRequest;
use k3_tokenizer::json::Json;
use k3_tokenizer::xtml::render_chat;

/// The request as the CLI gets it. Built from the order-preserving [`Json`] so that argument
/// key order survives (serde_json's `Value` would sort it).
fn request_json(case: &Json) -> Json {
    let req = case.get("request").unwrap();
    let mut top = vec![("messages".to_owned(), req.get("messages").unwrap().clone()), ("tools".to_owned(), req.get("tools").unwrap().clone())];
    if let Some(Json::Object(kw)) = req.get("chat_kwargs") {
        top.extend(kw.iter().cloned());
    }
    Json::Object(top)
}

#[test]
fn chat_cases() {
    let tok = tokenizer();
    let cases = load_json("chat/cases.json");
    let ordered = load_ordered("chat/cases.json");
    let Some(Json::Array(ordered)) = ordered.get("cases") else { panic!("no cases") };
    let mut n = 0;
    for (case, ordered_case) in cases["cases"].as_array().unwrap().iter().zip(ordered) {
        let name = case["name"].as_str().unwrap();
        let parsed = ChatRequest::from_json(request_json(ordered_case)).and_then(|r| render_chat(&tok, &r));
        n += 1;
        if case.get("error").is_some() {
            assert!(parsed.is_err(), "{name}: expected an error");
            continue;
        }
        let rendered = parsed.unwrap_or_else(|e| panic!("{name}: {e}"));
        let segs: Vec<(String, bool)> = rendered.segments.iter().map(|s| (s.text.clone(), s.control)).collect();
        let want: Vec<(String, bool)> =
            case["segments"].as_array().unwrap().iter().map(|s| (s[0].as_str().unwrap().to_owned(), s[1].as_bool().unwrap())).collect();
        if let Some(i) = (0..segs.len().max(want.len())).find(|&i| segs.get(i) != want.get(i)) {
            panic!("{name}: segment {i} differs: got {:?}, want {:?}", segs.get(i), want.get(i));
        }
        assert_eq!(rendered.text, case["rendered"].as_str().unwrap(), "{name}: text");
        assert_eq!(rendered.ids, ids(&case["ids"]), "{name}: ids");
    }
    assert!(n >= 25, "only {n} chat cases");
}
