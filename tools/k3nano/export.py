"""Export a trained k3-nano into the release checkpoint format.

python3 export.py --ckpt runs/h200/best --tok work/tok --prep work/prep.json --summary runs/h200/summary.json \
                  --out ../../models/k3-nano

Writes config.json (nested release schema), model.safetensors (release names; BF16, with the
tensors the release keeps F32 stored F32), tiktoken.model, tokenizer_config.json,
crosscheck.safetensors (prompt ids + this PyTorch model's f32 logits) and samples.json.
The logits are computed on CPU in f32 with the exported (bf16-rounded) weights, with the naive
KDA recurrence and the sparse MoE path.
"""
import argparse
import glob
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

from model import NanoConfig, K3Nano
from tokenizer_train import load_encoding

KEEP_F32 = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")

PROMPTS = [
    "ROMEO:",
    "To be, or not to be, that is the question:",
    "Of Mans First Disobedience, and the Fruit",
    "KING HENRY.\nOnce more unto the breach, dear friends, once more;",
]


def load_ckpt(base):
    state, meta = {}, None
    for f in sorted(glob.glob(base + ".*.pt")):
        d = torch.load(f, map_location="cpu")
        state.update(d["state"])
        meta = d
    return meta["cfg"], state, meta


def release_config(c: NanoConfig, n_ranks):
    bos, eos, pad = n_ranks + 0, n_ranks + 2, n_ranks + 255
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "hidden_act": "situ",
        "activation_situ_beta": c.activation_situ_beta,
        "activation_situ_linear_beta": c.activation_situ_linear_beta,
        "initializer_range": 0.02,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": 4096,
        "use_cache": True,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "q_lora_rank": c.q_lora_rank,
        "kv_lora_rank": c.kv_lora_rank,
        "qk_nope_head_dim": c.qk_nope_head_dim,
        "qk_rope_head_dim": c.qk_rope_head_dim,
        "v_head_dim": c.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": c.num_experts,
        "num_experts_per_token": c.num_experts_per_token,
        "num_shared_experts": c.num_shared_experts,
        "moe_intermediate_size": c.moe_intermediate_size,
        "routed_expert_hidden_size": c.routed_expert_hidden_size,
        "latent_moe_use_norm": True,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": c.routed_scaling_factor,
        "first_k_dense_replace": c.first_k_dense_replace,
        "moe_layer_freq": 1,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 0,
        "attn_res_block_size": c.attn_res_block_size,
        "linear_attn_config": {
            "kda_layers": list(c.kda_layers),
            "full_attn_layers": list(c.full_attn_layers),
            "head_dim": c.kda_head_dim,
            "num_heads": c.kda_num_heads,
            "short_conv_kernel_size": c.short_conv_kernel_size,
            "gate_lower_bound": c.gate_lower_bound,
            "use_full_rank_gate": True,
        },
        "dtype": "bfloat16",
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config"},
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": "bfloat16",
        "ignore_index": -100,
        "media_placeholder_token_id": n_ranks + 21,
        "tie_word_embeddings": False,
        "text_config": text,
    }


@torch.no_grad()
def generate(model, ids, n, temp=0.8, top_k=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(n):
        lg = model(torch.tensor([ids[-256:]]))[0, -1]
        v, i = torch.topk(lg / temp, top_k)
        ids.append(int(i[torch.multinomial(torch.softmax(v, -1), 1, generator=g)]))
    return ids


def load_export_model(ckpt):
    """The checkpoint's model with its weights rounded to the export dtypes (bf16, KEEP_F32
    tensors f32), computing in f32 with exactly those values: (config, model, checkpoint meta)."""
    cfgd, state, meta = load_ckpt(ckpt)
    cfgd["dropout"] = 0.0
    c = NanoConfig(**cfgd)
    model = K3Nano(c)
    st = {k: (v.float() if k.endswith(KEEP_F32) else v.to(torch.bfloat16).float()) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(st, strict=False)
    assert not unexpected and all(k.endswith(".load") for k in missing), (missing, unexpected)
    model.eval()
    return c, model, meta


def write_weights(model, out):
    """`out`/model.safetensors: the release tensor names, bf16 (KEEP_F32 tensors f32)."""
    os.makedirs(out, exist_ok=True)
    rel = {k: (v.float().contiguous() if k.endswith(KEEP_F32) else v.to(torch.bfloat16).contiguous())
           for k, v in model.release_state_dict().items()}
    save_file(rel, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default="runs/h200/best")
    ap.add_argument("--tok", default="work/tok")
    ap.add_argument("--prep", default="work/prep.json")
    ap.add_argument("--summary", default="runs/h200/summary.json")
    ap.add_argument("--out", default="../../models/k3-nano")
    ap.add_argument("--sample_tokens", type=int, default=80)
    a = ap.parse_args()
    c, model, _ = load_export_model(a.ckpt)
    write_weights(model, a.out)
    enc = load_encoding(a.tok)
    n_ranks = enc.n_vocab - 256
    json.dump(release_config(c, n_ranks), open(os.path.join(a.out, "config.json"), "w"), indent=2)
    for f in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(os.path.join(a.tok, f), os.path.join(a.out, f))
    # cross-check fixture: naive recurrence, sparse experts, f32 on CPU
    val_text = open(os.path.join(os.path.dirname(a.prep), "val.txt"), encoding="utf-8").read()
    prompts = PROMPTS + [val_text[1000:1300]]
    cc = {}
    t0 = time.time()
    for i, p in enumerate(prompts):
        ids = enc.encode(p, disallowed_special=())
        lg = model(torch.tensor([ids]), recurrent=True)[0].float()
        lg2 = model(torch.tensor([ids]))[0].float()
        rel_err = ((lg - lg2).norm(dim=-1) / lg.norm(dim=-1)).max().item()
        print(f"prompt {i}: {len(ids)} tokens, recurrent vs chunked max rel-L2 {rel_err:.2e}")
        cc[f"ids_{i}"] = torch.tensor(ids, dtype=torch.int64)
        if len(ids) > 32:  # long prompts: the first 8 and last 16 positions (keeps the file small)
            pos = torch.tensor(list(range(8)) + list(range(len(ids) - 16, len(ids))), dtype=torch.int64)
            cc[f"pos_{i}"] = pos
            lg = lg[pos]
        cc[f"logits_{i}"] = lg.contiguous()
    save_file(cc, os.path.join(a.out, "crosscheck.safetensors"),
              metadata={"n_prompts": str(len(prompts)), "note": "PyTorch k3nano f32 CPU logits for ids_i: every position, or the positions pos_i where given (the long prompt: its first 8 and last 16)"})
    print(f"crosscheck done in {time.time() - t0:.1f}s")
    samples = []
    for i, p in enumerate(PROMPTS[:2] + ["KING RICHARD.\n"]):
        ids = enc.encode(p, disallowed_special=())
        out = generate(model, ids, a.sample_tokens, seed=i)
        samples.append({"prompt": p, "text": enc.decode(out), "temperature": 0.8, "top_k": 40, "new_tokens": a.sample_tokens})
        print("----\n" + samples[-1]["text"])
    json.dump(samples, open(os.path.join(a.out, "samples.json"), "w"), indent=1)
    nparams = sum(v.numel() for v in rel.values())
    info = {"params": nparams, "cfg": c.to_dict(), "train": json.load(open(a.summary)), "prep": json.load(open(a.prep))}
    json.dump(info, open(os.path.join(a.out, "export_info.json"), "w"), indent=1)
    print(json.dumps({"params": nparams, "bytes": os.path.getsize(os.path.join(a.out, "model.safetensors"))}))


if __name__ == "__main__":
    main()
