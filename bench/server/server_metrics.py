#!/usr/bin/env python3
"""The server's own view of a load run, from two snapshots of tessera's /metrics: inter-token latency as the
scheduler emits the tokens, the batched engine's steps (decode-only, and steps carrying a prefill chunk) and the
scheduler's time around them — beside the clients' inter-token latency, it says where a gap is spent (the engine,
the scheduler, or between the server and the client: HTTP, the client's own parsing).

    bench/server/server_metrics.py snap URL FILE          writes /metrics to FILE
    bench/server/server_metrics.py report BEFORE AFTER [--label L] [--json-out FILE]
                                                          prints the run's quantiles (histogram differences)

Quantiles come from the histograms' buckets (linear inside a bucket, as Prometheus's histogram_quantile), so they are
as fine as the buckets: 0.5 ms steps below 3 ms. Standard library only.
"""
import argparse
import json
import math
import re
import sys
import urllib.request

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$')


def parse(text):
    """{(name, labels-without-le, le or None): value} of the Prometheus text."""
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        le = None
        pairs = [p for p in labels.strip("{}").split(",") if p]
        rest = []
        for p in pairs:
            k, _, v = p.partition("=")
            if k == "le":
                le = v.strip('"')
            else:
                rest.append(p)
        out[(name, ",".join(rest), le)] = value
    return out


def buckets(samples, name, labels=""):
    """[(upper bound, cumulative count)] of histogram `name` with `labels` (sorted; +Inf last)."""
    rows = [(math.inf if le == "+Inf" else float(le), v) for (n, lab, le), v in samples.items()
            if n == name + "_bucket" and lab == labels and le is not None]
    return sorted(rows)


def quantile(rows, q):
    """histogram_quantile: the q-quantile of cumulative bucket rows; NaN with no observations."""
    if not rows or rows[-1][1] <= 0:
        return float("nan")
    rank = q * rows[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for bound, count in rows:
        if count >= rank:
            if math.isinf(bound):
                return lo_bound  # above the last finite bucket: its bound is all that is known
            span = count - lo_count
            return lo_bound + (bound - lo_bound) * ((rank - lo_count) / span if span else 1.0)
        lo_bound, lo_count = bound, count
    return lo_bound


def diff(after, before):
    return [(b, c - dict(before).get(b, 0.0)) for b, c in after]


HISTOGRAMS = [
    ("itl", "tessera_inter_token_latency_seconds", ""),
    ("step_decode", "tessera_engine_step_seconds", 'kind="decode"'),
    ("step_prefill", "tessera_engine_step_seconds", 'kind="prefill"'),
    ("scheduler", "tessera_scheduler_step_seconds", ""),
]


def report(before, after, label=""):
    row = {"label": label}
    for key, name, labels in HISTOGRAMS:
        rows = diff(buckets(after, name, labels), buckets(before, name, labels))
        row[f"{key}_n"] = int(rows[-1][1]) if rows else 0
        for q in (0.5, 0.9, 0.99):
            row[f"{key}_p{int(q * 100)}_s"] = quantile(rows, q)
    return row


def ms(x):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.2f} ms"


TABLE_HEAD = ("| run | server ITL p50 / p99 (n) | decode-only steps p50 / p99 (n) | steps with prefill p50 / p99 (n) "
              "| scheduler around a step p50 / p99 |\n|---|---:|---:|---:|---:|")


def table_row(r):
    def cell(k):
        return f"{ms(r[k + '_p50_s'])} / {ms(r[k + '_p99_s'])} ({r[k + '_n']})"
    return (f"| {r['label']} | {cell('itl')} | {cell('step_decode')} | {cell('step_prefill')} "
            f"| {ms(r['scheduler_p50_s'])} / {ms(r['scheduler_p99_s'])} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snap")
    s.add_argument("url")
    s.add_argument("file")
    r = sub.add_parser("report")
    r.add_argument("before")
    r.add_argument("after")
    r.add_argument("--label", default="")
    r.add_argument("--json-out")
    args = p.parse_args()
    if args.cmd == "snap":
        text = urllib.request.urlopen(args.url.rstrip("/") + "/metrics", timeout=10).read().decode()
        with open(args.file, "w") as f:
            f.write(text)
        return
    with open(args.before) as f:
        before = parse(f.read())
    with open(args.after) as f:
        after = parse(f.read())
    row = report(before, after, args.label)
    if args.json_out:
        try:
            with open(args.json_out) as f:
                old = json.load(f)
        except FileNotFoundError:
            old = []
        with open(args.json_out, "w") as f:
            json.dump([{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in x.items()}
                       for x in old + [row]], f, indent=1)
    print(TABLE_HEAD)
    print(table_row(row))


if __name__ == "__main__":
    sys.exit(main())
