#!/usr/bin/env python3
"""What tokenizing a conversation's later turn costs the server, with its prompt token cache (issue 34).

    bench/server/tokenize_turns.py --tessera BIN --model GGUF [--doc-tokens 28000] [--clients 4] [--turns 4]
                                   [--api chat|completions] [--rounds 3] [--json-out FILE]

One `tessera serve` (the engine is not used); --clients conversations over their own documents (prefix_turns.py's
shape: numbered facts about made-up towns, --doc-tokens tokens), each --turns turns: the document with question 1,
then an answer and the next question added each turn, as chat messages or one growing completion text. Each turn's
prompt goes to POST /tokenize three ways, interleaved over the clients as concurrent clients send them:
  turn       the prompt as the conversation sends it: after the first turn the server's cache holds the previous
             turn's text, so it tokenizes only the new part (src/server/prompt_tokens.h)
  uncached   the same prompt behind a nonce no kept prompt starts with ("Z<n>\n" before the document): a whole
             tokenization of a text of the same size (what every turn cost before the cache)
  floor      /tokenize of "Hi" (HTTP and JSON alone)
Each /tokenize returns every id, so the JSON of ~N ids is in both turn and uncached. Prints the medians over the later
turns (all clients, --rounds repeats of the conversations, each on fresh texts) and the server's ids for turn and
uncached are checked equal (uncached minus the nonce's tokens: the bench exits 1 on a difference).
"""
import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from server_process import Server, tokenize_count  # noqa: E402
from ttft_parts import paragraph  # noqa: E402


def tokenize(url, body):
    req = urllib.request.Request(url + "/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    out = json.loads(urllib.request.urlopen(req, timeout=600).read())
    return time.perf_counter() - t0, out["tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tessera", default="build/ci/src/tessera")
    ap.add_argument("--model", required=True)
    ap.add_argument("--doc-tokens", type=int, default=28000)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--api", choices=["chat", "completions"], default="completions")
    ap.add_argument("--serve-args", default="")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    srv = Server([args.tessera, "serve", "-m", args.model, "--port", "0", "--parallel", "1",
                  *args.serve_args.split()])
    rows = {"turn": [], "uncached": [], "floor": []}
    first_turn, differ, nonce = [], 0, 0
    try:
        for rnd in range(args.rounds):
            convs = []
            for c in range(args.clients):
                rng = random.Random(1000 * rnd + c)
                paras = []
                while True:
                    paras.append(paragraph(rng, len(paras) + 1))
                    if len(paras) % 16 == 0 and tokenize_count(srv.url, "\n".join(paras)) >= args.doc_tokens:
                        break
                head = "Read the records below, then answer questions about them.\n\n"
                convs.append({"head": head, "doc": "\n".join(paras) + "\n", "messages": [], "text": "", "rng": rng,
                              "records": len(paras)})
            for turn in range(args.turns):
                for cv in convs:
                    q = f"In which year was the town of record {cv['rng'].randint(1, cv['records'])} founded?"
                    if turn > 0:  # the previous turn's answer
                        answer = f" In the year {cv['rng'].randint(1100, 1900)}."
                        cv["messages"].append({"role": "assistant", "content": answer})
                        cv["text"] += answer + "\n"
                    cv["messages"].append({"role": "user", "content": (cv["head"] + cv["doc"] if turn == 0 else "") +
                                           f"\nQuestion: {q}"})
                    cv["text"] += (cv["head"] + cv["doc"] if turn == 0 else "") + f"\nQuestion: {q}\nAnswer:"
                    nonce += 1
                    tag = f"Z{nonce}\n"
                    if args.api == "chat":
                        body = {"messages": cv["messages"]}
                        first = dict(cv["messages"][0], content=tag + cv["messages"][0]["content"])
                        fresh = {"messages": [first] + cv["messages"][1:]}
                    else:
                        body, fresh = {"prompt": cv["text"]}, {"prompt": tag + cv["text"]}
                    t_turn, ids = tokenize(srv.url, body)
                    t_fresh, fresh_ids = tokenize(srv.url, fresh)
                    t_floor, _ = tokenize(srv.url, {"prompt": "Hi"})
                    # The nonce's own tokens sit where the document starts: the rest must be the same ids.
                    extra = len(fresh_ids) - len(ids)
                    same = extra >= 0 and any(fresh_ids[:i] == ids[:i] and fresh_ids[i + extra:] == ids[i:]
                                              for i in range(0, min(len(ids), 64)))
                    differ += not same
                    if turn == 0:
                        first_turn.append(t_turn)
                    else:
                        rows["turn"].append(t_turn)
                        rows["uncached"].append(t_fresh)
                        rows["floor"].append(t_floor)
                    print(f"round {rnd} turn {turn + 1}: {len(ids)} tokens, turn {t_turn * 1e3:.1f} ms, uncached "
                          f"{t_fresh * 1e3:.1f} ms, floor {t_floor * 1e3:.1f} ms{'' if same else '  IDS DIFFER'}",
                          flush=True)
    finally:
        srv.stop()
    med = {k: statistics.median(v) * 1e3 for k, v in rows.items()}
    print(f"\nlater turns ({len(rows['turn'])}), median ms: turn {med['turn']:.1f}, uncached {med['uncached']:.1f}, "
          f"floor (HTTP+JSON of 'Hi') {med['floor']:.1f}; first turns median {statistics.median(first_turn) * 1e3:.1f}")
    print(f"ids differ from the uncached tokenization in {differ} prompts")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "command": " ".join(srv.cmd), "ms": {k: [x * 1e3 for x in v]
                       for k, v in rows.items()}, "median_ms": med, "differ": differ}, f, indent=1)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
