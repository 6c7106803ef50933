"""tessera.ops against PyTorch: dense equals SDPA, every pattern equals SDPA under the pattern's explicit mask,
the steps compose to the op, tensors are read and written in place, torch.compile traces the ops."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import tessera
from tessera import _tessera, ops

torch.manual_seed(0)


def qkv(b=1, hq=4, hkv=2, s=150, d=32, kv=None, dtype=torch.float32):
    kv = kv or s
    g = torch.Generator().manual_seed(1234 + s + hq)
    q = torch.randn(b, hq, s, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, kv, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, kv, d, generator=g).to(dtype)
    return q, k, v


def sdpa(q, k, v, mask=None, scale=None, q_begin=0):
    """SDPA in float64, GQA expanded, causal (bottom-right for chunks) unless a mask is given."""
    group = q.shape[-3] // k.shape[-3]
    q64, k64, v64 = (t.double() for t in (q, k, v))
    k64 = k64.repeat_interleave(group, dim=-3)
    v64 = v64.repeat_interleave(group, dim=-3)
    if mask is None:
        rows = torch.arange(q_begin, q_begin + q.shape[-2])[:, None]
        mask = torch.arange(k.shape[-2])[None, :] <= rows
    return F.scaled_dot_product_attention(q64, k64, v64, attn_mask=mask, scale=scale)


# Small budgets, so that every pattern hides keys at these lengths.
PATTERNS = [
    "ashape:sink=4,local=32",
    "triangle:sink=4,local=32,last=16",
    "moa:alpha=8,beta=0.1,sink=4",
    "vs:v=16,s=24,last_q=16",
    "bs:top_k=2,block=32",
]


def test_dense_equals_sdpa_batched_gqa():
    q, k, v = qkv(b=2, hq=8, hkv=2, s=200, d=64)
    out = ops.sparse_attention(q, k, v, "dense")
    assert out.shape == q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), sdpa(q, k, v), atol=2e-5, rtol=1e-5)


def test_dense_chunk_and_scale_and_3d():
    q, k, v = qkv(hq=4, hkv=4, s=70, kv=200, d=32)  # a chunk: queries at positions 130..199
    out = ops.sparse_attention(q[0], k[0], v[0], "dense", q_begin=130, scale=0.3)
    assert out.shape == q[0].shape
    torch.testing.assert_close(out.double(), sdpa(q[0], k[0], v[0], scale=0.3, q_begin=130), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", PATTERNS)
def test_each_pattern_equals_sdpa_with_its_explicit_mask(spec):
    q, k, v = qkv(hq=4, hkv=2, s=333, d=32)
    mask = ops.pattern_mask(q, k, spec)
    assert mask.shape == (4, 333, 333)
    causal = torch.tril(torch.ones(333, 333, dtype=torch.bool))
    assert not (mask & ~causal).any()
    density = mask.sum().item() / (4 * causal.sum().item())
    assert 0.05 < density < 0.9, f"{spec}: density {density:.2f}: the pattern should hide keys here"
    out = ops.sparse_attention(q, k, v, spec)
    torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=mask), atol=2e-5, rtol=1e-5)
    # and tessera's own f64 masked reference agrees
    torch.testing.assert_close(out.double(), ops.reference(q, k, v, spec), atol=2e-5, rtol=1e-5)
    # sparse is not dense here
    assert (out - ops.sparse_attention(q, k, v, "dense")).abs().max() > 1e-3


def test_pattern_with_window_and_chunk_and_bf16():
    q, k, v = qkv(hq=4, hkv=1, s=96, kv=300, d=64, dtype=torch.bfloat16)
    spec = "vs:v=20,s=30,last_q=32"
    out = ops.sparse_attention(q, k, v, spec, q_begin=204, window=100)
    assert out.dtype == torch.bfloat16
    mask = ops.pattern_mask(q, k, spec, q_begin=204, window=100)
    torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=mask), atol=1e-2, rtol=1e-2)
    ref = ops.reference(q, k, v, spec, q_begin=204, window=100)
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)


def test_policy_object_per_layer():
    p = tessera.Policy.from_spec("trianglemix:start=1,sink=4,local=16,last=8", 2, 4, 2)
    q, k, v = qkv(hq=4, hkv=2, s=100)
    dense = ops.sparse_attention(q, k, v, p, layer=0)
    torch.testing.assert_close(dense.double(), sdpa(q, k, v), atol=2e-5, rtol=1e-5)
    tri = ops.sparse_attention(q, k, v, p, layer=1)
    mask = ops.pattern_mask(q, k, p, layer=1)
    torch.testing.assert_close(tri.double(), sdpa(q, k, v, mask=mask), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="pass layer="):
        ops.sparse_attention(q, k, v, p)


def test_steps_compose_to_the_op():
    q, k, v = qkv(hq=4, hkv=2, s=260, d=32)
    spec = "vs:v=16,s=24,last_q=16"
    est = ops.estimate(q, k, spec)
    assert est.dtype == torch.int32
    heads = ops.unpack_estimates(est)
    assert len(heads) == 4 and all(h["kind"] == "vertical_slash" for h in heads)
    assert all(len(h["columns"]) == 16 and len(h["offsets"]) == 24 for h in heads)
    index = ops.build_index(spec, est, num_q_heads=4, num_kv_heads=2, q_len=260, kv_len=260)
    assert index.range_offsets.numel() == 4 * math.ceil(260 / 64) + 1
    assert index.ranges.shape[1] == 2
    out = ops.run_index(q, k, v, index)
    torch.testing.assert_close(out, ops.sparse_attention(q, k, v, spec), atol=0, rtol=0)
    # An index from other estimates (another head's) gives another answer: the index is what runs.
    empty = ops.build_index("dense", ops.estimate(q, k, "dense"), num_q_heads=4, num_kv_heads=2, q_len=260, kv_len=260)
    torch.testing.assert_close(ops.run_index(q, k, v, empty).double(), sdpa(q, k, v), atol=2e-5, rtol=1e-5)


def test_zero_copy_through_dlpack():
    # q as the model makes it: [batch, seq, heads, dim] transposed to SDPA's layout (not contiguous).
    qs = torch.randn(1, 90, 4, 32)
    q = qs.transpose(1, 2)
    _, k, v = qkv(hq=4, hkv=2, s=90)
    out = torch.empty(1, 4, 90, 32)
    seen = _tessera.ops_attention(q, k, v, out, "ashape:sink=4,local=16")
    assert seen == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    assert _tessera.ops_data_ptr(q) == qs.data_ptr()
    mask = ops.pattern_mask(q, k, "ashape:sink=4,local=16")
    torch.testing.assert_close(out.double(), sdpa(q, k, v, mask=mask), atol=2e-5, rtol=1e-5)
    # out= writes in place through the public API too
    out2 = torch.zeros_like(out)
    ptr = out2.data_ptr()
    r = ops.sparse_attention(q, k, v, "ashape:sink=4,local=16", out=out2)
    assert r is out2 and out2.data_ptr() == ptr
    torch.testing.assert_close(out2, out, atol=0, rtol=0)


def test_torch_compile_traces_the_ops_without_graph_breaks():
    q, k, v = qkv(hq=4, hkv=2, s=128, d=32)

    def layer(q, k, v):
        return ops.sparse_attention(q * 2.0, k, v, "triangle:sink=4,local=16,last=8") + 1.0

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), atol=0, rtol=0)

    def steps(q, k, v):
        est = ops.estimate(q, k, "bs:top_k=2,block=32")
        index = ops.build_index("bs:top_k=2,block=32", est, num_q_heads=4, num_kv_heads=2, q_len=128, kv_len=128)
        return ops.run_index(q, k, v, index)

    torch.testing.assert_close(torch.compile(steps, backend="aot_eager", fullgraph=True)(q, k, v), steps(q, k, v))


def test_opcheck():
    q, k, v = qkv(hq=4, hkv=2, s=64, d=32)
    args = (q, k, v, "ashape:sink=4,local=16", 0.0, 0, 0, 0, True)
    torch.library.opcheck(torch.ops.tessera.sparse_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_errors_have_the_cpp_messages():
    q, k, v = qkv(hq=4, hkv=2, s=64, d=32)
    with pytest.raises(tessera.Error, match=r"attention: 4 query heads are not a multiple of 3 kv heads"):
        ops.sparse_attention(q, torch.randn(1, 3, 64, 32), torch.randn(1, 3, 64, 32))
    with pytest.raises(tessera.Error, match=r"attention spec 'vs:x=3': unknown parameter 'x'"):
        ops.sparse_attention(q, k, v, "vs:x=3")
    with pytest.raises(tessera.Error, match="float16, which the CPU executor does not read"):
        ops.sparse_attention(q.half(), k.half(), v.half())
    with pytest.raises(tessera.Error, match=r"kv_len 32 is less than q_begin \+ q_len = 64"):
        ops.sparse_attention(q, k[:, :, :32], v[:, :, :32], "ashape:sink=4,local=16")
    with pytest.raises(tessera.Error, match=r"q .* and k .* must have the same head_dim"):
        ops.sparse_attention(q, k[..., :16], v[..., :16])
    with pytest.raises(ValueError, match="all be"):
        ops.sparse_attention(q, k[0], v[0])
    with pytest.raises(tessera.Error, match="int32"):
        _tessera.ops_build_index("dense", torch.zeros(3, dtype=torch.int64), 4, 2, 64, 64, 0, 0, 64)
    with pytest.raises(tessera.Error, match="estimates: .*overruns"):
        ops.build_index("dense", torch.tensor([2, 1, 5, 0, 7], dtype=torch.int32), num_q_heads=4, num_kv_heads=2,
                        q_len=64, kv_len=64)
