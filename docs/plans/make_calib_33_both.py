#!/usr/bin/env python3
"""Issue 33: calibration items with both kinds of target (docs/plans/README.md, "Every row at 2K and 4K"): each of
the eight items of calib-licences-2k-4k.jsonl becomes one item whose prompt is only "Read the following document."
and whose target is the document, the summary request and the dense model's own greedy 64-token summary — so the
loss (the mean cross-entropy over the target tokens) reads both the text's own next token at every row (what
perplexity scores) and a summary over the whole context (MoA's recipe), in one reverse-mode pass per item.

The summary is what `tessera run` (dense, greedy, 64 tokens) answers to the item's prompt, as `plan --calib
--answer-tokens 64` would make it. The loss is a mean, so the 64 summary tokens weigh 64 / ~2,000-4,000 of it; the
summary targets' per-token influence on the late layers is ~30x the text's (their Fisher losses, 4.3e-3 and 5.9e-6
in README.md), so the two parts come out of similar size.

  python3 docs/plans/make_calib_33_both.py TESSERA MODEL < docs/plans/calib-licences-2k-4k.jsonl \
      > docs/plans/calib-licences-2k-4k-both.jsonl
"""
import json
import subprocess
import sys

TESSERA, MODEL = sys.argv[1], sys.argv[2]
HEAD = "Read the following document.\n\n"
TAIL = "\n\nWrite a short summary of the document above: what it is, what it allows, and what it requires.\nSummary:"

for i, line in enumerate(sys.stdin):
    prompt = json.loads(line)["prompt"]
    assert prompt.startswith(HEAD) and prompt.endswith(TAIL), f"item {i + 1}: not a make_calib_33.py prompt"
    out = subprocess.run([TESSERA, "run", "-m", MODEL, "-f", "-", "-n", "64", "--temp", "0", "--kv-type", "f32",
                          "--device", "cpu", "--json"], input=prompt.encode(), capture_output=True, check=True).stdout
    summary = json.loads(out)["text"]
    print(json.dumps({"prompt": HEAD.rstrip("\n"), "target": "\n\n" + prompt[len(HEAD):] + summary}), flush=True)
