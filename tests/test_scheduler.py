"""The scheduler on its own (no model): token budget, chunked prefill, preemption, n > 1 forks."""

from __future__ import annotations

import pytest

from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.lora_slots import LoRASlots
from pagoda.service.engine.core.request import Request, RequestStatus
from pagoda.service.engine.core.scheduler import Scheduler
from pagoda.service.sampling_params import SamplingParams


def make(n_tokens: int, rid: str, start: int = 0) -> Request:
    return Request(rid, list(range(start, start + n_tokens)), SamplingParams(), arrival_time=0.0)


def run_step(sched: Scheduler, next_token: int = 7) -> dict[str, int]:
    out = sched.schedule()
    for req in sched.advance(out):
        req.token_ids[-1] = next_token
    return dict(zip([r.request_id for r in out.requests], out.num_scheduled_tokens, strict=True))


def test_one_rule_prefill_chunks_then_decode() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    sched.add(make(25, "long"))
    assert run_step(sched) == {"long": 10}
    assert run_step(sched) == {"long": 10}
    assert run_step(sched) == {"long": 5}  # the last chunk samples the first token
    assert sched.running[0].num_tokens == 26
    assert run_step(sched) == {"long": 1}  # decode


def test_mixed_prefill_cap_applies_only_beside_decodes() -> None:
    sched = Scheduler(BlockManager(64, 4), 8, max_num_batched_tokens=16, max_mixed_prefill_tokens=3)
    sched.add(make(6, "first"))
    sched.add(make(9, "second", start=100))
    assert run_step(sched) == {"first": 6, "second": 9}  # nothing decodes yet: the whole budget
    sched.add(make(8, "late", start=200))
    assert run_step(sched) == {"first": 1, "second": 1, "late": 3}  # beside decodes: 3 prompt tokens
    assert run_step(sched) == {"first": 1, "second": 1, "late": 3}  # a running chunk is held to it too
    assert run_step(sched) == {"first": 1, "second": 1, "late": 2}
    sched.finish(sched.running[0])
    sched.finish(sched.running[0])
    sched.add(make(12, "alone", start=300))
    assert run_step(sched) == {"late": 1, "alone": 3}
    sched.finish(sched.running[0])
    assert run_step(sched) == {"alone": 9}  # no decodes left: the cap lifts


def test_budget_and_sequence_cap() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(make(5, f"r{i}", start=10 * i))
    assert run_step(sched) == {"r0": 5, "r1": 5}
    assert len(sched.waiting) == 1
    sched.finish(sched.running[0])
    assert run_step(sched) == {"r1": 1, "r2": 5}  # the freed slot is reused at once


def test_preempts_newest_and_recomputes() -> None:
    bm = BlockManager(6, 4)  # 24 token slots
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    sched.add(make(8, "old"))
    sched.add(make(8, "new", start=100))
    run_step(sched)
    for _ in range(8):
        run_step(sched)
    assert sched.num_preemptions >= 1
    victim = next(r for r in [*sched.waiting, *sched.running] if r.request_id == "new")
    assert victim.num_preemptions >= 1
    old = next(r for r in sched.running if r.request_id == "old")
    assert old.num_output_tokens == 9  # the oldest kept decoding
    sched.finish(old)
    num_tokens = victim.num_tokens
    steps = run_step(sched)
    # It recomputes prompt + outputs (less what its own freed blocks still hold), then samples.
    assert victim.num_computed_tokens == num_tokens and victim.num_tokens == num_tokens + 1
    assert steps["new"] == num_tokens - victim.num_cached_tokens
    assert victim.num_cached_tokens % 4 == 0 and victim.num_cached_tokens < num_tokens
    for r in [*sched.running, *sched.waiting]:
        sched.finish(r)
    assert bm.num_free_blocks == 6


