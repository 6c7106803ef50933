#!/usr/bin/env python3
"""Builds the seed corpus of every fuzzer in tests/fuzz from the test data (stdlib only).

    tests/fuzz/make_seeds.py OUT_DIR

writes OUT_DIR/<fuzzer>/<seed> for each harness (fuzz_model_file, fuzz_hf_directory, ...): the model files,
tokenizers, chat templates and policy files under tests/data, the earlier findings kept there as regression
inputs, GGUF metadata turned into JSON (how ModelFile::metadata() holds it), and a few hand-made inputs.
Multi-file inputs use the "#file:<name>" sections of tests/fuzz/fuzz_common.h. scripts/fuzz.sh calls this.
"""
import json
import os
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
DATA = os.path.join(ROOT, "tests", "data")


def read(*parts):
    with open(os.path.join(DATA, *parts), "rb") as f:
        return f.read()


def files_in(*parts):
    d = os.path.join(DATA, *parts)
    return sorted(os.path.join(d, n) for n in os.listdir(d) if os.path.isfile(os.path.join(d, n))) if os.path.isdir(d) else []


def sections(default, files):
    """A multi-file input: `default` (bytes of the harness's default file), then "#file:<name>" sections."""
    out = default
    for name, body in files:
        out += b"\n#file:" + name.encode() + b"\n" + body
    return out


