//! Dev tool: preprocess images with a model directory's `preprocessor_config.json` and write each
//! image's `pixel_values` as raw little-endian f32 (`OUT_DIR/<file name>.f32`) plus its grid on
//! stdout, for comparing against another implementation.
//!
//! `cargo run --release -p k3-vision --example preprocess_dump -- MODEL_DIR OUT_DIR IMAGE...`

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 3 {
        return Err("usage: preprocess_dump MODEL_DIR OUT_DIR IMAGE...".into());
    }
    let cfg = k3_vision::ProcessorConfig::from_model_dir(&PathBuf::from(&a[0]))?;
    let out = PathBuf::from(&a[1]);
    for img in &a[2..] {
        let p = PathBuf::from(img);
        match k3_vision::preprocess::preprocess_file(&p, &cfg) {
            Ok(r) => {
                let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                let bytes: Vec<u8> = r.pixel_values.iter().flat_map(|v| v.to_le_bytes()).collect();
                std::fs::write(out.join(format!("{name}.f32")), bytes)?;
                println!("{img} {:?}", r.grid_thw);
            }
            Err(e) => println!("{img} ERROR {e}"),
        }
    }
    Ok(())
}
