#!/usr/bin/env python3
"""Issue 33: read a MoA gradient profile saved by `tessera plan --moa-profile-out` (docs/plans/README.md, "The floor
and a per-head cap inside the optimiser") and print
  1. per layer, the share of its |block influence| (summed over heads, mean over samples) in the last two query
     blocks that carry influence (the 128 rows around the answer): where the calibration loss looks;
  2. per cap C, the mean density when every head takes its narrowest alpha-0 window (beta k/8) that masks at most C
     of its influence mass (mean |block sum| over the samples) at every profiled length: which caps leave the MIP
     room under a budget. The windows are approximated cell by cell (keys i - span < j <= i, plus the 64-token
     sink), not lowered as the executor does: approximations (on the SmolLM2 profile the uniform window's worst head
     loses 0.480 by this count, 0.464 by `tessera plan`'s head_lost_share).
Needs numpy.   python3 docs/plans/profile_33.py PROFILE
"""
import struct
import sys

import numpy as np


def load(path):
    with open(path, "rb") as f:
        if f.read(8) != b"TSMOAPR1":
            sys.exit(f"{path}: not a MoA profile (no TSMOAPR1 magic)")
        layers, heads, count = struct.unpack("<3i", f.read(12))
        f.read(16)  # loss, seconds
        out = []
        for _ in range(count):
            n, nb, _samples, kept = struct.unpack("<4i", f.read(16))

            def arr():
                (m,) = struct.unpack("<Q", f.read(8))
                return np.frombuffer(f.read(8 * m), dtype="<f8").reshape(layers, heads, nb, nb)

            arr()  # the mean influence
            out.append((n, nb, [arr() for _ in range(kept)]))
        return layers, heads, out


def kept_fraction(n, nb, span, sink=64, block=64):
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    causal = j <= i
    keep = causal & ((j < sink) | (i - j < max(span, 1)))
    k = np.zeros((nb, nb))
    for qb in range(nb):
        for kb in range(qb + 1):
            c = causal[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].sum()
            k[qb, kb] = keep[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].sum() / c if c else 0
    return k, keep.sum() / causal.sum()


def main():
    layers, heads, lengths = load(sys.argv[1])
    for n, _nb, samples in lengths:
        shares = []
        for layer in range(layers):
            per = []
            for e in samples:
                rows = np.abs(e[layer]).sum(axis=(0, 2))  # per query block
                if rows.sum() == 0:
                    continue
                last = np.nonzero(rows)[0].max()
                per.append(rows[max(0, last - 1):].sum() / rows.sum())
            shares.append(np.mean(per))
        print(f"{n}: share of |influence| in the last two query blocks, per layer:")
        print("  " + " ".join(f"{layer}:{s:.2f}" for layer, s in enumerate(shares)))
    betas = [k / 8 for k in range(1, 9)]
    lost, density = {}, {}
    for n, nb, samples in lengths:
        mass = np.mean([np.abs(e) for e in samples], axis=0).reshape(layers * heads, nb, nb)
        mass = np.tril(mass)
        total = mass.sum(axis=(1, 2))
        for b in betas:
            k, d = kept_fraction(n, nb, int(b * n))
            lost[(n, b)] = np.where(total > 0, ((1 - k) * mass).sum(axis=(1, 2)) / np.where(total > 0, total, 1), 0)
            density[(n, b)] = d
    ns = [n for n, _, _ in lengths]
    for cap in (0.1, 0.15, 0.2, 0.25, 0.3):
        means = []
        for n in ns:
            s = 0
            for h in range(layers * heads):
                b = next(b for b in betas if all(lost[(m, b)][h] <= cap for m in ns))
                s += density[(n, b)]
            means.append(s / (layers * heads))
        print(f"cap {cap}: mean density with each head at its narrowest window within the cap: " +
              ", ".join(f"{d:.3f} at {n}" for n, d in zip(ns, means)))


if __name__ == "__main__":
    main()
