"""Small GGUF files for the tests, written with the gguf library's own writer (GGUFWriter, gguf.quants).

`gguf_from_checkpoint` turns a `make-model` folder into the GGUF file llama.cpp's converter would write
for it: llama.cpp's tensor names, q/k rows permuted for the llama architecture (the converter's
`permute`, written here from its definition: rows of a head regrouped as (2, D/2) -> (D/2, 2)), the
metadata keys, and the tokenizer's vocabulary and merges under tokenizer.ggml.*.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.numpy import load_file

HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows: within a head, row j*D/2 + i moves to 2*i + j."""
    d = rows.shape[0] // heads
    return rows.reshape(heads, 2, d // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def gguf_name(hf: str) -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def write(
    path: Path,
    arch: str,
    metadata: Callable[[GGUFWriter], None],
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
) -> Path:
    """A GGUF file at `path`: metadata written by `metadata(writer)`, tensors by llama.cpp name, each
    stored as its type (float arrays quantized with gguf.quants.quantize; uint8 arrays taken as blocks)."""
    writer = GGUFWriter(str(path), arch)
    metadata(writer)
    for name, (array, qtype) in tensors.items():
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
        elif qtype == GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float16))
        elif array.dtype == np.uint8:
            writer.add_tensor(name, array, raw_dtype=qtype)
        else:
            writer.add_tensor(name, quantize(np.asarray(array, dtype=np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tokenizer_metadata(
    folder: Path,
    pre: str = "gpt2",
    bos_id: int | None = None,
    model: str = "gpt2",
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[GGUFWriter], None]:
    """tokenizer.ggml.* from a make-model folder's tokenizer.json and tokenizer_config.json (the BOS id
    from config.json, as llama.cpp's converter takes it). `edit` may change the lists first, in place:
    {"tokens": [str], "merges": [str], "token_types": [int] or an int (written as one int32)}."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]]
    types = [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    lists: dict[str, Any] = {"tokens": tokens, "merges": merges, "token_types": types}
    if edit is not None:
        edit(lists)

    def add(w: GGUFWriter) -> None:
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.add_token_list(lists["tokens"])
        if isinstance(lists["token_types"], int):
            w.add_int32("tokenizer.ggml.token_type", lists["token_types"])
        else:
            w.add_token_types(lists["token_types"])
        w.add_token_merges(lists["merges"])
        if bos_id is not None:
            w.add_bos_token_id(bos_id)
        w.add_eos_token_id(vocab[config["eos_token"]])
        w.add_add_bos_token(tok["post_processor"]["type"] == "TemplateProcessing")
        w.add_chat_template(config["chat_template"])

    return add


def gguf_from_checkpoint(
    folder: Path,
    out: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra: Callable[[GGUFWriter], None] | None = None,
    tokenizer_model: str = "gpt2",
    pre: str = "gpt2",
    edit_tokenizer: Callable[[dict[str, Any]], None] | None = None,
    edit_tensors: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> Path:
    """`folder` (a make-model checkpoint) as the GGUF file llama.cpp's converter would write, the 2-D
    weights stored as `qtype` (norms and biases F32, as the converter keeps them). `edit_tokenizer` is
    `tokenizer_metadata`'s `edit`; `edit_tensors` may change the float tensors (by llama.cpp name, in
    place) before they are stored."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    arch = ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
    for name, array in sorted(load_file(folder / "model.safetensors").items()):
        if arch == "llama" and ".q_proj." in name:
            array = llama_cpp_permute(array, heads)
        elif arch == "llama" and ".k_proj." in name:
            array = llama_cpp_permute(array, kv_heads)
        tensors[gguf_name(name)] = (array, qtype if array.ndim == 2 else GGMLQuantizationType.F32)
    if edit_tensors is not None:
        arrays = {name: np.array(array, dtype=np.float32) for name, (array, _) in tensors.items()}
        edit_tensors(arrays)
        tensors = {name: (arrays[name], qt) for name, (_, qt) in tensors.items()}
    tokenizer = tokenizer_metadata(folder, pre, config.get("bos_token_id"), tokenizer_model, edit_tokenizer)

    def metadata(w: GGUFWriter) -> None:
        w.add_block_count(config["num_hidden_layers"])
        w.add_context_length(config["max_position_embeddings"])
        w.add_embedding_length(config["hidden_size"])
        w.add_feed_forward_length(config["intermediate_size"])
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_key_length(config["head_dim"])
        w.add_value_length(config["head_dim"])
        w.add_rope_dimension_count(config["head_dim"])
        w.add_rope_freq_base(config["rope_theta"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_vocab_size(config["vocab_size"])
        tokenizer(w)
        if extra is not None:
            extra(w)

    return write(out, arch, metadata, tensors)


def gguf_of_types(
    folder: Path,
    out: Path,
    types: dict[str, GGMLQuantizationType],
    blocks: Callable[[GGMLQuantizationType, int, int], np.ndarray],
    hidden: int = 256,
    inter: int = 512,
    layers: int = 2,
) -> Path:
    """A llama GGUF file of `hidden` x `inter` shapes (4 heads, 2 KV heads of hidden / 4) with the
    tokenizer of make-model `folder`: each 2-D tensor (llama.cpp name; `types` gives its type,
    default Q8_0) filled by `blocks(type, rows, cols)` (uint8 blocks, or floats for F32 / F16), norms
    F32 ones. q/k rows are whatever `blocks` makes (random weights need no permutation)."""
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    vocab, heads, kv_heads, head_dim = config["vocab_size"], 4, 2, hidden // 4
    shapes = {"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden),
            f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_output.weight": (hidden, heads * head_dim),
            f"blk.{i}.ffn_gate.weight": (inter, hidden),
            f"blk.{i}.ffn_up.weight": (inter, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, inter),
        }
    tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}
    for name, (rows, cols) in shapes.items():
        qtype = types.get(name, GGMLQuantizationType.Q8_0)
        tensors[name] = (blocks(qtype, rows, cols), qtype)
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{i}.{norm}.weight"] = (np.ones(hidden, np.float32), GGMLQuantizationType.F32)
    tensors["output_norm.weight"] = (np.ones(hidden, np.float32), GGMLQuantizationType.F32)
    tokenizer = tokenizer_metadata(folder, "gpt2", config.get("bos_token_id"))

    def metadata(w: GGUFWriter) -> None:
        w.add_block_count(layers)
        w.add_context_length(config["max_position_embeddings"])
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(inter)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(config["rope_theta"])
        w.add_layer_norm_rms_eps(config["rms_norm_eps"])
        w.add_vocab_size(vocab)
        tokenizer(w)

    return write(out, "llama", metadata, tensors)


# A tiny SentencePiece-style vocabulary (tokenizer.ggml.model "llama"), as llama.cpp's converter lays
# out Llama 2's: <unk>, <s>, </s>, the 256 byte pieces <0x00>..<0xFF>, then pieces by score (merged
# pieces first, highest score first; single characters last), a user-defined and a control token.
SP_PIECES = [
    "▁hello", "▁world", "▁the", "llo", "▁h", "▁w", "or", "he", "ll", "th", "▁t", "ld", "▁▁", "12", "日本",
    "▁", "e", "h", "l", "o", "w", "r", "d", "t", "1", "2", "3", "日", "本", "a", "n", "i", "s",
]  # fmt: skip
SP_USER_DEFINED = "<|tool|>"
SP_CONTROL = "<|end|>"


def sentencepiece_tokens() -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of the tiny vocabulary above (gguf.TokenType values)."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL, *[TokenType.BYTE] * 256]
    types += [TokenType.NORMAL] * len(SP_PIECES)
    scores = [0.0] * 259 + [-float(i) for i in range(len(SP_PIECES))]
    tokens += [SP_USER_DEFINED, SP_CONTROL, "<unused0>"]
    types += [TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.UNUSED]
    scores += [0.0, 0.0, 0.0]
    return tokens, scores, [int(t) for t in types]


def write_sentencepiece(path: Path, **flags: bool) -> Path:
    """A GGUF file holding the tiny SentencePiece vocabulary and a llama config of one small layer
    (enough for transformers' AutoTokenizer and AutoConfig); `flags` set tokenizer.ggml.<name>
    (add_bos_token, add_eos_token, add_space_prefix), absent when not given."""
    tokens, scores, types = sentencepiece_tokens()

    def metadata(w: GGUFWriter) -> None:
        w.add_block_count(1)
        w.add_context_length(64)
        w.add_embedding_length(64)
        w.add_feed_forward_length(128)
        w.add_head_count(2)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        for name, value in flags.items():
            w.add_bool(f"tokenizer.ggml.{name}", value)
        w.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}")

    return write(
        path,
        "llama",
        metadata,
        {"token_embd.weight": (np.zeros((len(tokens), 64)), GGMLQuantizationType.F32)},
    )


def split_gguf(source: Path, prefix: Path, parts: int, first_without_tensors: bool = False) -> list[Path]:
    """`source` rewritten as llama.cpp's `gguf-split --split` lays a model out: `parts` files named
    `<prefix>-0000i-of-0000n.gguf`, the first holding every key of `source`, each holding `split.no`
    (u16, 0-based), `split.count` (u16) and `split.tensors.count` (i32) and a consecutive share of the
    tensors (none in the first with `first_without_tensors`, as `--no-tensor-first-split` does)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    tensors = list(reader.tensors)
    carriers = parts - 1 if first_without_tensors else parts
    per = -(-len(tensors) // carriers)
    shares = [tensors[i * per : (i + 1) * per] for i in range(carriers)]
    if first_without_tensors:
        shares.insert(0, [])
    paths: list[Path] = []
    for no, share in enumerate(shares):
        path = prefix.with_name(f"{prefix.name}-{no + 1:05d}-of-{parts:05d}.gguf")
        writer = GGUFWriter(str(path), str(reader.fields["general.architecture"].contents()))
        if no == 0:
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":
                    continue
                sub = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
                writer.add_key_value(key, field.contents(), field.types[0], sub)
        else:
            del writer.kv_data[0]["general.architecture"]  # the other parts hold only the split keys
        writer.add_key_value("split.no", no, GGUFValueType.UINT16)
        writer.add_key_value("split.count", parts, GGUFValueType.UINT16)
        writer.add_key_value("split.tensors.count", len(tensors), GGUFValueType.INT32)
        for tensor in share:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        paths.append(path)
    return paths
