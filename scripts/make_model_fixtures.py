#!/usr/bin/env python3
"""Writes the model-file fixtures of tests/model_files_test.cpp into tests/data/model_files/.

Everything here is produced by the reference implementations, not by tessera:
  reference.gguf  written by gguf-py's GGUFWriter. Metadata: one key of every GGUF value type, arrays of every
                  element type, a nested array of strings. Tensors:
                    source            F32 [2, 64], random
                    q.<T>             gguf.quants.quantize(source, T) for F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
                                      (tessera's quantize_row must reproduce these bytes exactly)
                    q.<T>             random blocks (sane f16 scales) for Q2_K Q3_K Q4_K Q5_K Q6_K, shape [1, 512]
                    expected.<T>      F32, gguf.quants.dequantize(q.<T>, T): what tessera's dequantize must return
  hf_tiny/        a Hugging Face style directory: config.json, tokenizer.json, two safetensors shards written by
                  the `safetensors` package and the model.safetensors.index.json naming them.

Usage: pip install gguf numpy safetensors && python3 scripts/make_model_fixtures.py
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "model_files")


def sane_k_blocks(rng, qtype, n_blocks):
    """Random K-quant blocks whose f16 scale fields are finite, moderate numbers (random bits elsewhere)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    # byte offsets of the f16 super-block scales (d, dmin) in each layout
    half_fields = {Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208]}[qtype]
    for off in half_fields:
        vals = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        blocks[:, off:off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def write_gguf(path):
    rng = np.random.default_rng(20240229)
    w = gguf.GGUFWriter(path, arch="fixture")  # adds general.architecture = "fixture"
    w.add_uint8("test.uint8", 200)
    w.add_int8("test.int8", -100)
    w.add_uint16("test.uint16", 60000)
    w.add_int16("test.int16", -30000)
    w.add_uint32("test.uint32", 4000000000)
    w.add_int32("test.int32", -2000000000)
    w.add_float32("test.float32", 0.1)
    w.add_uint64("test.uint64", 18000000000000000000)
    w.add_int64("test.int64", -9000000000000000000)
    w.add_float64("test.float64", 0.1)
    w.add_bool("test.bool", True)
    w.add_string("test.string", "héllo wörld")
    w.add_key_value("test.array.uint8", [1, 2, 255], V.ARRAY, V.UINT8)
    w.add_key_value("test.array.int8", [-128, 0, 127], V.ARRAY, V.INT8)
    w.add_key_value("test.array.uint16", [0, 65535], V.ARRAY, V.UINT16)
    w.add_key_value("test.array.int16", [-32768, 32767], V.ARRAY, V.INT16)
    w.add_key_value("test.array.uint32", [0, 4294967295], V.ARRAY, V.UINT32)
    w.add_key_value("test.array.int32", [-2147483648, 2147483647], V.ARRAY, V.INT32)
    w.add_key_value("test.array.uint64", [0, 18446744073709551615], V.ARRAY, V.UINT64)
    w.add_key_value("test.array.int64", [-9223372036854775808, 9223372036854775807], V.ARRAY, V.INT64)
    w.add_key_value("test.array.float32", [0.5, -1.25, 0.1], V.ARRAY, V.FLOAT32)
    w.add_key_value("test.array.float64", [0.5, -1.25, 0.1], V.ARRAY, V.FLOAT64)
    w.add_key_value("test.array.bool", [True, False, True], V.ARRAY, V.BOOL)
    w.add_key_value("test.array.string", ["a", "", "<0x0A>", "ĠĠ"], V.ARRAY, V.STRING)
    w.add_key_value("test.array.nested", [["x", "y"], ["z"]], V.ARRAY, V.ARRAY)

    source = rng.standard_normal((2, 64)).astype(np.float32)
    source[0, :32] *= 0.01  # one block of small values: exercises small scales
    source[1, 32:] = 0.0    # one all-zero block: d == 0 paths
    w.add_tensor("source", source)
    for qt in [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]:
        q = gguf.quants.quantize(source, qt)
        w.add_tensor(f"q.{qt.name}", q, raw_dtype=qt)
        w.add_tensor(f"expected.{qt.name}", gguf.quants.dequantize(q, qt).astype(np.float32))
    for qt in [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]:
        q = sane_k_blocks(rng, qt, 2).reshape(1, -1)  # one row of two blocks
        w.add_tensor(f"q.{qt.name}", q, raw_dtype=qt)
        w.add_tensor(f"expected.{qt.name}", gguf.quants.dequantize(q, qt).astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_dir(d):
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(7)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
              "num_attention_heads": 2, "num_hidden_layers": 1, "vocab_size": 16, "torch_dtype": "float32"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(d, "tokenizer.json"), "w") as f:
        json.dump({"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}, f)
    shard1 = {"model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32),
              "model.norm.weight": np.linspace(-1, 1, 8).astype(np.float16)}
    shard2 = {"lm_head.weight": rng.standard_normal((16, 8)).astype(np.float32)}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file(shard1, os.path.join(d, names[0]), metadata={"format": "np"})
    save_file(shard2, os.path.join(d, names[1]), metadata={"format": "np"})
    weight_map = {k: names[0] for k in shard1} | {k: names[1] for k in shard2}
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f, indent=2)


def main():
    os.makedirs(OUT, exist_ok=True)
    write_gguf(os.path.join(OUT, "reference.gguf"))
    write_hf_dir(os.path.join(OUT, "hf_tiny"))
    print(f"wrote fixtures to {os.path.normpath(OUT)} (gguf-py {getattr(gguf, '__version__', '?')})", file=sys.stderr)


if __name__ == "__main__":
    main()
