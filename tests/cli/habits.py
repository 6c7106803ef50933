#!/usr/bin/env python3
"""The command line's habits (docs/cli.md), one ctest case each (tests/CMakeLists.txt: cli.<case>):

  python3 tests/cli/habits.py TESSERA_BINARY CASE

stdin        -f - and --file - read the prompt from standard input: the same answer as -p
quiet        --quiet: stdout is the generated text and a newline, nothing else; the text is --json's
json         --json: one JSON object (text, tokens, finish reason, timings); --compare --json; bench --json
n_minus_one  -n -1: generation runs to the end of the text or a full context (exact token counts)
tokenize     tessera tokenize: ids as run prefills them (--chat, --no-special, --parse-special, --ids, --json, -f -)
did_you_mean unknown flags and subcommands: the nearest known name; llama.cpp's flags with tessera's equivalent
aliases      llama.cpp's names that mean the same (-c, --ctx-size, --temp, -s, --n-predict, --file,
             --system-prompt): the same output as tessera's own names
exit_codes   0 done, 1 failed while running, 2 a wrong command line (every class of CLI11 parse error included)
version      tessera --version is the CMake project's version

Needs the real SmolLM2-135M-Instruct (scripts/setup.sh models); exit 77 (skip) when it is missing and
TESSERA_ALLOW_MISSING_MODELS=1.
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = os.environ.get("TESSERA_MODELS", os.path.expanduser("~/.cache/tessera/models"))
SMOL = os.path.join(MODELS, "smollm2-135m-instruct-q4_1.gguf")
GEMMA = os.path.join(MODELS, "gemma-3-270m-q4_k_m.gguf")
TESSERA = ""


def run(*args, stdin=None, code=0):
    p = subprocess.run([TESSERA, *args], input=stdin, capture_output=True, text=True, timeout=600)
    if code is not None and p.returncode != code:
        raise AssertionError(f"tessera {' '.join(args)}: exit {p.returncode}, expected {code}\n"
                             f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return p


def run_json(*args, stdin=None):
    p = run(*args, "--json", stdin=stdin)
    lines = p.stdout.splitlines()
    assert len(lines) == 1, f"--json printed {len(lines)} lines: {p.stdout[:500]!r}"
    return json.loads(lines[0])


def eq(got, want, what=""):
    if got != want:
        raise AssertionError(f"{what}: got {got!r}, expected {want!r}")


PROMPT = "The capital of France is"


def case_stdin():
    want = run("run", "-m", SMOL, "-p", PROMPT, "-n", "8", "--quiet").stdout
    eq(run("run", "-m", SMOL, "-f", "-", "-n", "8", "--quiet", stdin=PROMPT).stdout, want, "-f -")
    eq(run("run", "-m", SMOL, "--file", "-", "-n", "8", "--quiet", stdin=PROMPT).stdout, want, "--file -")
    # The same bytes from a file.
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tessera-habits-{os.getpid()}.txt")
    open(path, "w").write(PROMPT)
    try:
        eq(run("run", "-m", SMOL, "-f", path, "-n", "8", "--quiet").stdout, want, "-f FILE")
    finally:
        os.unlink(path)
    # Empty standard input: a runtime error naming it.
    p = run("run", "-m", SMOL, "-f", "-", stdin="", code=1)
    eq(p.stderr.splitlines()[0], "tessera: error: standard input (-f -) is empty: nothing to run")


def case_quiet():
    q = run("run", "-m", SMOL, "-p", PROMPT, "-n", "8", "--quiet")
    j = run_json("run", "-m", SMOL, "-p", PROMPT, "-n", "8")
    eq(q.stdout, j["text"] + "\n", "--quiet stdout vs --json text")
    assert "Paris" in j["text"], j["text"]
    eq(q.stderr, "", "--quiet stderr")
    # The default output holds the same text after "answer: ".
    plain = run("run", "-m", SMOL, "-p", PROMPT, "-n", "8").stdout
    start = plain.index("answer: ") + len("answer: ")
    eq(plain[start:plain.index("\n[dense] prefill", start)], j["text"], "default answer")
    # -q is --quiet; --quiet with --json or --compare is a usage error.
    eq(run("run", "-m", SMOL, "-p", PROMPT, "-n", "8", "-q").stdout, q.stdout, "-q")
    p = run("run", "-m", SMOL, "-p", PROMPT, "--quiet", "--json", code=2)
    eq(p.stderr.splitlines()[0], "tessera: error: run: --quiet excludes --json")
    p = run("run", "-m", SMOL, "-p", PROMPT, "--quiet", "--compare", "--attn", "ashape", code=2)
    eq(p.stderr.splitlines()[0],
       "tessera: error: --quiet prints one answer: drop --compare (or use --json, which holds both)")


def case_json():
    j = run_json("run", "-m", SMOL, "-p", PROMPT, "-n", "6")
    eq(sorted(j), sorted(["model", "device", "prompt_tokens", "load_s", "attn", "text", "tokens", "generated_tokens",
                          "finish_reason", "timings"]), "keys")
    eq(j["attn"], "dense")
    eq(j["finish_reason"], "length")
    eq(j["generated_tokens"], 6)
    eq(len(j["tokens"]), 6)
    eq(j["device"], "cpu")
    tok = run_json("tokenize", "-m", SMOL, "-p", PROMPT)
    eq(j["prompt_tokens"], tok["count"], "prompt_tokens vs tokenize")
    # The generated ids decode to the text: tokenize of prompt+text starts with the prompt's ids.
    t = j["timings"]
    eq(sorted(t), sorted(["prefill_s", "prefill_tokens_per_s", "prefill_attention_s", "prefill_gemm_s", "decode_s",
                          "decode_tokens", "decode_tokens_per_s"]), "timings keys")
    assert t["prefill_s"] > 0 and t["prefill_tokens_per_s"] > 0, t
    eq(t["decode_tokens"], 5, "decode steps (the last sampled token is not decoded)")
    # --compare --json: both runs, the speedup, whether the answers agree.
    c = run_json("run", "-m", SMOL, "-p", PROMPT, "-n", "6", "--compare", "--attn", "ashape:sink=4,local=4")
    eq([r["attn"] for r in c["runs"]], ["dense", "ashape:sink=4,local=4"])
    eq(c["runs"][0]["text"], j["text"], "dense run of --compare")
    eq(c["answers_identical"], c["runs"][0]["text"] == c["runs"][1]["text"])
    assert c["prefill_speedup"] > 0, c
    # A prompt of several lines and quotes comes back intact in the JSON string.
    text = 'Say "yes"\nor no:'
    j2 = run_json("run", "-m", SMOL, "-f", "-", "-n", "2", stdin=text)
    eq(j2["prompt_tokens"], run_json("tokenize", "-m", SMOL, "-f", "-", stdin=text)["count"])
    # bench --json is --format json.
    b = run("bench", "-m", SMOL, "-d", "64", "--attn", "ashape:sink=4,local=16", "--decode", "2", "--json").stdout
    b2 = run("bench", "-m", SMOL, "-d", "64", "--attn", "ashape:sink=4,local=16", "--decode", "2", "--format",
             "json").stdout
    strip = lambda s: re.sub(r"[0-9.]+(e[-+][0-9]+)?", "N", s)  # timings differ run to run
    eq(strip(b), strip(b2), "bench --json vs --format json")
    json.loads(b)
    p = run("bench", "-m", SMOL, "--json", "--format", "csv", code=2)
    eq(p.stderr.splitlines()[0], "tessera: error: bench: --format excludes --json")


def case_n_minus_one():
    # The prompt takes 7 tokens of a 12-token context: the 6th sampled token fills it (the last one is never
    # decoded), whatever -n allowed.
    args = ["run", "-m", SMOL, "-p", "Count: one two three four five", "--max-context", "12"]
    j = run_json(*args, "-n", "-1")
    eq(j["prompt_tokens"], 7)
    eq(j["finish_reason"], "context")
    eq(j["generated_tokens"], 12 - 7 + 1)
    eq(j["text"], run_json(*args, "-n", "50")["text"], "-n -1 vs -n 50")
    # Without a context limit in reach it runs to the end-of-turn token.
    chat = ["run", "-m", SMOL, "-p", "Say hello.", "--chat"]
    j = run_json(*chat, "-n", "-1")
    eq(j["finish_reason"], "stop")
    eq(j["text"], run_json(*chat, "-n", str(j["generated_tokens"] + 10))["text"], "-n -1 vs a larger -n")
    p = run("run", "-m", SMOL, "-p", "x", "-n", "-2", code=2)
    eq(p.stderr.splitlines()[0], "tessera: error: -n/--max-tokens must be >= 0, or -1 (until the end of the text or "
                                 "a full context), got -2")


def case_tokenize():
    # SmolLM2's byte-level BPE: no BOS added; ChatML special tokens.
    j = run_json("tokenize", "-m", SMOL, "-p", "Hello world")
    eq(j, {"tokens": [19556, 905], "pieces": ["Hello", " world"], "count": 2})
    eq(run("tokenize", "-m", SMOL, "-p", "Hello world", "--ids").stdout, "[19556, 905]\n")
    eq(run("tokenize", "-m", SMOL, "-p", "Hello world").stdout, '19556\t"Hello"\n905\t" world"\n')
    eq(run("tokenize", "-m", SMOL, "-f", "-", "--ids", stdin="Hello world").stdout, "[19556, 905]\n", "-f -")
    # Special tokens in the text are text unless --parse-special.
    text = "<|im_start|>user"
    plain = run_json("tokenize", "-m", SMOL, "-p", text)["tokens"]
    special = run_json("tokenize", "-m", SMOL, "-p", text, "--parse-special")["tokens"]
    eq(special, [1, 4093], "--parse-special")
    assert len(plain) > 2 and 1 not in plain, plain
    # --chat: the ids run --chat prefills (the count run reports), starting with <|im_start|>.
    chat = run_json("tokenize", "-m", SMOL, "-p", "Hi", "--chat", "--system", "Be brief.")
    eq(chat["tokens"][0], 1)
    eq(chat["pieces"][:3], ["<|im_start|>", "system", "\n"])
    r = run_json("run", "-m", SMOL, "-p", "Hi", "--chat", "--system", "Be brief.", "-n", "1")
    eq(r["prompt_tokens"], chat["count"], "run --chat prompt_tokens")
    # A model with a BOS: Gemma-3 adds <bos> (id 2) unless --no-special.
    if os.path.exists(GEMMA):
        with_bos = run_json("tokenize", "-m", GEMMA, "-p", "Hello world")
        eq(with_bos["tokens"][0], 2)
        eq(with_bos["pieces"][0], "<bos>")
        eq(run_json("tokenize", "-m", GEMMA, "-p", "Hello world", "--no-special")["tokens"], with_bos["tokens"][1:],
           "--no-special drops the BOS only")
    p = run("tokenize", "-m", SMOL, code=2)
    eq(p.stderr.splitlines()[0], "tessera: error: no text: pass -p TEXT, -f FILE or -f - (standard input)")


def first_error(*args):
    p = run(*args, code=2)
    return p.stderr.splitlines()


def has_flag(sub, flag):
    return re.search(r"(^|[ ,])" + re.escape(flag) + r"\b", run(sub, "--help").stdout, re.M) is not None


def case_plan_recipes():
    # The recipes in `tessera plan --help`'s footer name only flags plan has, with values it accepts: each recipe,
    # given a model that does not exist, gets as far as opening the model (exit 1), not a usage error (exit 2).
    out = run("plan", "--help").stdout
    foot = out[out.index("Recipes that kept every dense answer"):]
    recipes, cur = [], None
    for line in foot.splitlines()[1:]:
        m = re.match(r"  (MoA|MInference|TriangleMix): +(.*)", line)
        if m:
            cur = m.group(2).split()
            recipes.append(cur)
        elif cur is not None and line.startswith("               "):
            cur += line.split()
        else:
            cur = None
    eq(len(recipes), 3, "three recipes")
    for r in recipes:
        for flag in (a for a in r if a.startswith("--")):
            eq(has_flag("plan", flag), True, flag)
        args = ["plan", *(a for a in r if a != "cuda" and a != "--device"), "-m", "/nonexistent/model.gguf",
                "-o", "/nonexistent/plan.json"]
        args = [a.replace("data.jsonl", os.path.join(ROOT, "docs", "plans", "calib-licences-2k-4k-both.jsonl"))
                for a in args]
        eq(run(*args, code=1).stderr.splitlines()[0],
           "tessera: error: /nonexistent/model.gguf: cannot open: No such file or directory", " ".join(r))


def case_did_you_mean():
    m = ["-m", SMOL, "-p", "hi"]
    err = first_error("run", *m, "-ngl", "99")
    eq(err, ["tessera: error: run: unknown flag -ngl (llama.cpp's --n-gpu-layers): tessera does not split a model's "
             "layers between devices: --device cuda runs every layer on the GPU, --device cpu none",
             "Run 'tessera run --help' for the flags."])
    # The report of the issue: -ngl with -n was "--max-tokens: At Most 1 required but received 2".
    eq(first_error("run", *m, "-n", "4", "-ngl", "99")[0], err[0])
    eq(first_error("run", *m, "--temprature", "0.5")[0],
       "tessera: error: run: unknown flag --temprature; did you mean --temperature?")
    eq(first_error("run", *m, "-temperature", "0.5")[0],
       "tessera: error: run: unknown flag -temperature; did you mean --temperature?")
    eq(first_error("run", *m, "--max-tok", "5")[0],
       "tessera: error: run: unknown flag --max-tok; did you mean --max-tokens?")
    eq(first_error("run", *m, "--frobnicate")[0],
       "tessera: error: run: unknown flag --frobnicate ('tessera run --help' lists the flags)")
    eq(first_error("run", *m, "-fa")[0],
       "tessera: error: run: unknown flag -fa (llama.cpp's --flash-attn): tessera's attention is always fused "
       "(flash-style); --attn picks the sparse pattern")
    threads = ("tessera's is --threads N" if has_flag("run", "--threads")
               else "tessera's thread count is the environment variable TESSERA_NUM_THREADS")
    if not has_flag("run", "-t"):
        eq(first_error("run", *m, "-t", "4")[0], "tessera: error: run: unknown flag -t (llama.cpp's --threads): " + threads)
    eq(first_error("bench", "-m", SMOL, "-p", "512")[0],
       "tessera: error: bench: unknown flag -p (llama.cpp's llama-bench's --n-prompt): tessera bench's prompt "
       "lengths are -d/--depths 512,4096")
    eq(first_error("rnu", *m), ["tessera: error: unknown subcommand 'rnu'; did you mean 'run'? (subcommands: run, "
                                "bench, eval, inspect, tokenize, plan, serve)", "Run 'tessera --help' for the flags."])
    # The program's own flags after the subcommand stay known; values that look like flags are values.
    run("run", *m, "-n", "1", "--quiet", "--memory-budget", "4G")
    run("run", "-m", SMOL, "-p", "-5 degrees", "-n", "1", "--quiet")
    run("run", "-m", SMOL, "-p", "--not-a-flag", "-n", "1", "--quiet")


def case_aliases():
    base = ["run", "-m", SMOL, "-p", PROMPT, "--temperature", "0.8", "--seed", "7", "-n", "5", "--max-context", "64"]
    want = run_json(*base)["text"]
    alias = ["run", "-m", SMOL, "-p", PROMPT, "--temp", "0.8", "-s", "7", "--n-predict", "5", "-c", "64"]
    eq(run_json(*alias)["text"], want, "--temp -s --n-predict -c")
    alias2 = ["run", "-m", SMOL, "-p", PROMPT, "--temp", "0.8", "--seed", "7", "-n", "5", "--ctx-size", "64"]
    eq(run_json(*alias2)["text"], want, "--ctx-size")
    # --system-prompt is --system.
    a = run_json("run", "-m", SMOL, "-p", "Hi", "--chat", "--system-prompt", "Be brief.", "-n", "3")
    b = run_json("run", "-m", SMOL, "-p", "Hi", "--chat", "--system", "Be brief.", "-n", "3")
    eq((a["prompt_tokens"], a["text"]), (b["prompt_tokens"], b["text"]), "--system-prompt")


def case_exit_codes():
    tiny = os.path.join(ROOT, "tests", "data", "hf_tiny", "llama3", "model.gguf")
    # 0: done, help, version.
    run("run", "-m", SMOL, "-p", "hi", "-n", "1", "--quiet", code=0)
    run("--help", code=0)
    run("run", "--help", code=0)
    run("--version", code=0)
    # 1: it ran and failed.
    eq(run("run", "-m", "/nonexistent/model.gguf", "-p", "hi", code=1).stderr.splitlines()[0],
       "tessera: error: /nonexistent/model.gguf: cannot open: No such file or directory")
    eq(run("run", "-m", tiny, "-f", "/nonexistent/prompt.txt", code=1).stderr.splitlines()[0],
       "tessera: error: /nonexistent/prompt.txt: prompt file not found")
    # 2: every class of wrong command line, CLI11's included (its own codes were 105-114).
    m = ["-m", tiny, "-p", "hi"]
    cases = {
        "no subcommand (RequiredError)": ([], "tessera: error: A subcommand is required"),
        "missing required flag (RequiredError)": (["run", "-p", "hi"], "tessera: error: run: --model is required"),
        "not a number (ConversionError)": (["run", *m, "-n", "abc"],
                                           "tessera: error: run: Could not convert: --max-tokens = abc"),
        "value not among the choices (ValidationError)": (
            ["run", *m, "--device", "gpu"],
            "tessera: error: run: --device: gpu not in {cpu,cuda,auto}"),
        "two flags that exclude each other (ExcludesError)": (["run", *m, "-f", "x.txt"],
                                                              "tessera: error: run: --prompt excludes --prompt-file"),
        "a stray argument (ExtrasError)": (["run", *m, "stray"],
                                           "tessera: error: run: The following argument was not expected: stray"),
        "a flag given twice (ArgumentMismatch)": (["run", *m, "-n", "1", "-n", "2"],
                                                  "tessera: error: run: --max-tokens: At Most 1 required but received 2"),
        "a flag without its value (ArgumentMismatch)": (["run", *m, "-n"],
                                                         "tessera: error: run: --max-tokens: 1 required INT missing"),
        "unknown flag": (["run", *m, "--nope"],
                         "tessera: error: run: unknown flag --nope ('tessera run --help' lists the flags)"),
        "unknown subcommand": (["nope"], None),
        "a value out of range (tessera's check)": (["run", *m, "--top-p", "1.5"],
                                                    "tessera: error: --top-p must be in (0, 1] (1 = off), got 1.5"),
        "a bad --attn spec": (["run", "-m", "/nonexistent.gguf", "-p", "hi", "--attn", "vss"], None),
        "--memory-budget that is no size": (["run", *m, "--memory-budget", "lots"],
                                            "tessera: error: --memory-budget: 'lots' is not a size (write e.g. 24G, "
                                            "512M, 1.5G or a number of bytes)"),
    }
    for what, (args, line) in cases.items():
        p = run(*args, code=None)
        if p.returncode != 2:
            raise AssertionError(f"{what}: exit {p.returncode}, expected 2; stderr {p.stderr!r}")
        first = p.stderr.splitlines()[0]
        assert first.startswith("tessera: error: "), (what, first)
        if line is not None:
            eq(first, line, what)


def case_version():
    cmake = open(os.path.join(ROOT, "CMakeLists.txt")).read()
    version = re.search(r"project\(tessera VERSION ([0-9.]+)", cmake).group(1)
    eq(run("--version").stdout, f"tessera {version}\n")


def main():
    global TESSERA
    TESSERA = os.path.abspath(sys.argv[1])
    case = sys.argv[2]
    if case not in ("version", "plan_recipes") and not os.path.exists(SMOL):
        if os.environ.get("TESSERA_ALLOW_MISSING_MODELS") == "1":
            print(f"skip: {SMOL} is missing")
            return 77
        print(f"FAIL: {SMOL} is missing (scripts/setup.sh models)")
        return 1
    globals()["case_" + case]()
    print(f"cli.{case}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
