#!/usr/bin/env python3
"""Makes the tiny reference models of tests/data/hf_tiny and their expected logits.

Each fixture is a random-weight model of one architecture, small enough to commit (f32, well under 1 MB), saved
the way the Hugging Face hub ships models (config.json + model.safetensors), together with the logits that
Hugging Face `transformers` computes for a fixed token sequence. Some fixtures also get a GGUF file written the way
llama.cpp's convert_hf_to_gguf.py writes that architecture (tensor names, metadata keys, the Q/K row permutation
of the llama architecture, Gemma's norm weights stored with the +1 folded in, llama3 rope factors as a
rope_freqs tensor), so tests can check that both formats of one model give the same logits.

Layout of tests/data/hf_tiny/<name>/:
  config.json, model.safetensors   the model, as on the hub
  model.gguf                       (some fixtures) the same model in GGUF, f32
  model-q8_0.gguf                  (some fixtures) the same with every 2-D weight but the embedding in Q8_0
  expected.json                    {"tokens": [...], "vocab_size": V, "logits": "<file>", ...}
  logits.f32                       raw little-endian float32 [len(tokens), V]: every position's logits
  logits-q8_0.f32                  the same for model-q8_0.gguf (transformers run on the dequantized weights)

Run from the repository root:  python3 scripts/make_hf_fixtures.py
Needs: torch (the CPU part of PyPI's wheel suffices), transformers >= 5, safetensors, gguf, numpy.
The output is deterministic for a given torch/transformers version up to float rounding.

Real models: python3 scripts/make_hf_fixtures.py --real ~/.cache/tessera/models/<model>.gguf [...] runs the GGUFs
that scripts/fetch_models.sh fetches through transformers' own GGUF loader (which dequantizes with gguf-py; needs
accelerate) and writes tests/data/hf_tiny/real/<model>.json: the token ids of a fixed text, and at a few positions
the 16 largest logits and the logits of 48 fixed probe ids (the full rows would be megabytes). The text is long
enough for Gemma-3's 512-token sliding window to matter. It also writes real/<model>-greedy.json: for 3 short
prompts (plain text, a chat turn in the model's chat template, a code start) the prompt ids and the 32 tokens
that greedy generation (no stop token) produces, with the reference's top-2 logits at each step.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "hf_tiny"
SEQ_LEN = 40


# ---------------------------------------------------------------------------------------------------------------
# Configs. Most are written in the "v4" style that the hub's files use (rope_theta / rope_scaling /
# rope_local_base_freq); the ones marked save_pretrained are re-saved by transformers itself in its current style
# (rope_parameters), so both styles of config.json are covered.
# ---------------------------------------------------------------------------------------------------------------

FIXTURES: list[dict] = [
    {
        # Llama-3.1 style: GQA, untied LM head, llama3 RoPE scaling with all three frequency bands present.
        "name": "llama3",
        "gguf": True,
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32",
        },
    },
    {
        # SmolLM2 style: tied embeddings; Llama-2 style linear RoPE scaling; head_dim 16 with 4 heads, 1 KV head.
        "name": "smollm2",
        "gguf": True,
        "q8_0": True,
        "config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 192,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "hidden_act": "silu",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "tie_word_embeddings": True,
            "bos_token_id": 0,
            "eos_token_id": 0,
            "torch_dtype": "float32",
        },
    },
    {
        # Mistral v0.1 style: a model-level sliding window (row-exact, smaller than the sequence).
        "name": "mistral",
        "save_pretrained": True,
        "config": {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "vocab_size": 160,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "hidden_act": "silu",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "sliding_window": 12,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
    },
    {
        # Qwen2: biases on q/k/v (not on o), NeoX-style RoPE in GGUF (no permutation).
        "name": "qwen2",
        "gguf": True,
        "config": {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": 224,
            "hidden_size": 64,
            "intermediate_size": 160,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 256,
            "max_window_layers": 2,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        },
    },
    {
        # Gemma-3 text, as gemma-3-270m's config.json: 6 layers so that the default pattern (every 6th layer global)
        # mixes 5 local layers (window 8 < sequence) with a global one; per-layer RoPE bases; QK-norm; GeGLU;
        # (1 + w) norms; tied embeddings. query_pre_attn_scalar = head_dim (what llama.cpp assumes), so the GGUF
        # matches too.
        "name": "gemma3",
        "gguf": True,
        "config": {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": 256,
            "hidden_size": 48,
            "intermediate_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": None,
            "sliding_window": 8,
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "attention_bias": False,
            "tie_word_embeddings": True,
            "bos_token_id": 2,
            "eos_token_id": 1,
            "pad_token_id": 0,
            "torch_dtype": "float32",
        },
    },
    {
        # Gemma-3 with explicit layer_types, query_pre_attn_scalar != head_dim, linear RoPE scaling on the global
        # layers only, final logit soft-capping; config re-saved by transformers (rope_parameters per layer type).
        "name": "gemma3_scaled",
        "save_pretrained": True,
        "config": {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": 200,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
            "sliding_window": 6,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 5.0,
            "attention_bias": False,
            "tie_word_embeddings": True,
            "torch_dtype": "float32",
        },
    },
]


def randomize(model: torch.nn.Module, gemma: bool, tied: bool, seed: int) -> None:
    """Random weights of a scale that makes logits O(1) (transformers' init gives near-zero logits, which would
    make a 1e-4 comparison meaningless). Norm weights are random too, so that a wrong norm convention shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                base = 0.0 if gemma else 1.0  # Gemma's RMSNorm multiplies by (1 + w)
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                # Gemma scales embeddings by sqrt(hidden); a tied embedding is also the LM head.
                std = 1.0 / math.sqrt(p.shape[1]) if gemma else (0.3 if tied else 1.0)
                p.copy_(std * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / math.sqrt(fan_in)))


