#!/usr/bin/env python3
"""Makes the tokenizer and chat-template fixtures of tests/tokenizer_test.cpp.

    pip install transformers tokenizers gguf sentencepiece protobuf jinja2
    bash scripts/fetch_models.sh
    python3 tests/data/tokenizer/make_fixtures.py        # writes tests/data/tokenizer/*.json

References
- Real models (SmolLM2-135M-Instruct Q4_1, Gemma-3-270M Q4_K_M from $TESSERA_MODELS): the Hugging Face
  `tokenizers` tokenizer that transformers builds from the GGUF (transformers.integrations.gguf: the same code
  AutoTokenizer.from_pretrained(dir, gguf_file=...) runs; called directly because AutoTokenizer's GGUF reader
  imports torch). Two corrections/cross-checks:
  * SmolLM2: transformers does not know the GGUF pre-tokenizer name "smollm" and falls back to plain GPT-2
    ByteLevel. SmolLM2's own tokenizer.json (and llama.cpp's "smollm") first splits every digit on its own:
    Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)]. We set that.
  * Gemma-3: the ids are also produced by the `sentencepiece` library from a SentencePiece model rebuilt from the
    GGUF (pieces, scores, types; BPE, byte fallback, identity normalizer, no dummy prefix) -- Gemma's original
    tokenizer type -- and the two references must agree for the fixture to be written.
- Pre-tokenizer pieces: tokenizers' Split pre-tokenizer with each named regex (gpt2, llama3, qwen2, smollm).
- Tiny tokenizer.json files: trained here with `tokenizers` (byte-level BPE, Llama-3 regex; Qwen2 regex + NFC).
- Tiny SentencePiece: trained here with `sentencepiece` (BPE, byte fallback, dummy prefix), exported as GGUF-style
  metadata JSON; ids from sentencepiece itself.
- Chat templates: the models' own Jinja templates (SmolLM2's from its GGUF, the others in templates/) rendered with
  transformers' render_jinja_template (jinja2, trim_blocks, lstrip_blocks, as apply_chat_template does).
"""
import json
import os
import sys
import tempfile
from pathlib import Path

import gguf
import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
from transformers.utils.chat_template_utils import render_jinja_template

HERE = Path(__file__).resolve().parent
MODELS = Path(os.environ.get("TESSERA_MODELS", Path.home() / ".cache" / "tessera" / "models"))
SMOLLM2 = "smollm2-135m-instruct-q4_1.gguf"
GEMMA3 = "gemma-3-270m-q4_k_m.gguf"

TEXTS = [
    "",
    "Hello world",
    "Hello, world! How are you doing today?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "   three leading spaces and two trailing  ",
    "multiple     spaces    between words",
    "tabs\tand\t\ttabs\t",
    "line one\nline two\n\nline four\r\nwindows line\n\n\n",
    "\n\n\n",
    " ",
    "  \t \n ",
    "I'm sure you're right; they'll see it's done, we've said I'd go. DON'T SHOUT'S",
    "Numbers: 0 1 12 123 1234 12345 1234567890 3.14159 -42 1,000,000 2024-01-31",
    "Price $19.99 (20% off) vs. €15,50 or £12 — ¥1000",
    "Accents: café naïve résumé Ångström jalapeño façade Über straße",
    "Decomposed: cafe\u0301 nai\u0308ve",
    "中文测试：你好，世界！这是一个句子。",
    "日本語のテキスト、カタカナとひらがな。漢字も。",
    "한국어 문장입니다. 안녕하세요!",
    "Emoji: 😀 😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ 🤖",
    "שלום עולם, זה טקסט בעברית.",
    "مرحبا بالعالم، هذا نص عربي.",
    "Русский текст: Привет, мир! Ёжик.",
    "Ελληνικά: Γειά σου Κόσμε",
    "हिन्दी पाठ: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    "Mixed: abc中文def😀123ghi",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * b[i]; }  // dot",
    "<html><body><div class=\"x\">Text &amp; more</div></body></html>",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "https://example.com/path?query=value&other=123#frag",
    "user@example.com, +1-555-0100",
    "Special: <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>after end of text",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos<eos>",
    "Not special: <|im_start |> <im_start> <start_of_turn",
    "Unicode spaces:\u00a0nbsp\u2003emsp\u3000ideographic\u2009thin\u200bzwsp\ufeffbom",
    "NEL:\u0085next line\u2028line sep\u2029para sep",
    "Control chars:\x01\x02\x1b[0m\x7f",
    "Math: ∑ ∫ √ ∞ ≠ ≤ ≥ π ∂ ∇ ⊗ ℝ",
    "Superscripts ² ³ ½ ¼ Ⅻ ⑦ ٣ ३",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ababababababababababababababababab",
    "!!!???...,,,;;;:::---___===+++***",
    "Zalgo: Z\u0351\u036b\u0343\u036a\u0302\u036b\u033d\u034f\u0334\u0319\u0324\u031e\u0349\u035a\u032f\u031e\u0320\u034dA\u036b\u0357\u0334\u0362",
    "    indented with four spaces\n        and eight\n",
    "CamelCaseWordsAndSnake_case_words and kebab-case-words",
    "The year 1999 and 2000000 and 42nd street, 3rd place, 1st!",
    "It's 5 o'clock; '90s music; 'quoted'",
    "word" * 50,
    " ".join(["lorem", "ipsum", "dolor", "sit", "amet"] * 20),
]

