# shellcheck shell=bash
# scripts/gpu/phases_openai.sh — OpenAI's official client against `tessera serve --device cuda` (a phase of run.sh;
# issue 34): the CPU suite's client scripts on the GPU engines, on the real model. OPENAI_TESTS (default
# "test_sampling test_openai_api"): scripts in tests/server, each run with TESSERA_DEVICE=cuda (their harness starts
# every server, and the `tessera run` references they compare with, on the GPU):
#   test_sampling    presence / frequency / repetition penalties, min_p, logit_bias (each equal to `tessera run` with
#                    the same flags), logprobs / top_logprobs on chat and completions (streamed and not), echo with
#                    the prompt's log-probabilities, n > 1; --parallel 1 (single-sequence engine) and 2 (batched)
#   test_openai_api  chat and completions, streaming, stop, seeds, usage, every error class, /tokenize
#   test_stream      the batched engine with streamed (bounded) KV
# OPENAI_MODEL: a file under build/models (default SmolLM2, which the scripts' expected answers are for). OpenAI's
# client: the image's python3 if it has it, else the wheels carried in build/py-wheels (phase_prefix says how).
#   bash scripts/gpu/run.sh openai       (carry ["build/gpu-debs", "build/py-wheels"] and the model's parts)
phase_openai() {
  need tessera || return 1
  models
  local m=$ROOT/build/models/${OPENAI_MODEL:-smollm2-135m-instruct-q4_1.gguf} py=python3 t failed=0
  [ -f "$m" ] || { say "openai: no $m (carry it: run.sh parts)"; return 1; }
  if ! python3 -c "import openai" 2> /dev/null; then
    [ -d "$ROOT/build/py-wheels" ] || { say "openai: python3 has no openai and build/py-wheels was not carried"; return 1; }
    if [ ! -x "$WORK/pyenv/bin/python" ]; then
      step openai_pyenv 120 bash -c "python3 -m venv '$WORK/pyenv' && '$WORK/pyenv/bin/pip' install -q --no-index \
        --find-links '$ROOT/build/py-wheels' openai==3.51.0" || return 1
    fi
    py=$WORK/pyenv/bin/python
  fi
  for t in ${OPENAI_TESTS:-test_sampling test_openai_api}; do
    [ -f "$ROOT/tests/server/$t.py" ] || { say "openai: no tests/server/$t.py"; failed=1; continue; }
    STEP_TAIL=12 TESSERA_BIN=$(bin tessera) TESSERA_MODEL=$m TESSERA_DEVICE=cuda \
      step "openai_$t" 300 "$py" "$ROOT/tests/server/$t.py" || failed=1
  done
  return $failed
}
