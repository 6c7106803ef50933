"""generate() and generate_batch() with the penalties, min_p and logit_bias (issue 34): the text `tessera run` gives
with the same flags (whose sampler tests/runtime_sampling_test.cpp checks against transformers' processors)."""

from __future__ import annotations

import pytest

import tessera
from conftest import run_cli

POEM = "Write a poem about rain."
COLORS = "Name three colors."


def cli_answer(stdout: str) -> str:
    start = stdout.index("answer: ") + len("answer: ")
    return stdout[start:stdout.index("\n[dense] prefill", start)]


def test_penalties_equal_cli(smollm2, smollm2_path, cli):
    engine = tessera.Engine(smollm2)
    r = run_cli(cli, "run", "-m", str(smollm2_path), "--chat", "-p", POEM, "-n", "40", "--repeat-penalty", "1.3",
                "--frequency-penalty", "1")
    assert r.returncode == 0, r.stderr
    text = engine.generate(POEM, chat=True, max_tokens=40, repetition_penalty=1.3, frequency_penalty=1.0)
    assert text == cli_answer(r.stdout)
    assert text != engine.generate(POEM, chat=True, max_tokens=40)
    r = run_cli(cli, "run", "-m", str(smollm2_path), "--chat", "-p", POEM, "-n", "24", "--temperature", "1.2",
                "--min-p", "0.1", "--presence-penalty", "0.5", "--seed", "7")
    assert r.returncode == 0, r.stderr
    assert engine.generate(POEM, chat=True, max_tokens=24, temperature=1.2, min_p=0.1, presence_penalty=0.5,
                           seed=7) == cli_answer(r.stdout)


def test_generate_batch_applies_them_too(smollm2):
    engine = tessera.Engine(smollm2)
    kw = dict(chat=True, max_tokens=30, repetition_penalty=1.3, frequency_penalty=1.0)
    assert engine.generate_batch([COLORS, COLORS], **kw) == [engine.generate(COLORS, **kw)] * 2


def test_logit_bias(smollm2):
    engine = tessera.Engine(smollm2)
    paris = smollm2.tokenize(" Paris")
    assert len(paris) == 1
    assert engine.generate("The capital of France is", max_tokens=3, logit_bias={paris[0]: 100}) == " Paris Paris Paris"
    assert not engine.generate("The capital of France is", max_tokens=3,
                               logit_bias={str(paris[0]): -100}).startswith(" Paris")


@pytest.mark.parametrize("kw, message", [
    (dict(min_p=1.5), "min_p must be in [0, 1] (0 = off), got 1.5"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a number > 0 (1 = off), got 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number (0 = off), got nan"),
    (dict(logit_bias={-1: 1.0}), "logit_bias: token id -1 is negative"),
    (dict(logit_bias={49152: 1.0}), "logit_bias: token id 49152 is outside the vocabulary of 49152 tokens"),
])
def test_bad_values(smollm2, kw, message):
    engine = tessera.Engine(smollm2)
    with pytest.raises(tessera.Error) as e:
        engine.generate("x", max_tokens=1, **kw)
    assert str(e.value) == message
    with pytest.raises(tessera.Error) as e:
        engine.generate_batch(["x"], max_tokens=1, **kw)
    assert str(e.value) == message
