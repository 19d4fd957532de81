"""`attention-kv-caceh make-model`: write a seeded random Hugging Face checkpoint folder, no download.

Calls `toy_model.folder.write_checkpoint_folder` (the files of `toy_model.make_model.
write_random_checkpoint`: config.json, model.safetensors, tokenizer.json, tokenizer_config.json) and
prints the folder, the parameter count and the bytes written. The files are written into a temporary
folder beside `--out` and moved into place at the end, so an interrupted run leaves no half-written
checkpoint.

`--out` must be new or an empty folder. A non-empty folder is refused (exit 2) unless `--force`; then
the checkpoint's four files replace those of the same name, and every other weight file a loader would
read (`*.safetensors`, `model.safetensors.index.json`) is deleted first and listed, so the tensors of two
checkpoints never mix. Other files in the folder are left as they are.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from attention_kv_caceh.cli.common import CommandFailed, UsageError
from attention_kv_caceh.cli.flags import add_options, config_from_args
from attention_kv_caceh.toy_model.folder import MakeModelConfig, stale_weight_files

__all__ = ["HELP", "add_arguments", "run", "stale_weight_files"]

HELP = "write a random Llama/Qwen2/Qwen3/Gemma 3 checkpoint (Hugging Face layout) for the engine, no download"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `make-model`: MakeModelConfig's fields (--out, --arch, --preset, --seed, --dtype, --force)."""
    add_options(parser, MakeModelConfig)


def _check_out(out: Path, force: bool) -> None:
    """Raise UsageError for an --out that cannot take the checkpoint."""
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


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint and print what was written; UsageError for an unusable --out (nothing
    written), CommandFailed when writing fails."""
    config = config_from_args(MakeModelConfig, args)
    out = Path(config.out)
    _check_out(out, config.force)

    from attention_kv_caceh.memory import format_bytes
    from attention_kv_caceh.toy_model.folder import count_parameters, write_checkpoint_folder

    try:
        written, removed = write_checkpoint_folder(config)
    except OSError as exc:
        raise CommandFailed(f"could not write --out {str(out)!r}: {exc}") from None
    for p in removed:
        print(f"removed {p} (weights of the checkpoint that was there)")
    size = sum(p.stat().st_size for p in written)
    print(
        f"wrote {out}: {config.arch} {config.preset}, seed {config.seed}, {config.dtype}, "
        f"{count_parameters(out):,} parameters, {size:,} bytes ({format_bytes(size)})"
    )
    for p in written:
        print(f"  {p.name:<24} {p.stat().st_size:>12,} bytes")
    return 0
