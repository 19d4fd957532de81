"""SpeculativeConfig: `--speculative-config` as vLLM reads it, for the one method this engine has (`ngram`).

Corresponds to vLLM's `vllm/config/speculative.py` (SpeculativeConfig, its `__post_init__` and
`_verify_args`) and `vllm/v1/spec_decode/dynamic/utils.py` (the batch-size schedule). The JSON object of
`--speculative-config` is read with vLLM's rules and vLLM's messages:

- `method` names the proposer; without it, `model: "ngram"` (or `"[ngram]"`) means ngram, and anything
  else means vLLM's `draft_model`, which needs a draft model: with no `model`, vLLM's
  "num_speculative_tokens was provided but without speculative model." A method of vLLM's list that this
  engine does not have (eagle, suffix, draft_model, ...) is refused with its name.
- `num_speculative_tokens` K >= 1 is required (vLLM: "num_speculative_tokens must be provided ...").
- `prompt_lookup_min` / `prompt_lookup_max` (>= 1): both absent -> 5 and 5 (vLLM's defaults); one given ->
  the other takes its value; min > max is refused.
- `num_speculative_tokens_per_batch_size`: vLLM's dynamic schedule, `[[start, end, K_b], ...]` inclusive
  ranges of the step's batch size (requests scheduled) from 1, non-overlapping; the K proposed after a
  step of B requests is the K_b of B's range (min with K; a gap carries the previous range's K_b on, and
  the last range's K_b covers every larger B). vLLM's default, no schedule, proposes K at every batch
  size. This engine's default differs, because on a CPU the batch is compute-bound early:
  `default_draft_schedule` (below) proposes only while a step stays within DEFAULT_VERIFY_ROWS rows. Pass
  `[[1, max_num_seqs, K]]` for vLLM's behaviour.

Any other key is refused, naming it: vLLM's own other fields tune draft models, tree attention or
GPU padding, none of which exists here, and an unknown key is an error in vLLM too.

Left out: every method but `ngram` and the fields that configure them (a draft model's path, revision,
parallelism, quantization and max_model_len; EAGLE's tree), and the settings that tune drafting on a GPU.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

__all__ = [
    "DEFAULT_PROMPT_LOOKUP",
    "DEFAULT_VERIFY_ROWS",
    "VLLM_METHODS",
    "SpeculativeConfig",
    "default_draft_schedule",
]

DEFAULT_PROMPT_LOOKUP = 5
"""vLLM's prompt_lookup_min and prompt_lookup_max when neither is given."""

DEFAULT_VERIFY_ROWS = 8
"""Rows (tokens) of a step up to which the step costs about what one row costs on the development machine
(AVX-512, float32, one thread): the packed linear layers stream each weight once for up to 8 rows
(docs/engine.md, "When verification is free, and when it is not"). The default schedule keeps a
step's decode and draft tokens within this many rows."""

VLLM_METHODS = (
    "ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
    "extract_hidden_states", "mtp", "ngram_gpu", "dflash", "dspark",
)  # fmt: skip
"""vLLM 0.32's `SpeculativeMethod` values (its MTP aliases left out); only "ngram" runs here."""

_FIELDS = (
    "method",
    "model",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "num_speculative_tokens_per_batch_size",
)


logger = logging.getLogger(__name__)
MAX_FIELD_VALUE = 2**24  # the largest K or n-gram length taken: more tokens than any model's context


def _int_field(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"speculative_config {name}={value!r}: Input should be a valid integer")
    if value > MAX_FIELD_VALUE:  # past any context; the engine checks against its own (`check_fits`)
        raise ValueError(f"speculative_config {name}={value}: must be at most {MAX_FIELD_VALUE:,}")
    return value