def tokens_for(vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randint(0, vocab, (SEQ_LEN,), generator=g).tolist()


def all_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False)
    return out.logits[0].to(torch.float32).numpy()


# ---------------------------------------------------------------------------------------------------------------
# GGUF, the way llama.cpp's convert_hf_to_gguf.py writes these architectures.
# ---------------------------------------------------------------------------------------------------------------

def permute_llama(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: within each head, HF's rotate_half row order [x_0..x_{d/2-1}, y_0..]
    becomes interleaved pairs [x_0, y_0, x_1, y_1, ...]; GGUF's llama rope rotates adjacent pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict, head_dim: int) -> np.ndarray:
    rs = cfg["rope_scaling"]
    base = cfg.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor = rs.get("factor", 8.0)
    low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str, arch: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    assert parts[0] == "model" and parts[1] == "layers", hf
    bid, rest, suffix = parts[2], ".".join(parts[3:-1]), parts[-1]
    if rest == "post_attention_layernorm":
        # Llama's post_attention_layernorm is the FFN's pre-norm; Gemma's is a real post-attention norm.
        base = "post_attention_norm" if arch == "gemma3" else "ffn_norm"
    elif rest == "pre_feedforward_layernorm":
        base = "ffn_norm"
    elif rest == "post_feedforward_layernorm":
        base = "post_ffw_norm"
    else:
        base = HF_TO_GGUF[rest]
    return f"blk.{bid}.{base}.{suffix}"


def write_gguf(path: Path, fx: dict, state: dict[str, torch.Tensor], quant: gguf.GGMLQuantizationType | None) -> None:
    cfg = fx["config"]
    arch = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}[cfg["model_type"]]
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // n_head)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{fx['name']}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant is None else gguf.LlamaFileType.MOSTLY_Q8_0)
    if arch == "gemma3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_freq_base(cfg["rope_theta"])
        w.add_sliding_window(cfg["sliding_window"])
    else:
        w.add_rope_freq_base(cfg["rope_theta"])
        w.add_rope_dimension_count(head_dim)
        rs = cfg.get("rope_scaling") or {}
        if rs.get("rope_type", rs.get("type")) == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rs["factor"])
    if arch == "llama" and (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg, head_dim))
    for hf, t in state.items():
        name = gguf_name(hf, arch)
        a = t.detach().to(torch.float32).numpy().copy()
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            a = permute_llama(a, n_head if ".q_proj." in hf else n_kv)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp stores Gemma's (1 + w)
        if quant is not None and a.ndim == 2 and name != "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(a, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_0_roundtrip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a Q8_0 GGUF holds (every 2-D weight but the embedding), dequantized by gguf-py."""
    out = {}
    for name, t in state.items():
        a = t.detach().numpy()
        if a.ndim == 2 and name != "model.embed_tokens.weight":
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            a = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(a.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return out


def make(fx: dict, seed: int) -> None:
    d = OUT / fx["name"]
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(fx["config"], indent=2) + "\n")
    config = AutoConfig.from_pretrained(d)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gemma = fx["config"]["model_type"].startswith("gemma")
    randomize(model, gemma, bool(fx["config"].get("tie_word_embeddings")), seed)

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if fx["config"].get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    if fx.get("save_pretrained"):
        model.save_pretrained(d, safe_serialization=True)
        for extra in ("generation_config.json",):
            (d / extra).unlink(missing_ok=True)
    else:
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})

    tokens = tokens_for(fx["config"]["vocab_size"], seed)
    logits = all_logits(model, tokens)
    logits.astype("<f4").tofile(d / "logits.f32")
    expected = {
        "tokens": tokens,
        "vocab_size": int(logits.shape[1]),
        "logits": "logits.f32",
        "made_by": "scripts/make_hf_fixtures.py",
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
    }
    if fx.get("gguf"):
        write_gguf(d / "model.gguf", fx, state, None)
        expected["gguf"] = "model.gguf"
    if fx.get("q8_0"):
        q_state = q8_0_roundtrip(state)
        write_gguf(d / "model-q8_0.gguf", fx, state, gguf.GGMLQuantizationType.Q8_0)
        model.load_state_dict(q_state, strict=False)
        if fx["config"].get("tie_word_embeddings"):
            model.tie_weights()
        all_logits(model, tokens).astype("<f4").tofile(d / "logits-q8_0.f32")
        expected["gguf_q8_0"] = "model-q8_0.gguf"
        expected["logits_q8_0"] = "logits-q8_0.f32"
    (d / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{fx['name']}: {size / 1024:.0f} KiB, logits range [{logits.min():.2f}, {logits.max():.2f}]")


REAL_TEXT = (
    "The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away, there lived a miller "
    "who had three sons. When he died, the eldest took the mill, the second the donkey, and the youngest was left "
    "with nothing but a cat. Numbers 0 1 2 3 4 5 6 7 8 9 10, and some code: for (int i = 0; i < n; ++i) sum += i; "
)


def make_real(path: Path, length: int = 600, probes: int = 48, top: int = 16) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids: list[int] = tok(REAL_TEXT * 40)["input_ids"][:length]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    vocab = logits.shape[1]
    probe_ids = np.random.default_rng(7).choice(vocab, size=probes, replace=False).tolist()
    checks = []
    for pos in (24, length // 2 - 1, length - 1):
        row = logits[pos]
        best = np.argsort(-row, kind="stable")[:top].tolist()
        checks.append({
            "position": pos,
            "top_ids": best,
            "top_logits": [float(row[i]) for i in best],
            "probe_logits": [float(row[i]) for i in probe_ids],
        })
    out = OUT / "real"
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "model": path.name,
        "tokens": ids,
        "vocab_size": int(vocab),
        "probe_ids": probe_ids,
        "checks": checks,
        "made_by": "scripts/make_hf_fixtures.py --real (transformers GGUF loader, f32, eager attention)",
        "transformers": __import__("transformers").__version__,
    }
    (out / (path.stem + ".json")).write_text(json.dumps(doc) + "\n")
    print(f"{path.name}: {len(ids)} tokens, vocab {vocab}, argmax at {[c['top_ids'][0] for c in checks]}")
    make_greedy(path, tok, model)


GREEDY_NEW_TOKENS = 32
GREEDY_PROMPTS = [
    ("text", "The history of the printing press begins"),
    ("chat", "What is the capital of France?"),
    ("code", "def fibonacci(n):\n    "),
]


def make_greedy(path: Path, tok, model) -> None:
    """Greedy continuations of GREEDY_PROMPTS: writes tests/data/hf_tiny/real/<model>-greedy.json.

    Prompt ids come from transformers' tokenizer (the chat prompt through the GGUF's chat template), so the C++
    test needs no tokenizer. Generation is plain argmax with no stop token (transformers' generate with
    do_sample=False, EOS disabled), f32, eager attention. Each step also records the reference's two largest
    logits, so a divergence can be told apart from a near-tie.
    """
    prompts = []
    for kind, text in GREEDY_PROMPTS:
        if kind == "chat" and tok.chat_template is None:
            # Gemma-3-270m (the base model) ships no chat template: Gemma's turn format by hand (the BOS comes
            # from the tokenizer).
            assert "gemma" in model.config.model_type, "no chat template"
            ids = tok(f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n")["input_ids"]
        elif kind == "chat":
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            if not isinstance(ids, list):
                ids = ids["input_ids"]
        else:
            ids = tok(text)["input_ids"]
        ids = [int(i) for i in ids]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=GREEDY_NEW_TOKENS,
                                 min_new_tokens=0, eos_token_id=None, pad_token_id=0,
                                 temperature=None, top_p=None, top_k=None,
                                 output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, len(ids):].tolist()
        assert len(new) == GREEDY_NEW_TOKENS, (kind, len(new))
        top2_ids, top2_logits = [], []
        for step, row in enumerate(out.logits):
            row = row[0].float()
            vals, idx = torch.topk(row, 2)
            assert int(idx[0]) == new[step] or float(vals[0] - vals[1]) == 0.0, (kind, step)
            top2_ids.append([int(i) for i in idx])
            top2_logits.append([float(v) for v in vals])
        gaps = [a - b for a, b in top2_logits]
        prompts.append({
            "kind": kind,
            "text": text,
            "prompt_ids": ids,
            "expected_ids": [int(i) for i in new],
            "top2_ids": top2_ids,
            "top2_logits": top2_logits,
        })
        print(f"  greedy {kind}: {len(ids)} prompt tokens, min top-2 gap {min(gaps):.4g} at step "
              f"{int(np.argmin(gaps))}: {tok.decode(new)!r}")
    doc = {
        "model": path.name,
        "max_new_tokens": GREEDY_NEW_TOKENS,
        "prompts": prompts,
        "made_by": "scripts/make_hf_fixtures.py --real (transformers GGUF loader, f32, eager attention, "
                   "generate(do_sample=False), no EOS)",
        "transformers": __import__("transformers").__version__,
    }
    (OUT / "real" / (path.stem + "-greedy.json")).write_text(json.dumps(doc) + "\n")


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real", nargs="*", type=Path, default=None, help="GGUF files of real models")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.real:
        for p in args.real:
            make_real(p.expanduser())
        return
    torch.set_num_threads(1)
    for i, fx in enumerate(FIXTURES):
        make(fx, seed=1234 + i)


if __name__ == "__main__":
    main()