def test_fork_shares_prompt_blocks() -> None:
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    leader = make(10, "x#0")
    children = [make(10, f"x#{i}") for i in (1, 2)]
    leader.pending_forks = children
    sched.add(leader)
    assert run_step(sched) == {"x#0": 9}  # stops before the last prompt token
    assert run_step(sched) == {"x#0": 1, "x#1": 1, "x#2": 1}  # each computes it and samples
    assert all(r.status is RequestStatus.RUNNING and r.num_tokens == 11 for r in [leader, *children])
    # The first two blocks are shared three ways; the third was copied on write.
    assert leader.block_ids[:2] == children[0].block_ids[:2] == children[1].block_ids[:2]
    assert len({leader.block_ids[2], children[0].block_ids[2], children[1].block_ids[2]}) == 3
    for r in [leader, *children]:
        sched.finish(r)
    assert bm.num_free_blocks == 32


def order(sched: Scheduler) -> list[str]:
    """What `schedule` returns, in batch order (a dict comparison would not see the order)."""
    out = sched.schedule()
    for req in sched.advance(out):
        req.token_ids[-1] = 7
    return [f"{r.request_id}:{n}" for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)]


def test_a_chunked_leader_stops_at_the_fork_point() -> None:
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=4)
    leader = make(10, "x#0")
    leader.pending_forks = [make(10, "x#1")]
    sched.add(leader)
    assert order(sched) == ["x#0:4"]
    assert order(sched) == ["x#0:4"]
    assert order(sched) == ["x#0:1"]  # 9 computed: the fork point, not the whole 4-token budget
    assert order(sched) == ["x#0:1", "x#1:1"]  # forked: each computes the last prompt token
    assert [r.num_tokens for r in sched.running] == [11, 11]


def test_forks_from_a_cached_prefix_join_right_after_their_leader() -> None:
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make(9, "first"))  # computes and caches blocks 0-7 of the prompt the siblings share
    assert order(sched) == ["first:9"]
    sched.finish(sched.running[0])
    sched.add(make(3, "other", start=500))
    assert order(sched) == ["other:3"]
    leader = make(9, "x#0")
    leader.pending_forks = [make(9, "x#1"), make(9, "x#2")]
    sched.add(leader)
    # The cache holds everything up to the fork point (8 tokens): the leader forks at once, and nothing
    # of the group runs this step.
    assert order(sched) == ["other:1"]
    assert [r.request_id for r in sched.running] == ["other", "x#0", "x#1", "x#2"]
    assert all(r.status is RequestStatus.RUNNING for r in sched.running)
    assert order(sched) == ["other:1", "x#0:1", "x#1:1", "x#2:1"]
    assert leader.num_cached_tokens == 8


@pytest.mark.parametrize(("prefix", "first_step"), [(10, 1), (6, 5)], ids=["8 cached", "4 cached"])
def test_a_partly_cached_leader_computes_only_up_to_the_fork_point(prefix: int, first_step: int) -> None:
    """A 10-token leader (fork point 9) after a request that cached its first full blocks: it computes
    up to the fork point (9 - cached), not all the tokens left (10 - cached)."""
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make(prefix, "first"))
    assert order(sched) == [f"first:{prefix}"]
    sched.finish(sched.running[0])
    leader = make(10, "x#0")
    leader.pending_forks = [make(10, "x#1")]
    sched.add(leader)
    assert order(sched) == [f"x#0:{first_step}"]
    assert order(sched) == ["x#0:1", "x#1:1"]


def test_an_exhausted_budget_schedules_nothing_more() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=5)
    sched.add(make(5, "a"))
    sched.add(make(4, "b", start=100))
    assert order(sched) == ["a:5"]  # no zero-token row for "b", which keeps waiting
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.waiting[0].status is RequestStatus.WAITING
    assert order(sched) == ["a:1", "b:4"]
    assert order(sched) == ["a:1", "b:1"]