def _schedule(value: object) -> tuple[tuple[int, int, int], ...]:
    """vLLM's validate_and_normalize_dynamic_sd_schedule: sorted inclusive ranges from 1, no overlap."""
    name = "num_speculative_tokens_per_batch_size"
    if not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"{name} must be a non-empty list of (range_start, range_end, num_speculative_tokens) entries."
        )
    entries: list[tuple[int, int, int]] = []
    for entry in cast("list[object]", list(value)):  # pyright: ignore[reportUnknownArgumentType]
        if not isinstance(entry, list | tuple) or len(entry) != 3:  # pyright: ignore[reportUnknownArgumentType]
            raise ValueError(
                f"Each {name} entry must be a 3-item sequence: (range_start, range_end, num_speculative_tokens)."
            )
        start, end, k = (_int_field(name, item) for item in cast("list[object]", list(entry)))  # pyright: ignore[reportUnknownArgumentType]
        if start <= 0 or end <= 0:
            raise ValueError(f"Batch-size range ({start}, {end}) must be positive.")
        if start > end:
            raise ValueError(f"Batch-size range start must be <= end for ({start}, {end}, {k}).")
        if k < 0:
            raise ValueError(f"{name} values must be >= 0.")
        entries.append((start, end, k))
    entries.sort()
    previous_end = 0
    for start, end, _ in entries:
        if start <= previous_end:
            raise ValueError("Batch-size ranges must be non-overlapping and sorted.")
        previous_end = end
    if entries[0][0] != 1:
        raise ValueError(
            "The first batch-size range must start at 1 so every runtime batch size has a defined schedule."
        )
    return tuple(entries)


