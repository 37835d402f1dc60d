"""The batch's block tables, kept between steps: each running request owns a row of one numpy table,
and a step copies in only the block ids added since the last one (usually none), where converting every
request's whole list each step cost O(context) per request: 0.7 ms a step at batch 256 with 2k-token
contexts on a 2-core host, more on a GPU machine's slower cores.

A row changes only at its end between steps: blocks are appended, and copy on write replaces the
block that holds the request's next position, the last one filled before. A preempted request starts
over with new blocks (its `num_preemptions` tells), a forked one has a new request id, and a new
request that reuses a finished one's id is another object. Rows of requests that are gone are
reclaimed all at once, when the table runs out of rows.
"""

from __future__ import annotations

import numpy as np

from pagoda.service.engine.core.request import Request


class BlockTables:
    def __init__(self, num_rows: int, max_blocks_per_request: int) -> None:
        """`num_rows`: at least the most requests a step holds (max_num_seqs)."""
        self.table = np.zeros((num_rows, max_blocks_per_request), dtype=np.int32)
        # request id -> (row, the request, its num_preemptions when written): an id is reused once its
        # request finished, so the row is the same request's only if the object is.
        self._rows: dict[str, tuple[int, Request, int]] = {}
        self._filled = [0] * num_rows  # block ids written per row
        self._last = [-1] * num_rows  # the last block id written per row
        self._free = list(range(num_rows - 1, -1, -1))

    def gather(self, reqs: list[Request]) -> np.ndarray:
        """[len(reqs), the most blocks any has] int32: each request's block ids, zero-padded."""
        if sum(req.request_id not in self._rows for req in reqs) > len(self._free):
            self._reclaim()  # before any row of this batch is handed out: it holds every request
        rows = [self._update(req) for req in reqs]
        width = max(len(req.block_ids) for req in reqs)
        return self.table[rows, :width]

    def _update(self, req: Request) -> int:
        ids = req.block_ids
        seen = self._rows.get(req.request_id)
        if seen is not None and seen[1] is req and seen[2] == req.num_preemptions:
            row = seen[0]
            filled = self._filled[row]
            if filled == len(ids) and (not ids or self._last[row] == ids[-1]):
                return row  # most steps: no block added, none copied on write
            start = max(filled - 1, 0)  # the last block written may have been copied on write
        else:
            row = seen[0] if seen is not None else self._free.pop()
            self._rows[req.request_id] = (row, req, req.num_preemptions)
            self.table[row, : self._filled[row]] = 0  # a preempted request's old blocks
            filled = start = 0
        end = len(ids)
        self.table[row, start:end] = ids[start:end]  # a running request's list never shrinks
        self._filled[row] = end
        self._last[row] = ids[-1] if ids else -1
        return row

    def _reclaim(self) -> None:
        """Free every row; the requests still running are written again as they come."""
        self._rows.clear()
        self.table[:] = 0
        self._filled = [0] * len(self.table)
        self._last = [-1] * len(self.table)
        self._free = list(range(len(self.table) - 1, -1, -1))