def gguf_metadata(path):
    """The key/values of a GGUF file as a dict (arrays of arrays are not needed for the fixtures)."""
    with open(path, "rb") as f:
        buf = f.read()
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = buf[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return s

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t in scalars:
            return take(scalars[t])
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        raise ValueError(f"{path}: unknown GGUF type {t}")

    assert buf[:4] == b"GGUF"
    pos = 8
    _, n_kv = take("Q"), take("Q")
    md = {}
    for _ in range(n_kv):
        key = string()
        md[key] = value(take("I"))
    return md


def main():
    out = sys.argv[1]
    seeds = {}

    def add(fuzzer, name, data):
        seeds.setdefault(fuzzer, {})[name] = data if isinstance(data, bytes) else data.encode()

    ggufs = sorted(os.path.join(DATA, "hf_tiny", d, f) for d in os.listdir(os.path.join(DATA, "hf_tiny"))
                   if os.path.isdir(os.path.join(DATA, "hf_tiny", d))
                   for f in os.listdir(os.path.join(DATA, "hf_tiny", d)) if f.endswith(".gguf"))
    configs = sorted(os.path.join(DATA, "hf_tiny", d, "config.json") for d in os.listdir(os.path.join(DATA, "hf_tiny"))
                     if os.path.isfile(os.path.join(DATA, "hf_tiny", d, "config.json")))
    configs.append(os.path.join(DATA, "model_files", "hf_tiny", "config.json"))

    # fuzz_model_file: GGUF and safetensors files, earlier findings, two tiny hand-made files.
    add("fuzz_model_file", "reference.gguf", read("model_files", "reference.gguf"))
    for p in files_in("model_files", "hf_tiny"):
        if p.endswith(".safetensors"):
            add("fuzz_model_file", os.path.basename(p), open(p, "rb").read())
    for p in files_in("model_files", "fuzz"):
        add("fuzz_model_file", "finding-" + os.path.basename(p), open(p, "rb").read())

    def s(x):
        return struct.pack("<Q", len(x)) + x
    kv = s(b"general.architecture") + struct.pack("<I", 8) + s(b"llama")
    kv += s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + s(b"a") + s(b"b")
    ti = s(b"w") + struct.pack("<I", 2) + struct.pack("<qq", 32, 2) + struct.pack("<IQ", 8, 0)  # Q8_0 [2, 32]
    head = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + kv + ti
    head += b"\0" * (-len(head) % 32)
    add("fuzz_model_file", "seed.gguf", head + bytes(range(68)))
    h = b'{"w":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}}'
    add("fuzz_model_file", "seed.safetensors", struct.pack("<Q", len(h)) + h + bytes(8))

    # fuzz_hf_directory: the sharded tiny model with each family's config.json, with and without its index and
    # tokenizer files.
    hf = os.path.join("model_files", "hf_tiny")
    shards = [("model.safetensors.index.json", read(hf, "model.safetensors.index.json")),
              ("model-00001-of-00002.safetensors", read(hf, "model-00001-of-00002.safetensors")),
              ("model-00002-of-00002.safetensors", read(hf, "model-00002-of-00002.safetensors"))]
    for p in configs:
        tag = os.path.basename(os.path.dirname(p))
        cfg = open(p, "rb").read()
        add("fuzz_hf_directory", f"{tag}-sharded", sections(cfg, shards + [("tokenizer.json", read(hf, "tokenizer.json"))]))
        add("fuzz_hf_directory", f"{tag}-single", sections(cfg, [("model.safetensors", shards[1][1])]))
    add("fuzz_hf_directory", "tokenizer-llama3",
        sections(open(configs[0], "rb").read(),
                 shards + [("tokenizer.json", read("tokenizer", "tiny_llama3_tokenizer.json")),
                           ("tokenizer_config.json", b'{"add_bos_token": true, "bos_token": "<|begin|>"}')]))

    # fuzz_model_config: config.json files, and the GGUF metadata of the tiny models without the vocabulary.
    for p in configs:
        add("fuzz_model_config", os.path.basename(os.path.dirname(p)) + ".json", open(p, "rb").read())
    for p in ggufs:
        md = {k: v for k, v in gguf_metadata(p).items() if not k.startswith("tokenizer.")}
        add("fuzz_model_config", "gguf-" + os.path.basename(os.path.dirname(p)) + "-" + os.path.basename(p) + ".json",
            json.dumps(md))

    # fuzz_tokenizer_json: tokenizer.json files, one with a tokenizer_config.json and text.
    for name in ("tiny_llama3_tokenizer.json", "tiny_qwen2_tokenizer.json"):
        add("fuzz_tokenizer_json", name, read("tokenizer", name))
    add("fuzz_tokenizer_json", "hf_tiny.json", read(hf, "tokenizer.json"))
    add("fuzz_tokenizer_json", "llama3-with-config",
        sections(read("tokenizer", "tiny_llama3_tokenizer.json"),
                 [("tokenizer_config.json",
                   b'{"add_bos_token": true, "add_eos_token": true, "bos_token": {"content": "<|begin|>"}, '
                   b'"eos_token": "<|end|>", "pad_token": null}'),
                  ("text", "Hello <|end|> world 12345 caf\u00e9".encode())]))

    # fuzz_gguf_tokenizer: tokenizer metadata of the fixtures and of the tiny GGUF models.
    add("fuzz_gguf_tokenizer", "tiny_sentencepiece.json",
        json.dumps(json.loads(read("tokenizer", "tiny_sentencepiece.json"))["metadata"]))
    for p in ggufs:
        md = gguf_metadata(p)
        add("fuzz_gguf_tokenizer", os.path.basename(os.path.dirname(p)) + "-" + os.path.basename(p) + ".json",
            json.dumps({k: v for k, v in md.items() if k.startswith("tokenizer.") or k == "general.architecture"}))

    # fuzz_chat_template: each family's template with its tokens and a conversation.
    templates = json.loads(read("tokenizer", "chat_templates.json"))
    for family, t in templates.items():
        add("fuzz_chat_template", family,
            sections(t["template"].encode(),
                     [("bos", t["bos_token"].encode()), ("eos", t["eos_token"].encode()),
                      ("messages", b"system:Be brief.\nuser:Hi\nassistant:Hello\nuser: Bye ")]))
    add("fuzz_chat_template", "gemma3.jinja", read("tokenizer", "templates", "gemma3.jinja"))
    add("fuzz_chat_template", "vocab-only",
        sections(b"", [("architecture", b"llama"), ("vocab", b"<s>\n</s>\n<|start_header_id|>\n<|eot_id|>")]))

    # fuzz_policy_file: the policy files of the tests.
    for p in files_in("configs"):
        add("fuzz_policy_file", os.path.basename(p), open(p, "rb").read())

    # fuzz_attn_spec: one spec per preset.
    for i, spec in enumerate(["dense", "ashape:sink=4,local=64", "streaming", "triangle:sink=8,local=512,last=128",
                              "vs:v=1000,s=6096,last_q=64", "minference", "bs:top_k=100,block=64",
                              "moa:alpha=0,beta=0.5,sink=64", "trianglemix:start=1,inner=vs,v=10,s=20,local=64",
                              "trianglemix", "vs_adaptive:gamma=0.9,v=1000,s=6096,min_v=30,min_s=100",
                              "bs_adaptive:gamma=0.95,top_k=100,min_top_k=2,block=64"]):
        add("fuzz_attn_spec", f"spec-{i}", spec)
    for p in files_in("configs", "fuzz"):
        if os.path.basename(p).startswith("attn-spec-"):
            add("fuzz_attn_spec", "finding-" + os.path.basename(p), open(p, "rb").read().rstrip(b"\n"))

    # fuzz_server_request: request bodies; the first byte picks the endpoint (even: chat, odd: completions).
    chat = {"model": "tessera", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi"}],
            "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n\n", "END"],
            "stream": True, "stream_options": {"include_usage": True}, "tessera": {"attn": "vs:v=64,s=128"}}
    add("fuzz_server_request", "chat", b"\x00" + json.dumps(chat).encode())
    add("fuzz_server_request", "chat-min", b"\x00" + b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    add("fuzz_server_request", "completion", b"\x01" + json.dumps(
        {"model": "m", "prompt": "Once upon", "max_tokens": 8, "temperature": 0}).encode())
    add("fuzz_server_request", "completion-ids", b"\x01" + b'{"model": "m", "prompt": [1, 2, 3], "max_completion_tokens": 4}')

    for fuzzer, items in seeds.items():
        d = os.path.join(out, fuzzer)
        os.makedirs(d, exist_ok=True)
        for name, data in items.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)
        print(f"make_seeds: {fuzzer}: {len(items)} seeds in {d}")


if __name__ == "__main__":
    main()
