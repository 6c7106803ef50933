#!/usr/bin/env python3
"""scripts/gpu/ncu_kernels.py CSV [TITLE] — an ncu --csv --page raw listing (gpu__time_duration.sum per launch) summed
per kernel name: launches, total and mean microseconds, share of the window, largest first."""
import collections
import csv
import sys

rows = list(csv.reader(open(sys.argv[1], errors="replace")))
start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
if start is None:
    sys.exit(f"{sys.argv[1]}: no ncu table (the tool's own output follows)\n" + "".join(",".join(r) + "\n" for r in rows[-20:]))
head = rows[start]
name_col = head.index("Kernel Name")
time_col = head.index("gpu__time_duration.sum")
per = collections.defaultdict(list)
for r in rows[start + 1:]:
    if len(r) != len(head) or not r[0].isdigit():
        continue
    name = r[name_col].split("(")[0][:90]
    per[name].append(float(r[time_col].replace(",", "")) / 1e3)  # ns -> us
total = sum(sum(v) for v in per.values())
print(f"## {sys.argv[2] if len(sys.argv) > 2 else sys.argv[1]}: {sum(len(v) for v in per.values())} launches, {total:.0f} us")
print("| kernel | launches | total us | mean us | share |")
print("|---|---:|---:|---:|---:|")
for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    print(f"| `{name}` | {len(v)} | {sum(v):.0f} | {sum(v) / len(v):.1f} | {100 * sum(v) / total:.1f}% |")
