#!/usr/bin/env python3
"""The speed of one tessera binary under two environments (A and B), in alternating rounds on a shared machine.

    python3 bench/env_ab_speed.py --tessera build/h4-rel/src/tessera \
        --model ~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf \
        --a TESSERA_QACT_X2=none --b 'TESSERA_QACT_X2=*' --depths 1024,4096 --decode 32 --threads 1 --rounds 3

Each round runs `tessera bench -m MODEL -d DEPTH --decode N --threads T --format json` once with A's variables and
once with B's, the order swapped every round (A B, B A, ...), so a change of load falls on both. Prints per
(model, depth) the best and median prefill and decode tokens/s of each side, B / A of the best, and the 1-minute
load average before and after each round.
"""
import argparse
import json
import os
import statistics
import subprocess


def bench(tessera, model, depth, decode, threads, env_extra):
    env = dict(os.environ)
    env.update(env_extra)
    cmd = [tessera, "bench", "-m", model, "-d", str(depth), "--decode", str(decode), "--threads", str(threads),
           "--format", "json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out[out.index("["):])
    r = [x for x in rows if x.get("policy") == "dense"][0]
    return float(r["prefill_tok_s"]), float(r["decode_tok_s"])


def parse_env(s):
    return dict(kv.split("=", 1) for kv in s.split(";") if kv)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tessera", required=True)
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--a", required=True, help="VAR=VALUE[;VAR=VALUE]: side A's environment")
    ap.add_argument("--b", required=True, help="side B's")
    ap.add_argument("--depths", default="1024")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    sides = {"A": parse_env(a.a), "B": parse_env(a.b)}
    for model in a.model:
        for depth in [int(d) for d in a.depths.split(",")]:
            got = {"A": [], "B": []}
            loads = []
            for rnd in range(a.rounds):
                l0 = os.getloadavg()[0]
                for side in (["A", "B"] if rnd % 2 == 0 else ["B", "A"]):
                    got[side].append((bench(a.tessera, model, depth, a.decode, a.threads, sides[side])))
                loads.append((l0, os.getloadavg()[0]))
            print(f"\n{os.path.basename(model)}, {depth} tokens + {a.decode} decoded, {a.threads} thread(s), "
                  f"{a.rounds} rounds; load {min(min(x) for x in loads):.1f}-{max(max(x) for x in loads):.1f}")
            print(f"  A: {a.a}   B: {a.b}")
            for k, what in enumerate(["prefill tok/s", "decode tok/s"]):
                best = {s: max(r[k] for r in got[s]) for s in got}
                med = {s: statistics.median(r[k] for r in got[s]) for s in got}
                each = {s: " ".join(f"{r[k]:.1f}" for r in got[s]) for s in got}
                print(f"  {what:<14} A best {best['A']:8.1f} median {med['A']:8.1f} ({each['A']}) | "
                      f"B best {best['B']:8.1f} median {med['B']:8.1f} ({each['B']}) | B/A best {best['B'] / best['A']:.3f}"
                      f", median {med['B'] / med['A']:.3f}")


if __name__ == "__main__":
    main()
