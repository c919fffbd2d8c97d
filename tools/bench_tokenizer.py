#!/usr/bin/env python3
"""Encode throughput: k3-tokenizer (Rust) vs the Python `tiktoken` package (issue 6).

Usage: python3 tools/bench_tokenizer.py [--tokenizer DIR] [--mb 8] [--text FILE]

Builds one large text (the Debian licence texts plus the multilingual ~200K-character case of
the tokenizer goldens, repeated to --mb megabytes) unless --text is given, then:
- encodes it with tiktoken 0.14 configured as tokenization_kimi.py configures it (Kimi pat_str,
  the file's ranks, 256 specials), special names as plain text, single-threaded, both raw
  (`Encoding.encode`) and through the Kimi 400k/25k pre-split;
- runs `cargo bench -p k3-tokenizer --bench encode` on the same file and tokenizer;
- checks both produce the same ids (count + FNV-1a checksum) and prints MB/s and the ratio.
Needs `pip install tiktoken==0.14.0`.
"""
import argparse, base64, json, os, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.environ.get("K3_GOLDEN_DIR", os.path.join(ROOT, "..", "shared", "golden"))
PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def load_encoding(tok_dir):
    import tiktoken
    ranks = {}
    with open(os.path.join(tok_dir, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
    with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
        added = json.load(f).get("added_tokens_decoder", {})
    n = len(ranks)
    specials = {added.get(str(i), {}).get("content", f"<|reserved_token_{i}|>"): i for i in range(n, n + 256)}
    return tiktoken.Encoding("kimi-bench", pat_str=PAT, mergeable_ranks=ranks, special_tokens=specials)


def kimi_pieces(text):
    """tokenization_kimi.py's pre-split: 400k-char chunks, runs > 25k (str.isspace) cut."""
    for i in range(0, len(text), 400_000):
        s = text[i:i + 400_000]
        start, run, is_space = 0, 0, s[0].isspace() if s else False
        for j, c in enumerate(s):
            sp = c.isspace()
            if sp != is_space:
                run, is_space = 1, sp
            else:
                run += 1
                if run > 25_000:
                    yield s[start:j]
                    start, run = j, 1
        yield s[start:]


def fnv(ids):
    h = 0xcbf29ce484222325
    for i in ids:
        h = ((h ^ i) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def timed(fn, min_s=2.0):
    times, out, start = [], None, time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return out, times[0], times[len(times) // 2]


def build_text(mb):
    parts = []
    lic = "/usr/share/common-licenses"
    if os.path.isdir(lic):
        for name in sorted(os.listdir(lic)):
            p = os.path.join(lic, name)
            if os.path.isfile(p):
                parts.append(open(p, encoding="utf-8", errors="replace").read())
    cases = json.load(open(os.path.join(GOLDEN, "tokenizer", "cases.json")))
    parts += [c["text"] for c in cases["encode_cases"] if c["name"] == "long_200k"]
    unit = "\n".join(parts)
    reps = max(1, int(mb * 1e6 / len(unit.encode())))
    return unit * reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(GOLDEN, "tokenizer"))
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--text")
    a = ap.parse_args()
    text = open(a.text, encoding="utf-8").read() if a.text else build_text(a.mb)
    nbytes = len(text.encode())
    enc = load_encoding(a.tokenizer)

    raw_ids, raw_best, raw_med = timed(lambda: enc.encode(text, disallowed_special=()))
    kimi = lambda: [i for p in kimi_pieces(text) for i in enc.encode(p, disallowed_special=())]
    kimi_ids, kimi_best, kimi_med = timed(kimi)

    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
        path = f.name
    try:
        cmd = ["cargo", "bench", "-q", "-p", "k3-tokenizer", "--bench", "encode", "--", a.tokenizer, path]
        res = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
        rust = json.loads(res.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(path)

    same = rust["tokens"] == len(kimi_ids) and rust["checksum"] == fnv(kimi_ids)
    mbps = lambda t: nbytes / 1e6 / t
    report = {
        "text_bytes": nbytes,
        "tokens": len(kimi_ids),
        "ids_identical_to_tiktoken": same,
        "tiktoken_raw_mb_s": {"best": round(mbps(raw_best), 2), "median": round(mbps(raw_med), 2)},
        "tiktoken_kimi_presplit_mb_s": {"best": round(mbps(kimi_best), 2), "median": round(mbps(kimi_med), 2)},
        "k3_tokenizer_mb_s": {"best": rust["best_mb_s"], "median": rust["median_mb_s"]},
        "ratio_median_vs_tiktoken_raw": round(rust["median_mb_s"] / mbps(raw_med), 2),
        "ratio_median_vs_tiktoken_kimi": round(rust["median_mb_s"] / mbps(kimi_med), 2),
    }
    print(json.dumps(report, indent=2))
    if not same:
        sys.exit("ids differ from tiktoken")


if __name__ == "__main__":
    main()
