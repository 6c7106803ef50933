#!/usr/bin/env python3
"""Diagnostic of issue 33 (docs/plans/README.md, "MoA with long targets"): the MoA plan with every head that its
rule leaves at the sink alone at 2,048 tokens (span alpha + beta * 2048 <= 0) given the narrowest window of the rule
space instead (alpha 0, beta 1/8), the rest unchanged: do the sink-only heads cost the perplexity?
  python3 docs/plans/moa_floor_33.py IN.json OUT.json"""
import json, sys

src, dst = sys.argv[1], sys.argv[2]
p = json.load(open(src))
FLOOR = {"type": "moa_window", "alpha": 0.0, "beta": 0.125, "sink": 64}


def sink_only(r):
    return r["type"] == "moa_window" and r["alpha"] + r["beta"] * 2048 <= 0


changed = 0
for layer in p["layers"]:
    heads = {str(h): layer.get("heads", {}).get(str(h), layer.get("default", p["default"])) for h in range(p["num_q_heads"])}
    for h, r in heads.items():
        if sink_only(r):
            heads[h] = FLOOR
            changed += 1
    layer.pop("default", None)
    layer["heads"] = heads
p["comment"] = f"{src} with its {changed} sink-only heads at 2K given moa_window(0, 0.125) (docs/plans/moa_floor_33.py)"
json.dump(p, open(dst, "w"), indent=1)
print(p["comment"])
