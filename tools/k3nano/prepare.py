"""Tokenise work/train.txt and work/val.txt with the trained tokenizer into uint16 arrays and
compute the unigram baseline on the held-out split.

Writes WORK/train.npy, WORK/val.npy, WORK/prep.json."""
import argparse
import json
import math
import os

import numpy as np

from tokenizer_train import load_encoding


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="work")
    a = ap.parse_args()
    enc = load_encoding(os.path.join(a.work, "tok"))
    out = {}
    arrs = {}
    for split in ("train", "val"):
        text = open(os.path.join(a.work, f"{split}.txt"), encoding="utf-8").read()
        ids = np.array(enc.encode(text, disallowed_special=()), dtype=np.uint16)
        np.save(os.path.join(a.work, f"{split}.npy"), ids)
        arrs[split] = ids
        out[f"{split}_tokens"] = int(ids.size)
        out[f"{split}_chars"] = len(text)
    V = enc.n_vocab
    counts = np.bincount(arrs["train"], minlength=V).astype(np.float64) + 1.0   # add-one smoothing
    logp = np.log(counts / counts.sum())
    ce = float(-logp[arrs["val"]].mean())
    out["unigram_val_loss"] = ce
    out["unigram_val_ppl"] = math.exp(ce)
    out["vocab"] = V
    json.dump(out, open(os.path.join(a.work, "prep.json"), "w"), indent=1)
    print(out)


if __name__ == "__main__":
    main()
