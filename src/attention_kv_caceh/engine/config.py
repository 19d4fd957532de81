# stub: replaced by the scheduler branch at merge
"""EngineConfig (stub with the engine contract's fields only; the scheduler branch owns this module)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings named as in vLLM (stub: no validation)."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
