#!/usr/bin/env python3
"""Multi-turn TTFT with and without the prefix cache, in one run (issue 21).

Starts `k3 serve` twice on the same model (first with --no-prefix-cache, then with the default
settings, i.e. the cache on), and on each drives the same workload: N concurrent conversations
(a shared system prompt + tool definitions, a conversation-specific first question, then a growing
history of assistant answers and follow-ups) of T turns, streamed, greedy. Per turn it reports the
median time to first token over the conversations, the mean prompt length and the mean
`usage.prompt_tokens_details.cached_tokens`, and whether the answers of the two servers were equal.

    python3 tools/prefix_bench.py [--k3 target/release/k3] [--model DIR] [--tokenizer DIR] [--turns 8]
        [--convs 8] [--system-repeat 2] [--serve-arg=--device --serve-arg=cuda ...]

Standard library only. The numbers of the README's "Prefix caching" section come from this script.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

SYSTEM_TEXT = (
    "You are the prompter of a company of players. When an actor forgets a line, you give him the next words "
    "of the speech, no more, in the manner of the play; you never explain, you never apologise, and you keep "
    "to the verse. The company plays Romeo and Juliet, Hamlet, Macbeth and The Tempest this season; the prompt "
    "book for each play is open before you, and you follow the scene as it is spoken. Call a tool when the "
    "stage manager asks for the cue sheet, the weather for the open-air performance, or the list of players. "
)

TOOLS = [
    {"type": "function", "function": {"name": "cue_sheet", "description": "The cue sheet of a scene",
        "parameters": {"type": "object", "properties": {"play": {"type": "string"}, "act": {"type": "integer"},
        "scene": {"type": "integer"}}, "required": ["play", "act", "scene"]}}},
    {"type": "function", "function": {"name": "weather", "description": "The forecast for tonight's performance",
        "parameters": {"type": "object", "properties": {"town": {"type": "string"}}, "required": ["town"]}}},
    {"type": "function", "function": {"name": "players", "description": "Who plays which part",
        "parameters": {"type": "object", "properties": {"play": {"type": "string"}}, "required": ["play"]}}},
]

FIRST = ["ROMEO. But soft, what light", "JULIET. O Romeo, Romeo", "HAMLET. To be, or not to be",
         "MACBETH. Is this a dagger", "PROSPERO. Our revels now", "MERCUTIO. A plague o' both",
         "OPHELIA. O, what a noble mind", "LADY MACBETH. Out, damned spot"]
FOLLOW = ["And then?", "The next line.", "Again, louder.", "What follows?", "Go on.", "And after that?",
          "Once more.", "The rest of it."]


def start(k3, model, tokenizer, extra):
    cmd = [k3, "serve", "--port", "0"] + (["--model", model] if model else []) + (["--tokenizer", tokenizer] if tokenizer else []) + extra
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if "listening on" in line:
            return p, line.split("http://")[1].split()[0]
    raise SystemExit(f"{' '.join(cmd)} did not start: {p.stderr.read()}")


def stream_chat(addr, messages, max_tokens):
    body = {"messages": messages, "tools": TOOLS, "reasoning_effort": "none", "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"http://{addr}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            v = json.loads(line[6:])
            if v.get("usage"):
                usage = v["usage"]
            for c in v.get("choices", []):
                d = c.get("delta", {})
                piece = d.get("content") or d.get("reasoning_content") or ""
                if (piece or d.get("tool_calls") or c.get("finish_reason")) and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
    return ttft, text, usage


def workload(addr, turns, convs, max_tokens, system):
    """rows[turn][conv] = (ttft, prompt_tokens, cached_tokens, answer)"""
    rows = [[None] * convs for _ in range(turns)]
    errors = []

    def conv(i):
        try:
            one(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"conversation {i}: {e!r}")

    def one(i):
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": FIRST[i % len(FIRST)]}]
        for t in range(turns):
            ttft, text, usage = stream_chat(addr, msgs, max_tokens)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows[t][i] = (ttft, usage["prompt_tokens"], cached, text)
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW[(i + t) % len(FOLLOW)]}]

    th = [threading.Thread(target=conv, args=(i,)) for i in range(convs)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    if errors:
        raise SystemExit("; ".join(errors))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    tgt = os.environ.get("CARGO_TARGET_DIR", os.path.join(here, "..", "target"))
    ap.add_argument("--k3", default=os.path.join(tgt, "release", "k3"))
    ap.add_argument("--model", default=None, help="model directory (default: the embedded k3-nano)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--convs", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    ap.add_argument("--system-repeat", type=int, default=2, help="copies of the system prompt's text (a longer shared prefix)")
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra `k3 serve` argument (repeat it)")
    ap.add_argument("--control", action="store_true",
                    help="also run a second cache-off server: how often two servers without the cache agree (random weights on a GPU)")
    ap.add_argument("--json", default=None, help="also write the per-request rows here")
    a = ap.parse_args()
    system = SYSTEM_TEXT * a.system_repeat
    results = {}
    modes = [("off", ["--no-prefix-cache"]), ("on", [])] + ([("off again", ["--no-prefix-cache"])] if a.control else [])
    for mode, extra in modes:
        p, addr = start(a.k3, a.model, a.tokenizer, a.serve_arg + extra)
        try:
            t0 = time.perf_counter()
            results[mode] = workload(addr, a.turns, a.convs, a.max_tokens, system)
            wall = time.perf_counter() - t0
            with urllib.request.urlopen(f"http://{addr}/metrics") as r:
                metrics = [l for l in r.read().decode().splitlines() if l.startswith("k3_prefix_cache") and not l.startswith("#")]
            print(f"cache {mode}: {a.convs} conversations x {a.turns} turns in {wall:.1f} s", file=sys.stderr)
            for l in metrics:
                print(f"  {l}", file=sys.stderr)
        finally:
            p.terminate()
            p.wait()
    off, on = results["off"], results["on"]
    ctl = results.get("off again")
    print("| turn | prompt tokens (mean) | TTFT median, cache off | TTFT median, cache on | speed-up | cached tokens (mean, on) | answers equal |"
          + (" answers equal, off vs off |" if ctl else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if ctl else ""))
    for t in range(a.turns):
        m_off = statistics.median(r[0] for r in off[t]) * 1e3
        m_on = statistics.median(r[0] for r in on[t]) * 1e3
        ptok = statistics.mean(r[1] for r in on[t])
        cached = statistics.mean(r[2] for r in on[t])
        same = sum(x[3] == y[3] for x, y in zip(off[t], on[t]))
        row = f"| {t + 1} | {ptok:.0f} | {m_off:.0f} ms | {m_on:.0f} ms | {m_off / m_on:.2f}x | {cached:.0f} | {same}/{a.convs} |"
        if ctl:
            row += f" {sum(x[3] == y[3] for x, y in zip(off[t], ctl[t]))}/{a.convs} |"
        print(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"off": off, "on": on}, f)


if __name__ == "__main__":
    main()
