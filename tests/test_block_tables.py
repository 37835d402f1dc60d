"""The runner's persistent block tables against the requests' own block lists, step after step:
appends, copy on write of the last block, preemption, forks, and reclaiming rows."""

from __future__ import annotations

import numpy as np

from pagoda.service.engine.core.request import Request
from pagoda.service.engine.runner.block_tables import BlockTables
from pagoda.service.sampling_params import SamplingParams


def make(rid: str, block_ids: list[int]) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(), arrival_time=0.0)
    req.block_ids = list(block_ids)
    return req


def expected(reqs: list[Request]) -> np.ndarray:
    width = max(len(r.block_ids) for r in reqs)
    table = np.zeros((len(reqs), width), dtype=np.int32)
    for i, r in enumerate(reqs):
        table[i, : len(r.block_ids)] = r.block_ids
    return table


def test_rows_follow_appends_copy_on_write_preemption_and_reclaiming() -> None:
    tables = BlockTables(num_rows=3, max_blocks_per_request=8)
    a, b = make("a", [5, 6]), make("b", [7])

    def check(reqs: list[Request]) -> None:
        assert np.array_equal(tables.gather(reqs), expected(reqs))

    check([a, b])
    a.block_ids.append(9)  # a block filled: one more
    check([a, b])
    a.block_ids[-1] = 11  # copy on write of the block being filled
    b.block_ids += [12, 13]
    check([b, a])  # order does not matter
    a.num_preemptions += 1  # preempted: new blocks, fewer of them
    a.block_ids = [20]
    check([a, b])
    c, d = make("c", [30]), make("d", [31, 32])  # rows run out: all reclaimed, then rewritten
    check([c, d, a])
    check([a, b, c])
    fork = make("a-child", list(a.block_ids))  # a fork is a new request id: its own row
    fork.block_ids[-1] = 40
    check([a, fork])
    a.block_ids += [21, 22]
    check([a, fork])
    again = make("a", [50, 51, 52])  # a finished request's id, reused by a new request
    check([again, fork])
