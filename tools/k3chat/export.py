"""Export a trained k3-chat checkpoint into the release format (the same as k3-nano's:
tools/k3nano/export.py writes the weights and config, this adds the chat cross-check).

python3 export.py --ckpt RUN/best [--summary RUN/summary.json] [--data work/data] --out ../../models/k3-chat

RUN/best means the parts RUN/best.0.pt, RUN/best.1.pt, ... that train.py writes. Writes
config.json, model.safetensors, tiktoken.model, tokenizer_config.json (from tok/),
crosscheck.safetensors, samples.json and export_info.json.

crosscheck.safetensors: for a few chat prompts (rendered as the server renders them, plus this
model's greedy continuation) `ids_i` (I64, the whole sequence), `pos_i` (I64, the positions
whose logits are stored: the last ones, covering the generated tokens) and `logits_i` (F32,
[len(pos_i), vocab]), computed on CPU in f32 from the exported bf16 weights with the naive KDA
recurrence. Kept under 500 kB. crates/k3-model/tests/chat.rs checks the Rust engine against it.
"""
import argparse
import importlib.util
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
NANO = os.path.join(HERE, "..", "k3nano")
sys.path.insert(0, NANO)

_spec = importlib.util.spec_from_file_location("k3nano_export", os.path.join(NANO, "export.py"))
nano_export = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nano_export)
from render import Encoder, render_segments  # noqa: E402
from tasks import declaration  # noqa: E402


CALC = declaration("calculator")
UNITS = declaration("convert_units")
WEATHER = declaration("get_weather")
SAMPLE_REQUESTS = [
    {"messages": [{"role": "user", "content": "What is 37 * 12?"}], "tools": [CALC, UNITS]},
    {"messages": [{"role": "user", "content": "Hello! Who are you?"}]},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "How many km is 26.2 miles?"}], "tools": [UNITS, CALC]},
    {"messages": [{"role": "user", "content": "What is 37 * 12?"},
                  {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                   "function": {"name": "calculator", "arguments": "{\"expression\": \"37 * 12\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "444"}], "tools": [CALC]},
    {"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": [CALC]},
    {"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": [WEATHER, CALC]},
]
CROSSCHECK = [0, 1, 3]       # which sample requests go into crosscheck.safetensors
CC_POSITIONS = 28            # logits kept per prompt: 3 x 28 x 1280 x 4 B = 430 kB


@torch.no_grad()
def greedy(model, ids, eom, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        t = int(model(torch.tensor([ids]))[0, -1].argmax())
        ids.append(t)
        out.append(t)
        if t == eom:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="checkpoint base: RUN/best for RUN/best.N.pt")
    ap.add_argument("--summary", help="train.py's summary.json (default: beside the checkpoint)")
    ap.add_argument("--data", help="gen_data.py's output folder, for data.json (optional)")
    ap.add_argument("--tok", default=os.path.join(HERE, "tok"))
    ap.add_argument("--out", default=os.path.join(HERE, "..", "..", "models", "k3-chat"))
    ap.add_argument("--gen_tokens", type=int, default=120)
    a = ap.parse_args()
    c, model, meta = nano_export.load_export_model(a.ckpt)
    nano_export.write_weights(model, a.out)
    enc = Encoder(os.path.join(a.tok, "tiktoken.model"))
    assert enc.n_ranks + 256 == c.vocab_size, (enc.n_ranks, c.vocab_size)
    json.dump(nano_export.release_config(c, enc.n_ranks), open(os.path.join(a.out, "config.json"), "w"), indent=2)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tok, f), os.path.join(a.out, f))
    eom = enc.special["<|end_of_msg|>"]
    samples, seqs = [], []
    for i, req in enumerate(SAMPLE_REQUESTS):
        prompt, _ = enc.encode_segments(render_segments(req))
        gen = greedy(model, prompt, eom, a.gen_tokens)
        seqs.append((prompt, gen))
        samples.append({"request": req, "prompt_tokens": len(prompt), "output": enc.decode(gen),
                        "output_ids": gen, "decoding": "greedy"})
        print(f"---- sample {i}: {req['messages'][-1]['content']!r}\n{enc.decode(gen)}", flush=True)
    json.dump(samples, open(os.path.join(a.out, "samples.json"), "w"), indent=1)
    cc = {}
    for j, i in enumerate(CROSSCHECK):
        prompt, gen = seqs[i]
        ids = prompt + gen[:-1] if gen and gen[-1] == eom else prompt + gen
        lg = model(torch.tensor([ids]), recurrent=True)[0].float()
        lg2 = model(torch.tensor([ids]))[0].float()
        err = ((lg - lg2).norm(dim=-1) / lg.norm(dim=-1)).max().item()
        pos = list(range(max(0, len(ids) - CC_POSITIONS), len(ids)))
        print(f"crosscheck {j}: {len(ids)} tokens, {len(pos)} positions kept, recurrent vs chunked rel-L2 {err:.2e}")
        cc[f"ids_{j}"] = torch.tensor(ids, dtype=torch.int64)
        cc[f"pos_{j}"] = torch.tensor(pos, dtype=torch.int64)
        cc[f"logits_{j}"] = lg[pos].contiguous()
    path = os.path.join(a.out, "crosscheck.safetensors")
    save_file(cc, path, metadata={"n_prompts": str(len(CROSSCHECK)),
                                  "note": "PyTorch k3chat f32 CPU logits [len(pos_i), vocab] at positions pos_i of ids_i"})
    assert os.path.getsize(path) < 500_000, os.path.getsize(path)
    ckdir = os.path.dirname(a.ckpt)
    summ = a.summary or os.path.join(ckdir, "summary.json")
    info = {"params": sum(v.numel() for v in rel.values()), "cfg": c.to_dict(),
            "checkpoint": {k: v for k, v in meta.items() if k not in ("state", "cfg")},
            "train": json.load(open(summ)) if os.path.exists(summ) else None}
    if a.data and os.path.exists(os.path.join(a.data, "data.json")):
        info["data"] = json.load(open(os.path.join(a.data, "data.json")))
    elif os.path.exists(os.path.join(ckdir, "data.json")):
        info["data"] = json.load(open(os.path.join(ckdir, "data.json")))
    json.dump(info, open(os.path.join(a.out, "export_info.json"), "w"), indent=1)
    print(json.dumps({"params": info["params"], "bytes": os.path.getsize(os.path.join(a.out, "model.safetensors")),
                      "crosscheck_bytes": os.path.getsize(path)}))


if __name__ == "__main__":
    main()
