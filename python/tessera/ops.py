"""tessera's attention kernels as PyTorch ops (``torch.ops.tessera.*``), zero-copy through DLPack.

Tensors use ``torch.nn.functional.scaled_dot_product_attention``'s layout: q ``[batch, num_q_heads, q_len,
head_dim]``, k and v ``[batch, num_kv_heads, kv_len, head_dim]`` (GQA: num_q_heads a multiple of num_kv_heads,
never repeated), or the same without the batch dimension. Any strides are accepted on the CPU (a transposed view
is read in place); on CUDA the last dimension must be contiguous. CPU tensors (float32 or bfloat16) run on the CPU
executor, CUDA tensors (bfloat16 or float16) on the CUDA backend, on the current stream.

``policy`` is one layer's policy: a ``--attn`` preset applied to every head (``"dense"``,
``"ashape:sink=64,local=256"``, ``"vs:v=64,s=256"``, ``"bs:top_k=4"``, ``"triangle"``, ``"moa:alpha=64,beta=0.1"``)
or a :class:`tessera.Policy` with ``layer=`` (or its ``layer_json(layer)`` string). Attention is causal: query row r
sits at position ``q_begin + r`` and sees keys at positions <= its own (kv_len >= q_begin + q_len).
``total_len`` is the whole prompt's length (MoA spans, Triangle's last rows; 0: kv_len); ``window`` > 0 is a
model's sliding window (a row sees its ``window`` most recent keys), intersected with the pattern.

The ops are registered with ``torch.library.custom_op`` and fake implementations, so ``torch.compile`` traces
through them (no graph break). They are for inference (no autograd).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from . import _tessera
from ._tessera import Policy

__all__ = ["sparse_attention", "estimate", "build_index", "run_index", "SparseIndex", "unpack_estimates",
           "pattern_mask", "reference", "layer_policy"]


def layer_policy(policy: Union[str, Policy], layer: Optional[int] = None) -> str:
    """The string the ops take for one layer: a preset as is, or ``policy.layer_json(layer)``."""
    if isinstance(policy, Policy):
        if layer is None:
            if policy.num_layers != 1:
                raise ValueError(f"policy has {policy.num_layers} layers: pass layer= to choose one")
            layer = 0
        return policy.layer_json(layer)
    if isinstance(policy, str):
        if layer is not None:
            raise ValueError("layer= applies to a tessera.Policy, not to a preset string")
        return policy
    raise TypeError(f"policy must be a str or a tessera.Policy, got {type(policy).__name__}")


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _out_dtype(q: torch.Tensor) -> torch.dtype:
    # The CPU executor writes float32; the CUDA kernels write q's dtype.
    return torch.float32 if q.device.type == "cpu" else q.dtype


# --- the ops ---------------------------------------------------------------------------------------------------

@torch.library.custom_op("tessera::sparse_attention", mutates_args=())
def _sparse_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: str, scale: float,
                         q_begin: int, total_len: int, window: int, dense_fallback: bool) -> torch.Tensor:
    q, k, v = q.detach(), k.detach(), v.detach()
    out = torch.empty(q.shape, dtype=_out_dtype(q), device=q.device)
    _tessera.ops_attention(q, k, v, out, policy, scale, q_begin, total_len, window, _stream(q), dense_fallback)
    return out if out.dtype == q.dtype else out.to(q.dtype)


@_sparse_attention_op.register_fake
def _(q, k, v, policy, scale, q_begin, total_len, window, dense_fallback):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("tessera::sparse_attention_out", mutates_args=("out",))
def _sparse_attention_out_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, policy: str,
                             scale: float, q_begin: int, total_len: int, window: int, dense_fallback: bool) -> None:
    _tessera.ops_attention(q.detach(), k.detach(), v.detach(), out.detach(), policy, scale, q_begin, total_len,
                           window, _stream(q), dense_fallback)


@_sparse_attention_out_op.register_fake
def _(q, k, v, out, policy, scale, q_begin, total_len, window, dense_fallback):
    return None


@torch.library.custom_op("tessera::estimate", mutates_args=())
def _estimate_op(q: torch.Tensor, k: torch.Tensor, policy: str, scale: float, q_begin: int, total_len: int,
                 tile: int) -> torch.Tensor:
    return torch.from_numpy(_tessera.ops_estimate(q.detach(), k.detach(), policy, scale, q_begin, total_len, tile))


@_estimate_op.register_fake
def _(q, k, policy, scale, q_begin, total_len, tile):
    n = torch.library.get_ctx().new_dynamic_size()
    return q.new_empty((n,), dtype=torch.int32, device="cpu")


@torch.library.custom_op("tessera::build_index", mutates_args=())
def _build_index_op(policy: str, estimates: torch.Tensor, num_q_heads: int, num_kv_heads: int, q_len: int,
                    kv_len: int, q_begin: int, total_len: int, tile: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    arrays = _tessera.ops_build_index(policy, estimates.cpu(), num_q_heads, num_kv_heads, q_len, kv_len, q_begin,
                                      total_len, tile)
    return tuple(torch.from_numpy(a) for a in arrays)  # type: ignore[return-value]


@_build_index_op.register_fake
def _(policy, estimates, num_q_heads, num_kv_heads, q_len, kv_len, q_begin, total_len, tile):
    ctx = torch.library.get_ctx()
    offsets = num_q_heads * ((q_len + tile - 1) // tile) + 1
    nr, nc = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    e = estimates
    return (e.new_empty((offsets,), dtype=torch.int32), e.new_empty((nr, 2), dtype=torch.int32),
            e.new_empty((offsets,), dtype=torch.int32), e.new_empty((nc,), dtype=torch.int32))


@torch.library.custom_op("tessera::run_index", mutates_args=())
def _run_index_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, range_offsets: torch.Tensor,
                  ranges: torch.Tensor, column_offsets: torch.Tensor, columns: torch.Tensor, tile: int,
                  q_begin: int, scale: float, window: int) -> torch.Tensor:
    q, k, v = q.detach(), k.detach(), v.detach()
    out = torch.empty(q.shape, dtype=_out_dtype(q), device=q.device)
    _tessera.ops_run_index(q, k, v, out, range_offsets.cpu(), ranges.cpu(), column_offsets.cpu(), columns.cpu(),
                           tile, q_begin, scale, window, _stream(q))
    return out if out.dtype == q.dtype else out.to(q.dtype)


@_run_index_op.register_fake
def _(q, k, v, range_offsets, ranges, column_offsets, columns, tile, q_begin, scale, window):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# --- the Python API ----------------------------------------------------------------------------------------------

def _batched(*ts: torch.Tensor) -> tuple[bool, list[torch.Tensor]]:
    """Adds the batch dimension to 3-D tensors (a view); says whether it did."""
    dims = {t.dim() for t in ts}
    if dims == {3}:
        return True, [t.unsqueeze(0) for t in ts]
    if dims == {4}:
        return False, list(ts)
    raise ValueError("q, k and v must all be [batch, heads, seq, head_dim] or all [heads, seq, head_dim], got "
                     + ", ".join(str(list(t.shape)) for t in ts))


def _scale(scale: Optional[float]) -> float:
    if scale is None:
        return 0.0  # 1 / sqrt(head_dim)
    if not scale > 0:
        raise ValueError(f"scale must be > 0 (None: 1/sqrt(head_dim)), got {scale}")
    return float(scale)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Union[str, Policy] = "dense", *,
                     layer: Optional[int] = None, scale: Optional[float] = None, q_begin: int = 0,
                     total_len: int = 0, window: int = 0, out: Optional[torch.Tensor] = None,
                     dense_fallback: bool = True) -> torch.Tensor:
    """Causal attention under one layer's sparse policy: estimation (VS/BS heads), the range+column index and the
    sparse executor, as the engine runs a layer. Returns ``[.., num_q_heads, q_len, head_dim]`` in q's dtype.

    ``out``: a tensor of q's shape to write into (float32 on the CPU, q's dtype on CUDA), returned as is.
    ``dense_fallback`` (CUDA): as the engine, a layer whose index would cost more than dense attention runs dense;
    False runs the pattern exactly (the CPU op always does).
    Raises tessera.Error for shapes, dtypes or policies tessera does not take, with the C++ message."""
    p = layer_policy(policy, layer)
    squeezed, (qb, kb, vb) = _batched(q, k, v)
    if out is None:
        r = torch.ops.tessera.sparse_attention(qb, kb, vb, p, _scale(scale), q_begin, total_len, window,
                                               dense_fallback)
        return r.squeeze(0) if squeezed else r
    ob = out.unsqueeze(0) if squeezed else out
    torch.ops.tessera.sparse_attention_out(qb, kb, vb, ob, p, _scale(scale), q_begin, total_len, window,
                                           dense_fallback)
    return out


def estimate(q: torch.Tensor, k: torch.Tensor, policy: Union[str, Policy] = "dense", *, layer: Optional[int] = None,
             scale: Optional[float] = None, q_begin: int = 0, total_len: int = 0, tile: int = 64) -> torch.Tensor:
    """Step 1: the online estimates of the layer's dynamic heads (vertical-slash columns and diagonals from the last
    queries, block-sparse key blocks from pooled blocks), packed in an int32 CPU tensor (``unpack_estimates``
    reads it). Batch 1. ``tile`` is the query-tile height of the index to be built (64 on the CPU, 128 on CUDA)."""
    squeezed, (qb, kb) = _batched(q, k)
    if qb.shape[0] != 1:
        raise ValueError(f"estimate takes batch 1, got {qb.shape[0]}")
    return torch.ops.tessera.estimate(qb, kb, layer_policy(policy, layer), _scale(scale), q_begin, total_len, tile)


def unpack_estimates(estimates: torch.Tensor) -> list[dict]:
    """The packed estimates as one dict per query head: ``{"kind": "vertical_slash", "columns": [...],
    "offsets": [...]}``, ``{"kind": "block_sparse", "block": 64, "key_blocks": [...], ...}`` or ``{"kind": "static"}``."""
    return _tessera.ops_unpack_estimates(estimates.cpu())


class SparseIndex(NamedTuple):
    """The range+column index of one layer (attention/index/sparse_index.h): per (query head h, query tile t),
    entry ``h * num_tiles + t`` of the offsets delimits key ranges ``[begin, end)`` and single key columns."""
    range_offsets: torch.Tensor   # int32 [num_q_heads * num_tiles + 1]
    ranges: torch.Tensor          # int32 [n, 2]
    column_offsets: torch.Tensor  # int32 [num_q_heads * num_tiles + 1]
    columns: torch.Tensor         # int32 [m]
    tile: int
    q_begin: int


def build_index(policy: Union[str, Policy], estimates: torch.Tensor, *, num_q_heads: int, num_kv_heads: int,
                q_len: int, kv_len: int, layer: Optional[int] = None, q_begin: int = 0, total_len: int = 0,
                tile: int = 64) -> SparseIndex:
    """Step 2: lowers every head's pattern (with its estimate) to the range+column index, on the CPU."""
    arrays = torch.ops.tessera.build_index(layer_policy(policy, layer), estimates, num_q_heads, num_kv_heads, q_len,
                                           kv_len, q_begin, total_len, tile)
    return SparseIndex(*arrays, tile=tile, q_begin=q_begin)


