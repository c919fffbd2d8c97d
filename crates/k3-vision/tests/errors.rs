//! Bad inputs get errors that name the culprit: the image file, the config file, or the pad counts.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use k3_model::Checkpoint;
use k3_vision::preprocess::{preprocess_file, ProcessorConfig};
use k3_vision::{splice, VisionError, VisionModel};

fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

/// A PNG whose IHDR claims `w × h` (valid CRC), followed by an empty IDAT and IEND.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |ty: &[u8], data: &[u8]| {
        v.extend((data.len() as u32).to_be_bytes());
        let mut body = ty.to_vec();
        body.extend_from_slice(data);
        v.extend_from_slice(&body);
        v.extend(crc32(&body).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00, 0x00, 0x00, 0x00, 0x01]);
    chunk(b"IEND", &[]);
    v
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    p
}

fn image_err(path: &Path) -> String {
    let cfg = ProcessorConfig::from_model_dir(&vision_fixture()).unwrap();
    match preprocess_file(path, &cfg) {
        Err(e @ VisionError::Image { .. }) => e.to_string(),
        Err(e) => panic!("{}: wrong error kind: {e}", path.display()),
        Ok(_) => panic!("{}: accepted a bad image", path.display()),
    }
}

#[test]
fn corrupt_truncated_and_garbage_files_are_named() {
    let d = tempfile::tempdir().unwrap();
    let good = std::fs::read(vision_fixture().join(IMAGES[0])).unwrap();
    let p = write(d.path(), "truncated_photo.png", &good[..good.len() / 2]);
    let e = image_err(&p);
    assert!(e.contains("truncated_photo.png") && e.contains("corrupt"), "{e}");
    let mut flipped = good.clone();
    let n = flipped.len();
    flipped[n / 2..n / 2 + 64].iter_mut().for_each(|b| *b ^= 0x5a);
    let e = image_err(&write(d.path(), "bitrot.png", &flipped));
    assert!(e.contains("bitrot.png") && e.contains("corrupt"), "{e}");
    let e = image_err(&write(d.path(), "notes.png", b"this is a text file, not an image\n"));
    assert!(e.contains("notes.png") && e.contains("not a recognised image"), "{e}");
    let e = image_err(&write(d.path(), "empty.jpg", b""));
    assert!(e.contains("empty.jpg") && e.contains("empty"), "{e}");
    let e = image_err(&d.path().join("missing.webp"));
    assert!(e.contains("missing.webp") && e.contains("cannot read"), "{e}");
}

#[test]
fn zero_sized_and_enormous_images_are_refused_before_decoding() {
    let d = tempfile::tempdir().unwrap();
    let e = image_err(&write(d.path(), "zero_width.png", &png_header(0, 10)));
    assert!(e.contains("zero_width.png") && (e.contains("zero-sized") || e.contains("corrupt")), "{e}");
    let e = image_err(&write(d.path(), "huge.png", &png_header(100_000, 100_000)));
    assert!(e.contains("huge.png") && e.contains("enormous") && e.contains("100000x100000"), "{e}");
}

#[test]
fn unsupported_formats_are_named() {
    let d = tempfile::tempdir().unwrap();
    let gif = b"GIF89a\x01\x00\x01\x00\x80\x00\x00\x00\x00\x00\xff\xff\xff!\xf9\x04\x01\x00\x00\x00\x00,\x00\x00\x00\x00\x01\x00\x01\x00\x00\x02\x02D\x01\x00;";
    let e = image_err(&write(d.path(), "anim.gif", gif));
    assert!(e.contains("anim.gif") && e.contains("unsupported") && e.contains("Gif"), "{e}");
    let mut bmp = b"BM".to_vec();
    bmp.extend([0u8; 60]);
    let e = image_err(&write(d.path(), "scan.bmp", &bmp));
    assert!(e.contains("scan.bmp") && e.contains("unsupported"), "{e}");
}

#[test]
fn pad_count_mismatch_is_an_error_naming_the_counts() {
    let h = 4;
    let ids = [1, 9, 9, 9, 2, 9, 9, 3];
    let mut emb = vec![0f32; ids.len() * h];
    let a = vec![1f32; 3 * h];
    let b = vec![2f32; 2 * h];
    // Too few pads for the images.
    let e = splice(&mut emb, &ids, 9, &[&a, &b, &b]).unwrap_err().to_string();
    assert!(e.contains("5 <|media_pad|>") && e.contains("[3, 2]") && e.contains("[3, 2, 2]"), "{e}");
    // Same total, wrong order: the first run does not fit image 0.
    let e = splice(&mut emb, &ids, 9, &[&b, &a]).unwrap_err().to_string();
    assert!(e.contains("pad run 0") && e.contains("image 0 gives 2"), "{e}");
    // Features that are not rows of the text width.
    let e = splice(&mut emb, &ids, 9, &[&a[..5]]).unwrap_err().to_string();
    assert!(e.contains("image 0") && e.contains("text width 4"), "{e}");
    // The right images fill the runs in order and touch nothing else.
    splice(&mut emb, &ids, 9, &[&a, &b]).unwrap();
    let rows: Vec<f32> = emb.chunks(h).map(|r| r[0]).collect();
    assert_eq!(rows, vec![0.0, 1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 0.0]);
    // Adjacent images in one run are fine when they fill it exactly.
    let ids2 = [9, 9, 9, 9, 9];
    let mut emb2 = vec![0f32; 5 * h];
    splice(&mut emb2, &ids2, 9, &[&a, &b]).unwrap();
    assert!(splice(&mut vec![0f32; 7 * h], &[9, 9, 1, 9, 2, 9, 9], 9, &[&a, &b]).unwrap_err().to_string().contains("ends inside an image"));
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn missing_processor_config_names_the_file() {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(vision_fixture().join("config.json"), d.path().join("config.json")).unwrap();
    std::os::unix::fs::symlink(vision_fixture().join("model.safetensors"), d.path().join("model.safetensors")).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    let e = VisionModel::load(&ck).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("preprocessor_config.json") && e.contains("cannot read"), "{e}");
    // A config with a missing limit is refused, naming the file.
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(vision_fixture().join("preprocessor_config.json")).unwrap()).unwrap();
    v["media_proc_cfg"].as_object_mut().unwrap().remove("in_patch_limit");
    std::fs::write(d.path().join("preprocessor_config.json"), v.to_string()).unwrap();
    let e = VisionModel::load(&ck).err().map(|e| e.to_string()).unwrap_or_default();
    assert!(e.contains("preprocessor_config.json") && e.contains("in_patch_limit"), "{e}");
}

#[test]
#[ignore = "full golden set: K3_GOLDEN_DIR=/path/to/shared/golden cargo test -- --ignored"]
fn tower_rejects_bad_grids() {
    let m = VisionModel::load(&Checkpoint::open(&vision_fixture()).unwrap()).unwrap();
    let e = m.encode_pixels(vec![0.0; 588 * 4], [1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("pixel_values hold"), "{e}");
    let e = m.encode_pixels(vec![0.0; 588 * 6], [1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("merge kernel"), "{e}");
}
