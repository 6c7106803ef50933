#!/usr/bin/env python3
"""Issue 33: one table per eval folder — per policy and length, the executed density (plan --method measure's
density.txt), the cases dense passes that the policy also passes ("kept"), its outputs equal to dense's ("same"),
and the perplexity (perplexity.json).

  python3 docs/plans/summarize_eval_33.py EVAL_DIR DENSITY_TXT
"""
import collections
import json
import os
import sys

ev, dens_path = sys.argv[1], sys.argv[2]
res = json.load(open(os.path.join(ev, "results.json")))["results"]
ppl = {}
pj = os.path.join(ev, "perplexity.json")
if os.path.exists(pj):
    for r in json.load(open(pj))["results"]:
        ppl[(r["policy"], r["length"])] = r["perplexity"]
dens = {}
for line in open(dens_path):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 3 and cells[1].isdigit():
        dens[(cells[0], int(cells[1]))] = float(cells[2])
by = collections.defaultdict(dict)
for r in res:
    by[r["policy"]][r["id"]] = r
dense = by["dense"]
lengths = sorted({r["length"] for r in res})
policies = list(by)
short = lambda p: os.path.basename(p)
print("| policy | density " + " / ".join(f"{l // 1024}K" for l in lengths) + " | kept of dense-passed "
      + " / ".join(f"{l // 1024}K" for l in lengths) + " | all kept | same as dense | perplexity "
      + " / ".join(f"{l // 1024}K" for l in lengths) + " |")
print("|---|---:|---:|---:|---:|---:|")
for p in policies:
    kept, tot, same, n = [], [], 0, 0
    for l in lengths:
        ids = [i for i, r in dense.items() if r["length"] == l and r["pass"]]
        kept.append(sum(1 for i in ids if by[p][i]["pass"]))
        tot.append(len(ids))
    for i, r in dense.items():
        n += 1
        same += by[p][i]["output"] == r["output"]
    d = " / ".join(f"{dens[(p, l)]:.3f}" if (p, l) in dens else ("1" if p == "dense" else "-") for l in lengths)
    k = " / ".join(f"{a}/{b}" for a, b in zip(kept, tot))
    q = " / ".join(f"{ppl[(p, l)]:.3f}" if (p, l) in ppl else "-" for l in lengths)
    share = 100.0 * sum(kept) / max(1, sum(tot))
    print(f"| {short(p)} | {d} | {k} | {sum(kept)}/{sum(tot)} ({share:.0f}%) | {same}/{n} | {q} |")
