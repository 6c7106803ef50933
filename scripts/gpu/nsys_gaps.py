#!/usr/bin/env python3
"""Where the GPU idles: from an Nsight Systems sqlite export, over a window of the run, the union of the device's
kernels, copies and sets against the wall clock, and the idle gaps summed by the pair of activities around them
(the one before -> the one after), with the host's synchronisations in the window.

  nsys_gaps.py RUN.sqlite [--from 0.5] [--to 0.9] [--top 30] [--title TEXT]

--from / --to: the window as fractions of the span from the first to the last device activity (default the
second half but the tail: the prefill's late chunks, past the pinning and before the decode). Prints Markdown.
"""
import argparse
import collections
import sqlite3


def names(db):
    return dict(db.execute("SELECT id, value FROM StringIds"))


def short(name):
    # "void ns::<unnamed>::kernel<T>(args)" -> "kernel<T>"
    n = name.split("(")[0]
    if "::" in n:
        n = n.split("::")[-1]
    return n[:70]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("db")
    ap.add_argument("--from", dest="lo", type=float, default=0.5)
    ap.add_argument("--to", dest="hi", type=float, default=0.9)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    db = sqlite3.connect(a.db)
    s = names(db)
    acts = []
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
        for st, en, nid in db.execute("SELECT start, end, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL"):
            acts.append((st, en, short(s.get(nid, "?"))))
    kinds = {1: "HtoD", 2: "DtoH", 8: "DtoD", 10: "PtoP"}
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        for st, en, k, b in db.execute("SELECT start, end, copyKind, bytes FROM CUPTI_ACTIVITY_KIND_MEMCPY"):
            acts.append((st, en, "memcpy " + kinds.get(k, str(k)) + (" big" if b >= 1 << 20 else "")))
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        for st, en in db.execute("SELECT start, end FROM CUPTI_ACTIVITY_KIND_MEMSET"):
            acts.append((st, en, "memset"))
    acts.sort()
    t0, t1 = acts[0][0], max(e for _, e, _ in acts)
    lo, hi = t0 + a.lo * (t1 - t0), t0 + a.hi * (t1 - t0)
    win = [x for x in acts if lo <= x[0] < hi]
    busy, idle = 0, 0
    gaps = collections.Counter()
    count = collections.Counter()
    kern = collections.Counter()
    end, prev = win[0][0], "start"
    for st, en, nm in win:
        kern[nm] += en - st
        if st > end:
            g = st - end
            idle += g
            gaps[(prev, nm)] += g
            count[(prev, nm)] += 1
        if en > end:
            busy += en - max(st, end)
            end = en
            prev = nm
    wall = end - win[0][0]
    syncs = 0
    sync_ns = 0
    if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
        for st, en, nid in db.execute("SELECT start, end, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME WHERE start >= ? AND start < ?", (lo, hi)):
            if "Synchronize" in s.get(nid, ""):
                syncs += 1
                sync_ns += en - st
    print(f"## {a.title or a.db}: window {a.lo:.2f}-{a.hi:.2f} of the device's activity")
    print(f"wall {wall/1e6:.1f} ms, device busy {busy/1e6:.1f} ms ({100*busy/wall:.1f}%), idle {idle/1e6:.1f} ms in "
          f"{sum(count.values())} gaps; host synchronisations {syncs} ({sync_ns/1e6:.1f} ms inside them)\n")
    print("| idle before -> after | gaps | idle ms | mean us |")
    print("|---|---:|---:|---:|")
    for (p, n), g in gaps.most_common(a.top):
        print(f"| `{p}` -> `{n}` | {count[(p, n)]} | {g/1e6:.2f} | {g/1e3/count[(p, n)]:.1f} |")
    print("\n| activity | busy ms |\n|---|---:|")
    for nm, t in kern.most_common(a.top):
        print(f"| `{nm}` | {t/1e6:.2f} |")


if __name__ == "__main__":
    main()
