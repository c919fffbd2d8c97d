"""render.py == the Rust renderer, id for id, on generated conversations; the pure-Python encoder
== tiktoken. Run: python3 -m pytest -q test_render.py (K3_BIN=path/to/k3, default: the repository's
target/release/k3 or $CARGO_TARGET_DIR/release/k3; the Rust part is skipped without a binary).

What is compared is what `k3 serve` feeds the model: the prompt of every request a client would
send in these conversations (each prefix ending in a user or tool message, with the generation
stub; `k3 render-chat` is the server's render_chat), and the whole training sequence as a
prompt-less render (add_generation_prompt false).
"""
import json
import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gen_data import sample_segments  # noqa: E402
from render import Encoder, render_segments  # noqa: E402
from tasks import Gen  # noqa: E402

TOK = os.path.join(HERE, "tok")
ROOT = os.path.dirname(os.path.dirname(HERE))


def k3_bin():
    cands = [os.environ.get("K3_BIN", "")]
    if os.environ.get("CARGO_TARGET_DIR"):
        cands.append(os.path.join(os.environ["CARGO_TARGET_DIR"], "release", "k3"))
    cands += [os.path.join(ROOT, "target", "release", "k3"), "/work/target-chat/release/k3"]
    return next((c for c in cands if c and os.path.isfile(c)), None)


def requests(n, seed=42):
    """Full conversations and every client-side prompt prefix of them."""
    g = Gen(seed, heldout=True)
    out = []
    for _ in range(n):
        req, _, _ = g.conversation()
        out.append((req, False))
        msgs = req["messages"]
        for k in range(1, len(msgs) + 1):
            if msgs[k - 1]["role"] in ("user", "tool") and (k == len(msgs) or msgs[k]["role"] == "assistant"):
                out.append(({**req, "messages": msgs[:k]}, True))
    return out


def python_ids(enc, req, gen_prompt):
    segs = render_segments(req, add_generation_prompt=True) if gen_prompt else sample_segments(req)
    return enc.encode_segments(segs)[0]


@pytest.mark.skipif(k3_bin() is None, reason="no k3 binary (set K3_BIN)")
def test_matches_rust_renderer():
    enc = Encoder(os.path.join(TOK, "tiktoken.model"))
    cases = requests(60)
    checked = 0
    with tempfile.TemporaryDirectory() as d:
        for i, (req, gen_prompt) in enumerate(cases):
            if req.get("tool_choice") == "required" and not gen_prompt:
                continue  # a training sample of that kind is a prompt + generated turn, checked below
            body = dict(req)
            if not gen_prompt:
                body["add_generation_prompt"] = False
            p = os.path.join(d, f"r{i}.json")
            json.dump(body, open(p, "w"))
            out = subprocess.run([k3_bin(), "render-chat", "--tokenizer", TOK, "--request", p],
                                 check=True, capture_output=True, text=True).stdout
            rust = json.loads(out)["ids"]
            mine = python_ids(enc, req, gen_prompt)
            assert mine == rust, (i, enc.decode(mine), json.loads(out)["text"])
            checked += 1
    assert checked > 150


def test_required_sample_is_prompt_plus_generation():
    enc = Encoder(os.path.join(TOK, "tiktoken.model"))
    g = Gen(7)
    n = 0
    while n < 5:
        req, _, _ = g.conversation()
        if req.get("tool_choice") != "required":
            continue
        segs = sample_segments(req)
        k = max(i for i, m in enumerate(req["messages"]) if m.get("tool_calls"))
        prompt = render_segments({**req, "messages": req["messages"][:k]})
        assert segs[:len(prompt)] == prompt and all(s[2] for s in segs[len(prompt):])
        assert enc.decode(enc.encode_segments(segs[len(prompt):])[0]).endswith("<|close|>message<|sep|><|end_of_msg|>")
        n += 1


def test_encoder_matches_tiktoken():
    tiktoken = pytest.importorskip("tiktoken")
    pytest.importorskip("regex")
    sys.path.insert(0, os.path.join(HERE, "..", "k3nano"))
    from tokenizer_train import load_encoding
    ref = load_encoding(TOK)
    enc = Encoder(os.path.join(TOK, "tiktoken.model"))
    g = Gen(3, heldout=True)
    for _ in range(300):
        for text, control, _ in sample_segments(g.conversation()[0]):
            if not control:
                assert enc.encode(text) == ref.encode(text, disallowed_special=()), text
    odd = ["a  b\n\n  c", "x's 'S IT'LL", "12345678 9.5e-3", "  \n", "A1b2C3", "{\"k\":[1,2]}", "dots... -- dashes!?", "end "]
    for t in odd:
        assert enc.encode(t) == ref.encode(t, disallowed_special=()), t
    assert tiktoken is not None
