//! Image parts in `/v1/chat/completions`, end to end through HTTP against the real engine and
//! vision tower of the golden fixture `vision_small_f32` (text vocab 384, media ids 377–380),
//! with a small tokenizer built here whose special ids fall inside that vocab.
//!
//! The first greedy token and its logprob must equal those of an independent reference: the
//! same chat rendered with the image block, the fixture's PNG encoded from its file, the
//! features spliced into the token embeddings, and one full prefill. Error cases: bad base64,
//! unsupported and corrupt images, local paths outside `--allowed-local-media-path` or without
//! it, and images sent to a text-only model — each a 400 naming the image field. A video part
//! (an animated GIF made here, two chunks; with the `vp9` feature also a VP9 WebM, four chunks)
//! is checked the same way against its own reference.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use base64::Engine as _;
use common::*;
use k3_engine::{Engine, EngineConfig};
use k3_model::{Checkpoint, Model};
use k3_server::{spawn_background, spawn_background_with_vision, BackgroundServer, Scripted, ServerConfig};
use k3_tokenizer::{render_chat, ChatRequest, Tokenizer};
use k3_vision::{prompt::image_prompt_text, splice, VisionModel};
use serde_json::{json, Value};

const IMAGE: &str = "v2_la_alpha.png"; // 45×33, 4 image tokens
const FIELD: &str = "messages[0].content[1].image_url";

fn fixture() -> PathBuf {
    golden_dir().join("vision_small_f32")
}

/// 256 single-byte ranks + 256 specials (ids 256..512), the named ones below 384 (the model's
/// vocab) and the media tokens at the fixture's stand-in ids; the reserved rest is never rendered.
fn tiny_tokenizer() -> Arc<Tokenizer> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let model: String = (0u8..=255).map(|b| format!("{} {b}\n", b64.encode([b]))).collect();
    let named = [
        (256, "[BOS]", true),
        (257, "[EOS]", true),
        (258, "<|end_of_msg|>", true),
        (259, "<|open|>", true),
        (260, "<|close|>", false),
        (261, "<|sep|>", false),
        (377, "<|media_pad|>", true),
        (378, "<|media_begin|>", true),
        (379, "<|media_content|>", true),
        (380, "<|media_end|>", true),
    ];
    let added: Vec<(u32, String, bool)> = named.iter().map(|&(i, n, s)| (i, n.to_owned(), s)).collect();
    Arc::new(Tokenizer::from_parts(&model, &PathBuf::from("tiny.tiktoken"), &added).expect("tiny tokenizer"))
}

struct Loaded {
    model: Arc<Model>,
    vision: Arc<VisionModel>,
    tok: Arc<Tokenizer>,
}

fn load() -> Loaded {
    let ck = Checkpoint::open(&fixture()).expect("fixture checkpoint");
    let model = Arc::new(Model::load(&ck).expect("model"));
    let vision = Arc::new(VisionModel::load(&ck).expect("vision"));
    assert_eq!(vision.pad_id, 377);
    Loaded { model, vision, tok: tiny_tokenizer() }
}

fn start(l: &Loaded, local: Option<PathBuf>) -> BackgroundServer {
    let ecfg = EngineConfig { max_batch: 2, prefill_chunk: 512, max_step_tokens: 1024, ..Default::default() };
    let engine = Engine::new(l.model.clone(), Some(l.tok.clone()), ecfg);
    let cfg = ServerConfig { served_model_name: "vis".into(), allowed_local_media_path: local, ..Default::default() };
    spawn_background_with_vision(Box::new(engine), l.tok.clone(), cfg, Some(l.vision.clone())).expect("server starts")
}

fn data_uri(bytes: &[u8], mime: &str) -> String {
    format!("data:{mime};base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

fn chat(url: &str) -> Value {
    json!({
        "model": "vis", "temperature": 0, "max_tokens": 2, "logprobs": true, "thinking": false,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Look:"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "what is it?"},
        ]}],
    })
}

/// Reference ids and last-position log-softmax: with the image spliced in, and without.
fn reference(l: &Loaded, body: &Value) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let feats = l.vision.encode_image(&fixture().join(IMAGE)).expect("encode");
    assert_eq!(feats.orig_size, Some((45, 33)));
    reference_with(l, body, image_prompt_text(45, 33, feats.num_tokens), &[&feats.projected])
}

