#!/usr/bin/env python3
"""Makes tests/data/plan/<name>.json: PyTorch autograd's attention gradients for the tiny models of
tests/data/hf_tiny, the reference for tessera's reverse mode (src/plan/model_gradients.h, tests/plan_gradients_test).

For each fixture model, Hugging Face transformers runs a fixed token sequence in float64 with eager attention and
returns every layer's attention probabilities A [heads, S, S]; the loss is the mean cross-entropy of a few target
tokens at the end; autograd gives dL/dA. From it the script writes, per layer and query head, block sums over
BLOCK x BLOCK cells of
  gate_grad  G_ij = A_ij * dL/dA_ij                                 (dL/dtheta for A_theta = theta * A, theta = 1)
  influence  E_ij = -A_ij / (1 - A_ij) * (dL/dA_ij - sum_n dL/dA_in A_in)   (MoA Eq. 12 with the digest's sign;
                                                                      0 where A_ij = 0 or 1 - A_ij < 1e-12)
  attention  A_ij
and, per layer, TriangleMix's region sums of G over all heads (streaming: j < SINK or i - j < LOCAL; last:
i >= S - LAST and not streaming; middle: the other causal cells), as {sum, abs_sum, cells}.

The token sequence and targets are the test's: tokens[i] = (37 i + 11) % vocab, targets at the last 6 positions
with token (5 * tokens[p] + 3) % vocab.

Run from the repository root:  python3 scripts/make_plan_fixtures.py
Needs torch and transformers >= 5: the environment `scripts/setup.sh models` makes (~/.cache/tessera/pyenv; the
committed files were made with torch 2.15.0 and transformers 5.24.0, recorded in each). CI does not run it: the
JSON files are committed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "data" / "hf_tiny"
OUT = ROOT / "tests" / "data" / "plan"
NAMES = ["llama3", "qwen2", "gemma3", "mistral", "smollm2"]
SEQ = 70
TARGETS = 6
BLOCK = 16
SINK, LOCAL, LAST = 3, 4, 5


def block_sums(x: torch.Tensor, nb: int) -> list:
    heads, s, _ = x.shape
    pad = nb * BLOCK - s
    y = torch.nn.functional.pad(x, (0, pad, 0, pad))
    y = y.reshape(heads, nb, BLOCK, nb, BLOCK).sum(dim=(2, 4))
    return y.tolist()


def main() -> None:
    torch.manual_seed(0)
    OUT.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(MODELS / name, attn_implementation="eager",
                                                     dtype=torch.float64)
        model.eval()
        vocab = model.config.vocab_size
        tokens = [(37 * i + 11) % vocab for i in range(SEQ)]
        targets = [(p, (5 * tokens[p] + 3) % vocab) for p in range(SEQ - TARGETS, SEQ)]
        out = model(torch.tensor([tokens]), output_attentions=True, use_cache=False)
        atts = out.attentions
        for a in atts:
            a.retain_grad()
        logits = out.logits[0]
        loss = sum(torch.nn.functional.cross_entropy(logits[p:p + 1], torch.tensor([t])) for p, t in targets)
        loss = loss / len(targets)
        loss.backward()
        nb = (SEQ + BLOCK - 1) // BLOCK
        i = torch.arange(SEQ).view(SEQ, 1)
        j = torch.arange(SEQ).view(1, SEQ)
        causal = j <= i
        streaming = causal & ((j < SINK) | (i - j < LOCAL))
        last = causal & ~streaming & (i >= SEQ - LAST)
        middle = causal & ~streaming & ~last
        layers = []
        for a in atts:
            assert a.grad is not None, "attention probabilities are not on the autograd path"
            A = a.detach()[0]
            dA = a.grad[0]
            G = A * dA
            D = G.sum(dim=-1, keepdim=True)
            one_minus = 1 - A
            ok = (A > 0) & (one_minus >= 1e-12)
            E = torch.where(ok, -(G - A * D) / torch.where(ok, one_minus, torch.ones_like(A)), torch.zeros_like(A))
            # Cells outside a sliding window have A = 0 exactly and do not count in the regions.
            visible = A > 0

            def region(mask: torch.Tensor) -> dict:
                m = mask.unsqueeze(0) & visible
                return {"sum": float(G[m].sum()), "abs_sum": float(G[m].abs().sum()), "cells": int(m.sum())}

            layers.append({
                "influence": block_sums(E, nb),
                "gate_grad": block_sums(G, nb),
                "attention": block_sums(A, nb),
                "probe": {"streaming": region(streaming), "middle": region(middle), "last": region(last)},
            })
        doc = {
            "model": name,
            "tokens": tokens,
            "targets": [[p, t] for p, t in targets],
            "block": BLOCK,
            "regions": {"sink": SINK, "local": LOCAL, "last": LAST},
            "loss": float(loss),
            "layers": layers,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        path = OUT / f"{name}.json"
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        print(f"{path.relative_to(ROOT)}: loss {float(loss):.6f}, {len(layers)} layers")


if __name__ == "__main__":
    main()
