//! Every case of `golden/tokenizer/cases.json` through the public API.

mod common;
use common::*;
use k3_tokenizer::stream::StreamDecoder;

#[test]
fn vocabulary_shape_matches_golden_header() {
    let tok = tokenizer();
    let cases = load_json("tokenizer/cases.json");
    let header = &cases["tokenizer"];
    assert_eq!(tok.n_ranks() as u64, header["n_ranks"].as_u64().unwrap());
    assert_eq!(tok.vocab_size() as u64, header["n_vocab"].as_u64().unwrap());
    for (name, id) in header["special_ids"].as_object().unwrap() {
        assert_eq!(tok.special_id(name), Some(id.as_u64().unwrap() as u32), "{name}");
    }
}

#[test]
fn encode_cases() {
    let tok = tokenizer();
    let cases = load_json("tokenizer/cases.json");
    let mut n = 0;
    for case in cases["encode_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let text = case["text"].as_str().unwrap();
        let plain = tok.encode(text, false);
        if let Some(pieces) = case.get("pieces_hex_no_special") {
            let got: Vec<String> = plain.iter().map(|&id| hex(tok.token_bytes(id).unwrap())).collect();
            let want: Vec<String> = pieces.as_array().unwrap().iter().map(|p| p.as_str().unwrap().to_owned()).collect();
            assert_eq!(got, want, "{name}: pieces");
        }
        assert_eq!(plain, ids(&case["ids_no_special"]), "{name}: ids_no_special");
        let special = tok.encode(text, true);
        assert_eq!(special, ids(&case["ids_special"]), "{name}: ids_special");
        assert_eq!(tok.decode(&plain, false).unwrap(), text, "{name}: round trip (plain)");
        assert_eq!(tok.decode(&special, false).unwrap(), text, "{name}: round trip (special)");
        n += 1;
    }
    assert!(n >= 30, "only {n} encode cases");
}

#[test]
fn decode_cases() {
    let tok = tokenizer();
    let cases = load_json("tokenizer/cases.json");
    for case in cases["decode_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let input = ids(&case["ids"]);
        assert_eq!(hex(&tok.decode_bytes(&input, false).unwrap()), case["bytes_hex"].as_str().unwrap(), "{name}");
        assert_eq!(tok.decode(&input, false).unwrap(), case["decoded_lossy"].as_str().unwrap(), "{name}");
        assert_eq!(tok.decode(&input, true).unwrap(), case["decoded_skip_special"].as_str().unwrap(), "{name}: skip");
        let mut dec = StreamDecoder::new(&tok, false);
        let mut chunks: Vec<String> = input.iter().map(|&id| dec.push(id).unwrap()).collect();
        chunks.push(dec.finish());
        let want: Vec<String> = case["stream_chunks"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_owned()).collect();
        assert_eq!(chunks, want, "{name}: stream");
    }
}