/// The chat rendered with one media part's `prompt`, its `features` spliced in at the pads, and
/// one full prefill: ids and last-position log-softmax with and without the features.
fn reference_with(l: &Loaded, body: &Value, prompt: String, features: &[&[f32]]) -> (Vec<u32>, Vec<f32>, Vec<f32>) {
    let mut req = ChatRequest::from_json_str(&body.to_string()).expect("chat request");
    req.set_image_prompts(Some(vec![prompt]));
    let ids = render_chat(&l.tok, &req).expect("render").ids;
    let rows: usize = features.iter().map(|f| f.len() / l.vision.spec.text_hidden).sum();
    assert_eq!(ids.iter().filter(|&&t| t == 377).count(), rows);
    let last = |emb: Vec<f32>| {
        let mut st = l.model.new_state();
        let lg = l.model.forward_embeds(emb, &mut st, Default::default(), None).expect("forward");
        let row = &lg[lg.len() - 384..];
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let z = row.iter().map(|&x| ((x - m) as f64).exp()).sum::<f64>().ln() as f32 + m;
        row.iter().map(|&x| x - z).collect::<Vec<f32>>()
    };
    let plain = l.model.embed(&ids).expect("embed");
    let mut emb = plain.clone();
    splice(&mut emb, &ids, 377, features).expect("splice");
    (ids, last(emb), last(plain))
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &x)| if x > m.1 { (i, x) } else { m }).0
}

fn first_token(r: &Resp, tok: &Tokenizer) -> (u32, f32) {
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"]["content"][0];
    let bytes: Vec<u8> = lp["bytes"].as_array().expect("bytes").iter().map(|b| b.as_u64().expect("byte") as u8).collect();
    let id = (0..tok.vocab_size() as u32).find(|&i| tok.token_bytes(i).is_some_and(|b| b == bytes.as_slice())).expect("token id");
    (id, lp["logprob"].as_f64().expect("logprob") as f32)
}

