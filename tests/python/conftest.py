"""Shared fixtures of the Python tests (run by scripts/test.sh: pytest tests/python with PYTHONPATH=build/ci/python).

Environment: TESSERA_MODELS (default ~/.cache/tessera/models, filled by scripts/fetch_models.sh), TESSERA_CLI (the
`tessera` program the engine is compared with; default build/ci/src/tessera), TESSERA_ALLOW_MISSING_MODELS=1 to
skip rather than fail the tests that need the real models or the CLI (as the C++ tests do).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = Path(os.environ.get("TESSERA_MODELS", Path.home() / ".cache" / "tessera" / "models"))
SMOLLM2 = MODELS / "smollm2-135m-instruct-q4_1.gguf"
CLI = Path(os.environ.get("TESSERA_CLI", ROOT / "build" / "ci" / "src" / "tessera"))


def _need(path: Path, what: str) -> None:
    if path.exists():
        return
    msg = f"{what} not found at {path}"
    if os.environ.get("TESSERA_ALLOW_MISSING_MODELS") == "1":
        pytest.skip(msg)
    pytest.fail(msg + " (scripts/fetch_models.sh fetches the models; TESSERA_ALLOW_MISSING_MODELS=1 skips)")


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    _need(SMOLLM2, "SmolLM2-135M-Instruct")
    return SMOLLM2


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    import tessera

    return tessera.Model.load(str(smollm2_path))


@pytest.fixture(scope="session")
def cli() -> Path:
    _need(CLI, "the tessera CLI")
    return CLI


def run_cli(cli: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(cli), *args], capture_output=True, text=True, timeout=600)


def byte_level_tokenizer_json() -> dict:
    """A byte-level BPE tokenizer.json with the 256 byte tokens and no merges (ids 0-255 = bytes), for the tiny
    fixtures of tests/data/hf_tiny, which ship no tokenizer (their vocabulary is 256)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    vocab = {chr(c): b for b, c in zip(bs, cs)}
    return {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "vocab": vocab, "merges": []},
    }


@pytest.fixture()
def tiny_llama_dir(tmp_path) -> Path:
    """tests/data/hf_tiny/llama3 (config.json + model.safetensors, random weights) with a byte-level tokenizer."""
    import json

    src = ROOT / "tests" / "data" / "hf_tiny" / "llama3"
    for name in ("config.json", "model.safetensors"):
        (tmp_path / name).symlink_to(src / name)
    (tmp_path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    return tmp_path