# Conversations for the chat-template fixtures.
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  And 3+3?  \n"},
    ],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke\nabout cats."},
    ],
    [{"role": "user", "content": "Unicode: café 中文 😀"}, {"role": "assistant", "content": " spaced reply "}],
    [],
]


def load_gguf_tokenizer_dict(path):
    fields = gguf.GGUFReader(str(path)).fields
    md = {k: fields[k].contents() for k in fields if k.startswith("tokenizer.") or k == "general.architecture"}
    tok = {name: md["tokenizer." + key] for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
           if "tokenizer." + key in md}
    return md, tok


def real_model_fixture(file, fix):
    md, tok = load_gguf_tokenizer_dict(MODELS / file)
    backend, _ = convert_gguf_tokenizer(md["general.architecture"], tok)
    fix(backend)
    parse = Tokenizer.from_str(backend.to_str())
    parse.encode_special_tokens = False
    noparse = Tokenizer.from_str(backend.to_str())
    noparse.encode_special_tokens = True
    cases = []
    for text in TEXTS:
        ids = parse.encode(text, add_special_tokens=False).ids
        ids_plain = noparse.encode(text, add_special_tokens=False).ids
        cases.append({"text": text, "ids": ids, "ids_no_parse_special": ids_plain,
                      "decoded": parse.decode(ids, skip_special_tokens=False)})
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", md["tokenizer.ggml.model"] == "llama"))
    return md, noparse, {
        "model": file,
        "tokenizer_model": md["tokenizer.ggml.model"],
        "pre": md.get("tokenizer.ggml.pre"),
        "vocab_size": len(tok["tokens"]),
        "bos": md.get("tokenizer.ggml.bos_token_id"),
        "eos": md.get("tokenizer.ggml.eos_token_id"),
        "add_bos": add_bos,
        "cases": cases,
    }


def fix_smollm2(backend):
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def sentencepiece_from_gguf(md):
    """Gemma's SentencePiece model rebuilt from GGUF metadata (user-defined pieces spell spaces as U+2581)."""
    m = sp_pb.ModelProto()
    m.trainer_spec.model_type = sp_pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    piece = sp_pb.ModelProto.SentencePiece
    kinds = {1: piece.NORMAL, 2: piece.UNKNOWN, 3: piece.CONTROL, 4: piece.USER_DEFINED, 5: piece.UNUSED,
             6: piece.BYTE}
    for text, score, kind in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"],
                                 md["tokenizer.ggml.token_type"]):
        p = m.pieces.add()
        p.piece = text.replace(" ", "\u2581") if kind == 4 else text
        p.score = score
        p.type = kinds[kind]
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def pretokenizer_fixture():
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    split = lambda rx: pre_tokenizers.Split(Regex(rx), behavior="isolated")
    named = {
        "gpt2": split(gpt2),
        "llama3": split(GGUF_PRE_TOKENIZER_SPLITS["llama3"]),
        "qwen2": split(GGUF_PRE_TOKENIZER_SPLITS["qwen2"]),
        "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split(gpt2)]),
    }
    return {name: [{"text": t, "pieces": [p for p, _ in pt.pre_tokenize_str(t)]} for t in TEXTS if t]
            for name, pt in named.items()}


