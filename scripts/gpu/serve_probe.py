#!/usr/bin/env python3
"""The requests `scripts/gpu/run.sh serve` sends to a `tessera serve` (one GPU, or --gpus N), greedy:
completions (one long prompt), a chat, a per-request policy, a client that leaves mid-stream and a request after
it. Writes the answers as JSON; `--compare A.json B.json` prints a table of two runs' answers.

  python3 scripts/gpu/serve_probe.py PORT OUT.json
  python3 scripts/gpu/serve_probe.py --compare one_gpu.json two_gpus.json
"""
import http.client
import json
import sys
import urllib.error
import urllib.request


MODEL = None


def post(port, path, body):
    body = dict(body, model=MODEL)
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        return json.loads(urllib.request.urlopen(req, timeout=120).read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{path}: HTTP {e.code}: {e.read().decode()}")


def probe(port, out):
    global MODEL
    MODEL = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30).read())["data"][0]["id"]
    answers = {}
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 4, " * 200]
    for i, p in enumerate(prompts):
        r = post(port, "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0})
        answers[f"completion {i} ({r['usage']['prompt_tokens']} prompt tokens)"] = r["choices"][0]["text"]
    r = post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colours."}],
                                            "max_tokens": 16, "temperature": 0})
    answers["chat"] = r["choices"][0]["message"]["content"]
    r = post(port, "/v1/completions", {"prompt": "Once upon a time " * 60, "max_tokens": 8, "temperature": 0,
                                       "tessera": {"attn": "ashape:sink=16,local=64"}})
    answers["tessera.attn ashape:sink=16,local=64"] = r["choices"][0]["text"]
    # A client that leaves mid-stream, then a request after it.
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
                                                      "temperature": 0, "stream": True}),
              {"Content-Type": "application/json"})
    c.getresponse().read(64)
    c.close()
    r = post(port, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
    answers["after a client left mid-stream"] = r["choices"][0]["text"]
    json.dump(answers, open(out, "w"), indent=1)
    print(json.dumps(answers, indent=1))


def compare(a_path, b_path):
    a, b = json.load(open(a_path)), json.load(open(b_path))
    print("| request | one GPU (`serve --device cuda`) | `serve --gpus 2` | same |\n|---|---|---|---|")
    for k in a:
        print(f"| {k} | {a[k]!r} | {b.get(k)!r} | {a[k] == b.get(k)} |")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        probe(int(sys.argv[1]), sys.argv[2])
