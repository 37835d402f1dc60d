"""The routing simulation (pagoda/bench/routing_sim.py): a replica's timing against the step-cost line
worked by hand, the prefix cache's order of eviction, the router's policies, and small whole runs."""

from __future__ import annotations

import pytest
import simpy

from pagoda.bench.routing_sim import (
    Autoscaler,
    EngineShape,
    PrefixCache,
    Replica,
    Request,
    Router,
    Stats,
    StepCost,
    Workload,
    max_replicas_seen,
    simulate,
)

COST = StepCost()
READY = EngineShape(max_num_batched_tokens=1000, startup_s=0.0)


def replica(env: simpy.Environment, stats: Stats, index: int = 0, shape: EngineShape = READY) -> Replica:
    return Replica(env, index, COST, shape, stats, on_ready=lambda r: None)


def request(
    env: simpy.Environment, session: int = 0, system: int = 0, history: int = 0, **kw: int
) -> Request:
    return Request(
        session,
        system,
        kw.get("system_tokens", 500),
        history,
        kw.get("new_tokens", 100),
        kw.get("output_tokens", 10),
        env.now,
        done=env.event(),
    )


def test_one_request_takes_its_prefill_chunks_then_a_step_per_token() -> None:
    env, stats = simpy.Environment(), Stats()
    one = request(
        env, system_tokens=1500, new_tokens=100, output_tokens=10
    )  # 1,600 tokens: chunks 1000 + 600
    replica(env, stats).submit(one)
    env.run()
    prefill = COST.seconds(1, 1000) + COST.seconds(1, 600)
    assert one.first_token == pytest.approx(prefill)
    assert stats.ttft == [pytest.approx(prefill)]
    assert env.now == pytest.approx(prefill + 9 * COST.seconds(1, 0))  # the first token came with the prefill
    assert (stats.requests, stats.prompt_tokens, stats.cached_tokens) == (1, 1600, 0)


def test_an_arrival_during_decode_joins_at_the_next_step_and_reuses_the_cached_prefix() -> None:
    env, stats = simpy.Environment(), Stats()
    server = replica(env, stats)
    first = request(env, session=1, output_tokens=100)
    server.submit(first)
    env.run(until=first.done)
    decode = COST.seconds(1, 0)
    prefill_600 = COST.seconds(1, 600)
    assert env.now == pytest.approx(prefill_600 + 99 * decode)

    long = request(env, session=2, output_tokens=50)  # same system prompt, another session
    server.submit(long)
    env.run(until=env.now + COST.seconds(1, 100) + 2.5 * COST.seconds(1, 0))  # its prefill, then 2.5 steps
    late = request(
        env, session=1, history=110, new_tokens=40, output_tokens=5
    )  # the first session's next turn
    arrived = env.now
    server.submit(late)
    env.run(until=late.done)
    assert long.cached == 500  # the system prompt only
    assert late.cached == 500 + 110  # system prompt and the session's history
    boundary = arrived + 0.5 * COST.seconds(1, 0)  # the decode step under way ends first
    assert late.first_token == pytest.approx(boundary + COST.seconds(2, 40))


def test_the_cache_evicts_least_recently_used_sessions_before_their_system_prompt() -> None:
    env, cache = simpy.Environment(), PrefixCache()
    a, b = request(env, session=1, system=0), request(env, session=2, system=0)
    cache.insert(a)
    cache.insert(b)
    assert cache.tokens == 500 + 2 * 110
    cache.touch(a)  # session 1 and its system prompt are now the most recent
    cache.shrink_to(cache.tokens - 1)
    assert ("session", 2) not in cache.entries and ("session", 1) in cache.entries
    assert cache.match(request(env, session=1, history=110)) == 610
    assert cache.match(request(env, session=1, history=50)) == 550  # the prompt's own history bounds it
    cache.shrink_to(500)
    assert list(cache.entries) == [("system", 0)]
    cache.shrink_to(0)
    assert cache.match(request(env, session=1, history=110)) == 0 and cache.tokens == 0


