"""A drop-in for Hugging Face ``transformers`` models: their attention through tessera's sparse executor.

    import tessera.hf
    model = transformers.AutoModelForCausalLM.from_pretrained(...)
    tessera.hf.patch(model, attn="vs:v=1000,s=6096")     # or "trianglemix", a policy file, a tessera.Policy
    model.generate(...)                                  # prefill sparse, decode dense
    tessera.hf.unpatch(model)

Supported: Llama (and Llama-3/3.1), Mistral, Qwen2 and Gemma-3 causal LMs (any model whose attention modules
call ``ALL_ATTENTION_FUNCTIONS``, carry ``layer_idx`` and pass their ``sliding_window``). Prefill chunks (more than
one query) run ``tessera.ops.sparse_attention`` with the layer's patterns, the model's sliding window and scaling,
at the chunk's position in the cache (``q_begin = kv_len - q_len``); single-token decode steps run PyTorch's SDPA
(dense). Batches with padding are refused (tessera attends causally within one sequence per batch row).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from . import _tessera, ops
from ._tessera import Policy

__all__ = ["patch", "unpatch", "is_patched"]

_NAME = "tessera"
_EXECUTORS = ("sparse", "reference")


class _State:
    def __init__(self, layer_policy: str, executor: str, sdpa) -> None:
        self.layer_policy = layer_policy
        self.executor = executor
        self.sdpa = sdpa
        self.prefill_calls = 0
        self.decode_calls = 0


def _attention_modules(model: torch.nn.Module):
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "config") and hasattr(m, "q_proj"):
            yield m


def _check_mask(mask: Optional[torch.Tensor], q_len: int, kv_len: int, window: int) -> None:
    """A mask other than the causal (windowed) one means padding: refused. Checked on the last query row, whose
    mask must be exactly its causal window (O(kv_len); padding masks keys in every row)."""
    if mask is None:
        return
    row = mask[..., -1, :]
    if row.dtype != torch.bool:
        row = row == 0  # additive float masks: 0 where visible
    keys = torch.arange(kv_len, device=row.device)
    pos = kv_len - 1
    expected = keys <= pos
    if window > 0:
        expected &= (pos - keys) < window
    if row.shape[-1] != kv_len or not bool((row == expected).all()):
        raise _tessera.Error("tessera.hf: the attention mask is not causal (padding?); tessera's patched attention "
                             "takes unpadded sequences (one prompt, or prompts of one length)")


def _tessera_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       sliding_window=None, **kwargs):
    state: Optional[_State] = getattr(module, "_tessera_state", None)
    if state is None:
        raise _tessera.Error("tessera.hf: this attention module is not patched (call tessera.hf.patch(model))")
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1:  # decode: dense, through transformers' own SDPA path
        state.decode_calls += 1
        return state.sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                          sliding_window=sliding_window, **kwargs)
    if kwargs.get("softcap") is not None:
        raise _tessera.Error("tessera.hf: attention logit softcapping is not supported")
    window = int(sliding_window) if sliding_window else 0
    _check_mask(attention_mask, q_len, kv_len, window)
    state.prefill_calls += 1
    q_begin = kv_len - q_len
    if state.executor == "reference":
        out = ops.reference(query, key, value, state.layer_policy, scale=scaling, q_begin=q_begin, total_len=kv_len,
                            window=window).to(query.dtype)
    else:
        out = ops.sparse_attention(query, key, value, state.layer_policy, scale=scaling, q_begin=q_begin,
                                   total_len=kv_len, window=window)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(_NAME, _tessera_attention)
    if _NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        # The masks SDPA gets: None for a plain causal prefill, a boolean mask otherwise (windows, decode, padding).
        AttentionMaskInterface.register(_NAME, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping["sdpa"])


def is_patched(model: torch.nn.Module) -> bool:
    return any(hasattr(m, "_tessera_state") for m in _attention_modules(model))


def patch(model: torch.nn.Module, attn: Union[str, Policy] = "dense", *, executor: str = "sparse"
          ) -> torch.nn.Module:
    """Routes the attention of ``model`` through tessera: prefill under ``attn`` (a ``--attn`` spec, a policy file
    or a :class:`tessera.Policy` of the model's shape), decode dense. ``executor="reference"`` runs tessera's
    float64 masked reference instead of the executor (for tests). Reversible with :func:`unpatch`; patching a
    patched model replaces its policy. Returns the model."""
    if executor not in _EXECUTORS:
        raise ValueError(f"executor must be one of {_EXECUTORS}, got {executor!r}")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    modules = list(_attention_modules(model))
    if not modules:
        raise _tessera.Error(f"tessera.hf: {type(model).__name__} has no attention modules tessera knows (with "
                             "layer_idx, config and q_proj: Llama, Mistral, Qwen2, Gemma-3)")
    config = modules[0].config
    layers = config.num_hidden_layers
    q_heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    if isinstance(attn, Policy):
        policy = attn
        if (policy.num_layers, policy.num_q_heads, policy.num_kv_heads) != (layers, q_heads, kv_heads):
            raise _tessera.Error(
                f"tessera.hf: the policy has {policy.num_layers} layers x {policy.num_q_heads} query heads "
                f"({policy.num_kv_heads} kv heads); the model has {layers} layers x {q_heads} query heads "
                f"({kv_heads} kv heads)")
    elif isinstance(attn, str):
        policy = Policy.from_spec(attn, layers, q_heads, kv_heads)
    else:
        raise TypeError(f"attn must be a str or a tessera.Policy, got {type(attn).__name__}")
    _register()
    for m in modules:
        m._tessera_state = _State(policy.layer_json(m.layer_idx), executor, sdpa_attention_forward)
        cfg = m.config
        if not hasattr(cfg, "_tessera_saved_attn"):
            cfg._tessera_saved_attn = cfg._attn_implementation
        cfg._attn_implementation = _NAME
    for cfg in {id(c): c for c in (model.config, getattr(model.config, "text_config", None)) if c is not None}.values():
        if not hasattr(cfg, "_tessera_saved_attn"):
            cfg._tessera_saved_attn = cfg._attn_implementation
        cfg._attn_implementation = _NAME
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Restores the attention implementation ``model`` had before :func:`patch`. Returns the model."""
    configs = {}
    for m in _attention_modules(model):
        if hasattr(m, "_tessera_state"):
            del m._tessera_state
        configs[id(m.config)] = m.config
    for c in (model.config, getattr(model.config, "text_config", None)):
        if c is not None:
            configs[id(c)] = c
    for cfg in configs.values():
        if hasattr(cfg, "_tessera_saved_attn"):
            cfg._attn_implementation = cfg._tessera_saved_attn
            del cfg._tessera_saved_attn
    return model


def stats(model: torch.nn.Module) -> dict:
    """How many prefill (tessera) and decode (SDPA) attention calls the patched model made, summed over layers."""
    s = [m._tessera_state for m in _attention_modules(model) if hasattr(m, "_tessera_state")]
    return {"prefill_calls": sum(x.prefill_calls for x in s), "decode_calls": sum(x.decode_calls for x in s)}
