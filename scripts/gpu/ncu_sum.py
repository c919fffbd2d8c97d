#!/usr/bin/env python3
"""k3rs: sums an `ncu --metrics gpu__time_duration.sum --csv` log per kernel name.

Usage: python3 ncu_sum.py NCU.csv — prints total ms, launches and share per kernel, largest first.
"""
import csv
import sys
from collections import defaultdict

rows = [line for line in open(sys.argv[1], errors="replace") if line.startswith('"')]
tot = defaultdict(float)
cnt = defaultdict(int)
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    v = float(r["Metric Value"].replace(",", ""))
    unit = r.get("Metric Unit", "ns")
    ms = v * {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}.get(unit, 1e-6)
    name = r["Kernel Name"].split("(")[0][:60]
    tot[name] += ms
    cnt[name] += 1
all_ms = sum(tot.values())
print(f"{'kernel':<60} {'ms':>10} {'launches':>9} {'share':>6}  (all {all_ms:.2f} ms)")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"{k:<60} {v:10.3f} {cnt[k]:9d} {100 * v / all_ms:5.1f}%")
