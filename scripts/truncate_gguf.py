#!/usr/bin/env python3
"""Writes a copy of a GGUF model keeping only its first N blocks (layers): the tokenizer, chat template and every
other metadata key stay, `<arch>.block_count` becomes N. Used to carry a real tokenizer with a small model to the
GPU machines (`SERVE_MODEL=smol2l.gguf scripts/gpu/run.sh serve`, carrying build/models: SmolLM2 with 2 of its 30 layers is
21 MB instead of 98).

  python3 scripts/truncate_gguf.py IN.gguf OUT.gguf --blocks 2      (needs the `gguf` package: pip install gguf)
"""
import argparse
import re

import gguf


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--blocks", type=int, default=2)
    a = ap.parse_args()
    r = gguf.GGUFReader(a.src)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = gguf.GGUFWriter(a.dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        t = f.types[0]
        if name == f"{arch}.block_count":
            w.add_uint32(name, a.blocks)
        elif t == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == gguf.GGUFValueType.STRING:
                vals = [bytes(f.parts[i]).decode("utf-8", errors="surrogateescape") for i in f.data]
            else:
                vals = [f.parts[i].tolist()[0] for i in f.data]
            w.add_array(name, vals)
        elif t == gguf.GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[-1]).decode("utf-8", errors="surrogateescape"))
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], t)
    for tensor in r.tensors:
        m = re.match(r"blk\.(\d+)\.", tensor.name)
        if m and int(m.group(1)) >= a.blocks:
            continue
        # The reader gives quantized tensors as their bytes per row; the writer derives the shape back from them.
        w.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
