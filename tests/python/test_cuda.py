"""tessera.ops on CUDA tensors (skipped without a GPU or a module built with CUDA; scripts/gpu/python_check.sh runs
them on the GPU machine): every pattern equals SDPA under its explicit mask (built on the CPU from the same q and
k with the CUDA executor's 128-row query tile), on the caller's stream, in place."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import tessera
from tessera import _tessera, ops

pytestmark = pytest.mark.skipif(not (tessera.built_with_cuda and torch.cuda.is_available()),
                                reason="needs a CUDA device and a tessera module built with CUDA")

PATTERNS = ["dense", "ashape:sink=64,local=256", "triangle:sink=8,local=128,last=64", "vs:v=64,s=128,last_q=64",
            "bs:top_k=4,block=64", "moa:alpha=64,beta=0.1,sink=16"]


def inputs(s=1000, hq=8, hkv=2, d=128, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, hq, s, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, s, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, s, d, generator=g).to(dtype)
    return q, k, v


def masked_sdpa(q, k, v, mask):
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, 1),
                                          v.float().repeat_interleave(group, 1), attn_mask=mask)


@pytest.mark.parametrize("spec", PATTERNS)
def test_cuda_pattern_equals_masked_sdpa(spec):
    q, k, v = inputs()
    # dense_fallback=False: the pattern exactly (with the fallback a layer whose index costs more runs dense)
    out = ops.sparse_attention(q.cuda(), k.cuda(), v.cuda(), spec, dense_fallback=False)
    assert out.is_cuda and out.dtype == torch.bfloat16
    mask = ops.pattern_mask(q, k, spec, tile=128)
    ref = masked_sdpa(q, k, v, mask)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


def test_cuda_steps_and_stream_and_zero_copy():
    q, k, v = (t.cuda() for t in inputs(s=700))
    spec = "vs:v=64,s=128,last_q=64"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = torch.empty_like(q)
        seen = _tessera.ops_attention(q, k, v, out, spec, 0.0, 0, 0, 0, stream.cuda_stream, False)
        assert seen == [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
        est = ops.estimate(q, k, spec, tile=128)
        index = ops.build_index(spec, est, num_q_heads=8, num_kv_heads=2, q_len=700, kv_len=700, tile=128)
        stepped = ops.run_index(q, k, v, index)
    stream.synchronize()
    # The device estimates are the CPU's; the index run alone equals the op.
    assert ops.unpack_estimates(est) == ops.unpack_estimates(ops.estimate(q.cpu(), k.cpu(), spec, tile=128))
    torch.testing.assert_close(stepped, out, atol=1e-2, rtol=1e-2)


def test_cuda_compile():
    q, k, v = (t.cuda() for t in inputs(s=512))
    f = torch.compile(lambda q, k, v: ops.sparse_attention(q, k, v, "ashape:sink=64,local=128") * 2, fullgraph=True)
    torch.testing.assert_close(f(q, k, v), ops.sparse_attention(q, k, v, "ashape:sink=64,local=128") * 2)


def test_cuda_engine_matches_the_cpu_engine(tiny_llama_dir):
    import numpy as np

    model = tessera.Model.load(str(tiny_llama_dir))
    ids = list(range(3, 120, 2))
    cpu = np.array(tessera.Engine(model).logits(ids))
    # The fixture's head dim (16) has no sparse kernel on the GPU: a sparse policy is refused with the CLI's message.
    sparse = tessera.Engine(model, device="cuda", attn="ashape:sink=4,local=16")
    with pytest.raises(tessera.Error, match="does not support head_dim 16"):
        sparse.generate(ids, max_tokens=2)
    engine = tessera.Engine(model, device="cuda")
    assert engine.device == "cuda"
    dense_gpu = np.array(tessera.Engine(model, device="cuda").logits(ids))
    rel = np.linalg.norm(dense_gpu - cpu) / np.linalg.norm(cpu)
    assert rel < 4.5e-2, rel  # bf16 weights on the GPU (the bound of tests/gpu/engine_tests)
    gen = engine.generate(ids, max_tokens=6, stream=True)
    list(gen)
    assert len(gen.tokens) == 6 and gen.finish_reason == "length"
    m = engine.memory()
    assert m["device"] == "cuda" and m["weights_bytes"] > 0 and m["peak_in_use_bytes"] >= m["weights_bytes"]
    assert list(m) == ["device", "weights_bytes", "kv_cache_bytes", "scratch_bytes", "peak_in_use_bytes",
                       "device_total_bytes"], m
    assert engine.stats()["decode_tokens"] == 5
