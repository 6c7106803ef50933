#!/usr/bin/env python3
"""Issue 33: calibration items whose targets are every token of the document (docs/plans/README.md, "Targets at
every row"), made from the first N items of calib-licences-2k-4k.jsonl (the same licence texts; N = 4: the 2K items, N = 8:
the 4K items too): the prompt is only
"Read the following document.", the "target" is the document, so the loss is the cross-entropy of the text's own
next tokens at every row (what the KJV perplexity scores), not of a summary at the end.

  python3 docs/plans/make_calib_33_text.py < docs/plans/calib-licences-2k-4k.jsonl > docs/plans/calib-licences-2k-text.jsonl
  python3 docs/plans/make_calib_33_text.py 8 < docs/plans/calib-licences-2k-4k.jsonl > docs/plans/calib-licences-2k-4k-text.jsonl
"""
import json
import sys

HEAD = "Read the following document.\n\n"
TAIL = "\n\nWrite a short summary of the document above: what it is, what it allows, and what it requires.\nSummary:"

ITEMS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
for i, line in enumerate(sys.stdin):
    if i >= ITEMS:  # the four 2K items (then the four 4K items)
        break
    prompt = json.loads(line)["prompt"]
    assert prompt.startswith(HEAD) and prompt.endswith(TAIL), f"item {i + 1}: not a make_calib_33.py prompt"
    print(json.dumps({"prompt": HEAD.rstrip("\n"), "target": "\n\n" + prompt[len(HEAD):-len(TAIL)]}))
