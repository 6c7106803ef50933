"""`tessera serve --stream`: every request through streaming memory (docs/streaming.md), on the real SmolLM2-135M
(CPU; TESSERA_DEVICE=cuda: the GPU's batched engine, each sequence its own GpuStreamingKV), through OpenAI's official
Python client.

Sizes small enough that a ~150-token prompt evicts and retrieves blocks. Greedy answers must equal
`tessera run --stream` with the same sizes (the server adds no drift); the context the server states is what the
host budget holds (2 slots sharing 16 MiB: 8 MiB each, 11 blocks of 16 tokens over 30 layers, so 80 + 12 * 16 - 1 =
271 tokens); error answers have the API's status, param, code and our exact message.
"""
import subprocess
import threading

import openai

from harness import BIN, DEVICE, MODEL, MODEL_ID, Server, cli_answer, run, test

SIZES = ["--stream-sinks", "16", "--stream-local", "64", "--stream-block", "16", "--stream-top-k", "2",
         "--stream-chunk", "32", "--stream-last-chunk", "16"]
# The host budget of a slot (8 MiB) over one evicted block's K and V in every layer (16 tokens x 30 layers x 3 kv heads
# x 64 x 2): f32 on the CPU (11 blocks), bf16 in the GPU's pinned memory (22 blocks, TESSERA_DEVICE=cuda); the context
# is sinks + local + (blocks + 1) x 16 - 1.
BLOCKS = (8 << 20) // (16 * 30 * 3 * 64 * 2 * (4 if DEVICE == "cpu" else 2))
CONTEXT = 16 + 64 + (BLOCKS + 1) * 16 - 1
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12 + "How many times did the fox jump? Answer:"
QUESTION = "Name three colours of the rainbow. " * 6 + "Which colour comes first?"


def setup():
    s = Server("--stream", "ltri", *SIZES, "--stream-host-budget", "16M", "--parallel", "2")
    s.client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    return s


def expect_error(call, status, message, param, code):
    try:
        call()
    except openai.APIStatusError as e:
        assert e.status_code == status, (e.status_code, e.body)
        assert e.body["message"] == message, e.body
        assert e.body.get("param") == param and e.body.get("code") == code, e.body
        return
    raise AssertionError(f"expected {status}")


@test
def startup_line_and_context(s):
    assert any("streaming: ltri (sinks 16, local 64, chunk 32, blocks of 16, top 2; host budget 8.39 MB) per slot, "
               f"context {CONTEXT} tokens" in l for l in s.lines), s.lines[:3]
    assert s.client.models.retrieve(MODEL_ID).model_extra["context_length"] == CONTEXT


@test
def completion_equals_cli_stream(s):
    want, prompt_tokens = cli_answer("-p", PROMPT, "-n", "12", "--stream", "ltri", *SIZES,
                                     "--stream-host-budget", "8M")
    assert prompt_tokens > 96  # past sinks + local + one block: blocks were evicted
    r = s.client.completions.create(model=MODEL_ID, prompt=PROMPT, temperature=0, max_tokens=12)
    assert r.choices[0].text == want, (r.choices[0].text, want)
    assert r.usage.prompt_tokens == prompt_tokens
    # The same through server-sent events.
    got = "".join(c.choices[0].text for c in
                  s.client.completions.create(model=MODEL_ID, prompt=PROMPT, temperature=0, max_tokens=12, stream=True))
    assert got == want, (got, want)
    assert s.saw(lambda l: "POST /v1/completions 200" in l and "attn=stream:ltri" in l)


@test
def chat_equals_cli_and_two_at_once(s):
    want, _ = cli_answer("--chat", "-p", QUESTION, "-n", "10", "--stream", "ltri", *SIZES,
                         "--stream-host-budget", "8M")
    answers = [None, None]

    def ask(i):
        r = s.client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": QUESTION}],
                                             temperature=0, max_tokens=10)
        answers[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert answers == [want, want], (answers, want)
    h = s.wait_idle()
    assert h["kv_cache_bytes"] == 0  # each request's streaming memory went with it


@test
def errors(s):
    long_prompt = "word " * (CONTEXT + 100)
    try:
        s.client.completions.create(model=MODEL_ID, prompt=long_prompt, max_tokens=1)
        raise AssertionError("a prompt over the streaming context was accepted")
    except openai.BadRequestError as e:
        assert e.body["code"] == "context_length_exceeded", e.body
        assert e.body["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens."), e.body
    expect_error(lambda: s.client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=1,
                                                     extra_body={"tessera": {"attn": "vs"}}),
                 400, "'tessera.attn' is 'vs': this server streams every request (--stream ltri), which attends "
                      "densely within its own layout; drop 'tessera.attn'", "tessera.attn", None)


@test
def startup_errors(s):
    def fails(*args):
        p = subprocess.run([BIN, "serve", "-m", MODEL, "--device", "cpu", "--port", "0", *args], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)  # a wrong command line (docs/cli.md)
        return p.stderr.strip()

    assert fails("--stream", "ltri", "--attn", "vs") == (
        "tessera: error: --stream cannot be combined with --attn vs: streaming memory attends densely within its own "
        "layout (docs/streaming.md)")
    assert fails("--stream", "infllm", "--stream-chunk", "0") == "tessera: error: --stream-chunk must be positive, got 0"


if __name__ == "__main__":
    run(setup, lambda s: s.stop())
