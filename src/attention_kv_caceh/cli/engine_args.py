"""The engine flag group and the up-front checks `generate` and `serve` share before they load any weight.

The engine flags are EngineConfig's fields (`engine/config.py`, vLLM's names, declared with
`options.option`); `add_engine_arguments` puts them on `generate`, `serve`, `bench-engine` (a subset: it
sizes its own KV pool) and `harness --backend engine` (which passes the ones given on to `serve`).

Both commands build an engine from a checkpoint (`model_executor.model_source`: a model name such as `smollm2`, a
GGUF file, a folder holding one, or a Hugging Face folder) and the same engine flags. Everything that can
be refused from the flags, the checkpoint's config (`config.json` or the GGUF metadata) and its tokenizer
alone is refused here, with the same exit code in both commands: a --model that names no checkpoint, a
config, GGUF file or tokenizer the engine cannot read or does not implement, a flag combination
EngineConfig refuses, a `--max-model-len` above the checkpoint's, a KV cache that holds no block, a KV
cache larger than the memory a run may plan to use (`memory.check_memory`, the project's one memory check;
without it a huge `--kv-cache-memory` or `--num-kv-blocks` fails in NumPy's allocation), and (generate) a
request whose prompt plus max_tokens can never fit the KV pool. These are UsageErrors (exit 2); what fails
later, while the weights are read (a missing tensor, a truncated safetensors file), is exit 1.

The block count found here is passed on to the engine (`EnginePlan.engine_config` fixes `num_kv_blocks`),
so the engine gets exactly the cache that was checked, even if the available memory moves in between.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attention_kv_caceh.cli.common import UsageError, check_memory
from attention_kv_caceh.cli.flags import Target, add_options, usage_error
from attention_kv_caceh.engine.config import MODEL_HELP, EngineConfig
from attention_kv_caceh.engine.spec_decode.config import SpeculativeConfig
from attention_kv_caceh.options import ConfigError, check_field, flag_of, option_fields

if TYPE_CHECKING:
    from attention_kv_caceh.engine.kv_cache_manager import KVCacheConfig
    from attention_kv_caceh.engine.request import SamplingParams
    from attention_kv_caceh.engine.tokenizer import Tokenizer
    from attention_kv_caceh.model_executor.model_config import ModelConfig
    from attention_kv_caceh.model_executor.model_source import ModelSource

__all__ = [
    "ENGINE_FLAGS",
    "MODEL_HELP",
    "MODEL_METAVAR",
    "EnginePlan",
    "add_engine_arguments",
    "check_gguf_source",
    "check_prompts_fit",
    "engine_config_kwargs",
    "engine_flags_given",
    "model_source",
    "open_checkpoint",
    "plan_engine",
]

MODEL_METAVAR = "MODEL"

# EngineConfig field -> the flag that sets it
ENGINE_FLAGS = {f.name: flag_of(EngineConfig, f.name) for f, _ in option_fields(EngineConfig)}


def add_engine_arguments(
    group: Target, *, defaults: bool = True, only: tuple[str, ...] | None = None
) -> None:
    """Declare the engine flags on `group`, their defaults read from EngineConfig.

    `defaults=False` leaves every default None (a caller can then tell which were given; the help says
    which default the engine applies). `only`: the EngineConfig fields to declare (None: all).
    """
    add_options(group, EngineConfig, only=only, defaults=None if defaults else dict.fromkeys(ENGINE_FLAGS))


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The EngineConfig fields the engine flags in `args` set (fields whose flag was not declared, or
    was given no value under `defaults=False`, are left out: EngineConfig's default applies)."""
    return {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name, None) is not None}


def engine_flags_given(args: argparse.Namespace) -> list[str]:
    """The engine flags given in `args` (declared with defaults=False) as argv, e.g. ["--max-num-seqs", "4"].
    UsageError naming the flag for a value out of its bounds (the config that checks it is built later,
    by `serve`)."""
    argv: list[str] = []
    for f, _ in option_fields(EngineConfig):
        value = getattr(args, f.name, None)
        try:
            check_field(EngineConfig, f.name, value)
        except ConfigError as exc:
            raise usage_error(EngineConfig, exc) from None
        flag = ENGINE_FLAGS[f.name]
        if isinstance(value, bool):
            argv += [flag] if value != f.default else []
        elif isinstance(value, SpeculativeConfig):
            argv += [flag, value.to_json()]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


@dataclass(frozen=True)
class EnginePlan:
    """What the checks found: the engine config to load with (its `num_kv_blocks` fixed to the checked
    count), the model's config, the tokenizer, the effective max_model_len (tokens), the KV pool
    (`num_blocks` blocks of `bytes_per_block` bytes each), where the checkpoint is (`source.path`:
    the folder or GGUF file to load, `source.name`: what a server calls it by default) and the pool as
    the engine will check requests against it (`kv_cache_config`, with the model's KV cache groups)."""

    engine_config: EngineConfig
    model_config: ModelConfig
    tokenizer: Tokenizer
    max_model_len: int
    num_blocks: int
    bytes_per_block: int
    source: ModelSource
    kv_cache_config: KVCacheConfig


