"""MultiGroupBlockTable: a step's block tables and slot mappings, one per KV cache group.

Corresponds to vLLM v1's `vllm/v1/worker/block_table.py` (BlockTable: a request's row of block ids and
`compute_slot_mapping`; MultiGroupBlockTable: one BlockTable per KV cache group). Here the tables are
rebuilt each step from the scheduler's output (`SchedulerOutput.block_ids`, or `request.block_ids` for a
model of one group) rather than kept in persistent buffers updated by row: left out are the persistent
CPU/GPU buffers, `append_row` / `move_row` / `swap_row`, and hybrid block sizes (every group here has the
engine's block_size).

Position p of a request goes to slot table[p // block_size] * block_size + p % block_size of its table in
the group. A sliding group's entries before its window may be -1 (freed); every block the step reads or
writes must be in the pool (`check_request`).

Shape legend: N scheduled tokens, R scheduled requests, B the longest table of a group, in blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from attention_kv_caceh.engine.request import Request
from attention_kv_caceh.engine.scheduler import SchedulerOutput
from attention_kv_caceh.model_executor.paged_attention import AttentionMetadata

__all__ = ["MultiGroupBlockTable"]


class MultiGroupBlockTable:
    """The block tables of one step in each KV cache group of a pool of `num_blocks` blocks of
    `block_size` tokens. group_windows: W of each group's sliding window, None for full attention
    (one entry per group; `(None,)` for a model of one group)."""

    def __init__(self, group_windows: Sequence[int | None], block_size: int, num_blocks: int) -> None:
        self.group_windows = tuple(group_windows)
        self.block_size = block_size
        self.num_blocks = num_blocks

    def check_request(
        self, scheduler_output: SchedulerOutput, r: Request, num_positions: int
    ) -> tuple[list[int], ...]:
        """Request r's block table per group, checked to cover num_positions with blocks of the pool
        wherever the step reads or writes (a sliding group's entries before the window may be -1).
        Raises ValueError for tables of another number of groups, too few blocks, or a block the step
        uses (a sliding group's: from the block of position num_computed_tokens - W + 1 on) outside
        the pool."""
        bs = self.block_size
        tables = scheduler_output.block_ids.get(r.request_id) or (r.block_ids,)
        if len(tables) != len(self.group_windows):
            raise ValueError(
                f"request {r.request_id!r}: block tables of {len(tables)} KV cache groups, "
                f"the model has {len(self.group_windows)}"
            )
        for g, (table, window) in enumerate(zip(tables, self.group_windows, strict=True)):
            first = 0 if window is None else max(0, r.num_computed_tokens - window + 1) // bs
            used = table[first : -(-num_positions // bs)]
            if len(table) * bs < num_positions or any(not 0 <= b < self.num_blocks for b in used):
                raise ValueError(
                    f"request {r.request_id!r}: block_ids {table} of KV cache group {g} must cover "
                    f"{num_positions} positions with blocks in 0 .. {self.num_blocks - 1} from block "
                    f"{first} on (block_size {bs})"
                )
        return tables

    def attention_metadata(
        self,
        tables_of: Sequence[tuple[list[int], ...]],
        positions: npt.NDArray[np.int64],
        request_of_token: npt.NDArray[np.int64],
        query_start_loc: npt.NDArray[np.int64],
        context_lens: npt.NDArray[np.int64],
        row_per_token: bool,
    ) -> list[AttentionMetadata]:
        """The AttentionMetadata of each group, from the checked tables (`tables_of` `[R][groups]`),
        the tokens' positions and requests `[N]`, query_start_loc `[R + 1]` and context_lens `[R]`.

        Each group's block_tables `[R, B]` int32 (-1 past a request's table) and slot_mapping `[N]`
        int64. `row_per_token` (a step of one token plus drafts per request): one row per token, each
        attending its request's blocks up to its own position (block_tables `[N, B]`, context
        positions + 1), the causal mask of the request's queries."""
        bs = self.block_size
        out: list[AttentionMetadata] = []
        for g in range(len(self.group_windows)):
            max_blocks = max(len(tables[g]) for tables in tables_of)
            block_tables = np.full((len(tables_of), max_blocks), -1, dtype=np.int32)  # [R, B]
            for i, tables in enumerate(tables_of):
                block_tables[i, : len(tables[g])] = tables[g]
            slot_mapping = (
                block_tables[request_of_token, positions // bs].astype(np.int64) * bs + positions % bs
            )  # [N]
            if row_per_token:
                metadata = AttentionMetadata(
                    slot_mapping=slot_mapping,
                    query_start_loc=np.arange(positions.shape[0] + 1, dtype=np.int64),  # [N+1]
                    block_tables=block_tables[request_of_token],  # [N, B]
                    context_lens=positions + 1,  # [N]
                    block_size=bs,
                )
            else:
                metadata = AttentionMetadata(
                    slot_mapping=slot_mapping,
                    query_start_loc=query_start_loc,
                    block_tables=block_tables,
                    context_lens=context_lens,
                    block_size=bs,
                )
            out.append(metadata)
        return out
