# shellcheck shell=bash
# scripts/gpu/phases_structured.sh — structured output on the GPU engines (a phase of run.sh; issue 34):
# tests/server/test_structured.py (OpenAI's client: response_format json_object / json_schema, tools with
# tool_choice required / named / auto, streaming, bad schemas) against `serve --device cuda` with --parallel 1 (the
# GPU single-sequence engine) and --parallel 2 (the batched GPU engine: a constrained row's grammar mask goes to the
# device as -inf logit edits, runtime/sampling.h). STRUCTURED_MODEL: a file under build/models (default SmolLM2).
# OpenAI's client: the image's python3 if it has it, else the wheels carried in build/py-wheels (phase_prefix says
# how to make them).
#   bash scripts/gpu/run.sh structured            (carry ["build/gpu-debs"] and, without openai there, "build/py-wheels")
phase_structured() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${STRUCTURED_MODEL:-smollm2-135m-instruct-q4_1.gguf} py=python3
  [ -f "$m" ] || { say "structured: no $m (carry it: run.sh parts)"; return 1; }
  if ! python3 -c "import openai" 2> /dev/null; then
    [ -d "$ROOT/build/py-wheels" ] || { say "structured: python3 has no openai and build/py-wheels was not carried"; return 1; }
    if [ ! -x "$WORK/pyenv/bin/python" ]; then
      step structured_pyenv 120 bash -c "python3 -m venv '$WORK/pyenv' && '$WORK/pyenv/bin/pip' install -q --no-index \
        --find-links '$ROOT/build/py-wheels' openai==3.51.0" || return 1
    fi
    py=$WORK/pyenv/bin/python
  fi
  STEP_TAIL=12 TESSERA_BIN=$(bin tessera) TESSERA_MODEL=$m TESSERA_DEVICE=cuda \
    step structured 600 "$py" "$ROOT/tests/server/test_structured.py"
}
