#!/usr/bin/env python3
"""k3rs: compares a parallel run's logits with the one-GPU run's (both [T, vocab] f32 .npy).

Prints the worst and the mean per-position relative L2 error, the positions whose argmax
differs, and exits 1 when the worst error exceeds --tol (or shapes differ, or a value is not
finite). Usage: parallel_cmp.py REF.npy OTHER.npy --tol 1e-4 --label "tp2 f32 full"
"""
import argparse
import sys

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("ref")
ap.add_argument("other")
ap.add_argument("--tol", type=float, required=True)
ap.add_argument("--label", default="")
a = ap.parse_args()
try:
    r, o = np.load(a.ref).astype(np.float64), np.load(a.other).astype(np.float64)
except Exception as e:  # a missing file is a failed run
    print(f"FAIL {a.label}: {e}")
    sys.exit(1)
if r.shape != o.shape:
    print(f"FAIL {a.label}: shape {o.shape} vs reference {r.shape}")
    sys.exit(1)
if not np.isfinite(o).all():
    print(f"FAIL {a.label}: non-finite logits")
    sys.exit(1)
rel = np.linalg.norm(o - r, axis=-1) / np.maximum(np.linalg.norm(r, axis=-1), 1e-30)
arg = int((o.argmax(-1) != r.argmax(-1)).sum())
ok = rel.max() <= a.tol
print(f"{'ok  ' if ok else 'FAIL'} {a.label}: T={r.shape[0]} worst rel-L2 {rel.max():.3e} mean {rel.mean():.3e} (tol {a.tol:g}); argmax differs at {arg}/{r.shape[0]} positions")
sys.exit(0 if ok else 1)