def test_the_last_token_of_the_budget_is_used() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=6)
    sched.add(make(5, "a"))
    sched.add(make(4, "b", start=100))
    assert order(sched) == ["a:5", "b:1"]  # one token left: a one-token chunk of "b"
    sched.add(make(4, "c", start=200))
    assert order(sched) == ["a:1", "b:3", "c:2"]
    sched.add(make(4, "d", start=300))
    assert order(sched) == ["a:1", "b:1", "c:2", "d:2"]
    assert order(sched) == ["a:1", "b:1", "c:1", "d:2"]
    # Three decodes and a decode-sized budget: the last decode still gets the budget's last token.
    sched.finish(next(r for r in sched.running if r.request_id == "a"))
    assert order(sched) == ["b:1", "c:1", "d:1"]


def test_the_spent_mixed_prefill_cap_admits_nothing() -> None:
    """Beside decodes, once a running chunk has spent the mixed-prefill cap no prompt is admitted."""
    sched = Scheduler(BlockManager(64, 4), 8, max_num_batched_tokens=32, max_mixed_prefill_tokens=2)
    sched.add(make(3, "dec"))
    assert order(sched) == ["dec:3"]
    sched.add(make(6, "p1", start=100))
    sched.add(make(6, "p2", start=200))
    assert order(sched) == ["dec:1", "p1:2"]  # the cap is spent on p1: p2 waits
    assert order(sched) == ["dec:1", "p1:2"]  # p1 running takes the cap again; p2 still waits
    sched.add(make(2, "tail", start=300))
    assert [r.request_id for r in sched.waiting] == ["p2", "tail"]


def test_a_fork_waits_for_its_leader_to_reach_the_fork_point() -> None:
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=3)
    leader = make(8, "x#0")
    child = make(8, "x#1")
    leader.pending_forks = [child]
    sched.add(leader)
    assert order(sched) == ["x#0:3"]  # 3 computed, below the fork point 7: no fork yet
    assert child.status is RequestStatus.WAITING and sched.running == [leader]
    assert order(sched) == ["x#0:3"]
    assert order(sched) == ["x#0:1"]
    assert order(sched) == ["x#0:1", "x#1:1"]


def test_finish_frees_waiting_siblings_and_preemption_counts_once() -> None:
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    leader = make(10, "x#0")
    child = make(10, "x#1")
    leader.pending_forks = [child]
    sched.add(leader)
    assert sched.has_unfinished
    assert order(sched) == ["x#0:9"]
    sched.finish(leader)  # aborted before its siblings forked: they end with it
    assert child.status is RequestStatus.FINISHED and leader.pending_forks == []
    assert not sched.has_unfinished and bm.num_free_blocks == 32
    assert sched.num_preemptions == 0
    sched.add(make(3, "only-waiting"))
    assert sched.has_unfinished and not sched.running  # waiting alone counts as unfinished
    victim = make(4, "v", start=50)
    sched.add(victim)
    order(sched)
    sched._preempt(victim)
    assert victim.num_preemptions == 1 and sched.num_preemptions == 1


def test_siblings_of_a_running_leader_come_before_the_requests_after_it() -> None:
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=6)
    leader = make(10, "x#0")
    leader.pending_forks = [make(10, "x#1"), make(10, "x#2")]
    sched.add(leader)
    sched.add(make(2, "other", start=100))
    assert order(sched) == ["x#0:6"]
    # 6 computed, the fork point is 9: 3 more tokens, not the 4 that remain nor the 6 of the budget.
    assert order(sched) == ["x#0:3", "other:2"]
    assert order(sched) == ["x#0:1", "x#1:1", "x#2:1", "other:1"]


def test_a_cached_prefix_that_is_not_the_whole_prompt() -> None:
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make(6, "first"))  # caches one full block: tokens 0-3
    assert order(sched) == ["first:6"]
    sched.finish(sched.running[0])
    sched.add(make(10, "y"))  # tokens 0-9: 4 cached, 6 to compute
    assert order(sched) == ["y:6"]
    sched.finish(sched.running[0])
    leader = make(10, "x#0")  # 8 cached now; the fork point is 9
    leader.pending_forks = [make(10, "x#1")]
    sched.add(leader)
    assert order(sched) == ["x#0:1"]


