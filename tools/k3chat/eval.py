"""Held-out tool-call accuracy of a chat model, measured through the Rust engine (`k3 serve` and
its OpenAI-compatible HTTP API), so it is what a client gets.

python3 eval.py [--model ../../models/k3-chat] [--k3 BIN] [--mode unconstrained|constrained|both]
                [--per-kind 40] [--out results.json]
python3 eval.py --server http://127.0.0.1:8000 ...     (use a server that is already running)

The episodes are the held-out ones of gen_data.py (same seeds, held-out name pools), generated
here (no data folder needed): for each declared tool, requests that need it; requests that need
an undeclared tool (a refusal is expected); questions answerable from the prompt; small talk.

Each call episode is a full round trip, as a client does it: request 1 (system + user, tools,
tool_choice auto) must return exactly the expected tool call with arguments that parse as a
JSON object and match; the tool is then run on the model's own arguments (tasks.run_tool), the
assistant message (content + tool_calls, no reasoning, as the openai client sends it back) and
the tool message are appended, and request 2 must answer in `content`, call no tool, and use the
tool result (its salient values appear in the answer). Greedy decoding (temperature 0).

Modes: `unconstrained` sends tool_choice "auto" with --unconstrained-extra merged into each
request (default: nothing else); `constrained` sends tool_choice "auto" with --constrained-extra
(default: nothing else), i.e. whatever grammar the server enforces for auto. Point them at the
server's switch with the two --*-extra JSON options (and --serve-arg for `k3 serve` flags) when
the switch is a request field or a server flag. `--required` adds a third measurement with
tool_choice "required" on the call episodes (the call is then forced).
"""
import argparse
import concurrent.futures as cf
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from gen_data import EPISODE_SEED_OFFSET, episodes  # noqa: E402
from tasks import fmt_num, run_tool  # noqa: E402

REFUSAL = re.compile(r"\b(can't|cannot|can not|not able|unable|sorry|unfortunately)\b", re.I)


def post(url, body, timeout=300):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"error": {"status": e.code, "body": e.read().decode(errors="replace")}}


def norm_expr(s):
    return re.sub(r"\s+", "", str(s)).replace("x", "*")


def args_match(name, got, want):
    if not isinstance(got, dict) or set(got) != set(want):
        return False
    for k, w in want.items():
        g = got[k]
        if isinstance(w, (int, float)) and not isinstance(w, bool):
            if isinstance(g, bool) or not isinstance(g, (int, float)) or abs(float(g) - float(w)) > 1e-9:
                return False
        elif name == "calculator":
            if norm_expr(g) != norm_expr(w):
                return False
        elif not isinstance(g, str) or g.strip().lower() != str(w).strip().lower():
            return False
    return True


def salient(tool, result, col):
    """Values of a tool result that an answer using it must contain."""
    if tool == "calculator":
        return [result]
    try:
        d = json.loads(result)
    except ValueError:
        return [result]
    if "error" in d:
        return []
    if tool == "convert_units":
        return [fmt_num(d["value"])]
    if tool == "lookup":
        return [str(d[col])] if col in d else [str(v) for v in list(d.values())[1:]]
    if tool == "get_weather":
        return [str(d["temperature_c"]), d["condition"]]
    if tool == "send_email":
        return [d["to"]]
    if tool == "set_timer":
        return [fmt_num(d["minutes"])]
    return []


def message(resp):
    if "error" in resp:
        return None
    return resp["choices"][0]["message"]


def leaked(m):
    return any("<|" in (m.get(k) or "") for k in ("content", "reasoning_content"))