CORPUS = [t for t in TEXTS if t] + [
    "the cat sat on the mat and the dog sat on the log",
    "tokenizers merge frequent pairs of bytes into new tokens",
    "numbers like 100 200 300 and 1234 appear in text",
    "Ünïcödé characters appear too: ĉu vi parolas Esperanton?",
] * 3


def tiny_hf_tokenizers():
    """Two small byte-level BPE tokenizer.json files and their reference ids."""
    out = {}
    specs = {
        "tiny_llama3": (pre_tokenizers.Split(Regex(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            behavior="isolated"), None),
        "tiny_qwen2": (pre_tokenizers.Split(Regex(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            behavior="isolated"), normalizers.NFC()),
    }
    for name, (split, normalizer) in specs.items():
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizer
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                     use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=700, min_frequency=2, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|begin|>", "<|end|>", "<|im_start|>", "<|im_end|>"])
        tok.train_from_iterator(CORPUS, trainer)
        tok.add_tokens(["<think>"])  # a non-special added token: always matched whole
        begin = tok.token_to_id("<|begin|>")
        tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", begin)])
        j = json.loads(tok.to_str())
        if name == "tiny_qwen2":  # the older merges spelling: "a b" strings
            j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
        (HERE / f"{name}_tokenizer.json").write_text(json.dumps(j, ensure_ascii=False, indent=None) + "\n")
        tok = Tokenizer.from_str(json.dumps(j))
        texts = TEXTS + ["<think>reasoning</think> <|im_start|>x<|im_end|>"]
        out[name] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids,
                      "ids_with_bos": tok.encode(t).ids} for t in texts]
    return out


def tiny_sentencepiece():
    """A small SentencePiece BPE model (byte fallback, dummy prefix) as GGUF-style metadata, with reference ids."""
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text("\n".join(t.replace("\n", " ") for t in CORPUS if "\x00" not in t) + "\n")
        spm.SentencePieceTrainer.train(
            input=str(corpus), model_prefix=str(Path(tmp) / "tiny"), model_type="bpe", vocab_size=800,
            byte_fallback=True, character_coverage=0.98, normalization_rule_name="identity",
            remove_extra_whitespaces=False, add_dummy_prefix=True, user_defined_symbols=["<ud>", "\n\n"],
            control_symbols=["<ctrl>"], bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
        sp = spm.SentencePieceProcessor(model_file=str(Path(tmp) / "tiny.model"))
    kinds = []
    for i in range(sp.get_piece_size()):
        kinds.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
                     else 5 if sp.is_unused(i) else 4 if sp.id_to_piece(i) in ("<ud>", "\n\n") else 1)
    metadata = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(sp.get_piece_size())],
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
    }
    texts = [t for t in TEXTS if "<ctrl>" not in t] + ["x<ud>y \n\n z", "Ünïcödé ĉu 😀 中"]
    cases = [{"text": t, "ids": sp.encode(t), "decoded": sp.decode(sp.encode(t))} for t in texts]
    return {"metadata": metadata, "cases": cases}


