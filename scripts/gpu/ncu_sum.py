#!/usr/bin/env python3
"""Sums Nsight Compute's per-kernel durations by kernel name.

    ncu --metrics gpu__time_duration.sum --csv --log-file run.csv PROGRAM ARGS...
    python3 scripts/gpu/ncu_sum.py run.csv [--top 25]

Prints, per kernel name (demangled, templates cut), the launches, the total and mean GPU time, largest total first,
and the sum over all kernels: set beside the program's own wall time, it says how much of a step is the GPU's work
and how much is launches and host time.
"""
import argparse
import csv
import collections
import re
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    with open(a.csv, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own log lines come before the table
    rows = list(csv.DictReader(lines))
    if not rows:
        sys.exit(f"ncu_sum: no kernel rows in {a.csv}")
    total = collections.defaultdict(float)
    count = collections.Counter()
    unit_scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"<.*", "", r["Kernel Name"]).strip()
        scale = unit_scale.get(r.get("Metric Unit", "nsecond"), 1e-3)
        total[name] += float(r["Metric Value"].replace(",", "")) * scale
        count[name] += 1
    all_us = sum(total.values())
    print(f"{sum(count.values())} kernel launches, {all_us / 1e3:.3f} ms of GPU time")
    print(f"{'kernel':60s} {'launches':>8s} {'total ms':>10s} {'mean us':>9s}")
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{name[:60]:60s} {count[name]:8d} {us / 1e3:10.3f} {us / count[name]:9.1f}")


if __name__ == "__main__":
    main()
