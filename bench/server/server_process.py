"""A `tessera serve` process for the bench scripts in this folder (prefix_turns.py, step_budget.py, ttft_parts.py).

Server(cmd) starts the command (which passes --port 0), keeps every line it prints, and reads the port from its
"listening on http://...:PORT" line; a server that does not start within the timeout is killed and the script exits
with the command and what it printed. metrics() reads /metrics' tessera_* values; stop() ends the process.
tokenize_count() is /tokenize's token count of a text.
"""
import json
import re
import subprocess
import sys
import threading
import urllib.request


class Server:
    def __init__(self, cmd, startup_timeout=300):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.lines, self.port = [], None
        up = threading.Event()

        def drain():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                m = re.search(r"listening on http://[0-9.]+:(\d+)", line)
                if m:
                    self.port = int(m.group(1))
                    up.set()
            up.set()

        threading.Thread(target=drain, daemon=True).start()
        if not up.wait(startup_timeout) or self.port is None:
            self.proc.kill()
            sys.exit("server did not start: " + " ".join(cmd) + "\n" + "\n".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"

    def metrics(self, timeout=30):
        """The tessera_* lines of /metrics without labels: {name: value}."""
        text = urllib.request.urlopen(self.url + "/metrics", timeout=timeout).read().decode()
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(tessera_[a-z_]+) ([0-9.eE+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def tokenize_count(url, text, timeout=60):
    """How many tokens the server's tokenizer makes of `text` (POST /tokenize)."""
    req = urllib.request.Request(url + "/tokenize", json.dumps({"prompt": text}).encode(),
                                 {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=timeout).read())["count"]
