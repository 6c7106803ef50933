#!/usr/bin/env python3
"""Issue 33, second session: repair a MoA plan layer by layer by its actual masked loss (docs/plans/README.md,
"... (issue 33, 2026-11-30, second session)").

The Fisher estimate ranks rules by a second-order sum over masked cells; its bias (not its variance) is what
separates the plan from the uniform window in perplexity. Here the plan is measured as the model runs it, one layer
at a time, on held-out text (not the evaluation's): hybrid H_l = the uniform window everywhere but layer l, which
keeps the plan's rules. Its log-perplexity change over the window, minus what its extra density alone buys (the
window's own slope d log ppl / d density, from the window at two betas), says whether the plan's choice on layer l
beats the window's there. The repaired plans keep the plan's rules on the k best such layers and the window
elsewhere, the window's beta lowered so the mean density at the first length equals the window's.

  python3 moa_layers_33.py gen PLAN BETA HDIR             -> HDIR/h_LL.json, HDIR/policies.txt (';'-list)
  python3 moa_layers_33.py fit PLAN BETA HDIR OUT PPL.json... -> OUT/layers.txt (per layer), OUT/repair_kK.json
    (PPL.json: tessera eval --perplexity 2048,4096 --haystack file:HELDOUT --attn "$(cat HDIR/policies.txt)" -o X,
     X/perplexity.json; one per held-out text)
  python3 moa_layers_33.py density POLICY.json LENGTH      -> the exact mean density of a moa_window policy
"""
import functools
import json
import os
import math
import sys

SINK = 64
LENGTHS = (2048, 4096)
SLOPE_BETAS = (0.2, 0.3)  # the window at these betas gives the density slope


def span(beta, n, alpha=0.0):
    s = math.floor(alpha + beta * n)
    return 0 if s <= 0 else min(n, s)


