"""tessera.hf.patch on tiny random transformers models (Llama, Mistral with a sliding window, Qwen2, Gemma-3 with
local layers): a dense patch gives the unpatched logits, a sparse patch gives tessera's masked reference, decode
stays dense, unpatch restores the model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tessera  # noqa: E402
import tessera.hf  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


def make(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        cfg, cls = transformers.LlamaConfig(**COMMON), transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg, cls = transformers.MistralConfig(**COMMON, sliding_window=48), transformers.MistralForCausalLM
    elif arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**COMMON), transformers.Qwen2ForCausalLM
    elif arch == "gemma3":
        cfg = transformers.Gemma3TextConfig(**COMMON, sliding_window=48, query_pre_attn_scalar=16,
                                            layer_types=["sliding_attention", "full_attention"])
        cls = transformers.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "sdpa"
    model = cls(cfg).eval()
    # Random weights of a model at init are small: scale q/k so that attention is far from uniform, which makes a
    # wrong mask show in the logits.
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "q_proj"):
                m.q_proj.weight.mul_(8.0)
    return model


IDS = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(3))
ARCHS = ["llama", "mistral", "qwen2", "gemma3"]


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("arch", ARCHS)
def test_dense_patch_equals_unpatched_and_unpatch_restores(arch):
    model = make(arch)
    before = logits(model)
    tessera.hf.patch(model, attn="dense")
    assert tessera.hf.is_patched(model)
    patched = logits(model)
    assert tessera.hf.stats(model)["prefill_calls"] == 2
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    tessera.hf.unpatch(model)
    assert not tessera.hf.is_patched(model)
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits(model), before, atol=0, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_sparse_patch_equals_the_masked_reference(arch):
    model = make(arch)
    dense = logits(model)
    spec = "ashape:sink=4,local=16" if arch != "qwen2" else "vs:v=8,s=16,last_q=16"
    tessera.hf.patch(model, attn=spec)
    sparse = logits(model)
    tessera.hf.patch(model, attn=spec, executor="reference")
    reference = logits(model)
    torch.testing.assert_close(sparse, reference, atol=1e-4, rtol=1e-4)
    assert (sparse - dense).abs().max() > 1e-2, "the sparse policy should change the logits"


def test_generate_prefills_sparse_and_decodes_dense():
    model = make("llama")
    tessera.hf.patch(model, attn="triangle:sink=4,local=16,last=8")
    out = model.generate(IDS, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    s = tessera.hf.stats(model)
    assert s["prefill_calls"] == 2 and s["decode_calls"] == 2 * 5
    # The same tokens with the reference executor: decode steps see the same (dense) cache either way.
    tessera.hf.patch(model, attn="triangle:sink=4,local=16,last=8", executor="reference")
    ref = model.generate(IDS, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert torch.equal(out, ref)


def test_policy_object_and_bad_inputs():
    model = make("qwen2")
    p = tessera.Policy.from_spec("trianglemix:start=1,sink=4,local=16,last=8", 2, 4, 2)
    tessera.hf.patch(model, attn=p)
    logits(model)
    with pytest.raises(tessera.Error, match="the policy has 3 layers x 4 query heads"):
        tessera.hf.patch(model, attn=tessera.Policy.from_spec("dense", 3, 4, 2))
    with pytest.raises(tessera.Error, match="attention spec 'bs:top=3'"):
        tessera.hf.patch(model, attn="bs:top=3")
    mask = torch.ones_like(IDS)
    mask[0, :5] = 0  # left padding
    with pytest.raises(tessera.Error, match="not causal"):
        with torch.no_grad():
            model(IDS, attention_mask=mask)