def plan_engine(model_flag: str, config_kwargs: dict[str, object]) -> EnginePlan:
    """Check the engine flags against the checkpoint `model_flag` (the --model value) without loading
    weights.

    `config_kwargs` are EngineConfig fields (None where a flag was not given). Raises UsageError, naming
    the flag or the file and key: --model naming no checkpoint, a config.json, GGUF file or tokenizer the
    engine cannot read or does not implement (a GGUF file is checked whole here: header, metadata, every
    tensor's type, extent and alignment, NaN or infinite floats and block scales: `check_finite`), a combination EngineConfig refuses, --max-model-len over the checkpoint's, a
    KV cache of no block or over `memory.memory_budget_bytes()`.
    """
    from attention_kv_caceh.engine.kv_cache_manager import KVCacheConfig, full_batch_blocks
    from attention_kv_caceh.engine.model_runner import ModelRunner

    source = model_source(model_flag)
    try:
        config = EngineConfig(**config_kwargs)  # pyright: ignore[reportArgumentType]
    except ValueError as exc:
        raise usage_error(EngineConfig, exc) from None
    model_config, tokenizer, _ = open_checkpoint(source, config.quantization, model_flag)
    try:
        max_model_len = config.resolve_max_model_len(model_config.max_position_embeddings)
    except ValueError as exc:
        raise UsageError(f"--max-model-len: {exc}") from None
    if config.speculative_config is not None:
        try:
            config.speculative_config.check_fits(max_model_len)
        except ValueError as exc:
            raise UsageError(f"--speculative-config: {exc}") from None
    bytes_per_block = ModelRunner.bytes_per_block(model_config, config.block_size, config.dtype)
    if config.num_kv_blocks is not None:
        flag = f"--num-kv-blocks {config.num_kv_blocks}"
    elif config.kv_cache_memory is not None:
        flag = f"--kv-cache-memory {config.kv_cache_memory}"
    else:
        flag = "the default KV cache size"
    groups = ModelRunner.model_kv_cache_groups(model_config)
    needed = full_batch_blocks(
        config.max_num_seqs, config.block_size, max_model_len, groups, config.max_num_batched_tokens
    )
    try:
        num_blocks = config.num_blocks_for(bytes_per_block, blocks_needed=needed)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None
    check_memory(
        num_blocks * bytes_per_block,
        f"{flag}: a KV cache of {num_blocks} blocks of {bytes_per_block} bytes",
        "--kv-cache-memory or --num-kv-blocks",
    )
    engine_config = dataclasses.replace(config, num_kv_blocks=num_blocks, kv_cache_memory=None)
    pool = KVCacheConfig.for_engine(
        num_blocks, config.block_size, max_model_len, groups, config.max_num_batched_tokens
    )
    return EnginePlan(
        engine_config, model_config, tokenizer, max_model_len, num_blocks, bytes_per_block, source, pool
    )


def open_checkpoint(
    source: ModelSource, quantization: str | None, model_flag: str
) -> tuple[ModelConfig, Tokenizer, float]:
    """The checks of a checkpoint every engine command makes before any weight is read, and what they
    read: (the model's config, its tokenizer, the seconds reading the config took: a GGUF file is parsed
    and checked whole here, and Model.load reuses it). `quantization` is the engine's (checked by
    `check_gguf_source`); `model_flag` the --model value. UsageError for either check or a config or
    tokenizer the engine cannot read."""
    import time

    from attention_kv_caceh.engine.tokenizer import Tokenizer
    from attention_kv_caceh.model_executor.checkpoint import CheckpointError

    check_gguf_source(quantization, source, model_flag)
    try:
        opened = time.perf_counter()
        _, model_config = load_model_config(source.path)
        open_s = time.perf_counter() - opened
        # the requests stream text as a server's do: a tokenizer is checked before any weight is read
        tokenizer = Tokenizer.load(source.path)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    return model_config, tokenizer, open_s


def check_gguf_source(quantization: str | None, source: ModelSource, model_flag: str) -> None:
    """UsageError for --quantization gguf (a GGUF file's own blocks) on a --model that is no GGUF file."""
    if quantization == "gguf" and source.format != "gguf":
        raise UsageError(
            f"--quantization gguf keeps a GGUF file's blocks; --model {model_flag} is not a GGUF file"
        )


def model_source(model_flag: str) -> ModelSource:
    """The checkpoint a --model value names (`model_executor.model_source.resolve_model`: a model name, a GGUF
    file, a folder holding one, or a Hugging Face folder); UsageError naming the value otherwise."""
    from attention_kv_caceh.model_executor.checkpoint import CheckpointError
    from attention_kv_caceh.model_executor.model_source import resolve_model

    try:
        return resolve_model(model_flag)
    except CheckpointError as exc:
        raise UsageError(f"--model {exc}") from None


def load_model_config(path: Path) -> tuple[ModelSource, ModelConfig]:
    """`model_executor.model_source.load_model_config` (imported when called: the CLI starts without the engine)."""
    from attention_kv_caceh.model_executor.model_source import load_model_config as load

    return load(path)


def check_prompts_fit(plan: EnginePlan, prompt_ids: list[list[int]], params: SamplingParams) -> None:
    """UsageError for a prompt that encodes to no token, is longer than max_model_len, or whose prompt +
    max_tokens can never fit the whole KV pool (the engine's one admission rule,
    `KVCacheConfig.check_request_fits`, and its message). Prompts are counted from 0."""
    from attention_kv_caceh.engine.kv_cache_manager import RequestTooLargeError

    pool = plan.kv_cache_config
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise UsageError(f"prompt {i} encodes to no token")
        if len(ids) > plan.max_model_len:
            raise UsageError(
                f"prompt {i} has {len(ids)} tokens, more than max_model_len {plan.max_model_len}"
            )
        try:
            pool.check_request_fits(len(ids), params.max_tokens)
        except RequestTooLargeError as exc:
            raise UsageError(
                f"prompt {i}: {exc}; raise --num-kv-blocks or --kv-cache-memory, or lower --max-tokens"
            ) from None
