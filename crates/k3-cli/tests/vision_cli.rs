//! `k3 vision` (images and videos), `k3 logits --image` and `k3 run --image/--video` on the
//! `vision_small_f32` fixture, run as a user would.

use std::path::PathBuf;
use std::process::Command;

use k3_model::checkpoint::open_tensors_only;

#[path = "../../../tests/support/golden.rs"]
mod golden;
#[path = "../../../tests/support/numeric.rs"]
mod numeric;
use numeric::max_abs;

/// In the full golden set only (`K3_GOLDEN_DIR`): these tests are `#[ignore]`d by default.
fn fixture() -> PathBuf {
    golden::fixture("vision_small_f32")
}

fn read_npy_f32(p: &std::path::Path) -> Vec<f32> {
    let b = std::fs::read(p).unwrap();
    let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
    b[10 + hl..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn vision_writes_every_stage() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("v1.safetensors");
    let st = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["vision", "--model"])
        .arg(fixture())
        .arg("--image")
        .arg(fixture().join("v1_rgb_wide_resize.png"))
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    let got = open_tensors_only(&out).unwrap();
    let r = open_tensors_only(&fixture().join("reference.safetensors")).unwrap();
    assert_eq!(&*got.tensor("grid_thw").unwrap().as_i64().unwrap(), &[1, 4, 10]);
    for (k, shape, tol) in
        [("pixel_values", vec![40, 3, 14, 14], 0.0), ("vit_out", vec![40, 32], 1e-4), ("merged", vec![10, 4, 32], 1e-4), ("projected", vec![10, 96], 1e-4)]
    {
        let t = got.tensor(k).unwrap();
        assert_eq!(t.shape(), shape.as_slice(), "{k}");
        let m = max_abs(&t.to_f32().unwrap(), &r.tensor(&format!("{k}_1")).unwrap().to_f32().unwrap());
        assert!(m <= tol, "{k}: max |Δ| {m}");
    }
    // No temporary file is left beside the output.
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn logits_with_images_match_and_mismatch_fails() {
    let d = tempfile::tempdir().unwrap();
    let r = open_tensors_only(&fixture().join("reference.safetensors")).unwrap();
    let ids: Vec<String> = r.tensor("input_ids").unwrap().as_i64().unwrap().iter().map(|v| v.to_string()).collect();
    let ids = ids.join(",");
    let imgs = ["v0_rgba_resize.png", "v1_rgb_wide_resize.png", "v2_la_alpha.png"];
    let run = |images: &[&str], mode: &str, out: &std::path::Path| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_k3"));
        c.args(["logits", "--model"]).arg(fixture()).args(["--ids", &ids, "--mode", mode, "--out"]).arg(out);
        for i in images {
            c.arg("--image").arg(fixture().join(i));
        }
        c.output().unwrap()
    };
    let want = r.tensor("logits").unwrap().to_f32().unwrap().into_owned();
    for mode in ["full", "chunked:16"] {
        let out = d.path().join(format!("l_{}.npy", mode.replace(':', "_")));
        let o = run(&imgs, mode, &out);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let m = max_abs(&read_npy_f32(&out), &want);
        assert!(m <= 1e-3, "{mode}: max |Δ| {m}");
    }
    let o = run(&imgs[..2], "full", &d.path().join("bad.npy"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("26 <|media_pad|>") && err.contains("[12, 10]"), "{err}");
}

/// `k3 run --image` (greedy) continues with the argmax of `k3 logits --image` at the last
/// position, and a wrong pad count is an error naming the counts.
#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn run_with_image_continues_like_logits() {
    let f = fixture();
    let pads = ["377"; 12].join(",");
    let ids = format!("165,22,89,15,99,378,213,192,41,165,379,{pads},380,350,295,181");
    let img = f.join("v0_rgba_resize.png");
    let d = tempfile::tempdir().unwrap();
    let npy = d.path().join("l.npy");
    let st = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["logits", "--model"])
        .arg(&f)
        .args(["--ids", &ids, "--image"])
        .arg(&img)
        .arg("--out")
        .arg(&npy)
        .status()
        .unwrap();
    assert!(st.success());
    let lg = read_npy_f32(&npy);
    let last = &lg[lg.len() - 384..];
    let want = last.iter().enumerate().fold((0, f32::NEG_INFINITY), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0;
    let out = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["run", "--model"])
        .arg(&f)
        .args(["--ids", &ids, "--image"])
        .arg(&img)
        .args(["-n", "3", "--temperature", "0", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ids"][0].as_u64(), Some(want as u64));
    let bad = Command::new(env!("CARGO_BIN_EXE_k3")).args(["run", "--model"]).arg(&f).args(["--ids", "1,2,377,377", "--image"]).arg(&img).output().unwrap();
    assert!(!bad.status.success());
    let e = String::from_utf8_lossy(&bad.stderr);
    assert!(e.contains("377") && e.contains("12"), "{e}");
}

#[path = "../../../tests/support/gif_clip.rs"]
mod gif_clip;

/// `k3 vision --video` writes every chunk's stages, times and frame indices; `k3 run --video`
/// takes the two chunks' pads in `--ids` and names the counts when they do not match.
#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn video_stages_and_run() {
    let d = tempfile::tempdir().unwrap();
    let gif = d.path().join("clip.gif");
    std::fs::write(&gif, gif_clip::gif_clip()).unwrap();
    let out = d.path().join("clip.safetensors");
    let o = Command::new(env!("CARGO_BIN_EXE_k3")).args(["vision", "--model"]).arg(fixture()).arg("--video").arg(&gif).arg("--out").arg(&out).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("2 chunks, 8 video tokens"), "{}", String::from_utf8_lossy(&o.stderr));
    let got = open_tensors_only(&out).unwrap();
    assert_eq!(&*got.tensor("chunk0.grid_thw").unwrap().as_i64().unwrap(), &[4, 4, 4]);
    assert_eq!(&*got.tensor("chunk1.grid_thw").unwrap().as_i64().unwrap(), &[1, 4, 4]);
    assert_eq!(got.tensor("chunk0.pixel_values").unwrap().shape(), &[64, 3, 14, 14]);
    assert_eq!(got.tensor("chunk1.projected").unwrap().shape(), &[4, 96]);
    assert_eq!(&*got.tensor("frames").unwrap().as_i64().unwrap(), &[0, 1, 2, 4, 5, -1, -1, -1]);
    let t = got.tensor("time_s").unwrap();
    assert_eq!(&*t.to_f32().unwrap(), &[0.0, 0.5]);
    assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 2, "no temporary file is left");

    let pads = ["377"; 4].join(",");
    let ids = format!("165,22,378,379,{pads},380,378,379,{pads},380,350");
    let run = |ids: &str| {
        Command::new(env!("CARGO_BIN_EXE_k3"))
            .args(["run", "--model"])
            .arg(fixture())
            .args(["--ids", ids, "-n", "2", "--temperature", "0", "--video"])
            .arg(&gif)
            .output()
            .unwrap()
    };
    let o = run(&ids);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = run(&format!("165,22,378,379,{pads},380,350"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("4 <|media_pad|>") && err.contains("[4, 4]"), "{err}");
    let o = Command::new(env!("CARGO_BIN_EXE_k3"))
        .args(["vision", "--model"])
        .arg(fixture())
        .arg("--video")
        .arg(fixture().join("v2_la_alpha.png"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("v2_la_alpha.png") && err.contains("not a recognised video"), "{err}");
}