def chat_fixture(smollm2_md, gemma3_md):
    templates = {
        "smollm2": (smollm2_md["tokenizer.chat_template"], "<|im_start|>", "<|im_end|>"),
        "qwen2": ((HERE / "templates/qwen2.jinja").read_text(), "", "<|im_end|>"),
        "llama3": ((HERE / "templates/llama3.jinja").read_text(), "<|begin_of_text|>", "<|eot_id|>"),
        "llama31": ((HERE / "templates/llama31.jinja").read_text(), "<|begin_of_text|>", "<|eot_id|>"),
        "gemma3": ((HERE / "templates/gemma3.jinja").read_text(), "<bos>", "<eos>"),
        "mistral": ((HERE / "templates/mistral.jinja").read_text(), "<s>", "</s>"),
    }
    out = {}
    for name, (template, bos, eos) in templates.items():
        cases = []
        for conv in CONVERSATIONS:
            for gen in (True, False):
                try:
                    rendered, _ = render_jinja_template(conversations=[conv], chat_template=template,
                                                        add_generation_prompt=gen, bos_token=bos, eos_token=eos)
                    cases.append({"messages": conv, "add_generation_prompt": gen, "expected": rendered[0]})
                except Exception as e:  # the template rejects this conversation (jinja2 TemplateError)
                    cases.append({"messages": conv, "add_generation_prompt": gen, "error": str(e)})
        out[name] = {"template": template, "bos_token": bos, "eos_token": eos, "cases": cases}
    return out


def dumps(obj, depth=0):
    """JSON with one line per case: nested objects and lists of objects are broken up, lists of scalars not."""
    pad = " " * depth
    if isinstance(obj, dict) and depth < 4:
        items = [f"{pad} {json.dumps(k, ensure_ascii=False)}: {dumps(v, depth + 1).lstrip()}" for k, v in obj.items()]
        return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and all(isinstance(x, (dict, list)) for x in obj) and depth < 4:
        return pad + "[\n" + ",\n".join(dumps(x, depth + 1) for x in obj) + "\n" + pad + "]"
    return pad + json.dumps(obj, ensure_ascii=False)


def main():
    for f in (SMOLLM2, GEMMA3):
        if not (MODELS / f).exists():
            sys.exit(f"{MODELS / f} is missing: run scripts/fetch_models.sh")
    smollm2_md, _, smollm2 = real_model_fixture(SMOLLM2, fix_smollm2)
    gemma3_md, gemma_noparse, gemma3 = real_model_fixture(GEMMA3, lambda b: None)

    # Gemma-3 cross-check against the sentencepiece library (which never parses control tokens in text).
    sp = sentencepiece_from_gguf(gemma3_md)
    bad = [c["text"] for c in gemma3["cases"] if sp.encode(c["text"]) != c["ids_no_parse_special"]]
    if bad:
        sys.exit(f"transformers and sentencepiece disagree on Gemma-3 for {bad!r}")

    # Chat prompts tokenized end to end (template rendered by jinja2, encoded with special tokens parsed).
    chats = chat_fixture(smollm2_md, gemma3_md)
    for fixture, name in ((smollm2, "smollm2"), (gemma3, "gemma3")):
        tok = Tokenizer.from_str(gemma_noparse.to_str()) if name == "gemma3" else None
        if tok is None:
            md, t = load_gguf_tokenizer_dict(MODELS / SMOLLM2)
            tok, _ = convert_gguf_tokenizer(md["general.architecture"], t)
            fix_smollm2(tok)
        tok.encode_special_tokens = False
        fixture["chat"] = [{"messages": c["messages"], "prompt": c["expected"],
                            "ids": tok.encode(c["expected"], add_special_tokens=False).ids}
                           for c in chats[name]["cases"] if "expected" in c and c["add_generation_prompt"]]

    write = lambda name, obj: (HERE / name).write_text(dumps(obj) + "\n")
    write("smollm2_ids.json", smollm2)
    write("gemma3_ids.json", gemma3)
    write("pretokenizer_pieces.json", pretokenizer_fixture())
    write("tiny_hf_ids.json", tiny_hf_tokenizers())
    write("tiny_sentencepiece.json", tiny_sentencepiece())
    write("chat_templates.json", chats)
    print("fixtures written to", HERE)


if __name__ == "__main__":
    main()