def test_a_cached_fork_lets_the_next_waiting_request_in() -> None:
    sched = Scheduler(BlockManager(32, 4), max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make(9, "first"))
    assert order(sched) == ["first:9"]
    sched.finish(sched.running[0])
    leader = make(9, "x#0")
    leader.pending_forks = [make(9, "x#1")]
    sched.add(leader)
    sched.add(make(3, "late", start=100))
    assert order(sched) == ["late:3"]  # the group forked without a row, and the queue went on
    assert [r.request_id for r in sched.running] == ["x#0", "x#1", "late"]


def test_decodes_share_out_the_budget_to_its_last_token() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=6)
    for i, name in enumerate("abc"):
        sched.add(make(2, name, start=10 * i))
    assert order(sched) == ["a:2", "b:2", "c:2"]
    sched.max_num_batched_tokens = 2
    assert order(sched) == ["a:1", "b:1"]  # no zero-token row for "c"
    assert order(sched) == ["a:1", "b:1"]


def test_the_cap_applies_beside_decodes_only_even_to_a_two_token_chunk() -> None:
    # No decode running: a running chunk takes the whole budget, whatever its counts.
    for prompt, budget in ((7, 3), (7, 4)):
        sched = Scheduler(BlockManager(64, 4), 8, max_num_batched_tokens=budget, max_mixed_prefill_tokens=2)
        sched.add(make(prompt, "p"))
        assert order(sched) == [f"p:{budget}"]
        assert order(sched) == [f"p:{min(budget, prompt - budget)}"]
    # Beside a decode, a cap of 1 holds a 2-token chunk to 1 token.
    sched = Scheduler(BlockManager(64, 4), 8, max_num_batched_tokens=16, max_mixed_prefill_tokens=1)
    sched.add(make(2, "dec"))
    sched.add(make(4, "p", start=100))
    assert order(sched) == ["dec:2", "p:4"]
    sched.add(make(2, "q", start=200))
    assert order(sched) == ["dec:1", "p:1", "q:1"]
    assert order(sched) == ["dec:1", "p:1", "q:1"]


def test_advance_skips_a_request_finished_meanwhile_and_goes_on() -> None:
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100)
    for i, name in enumerate("abc"):
        sched.add(make(3, name, start=10 * i))
    out = sched.schedule()
    assert not out.is_empty and out.total_num_tokens == 9
    middle = out.requests[1]
    sched.finish(middle)  # e.g. aborted while its step ran
    grew = sched.advance(out)
    assert [r.request_id for r in grew] == ["a", "c"]
    assert middle.num_computed_tokens == 0 and out.requests[2].num_computed_tokens == 3
    assert sched.schedule().total_num_tokens == 2
    empty = Scheduler(BlockManager(8, 4), 8, 100).schedule()
    assert empty.is_empty and empty.total_num_tokens == 0


def test_a_long_prompt_samples_when_its_last_chunk_is_computed() -> None:
    """Token counts past 256, where CPython's small-int cache ends: compared by value, not identity."""
    sched = Scheduler(BlockManager(128, 4), max_num_seqs=8, max_num_batched_tokens=200)
    req = make(300, "long")
    sched.add(req)
    assert order(sched) == ["long:200"]
    assert req.num_tokens == 300
    assert order(sched) == ["long:100"]
    assert req.num_tokens == 301 and req.token_ids[-1] == 7


