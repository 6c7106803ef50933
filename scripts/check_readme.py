#!/usr/bin/env python3
"""Runs the commands of the README (or other Markdown files) as written, on the CPU: the check that they still work.

    python3 scripts/check_readme.py [FILE.md ...]        default README.md; run from anywhere

Every fenced block whose info string starts with sh, bash or python runs, in its order, from the repository root:
shell blocks with `bash -euo pipefail`, Python blocks with the Python module's interpreter (TESSERA_PYENV, default
~/.cache/tessera/pyenv, with PYTHONPATH=build/ci/python: the module of the ci build). A word after the language
marks a block that does not run here:
    ```sh skip     illustrative, or long (the set-up commands themselves: CI runs them as .ci/run)
    ```sh gpu      needs a GPU (run where nvidia-smi finds one and GPU=1 is set)
Shell blocks find `python3` in build/venv first (OpenAI's client, made by scripts/setup.sh models). Each block runs
in its own process group, killed with everything it started (a server in the background) when it ends or after
BLOCK_TIMEOUT_S (120) seconds. Prints one line per block and "README commands: N of M blocks passed (S s)"; exits 1
if any failed. The README's commands read SmolLM2-135M from ~/.cache/tessera/models (scripts/fetch_models.sh); without
it the check fails, or is skipped with TESSERA_ALLOW_MISSING_MODELS=1.
"""
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\S*)\s*(.*)$")


def blocks(path):
    """(first line number, language, tags, text) of each fenced block."""
    out, cur = [], None
    with open(path) as f:
        for n, line in enumerate(f, 1):
            m = FENCE.match(line.rstrip("\n"))
            if cur is None and m and m.group(1):
                cur = (n + 1, m.group(1), m.group(2).split(), [])
            elif cur is not None and line.startswith("```"):
                out.append((cur[0], cur[1], cur[2], "".join(cur[3])))
                cur = None
            elif cur is not None:
                cur[3].append(line)
    return out


def run(lang, text, timeout):
    env = dict(os.environ)
    env["PATH"] = os.path.join(ROOT, "build/venv/bin") + os.pathsep + env.get("PATH", "")
    if lang == "python":
        pyenv = os.environ.get("TESSERA_PYENV", os.path.expanduser("~/.cache/tessera/pyenv"))
        env["PYTHONPATH"] = os.path.join(ROOT, "build/ci/python")
        cmd = [os.path.join(pyenv, "bin/python"), "-c", text]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", text]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True, text=True)
    try:
        output, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
        output = ""
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the block's background processes too
        except ProcessLookupError:
            pass
    if rc == "timeout":
        output, _ = p.communicate()
    return rc, output or ""


def main():
    files = sys.argv[1:] or [os.path.join(ROOT, "README.md")]
    timeout = int(os.environ.get("BLOCK_TIMEOUT_S", "120"))
    have_gpu = os.environ.get("GPU") == "1"
    if not os.path.exists(os.path.join(ROOT, "build/ci/src/tessera")):
        print("README commands: FAILED: no build/ci/src/tessera (build it first: scripts/test.sh)")
        return 1
    model = os.path.expanduser("~/.cache/tessera/models/smollm2-135m-instruct-q4_1.gguf")  # what the README names
    if not os.path.exists(model):
        if os.environ.get("TESSERA_ALLOW_MISSING_MODELS") == "1":
            print(f"README commands: skipped (no {model}; TESSERA_ALLOW_MISSING_MODELS=1)")
            return 0
        print(f"README commands: FAILED: no {model} (scripts/fetch_models.sh)")
        return 1
    start, ran, passed, failed = time.time(), 0, 0, []
    for path in files:
        name = os.path.relpath(path, ROOT)
        for line, lang, tags, text in blocks(path):
            if lang not in ("sh", "bash", "python"):
                continue
            where = f"{name}:{line}"
            if "skip" in tags or ("gpu" in tags and not have_gpu):
                print(f"  {where} ({lang} {' '.join(tags)}): not run here")
                continue
            t0 = time.time()
            rc, output = run(lang, text, timeout)
            ran += 1
            if rc == 0:
                passed += 1
                print(f"  {where} ({lang}): ok ({time.time() - t0:.0f} s)")
            else:
                failed.append(where)
                print(f"  {where} ({lang}): FAILED ({'timed out after %d s' % timeout if rc == 'timeout' else 'exit %s' % rc}); "
                      f"the block:\n{text}  its output (last 40 lines):")
                print("\n".join("    " + l for l in output.splitlines()[-40:]))
    status = "ok" if not failed else "FAILED: " + ", ".join(failed)
    print(f"README commands: {passed} of {ran} blocks passed ({time.time() - start:.0f} s) {status}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
