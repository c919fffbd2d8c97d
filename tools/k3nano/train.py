"""Train k3-nano with a wall-clock budget (it stops by itself).

python3 train.py --data DIR(with train.npy, val.npy) --out OUTDIR --minutes 7
Writes OUTDIR/best.pt (best held-out loss), OUTDIR/last.pt, OUTDIR/log.jsonl, OUTDIR/summary.json.

Conversation mode (k3-chat, tools/k3chat): when DIR also holds train_off.npy / train_mask.npy
(conversation starts and a 0/1 loss mask, from tools/k3chat/gen_data.py), batches are whole
conversations of similar length padded to the longest (about --batch x --ctx tokens each), and
the loss (training and held-out) is on the masked tokens only: what the assistant generates.
`--cfg FILE.json` gives the NanoConfig fields (otherwise k3-nano's defaults).
"""
import argparse
import json
import math
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from model import NanoConfig, K3Nano


KEEP_F32 = ("conv1d.weight", "A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias")


def save_parts(obj, state, path_base, max_bytes=15 * 2 ** 20):
    """Save a state dict as bf16 (fp32 for the tensors the release keeps F32), split into
    files of at most ~15 MiB (the device returns files of <= 16 MiB)."""
    parts, cur, size = [], {}, 0
    for k, v in state.items():
        v = v.detach().cpu()
        if v.is_floating_point() and not k.endswith(KEEP_F32):
            v = v.to(torch.bfloat16)
        nb = v.numel() * v.element_size()
        if cur and size + nb > max_bytes:
            parts.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += nb
    parts.append(cur)
    for i, p in enumerate(parts):
        torch.save({**obj, "state": p, "part": i, "nparts": len(parts)}, f"{path_base}.{i}.pt")


