#!/usr/bin/env python3
"""Bad input -> message, exit code, peak memory: every class of bad input tessera must answer with a clear error.

Runs the `tessera` binary on hostile and mistaken inputs (corrupt and oversized files, sizes read from files,
prompts over the context, malformed configs, policies and flags, the rough edges a new user hits) and checks each
answer: the exact first line on stderr, the exit code (docs/cli.md: 1 for what fails once it runs, 2 for a wrong
command line), and that the process stayed small (peak RSS, measured with wait4). Writes the table as markdown.

  python3 scripts/bad_inputs.py TESSERA_BINARY [--out docs/bad-inputs.md] [--models DIR]

Exit status 1 when any case answers differently from what it expects (CI runs it through ctest as cli.bad_inputs);
cases that need a real model are skipped (and listed as skipped) when the model is missing.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")


def run(cmd, env=None, timeout=300, stdin=b""):
    """Runs cmd with `stdin` on its standard input; returns (exit code, stdout, stderr, peak RSS in MB, seconds)."""
    t0 = time.time()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.TemporaryFile() as inp:
        inp.write(stdin)
        inp.seek(0)
        p = subprocess.Popen(cmd, stdin=inp, stdout=out, stderr=err, env=env)
        deadline = t0 + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                p.kill()
                pid, status, usage = os.wait4(p.pid, 0)
                break
            time.sleep(0.01)
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace"), usage.ru_maxrss / 1024, time.time() - t0


def first_error_line(stderr):
    for line in stderr.splitlines():
        if line.startswith("tessera: ") or "Error" in line or "error" in line:
            return line.strip()
    return stderr.strip().splitlines()[-1] if stderr.strip() else ""


def make_fixtures(tmp):
    """Builds the bad files in tmp; returns a dict of paths."""
    f = {}
    llama = os.path.join(DATA, "hf_tiny", "llama3")
    # An HF folder with a tokenizer whose vocabulary holds an out-of-range id.
    hf = os.path.join(tmp, "hf_bad_tokenizer")
    os.makedirs(hf)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(llama, name), hf)
    tok = json.load(open(os.path.join(DATA, "tokenizer", "tiny_llama3_tokenizer.json")))
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first] = 1 << 30
    json.dump(tok, open(os.path.join(hf, "tokenizer.json"), "w"))
    f["hf_bad_tokenizer"] = hf
    # A float id.
    hf2 = os.path.join(tmp, "hf_float_id")
    shutil.copytree(hf, hf2)
    vocab[first] = 1.5
    json.dump(tok, open(os.path.join(hf2, "tokenizer.json"), "w"))
    f["hf_float_id"] = hf2
    # config.json asking for two billion layers.
    hf3 = os.path.join(tmp, "hf_huge_layers")
    shutil.copytree(hf, hf3)
    cfg = json.load(open(os.path.join(llama, "config.json")))
    cfg["num_hidden_layers"] = 2_000_000_000
    json.dump(cfg, open(os.path.join(hf3, "config.json"), "w"))
    f["hf_huge_layers"] = hf3
    # config.json with a wrong type.
    hf4 = os.path.join(tmp, "hf_wrong_type")
    shutil.copytree(hf, hf4)
    cfg = json.load(open(os.path.join(llama, "config.json")))
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": "two"}
    json.dump(cfg, open(os.path.join(hf4, "config.json"), "w"))
    f["hf_wrong_type"] = hf4
    # Truncated and garbage model files.
    gguf = os.path.join(llama, "model.gguf")
    data = open(gguf, "rb").read()
    open(os.path.join(tmp, "truncated.gguf"), "wb").write(data[: len(data) // 2])
    f["truncated_gguf"] = os.path.join(tmp, "truncated.gguf")
    # A GGUF header claiming 2^40 tensors.
    open(os.path.join(tmp, "huge_count.gguf"), "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0))
    f["huge_count_gguf"] = os.path.join(tmp, "huge_count.gguf")
    # Policies.
    pol = os.path.join(tmp, "huge_policy.json")
    json.dump({"tessera_policy": 1, "num_layers": 2_000_000_000, "num_q_heads": 2_000_000_000, "num_kv_heads": 1,
               "default": {"type": "dense"}}, open(pol, "w"))
    f["huge_policy"] = pol
    big = os.path.join(tmp, "big_policy.json")
    with open(big, "wb") as fh:
        fh.write(b"[")
        fh.truncate(65 << 20)  # sparse
    f["big_policy"] = big
    bad_json = os.path.join(tmp, "bad_policy.json")
    open(bad_json, "w").write('{"tessera_policy": 1,\n  "num_layers": 2,\n}\n')
    f["bad_json_policy"] = bad_json
    # tessera plan: calibration files, and a plan made for another model (SmolLM2's 30 x 9 heads, 3 KV heads).
    open(os.path.join(tmp, "empty.jsonl"), "w").write("\n")
    f["empty_calib"] = os.path.join(tmp, "empty.jsonl")
    open(os.path.join(tmp, "bad.jsonl"), "w").write('{"prompt": "one", "target": "two"}\n{"prompt": "three"\n')
    f["bad_calib"] = os.path.join(tmp, "bad.jsonl")
    other = os.path.join(tmp, "smollm2-plan.json")
    json.dump({"tessera_policy": 1, "num_layers": 30, "num_q_heads": 9, "num_kv_heads": 3,
               "default": {"type": "moa_window", "alpha": 0, "beta": 0.5}}, open(other, "w"))
    f["other_model_plan"] = other
    # Prompts.
    huge_prompt = os.path.join(tmp, "huge_prompt.txt")
    with open(huge_prompt, "wb") as fh:
        fh.write(b"a")
        fh.truncate((1 << 30) + 1)  # sparse, 1 GiB + 1
    f["huge_prompt"] = huge_prompt
    long_prompt = os.path.join(tmp, "long_prompt.txt")
    open(long_prompt, "w").write("word " * 400_000)  # 2 MB of text
    f["long_prompt"] = long_prompt
    return f


def cases(tessera, fx, models):
    tiny = os.path.join(DATA, "hf_tiny", "llama3", "model.gguf")
    smol = os.path.join(models, "smollm2-135m-instruct-q4_1.gguf")
    gemma = os.path.join(models, "gemma-3-270m-q4_k_m.gguf")
    T = [tessera]
    c = []

    def add(klass, what, args, code, message, needs=None, stdout=None, stdin=b""):
        c.append(dict(klass=klass, what=what, args=args, code=code, message=message, needs=needs, stdout=stdout,
                      stdin=stdin))

    # Corrupt and hostile model files.
    add("model file", "tokenizer.json with an out-of-range id", T + ["run", "-m", fx["hf_bad_tokenizer"], "-p", "hi"], 1,
        None)
    add("model file", "tokenizer.json with a float id", T + ["run", "-m", fx["hf_float_id"], "-p", "hi"], 1, None)
    add("model file", "truncated GGUF", T + ["inspect", fx["truncated_gguf"]], 1, None)
    add("model file", "GGUF header claiming 2^40 tensors", T + ["inspect", fx["huge_count_gguf"]], 1, None)
    add("model file", "model path that does not exist", T + ["inspect", "/nonexistent/model.gguf"], 1, None)
    # Sizes read from files.
    add("sizes from files", "config.json with 2,000,000,000 layers", T + ["run", "-m", fx["hf_huge_layers"], "-p", "hi"],
        1, None)
    add("sizes from files", "config.json with a wrong type", T + ["run", "-m", fx["hf_wrong_type"], "-p", "hi"], 1, None)
    add("sizes from files", "policy with 2e9 x 2e9 heads", T + ["run", "-m", tiny, "-p", "hi", "--attn", fx["huge_policy"]],
        1, None)
    add("sizes from files", "policy file of 65 MiB", T + ["run", "-m", tiny, "-p", "hi", "--attn", fx["big_policy"]], 1,
        None)
    add("sizes from files", "policy path that is a device", T + ["run", "-m", tiny, "-p", "hi", "--attn", "/dev/zero"], 1,
        None)
    add("sizes from files", "policy file with invalid JSON",
        T + ["run", "-m", tiny, "-p", "hi", "--attn", fx["bad_json_policy"]], 1, None)
    # Prompts over the context, memory budgets.
    add("context and memory", "prompt file of 1 GiB", T + ["run", "-m", tiny, "-f", fx["huge_prompt"]], 1, None)
    add("context and memory", "2 MB prompt over the 8K context (refused before tokenizing)",
        T + ["run", "-m", smol, "-f", fx["long_prompt"]], 1, None, needs=smol)
    add("context and memory", "prompt file that is a directory", T + ["run", "-m", tiny, "-f", "/tmp"], 1, None)
    add("context and memory", "--max-context 2,000,000,000 (KV cache over the budget)",
        T + ["run", "-m", smol, "-p", "hi", "--max-context", "2000000000"], 1, None, needs=smol)
    add("context and memory", "--memory-budget 1M (weights over the budget)",
        T + ["run", "-m", smol, "-p", "hi", "--memory-budget", "1M"], 1, None, needs=smol)
    add("context and memory", "generation reaching the context limit",
        T + ["run", "-m", smol, "-p", "Count: one two three four five", "--max-context", "12", "-n", "50"], 0, None,
        needs=smol, stdout="(generation stopped at the context limit of 12 tokens")
    add("context and memory", "-f - with nothing on standard input", T + ["run", "-m", tiny, "-f", "-"], 1, None)
    # Flags: a wrong command line is exit code 2 (docs/cli.md), found before anything is loaded.
    add("flags", "-n -2 (-1: until the end of the text or a full context)", T + ["run", "-m", tiny, "-p", "hi", "-n", "-2"],
        2, None)
    add("flags", "llama.cpp's -ngl 99", T + ["run", "-m", tiny, "-p", "hi", "-ngl", "99"], 2, None)
    add("flags", "llama.cpp's -ngl 99 after -n 16 (was: --max-tokens: At Most 1 required but received 2)",
        T + ["run", "-m", tiny, "-p", "hi", "-n", "16", "-ngl", "99"], 2, None)
    add("flags", "a mistyped flag", T + ["run", "-m", tiny, "-p", "hi", "--temprature", "0.5"], 2, None)
    add("flags", "a mistyped subcommand", T + ["rnu", "-m", tiny, "-p", "hi"], 2, None)
    add("flags", "an unknown flag with no near name", T + ["run", "-m", tiny, "-p", "hi", "--frobnicate"], 2, None)
    add("flags", "a flag's value that is no number (CLI11)", T + ["run", "-m", tiny, "-p", "hi", "-n", "many"], 2, None)
    add("flags", "a value outside a flag's choices (CLI11)", T + ["run", "-m", tiny, "-p", "hi", "--device", "gpu"], 2,
        None)
    add("flags", "--quiet with --json", T + ["run", "-m", tiny, "-p", "hi", "--quiet", "--json"], 2, None)
    add("flags", "--json with --gpus 2", T + ["run", "-m", tiny, "-p", "hi", "--gpus", "2", "--json"], 2, None)
    add("flags", "tokenize without a text", T + ["tokenize", "-m", tiny], 2, None)
    add("flags", "tokenize --chat with --no-special", T + ["tokenize", "-m", tiny, "-p", "hi", "--chat", "--no-special"],
        2, None)
    add("flags", "--gemm fp8 on the CPU", T + ["run", "-m", smol, "-p", "hi", "--device", "cpu", "--gemm", "fp8"], 1,
        None, needs=smol)
    add("flags", "--gemm fp8 with --gpus 2", T + ["run", "-m", tiny, "-p", "hi", "--gpus", "2", "--gemm", "fp8"], 1,
        None)
    add("flags", "--kv-type fp8 on the CPU", T + ["run", "-m", smol, "-p", "hi", "--device", "cpu", "--kv-type", "fp8"],
        1, None, needs=smol)
    add("flags", "--kv-type fp8 with --gpus 2", T + ["run", "-m", tiny, "-p", "hi", "--gpus", "2", "--kv-type", "fp8"],
        1, None)
    add("flags", "--temperature -1", T + ["run", "-m", tiny, "-p", "hi", "--temperature", "-1"], 2, None)
    add("flags", "--top-p 1.5", T + ["run", "-m", tiny, "-p", "hi", "--top-p", "1.5"], 2, None)
    add("flags", "--top-k -3", T + ["run", "-m", tiny, "-p", "hi", "--top-k", "-3"], 2, None)
    add("flags", "--system without --chat", T + ["run", "-m", tiny, "-p", "hi", "--system", "be brief"], 2, None)
    add("flags", "--memory-budget lots", T + ["run", "-m", tiny, "-p", "hi", "--memory-budget", "lots"], 2, None)
    add("flags", "--attn vs:v=-5 (checked before the model loads)",
        T + ["run", "-m", "/nonexistent.gguf", "-p", "hi", "--attn", "vs:v=-5"], 2, None)
    add("flags", "--attn bs:top_k=0", T + ["run", "-m", tiny, "-p", "hi", "--attn", "bs:top_k=0"], 2, None)
    add("flags", "--attn with a typo", T + ["run", "-m", tiny, "-p", "hi", "--attn", "vss"], 2, None)
    add("flags", "--attn vs_adaptive:gamma=1.5 (a coverage target outside (0, 1])",
        T + ["run", "-m", "/nonexistent.gguf", "-p", "hi", "--attn", "vs_adaptive:gamma=1.5"], 2, None)
    add("flags", "--attn bs_adaptive:min_top_k=500 (a minimum above the maximum)",
        T + ["run", "-m", tiny, "-p", "hi", "--attn", "bs_adaptive:min_top_k=500"], 2, None)
    add("flags", "bench: bad second policy (checked before the first row)",
        T + ["bench", "-m", tiny, "-d", "64", "--attn", "ashape;vs:s=-1"], 2, None)
    add("flags", "bench: depth 0", T + ["bench", "-m", tiny, "-d", "0"], 2, None)
    add("flags", "serve --step-tokens without --parallel (it budgets the batched engine's steps)",
        T + ["serve", "-m", tiny, "--step-tokens", "64"], 2, None)
    add("flags", "serve --step-tokens 4 --parallel 4 (the budget must exceed the decoding rows)",
        T + ["serve", "-m", tiny, "--parallel", "4", "--step-tokens", "4"], 2, None)
    add("flags", "--logits-out with --compare", T + ["run", "-m", tiny, "-p", "hi", "--attn", "ashape", "--compare",
                                                     "--logits-out", "/tmp/l.f32"], 2, None)
    # Several GPUs (docs/multi-gpu.md): checked before any GPU is touched.
    add("several GPUs", "serve --gpus 2 --parallel 4 for a model with 3 KV heads (the batched tensor-parallel engine splits whole KV heads)",
        T + ["serve", "-m", smol, "--gpus", "2", "--parallel", "4"], 2, None)
    add("several GPUs", "plan --gpus 64 for a model with 9 query heads (refused before planning)",
        T + ["plan", "--method", "minference", "-m", smol, "--gpus", "64", "-o", "/tmp/tessera-bad-input-plan.json"], 1,
        None, needs=smol)
    # Streaming memory (docs/streaming.md): sizes, the index ratio, host budgets (Gemma-3: its global layers only).
    add("streaming", "--stream-chunk 0",
        T + ["run", "-m", tiny, "-p", "hi", "--stream", "ltri", "--stream-chunk", "0"], 2, None)
    add("streaming", "--stream with --attn", T + ["run", "-m", tiny, "-p", "hi", "--stream", "infllm", "--attn", "ashape"],
        2, None)
    add("streaming", "--stream-index-ratio 0.5 (under one evicted token per index vector)",
        T + ["run", "-m", tiny, "-p", "hi", "--stream", "ltri", "--stream-index-ratio", "0.5"], 2, None)
    add("streaming", "--stream-index-heads some (retrieval or all)",
        T + ["run", "-m", tiny, "-p", "hi", "--stream", "ltri", "--stream-index-heads", "some"], 2, None)
    add("streaming", "--stream-early-layers skip (score or votes)",
        T + ["run", "-m", tiny, "-p", "hi", "--stream", "ltri", "--stream-early-layers", "skip"], 2, None)
    add("streaming", "--stream-map-heads one (all or retrieval)",
        T + ["run", "-m", tiny, "-p", "hi", "--stream", "ltri", "--stream-map-heads", "one"], 2, None)
    add("streaming", "--stream-host-kv fp8 on the CPU (the GPU path's)",
        T + ["run", "-m", tiny, "-p", "hi", "--stream", "ltri", "--stream-host-kv", "fp8"], 2, None)
    add("streaming", "eval --device cuda --stream-host-kv fp8 (checked for the GPU: here the GPU's absence answers)",
        T + ["eval", "-m", smol, "--device", "cuda", "--stream", "ltri", "--stream-host-kv", "fp8", "--tasks",
             "niah_single", "-l", "512", "-o", "/tmp/tessera-bad-input-eval"], 1, None, needs=smol)
    add("streaming", "--stream-host-budget 4K on Gemma-3 (only its global layers keep evicted blocks)",
        T + ["run", "-m", gemma, "-p", "one two three four five six seven eight nine ten " * 12, "--stream", "ltri",
             "--stream-sinks", "4", "--stream-local", "16", "--stream-block", "16", "--stream-chunk", "16",
             "--stream-host-budget", "4K"], 1, None, needs=gemma)
    add("streaming", "--stream-host-budget 4K for a prompt that evicts more",
        T + ["run", "-m", smol, "-p", "one two three four five six seven eight nine ten " * 12, "--stream", "ltri",
             "--stream-sinks", "4", "--stream-local", "16", "--stream-block", "16", "--stream-chunk", "16",
             "--stream-host-budget", "4K"], 1, None, needs=smol)
    add("streaming", "--stream-trace without --stream",
        T + ["run", "-m", tiny, "-p", "hi", "--stream-trace", "/tmp/tessera-bad-input-trace.txt"], 2, None)
    add("streaming", "serve --stream with --attn (streaming attends densely within its layout)",
        T + ["serve", "-m", tiny, "--device", "cpu", "--stream", "ltri", "--attn", "vs"], 2, None)
    # tessera plan (docs/plans/README.md): checked before the model loads, except the last.
    out = os.path.join(os.path.dirname(fx["empty_calib"]), "plan.json")
    add("plan", "plan --budget 0", T + ["plan", "--method", "moa", "-m", tiny, "--budget", "0", "-o", out], 2, None)
    add("plan", "plan --budget 1.5", T + ["plan", "--method", "minference", "-m", tiny, "--budget", "1.5", "-o", out],
        2, None)
    add("plan", "plan --method with a typo", T + ["plan", "--method", "mo", "-m", tiny, "-o", out], 2, None)
    add("plan", "plan --validation-length with a 0 among lengths",
        T + ["plan", "--method", "moa", "-m", tiny, "--validation-length", "0,2048", "-o", out], 2, None)
    add("plan", "plan --validation-texts 0",
        T + ["plan", "--method", "moa", "-m", tiny, "--validation-texts", "0", "-o", out], 2, None)
    add("plan", "plan --calib-tasks without --calib",
        T + ["plan", "--method", "moa", "-m", tiny, "--calib-tasks", "-o", out], 2, None)
    add("plan", "plan --trianglemix-select with --budget (both choose the split)",
        T + ["plan", "--method", "trianglemix", "-m", tiny, "--trianglemix-select", "0.02", "--budget", "0.5",
             "-o", out], 2, None)
    add("plan", "plan --trianglemix-select for MoA",
        T + ["plan", "--method", "moa", "-m", tiny, "--trianglemix-select", "0.02", "-o", out], 2, None)
    add("plan", "plan --compare-with presets without held-out tasks",
        T + ["plan", "--method", "trianglemix", "-m", tiny, "--compare-with", "vs_adaptive", "--validation-cases", "0",
             "-o", out], 2, None)
    add("plan", "plan --compare-with a preset with a typo (checked before planning)",
        T + ["plan", "--method", "trianglemix", "-m", smol, "--compare-with", "vs_adaptive;trianglemx", "-o", out], 1,
        None, needs=smol)
    add("plan", "plan with an empty calibration file",
        T + ["plan", "--method", "trianglemix", "-m", tiny, "--calib", fx["empty_calib"], "-o", out], 1, None)
    add("plan", "plan with a malformed calibration line",
        T + ["plan", "--method", "moa", "-m", tiny, "--calib", fx["bad_calib"], "-o", out], 1, None)
    add("plan", "a plan for SmolLM2 given to run on Gemma-3",
        T + ["run", "-m", gemma, "-p", "hi", "--attn", fx["other_model_plan"]], 1, None, needs=gemma)
    # Chat.
    add("chat", "--chat on a base model (no chat template)", T + ["run", "-m", gemma, "-p", "hi", "--chat"], 1, None,
        needs=gemma)
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("tessera")
    ap.add_argument("--out", help="write the markdown table here")
    ap.add_argument("--models", default=os.environ.get("TESSERA_MODELS", os.path.expanduser("~/.cache/tessera/models")))
    ap.add_argument("--expect", default=os.path.join(DATA, "bad_inputs_expected.json"),
                    help="expected first stderr line per case (JSON); --update rewrites it")
    ap.add_argument("--update", action="store_true", help="record the current messages as expected")
    args = ap.parse_args()
    expected = json.load(open(args.expect)) if os.path.exists(args.expect) and not args.update else {}
    tmp = tempfile.mkdtemp(prefix="tessera-bad-inputs-")
    failures, rows, recorded, skipped = [], [], {}, []
    try:
        fx = make_fixtures(tmp)
        for case in cases(os.path.abspath(args.tessera), fx, args.models):
            if case["needs"] and not os.path.exists(case["needs"]):
                skipped.append(case["what"])
                continue
            code, out, err, rss, secs = run(case["args"], stdin=case["stdin"])
            line = first_error_line(err).replace(tmp, "$TMP").replace(args.models, "$MODELS").replace(ROOT + "/", "")
            if case["stdout"]:
                got = next((l for l in out.splitlines() if l.startswith(case["stdout"])), "")
                line = got.strip() or line
            recorded[case["what"]] = line
            problems = []
            if code != case["code"]:
                problems.append(f"exit code {code}, expected {case['code']}")
            if case["stdout"] and not any(l.startswith(case["stdout"]) for l in out.splitlines()):
                problems.append(f"stdout lacks '{case['stdout']}'")
            if not args.update:
                want = expected.get(case["what"])
                if want is None:
                    problems.append("no expected message recorded (run with --update)")
                elif want != line:
                    problems.append(f"message differs: expected {want!r}")
            if code < 0 or "internal error" in err or "Sanitizer" in err:
                problems.append("crash or internal error")
            # The largest case loads Gemma-3-270M in f32 (1.4 GB); AddressSanitizer's shadow memory adds to that.
            bound = 2048 * (4 if "ASAN_OPTIONS" in os.environ else 1)
            if rss > bound:
                problems.append(f"peak memory {rss:.0f} MB, over {bound} MB")
            if problems:
                failures.append(f"{case['what']}: {'; '.join(problems)}\n    got: {line!r}")
            rows.append((case["klass"], case["what"], line, code, rss, secs))
            print(f"{'FAIL' if problems else 'ok  '} {case['what']}: exit {code}, {rss:.0f} MB, {secs:.2f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.update:
        json.dump(recorded, open(args.expect, "w"), indent=1, ensure_ascii=False)
        open(args.expect, "a").write("\n")
    if args.out:
        with open(args.out, "w") as md:
            md.write("# Bad input -> message, exit code, peak memory\n\n")
            md.write("Made by `python3 scripts/bad_inputs.py build/ci/src/tessera --out docs/bad-inputs.md` (CI runs the same "
                     "script as the ctest `cli.bad_inputs`, which fails when a message, an exit code or the memory bound "
                     "changes). Peak memory is the process's maximum resident set (wait4); `$TMP` is the script's scratch "
                     "folder, `$MODELS` the real test models.\n\n")
            md.write("| class | bad input | message (first line on stderr, or the line on stdout) | exit | peak MB | s |\n")
            md.write("|---|---|---|---:|---:|---:|\n")
            for klass, what, line, code, rss, secs in rows:
                md.write(f"| {klass} | {what} | `{line.replace('|', '/')}` | {code} | {rss:.0f} | {secs:.2f} |\n")
            if skipped:
                md.write(f"\nSkipped (model missing): {', '.join(skipped)}\n")
    if skipped and os.environ.get("TESSERA_ALLOW_MISSING_MODELS") != "1":
        failures.append(f"{len(skipped)} cases need the real models in {args.models} (scripts/setup.sh models; "
                        "TESSERA_ALLOW_MISSING_MODELS=1 skips them)")
    print(f"bad inputs: {len(rows) - len(failures)}/{len(rows)} answered as expected"
          + (f", {len(skipped)} skipped (models missing)" if skipped else ""))
    for f in failures:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