def test_prompt_scoring_is_held_to_its_own_budget_across_requests() -> None:
    """`prompt_logprobs` requests score at most max_prompt_score_tokens prompt positions a step between
    them (each scored row is a vocabulary-wide float32 row on the device); the others are not held."""
    sched = Scheduler(BlockManager(64, 4), 8, max_num_batched_tokens=40, max_prompt_score_tokens=6)

    def scoring(n: int, rid: str, start: int) -> Request:
        return Request(
            rid, list(range(start, start + n)), SamplingParams(prompt_logprobs=1), arrival_time=0.0
        )

    sched.add(scoring(10, "a", 0))
    sched.add(make(12, "plain", start=100))
    sched.add(scoring(5, "b", 200))
    sched.add(make(3, "after", start=300))
    # "a" takes the whole scoring budget; "b" waits for the next step, and so does "after" (arrival order).
    assert run_step(sched) == {"a": 6, "plain": 12}
    # The budget counts a chunk's tokens (a's last 4, its last prompt token unscored): b gets the 2 left.
    assert run_step(sched) == {"a": 4, "plain": 1, "b": 2, "after": 3}
    assert run_step(sched) == {"a": 1, "plain": 1, "b": 3, "after": 1}  # decodes are not held
    sched.add(scoring(6, "c", 400))
    sched.add(scoring(1, "one", 500))  # a one-token prompt has no position to score: not held
    assert run_step(sched) == {"a": 1, "plain": 1, "b": 1, "after": 1, "c": 6, "one": 1}


def test_a_request_whose_adapter_has_no_slot_waits_while_the_ones_behind_it_run() -> None:
    """One adapter slot: a second adapter's request waits at the head of the queue (the requests behind
    it, base model or the first adapter, are admitted meanwhile) until no running request holds the slot;
    each placement is a load the step carries."""
    slots = LoRASlots(1)
    for name in ("x", "y"):
        slots.register(name, f"/{name}")
    sched = Scheduler(BlockManager(64, 4), 8, 100, lora_slots=slots)

    def under(adapter: str | None, rid: str, start: int) -> Request:
        return Request(rid, list(range(start, start + 3)), SamplingParams(), 0.0, lora_name=adapter)

    for adapter, rid, start in (("x", "x1", 0), ("y", "y1", 10), (None, "base", 20), ("x", "x2", 30)):
        sched.add(under(adapter, rid, start))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["x1", "base", "x2"]
    assert out.lora_loads == [(0, "x", "/x")]
    assert [r.lora_slot for r in out.requests] == [0, -1, 0]
    assert [r.request_id for r in sched.waiting] == ["y1"]
    sched.advance(out)
    sched.finish(sched.running[0])  # x1
    assert [r.request_id for r in sched.schedule().requests] == ["base", "x2"]  # x2 still holds x's slot
    sched.finish(next(r for r in sched.running if r.request_id == "x2"))
    out = sched.schedule()
    assert [r.request_id for r in out.requests] == ["base", "y1"]
    assert out.lora_loads == [(0, "y", "/y")] and out.requests[1].lora_slot == 0


def test_a_preempted_request_goes_back_first_and_holds_back_those_behind_it() -> None:
    """The victim goes back to the head of the queue, before requests that waited already, and while it
    does not fit nothing behind it is admitted, though "tiny" would fit the block left: arrival order.
    (The step's own `preempted` guard, no admission after a preemption, is not observable here: the head
    is always the last victim, which never fits the blocks its preemption left.)"""
    bm = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make(8, "old"))
    sched.add(make(8, "new", start=100))
    assert order(sched) == ["old:8", "new:8"]  # every block in use
    sched.add(make(1, "tiny", start=200))
    assert order(sched) == ["old:1"]  # "new" preempted for old's next block; "tiny" not admitted
    assert [r.request_id for r in sched.waiting] == ["new", "tiny"]
    assert sched.num_preemptions == 1


def test_a_preempted_request_that_is_the_one_scheduling_ends_the_pass() -> None:
    """The newest running request is the victim; when it is the request being scheduled, nothing after
    it is scheduled this step (it was the last)."""
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    sched.add(make(7, "a"))
    sched.add(make(8, "b", start=100))
    assert order(sched) == ["a:7", "b:8"]  # a samples at 7 (8 tokens), b at 8 (9 tokens)
    # a's 8th token fits its block; b's 9th needs a fifth block: b, the newest, is its own victim.
    assert order(sched) == ["a:1"]
    assert [r.request_id for r in sched.running] == ["a"] and [r.request_id for r in sched.waiting] == ["b"]
