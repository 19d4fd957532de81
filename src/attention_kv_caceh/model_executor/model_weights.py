"""How `Model` reads its weights from a checkpoint and keeps them: floats, bfloat16 panels or GGUF blocks.

What vLLM's `model_loader` and `LinearMethodBase.create_weights` do between them, at this project's
size: every tensor is read once; norms, biases and the embedding table become arrays of the compute
dtype; each linear layer (q/k/v and gate/up fused row-wise, as the model multiplies them) becomes a
`layers.LinearWeight` in the model's weight format (`dispatch.weight_format`). With quantization "gguf"
(vLLM's name for a GGUF checkpoint) every tensor is kept as the file's own bytes
(`GGUFCheckpoint.quantized`) for `block_gemm`'s kernels, whatever its type among
`block_formats.BLOCK_FORMATS` (Q4_0 to Q8_0, the k-quants, F32, F16, BF16); a fused layer whose parts
the file stores in different types (a Q4_K_M file's Q4_K q/k and Q6_K v) keeps one block weight per
part. A tensor of another type (the IQ family), or a float type whose rows are not whole chunks of 32,
is dequantized and packed as float32 panels, and a note names it and says why (logged, and listed in
`notes`). The embedding table stays in blocks too, and a token's row is decoded when it is looked up;
a tied LM head then is the same blocks.

Shape legend: V vocabulary, D_model hidden size.

Left out: tensor-parallel sharding of each weight (vLLM's per-parameter `weight_loader`), quantization methods
other than GGUF blocks (AWQ, GPTQ, FP8, bitsandbytes), and vLLM's `process_weights_after_loading` repacking
for other backends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.kernels.block_formats import FORMATS, dequantize_blocks
from attention_kv_caceh.model_executor.checkpoint import CheckpointError, SafetensorsCheckpoint
from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint, QuantizedTensor, gguf_name
from attention_kv_caceh.model_executor.layers import LinearWeight

__all__ = ["Embedding", "WeightReader", "why_not_kept"]

logger = logging.getLogger(__name__)


def why_not_kept(tensor: QuantizedTensor) -> str | None:
    """Why the block kernels cannot multiply `tensor` as the file stores it, or None when they can:
    a type outside `block_formats.BLOCK_FORMATS` (the IQ family, F64), or a 2-D float tensor whose
    rows are not whole chunks of 32 values."""
    fmt = tensor.ggml_type.lower()
    if fmt not in FORMATS:
        family = "an IQ type, " if fmt.startswith("iq") else ""
        return f"{tensor.ggml_type} is {family}not a type the block kernels decode"
    if len(tensor.shape) != 2 or tensor.shape[1] % FORMATS[fmt].chunk:
        return f"{tensor.ggml_type} rows of {tensor.shape[-1]} values are not whole chunks of {FORMATS[fmt].chunk}"
    return None


FloatArray = npt.NDArray[np.floating[Any]]


@dataclass(frozen=True)
class Embedding:
    """The token embedding table `[V, D_model]`: `table` (floats of the compute dtype) or `blocks` (a
    GGUF block format's bytes `[V, D_model / 32 * block bytes]`, `format`), exactly one set."""

    table: FloatArray | None
    blocks: npt.NDArray[np.uint8] | None
    format: str
    dtype: np.dtype[Any]
    shape: tuple[int, int]

    def lookup(self, input_ids: npt.NDArray[np.integer[Any]]) -> FloatArray:
        """Rows `[N, D_model]` of token ids `[N]`, in the compute dtype (blocks: decoded row by row)."""
        if self.blocks is not None:
            return dequantize_blocks(self.blocks[input_ids], self.format).astype(self.dtype)
        assert self.table is not None
        return self.table[input_ids]

    @property
    def size(self) -> int:
        """V * D_model: the parameters."""
        return self.shape[0] * self.shape[1]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's row as stored (what a lookup reads)."""
        if self.blocks is not None:
            return int(self.blocks.shape[1])
        assert self.table is not None
        return self.shape[1] * self.table.itemsize


@dataclass
class WeightReader:
    """Reads `checkpoint`'s tensors for a Model: `tensor` (floats of `dtype`, shape checked), `linear`
    (fused rows in the weight format `fmt` for GEMM `path`), `embedding`, `tied_head`.

    fmt: a `dispatch.WEIGHT_FORMATS` name, "float64" (kept as read), or "gguf" (the file's blocks).
    kernels records the formats of the packed kernels the layers use (to compile them at load), and
    notes the layers that could not keep their file's format. Raises (from the constructor)
    ValueError for "gguf" on a checkpoint that is not a GGUF file.
    """

    checkpoint: SafetensorsCheckpoint | GGUFCheckpoint
    dtype: np.dtype[Any]
    path: str
    fmt: str
    kernels: set[str] = field(default_factory=set[str])
    notes: list[str] = field(default_factory=list[str])

    def __post_init__(self) -> None:
        if self.fmt == "gguf" and not isinstance(self.checkpoint, GGUFCheckpoint):
            raise ValueError(f"quantization 'gguf' needs a GGUF checkpoint, got {self.checkpoint.source}")

    def tensor(self, name: str, shape: tuple[int, ...]) -> FloatArray:
        """Tensor `name` as floats of the compute dtype. Raises CheckpointError for a missing tensor or
        one of another shape (naming the file and key)."""
        found = self.checkpoint.shape(name)
        if found != shape:
            raise CheckpointError(
                f"{self.checkpoint.source}: tensor {name!r} has shape {found}, expected {shape}"
            )
        return self.checkpoint.get(name, self.dtype)

    def _blocks(
        self, parts: list[tuple[str, tuple[int, int]]]
    ) -> list[tuple[npt.NDArray[np.uint8], str]] | None:
        """Each part's GGUF blocks and format, when the block kernels can multiply every part as the
        file stores it; else None, with a note naming the parts that cannot and why."""
        checkpoint = self.checkpoint
        assert isinstance(checkpoint, GGUFCheckpoint)
        stored = [checkpoint.quantized(name) for name, _ in parts]
        for tensor, (name, shape) in zip(stored, parts, strict=True):
            if tensor.shape != shape:
                raise CheckpointError(
                    f"{checkpoint.source}: tensor {name!r} has shape {tensor.shape}, expected {shape}"
                )
        refused = [(t.name, why) for t in stored if (why := why_not_kept(t)) is not None]
        if refused:
            names = ", ".join(f"{name} ({gguf_name(name, checkpoint.arch)}: {why})" for name, why in refused)
            note = f"{' + '.join(name for name, _ in parts)}: dequantized to float32 panels: {names}"
            logger.warning("%s: %s", checkpoint.source, note)
            self.notes.append(note)
            return None
        # the bytes as stored (a float type's values too: F32 / F16 come as float arrays)
        return [(t.data.view(np.uint8).reshape(t.shape[0], -1), t.ggml_type.lower()) for t in stored]

    def linear(self, parts: list[tuple[str, tuple[int, int]]]) -> LinearWeight:
        """The linear layer whose weight is the tensors `parts` (name, (rows, in)) stacked row-wise."""
        if self.fmt == "gguf":
            found = self._blocks(parts)
            if found is not None:
                formats = {fmt for _, fmt in found}
                if self.path == "packed":
                    self.kernels.update(formats)
                if len(formats) == 1:
                    blocks = np.ascontiguousarray(np.concatenate([data for data, _ in found]))
                    return LinearWeight.from_blocks(blocks, found[0][1], self.path, self.dtype)
                return LinearWeight.from_parts(found, self.path, self.dtype)
        weight = np.concatenate([self.tensor(name, shape) for name, shape in parts])
        stored = "float32" if self.fmt in ("float64", "gguf") else self.fmt  # float64: kept as read
        if self.path == "packed":
            self.kernels.add(stored)
        return LinearWeight.of(weight, self.path, stored)

    def embedding(self, name: str, shape: tuple[int, int]) -> Embedding:
        """The embedding table: GGUF blocks for "gguf" when the file stores it in a block format."""
        if self.fmt == "gguf":
            found = self._blocks([(name, shape)])
            if found is not None:
                # a writable ndarray copy, as the linear layers' blocks are (one kernel signature for both)
                return Embedding(None, np.array(found[0][0]), found[0][1], self.dtype, shape)
        return Embedding(self.tensor(name, shape), None, str(self.dtype), self.dtype, shape)

    def tied_head(self, embedding: Embedding) -> LinearWeight:
        """The LM head that is the embedding table (transformers ties them): the same blocks, or the
        table packed (numpy path: the same array)."""
        if embedding.blocks is not None:
            if self.path == "packed":
                self.kernels.add(embedding.format)
            return LinearWeight.from_blocks(embedding.blocks, embedding.format, self.path, self.dtype)
        assert embedding.table is not None
        stored = "float32" if self.fmt in ("float64", "gguf") else self.fmt
        if self.path == "packed":
            self.kernels.add(stored)
        return LinearWeight.of(embedding.table, self.path, stored)