def served_model(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


def run_episode(url, ep, extra, tool_choice, max_tokens, model):
    req = dict(ep["request"])
    req.update({"model": model, "temperature": 0, "max_tokens": max_tokens})
    if req.get("tools"):
        req["tool_choice"] = tool_choice
    req.update(extra)
    exp, ref = ep["expected"], ep["reference"]
    rec = {"kind": exp["kind"], "user": req["messages"][-1]["content"]}
    resp = post(url, req)
    m = message(resp)
    if m is None:
        rec["error"] = resp["error"]
        return rec
    calls = m.get("tool_calls") or []
    rec["content"], rec["reasoning"] = m.get("content"), m.get("reasoning_content")
    rec["calls"] = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    rec["leak"] = leaked(m)
    rec["content_present"] = bool((m.get("content") or "").strip())
    if exp["kind"] != "call":
        text = m.get("content") or ""
        rec["no_call"] = not calls
        if exp["kind"] == "refuse":
            rec["ok"] = not calls and bool(REFUSAL.search(text))
        elif exp["kind"] == "direct":
            rec["ok"] = not calls and all(e.lower() in text.lower() for e in ref.get("expect", []))
        else:
            rec["ok"] = not calls and bool(text.strip())
        return rec
    want = exp["calls"]
    rec["tool_ok"] = len(calls) == len(want) and all(c["function"]["name"] == w["name"] for c, w in zip(calls, want))
    parsed = []
    for c in calls:
        try:
            a = json.loads(c["function"]["arguments"])
            parsed.append(a if isinstance(a, dict) else None)
        except ValueError:
            parsed.append(None)
    rec["json_ok"] = bool(calls) and all(p is not None for p in parsed)
    rec["args_ok"] = rec["tool_ok"] and rec["json_ok"] and all(
        args_match(w["name"], p, w["arguments"]) for p, w in zip(parsed, want))
    rec["final_ok"] = False
    if not calls or not rec["json_ok"]:
        return rec
    ctx = ep["ctx"]
    results = [run_tool(c["function"]["name"], p, ctx) for c, p in zip(calls, parsed)]
    msgs = list(ep["request"]["messages"]) + [
        {"role": "assistant", "content": m.get("content") or "",
         "tool_calls": [{"id": c.get("id") or f"call_{i}", "type": "function",
                         "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
                        for i, c in enumerate(calls)]}]
    for c, res in zip(msgs[-1]["tool_calls"], results):
        msgs.append({"role": "tool", "tool_call_id": c["id"], "content": res})
    req2 = {**req, "messages": msgs}
    if req2.get("tool_choice") == "required":
        req2["tool_choice"] = "auto"
    resp2 = post(url, req2)
    m2 = message(resp2)
    if m2 is None:
        rec["error2"] = resp2["error"]
        return rec
    text = m2.get("content") or ""
    cols = ref.get("cols") or [None] * len(calls)
    need = [v for c, res, col in zip(calls, results, cols) for v in salient(c["function"]["name"], res, col)]
    rec["final"], rec["final_calls"], rec["need"] = text, len(m2.get("tool_calls") or []), need
    rec["leak"] = rec["leak"] or leaked(m2)
    rec["final_ok"] = not m2.get("tool_calls") and bool(text.strip()) and all(v.lower() in text.lower() for v in need)
    return rec


def summarise(recs):
    def rate(xs):
        xs = list(xs)
        return {"n": len(xs), "rate": round(sum(xs) / len(xs), 4) if xs else None}
    calls = [r for r in recs if r["kind"] == "call"]
    out = {
        "tool_call": {
            "right_tool": rate(r.get("tool_ok", False) for r in calls),
            "arguments_json": rate(r.get("json_ok", False) for r in calls),
            "arguments_match": rate(r.get("args_ok", False) for r in calls),
            "final_uses_result": rate(r.get("final_ok", False) for r in calls),
            "end_to_end": rate(r.get("args_ok", False) and r.get("final_ok", False) for r in calls),
        },
        "by_tool": {},
        "refusal_of_undeclared": rate(r["ok"] for r in recs if r["kind"] == "refuse" and "ok" in r),
        "direct_answers": rate(r["ok"] for r in recs if r["kind"] == "direct" and "ok" in r),
        "small_talk": rate(r["ok"] for r in recs if r["kind"] == "chat" and "ok" in r),
        "no_call_when_none_needed": rate(r.get("no_call", False) for r in recs if r["kind"] != "call"),
        "content_present_first_turn_non_call": rate(r.get("content_present", False) for r in recs if r["kind"] != "call"),
        "xtml_leaks": sum(bool(r.get("leak")) for r in recs),
        "errors": sum(bool(r.get("error") or r.get("error2")) for r in recs),
    }
    by = {}
    for r in calls:
        by.setdefault(r["tool"], []).append(r)
    for t, rs in sorted(by.items()):
        out["by_tool"][t] = {"n": len(rs), "arguments_match": rate(r.get("args_ok", False) for r in rs)["rate"],
                             "end_to_end": rate(r.get("args_ok", False) and r.get("final_ok", False) for r in rs)["rate"]}
    return out


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start_server(k3, model, serve_args, log):
    port = free_port()
    cmd = [k3, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port)] + serve_args
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if p.poll() is not None:
            raise SystemExit(f"k3 serve exited with {p.returncode}; see its log")
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return p, url
        except Exception:
            time.sleep(0.5)
    p.kill()
    raise SystemExit("k3 serve did not become healthy in 300 s")


def find_k3():
    for c in [os.environ.get("K3_BIN", ""), os.path.join(os.environ.get("CARGO_TARGET_DIR", "/nonexistent"), "release", "k3"),
              os.path.join(ROOT, "target", "release", "k3")]:
        if c and os.path.isfile(c):
            return c
    raise SystemExit("no k3 binary: build it (cargo build --release -p k3-cli) or pass --k3")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "k3-chat"))
    ap.add_argument("--k3", help="k3 binary (default: $K3_BIN, $CARGO_TARGET_DIR/release/k3, target/release/k3)")
    ap.add_argument("--server", help="URL of a running k3 serve (then --model/--k3 are not used)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `k3 serve` argument (repeatable)")
    ap.add_argument("--mode", choices=["unconstrained", "constrained", "both"], default="both")
    ap.add_argument("--unconstrained-extra", default="{}", help="JSON merged into each unconstrained request")
    ap.add_argument("--constrained-extra", default="{}", help="JSON merged into each constrained request")
    ap.add_argument("--required", action="store_true", help="also measure call episodes with tool_choice required")
    ap.add_argument("--per-kind", type=int, default=40, help="episodes per tool / kind (refusals: twice)")
    ap.add_argument("--seed", type=int, default=1, help="gen_data.py --seed of the training run")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--out", help="write the summary and every episode's record here (JSON)")
    a = ap.parse_args()
    eps = episodes(a.seed * 10 ** 7 + EPISODE_SEED_OFFSET, a.per_kind)
    for e in eps:
        e["tool"] = e["expected"]["calls"][0]["name"] if e["expected"]["kind"] == "call" else None
    proc = None
    if a.server:
        url = a.server.rstrip("/")
    else:
        log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "k3chat_eval_serve.log"), "w")
        proc, url = start_server(a.k3 or find_k3(), a.model, a.serve_arg, log)
    model = served_model(url)
    runs = []
    if a.mode in ("unconstrained", "both"):
        runs.append(("unconstrained", json.loads(a.unconstrained_extra), "auto", eps))
    if a.mode in ("constrained", "both"):
        runs.append(("constrained", json.loads(a.constrained_extra), "auto", eps))
    if a.required:
        extra = json.loads(a.constrained_extra)
        runs.append(("required", extra, "required", [e for e in eps if e["expected"]["kind"] == "call"]))
    report = {"model": a.model if not a.server else a.server, "episodes": len(eps), "runs": {}}
    try:
        for name, extra, choice, subset in runs:
            t0 = time.time()
            with cf.ThreadPoolExecutor(a.parallel) as ex:
                recs = list(ex.map(lambda e: run_episode(url, e, extra, choice, a.max_tokens, model), subset))
            for r, e in zip(recs, subset):
                r["tool"] = e["tool"]
            s = summarise(recs)
            s["seconds"] = round(time.time() - t0, 1)
            report["runs"][name] = {"summary": s, "records": recs}
            print(f"== {name} ({len(subset)} episodes, {s['seconds']} s)\n" + json.dumps(s, indent=1), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    if a.out:
        json.dump(report, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
