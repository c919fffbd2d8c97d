"""Generate the k3-chat training data: synthetic conversations (tasks.py), rendered in the XTML
chat format exactly as `k3 serve` renders prompts (render.py, checked against the Rust renderer
by test_render.py) and tokenized with the k3-chat tokenizer. Deterministic by seed; needs only
the Python standard library and numpy (so it runs on the GPU machine).

python3 gen_data.py --tok tok --out work [--train 60000 --val 2000 --seed 1]
  -> work/train.npy (uint16 tokens, conversations back to back), work/train_off.npy (int64 start
     of each conversation, plus the end), work/train_mask.npy (uint8: 1 on the tokens the
     assistant generates), the same for val_*, work/val_episodes.jsonl (held-out evaluation
     episodes for eval.py), work/data.json (counts)
python3 gen_data.py --counts work/pretok_counts.json --train 20000
  -> pre-token counts of the rendered text segments, for tokenizer training (no tokenizer needed)

The held-out split uses other seeds and mixes in names, cities and products that the training
split never contains, so that copying, not memorising, is measured.
"""
import argparse
import collections
import json
import multiprocessing as mp
import os
import time

from render import Encoder, pretokenize_counts, render_segments
from tasks import TOOL_NAMES, Gen

CHUNK = 1000
VAL_SEED_OFFSET = 10 ** 6
EPISODE_SEED_OFFSET = 2 * 10 ** 6


def sample_segments(req):
    """Segments of one training sample. A request with tool_choice=required is a prompt (its
    note comes after the messages) followed by the calling assistant turn's generated part."""
    if req.get("tool_choice") != "required":
        return render_segments(req, add_generation_prompt=False)
    msgs = req["messages"]
    k = max(i for i, m in enumerate(msgs) if m["role"] == "assistant" and m.get("tool_calls"))
    prompt = render_segments({**req, "messages": msgs[:k]}, add_generation_prompt=True)
    alone = {key: v for key, v in req.items() if key not in ("messages", "tool_choice")}
    gen = [s for s in render_segments({**alone, "messages": [msgs[k]]}, add_generation_prompt=False) if s[2]]
    return prompt + gen


def chunk_conversations(seed, n, heldout):
    g = Gen(seed, heldout=heldout)
    return [g.conversation()[0] for _ in range(n)]


def _encode_chunk(job):
    seed, n, heldout, tok_dir, max_len = job
    enc = Encoder(os.path.join(tok_dir, "tiktoken.model"))
    ids, mask, lens, dropped = [], [], [], 0
    for req in chunk_conversations(seed, n, heldout):
        i, m = enc.encode_segments(sample_segments(req))
        if len(i) > max_len:
            dropped += 1
            continue
        ids.extend(i)
        mask.extend(m)
        lens.append(len(i))
    return ids, mask, lens, dropped


def _count_chunk(job):
    seed, n, heldout = job
    c = collections.Counter()
    for req in chunk_conversations(seed, n, heldout):
        pretokenize_counts(sample_segments(req), c)
    return c


def jobs(seed, n, heldout, extra=()):
    out, k = [], 0
    while n > 0:
        out.append((seed + k, min(CHUNK, n), heldout) + tuple(extra))
        n -= CHUNK
        k += 1
    return out


def episodes(seed, per_kind):
    """Held-out evaluation episodes: one exchange each, balanced over kinds and tools."""
    g = Gen(seed, heldout=True)
    out = []
    plan = [("call", t) for t in TOOL_NAMES] + [("refuse", None), ("direct", None), ("chat", None)]
    for kind, tool in plan:
        n = per_kind * (2 if kind == "refuse" else 1)
        for _ in range(n):
            ctx, ex = g.episode(kind, tool)
            msgs = ([{"role": "system", "content": ctx["system"]}] if ctx["system"] else []) + \
                [{"role": "user", "content": ex["user"]}]
            req = {"messages": msgs}
            if ctx["tools"]:
                req["tools"] = g.tools_json(ctx)
            exp = {"kind": kind, "final": ex["final"]}
            if kind == "call":
                exp["calls"] = [{"name": t, "arguments": a} for t, a in ex["calls"]]
            out.append({"request": req, "ctx": {"table": ctx["table"], "tools": ctx["tools"]}, "expected": exp,
                        "reference": ex})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tok", default="tok", help="folder with tiktoken.model")
    ap.add_argument("--out", default="work")
    ap.add_argument("--train", type=int, default=60000, help="training conversations")
    ap.add_argument("--val", type=int, default=2000, help="held-out conversations (loss)")
    ap.add_argument("--episodes", type=int, default=40, help="held-out eval episodes per kind/tool")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--counts", help="write pre-token counts (tokenizer training) to this file and stop")
    a = ap.parse_args()
    t0 = time.time()
    base = a.seed * 10 ** 7
    with mp.Pool(a.workers) as pool:
        if a.counts:
            total = collections.Counter()
            for c in pool.imap(_count_chunk, jobs(base, a.train, False)):
                total.update(c)
            os.makedirs(os.path.dirname(a.counts) or ".", exist_ok=True)
            json.dump(dict(total), open(a.counts, "w"))
            print(f"{len(total)} distinct pre-tokens, {sum(total.values())} total, {time.time() - t0:.1f}s")
            return
        import numpy as np
        os.makedirs(a.out, exist_ok=True)
        stats = {"seed": a.seed, "max_len": a.max_len}
        for split, n, seed, held in (("train", a.train, base, False), ("val", a.val, base + VAL_SEED_OFFSET, True)):
            ids, mask, lens, dropped = [], [], [], 0
            for i, m, l, d in pool.imap(_encode_chunk, jobs(seed, n, held, (a.tok, a.max_len))):
                ids.extend(i)
                mask.extend(m)
                lens.extend(l)
                dropped += d
            off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            np.save(os.path.join(a.out, f"{split}.npy"), np.array(ids, dtype=np.uint16))
            np.save(os.path.join(a.out, f"{split}_mask.npy"), np.array(mask, dtype=np.uint8))
            np.save(os.path.join(a.out, f"{split}_off.npy"), off)
            L = np.array(lens)
            stats[split] = {"conversations": len(lens), "dropped_over_max_len": dropped, "tokens": int(off[-1]),
                            "trained_tokens": int(sum(mask)), "mean_len": float(L.mean()), "max_len": int(L.max()),
                            "p95_len": float(np.percentile(L, 95))}
            print(split, stats[split], flush=True)
    eps = episodes(base + EPISODE_SEED_OFFSET, a.episodes)
    with open(os.path.join(a.out, "val_episodes.jsonl"), "w") as f:
        for e in eps:
            f.write(json.dumps(e) + "\n")
    stats["episodes"] = len(eps)
    stats["seconds"] = round(time.time() - t0, 1)
    json.dump(stats, open(os.path.join(a.out, "data.json"), "w"), indent=1)
    print(json.dumps({"episodes": len(eps), "seconds": stats["seconds"]}))


if __name__ == "__main__":
    main()
