"""The one Server-Sent Events parser, and the one decoder of OpenAI-style token streams.

Both OpenAI endpoints (`/v1/completions` and `/v1/chat/completions`) stream `data: {json}` events ended
by `data: [DONE]`; they differ only in where the text sits (`choices[0].text` or
`choices[0].delta.content`). `SSEParser` follows the WHATWG event-stream rules (lines end in LF, CRLF or
CR; `:` starts a comment; several `data:` lines join with LF; a blank line dispatches). The decoder
decides what is a token-bearing event, the point common tools get wrong:

- a chunk is token-bearing when its choice carries generated tokens: text, content, reasoning, refusal,
  tool-call name/arguments, or a logprobs list, or when per-chunk usage grows on a choice whose text the
  server held back (vLLM sends `"text": ""` for a token that ends inside a UTF-8 character); a chat
  stream's role-only opening chunk, an empty finish chunk and a usage-only chunk (`choices: []`) are
  not, and never move the finish time;
- the tokens of a token-bearing event: the change in `usage.completion_tokens` from the tokens already
  counted, where the server reports usage per chunk (vLLM's `continuous_usage_stats`); a chunk whose
  per-chunk usage adds 0 carries no token and is not an event. Without per-chunk usage: the chunk's
  `logprobs` token list, else 1. `tokens_per_event_source` records which;
- the events always sum to the final usage count when the server gives one: a final usage above (or
  below) what was counted is reconciled onto the last event(s), never as an invented event, and the
  record says so (`reconciled_counts`);
- every usage count is checked (a non-negative integer; `completion_tokens` never decreases), else the
  request fails as `invalid_usage`; one event may hold at most MAX_EVENT_BYTES, else `event_too_large`;
- every chunk's shape is checked: `choices` a list of objects, their `text`, `finish_reason` and
  `delta` fields strings (`delta` an object), `usage` an object; anything else (`{"choices": "nope"}`,
  `{"choices": [null]}`, `{"choices": [{"text": 5}]}`) fails the request as `malformed_sse`.

The chunks' shapes and checks are `sse_chunks.py` (a typed msgspec decode for the common chunk, the
field-by-field checks for the rest); the parser splits a chunk without CR at its LFs in one call.
"""

from __future__ import annotations

from typing import Any, cast

from attention_kv_caceh.harness.sse_chunks import (
    CHUNK_DECODER,
    CHUNK_LIST_DECODER,
    Chunk,
    InvalidUsageError,
    MalformedSSEError,
    StreamErrorEvent,
    as_dict,
    carries_tokens,
    checked_choices,
    decode_json,
    logprob_tokens,
    nonempty_str,
    short,
    usage_count,
)
from attention_kv_caceh.harness.sse_parser import MAX_EVENT_BYTES, EventTooLargeError, SSEEvent, SSEParser

__all__ = [
    "MAX_EVENT_BYTES",
    "EventTooLargeError",
    "InvalidUsageError",
    "MalformedSSEError",
    "OpenAIStreamDecoder",
    "SSEEvent",
    "SSEParser",
    "StreamErrorEvent",
]

_GENERAL = -1  # `_typed_event`: leave this chunk to the general path (never a token count)