def default_draft_schedule(num_speculative_tokens: int, max_num_seqs: int) -> list[int]:
    """K to propose after a step of B requests, for B = 0 .. max_num_seqs, when no schedule is given.

    K_B = min(K, DEFAULT_VERIFY_ROWS // B - 1), at least 0: the next step's B * (1 + K_B) rows stay
    within DEFAULT_VERIFY_ROWS, where verification is about free; past that the step is bound by
    arithmetic and a draft costs what the token it may save costs. Entry 0 is unused.
    """
    out = [0] * (max_num_seqs + 1)
    for b in range(1, max_num_seqs + 1):
        out[b] = max(0, min(num_speculative_tokens, DEFAULT_VERIFY_ROWS // b - 1))
    return out


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings (the fields of vLLM's SpeculativeConfig that ngram uses).

    Attributes:
        num_speculative_tokens: K, the most draft tokens proposed per request per step (>= 1).
        prompt_lookup_min, prompt_lookup_max: n-gram lengths the proposer matches (1 <= min <= max).
        num_speculative_tokens_per_batch_size: vLLM's dynamic schedule (module docstring), or None for
            `default_draft_schedule`.
        method: "ngram".

    Raises:
        ValueError: with vLLM's message for the value it refuses (`from_dict` for the JSON form).
    """

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    num_speculative_tokens_per_batch_size: tuple[tuple[int, int, int], ...] | None = None
    method: str = "ngram"

    def __post_init__(self) -> None:
        k = _int_field("num_speculative_tokens", self.num_speculative_tokens)
        if k <= 0:
            raise ValueError(f"Expected num_speculative_tokens to be greater than zero ({k}).")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if _int_field(name, getattr(self, name)) < 1:
                raise ValueError(
                    f"speculative_config {name}={getattr(self, name)}: Input should be greater than or equal to 1"
                )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} must be <= prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method != "ngram":
            raise ValueError(_method_error(self.method))
        if self.num_speculative_tokens_per_batch_size is not None:
            object.__setattr__(
                self,
                "num_speculative_tokens_per_batch_size",
                _schedule(self.num_speculative_tokens_per_batch_size),
            )
            for start, end, k_b in self.num_speculative_tokens_per_batch_size or ():
                if k_b > k:  # taken, as the module docstring says, but not in silence
                    logger.warning(
                        "speculative_config num_speculative_tokens_per_batch_size [%d, %d, %d]: %d drafts "
                        "are above num_speculative_tokens %d; batch sizes %d..%d propose %d",
                        start,
                        end,
                        k_b,
                        k_b,
                        k,
                        start,
                        end,
                        k,
                    )

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SpeculativeConfig:
        """The config of a `--speculative-config` JSON object (keys may use `-` for `_`, as vLLM allows).

        Raises:
            ValueError: an unknown or unsupported key, a method other than ngram, a missing
                num_speculative_tokens, or a value vLLM refuses (module docstring), naming it.
        """
        fields = {str(key).replace("-", "_"): value for key, value in obj.items()}
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"speculative_config: {', '.join(map(repr, unknown))} not supported by this engine "
                f"(it reads {', '.join(_FIELDS)})"
            )
        method, model = fields.get("method"), fields.get("model")
        if method is None:
            method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method != "ngram":
            if method == "draft_model" and model is None and fields.get("num_speculative_tokens") is not None:
                raise ValueError("num_speculative_tokens was provided but without speculative model.")
            raise ValueError(_method_error(method))
        if model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config model={model!r}: the ngram method takes no draft model")
        k = fields.get("num_speculative_tokens")
        if k is None:
            raise ValueError(
                "num_speculative_tokens must be provided with speculative model unless the draft model "
                "config contains an n_predict parameter."
            )
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:  # checked as given, before one fills in the other
                _int_field(name, value)
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        return cls(
            num_speculative_tokens=k,
            prompt_lookup_min=lo,  # pyright: ignore[reportArgumentType]
            prompt_lookup_max=hi,  # pyright: ignore[reportArgumentType]
            num_speculative_tokens_per_batch_size=fields.get("num_speculative_tokens_per_batch_size"),
        )

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """`from_dict` of a JSON text. Raises ValueError for text that is not a JSON object, or as from_dict."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object such as {_EXAMPLE}, got {text!r}")
        return cls.from_dict(obj)  # pyright: ignore[reportUnknownArgumentType]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object `from_dict` reads back to this config (vLLM reads it too, but for a schedule
        key vLLM 0.32 has only on its dynamic path)."""
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "prompt_lookup_min": self.prompt_lookup_min,
            "prompt_lookup_max": self.prompt_lookup_max,
        }
        if self.num_speculative_tokens_per_batch_size is not None:
            out["num_speculative_tokens_per_batch_size"] = [
                list(e) for e in self.num_speculative_tokens_per_batch_size
            ]
        return out

    def to_json(self) -> str:
        """`to_dict` as compact JSON (what `--speculative-config` takes)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def check_fits(self, max_model_len: int) -> None:
        """Raise ValueError naming the field when a draft could never fit a request's context: a draft
        of K tokens and the token that verifies it take K + 1 positions, and an n-gram longer than the
        context never recurs in it (K < max_model_len, prompt_lookup_max <= max_model_len)."""
        if self.num_speculative_tokens >= max_model_len:
            raise ValueError(
                f"speculative_config num_speculative_tokens={self.num_speculative_tokens}: must be below "
                f"max_model_len ({max_model_len}), as a draft and the token verifying it fit one context"
            )
        if self.prompt_lookup_max > max_model_len:
            raise ValueError(
                f"speculative_config prompt_lookup_max={self.prompt_lookup_max}: must be at most "
                f"max_model_len ({max_model_len}), the longest n-gram a context holds"
            )

    def draft_schedule(self, max_num_seqs: int) -> list[int]:
        """K to propose after a step of B requests, for B = 0 .. max_num_seqs (entry 0 unused): vLLM's
        `build_dynamic_sd_schedule_lookup` of the given schedule, or `default_draft_schedule`."""
        k = self.num_speculative_tokens
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return default_draft_schedule(k, max_num_seqs)
        out = [0] * (max_num_seqs + 1)
        covered, last = 0, 0
        for start, end, k_b in schedule:
            for b in range(covered + 1, min(start, max_num_seqs + 1)):
                out[b] = min(k, last)  # a gap carries the previous range's K on
            for b in range(start, min(end, max_num_seqs) + 1):
                out[b] = min(k, k_b)
            covered, last = max(covered, end), k_b
        for b in range(covered + 1, max_num_seqs + 1):
            out[b] = min(k, last)
        return out


_EXAMPLE = '{"method": "ngram", "num_speculative_tokens": 4}'


def _method_error(method: object) -> str:
    if method in VLLM_METHODS:
        return f"speculative method {method!r} is not available in this engine; it runs 'ngram' only"
    return f"speculative method {method!r} is not one of vLLM's ({', '.join(VLLM_METHODS)})"