/// Sends the fixture's PNG as a `data:` URI to `srv` and checks the first greedy token, its
/// logprob and the prompt's token count against the reference prefill of `l`; returns the
/// request, the prompt's ids and the server's (token, logprob).
fn check_image_chat(l: &Loaded, srv: &BackgroundServer) -> (Value, Vec<u32>, (u32, f32)) {
    let png = std::fs::read(fixture().join(IMAGE)).expect("png");
    let body = chat(&data_uri(&png, "image/png"));
    let (ids, want, plain) = reference(l, &body);
    let top = argmax(&want);
    assert!(want.iter().zip(&plain).any(|(a, b)| (a - b).abs() > 1e-2), "the image must change the logits for this test to mean anything");
    let r = post(srv.addr, "/v1/chat/completions", &body);
    let (id, lp) = first_token(&r, &l.tok);
    assert_eq!(id as usize, top, "first greedy token");
    assert!((lp - want[top]).abs() < 1e-3, "logprob {lp} vs reference {}", want[top]);
    assert_eq!(r.json()["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64), "usage counts the pads");
    (body, ids, (id, lp))
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn image_chat_matches_the_reference_prefill() {
    let l = load();
    let srv = start(&l, Some(fixture()));
    let (body, ids, (id, lp)) = check_image_chat(&l, &srv);

    // The same image as an allowed local path (file:// URL and plain relative path).
    for url in [format!("file://{}", fixture().join(IMAGE).display()), IMAGE.to_owned()] {
        let r = post(srv.addr, "/v1/chat/completions", &chat(&url));
        let (id2, lp2) = first_token(&r, &l.tok);
        assert_eq!((id2, lp2), (id, lp), "{url}");
    }

    // Streaming takes the same path.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let r = post(srv.addr, "/v1/chat/completions", &sb);
    assert_eq!(r.status, 200, "{}", r.text());
    let ev = r.sse();
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let usage: Value = serde_json::from_str(&ev[ev.len() - 2]).expect("usage chunk");
    assert_eq!(usage["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64));
}

#[path = "../../../tests/support/gif_clip.rs"]
mod gif_clip;
use gif_clip::gif_clip;

fn video_chat(url: &str) -> Value {
    json!({
        "model": "vis", "temperature": 0, "max_tokens": 2, "logprobs": true, "thinking": false,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Watch:"},
            {"type": "video_url", "video_url": {"url": url}},
            {"type": "text", "text": "what happens?"},
        ]}],
    })
}

const VIDEO_FIELD: &str = "messages[0].content[1].video_url";

/// Sends `clip` as a `video_url` data URI of type `mime` and checks the first greedy token, its
/// logprob and the prompt's token count against the reference prefill; returns the chunks'
/// frame counts.
fn check_video_chat(l: &Loaded, srv: &BackgroundServer, clip: &[u8], mime: &str) -> Vec<usize> {
    let feats = l.vision.encode_video_bytes(clip, "clip", &Default::default()).expect("encode video");
    let body = video_chat(&data_uri(clip, mime));
    let (ids, want, plain) = reference_with(l, &body, feats.prompt_text(), &feats.projected());
    assert!(want.iter().zip(&plain).any(|(a, b)| (a - b).abs() > 1e-2), "the video must change the logits for this test to mean anything");
    let top = argmax(&want);
    let r = post(srv.addr, "/v1/chat/completions", &body);
    let (id, lp) = first_token(&r, &l.tok);
    assert_eq!(id as usize, top, "first greedy token");
    assert!((lp - want[top]).abs() < 1e-3, "logprob {lp} vs reference {}", want[top]);
    assert_eq!(r.json()["usage"]["prompt_tokens"].as_u64(), Some(ids.len() as u64), "usage counts the pads of every chunk");
    feats.chunks.iter().map(|c| c.2.grid_thw[0]).collect()
}

/// A video part that must be a 400 naming the part, its message holding `needle`.
fn bad_video(srv: &BackgroundServer, url: &str, needle: &str) {
    let r = post(srv.addr, "/v1/chat/completions", &video_chat(url));
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["param"], VIDEO_FIELD, "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains(needle), "{msg:?} should mention {needle:?}");
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn video_chat_matches_the_reference_prefill() {
    let l = load();
    let gif = gif_clip();
    let srv = start(&l, None);
    assert_eq!(check_video_chat(&l, &srv, &gif, "image/gif"), vec![4, 1]);

    bad_video(&srv, &data_uri(&gif[..gif.len() / 2], "image/gif"), "");
    // WebM: without the vp9 feature refused with the ways out; with it, these 8 bytes are corrupt.
    let webm_needle = if cfg!(feature = "vp9") { "corrupt WebM" } else { "--features vp9" };
    bad_video(&srv, &data_uri(&[0x1A, 0x45, 0xDF, 0xA3, 0, 0, 0, 0], "video/webm"), webm_needle);
    bad_video(&srv, &data_uri(b"hello", "video/x-msvideo"), "unsupported video type");
    let long = ServerConfig { served_model_name: "vis".into(), max_video_frames: 4, ..Default::default() };
    let ecfg = EngineConfig { max_batch: 2, prefill_chunk: 512, max_step_tokens: 1024, ..Default::default() };
    let engine = Engine::new(l.model.clone(), Some(l.tok.clone()), ecfg);
    let strict = spawn_background_with_vision(Box::new(engine), l.tok.clone(), long, Some(l.vision.clone())).expect("server starts");
    let r = post(strict.addr, "/v1/chat/completions", &video_chat(&data_uri(&gif, "image/gif")));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.json()["error"]["message"].as_str().unwrap_or_default().contains("over the limit of 4 frames"), "{}", r.text());
    assert_eq!(get(srv.addr, "/health").status, 200);
}

/// A VP9 WebM (k3-vision's tests/data/vp9_24f_12fps.webm: 24 frames at 12 fps, sampled at the
/// fixture's 8 fps to 16 frames, 4 chunks) as a `data:video/webm` part, against its reference;
/// a truncated copy is a 400 naming the part.
#[cfg(feature = "vp9")]
#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn webm_video_chat_matches_the_reference_prefill() {
    let l = load();
    let webm = std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/../k3-vision/tests/data/vp9_24f_12fps.webm")).expect("the VP9 clip");
    let srv = start(&l, None);
    assert_eq!(check_video_chat(&l, &srv, &webm, "video/webm"), vec![4, 4, 4, 4]);
    bad_video(&srv, &data_uri(&webm[..webm.len() / 2], "video/webm"), "corrupt WebM/Matroska file");
    assert_eq!(get(srv.addr, "/health").status, 200);
}

fn assert_400(r: &Resp, needle: &str) {
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["param"], FIELD, "{v}");
    let m = v["error"]["message"].as_str().unwrap_or_default();
    assert!(m.contains(needle), "{m:?} should mention {needle:?}");
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn bad_images_are_400s_naming_the_field() {
    let l = load();
    let srv = start(&l, Some(fixture()));
    let post_url = |u: &str| post(srv.addr, "/v1/chat/completions", &chat(u));
    assert_400(&post_url("data:image/png;base64,%%%not-base64%%%"), "invalid base64");
    assert_400(&post_url(&data_uri(b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "")), "unsupported");
    assert_400(&post_url(&data_uri(b"GIF89a", "image/gif")), "unsupported image type");
    let mut corrupt = b"\x89PNG\r\n\x1a\n".to_vec();
    corrupt.extend_from_slice(&[7u8; 40]);
    assert_400(&post_url(&data_uri(&corrupt, "image/png")), "");
    assert_400(&post_url(&data_uri(b"hello, not an image", "image/png")), "not a recognised image");
    assert_400(&post_url("https://example.com/cat.png"), "remote image URLs");
    let outside = fixture().join("../k3_small_f32/config.json");
    assert_400(&post_url(&format!("file://{}", outside.display())), "outside");
    assert_400(&post_url("../vision_small_f32/../tokenizer/tiktoken.model"), "outside");
    assert_400(&post_url("/etc/hostname"), "");
    let missing =
        post(srv.addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}]}));
    assert_400(&missing, "required");
    // The server still works afterwards.
    assert_eq!(get(srv.addr, "/health").status, 200);

    // Without --allowed-local-media-path, local paths are refused even inside the fixture.
    let closed = start(&l, None);
    let r = post(closed.addr, "/v1/chat/completions", &chat(&fixture().join(IMAGE).display().to_string()));
    assert_400(&r, "--allowed-local-media-path");
}

