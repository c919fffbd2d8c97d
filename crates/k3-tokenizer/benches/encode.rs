//! Encode-throughput benchmark (issue 6): `cargo bench -p k3-tokenizer --bench encode -- DIR TEXT`.
//!
//! Encodes TEXT (a UTF-8 file) with special names as plain text, single-threaded, repeatedly for
//! at least two seconds, and prints one JSON line: bytes, tokens, an FNV-1a checksum of the ids
//! (so `tools/bench_tokenizer.py` can check the ids equal tiktoken's) and the best and median MB/s.

use k3_tokenizer::Tokenizer;
use std::path::Path;
use std::time::{Duration, Instant};

fn checksum(ids: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &id in ids {
        h = (h ^ id as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let (Some(dir), Some(file)) = (args.first(), args.get(1)) else {
        eprintln!("usage: encode TOKENIZER_DIR TEXT_FILE");
        std::process::exit(2);
    };
    let tok = match Tokenizer::from_dir(Path::new(dir)) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let text = match std::fs::read_to_string(file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{file}: {e}");
            std::process::exit(1);
        }
    };
    let ids = tok.encode(&text, false); // warm-up, and the ids to check
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || start.elapsed() < Duration::from_secs(2) {
        let t = Instant::now();
        let n = tok.encode(&text, false).len();
        times.push(t.elapsed().as_secs_f64());
        assert_eq!(n, ids.len());
    }
    times.sort_by(f64::total_cmp);
    let mb = text.len() as f64 / 1e6;
    println!(
        "{{\"bytes\": {}, \"tokens\": {}, \"checksum\": {}, \"runs\": {}, \"best_mb_s\": {:.2}, \"median_mb_s\": {:.2}}}",
        text.len(),
        ids.len(),
        checksum(&ids),
        times.len(),
        mb / times[0],
        mb / times[times.len() / 2]
    );
}
