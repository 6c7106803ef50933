"""The table of scripts/gpu/compare_commits.sh bench: old and new rows side by side.

Reads $OUT/attn_{old,new}_{round}.csv (attention_gpu_bench) and $OUT/ttft_{old,new}_{round}.csv (ttft_bench); for
each row prints every round's time for both trees, the medians and new / old. Usage: compare_table.py OUT ROUNDS
"""
import csv
import os
import statistics
import sys


def load(path, key_cols, value_col, extra=None):
    rows = {}
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        for r in csv.DictReader(f):
            key = tuple(r[c] for c in key_cols)
            try:
                rows[key] = (float(r[value_col]), r.get(extra, "") if extra else "")
            except (KeyError, ValueError):
                pass
    return rows


def table(title, out, rounds, prefix, key_cols, value_col, unit, extra=None):
    old = [load(os.path.join(out, f"{prefix}_old_{r}.csv"), key_cols, value_col, extra) for r in range(1, rounds + 1)]
    new = [load(os.path.join(out, f"{prefix}_new_{r}.csv"), key_cols, value_col, extra) for r in range(1, rounds + 1)]
    keys = []
    for d in old + new:
        for k in d:
            if k not in keys:
                keys.append(k)
    print(f"\n### {title}\n")
    print(f"| {' | '.join(key_cols)} | old {unit} (rounds) | new {unit} (rounds) | old median | new median | new / old |"
          + (" path (new) |" if extra else ""))
    print("|" + "---|" * (len(key_cols) + 5 + (1 if extra else 0)))
    worst = 0.0
    for k in keys:
        o = [d[k][0] for d in old if k in d]
        n = [d[k][0] for d in new if k in d]
        if not o or not n:
            print(f"| {' | '.join(k)} | {o} | {n} | | | missing |")
            continue
        mo, mn = statistics.median(o), statistics.median(n)
        ratio = mn / mo if mo > 0 else float("nan")
        worst = max(worst, abs(ratio - 1))
        path = next((d[k][1] for d in new if k in d), "") if extra else None
        print(f"| {' | '.join(k)} | {' / '.join(f'{x:.3f}' for x in o)} | {' / '.join(f'{x:.3f}' for x in n)} | "
              f"{mo:.3f} | {mn:.3f} | {ratio:.3f} |" + (f" {path} |" if extra else ""))
    print(f"\nlargest |new / old - 1| of the medians: {100 * worst:.1f}%")


def main():
    out, rounds = sys.argv[1], int(sys.argv[2])
    table("Attention, one layer (attention_gpu_bench, total = estimation + index + kernel)", out, rounds, "attn",
          ["seq", "pattern"], "total_ms", "ms", extra="path")
    table("Time to first token (ttft_bench)", out, rounds, "ttft", ["seq", "policy"], "ttft_s", "s")


if __name__ == "__main__":
    main()
