"""32 parallel streams against `tessera serve` (loopback, bounded in count and time), 8 of whose clients hang up
mid-stream: the server stays up, every other stream ends with a finish_reason and "data: [DONE]", the cancelled
ones free their slots, and the KV cache (0 tokens, 0 bytes) and the resident memory return to their baseline.
"""
import http.client
import json
import os
import shutil
import subprocess
import threading
import time

from harness import MODEL_ID, Server, run, test

CLIENTS = 32
HANG_UP_EVERY = 4       # clients 0, 4, 8, ... close the connection after their second text chunk
MAX_TOKENS = 10
RSS_SLACK = 48 << 20    # allowed growth of the resident size after the burst (allocator and thread stacks)
DEADLINE_S = 900        # generous: CI also runs this under AddressSanitizer on 2 shared cores


def stream_one(port, i, results):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = {"model": MODEL_ID, "prompt": f"Story number {i}: once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0.8, "seed": i, "stream": True}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            results[i] = ("http", r.status, r.read())
            return
        texts, finish, done, buf = 0, None, False, b""
        while not done:
            line = r.fp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[len(b"data: "):]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            c = chunk["choices"][0]
            if c["text"]:
                texts += 1
            if c["finish_reason"]:
                finish = c["finish_reason"]
            if i % HANG_UP_EVERY == 0 and texts == 2:
                conn.sock.close()  # hang up mid-stream
                results[i] = ("hung up", texts)
                return
        results[i] = ("done", finish, texts, done)
    except Exception as e:  # noqa: BLE001 - reported as this client's result
        results[i] = ("exception", repr(e))
    finally:
        conn.close()


def setup():
    return Server("--parallel", "4", "--queue", str(CLIENTS), "--quiet")


def listen_backlog(port):
    """The listening socket's backlog (ss's Send-Q for a LISTEN socket), or None without ss."""
    if shutil.which("ss") is None:
        return None
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    return int(out.split()[2]) if out.strip() else None


@test
def parallel_streams_with_disconnects(s):
    # A burst of 32 connections must fit the accept queue (cpp-httplib's own backlog is 5: the server sets 1024).
    backlog = listen_backlog(s.port)
    if backlog is None:
        print("  (no `ss` here: the listen backlog was not read)")
    else:
        assert backlog >= CLIENTS, f"listen backlog {backlog} < {CLIENTS} clients"
    # Warm up (first-use allocations), then take the baseline.
    status, _, _ = s.request("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 4})
    assert status == 200
    base = s.wait_idle()
    assert base["kv_cache_tokens"] == 0 and base["kv_cache_bytes"] == 0, base
    results = [None] * CLIENTS
    threads = [threading.Thread(target=stream_one, args=(s.port, i, results)) for i in range(CLIENTS)]
    t0 = time.time()
    for t in threads:
        t.start()
    peak_kv = 0
    while any(t.is_alive() for t in threads):
        assert time.time() - t0 < DEADLINE_S, "the streams did not end in time"
        peak_kv = max(peak_kv, s.health()["kv_cache_bytes"])
        time.sleep(0.1)
    elapsed = time.time() - t0
    hung = [i for i, r in enumerate(results) if r[0] == "hung up"]
    done = [i for i, r in enumerate(results) if r[0] == "done"]
    assert hung == list(range(0, CLIENTS, HANG_UP_EVERY)), results
    assert len(done) == CLIENTS - len(hung), [r for r in results if r[0] not in ("done", "hung up")]
    for i in done:
        _, finish, texts, saw_done = results[i]
        assert saw_done and finish in ("stop", "length") and texts >= 1, (i, results[i])
    after = s.wait_idle()
    m = s.metrics()
    print(f"  {CLIENTS} streams in {elapsed:.1f} s; peak KV {peak_kv / 2**20:.1f} MiB; RSS {base['rss_bytes'] / 2**20:.0f}"
          f" -> {after['rss_bytes'] / 2**20:.0f} MiB; cancelled {m['tessera_requests_cancelled_total']:.0f}")
    assert peak_kv > 0
    assert after["kv_cache_tokens"] == 0 and after["kv_cache_bytes"] == 0, after
    if os.environ.get("TESSERA_SANITIZED") == "1":
        print("  (AddressSanitizer build: its quarantine keeps freed memory resident; RSS not compared)")
    else:
        assert after["rss_bytes"] <= base["rss_bytes"] + RSS_SLACK, (base, after)
    assert m["tessera_requests_cancelled_total"] >= 1, m
    assert m['tessera_requests_total{endpoint="/v1/completions",status="200"}'] == CLIENTS + 1
    # Still serving.
    status, _, body = s.request("POST", "/v1/completions", {"model": MODEL_ID, "prompt": "Hi", "max_tokens": 2})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] <= 2, body


run(setup, lambda s: s.stop())