def run_index(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: SparseIndex, *,
              scale: Optional[float] = None, window: int = 0) -> torch.Tensor:
    """Step 3: the sparse executor over ``index`` (batch 1): exactly dense attention under the index's mask."""
    squeezed, (qb, kb, vb) = _batched(q, k, v)
    if qb.shape[0] != 1:
        raise ValueError(f"run_index takes batch 1, got {qb.shape[0]}")
    r = torch.ops.tessera.run_index(qb, kb, vb, index.range_offsets, index.ranges, index.column_offsets,
                                    index.columns, index.tile, index.q_begin, _scale(scale), window)
    return r.squeeze(0) if squeezed else r


def pattern_mask(q: torch.Tensor, k: torch.Tensor, policy: Union[str, Policy] = "dense", *,
                 layer: Optional[int] = None, scale: Optional[float] = None, q_begin: int = 0, total_len: int = 0,
                 window: int = 0, tile: int = 64) -> torch.Tensor:
    """The layer's explicit boolean mask ``[num_q_heads, q_len, kv_len]`` (CPU, batch 1), from each pattern's
    per-cell definition (not from the index), causal and ``window`` included: what ``sparse_attention`` must equal
    dense attention under."""
    squeezed, (qb, kb) = _batched(q, k)
    if qb.shape[0] != 1:
        raise ValueError(f"pattern_mask takes batch 1, got {qb.shape[0]}")
    m = torch.from_numpy(_tessera.ops_pattern_mask(qb.detach(), kb.detach(), layer_policy(policy, layer),
                                                   _scale(scale), q_begin, total_len, tile)).bool()
    if window > 0:
        rows = torch.arange(q_begin, q_begin + m.shape[1])[:, None]
        keys = torch.arange(m.shape[2])[None, :]
        m &= (rows - keys) < window
    return m


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: Union[str, Policy] = "dense", *,
              layer: Optional[int] = None, scale: Optional[float] = None, q_begin: int = 0, total_len: int = 0,
              window: int = 0, tile: int = 64) -> torch.Tensor:
    """tessera's masked reference (CPU, float64): dense attention under each head's explicit pattern mask, the slow
    twin the executors are tested against. Same layout as ``sparse_attention``; returns float64."""
    squeezed, (qb, kb, vb) = _batched(q, k, v)
    r = torch.from_numpy(np.asarray(_tessera.ops_reference(qb.detach(), kb.detach(), vb.detach(),
                                                           layer_policy(policy, layer), _scale(scale), q_begin,
                                                           total_len, window, tile)))
    return r.squeeze(0) if squeezed else r
