"""Starts `tessera serve` for the tests in this folder and reads what it prints; a tiny test runner.

The server listens on a free loopback port (--port 0) and prints it; every line it prints is kept, so tests can
check the per-request status lines. Tests are plain functions registered with @test; run() prints one line per
test and the closing "N passed, N failed" line, and exits non-zero when one failed.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback

BIN = os.environ["TESSERA_BIN"]
MODEL = os.environ["TESSERA_MODEL"]
MODEL_ID = os.path.splitext(os.path.basename(MODEL))[0]
# The device the servers and the CLI references run on: cpu, or cuda for the same scripts on a GPU machine
# (TESSERA_DEVICE=cuda tests/server/run.sh BIN test_sampling.py).
DEVICE = os.environ.get("TESSERA_DEVICE", "cpu")


class Server:
    def __init__(self, *args, startup_timeout=120):
        self.args = [BIN, "serve", "-m", MODEL, "--port", "0", "--device", DEVICE, *args]
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines = []
        self.port = None
        listening = threading.Event()

        def drain():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    listening.set()
            listening.set()

        self.reader = threading.Thread(target=drain, daemon=True)
        self.reader.start()
        if not listening.wait(startup_timeout) or self.port is None:
            self.proc.kill()
            raise RuntimeError("server did not start: " + "\n".join(self.lines))
        self.base_url = f"http://127.0.0.1:{self.port}"

    def request(self, method, path, body=None, headers=None, timeout=60):
        """Raw HTTP: (status, headers dict, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body)
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()

    def health(self):
        status, _, body = self.request("GET", "/health")
        assert status == 200, (status, body)
        return json.loads(body)

    def metrics(self):
        """Prometheus text -> {"name{labels}": value}."""
        status, _, body = self.request("GET", "/metrics")
        assert status == 200, (status, body)
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def wait_idle(self, timeout=20):
        """Polls /health until nothing runs or waits; returns it."""
        end = time.time() + timeout
        while True:
            h = self.health()
            if h["running"] == 0 and h["queued"] == 0:
                return h
            if time.time() > end:
                raise AssertionError(f"server not idle after {timeout} s: {h}")
            time.sleep(0.05)

    def saw(self, predicate, count=1, timeout=10):
        """Waits until `count` of the printed lines satisfy `predicate` (the reader thread may lag the answers)."""
        end = time.time() + timeout
        while sum(1 for l in list(self.lines) if predicate(l)) < count:
            if time.time() > end:
                return False
            time.sleep(0.02)
        return True

    def stop(self):
        """SIGTERM; the server must exit 0 within 20 s."""
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(20)
        self.reader.join(5)
        assert rc == 0, f"server exited with {rc}: " + "\n".join(self.lines[-20:])


def cli_answer(*args):
    """`tessera run` on the same model: (answer text, prompt token count)."""
    out = subprocess.run([BIN, "run", "-m", MODEL, "--device", DEVICE, *args], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    prompt_tokens = int(re.search(r"^prompt: ([\d,]+) tokens$", out, re.M).group(1).replace(",", ""))
    start = out.index("answer: ") + len("answer: ")
    end = re.search(r"\n\[[^\]]+\] prefill ", out).start()
    return out[start:end], prompt_tokens


_tests = []


def test(fn):
    _tests.append(fn)
    return fn


def run(setup=None, teardown=None):
    passed = failed = 0
    t0 = time.time()
    context = setup() if setup else None
    try:
        only = os.environ.get("ONLY", "")  # a comma-separated list of test names, to run a few while working
        for fn in _tests:
            if only and fn.__name__ not in only.split(","):
                continue
            t = time.time()
            try:
                fn(context) if context is not None else fn()
                passed += 1
                print(f"PASS {fn.__name__} ({time.time() - t:.1f} s)", flush=True)
            except Exception:  # noqa: BLE001 - every failure is reported, then the next test runs
                failed += 1
                print(f"FAIL {fn.__name__} ({time.time() - t:.1f} s)", flush=True)
                traceback.print_exc()
    finally:
        if teardown:
            try:
                teardown(context)
            except Exception:  # noqa: BLE001
                failed += 1
                print("FAIL teardown", flush=True)
                traceback.print_exc()
    print(f"{os.path.basename(sys.argv[0])}: {time.time() - t0:.1f} s")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
