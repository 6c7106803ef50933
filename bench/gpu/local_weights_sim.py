#!/usr/bin/env python3
"""Simulates DeviceModel::random(..., RandomInit::kLocalAttention) (ttft_bench --weights local) on the CPU, at reduced
width, through all its layers, and prints per layer what MInference's vertical-slash estimator makes of its attention.

The recipe is src/runtime/cuda/local_attention_init.h's (device_model.h explains it): the same special channels,
embedding values, zeroed V/gate/up columns and O/down rows, designed Q/K columns (same phases: unit_hash is ported),
Llama-3.1's RoPE (theta 500000, llama3 scaling), RMSNorm, SwiGLU, causal softmax attention (exact, f32). Only the
width is reduced (default hidden 1024, 8 query / 2 KV heads of 128, FFN 3584) and the plain random weights come from
numpy with the device's distribution (uniform) and a standard deviation scaled by sqrt(Llama-3-8B's fan-in / this
fan-in), so that per-element activations are Llama-3-8B's. --weights plain simulates RandomInit::kPlain instead.

Per layer and checked head: VS(1000, 6096) estimated as MInference Alg. 2 / attention/index/estimate.cpp does (softmax
of the last 64 queries, column sums -> top verticals with the first 30 forced, diagonal sums -> top slashes with the
first 100 forced), lowered to 128-row tiles as attention/index/lower.cpp does (per tile, the union of the slashes'
key intervals plus the columns outside it), and the density (visible cells / causal cells) against the same index
with the 6096 nearest diagonals; tau = |token part| / |massive part| of the residual stream; where the last query's
attention goes (last 1K keys, last 8K, the sink). This script's lowering gives exactly the CPU library's densities on
the nearest-diagonal index (0.3892 at 32K, 0.1063 at 128K with columns 0..999).

  python3 bench/gpu/local_weights_sim.py [--seq 16384] [--layers 32] [--weights local|plain] [--check-heads 2]
  python3 bench/gpu/local_weights_sim.py --profile      # the shared part's score against distance, and its margins

Cost: about 25 s per layer at 16K tokens and 1-2 minutes at 32K on two cores (numpy). Measured (2 heads per layer):
32 layers at 16K: ratio 1.004-1.134, mean 1.040, tau 0.40 -> 0.47; 8 layers at 32K: 1.026-1.087, mean 1.040;
--weights plain, 4 layers at 16K: density 1.000 (ratio 1.57: the diagonals scatter).
"""
import argparse
import math
import time

import numpy as np

# local_attention_init.h
TOKEN_STD, TAU, DECAY_LOGITS, SINK_LOGITS = 3.0, 0.4, 32.0, 38.0
GAIN_MIN, GAIN_MAX = 0.8, 1.2
# local_attention_spectrum.h
MIN_WAVELENGTH, MAX_WAVELENGTH, SINK_MIN_WAVELENGTH = 4096.0, 262144.0, 2097152.0
SINK_TOKEN = 0
MASK64 = (1 << 64) - 1


