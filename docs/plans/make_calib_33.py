#!/usr/bin/env python3
"""Long-target calibration for MoA (issue 33, docs/plans/README.md): prompts that fill 2K / 4K tokens with text the
evaluation never reads (the GNU / Mozilla / Apache / FDL licence texts of /usr/share/common-licenses, not the KJV
haystack of the perplexity and needle tasks), each ending in a request for a summary. No "target": `tessera plan
--calib` makes the dense model's own greedy answer (--answer-tokens, 64) the target, as MoA does with its
summaries, so the loss reads heads that use the whole context, not a 7-digit needle.

  python3 docs/plans/make_calib_33.py TESSERA MODEL > docs/plans/calib-licences-2k-4k.jsonl

Each prompt is cut (at a line end) to the most tokens that leave the answer room in its level:
level - answer_tokens - 8, counted by `tessera tokenize` (as plan's --calib encodes it, with BOS)."""
import json, subprocess, sys

TESSERA, MODEL = sys.argv[1], sys.argv[2]
ANSWER = 64
LIC = "/usr/share/common-licenses/"
HEAD = "Read the following document.\n\n"
TAIL = "\n\nWrite a short summary of the document above: what it is, what it allows, and what it requires.\nSummary:"
# (level, file, first line): four items per level, no text in two items.
ITEMS = [(2048, "GPL-2", 0), (2048, "Apache-2.0", 0), (2048, "MPL-2.0", 0), (2048, "LGPL-3", 0),
         (4096, "GPL-3", 0), (4096, "GFDL-1.3", 0), (4096, "LGPL-2.1", 0), (4096, "MPL-1.1", 0)]


def count(text):
    out = subprocess.run([TESSERA, "tokenize", "-m", MODEL, "-f", "-", "--json"], input=text.encode(),
                         capture_output=True, check=True).stdout
    return json.loads(out)["count"]


for level, name, first in ITEMS:
    lines = open(LIC + name, encoding="utf-8").read().splitlines()[first:]
    room = level - ANSWER - 8
    lo, hi = 1, len(lines)  # the most lines whose prompt fits
    if count(HEAD + "\n".join(lines) + TAIL) <= room:
        lo = hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(HEAD + "\n".join(lines[:mid]) + TAIL) <= room:
            lo = mid
        else:
            hi = mid - 1
    prompt = HEAD + "\n".join(lines[:lo]) + TAIL
    n = count(prompt)
    print(f"{name}: {lo} lines, {n} tokens for level {level}", file=sys.stderr)
    print(json.dumps({"prompt": prompt}))
