#!/usr/bin/env python3
"""Makes tests/data/sampling/hf_processors.json: what Hugging Face transformers' logits processors compute, for
tests/runtime_sampling_test.cpp to compare tessera's sampler with (issue 34).

Two parts:
  "cases":  random logits over a 64-token vocabulary, a prompt and generated tokens, and options; for each, the
            logits after logit_bias + repetition / presence / frequency penalties ("edited") and the distribution
            after temperature, top_k, top_p and min_p ("probs": softmax of the processed scores, 0 where cut).
  "greedy": greedy generation (do_sample=False) on the tiny llama3 fixture model (tests/data/hf_tiny/llama3) with
            penalties and a bias, 24 new tokens, no end token: the ids transformers' generate() gives.

The processors are transformers' own, in the order its generate() builds them (generation/utils.py,
_get_logits_processor): SequenceBiasLogitsProcessor (logit_bias: one-token sequences), RepetitionPenaltyLogits-
Processor (over prompt + generated), then presence / frequency penalties over the generated tokens — transformers
has no processor for those, so this script applies OpenAI's formula (logit - count * frequency - presence), which
custom processors passed to generate() would also do at this place (after the built-in processors, before the
warpers) — then TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper.

Run from the repository root with the environment that has torch and transformers (~/.cache/tessera/pyenv):
  ~/.cache/tessera/pyenv/bin/python scripts/make_sampling_fixtures.py
"""
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (LogitsProcessor, LogitsProcessorList, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "sampling", "hf_processors.json")


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's presence / frequency penalties over the tokens generated after the prompt."""

    def __init__(self, prompt_len, presence, frequency):
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        out = scores.clone()
        for b in range(input_ids.shape[0]):
            gen = input_ids[b, self.prompt_len:]
            if gen.numel() == 0:
                continue
            counts = torch.bincount(gen, minlength=scores.shape[-1]).to(scores.dtype)
            seen = counts > 0
            out[b] = torch.where(seen, out[b] - counts * self.frequency, out[b])
            out[b] = torch.where(seen, out[b] - self.presence, out[b])
        return out


def edit_processors(o, prompt_len):
    ps = []
    if o.get("logit_bias"):
        ps.append(SequenceBiasLogitsProcessor(sequence_bias=[[[int(t)], float(b)] for t, b in o["logit_bias"]]))
    if o.get("repetition_penalty", 1.0) != 1.0:
        ps.append(RepetitionPenaltyLogitsProcessor(penalty=float(o["repetition_penalty"])))
    if o.get("presence_penalty", 0.0) != 0.0 or o.get("frequency_penalty", 0.0) != 0.0:
        ps.append(PresenceFrequencyPenalty(prompt_len, float(o.get("presence_penalty", 0.0)),
                                           float(o.get("frequency_penalty", 0.0))))
    return ps


def warpers(o):
    ps = []
    if o["temperature"] != 1.0:
        ps.append(TemperatureLogitsWarper(float(o["temperature"])))
    if o.get("top_k", 0) != 0:
        ps.append(TopKLogitsWarper(top_k=int(o["top_k"])))
    if o.get("top_p", 1.0) < 1.0:
        ps.append(TopPLogitsWarper(top_p=float(o["top_p"])))
    if o.get("min_p", 0.0) > 0.0:
        ps.append(MinPLogitsWarper(min_p=float(o["min_p"])))
    return ps


def cases():
    g = torch.Generator().manual_seed(34)
    vocab = 64
    options = [
        {"temperature": 1.0, "repetition_penalty": 1.3},
        {"temperature": 1.0, "repetition_penalty": 0.7},
        {"temperature": 0.8, "presence_penalty": 0.5, "frequency_penalty": 0.25},
        {"temperature": 1.0, "presence_penalty": -1.0, "frequency_penalty": -0.5},
        {"temperature": 1.0, "logit_bias": [[3, 5.0], [17, -100.0], [40, 2.5]]},
        {"temperature": 1.0, "min_p": 0.1},
        {"temperature": 0.7, "min_p": 0.05},
        {"temperature": 1.5, "min_p": 0.2, "top_k": 20},
        {"temperature": 1.2, "min_p": 0.02, "top_p": 0.9},
        {"temperature": 0.9, "top_k": 10, "top_p": 0.8, "min_p": 0.1, "repetition_penalty": 1.2,
         "presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": [[5, 1.0], [9, -2.0]]},
    ]
    out = []
    for o in options:
        logits = (torch.randn(vocab, generator=g) * 2.5).to(torch.float32)
        prompt = torch.randint(0, vocab, (12,), generator=g).tolist()
        generated = torch.randint(0, vocab, (8,), generator=g).tolist()
        ids = torch.tensor([prompt + generated])
        scores = logits[None, :].clone()
        for p in edit_processors(o, len(prompt)):
            scores = p(ids, scores)
        edited = scores[0].clone()
        for p in warpers(o):
            scores = p(ids, scores)
        probs = torch.softmax(scores.to(torch.float64), dim=-1)[0]
        out.append({"options": o, "logits": logits.tolist(), "prompt": prompt, "generated": generated,
                    "edited": edited.tolist(), "probs": probs.tolist(), "greedy": int(torch.argmax(edited))})
    return out


def greedy():
    path = os.path.join(ROOT, "tests", "data", "hf_tiny", "llama3")
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    prompt = [1, 239, 72, 223, 10, 58, 209, 185, 254, 145]
    runs = [
        {},
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 1.3, "logit_bias": [[72, -3.0], [100, 4.0]]},
        {"presence_penalty": 1.0, "frequency_penalty": 0.5},
        {"repetition_penalty": 1.2, "presence_penalty": 0.4, "frequency_penalty": 0.3, "logit_bias": [[7, 2.0]]},
    ]
    out = []
    for o in runs:
        procs = LogitsProcessorList(edit_processors(dict(o, temperature=1.0), len(prompt)))
        with torch.no_grad():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                 logits_processor=procs, eos_token_id=None, pad_token_id=0)
        out.append({"options": o, "prompt": prompt, "tokens": ids[0, len(prompt):].tolist()})
    return out


def main():
    data = {"made_by": "scripts/make_sampling_fixtures.py", "transformers": transformers.__version__,
            "torch": torch.__version__, "cases": cases(), "greedy": greedy()}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(data, f)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