#[test]
fn text_only_model_refuses_images() {
    let tok = tokenizer();
    let t = tok.clone();
    let backend = Scripted::new(tok.clone(), Box::new(move |_: &[u32]| t.encode("ok<|end_of_msg|>", true)));
    let srv = spawn_background(Box::new(backend), tok, ServerConfig { served_model_name: "vis".into(), ..Default::default() }).expect("server");
    let png = std::fs::read(fixture().join(IMAGE)).expect("png");
    let r = post(srv.addr, "/v1/chat/completions", &chat(&data_uri(&png, "image/png")));
    assert_400(&r, "no vision tower");
    // Text-only requests still work.
    let r = post(srv.addr, "/v1/chat/completions", &json!({"model": "vis", "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(r.status, 200, "{}", r.text());
}

#[cfg(feature = "cuda")]
#[path = "../../../tests/support/cuda.rs"]
mod cuda_support;

/// The fixture with its vision tower uploaded to the GPU in the reference precision (F32), or
/// `None` after printing `skipped` without a GPU (`K3_REQUIRE_CUDA=1`: a failure).
#[cfg(feature = "cuda")]
fn gpu_vision(test: &str, l: &Loaded) -> Option<Arc<VisionModel>> {
    let dev = cuda_support::device(test)?;
    let mut v = VisionModel::load(&Checkpoint::open(&fixture()).expect("fixture checkpoint")).expect("vision");
    v.attach_cuda(&dev, k3_vision::cuda::Precision::F32).expect("upload the tower");
    assert!(v.on_gpu() && !l.vision.on_gpu());
    Some(Arc::new(v))
}

/// Sends the fixture's PNG and the GIF clip to `srv` and checks both against the CPU reference
/// prefill of `l` (CPU tower and CPU text model).
#[cfg(feature = "cuda")]
fn check_image_and_video(l: &Loaded, srv: &BackgroundServer) {
    check_image_chat(l, srv);
    assert_eq!(check_video_chat(l, srv, &gif_clip(), "image/gif"), vec![4, 1]);
    bad_video(srv, &data_uri(&gif_clip()[..100], "image/gif"), "");
    assert_eq!(get(srv.addr, "/health").status, 200);
}

/// `k3 serve --device cuda`'s media path with the text model on the CPU: the tower's stages are
/// left pending by the blocking thread and run on the GPU on the engine thread; an image and a
/// video chat give the CPU reference's first token and logprob.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn gpu_tower_chat_matches_the_reference_prefill() {
    let l = load();
    let Some(vision) = gpu_vision("gpu_tower_chat_matches_the_reference_prefill", &l) else { return };
    let gl = Loaded { model: l.model.clone(), vision, tok: l.tok.clone() };
    check_image_and_video(&l, &start(&gl, None));
}

/// The same with the text model on the GPU too (F32, decode steps from CUDA graphs, which are
/// captured on the stream the tower also uses): what `k3 serve --device cuda --precision f32`
/// runs.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn gpu_engine_and_tower_chat_matches_the_reference_prefill() {
    let l = load();
    let Some(vision) = gpu_vision("gpu_engine_and_tower_chat_matches_the_reference_prefill", &l) else { return };
    let ck = Checkpoint::open(&fixture()).expect("fixture checkpoint");
    let gpu = k3_engine::gpu::load_gpu(&ck, 0, 2, 4096, k3_model::capacity::KvDtype::Bf16, true, true, &Default::default()).expect("text model on the GPU");
    let ecfg = EngineConfig { max_batch: 2, prefill_chunk: 512, max_step_tokens: 1024, ..Default::default() };
    let engine = Engine::with_gpu(gpu, Some(l.tok.clone()), ecfg);
    let cfg = ServerConfig { served_model_name: "vis".into(), ..Default::default() };
    let srv = spawn_background_with_vision(Box::new(engine), l.tok.clone(), cfg, Some(vision)).expect("server starts");
    check_image_and_video(&l, &srv);
}