class Conversations:
    """Whole conversations, batched by length under a token budget (conversation mode)."""

    def __init__(self, data, split, budget, pad_id, dev, seed=0):
        self.ids = np.load(os.path.join(data, f"{split}.npy")).astype(np.int64)
        self.mask = np.load(os.path.join(data, f"{split}_mask.npy")).astype(bool)
        off = np.load(os.path.join(data, f"{split}_off.npy"))
        self.spans = list(zip(off[:-1], off[1:]))
        self.pad_id, self.dev = pad_id, dev
        order = sorted(range(len(self.spans)), key=lambda i: self.spans[i][1] - self.spans[i][0])
        self.batches, cur, longest = [], [], 0
        for i in order:
            n = self.spans[i][1] - self.spans[i][0]
            if cur and max(longest, n) * (len(cur) + 1) > budget:
                self.batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            self.batches.append(cur)
        self.rng = np.random.default_rng(seed)
        self.queue = []
        self.tokens = int(off[-1])
        self.targets = int(self.mask[1:].sum())

    def batch(self, idx):
        """(x, y) with y = -100 where no loss is taken; padded to a multiple of 16."""
        T = max(self.spans[i][1] - self.spans[i][0] for i in idx)
        T = -(-T // 16) * 16
        x = np.full((len(idx), T), self.pad_id, dtype=np.int64)
        y = np.full((len(idx), T), -100, dtype=np.int64)
        for r, i in enumerate(idx):
            s, e = self.spans[i]
            x[r, :e - s] = self.ids[s:e]
            tgt = self.ids[s + 1:e].copy()
            tgt[~self.mask[s + 1:e]] = -100
            y[r, :e - s - 1] = tgt
        return torch.from_numpy(x).to(self.dev), torch.from_numpy(y).to(self.dev)

    def next(self):
        if not self.queue:
            self.queue = list(self.rng.permutation(len(self.batches)))
        return self.batch(self.batches[self.queue.pop()])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min_lr_frac", type=float, default=0.05)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--eval_every_s", type=float, default=25.0)
    ap.add_argument("--save_every_s", type=float, default=90.0)
    ap.add_argument("--bias_rate", type=float, default=1e-3)
    ap.add_argument("--max_steps", type=int, default=10 ** 9)
    ap.add_argument("--tiny", action="store_true", help="tiny model for a CPU smoke test")
    ap.add_argument("--cfg", help="JSON file with NanoConfig fields (default: k3-nano's)")
    a = ap.parse_args()
    t_start = time.time()
    budget = a.minutes * 60
    os.makedirs(a.out, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(1234)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    conv = os.path.exists(os.path.join(a.data, "train_off.npy"))
    if conv:
        train = val = None
    else:
        train = torch.from_numpy(np.load(os.path.join(a.data, "train.npy")).astype(np.int64))
        val = torch.from_numpy(np.load(os.path.join(a.data, "val.npy")).astype(np.int64))
    cfg = NanoConfig(dropout=a.dropout)
    if a.cfg:
        cfg = NanoConfig(**{**json.load(open(a.cfg)), "dropout": a.dropout})
    if a.tiny:
        cfg = NanoConfig(hidden_size=64, num_hidden_layers=4, kda_layers=[1, 2, 3], full_attn_layers=[4],
                         kda_num_heads=2, kda_head_dim=16, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=16,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
                         moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=2,
                         dropout=a.dropout)
    model = K3Nano(cfg).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "conv1d" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "conv1d" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=(dev == "cuda"))
    T = a.ctx
    if conv:
        tr = Conversations(a.data, "train", a.batch * T, cfg.vocab_size - 1, dev)
        va = Conversations(a.data, "val", a.batch * T, cfg.vocab_size - 1, dev)
        val_batches = [va.batch(b) for b in va.batches]
        n_train_tokens, n_val_tokens = tr.tokens, va.tokens
    else:
        train_gpu, val_gpu = train.to(dev), val.to(dev)
        nval = (val.numel() - 1) // T
        vx = torch.stack([val_gpu[i * T:(i + 1) * T] for i in range(nval)])
        vy = torch.stack([val_gpu[i * T + 1:(i + 1) * T + 1] for i in range(nval)])
        val_batches = [(vx[i:i + 64], vy[i:i + 64]) for i in range(0, nval, 64)]
        n_train_tokens, n_val_tokens = train.numel(), val.numel()
    amp = dict(device_type="cuda", dtype=torch.bfloat16, enabled=(dev == "cuda"))
    logf = open(os.path.join(a.out, "log.jsonl"), "w")

    def log(d):
        d["t"] = round(time.time() - t_start, 1)
        print(json.dumps(d), flush=True)
        logf.write(json.dumps(d) + "\n")
        logf.flush()

    @torch.no_grad()
    def evaluate(fp32=False):
        model.eval()
        tot, n = 0.0, 0
        for bx, by in val_batches:
            with torch.autocast(**(amp if not fp32 else dict(device_type=dev, enabled=False))):
                lg = model(bx)
            tot += F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), by.reshape(-1), reduction="sum").item()
            n += int((by != -100).sum())
        model.train()
        return tot / n

    log({"event": "start", "params": nparams, "device": dev, "train_tokens": n_train_tokens, "val_tokens": n_val_tokens,
         "cfg": cfg.to_dict(), "args": vars(a)})
    best, best_state, best_step = float("inf"), None, -1
    step, tokens = 0, 0
    t_train0 = time.time()
    last_eval, last_save = t_train0, t_train0
    train_budget = budget - (time.time() - t_start) - 25  # leave time for final eval + saves
    ema = None
    while step < a.max_steps:
        el = time.time() - t_train0
        if el > train_budget:
            break
        frac = el / train_budget
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for gr in opt.param_groups:
            gr["lr"] = lr
        if conv:
            x, y = tr.next()
        else:
            ix = torch.randint(0, train_gpu.numel() - T - 1, (a.batch,), device=dev)
            x = torch.stack([train_gpu[i:i + T] for i in ix])
            y = torch.stack([train_gpu[i + 1:i + T + 1] for i in ix])
        with torch.autocast(**amp):
            lg = model(x)
        loss = F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        for moe in model.moe_layers():
            moe.update_bias(a.bias_rate)
        step += 1
        tokens += x.numel()
        if step % 25 == 0 or step == 1:
            lv = loss.item()
            ema = lv if ema is None else 0.9 * ema + 0.1 * lv
            log({"step": step, "loss": round(lv, 4), "gn": round(gn.item(), 3), "lr": round(lr, 6),
                 "tok_s": round(tokens / (time.time() - t_train0))})
        now = time.time()
        if now - last_eval > a.eval_every_s:
            vl = evaluate()
            last_eval = now
            if vl < best:
                best, best_step = vl, step
                best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            log({"step": step, "val_loss": round(vl, 4), "val_ppl": round(math.exp(vl), 2), "best": round(best, 4),
                 "epochs": round(tokens / n_train_tokens, 2)})
        if now - last_save > a.save_every_s and best_state is not None:
            save_parts({"cfg": cfg.to_dict(), "step": best_step, "val_loss": best}, best_state,
                       os.path.join(a.out, "best"))
            last_save = now
    vl = evaluate()
    if vl < best:
        best, best_step = vl, step
        best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    save_parts({"cfg": cfg.to_dict(), "step": step, "val_loss": vl}, model.state_dict(), os.path.join(a.out, "last"))
    model.load_state_dict(best_state)
    vl32 = evaluate(fp32=True)
    save_parts({"cfg": cfg.to_dict(), "step": best_step, "val_loss": best, "val_loss_fp32": vl32}, best_state,
               os.path.join(a.out, "best"))
    summ = {"params": nparams, "steps": step, "tokens": tokens, "epochs": tokens / n_train_tokens,
            "best_step": best_step, "best_val_loss_bf16": best, "best_val_loss_fp32": vl32,
            "best_val_ppl_fp32": math.exp(vl32), "last_val_loss": vl, "train_seconds": time.time() - t_train0,
            "total_seconds": time.time() - t_start, "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    json.dump(summ, open(os.path.join(a.out, "summary.json"), "w"), indent=1)
    log({"event": "done", **summ})


if __name__ == "__main__":
    main()
