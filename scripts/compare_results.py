#!/usr/bin/env python3
"""Two result files side by side, in one command (as llama.cpp's compare-llama-bench.py does).

    python3 scripts/compare_results.py OLD.csv NEW.csv
    python3 scripts/compare_results.py OLD_1.csv OLD_2.csv -- NEW_1.csv NEW_2.csv     rounds: medians of each side
    options: --key COL,COL  (the columns that name a row)  --value COL,COL  (the measures to compare)  --title TEXT

Reads CSV with a header row (`tessera bench --format csv`, `bench/gpu/*_bench --csv`, decode_bench, stream_bench,
tp_bench, ttft_bench) or JSON (`tessera bench --format json`: an array of objects). Rows are matched on the key
columns (by default the ones of KEYS below that the file has); the measures are by default the ones of VALUES
below that it has (else every numeric column that is not a key). Prints a markdown table per measure: each round's
value, the medians, new / old; and the largest |new / old - 1| of the medians. Rows in one file only are listed as
missing.
"""
import argparse
import csv
import json
import statistics
import sys

KEYS = ["model", "device", "weights", "context", "kv", "batch", "gpus", "seq", "length", "depth", "method", "placement",
        "pattern", "policy", "chunk", "tag"]
VALUES = ["total_ms", "ttft_s", "step_ms", "tokens_per_s", "prefill_s", "attention_s", "decode_tok_s",
          "attn_slowest_s"]


def load(path):
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith(("[", "{")):
        data = json.loads(text)
        rows = data.get("rows", []) if isinstance(data, dict) else data
        return [{k: str(v) for k, v in r.items()} for r in rows]
    return list(csv.DictReader(text.splitlines()))


def number(s):
    try:
        return float(str(s).replace(",", ""))
    except (TypeError, ValueError):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--key")
    ap.add_argument("--value")
    ap.add_argument("--title")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else None  # argparse would swallow the separator
    args = ap.parse_args(argv[:split] if split is not None else argv)
    files = args.files
    if split is not None:
        old_files, new_files = files, [a for a in argv[split + 1:]]
    elif len(files) == 2:
        old_files, new_files = files[:1], files[1:]
    else:
        sys.exit("compare_results.py: give OLD NEW, or OLD... -- NEW...")
    old = [load(p) for p in old_files]
    new = [load(p) for p in new_files]
    header = [c for t in old + new for r in t[:1] for c in r]
    cols = list(dict.fromkeys(header))
    keys = args.key.split(",") if args.key else [c for c in KEYS if c in cols]
    if not keys:
        keys = [c for c in cols if any(number(r.get(c)) is None for t in old for r in t)][:3]
    values = args.value.split(",") if args.value else [c for c in VALUES if c in cols]
    if not values:
        values = [c for c in cols if c not in keys and all(number(r.get(c)) is not None for t in old for r in t)]
    if args.title:
        print(f"### {args.title}\n")
    print(f"old: {', '.join(old_files)}\nnew: {', '.join(new_files)}")

    def index(tables):
        out = []
        for t in tables:
            d = {}
            for r in t:
                d[tuple(r.get(k, "") for k in keys)] = r
            out.append(d)
        return out

    oi, ni = index(old), index(new)
    order = list(dict.fromkeys(k for d in oi + ni for k in d))
    for v in values:
        print(f"\n| {' | '.join(keys)} | old {v} | new {v} | old median | new median | new / old |")
        print("|" + "---|" * (len(keys) + 5))
        worst = 0.0
        for k in order:
            o = [x for x in (number(d[k].get(v)) for d in oi if k in d) if x is not None]
            n = [x for x in (number(d[k].get(v)) for d in ni if k in d) if x is not None]
            if not o or not n:
                print(f"| {' | '.join(k)} | {' / '.join(f'{x:.4g}' for x in o) or '-'} | "
                      f"{' / '.join(f'{x:.4g}' for x in n) or '-'} | | | missing |")
                continue
            mo, mn = statistics.median(o), statistics.median(n)
            ratio = mn / mo if mo else float("nan")
            if mo:
                worst = max(worst, abs(ratio - 1))
            print(f"| {' | '.join(k)} | {' / '.join(f'{x:.4g}' for x in o)} | {' / '.join(f'{x:.4g}' for x in n)} | "
                  f"{mo:.4g} | {mn:.4g} | {ratio:.3f} |")
        print(f"\nlargest |new / old - 1| of the {v} medians: {100 * worst:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
