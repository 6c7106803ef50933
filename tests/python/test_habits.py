"""The package's habits (docs/python.md): generate(stop=...) with the server's stop-sequence semantics,
max_tokens=-1, tessera.__version__ (the CMake project's), and a namespace without typing names."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import tessera
from conftest import ROOT, run_cli

PROMPT = "The three primary colours are"


def cmake_version() -> str:
    return re.search(r"project\(tessera VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text()).group(1)


def test_version_is_the_cmake_project_version():
    assert tessera.__version__ == cmake_version()
    assert tessera._tessera.__version__ == tessera.__version__


def test_version_equals_the_cli(cli):
    r = run_cli(cli, "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"tessera {tessera.__version__}\n"


def test_pyproject_reads_the_version_from_cmake():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in text
    assert not re.search(r'^version\s*=', text, re.M), "a second version in pyproject.toml"
    regex = re.search(r"^regex = '(.*)'$", text, re.M).group(1)
    assert re.search(regex, (ROOT / "CMakeLists.txt").read_text()).group("value") == tessera.__version__


def test_dir_holds_the_api_only():
    names = dir(tessera)
    for leaked in ("Mapping", "Sequence", "Union", "annotations", "Message", "Prompt"):
        assert leaked not in names
    public = [n for n in names if not n.startswith("_")]
    assert public == sorted(tessera.__all__)
    assert "__version__" in names
    for n in public:  # every listed name resolves (ops and hf import torch: only checked when it is installed)
        if n in ("ops", "hf"):
            continue
        getattr(tessera, n)


def test_stop_returns_the_text_before_the_first_stop_sequence(smollm2):
    engine = tessera.Engine(smollm2)
    whole = engine.generate(PROMPT, max_tokens=24)
    # A stop sequence from the middle of the answer, across token boundaries.
    stop = whole[len(whole) // 2: len(whole) // 2 + 5]
    assert len(stop) == 5 and stop in whole
    want = whole[: whole.index(stop)]
    assert engine.generate(PROMPT, max_tokens=24, stop=[stop]) == want
    assert engine.generate(PROMPT, max_tokens=24, stop=stop) == want  # a str is one sequence
    # Streamed: the same text, finish_reason "stop", and no piece ever held part of the stop sequence.
    gen = engine.generate(PROMPT, max_tokens=24, stop=[stop], stream=True)
    pieces = list(gen)
    assert "".join(pieces) == want
    assert gen.finish_reason == "stop"
    assert 0 < len(gen.tokens) < 24
    # The tokens sampled up to and including the stop sequence: their text holds it.
    assert stop in smollm2.detokenize(gen.tokens, skip_special=True)


def test_stop_the_earliest_of_several_wins_and_absent_ones_change_nothing(smollm2):
    engine = tessera.Engine(smollm2)
    whole = engine.generate(PROMPT, max_tokens=24)
    late, early = whole[-4:], whole[3:6]
    assert whole.index(early) < whole.index(late)
    assert engine.generate(PROMPT, max_tokens=24, stop=[late, early]) == whole[: whole.index(early)]
    gen = engine.generate(PROMPT, max_tokens=24, stop=["\u2603 never \u2603"], stream=True)
    assert "".join(gen) == whole
    assert gen.finish_reason == "length"
    # A stop sequence at the very start: nothing is returned.
    assert engine.generate(PROMPT, max_tokens=24, stop=[whole[:3]]) == ""


def test_stop_equals_the_server_matcher_on_a_chat(smollm2):
    # The server's StopMatcher (server/stop_matcher.cpp) is the one generate() runs: as OpenAI's API, the first
    # occurrence of any stop sequence in the whole text ends it, even one that ends inside a later token.
    engine = tessera.Engine(smollm2)
    messages = [{"role": "user", "content": "List three fruits, one per line."}]
    whole = engine.generate(messages, max_tokens=32)
    assert "\n" in whole, whole
    assert engine.generate(messages, max_tokens=32, stop="\n") == whole[: whole.index("\n")]


def test_stop_bad_values(smollm2):
    engine = tessera.Engine(smollm2)
    with pytest.raises(tessera.Error, match="generate: stop sequences must not be empty"):
        engine.generate(PROMPT, max_tokens=4, stop=[""])
    with pytest.raises(TypeError, match="stop must be a string or a list of strings"):
        engine.generate(PROMPT, max_tokens=4, stop=[3])


def test_max_tokens_minus_one_runs_to_a_full_context(smollm2, smollm2_path, cli):
    prompt = "Count: one two three four five"
    engine = tessera.Engine(smollm2, max_context=12)
    gen = engine.generate(prompt, max_tokens=-1, stream=True)
    text = "".join(gen)
    assert gen.finish_reason == "context"
    assert gen.prompt_tokens == 7 and len(gen.tokens) == 12 - 7 + 1
    r = run_cli(cli, "run", "-m", str(smollm2_path), "-p", prompt, "--max-context", "12", "-n", "-1", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert (j["text"], j["tokens"], j["finish_reason"]) == (text, gen.tokens, "context")
    with pytest.raises(tessera.Error, match=r"generate: max_tokens must be >= 0, or -1"):
        engine.generate(prompt, max_tokens=-2)