def test_router_policies() -> None:
    env, stats = simpy.Environment(), Stats()
    replicas = [replica(env, stats, i) for i in range(3)]
    rr = Router("round_robin")
    rr.serving = {r.index: r for r in replicas}
    assert [rr.pick(request(env)).index for _ in range(4)] == [0, 1, 2, 0]

    least = Router("least_load")
    least.serving = {r.index: r for r in replicas}
    replicas[0].waiting.extend([request(env)] * 2)
    replicas[2].waiting.append(request(env))
    assert least.pick(request(env)).index == 1

    aware = Router("cache_aware")
    aware.serving = {r.index: r for r in replicas}
    first = aware.pick(
        request(env, session=7, system=3)
    )  # nothing sent yet: the smallest tree, 1 (least load)
    assert first.index == 0  # every tree is empty: the lowest index
    assert aware.pick(request(env, session=8, system=3)).index == 0  # the same system prompt follows it
    assert aware.pick(request(env, session=9, system=4, system_tokens=50)).index == 1  # a match under 0.3
    assert aware.pick(request(env, session=7, system=3, history=110)).index == 0
    replicas[0].waiting.extend([request(env)] * 100)  # 102 waiting against 0 and 1: balance wins
    assert aware.pick(request(env, session=7, system=3, history=220)).index == 1
    del aware.serving[0]  # drained: its prefixes no longer count
    assert aware.pick(request(env, session=8, system=3, history=110)).index == 1


def test_a_small_day_finishes_every_request_and_cache_aware_hits_more() -> None:
    workload = Workload(peak_sessions_per_s=3.0, day_s=120.0, system_prompts=8, think_s_mean=2.0)
    autoscaler = Autoscaler(min_replicas=4, max_replicas=4)
    outcomes = {
        p: simulate(p, workload, autoscaler, seed=1, duration_s=150.0) for p in ("round_robin", "cache_aware")
    }
    for outcome in outcomes.values():
        assert outcome.requests > 200
        assert outcome.gpu_hours == pytest.approx(4 * 150 / 3600)
        assert outcome.peak_replicas == 4
    assert outcomes["cache_aware"].hit_rate > outcomes["round_robin"].hit_rate + 0.05
    assert outcomes["cache_aware"].ttft_p50_s < outcomes["round_robin"].ttft_p50_s
    again = simulate("cache_aware", workload, autoscaler, seed=1, duration_s=150.0)
    assert again == outcomes["cache_aware"]  # one seed, one result


def test_the_hpa_adds_replicas_under_load_and_removes_them_after() -> None:
    busy = Workload(peak_sessions_per_s=40.0, day_s=600.0, trough=0.0, system_prompts=64, think_s_mean=1.0)
    shape = EngineShape(max_num_seqs=16, startup_s=20.0)
    outcome = simulate(
        "least_load", busy, Autoscaler(1, 6, period_s=5.0, scale_down_window_s=30.0), shape=shape
    )
    assert 1 < outcome.peak_replicas <= 6
    assert outcome.gpu_hours < 6 * 600 / 3600  # fewer than the most, all day


def test_max_replicas_seen_counts_overlaps() -> None:
    env, stats = simpy.Environment(), Stats()
    replicas = [replica(env, stats, i) for i in range(3)]
    replicas[0].started, replicas[0].stopped = 0.0, 10.0
    replicas[1].started, replicas[1].stopped = 5.0, 20.0
    replicas[2].started, replicas[2].stopped = 10.0, None
    assert max_replicas_seen(replicas) == 2


def test_a_full_kv_cache_evicts_cached_prefixes_for_the_requests_it_runs() -> None:
    def second_turn_cached(kv_tokens: int) -> int:
        env, stats = simpy.Environment(), Stats()
        server = replica(env, stats, shape=EngineShape(kv_tokens=kv_tokens, startup_s=0.0))
        for turn in (request(env, session=1, system=0), request(env, session=2, system=1)):
            server.submit(turn)
            env.run(until=turn.done)
        again = request(env, session=1, system=0, history=110)
        server.submit(again)
        env.run(until=again.done)
        return again.cached

    assert second_turn_cached(10_000) == 610
    assert second_turn_cached(1_000) == 0  # session 2's 610 tokens in flight left room for 390


def test_pagoda_bench_routing_writes_a_row_per_run(tmp_path) -> None:
    from pagoda.bench.offline import main

    out = tmp_path / "BENCHMARKS.md"
    argv = ["routing", "--max-replicas", "2", "--day-seconds", "20"]
    argv += ["--policies", "round_robin", "cache_aware"]
    assert main([*argv, "--seeds", "0", "1", "--target-queue-depth", "4", "--output", str(out)]) == 0
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| 2 |")]
    assert [(r[1], r[2], r[3]) for r in rows] == [
        ("4", "round_robin", "0"),
        ("4", "round_robin", "1"),
        ("4", "cache_aware", "0"),
        ("4", "cache_aware", "1"),
    ]
    assert rows[0][4:] != rows[1][4:]  # another seed, another day
