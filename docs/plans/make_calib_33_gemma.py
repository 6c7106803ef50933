#!/usr/bin/env python3
"""Issue 33: every-row calibration items for Gemma-3-270M's MoA plan at 8K and 16K (docs/plans/gemma3-8k-32k.md).
The licence texts of the SmolLM2 items (make_calib_33.py) hold ~60K distinct tokens, too few for four 8K and four
16K items, so these are KJV passages the evaluation never reads: sentences 16,000 onwards, one passage after the
other (the perplexity reads the KJV from its first sentence, about 1,100 sentences at 32K; `tessera plan`'s validation
texts start at sentences 7,919 + 1,000 k; the needle haystacks are generated from the start). Each item's prompt is
"Read the following document." and its "target" the passage, so the loss is the cross-entropy of the text's own next
token at every row (what made SmolLM2's MoA plan: "Targets at every row" in README.md), sized to the most sentences
whose prompt + target fit the level less 8 tokens, counted by `tessera tokenize`.

  python3 docs/plans/make_calib_33_gemma.py TESSERA MODEL KJVDUMP > docs/plans/calib-kjv-gemma3-8k-16k-text.jsonl

KJVDUMP: docs/plans/kjvdump_33.cpp built as its first line says.
"""
import json
import os
import subprocess
import sys
import tempfile

TESSERA, MODEL, KJVDUMP = sys.argv[1:4]
HEAD = "Read the following document."
LEVELS = [8192] * 4 + [16384] * 4
FIRST = 16000


def passage(first, count):
    with tempfile.NamedTemporaryFile("r", suffix=".txt", delete=False) as f:
        path = f.name
    subprocess.run([KJVDUMP, str(first), str(count), path], check=True, capture_output=True)
    text = open(path, encoding="utf-8").read().rstrip()
    os.unlink(path)
    return text


def count(text):
    out = subprocess.run([TESSERA, "tokenize", "-m", MODEL, "-f", "-", "--json"], input=text.encode(),
                         capture_output=True, check=True).stdout
    return json.loads(out)["count"]


first = FIRST
for level in LEVELS:
    room = level - 8
    lo, hi = 1, level  # the most sentences whose prompt + target fit (a sentence is at least one token)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(HEAD + "\n\n" + passage(first, mid)) <= room:
            lo = mid
        else:
            hi = mid - 1
    text = passage(first, lo)
    n = count(HEAD + "\n\n" + text)
    print(f"sentences {first}-{first + lo - 1}: {n} tokens for level {level}", file=sys.stderr)
    print(json.dumps({"prompt": HEAD, "target": "\n\n" + text}))
    first += lo