class OpenAIStreamDecoder:
    """Turn the bytes of one OpenAI-style stream into token counts per token-bearing event.

    `feed` returns, for each token-bearing event completed by the bytes, its number of tokens (how it
    is derived: the module docstring). After the stream: `done` (saw `[DONE]`), `finish_reason` (the
    last one a choice carried), `failure` (the error that stopped decoding), `prompt_tokens` and
    `usage_completion_tokens` (from usage, else None), and `reconciled_counts()` (the counts made to
    sum to the final usage), `output_tokens`, `output_tokens_source`, `tokens_per_event_source`.
    """

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self._parser = SSEParser(max_event_bytes)
        self.done = False
        self.finish_reason: str | None = None
        self.failure: StreamErrorEvent | MalformedSSEError | None = None
        self.prompt_tokens: int | None = None
        self.usage_completion_tokens: int | None = None
        self.counts: list[int] = []
        self._counted = 0
        self._usage_on_tokens = False  # usage arrived on a token-bearing chunk (per-chunk usage)
        self._count_source = "chunks"

    def feed(self, chunk: bytes) -> list[int]:
        """Parse `chunk`; return the token count of each token-bearing event it completed.

        An error event (StreamErrorEvent), a `data:` payload that is not a JSON object or not UTF-8
        (MalformedSSEError), an event over the size cap (EventTooLargeError) or a bad usage count
        (InvalidUsageError) stops decoding: the counts of the events before it are still returned, and
        the exception is left in `failure` for the caller to raise. Data after `[DONE]` is ignored.
        """
        if self.failure is not None or self.done:
            return []
        counts: list[int] = []
        try:
            payloads = self._parser.whole_data_events(chunk)
            if payloads is not None:
                self._feed_payloads(payloads, counts)
                return counts
            for event in self._parser.iter_feed(chunk):
                self._add(self._event(event), counts)
                if self.done:
                    break
        except UnicodeDecodeError as exc:
            self.failure = MalformedSSEError(f"stream is not UTF-8: {exc}")
        except (StreamErrorEvent, MalformedSSEError) as exc:
            self.failure = exc
        return counts

    def _add(self, count: int | None, counts: list[int]) -> None:
        if count is not None:
            counts.append(count)
            self.counts.append(count)
            self._counted += count

    def _feed_payloads(self, payloads: list[bytes], counts: list[int]) -> None:
        """The events of a chunk that is nothing but whole one-line `data:` events (`payloads`, their
        data), decoded in one msgspec call as a JSON array of typed chunks; each is then counted as
        `_event` counts it. Any payload the typed decoder refuses sends the whole list one by one
        through `_event`, which gives the same failure it gives on any other path."""
        # `[DONE]` as servers send it; one with spaces around it fails the typed decode below and is
        # then recognised by `_event`
        stop = payloads.index(b"[DONE]") if b"[DONE]" in payloads else None
        batch = payloads if stop is None else payloads[:stop]
        try:
            chunks: list[Chunk] | None = (
                CHUNK_LIST_DECODER.decode(b"[" + b",".join(batch) + b"]") if batch else []
            )
        except ValueError:
            chunks = None
        if chunks is None:
            for payload in payloads:
                self._add(self._event(SSEEvent(payload.decode("utf-8"))), counts)
                if self.done:
                    return
            return
        typed_event, add = self._typed_event, self._add
        for typed, payload in zip(chunks, batch, strict=True):
            count = typed_event(typed)
            if count == _GENERAL:
                count = self._general_event(payload.decode("utf-8"))
            if count is not None:
                add(count, counts)
        if stop is not None:
            self.done = True

    def _event(self, event: SSEEvent) -> int | None:
        if event.event == "error":
            raise StreamErrorEvent(event.data[:500])
        data = event.data
        if data == "[DONE]" or data.strip() == "[DONE]":
            self.done = True
            return None
        try:
            typed: Chunk | None = CHUNK_DECODER.decode(data)
        except ValueError:  # not JSON, or a shape the typed decoder does not take: the general path
            typed = None
        if typed is not None:
            count = self._typed_event(typed)
            if count != _GENERAL:
                return count
        return self._general_event(data)

    def _typed_event(self, chunk: Chunk) -> int | None:
        """The common chunk, its types already checked by msgspec: text or delta fields that are strings
        or null, usage counts that are integers. Returns _GENERAL, having changed nothing, for anything
        else (an error, a negative or decreasing count, logprobs, tool calls), which the general path
        then decodes with its full checks and messages."""
        if chunk.error is not None or chunk.object == "error":
            return _GENERAL
        completion: int | None = None
        usage = chunk.usage
        if usage is not None:
            prompt, completion = usage.prompt_tokens, usage.completion_tokens
            if (prompt is not None and prompt < 0) or (completion is not None and completion < 0):
                return _GENERAL
            previous = self.usage_completion_tokens
            if completion is not None and previous is not None and completion < previous:
                return _GENERAL
        choices = chunk.choices or []
        for c in choices:
            d = c.delta
            if c.logprobs is not None or (d is not None and (d.tool_calls or d.function_call is not None)):
                return _GENERAL
        if usage is not None:
            if usage.prompt_tokens is not None:
                self.prompt_tokens = usage.prompt_tokens
            if completion is not None:
                self.usage_completion_tokens = completion
        if not choices:
            return None  # usage-only (or empty) chunk: not a token
        choice = choices[0]
        reason = choice.finish_reason
        if reason:
            self.finish_reason = reason
        d = choice.delta
        carries = bool(choice.text) or (
            d is not None and bool(d.content or d.reasoning_content or d.reasoning or d.refusal)
        )
        return self._count(completion, carries, reason, None)

    def _general_event(self, data: str) -> int | None:
        """A chunk decoded to Python objects and checked field by field (the messages name the field)."""
        try:
            obj: object = decode_json(data)
        except ValueError:  # msgspec.DecodeError: not JSON (strict: no NaN or Infinity)
            obj = None
        if type(obj) is not dict:
            raise MalformedSSEError(f"data line is not a JSON object: {data.strip()[:200]!r}")
        chunk = cast("dict[str, Any]", obj)
        error = chunk.get("error")
        if error is not None or chunk.get("object") == "error":
            detail = as_dict(error)
            message = detail.get("message") if detail is not None else error
            raise StreamErrorEvent(str(message or chunk.get("message") or data.strip()[:500]))
        completion = self._usage(chunk) if chunk.get("usage") is not None else None
        choices = checked_choices(chunk)
        if not choices:
            return None  # usage-only (or empty) chunk: not a token
        choice = choices[0]
        reason = choice.get("finish_reason")
        if reason:  # a non-empty string (checked)
            self.finish_reason = reason
        return self._count(completion, carries_tokens(choice), reason, logprob_tokens(choice))

    def _count(
        self, completion: int | None, carries: bool, reason: object, logprobs: int | None
    ) -> int | None:
        """The tokens of a chunk (None: not a token event) from its usage count, whether its choice
        carries generated text, its finish reason and its logprobs token count."""
        if not carries:
            if completion is not None and self._held_back_token(completion, reason):
                return self._usage_delta(completion)
            return None  # role-only, empty or finish-only chunk: not a token (usage reconciled later)
        if completion is not None and completion > self._counted:
            return self._usage_delta(completion)
        if completion is not None and self._usage_on_tokens:
            return None  # per-chunk usage says this chunk carried no token
        # else no usage, or a first usage report below the chunks counted one by one: reconciled at the end
        if logprobs is not None and self._count_source == "chunks":
            self._count_source = "logprobs"
        return logprobs or 1

    def _held_back_token(self, completion: int, reason: object) -> bool:
        """True when a choice without text still carries a token by per-chunk usage: the server
        generated it but held its text back (an incomplete UTF-8 sequence of a byte-level BPE, a
        stripped special token), as vLLM does, and vLLM's client counts that chunk. Only once per-chunk
        usage is established (or for the stream's first chunk, before any finish), so that a final
        usage report after chunks counted one by one is reconciled, never a new event."""
        if completion <= self._counted:
            return False
        return self._usage_on_tokens or (self._counted == 0 and not nonempty_str(reason))

    def _usage_delta(self, completion: int) -> int:
        """The tokens of a chunk by per-chunk usage (`completion` above those counted so far)."""
        self._usage_on_tokens = True
        self._count_source = "usage"
        return completion - self._counted

    def _usage(self, obj: dict[str, Any]) -> int | None:
        """Check and store a chunk's usage; return its completion tokens (None without usage)."""
        raw = obj.get("usage")
        if raw is None:
            return None
        usage = as_dict(raw)
        if usage is None:
            raise InvalidUsageError(f"usage is {short(raw)}, not an object")
        prompt = usage_count(usage, "prompt_tokens")
        if prompt is not None:
            self.prompt_tokens = prompt
        completion = usage_count(usage, "completion_tokens")
        if completion is None:
            return None
        previous = self.usage_completion_tokens
        if previous is not None and completion < previous:
            raise InvalidUsageError(f"usage.completion_tokens decreased from {previous} to {completion}")
        self.usage_completion_tokens = completion
        return completion

    def reconciled_counts(self) -> tuple[list[int], str | None]:
        """The tokens of each event made to sum to the final usage count, and how (None: no change).

        No event is added or removed: a surplus goes to the last event, a shortfall is taken from the
        last events down to 1 token each. If the usage is below the number of events (impossible with a
        one-token minimum per event), the counts are kept and the note says so.
        """
        counts = list(self.counts)
        target = self.usage_completion_tokens
        total = sum(counts)
        if target is None or target == total or not counts:
            return counts, None
        if target > total:
            counts[-1] += target - total
            return counts, f"final usage {target} > {total} counted: +{target - total} on the last event"
        if target < len(counts):
            return counts, f"final usage {target} < {len(counts)} token events: counts kept"
        excess = total - target
        for i in range(len(counts) - 1, -1, -1):
            take = min(excess, counts[i] - 1)
            counts[i] -= take
            excess -= take
        return counts, f"final usage {target} < {total} counted: -{total - target} from the last events"

    @property
    def output_tokens(self) -> int:
        """Tokens generated: the server's usage count when it gave one, else the counted tokens."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self._counted

    @property
    def output_tokens_source(self) -> str:
        """How `output_tokens` was obtained: "usage", "logprobs" or "chunks"."""
        return "usage" if self.usage_completion_tokens is not None else self._count_source

    @property
    def tokens_per_event_source(self) -> str:
        """How the tokens of each event were derived: "usage" (the change in per-chunk usage),
        "logprobs" (the chunk's token list) or "chunks" (one per token-bearing chunk)."""
        return self._count_source

    @property
    def truncated(self) -> bool:
        """True when bytes of an unfinished event are left over."""
        return self._parser.pending