def llama31_inv_freq(d=128):
    """runtime/rope.cpp with theta 500000 and llama3 scaling (factor 8, low 1, high 4, original context 8192), f32."""
    out = []
    for i in range(d // 2):
        f = np.float32(1.0) / np.float32(500000.0 ** float(np.float32(2 * i) / np.float32(d)))
        wavelen = 2 * math.pi / float(f)
        if wavelen > 8192.0:
            f = np.float32(f / np.float32(8.0))
        elif wavelen >= 2048.0:
            smooth = (8192.0 / wavelen - 1.0) / 3.0
            f = np.float32((1.0 - smooth) * float(f) / 8.0 + smooth * float(f))
        out.append(float(f))
    return np.array(out, dtype=np.float32)


def local_attention_weights(inv_freq):
    lam = 2 * math.pi / inv_freq.astype(np.float64)
    w = np.where((lam >= MIN_WAVELENGTH) & (lam <= MAX_WAVELENGTH), np.sqrt(lam), 0.0)
    return w / w.sum()


def sink_pairs(inv_freq):
    return np.nonzero(2 * math.pi / inv_freq.astype(np.float64) >= SINK_MIN_WAVELENGTH)[0]


def unit_hash(seed, layer, head, pair, stream):
    z = (seed * 0x9E3779B97F4A7C15) & MASK64
    for v in (layer, head, pair, stream):
        z = (z + v + 0x9E3779B97F4A7C15) & MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        z ^= z >> 31
    return (z >> 11) * (1.0 / 9007199254740992.0)


def channels(hidden):
    return [7, hidden // 4 + 7, hidden // 2 + 7, 3 * hidden // 4 + 7], [hidden // 8 + 3, 5 * hidden // 8 + 3]


def layer_columns(hidden, nq, nkv, d, inv_freq, layer, seed):
    """local_init::layer_columns."""
    half = d // 2
    w, sinks = local_attention_weights(inv_freq), set(sink_pairs(inv_freq).tolist())
    scale = 1.0 / math.sqrt(d)
    boost = SINK_LOGITS / scale / len(sinks) if sinks else 0.0
    hm = math.sqrt(hidden) / 2.0 / math.sqrt(1.0 + TAU * TAU)
    hz = math.sqrt(hidden / 2.0)
    qm, km, kz = np.zeros(nq * d), np.zeros(nkv * d), np.zeros(nkv * d)
    group = nq // nkv
    for g in range(nkv):
        for i in range(half):
            a = math.sqrt(w[i] * DECAY_LOGITS / scale)
            sk = 1.0 if i in sinks else 0.0
            phi = 2 * math.pi * unit_hash(seed, layer, g, i, 1)
            psi = 2 * math.pi * unit_hash(seed, layer, g, i, 2)
            km[g * d + i], km[g * d + i + half] = a * math.cos(phi) / (4 * hm), a * math.sin(phi) / (4 * hm)
            kz[g * d + i] = sk * boost * math.cos(psi) / (2 * hz)
            kz[g * d + i + half] = sk * boost * math.sin(psi) / (2 * hz)
            for h in range(g * group, (g + 1) * group):
                gain = GAIN_MIN + (GAIN_MAX - GAIN_MIN) * unit_hash(seed, layer, h, 0, 3)
                qm[h * d + i] = gain * (a * math.cos(phi) + sk * math.cos(psi)) / (4 * hm)
                qm[h * d + i + half] = gain * (a * math.sin(phi) + sk * math.sin(psi)) / (4 * hm)
    return qm.astype(np.float32), km.astype(np.float32), kz.astype(np.float32)


def top_k(score, begin, count):
    if count <= 0:
        return np.array([], dtype=np.int64)
    return np.sort(np.argsort(-score[begin:], kind="stable")[:count] + begin)


def vs_estimate(q_last, k, pos_last, scale, vertical=1000, slash=6096, forced_columns=30, forced_diagonals=100):
    keys = int(pos_last[-1]) + 1
    s = (q_last.astype(np.float64) @ k[:keys].astype(np.float64).T) * scale
    s[np.arange(keys)[None, :] > pos_last[:, None]] = -np.inf
    a = np.exp(s - s.max(axis=1, keepdims=True))
    a /= a.sum(axis=1, keepdims=True)
    colsum, diagsum = a.sum(axis=0), np.zeros(keys)
    for r, p in enumerate(pos_last):
        diagsum[: p + 1] += a[r, : p + 1][::-1]  # offset o = p - key
    kv, ks = min(vertical, keys), min(slash, keys)
    fc, fd = min(forced_columns, kv), min(forced_diagonals, ks)
    cols = np.concatenate([np.arange(fc), top_k(colsum, fc, kv - fc)])
    offs = np.concatenate([np.arange(fd), top_k(diagsum, fd, ks - fd)])
    return np.sort(cols), np.sort(offs)


def vs_density(seq, cols, offs, tile=128):
    offs, cols = np.sort(np.asarray(offs)), np.sort(np.asarray(cols))
    cells = 0
    for t in range((seq + tile - 1) // tile):
        p0, p1 = t * tile, min(seq, t * tile + tile)
        st, en = np.clip(p0 - offs[::-1], 0, None), np.clip(p1 - offs[::-1], 0, p1)
        keep = st < en
        st, en = st[keep], en[keep]
        b = e = np.array([], dtype=np.int64)
        if len(st):
            o = np.argsort(st, kind="stable")
            st, en = st[o], en[o]
            run_end = np.maximum.accumulate(en)
            new = np.ones(len(st), bool)
            new[1:] = st[1:] > run_end[:-1]
            gid = np.cumsum(new) - 1
            b, e = st[new], np.zeros(int(new.sum()), dtype=np.int64)
            np.maximum.at(e, gid, en)
            p = np.arange(p0, p1)[:, None]
            cells += np.maximum(0, np.minimum(e[None, :], p + 1) - b[None, :]).sum()
        c = cols[cols < p1]
        if len(c) and len(b):
            i = np.searchsorted(b, c, side="right") - 1
            c = c[~((i >= 0) & (c < e[np.maximum(i, 0)]))]
        cells += np.maximum(0, p1 - np.maximum(p0, c)).sum()
    return cells / (seq * (seq + 1) / 2)


def profile():
    inv = llama31_inv_freq()
    w = local_attention_weights(inv)
    lam = 2 * math.pi / inv.astype(np.float64)
    print("pairs carrying the decay:", np.nonzero(w)[0].tolist(), "wavelengths", [int(lam[i]) for i in np.nonzero(w)[0]])
    print("sink pairs:", sink_pairs(inv).tolist())
    n = 131072
    dist = np.arange(n)
    h = np.zeros(n)
    for i in np.nonzero(w)[0]:
        h += w[i] * np.cos(dist * float(inv[i]))
    print("h(distance) / h(0):", {x: round(float(h[x]), 3) for x in [0, 100, 1000, 2000, 4000, 6096, 8000, 16000,
                                                                      32000, 64000, 100000, n - 1]})
    print(f"minimum {h.min():.3f} at {int(h.argmin())}")
    prefix_min, suffix_max = np.minimum.accumulate(h), np.maximum.accumulate(h[::-1])[::-1]
    xs = np.arange(565, 30001)
    margin = prefix_min[xs] - suffix_max[np.minimum(n - 1, np.ceil(1.5 * xs).astype(int))]
    print(f"for x in [565, 30K]: min over distances <= x minus max over distances >= 1.5 x: at least "
          f"{margin.min():.4f} of the peak (x = {int(xs[margin.argmin()])})")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=3584)
    ap.add_argument("--weights", choices=["local", "plain"], default="local")
    ap.add_argument("--check-heads", type=int, default=2, help="query heads checked per layer (spread over groups)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    if a.profile:
        profile()
        return
    H, NQ, NKV, D, F, S = a.hidden, a.heads, a.kv_heads, 128, a.ffn, a.seq
    G, half, V = NQ // NKV, D // 2, 32000
    local = a.weights == "local"
    rng = np.random.default_rng(a.seed)
    inv = llama31_inv_freq(D)

    def uniform(shape, std):
        return (rng.uniform(-1, 1, size=shape) * std * math.sqrt(3)).astype(np.float32)

    std_in, std_o, std_d = 0.02 * math.sqrt(4096 / H), 0.02 * math.sqrt(4096 / (NQ * D)), 0.02 * math.sqrt(14336 / F)
    massive, sinkc = channels(H)
    special = massive + sinkc
    if local:
        E = uniform((V, H), TOKEN_STD)
        mval = TOKEN_STD * math.sqrt(H) / (2 * TAU)
        E[:, special] = 0
        E[:, massive] = mval
        E[SINK_TOKEN, :] = 0
        E[SINK_TOKEN, sinkc] = mval
    else:
        E = uniform((V, H), 0.02)
    tokens = rng.integers(1, V, size=S)
    if local:
        tokens[0] = SINK_TOKEN
    layers = []
    for l in range(a.layers):
        Wq, Wk, Wv = uniform((NQ * D, H), std_in), uniform((NKV * D, H), std_in), uniform((NKV * D, H), std_in)
        Wo, Wg, Wu, Wd = uniform((H, NQ * D), std_o), uniform((F, H), std_in), uniform((F, H), std_in), uniform((H, F), std_d)
        if local:
            for M in (Wv, Wg, Wu):
                M[:, special] = 0
            for M in (Wo, Wd):
                M[special, :] = 0
            qm, km, kz = layer_columns(H, NQ, NKV, D, inv, l, a.seed)
            for j in massive:
                Wq[:, j], Wk[:, j] = qm, km
            for j in sinkc:
                Wq[:, j], Wk[:, j] = 0, kz
        layers.append((Wq, Wk, Wv, Wo, Wg, Wu, Wd))

    ang = np.arange(S, dtype=np.float32)[:, None] * inv[None, :]
    cos, sin = np.cos(ang.astype(np.float64)).astype(np.float32), np.sin(ang.astype(np.float64)).astype(np.float32)

    def rms_norm(x):
        return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5)

    def rope(x):  # rotate_half, [S, heads, D]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]], axis=-1)

    def attention(q, k, v, block=512):
        out, sc = np.zeros_like(q), np.float32(1 / math.sqrt(D))
        for g in range(NKV):
            K, Vg = k[:, g], v[:, g]
            for b0 in range(0, S, block):
                b1 = min(S, b0 + block)
                qq = q[b0:b1, g * G:(g + 1) * G].transpose(1, 0, 2).reshape(G * (b1 - b0), D)
                s = (qq @ K[:b1].T) * sc
                s[np.arange(b1)[None, :] > np.tile(np.arange(b0, b1), G)[:, None]] = -np.inf
                s -= s.max(axis=1, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=1, keepdims=True)
                out[b0:b1, g * G:(g + 1) * G] = (s @ Vg[:b1]).reshape(G, b1 - b0, D).transpose(1, 0, 2)
        return out

    print(f"# {a.weights} weights: hidden {H}, heads {NQ}/{NKV} x {D}, FFN {F}, {a.layers} layers, {S} tokens"
          + (f"; token/massive {TAU}, decay {DECAY_LOGITS}, sink {SINK_LOGITS} logits" if local else ""))
    x = E[tokens].astype(np.float32)
    ordinary = np.ones(H, bool)
    ordinary[special] = False
    checked = [(i * NQ) // a.check_heads for i in range(a.check_heads)]
    ratios = []
    for l, (Wq, Wk, Wv, Wo, Wg, Wu, Wd) in enumerate(layers):
        t0 = time.time()
        tau = float(np.linalg.norm(x[1:, ordinary], axis=1).mean() / max(1e-30, np.linalg.norm(x[1:, massive], axis=1).mean()))
        h = rms_norm(x)
        q, k, v = (h @ Wq.T).reshape(S, NQ, D), (h @ Wk.T).reshape(S, NKV, D), (h @ Wv.T).reshape(S, NKV, D)
        q, k = rope(q), rope(k)
        for hq in checked:
            cols, offs = vs_estimate(q[S - 64:, hq], k[:, hq // G], np.arange(S - 64, S), 1 / math.sqrt(D))
            dens = vs_density(S, cols, offs)
            nearest = vs_density(S, cols, np.arange(min(6096, S)))
            ratios.append(dens / nearest)
            s = (q[S - 1, hq] @ k[:, hq // G].T) / math.sqrt(D)
            p = np.exp(s - s.max())
            p /= p.sum()
            far = int(((offs >= 7620) & (offs < S - 100)).sum())
            tau_text = f"tau {tau:.3f}  " if local else ""
            print(f"layer {l:2d} head {hq}: {tau_text}VS density {dens:.4f} (nearest 6096 diagonals {nearest:.4f}, "
                  f"ratio {dens / nearest:.3f}), {far} offsets in [7620, S - 100); last query's attention: last 1K "
                  f"{p[-1024:].sum():.2f}, last 8K {p[-8192:].sum():.2f}, sink {p[0]:.2f}", flush=True)
        x = x + attention(q, k, v).reshape(S, NQ * D) @ Wo.T
        h2 = rms_norm(x)
        g_, u_ = h2 @ Wg.T, h2 @ Wu.T
        x = x + (g_ / (1 + np.exp(-g_)) * u_) @ Wd.T
        print(f"  layer {l:2d} done in {time.time() - t0:.1f} s", flush=True)
    print(f"# VS density / nearest-diagonal density over all checked heads and layers: min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}")


if __name__ == "__main__":
    main()
