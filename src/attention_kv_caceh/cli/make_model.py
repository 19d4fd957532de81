"""`attention-kv-caceh make-model`: write a seeded random Hugging Face checkpoint folder, no download.

Calls `toy_model.make_model.write_random_checkpoint` (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) and prints the folder, the parameter count and the bytes written. The files are
written into a temporary folder beside `--out` and moved into place at the end, so an interrupted run
leaves no half-written checkpoint.

`--out` must be new or an empty folder. A non-empty folder is refused (exit 2) unless `--force`; then
the checkpoint's four files replace those of the same name, and every other weight file a loader would
read (`*.safetensors`, `model.safetensors.index.json`) is deleted first and listed, so the tensors of two
checkpoints never mix. Other files in the folder are left as they are.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from attention_kv_caceh.cli.common import CommandFailed, UsageError, nonnegative_int

__all__ = ["HELP", "add_arguments", "run", "stale_weight_files"]

HELP = "write a random Llama/Qwen2/Qwen3 checkpoint (Hugging Face layout) for the engine, no download"

_ARCHS = ("llama", "qwen2", "qwen3")
_PRESETS = ("tiny", "small")
_DTYPES = ("float32", "float16", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `make-model`: --out, --arch, --preset, --seed, --dtype, --force."""
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder to write; must be new or empty unless --force (default: none, required)",
    )
    parser.add_argument("--arch", choices=_ARCHS, default="llama", help="model family")
    parser.add_argument(
        "--preset",
        choices=_PRESETS,
        default="tiny",
        help="shapes: tiny (~0.5 M parameters, for tests) or small (~100-125 M, for benchmarks)",
    )
    parser.add_argument(
        "--seed",
        type=nonnegative_int,
        default=0,
        help="weights seed; the same flags write the same bytes (default: 0)",
    )
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="dtype of the tensors on disk")
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a non-empty --out: replaces the checkpoint's files and deletes the other "
        "*.safetensors and model.safetensors.index.json there first (default: refuse)",
    )


def stale_weight_files(folder: Path) -> list[Path]:
    """Files in `folder` a checkpoint loader would read as weights: `*.safetensors` and the shard index."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and (p.suffix == ".safetensors" or p.name == "model.safetensors.index.json")
    )


def _check_out(out: Path, force: bool) -> bool:
    """Raise UsageError for an --out that cannot take the checkpoint; return whether it is non-empty."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r} exists and is not a folder")
    nonempty = out.is_dir() and any(out.iterdir())
    if nonempty and not force:
        raise UsageError(
            f"--out {str(out)!r} is a non-empty folder; choose a new one or pass --force to replace "
            "the checkpoint files there"
        )
    # The checkpoint is staged in a folder beside --out, then moved into it: both places must take a
    # new folder. Tested by creating and removing one (root passes os.access everywhere, even in /proc).
    places = [out.absolute().parent] + ([out] if out.is_dir() else [])
    for place in places:
        target = next((p for p in [place, *place.parents] if p.exists()), None)
        if target is None or not target.is_dir():
            raise UsageError(f"--out {str(out)!r}: cannot create or write a folder there")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".write-test.", dir=target))
        except OSError as exc:
            raise UsageError(
                f"--out {str(out)!r}: cannot create or write a folder there ({exc.strerror or exc})"
            ) from None
    return nonempty


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _count_parameters(folder: Path) -> int:
    """Elements of every tensor in the folder's safetensors files (a tied LM head is stored once)."""
    from attention_kv_caceh.engine.checkpoint import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(folder)
    total = 0
    for name in ckpt.names:
        n = 1
        for s in ckpt.shape(name):
            n *= s
        total += n
    return total


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint and print what was written; UsageError for an unusable --out (nothing
    written), CommandFailed when writing fails."""
    out = Path(args.out)
    nonempty = _check_out(out, args.force)

    from attention_kv_caceh.memory import format_bytes
    from attention_kv_caceh.toy_model.make_model import write_random_checkpoint

    removed: list[Path] = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as exc:
        raise CommandFailed(f"could not write --out {str(out)!r}: {exc}") from None
    names: list[str] = []
    try:
        write_random_checkpoint(staging, arch=args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype)
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
        # the hidden staging folder is ours, not the user's: the message names --out only
        reason = (exc.strerror if exc.filename else None) or str(exc)
        reason = reason.replace(str(staging), str(out))
        raise CommandFailed(f"could not write --out {str(out)!r}: {reason}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    written = [out / name for name in names]
    for p in removed:
        print(f"removed {p} (weights of the checkpoint that was there)")
    size = sum(p.stat().st_size for p in written)
    print(
        f"wrote {out}: {args.arch} {args.preset}, seed {args.seed}, {args.dtype}, "
        f"{_count_parameters(out):,} parameters, {size:,} bytes ({format_bytes(size)})"
    )
    for p in written:
        print(f"  {p.name:<24} {p.stat().st_size:>12,} bytes")
    return 0
