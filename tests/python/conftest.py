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