@functools.lru_cache(maxsize=None)
def window_density(beta, n, sink=SINK, alpha=0.0, tile=64):
    """Kept cells / causal cells of moa_window(alpha, beta, sink) at a prefill of n tokens, as the index lowers it
    (lower.cpp add_streaming, 64-row tiles): row i of the tile starting at p0 keeps [0, sink) and
    [p0 - local + 1, i], local = max(1, span)."""
    local = max(1, span(beta, n, alpha))
    kept = 0
    for i in range(n):
        lo = max(0, (i // tile) * tile - local + 1)
        kept += (i + 1 - lo) + min(sink, lo)
    return kept / (n * (n + 1) / 2)


def load_table(path):
    """The plan's pattern per (layer, head): a list of layers, each a list of dicts."""
    p = json.load(open(path))
    L, H = p["num_layers"], p["num_q_heads"]
    top = p.get("default")
    table = []
    for l in range(L):
        lay = p["layers"][l] if l < len(p.get("layers", [])) else {}
        d = lay.get("default", top)
        table.append([lay.get("heads", {}).get(str(h), d) for h in range(H)])
    return p, table


def pattern_density(pat, n):
    assert pat["type"] == "moa_window", pat
    return window_density(pat["beta"], n, pat.get("sink", SINK), pat.get("alpha", 0.0))


def mean_density(table, n):
    cells = [pattern_density(p, n) for lay in table for p in lay]
    return sum(cells) / len(cells)


def win(beta):
    return {"type": "moa_window", "alpha": 0.0, "beta": beta, "sink": SINK}


def policy_json(p, table, comment):
    layers = []
    for lay in table:
        layers.append({"heads": {str(h): pat for h, pat in enumerate(lay)}})
    return {"tessera_policy": 1, "comment": comment, "num_layers": p["num_layers"], "num_q_heads": p["num_q_heads"],
            "num_kv_heads": p["num_kv_heads"], "default": layers and table[0][0], "layers": layers,
            **({"planned_lengths": p["planned_lengths"]} if "planned_lengths" in p else {})}


def write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")


def hybrid(table, beta, keep):
    H = len(table[0])
    return [list(table[l]) if l in keep else [win(beta)] * H for l in range(len(table))]


def gen(plan, beta, out):
    p, table = load_table(plan)
    names = []
    for l in range(p["num_layers"]):
        name = f"{out}/h_{l:02d}.json"
        write(name, policy_json(p, hybrid(table, beta, {l}), f"{plan}: layer {l} as planned, moa_window beta {beta} elsewhere"))
        names.append(name)
    specs = names + [f"moa:alpha=0,beta={beta},sink={SINK}"] + [f"moa:alpha=0,beta={b},sink={SINK}" for b in SLOPE_BETAS]
    open(f"{out}/policies.txt", "w").write(";".join(specs))
    print(";".join(specs))


def beta_for_density(fixed_table, free_layers, target, n):
    """The window beta for free_layers so that the mean density at n is target (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        t = [lay if l not in free_layers else [win(mid)] * len(lay) for l, lay in enumerate(fixed_table)]
        if mean_density(t, n) < target:
            lo = mid
        else:
            hi = mid
    return hi


def fit(plan, beta, hdir, out, ppl_files):
    p, table = load_table(plan)
    L = p["num_layers"]
    runs = [json.load(open(f)) for f in ppl_files]

    def logppl(spec):  # summed over held-out texts and lengths
        total = 0.0
        for r in runs:
            rows = r["rows"] if "rows" in r else r["results"]
            for row in rows:
                if row["policy"] == spec:
                    total += math.log(row["perplexity"])
        return total

    wspec = f"moa:alpha=0,beta={beta},sink={SINK}"
    base = logppl(wspec)
    n0 = LENGTHS[0]
    # slope: d (summed log ppl) / d (mean density, averaged over the lengths)
    def dens(tab):
        return sum(mean_density(tab, n) for n in LENGTHS) / len(LENGTHS)
    H = p["num_q_heads"]
    d_lo = dens([[win(SLOPE_BETAS[0])] * H] * L)
    d_hi = dens([[win(SLOPE_BETAS[1])] * H] * L)
    lp_lo = logppl(f"moa:alpha=0,beta={SLOPE_BETAS[0]},sink={SINK}")
    lp_hi = logppl(f"moa:alpha=0,beta={SLOPE_BETAS[1]},sink={SINK}")
    slope = (lp_hi - lp_lo) / (d_hi - d_lo)
    d_w = dens([[win(beta)] * H] * L)
    os.makedirs(out, exist_ok=True)
    lines = [f"window {wspec}: summed log ppl {base:.5f}, mean density {d_w:.4f}; slope {slope:.4f} per unit density "
             f"(beta {SLOPE_BETAS[0]}: {lp_lo:.5f} at {d_lo:.4f}, beta {SLOPE_BETAS[1]}: {lp_hi:.5f} at {d_hi:.4f})",
             "| layer | plan's layer density 2K | window's | change of summed log ppl | of which density | net |",
             "|---:|---:|---:|---:|---:|---:|"]
    net = []
    for l in range(L):
        spec = f"{hdir}/h_{l:02d}.json"
        delta = logppl(spec) - base
        dd = dens(hybrid(table, beta, {l})) - d_w
        n_l = delta - slope * dd
        net.append((n_l, l))
        lay2k = sum(pattern_density(pt, n0) for pt in table[l]) / H
        lines.append(f"| {l} | {lay2k:.3f} | {window_density(beta, n0):.3f} | {delta:+.5f} | {slope * dd:+.5f} | {n_l:+.5f} |")
    net.sort()
    good = [l for n_l, l in net if n_l < 0]
    lines.append(f"layers where the plan's rules beat the window net of density ({len(good)}): "
                 + ", ".join(f"{l} ({n_l:+.5f})" for n_l, l in net if n_l < 0))
    target = mean_density([[win(beta)] * H] * L, n0)
    ks = sorted({k for k in (2, 4, 6, 8, 12, len(good)) if 0 < k <= len(good)})
    for k in ks:
        keep = set(good[:k])
        free = set(range(L)) - keep
        b = beta_for_density([table[l] if l in keep else [win(beta)] * H for l in range(L)], free, target, n0)
        t = hybrid(table, b, keep)
        name = f"{out}/repair_k{k}.json"
        write(name, policy_json(p, t, f"{plan} repaired by moa_layers_33.py: the plan's rules on layers "
                                      f"{sorted(keep)}, moa_window beta {b:.6f} elsewhere"))
        lines.append(f"{name}: layers {sorted(keep)} as planned, window beta {b:.6f} elsewhere; density "
                     + ", ".join(f"{n}: {mean_density(t, n):.4f}" for n in LENGTHS)
                     + f" (the window: " + ", ".join(f"{n}: {window_density(beta, n):.4f}" for n in LENGTHS) + ")")
    open(f"{out}/layers.txt", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "gen":
        gen(sys.argv[2], float(sys.argv[3]), sys.argv[4])
    elif cmd == "fit":
        fit(sys.argv[2], float(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:])
    elif cmd == "density":
        _, t = load_table(sys.argv[2])
        print(mean_density(t, int(sys.argv[3])))
    else:
        sys.exit(__doc__)
