"""The one Server-Sent Events parser: bytes in, dispatched events out, one event's size bounded.

`SSEParser` follows the WHATWG HTML standard's event-stream rules ("9.2 Server-sent events": lines end in
LF, CRLF or CR; a line starting with `:` is a comment; several `data:` lines join with LF; a blank line
dispatches the event; a field without a colon is a field with an empty value). One event, its data lines
and the line being read together, may hold at most MAX_EVENT_BYTES, else `EventTooLargeError`. The
token decoder of OpenAI streams over it is `sse.py`; the harness's second reader of the answer text is
`answer_text.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import NamedTuple

from attention_kv_caceh.harness.sse_chunks import MalformedSSEError

__all__ = ["MAX_EVENT_BYTES", "EventTooLargeError", "SSEEvent", "SSEParser"]

# The one cap on a single event (its data lines plus the line being read): a stream that sends more
# without a blank line is refused as `event_too_large` instead of growing the client's memory without
# bound. 8 MiB is far above any token chunk (a few hundred bytes; a logprobs chunk a few KiB).
MAX_EVENT_BYTES = 8 * 2**20

_LINE_BREAK = re.compile(rb"[\r\n]")
_CR, _LF = 0x0D, 0x0A
_CR_BYTE = b"\r"


class SSEEvent(NamedTuple):
    """One dispatched event: its `event:` type ("message" by default) and joined `data:` lines."""

    data: str
    event: str = "message"


class SSEParser:
    """Incremental event-stream parser: feed bytes as they arrive, get the completed events.

    Linear time: each byte is searched for a line break once, when it arrives, and copied once into
    the line being built (`bytes_scanned` counts this work, so tests can check it without a clock).
    `max_event_bytes` caps one event (default MAX_EVENT_BYTES); beyond it `feed` raises
    EventTooLargeError.
    """

    def __init__(self, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        if max_event_bytes < 1:
            raise ValueError(f"max_event_bytes must be >= 1, got {max_event_bytes}")
        self.max_event_bytes = max_event_bytes
        self.bytes_scanned = 0
        self._line = bytearray()
        self._after_cr = False  # the last byte seen was a CR: an LF right after it is the same break
        self._data_lines: list[str] = []
        self._data_bytes = 0
        self._event_type = ""

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse `chunk` (any split of the byte stream); return the events it completed, in order.

        Raises UnicodeDecodeError for a line that is not UTF-8, EventTooLargeError when one event
        exceeds `max_event_bytes`.
        """
        return list(self.iter_feed(chunk))

    def iter_feed(self, chunk: bytes) -> Iterator[SSEEvent]:
        """As `feed`, yielding each event as soon as it is complete (the events before an error in
        the same chunk are still delivered)."""
        if not self._line and not self._after_cr and _CR_BYTE not in chunk:
            yield from self._feed_lf_lines(chunk)
            return
        n = len(chunk)
        pos = 1 if self._after_cr and n and chunk[0] == _LF else 0
        if n:
            self._after_cr = False
        while pos < n:
            match = _LINE_BREAK.search(chunk, pos)
            end = n if match is None else match.start()
            self.bytes_scanned += end - pos + (match is not None)
            self._line += chunk[pos:end]
            if len(self._line) + self._data_bytes > self.max_event_bytes:
                raise EventTooLargeError(
                    f"one SSE event exceeded {self.max_event_bytes} bytes without ending "
                    f"(the cap on an event's size, MAX_EVENT_BYTES)"
                )
            if match is None:
                break
            if chunk[end] == _CR:
                if end + 1 == n:
                    self._after_cr = True
                    pos = n
                else:
                    pos = end + 2 if chunk[end + 1] == _LF else end + 1
            else:
                pos = end + 1
            line = self._line.decode("utf-8")
            self.bytes_scanned += len(self._line)
            self._line.clear()
            event = self._handle_line(line)
            if event is not None:
                yield event

    def whole_data_events(self, chunk: bytes) -> list[bytes] | None:
        """The data of each event `chunk` completes when those events are all of one `data: ` line each
        (`data: X` LF LF, no CR), with at most a partial line pending before it: the common shape of a
        token stream's reads, taken apart with one split. The bytes after the last complete event stay
        pending, as on the other paths. None otherwise, with nothing consumed (feed it then)."""
        if self._data_lines or self._after_cr or self._event_type or _CR_BYTE in chunk:
            return None
        buffer = bytes(self._line) + chunk if self._line else chunk
        end = buffer.rfind(b"\n\n")
        if end < 0 or not buffer.startswith(b"data: "):
            return None
        whole = buffer[:end]
        events = whole.split(b"\n\n")
        # every event one line that starts "data: ": as many "data: " after a blank line as events
        # after the first, and no LF but the blank lines'
        if whole.count(b"\n\ndata: ") != len(events) - 1 or whole.count(b"\n") != 2 * (len(events) - 1):
            return None
        if max(map(len, events)) > self.max_event_bytes:
            return None
        self._line.clear()
        self.bytes_scanned += 2 * (end + 2)  # one search, one copy, as on the other paths
        for _ in self._feed_lf_lines(buffer[end + 2 :]):  # the start of the next event: pending
            raise AssertionError("no event can end after the last blank line")
        return [event[6:] for event in events]

    def _feed_lf_lines(self, chunk: bytes) -> Iterator[SSEEvent]:
        """The common case, and the same rules: no partial line pending and no CR in `chunk`, so its
        lines end at LF; one split finds them all (each byte searched once, each line copied once by
        its decode, as on the general path)."""
        lines = chunk.split(b"\n")
        tail = lines.pop()  # the bytes after the last LF: the start of the next line
        self.bytes_scanned += len(chunk) - len(tail)
        for raw in lines:
            if len(raw) + self._data_bytes > self.max_event_bytes:
                raise EventTooLargeError(
                    f"one SSE event exceeded {self.max_event_bytes} bytes without ending "
                    f"(the cap on an event's size, MAX_EVENT_BYTES)"
                )
            self.bytes_scanned += len(raw)
            event = self._handle_line(raw.decode("utf-8"))
            if event is not None:
                yield event
        if tail:
            self.bytes_scanned += len(tail)
            self._line += tail
            if len(self._line) + self._data_bytes > self.max_event_bytes:
                raise EventTooLargeError(
                    f"one SSE event exceeded {self.max_event_bytes} bytes without ending "
                    f"(the cap on an event's size, MAX_EVENT_BYTES)"
                )

    def _handle_line(self, line: str) -> SSEEvent | None:
        if line.startswith("data:"):  # the common line first
            value = line[6:] if line.startswith("data: ") else line[5:]
            self._data_lines.append(value)
            self._data_bytes += len(value) + 1
            return None
        if line == "":
            if not self._data_lines:
                self._event_type = ""
                return None
            event = SSEEvent(data="\n".join(self._data_lines), event=self._event_type or "message")
            self._data_lines = []
            self._data_bytes = 0
            self._event_type = ""
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "data":
            self._data_lines.append(value)
            self._data_bytes += len(value) + 1
        elif name == "event":
            self._event_type = value
        # `id`, `retry` and unknown fields are ignored, as the standard says.
        return None

    @property
    def pending(self) -> bool:
        """True when bytes or data lines of an undispatched event are buffered (a cut stream)."""
        return bool(self._line.strip()) or bool(self._data_lines)


class EventTooLargeError(MalformedSSEError):
    """One event grew past the parser's `max_event_bytes` (recorded as `event_too_large`)."""
