//! Property tests: encode→decode round trips, the fast pre-tokenizer equals the verbatim
//! `fancy-regex` pattern, the stream decoder and the output parser never panic and agree with
//! their one-shot forms, and user text never yields control tokens.

mod common;
use common::tokenizer;
use k3_tokenizer::json::Json;
use k3_tokenizer::pretok::{Pretokenizer, ReferencePretokenizer};
use k3_tokenizer::{parse_output, render_chat, ChatRequest, OutputDelta, OutputParser, StreamDecoder, Tokenizer};
use proptest::prelude::*;
use std::sync::OnceLock;

fn tok() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(tokenizer)
}

/// Strings drawn from pieces that exercise every `pat_str` branch and the specials.
fn texty() -> impl Strategy<Value = String> {
    let pieces = prop::sample::select(vec![
        "a",
        "Z",
        "é",
        "e\u{301}",
        "中",
        "文",
        "カ",
        "한",
        "Ж",
        "1",
        "٣",
        "½",
        "Ⅻ",
        "'s",
        "'LL",
        "'d",
        " ",
        "  ",
        "\t",
        "\n",
        "\r\n",
        "\r",
        "\u{a0}",
        "\u{3000}",
        "\u{2003}",
        "\u{1c}",
        "\u{85}",
        "!",
        "...",
        "—",
        "🦀",
        "👨\u{200d}👩",
        "\u{fe0f}",
        "\0",
        "<|open|>",
        "<|sep|>",
        "<|close|>",
        "[EOS]",
        "<|reserved_token_8222|>",
        "<|",
        "|>",
        "𝔘",
        "𝟙",
    ]);
    prop::collection::vec(pieces, 0..40).prop_map(|v| v.concat())
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![texty(), any::<String>()]
}

/// Ids biased towards the XTML markers and the tag-name tokens.
fn output_ids() -> impl Strategy<Value = Vec<u32>> {
    let t = tok();
    let mut interesting: Vec<u32> =
        ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[EOS]", "<|media_pad|>"].iter().filter_map(|n| t.special_id(n)).collect();
    for word in ["think", "response", "tools", "call", "argument", "json", "message", " tool=\"f\"", " key=\"k\" type=\"number\"", "3", "\""] {
        interesting.extend(t.encode(word, false));
    }
    let vocab = t.vocab_size() as u32;
    let id = prop_oneof![3 => prop::sample::select(interesting), 2 => 0..vocab, 1 => vocab..vocab + 100];
    prop::collection::vec(id, 0..120)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn encode_decode_round_trips(text in any_text()) {
        for allow_special in [false, true] {
            let ids = tok().encode(&text, allow_special);
            prop_assert_eq!(tok().decode(&ids, false).unwrap(), text.clone());
        }
    }

    #[test]
    fn fast_pretokenizer_equals_reference(text in any_text()) {
        static P: OnceLock<(Pretokenizer, ReferencePretokenizer)> = OnceLock::new();
        let (fast, slow) = P.get_or_init(|| (Pretokenizer::new().unwrap(), ReferencePretokenizer::new().unwrap()));
        prop_assert_eq!(fast.split(&text), slow.split(&text).unwrap());
    }

    #[test]
    fn stream_decoder_matches_decode(ids in output_ids(), skip in any::<bool>()) {
        let t = tok();
        let mut dec = StreamDecoder::new(t, skip);
        let mut streamed = String::new();
        let mut known = Vec::new();
        for &id in &ids {
            match dec.push(id) {
                Ok(s) => { streamed += &s; known.push(id); }
                Err(_) => prop_assert!(t.token_bytes(id).is_none()),
            }
        }
        streamed += &dec.finish();
        prop_assert_eq!(streamed, t.decode(&known, skip).unwrap());
    }

    #[test]
    fn parser_never_panics_and_streams_consistently(ids in output_ids(), thinking in any::<bool>(), tools in any::<bool>()) {
        let t = tok();
        let whole = parse_output(t, &ids, thinking, tools);
        let mut p = OutputParser::new(t, thinking, tools);
        let mut deltas: Vec<OutputDelta> = ids.iter().flat_map(|&id| p.push(id)).collect();
        deltas.extend(p.finish());
        let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), Vec::new());
        for d in deltas {
            match d {
                OutputDelta::Reasoning(s) => reasoning += &s,
                OutputDelta::Content(s) => content += &s,
                OutputDelta::ToolCall(c) => calls.push(c),
            }
        }
        // The aggregate equals the stream, except that choice 4 may move a leading stretch of
        // streamed reasoning into the aggregate's content.
        let whole_reasoning = whole.reasoning_content.clone().unwrap_or_default();
        prop_assert!(reasoning.ends_with(&whole_reasoning), "{:?} vs {:?}", reasoning, whole_reasoning);
        let moved = &reasoning[..reasoning.len() - whole_reasoning.len()];
        prop_assert_eq!(whole.content.clone().unwrap_or_default(), format!("{moved}{content}"));
        prop_assert_eq!(&calls, &whole.tool_calls);
        for c in &whole.tool_calls {
            prop_assert!(matches!(Json::parse(&c.arguments), Some(Json::Object(_))), "arguments not an object: {}", c.arguments);
        }
        if !tools { prop_assert!(whole.tool_calls.is_empty()); }
    }

    #[test]
    fn user_text_never_produces_control_tokens(text in any_text(), name in texty()) {
        let t = tok();
        let render = |content: &str, name: &str| {
            let msg = Json::Object(vec![
                ("role".into(), Json::Str("user".into())),
                ("name".into(), Json::Str(name.into())),
                ("content".into(), Json::Str(content.into())),
            ]);
            render_chat(t, &ChatRequest::from_messages(vec![msg])).unwrap().ids
        };
        let specials = |ids: &[u32]| ids.iter().filter(|&&id| t.is_special(id)).count();
        prop_assert_eq!(specials(&render(&text, &name)), specials(&render("x", "n")));
    }
}
