"""MakeModelConfig and `write_checkpoint_folder`: `make-model`'s checkpoint, written so that no half of one
is ever left behind (vLLM has no counterpart: its tests download their models).

The four files of `make_model.write_random_checkpoint` are written into a hidden folder beside `out`
and moved into place at the end. Into a non-empty folder (`force`), they replace the files of the same
name, and every other weight file a loader would read (`stale_weight_files`) is deleted first, so the
tensors of two checkpoints never mix; other files are left as they are.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attention_kv_caceh.options import check_options, option

__all__ = ["MakeModelConfig", "count_parameters", "stale_weight_files", "write_checkpoint_folder"]


@dataclass(frozen=True, kw_only=True)
class MakeModelConfig:
    """The flags of `make-model`: where, which family and shapes, the seed and the dtype on disk."""

    out: str = option(
        help="folder to write; must be new or empty unless --force (default: none, required)",
        metavar="DIR",
        required=True,
    )
    arch: str = option(
        "llama",
        help="model family (gemma3: sliding-window layers beside global ones, a window of 64 tokens "
        "in tiny, 512 in small)",
        choices=("llama", "qwen2", "qwen3", "gemma3"),
    )
    preset: str = option(
        "tiny",
        help="shapes: tiny (~0.5 M parameters, for tests) or small (~100-125 M, for benchmarks)",
        choices=("tiny", "small"),
    )
    seed: int = option(
        0, help="weights seed; the same flags write the same bytes (default: 0)", metavar="SEED", minimum=0
    )
    dtype: str = option(
        "float32", help="dtype of the tensors on disk", choices=("float32", "float16", "bfloat16")
    )
    force: bool = option(
        False,
        help="write into a non-empty --out: replaces the checkpoint's files and deletes the other "
        "*.safetensors and model.safetensors.index.json there first (default: refuse)",
    )

    def __post_init__(self) -> None:
        check_options(self)


def stale_weight_files(folder: Path) -> list[Path]:
    """Files in `folder` a checkpoint loader would read as weights: `*.safetensors` and the shard index."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json")
    )


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_checkpoint_folder(config: MakeModelConfig) -> tuple[list[Path], list[Path]]:
    """Write the checkpoint into `config.out` (new, empty, or non-empty with `force`; the caller checked
    which); returns the files written and the stale weight files removed.

    Raises:
        OSError: writing failed; its message names `out`, never the hidden staging folder.
    """
    from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

    out = Path(config.out)
    nonempty = out.is_dir() and any(out.iterdir())
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    removed: list[Path] = []
    try:
        write_random_checkpoint(
            staging, arch=config.arch, preset=config.preset, seed=config.seed, dtype=config.dtype
        )
        names = sorted(f.name for f in staging.iterdir())
        mask = _umask()  # mkdtemp makes a private 0700 folder, safetensors a 0600 file: use the usual modes
        staging.chmod(0o777 & ~mask)
        for name in names:
            (staging / name).chmod(0o666 & ~mask)
        if nonempty:
            removed = [p for p in stale_weight_files(out) if p.name not in names]
            for p in removed:
                p.unlink()
        if out.is_dir():
            for name in names:
                os.replace(staging / name, out / name)
        else:
            os.replace(staging, out)
    except OSError as exc:
        # the hidden staging folder is ours, not the user's: the message names out only
        reason = (exc.strerror if exc.filename else None) or str(exc)
        raise OSError(reason.replace(str(staging), str(out))) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [out / name for name in names], removed


def count_parameters(folder: Path) -> int:
    """Elements of every tensor in the folder's safetensors files (a tied LM head is stored once)."""
    from attention_kv_caceh.model_executor.checkpoint import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(folder)
    total = 0
    for name in ckpt.names:
        n = 1
        for s in ckpt.shape(name):
            n *= s
        total += n
    return total
