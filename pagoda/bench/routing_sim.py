"""`pagoda bench routing`: routers over many replicas, simulated, for the scales no machine here can run.

A discrete-event simulation (simpy) of an InferenceService under a diurnal trace of chat sessions that
share system prompts: a router in front of N replicas, each an engine doing continuous batching over
a prefix cache, and the HPA adding and removing replicas. A replica's step time is a line fitted to
the H200 figures in BENCHMARKS.md (`StepCost`), so the simulation says what a routing policy is worth
at 16 to 1,024 replicas, not what one replica does (the e2e test and the H200 runs measure that).

What it models, and what it leaves out, is in docs/routing.md ("Past one machine").
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where it runs: `pagoda bench` works without the dev extra's simpy
    import simpy

HELP = "simulate routing policies and HPA settings over many replicas (docs/routing.md)"
POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass(frozen=True)
class StepCost:
    """One engine step on one H200, Llama-3.1-8B shapes, fp8 + fp8 KV (BENCHMARKS.md, issue 37's grid).

    base_ms: a batch-1 decode step (3.2 ms/token). per_seq_ms: each further sequence in the step, from
    128 in / 2,048 out at 256 in flight, 21,032 tok/s (a 12.2 ms step): (12.2 - 3.2) / 255.
    per_prefill_token_ms: 2,048 in / 128 out, 1,024 requests at 3,070 tok/s (42.7 s, about 6 s of it
    decode) leaves 36.7 s for 2.1M prompt tokens.
    """

    base_ms: float = 3.2
    per_seq_ms: float = 0.035
    per_prefill_token_ms: float = 0.0175

    def seconds(self, sequences: int, prefill_tokens: int) -> float:
        return (self.base_ms + self.per_seq_ms * sequences + self.per_prefill_token_ms * prefill_tokens) / 1e3


@dataclass(frozen=True)
class EngineShape:
    """The engine's limits on one replica. kv_tokens: an H200's 0.9 of 141 GB, less 8 GB of fp8 weights
    and activations, at 64 KiB of fp8 KV per token (32 layers x 8 KV heads x 128 x K and V)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_tokens: int = 1_800_000
    startup_s: float = 60.0  # a new pod to Ready: image cached, weights from the node's model cache


@dataclass(frozen=True)
class Workload:
    """Chat sessions: each picks one of `system_prompts` shared prompts, then takes turns; each turn's
    prompt is the system prompt, the session so far, and the new user message."""

    peak_sessions_per_s: float
    day_s: float = 1800.0  # one diurnal period, compressed (docs/routing.md says what that changes)
    trough: float = 0.25  # the night's rate as a share of the peak
    system_prompts: int = 64
    system_tokens: tuple[int, int] = (1000, 2000)
    turns_mean: float = 4.0
    think_s_mean: float = 20.0
    user_tokens: tuple[int, int] = (30, 300)
    output_tokens: tuple[int, int] = (50, 400)

    def rate(self, t: float) -> float:
        phase = (1 - math.cos(2 * math.pi * t / self.day_s)) / 2  # 0 at midnight, 1 at noon
        return self.peak_sessions_per_s * (self.trough + (1 - self.trough) * phase)


@dataclass(frozen=True)
class Autoscaler:
    """The HPA as Kubernetes runs it on the operator's two metrics: waiting requests per pod against
    targetQueueDepth and KV-cache usage against targetKvCacheUsage (the larger ratio wins), a 10%
    tolerance, scale-up at most doubling per period, scale-down held for the stabilization window."""

    min_replicas: int
    max_replicas: int
    target_queue_depth: float = 8.0
    target_kv_cache_usage: float = 0.8
    period_s: float = 15.0
    scale_down_window_s: float = 300.0
    tolerance: float = 0.1


@dataclass
class Request:
    session: int
    system: int
    system_tokens: int
    history_tokens: int  # the session's earlier turns, cached as one prefix after the system prompt
    new_tokens: int
    output_tokens: int
    arrived: float
    cached: int = 0
    prefill_left: int = 0
    generated: int = 0
    first_token: float | None = None
    done: simpy.Event | None = None

    @property
    def prompt_tokens(self) -> int:
        return self.system_tokens + self.history_tokens + self.new_tokens


class PrefixCache:
    """A replica's prefix cache, by prefix rather than by block: a system prompt, and under it each
    session's history. Least recently used goes first; a system prompt is touched with each of its
    sessions, so its sessions go before it (as leaves go before their parent in a radix tree)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.tokens = 0

    def match(self, request: Request) -> int:
        system = self.entries.get(("system", request.system))
        if system is None:
            return 0
        history = self.entries.get(("session", request.session), 0)
        return system + min(history, request.history_tokens)

    def touch(self, request: Request) -> None:
        for key in (("session", request.session), ("system", request.system)):
            if key in self.entries:
                self.entries.move_to_end(key)

    def insert(self, request: Request) -> None:
        """After a turn: the system prompt and the session through this turn's answer."""
        history = request.history_tokens + request.new_tokens + request.output_tokens
        for key, tokens in (
            (("session", request.session), history),
            (("system", request.system), request.system_tokens),
        ):
            self.tokens += tokens - self.entries.get(key, 0)
            self.entries[key] = tokens
            self.entries.move_to_end(key)

    def shrink_to(self, tokens: int) -> None:
        while self.tokens > tokens and self.entries:
            _, evicted = self.entries.popitem(last=False)
            self.tokens -= evicted


class Replica:
    """One server pod: continuous batching, chunked prefill within a token budget, prefix reuse.

    Steps are simulated in runs: while a batch only decodes, the next change (a request finishing) is
    a known number of steps away, so the replica sleeps that long unless a request arrives, and then
    it wakes at the next step boundary to admit it (as the engine would)."""

    def __init__(
        self,
        env: simpy.Environment,
        index: int,
        cost: StepCost,
        shape: EngineShape,
        stats: Stats,
        on_ready: Callable[[Replica], None],
    ) -> None:
        self.env, self.index, self.cost, self.shape, self.stats = env, index, cost, shape, stats
        self._on_ready = on_ready
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cache = PrefixCache()
        self.in_flight_tokens = 0
        self.ready = False
        self.draining = False
        self.started = env.now
        self.stopped: float | None = None
        self._wake = env.event()
        env.process(self._run())

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def kv_cache_usage(self) -> float:
        return self.in_flight_tokens / self.shape.kv_tokens

    def submit(self, request: Request) -> None:
        self.waiting.append(request)
        self._poke()

    def drain(self) -> None:
        """Take no more requests; finish those taken, then stop (a pod still starting stops at once)."""
        self.draining = True
        if not self.ready:
            self.stopped = self.env.now
        self._poke()

    def _poke(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def _run(self) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(self.shape.startup_s)
        if self.draining:
            return
        self.ready = True
        self._on_ready(self)
        while not (self.draining and self.load == 0):
            self._admit()
            if not self.running:
                self._wake = self.env.event()
                yield self._wake
                continue
            prefill = self._plan_prefill()
            decoding = [r for r in self.running if r.prefill_left == 0]
            if prefill:
                yield self.env.timeout(self.cost.seconds(len(decoding) + len(prefill), sum(prefill.values())))
                self._advance(decoding, 1, prefill)
                continue
            step = self.cost.seconds(len(decoding), 0)
            steps = min(r.output_tokens - r.generated for r in decoding)
            start = self.env.now
            self._wake = self.env.event()
            if self.waiting or len(self.running) >= self.shape.max_num_seqs:
                yield self.env.timeout(steps * step)  # nothing could be admitted sooner anyway
            else:
                yield self._wake | self.env.timeout(steps * step)
                done = min(steps, math.floor((self.env.now - start) / step + 1e-9))
                if done < steps:  # woken by an arrival: finish the step under way
                    done += 1
                    yield self.env.timeout(start + done * step - self.env.now)
                steps = done
            self._advance(decoding, steps, {})
        self.stopped = self.env.now

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.shape.max_num_seqs:
            request = self.waiting.popleft()
            request.cached = self.cache.match(request)
            request.prefill_left = request.prompt_tokens - request.cached
            self.cache.touch(request)
            self.in_flight_tokens += request.prompt_tokens + request.output_tokens
            self.cache.shrink_to(self.shape.kv_tokens - self.in_flight_tokens)
            self.running.append(request)

    def _plan_prefill(self) -> dict[int, int]:
        budget, plan = self.shape.max_num_batched_tokens, {}
        for i, request in enumerate(self.running):
            if request.prefill_left and budget:
                plan[i] = min(request.prefill_left, budget)
                budget -= plan[i]
        return plan

    def _advance(self, decoding: list[Request], steps: int, prefill: dict[int, int]) -> None:
        for i, tokens in prefill.items():
            request = self.running[i]
            request.prefill_left -= tokens
            if request.prefill_left == 0:  # the step that ends a prefill samples its first token
                request.first_token = self.env.now
                request.generated = 1
        for request in decoding:
            request.generated += steps
        finished = [r for r in self.running if r.prefill_left == 0 and r.generated >= r.output_tokens]
        for request in finished:
            self.running.remove(request)
            self.in_flight_tokens -= request.prompt_tokens + request.output_tokens
            self.cache.insert(request)
            self.cache.shrink_to(self.shape.kv_tokens - self.in_flight_tokens)
            self.stats.finish(request)
            assert request.done is not None
            request.done.succeed()


@dataclass
class Stats:
    ttft: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0

    def finish(self, request: Request) -> None:
        assert request.first_token is not None
        self.ttft.append(request.first_token - request.arrived)
        self.prompt_tokens += request.prompt_tokens
        self.cached_tokens += request.cached
        self.requests += 1


class Router:
    """The policies, as vllm-router runs them (docs/routing-candidates.md). cache_aware keeps its own
    record of which prefixes it sent where, not the engines' caches: it cannot see an eviction."""

    def __init__(
        self, policy: str, cache_threshold: float = 0.3, abs_threshold: int = 64, rel_threshold: float = 1.5
    ) -> None:
        self.policy = policy
        self.cache_threshold, self.abs_threshold, self.rel_threshold = (
            cache_threshold,
            abs_threshold,
            rel_threshold,
        )
        self.serving: dict[int, Replica] = {}  # ready and not draining, by index
        self._turn = itertools.count()
        self._sent: dict[tuple[str, int], dict[int, int]] = {}  # prefix -> replica index -> its tokens there
        self._tree_tokens: dict[int, int] = {}  # replica index -> the tokens of all prefixes sent there

    def pick(self, request: Request) -> Replica:
        replicas = list(self.serving.values())
        if self.policy == "round_robin":
            return replicas[next(self._turn) % len(replicas)]
        least = min(replicas, key=lambda r: (r.load, r.index))
        if self.policy == "least_load":
            return least
        loads = [r.load for r in replicas]
        chosen = least
        if not (
            max(loads) - min(loads) > self.abs_threshold and max(loads) > self.rel_threshold * min(loads)
        ):
            matches = self._matches(request)
            if matches and max(matches.values()) / request.prompt_tokens > self.cache_threshold:
                chosen = self.serving[max(matches, key=lambda i: (matches[i], -i))]
            else:  # no good match: the replica whose tree is smallest
                chosen = min(replicas, key=lambda r: (self._tree_tokens.get(r.index, 0), r.index))
        self._record(request, chosen.index)
        return chosen

    def _matches(self, request: Request) -> dict[int, int]:
        """Serving replica -> the tokens of this prompt the router sent there before."""
        system = self._sent.get(("system", request.system), {})
        session = self._sent.get(("session", request.session), {})
        return {
            i: request.system_tokens + min(session.get(i, 0), request.history_tokens)
            for i in system
            if i in self.serving
        }

    def _record(self, request: Request, index: int) -> None:
        prefixes = (
            (("system", request.system), request.system_tokens),
            (("session", request.session), request.history_tokens + request.new_tokens),
        )
        for key, tokens in prefixes:
            sent = self._sent.setdefault(key, {})
            self._tree_tokens[index] = self._tree_tokens.get(index, 0) + tokens - sent.get(index, 0)
            sent[index] = tokens


@dataclass
class Outcome:
    policy: str
    target_queue_depth: float
    requests: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p99_s: float
    gpu_hours: float
    peak_replicas: int


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def simulate(
    policy: str,
    workload: Workload,
    autoscaler: Autoscaler,
    cost: StepCost = StepCost(),
    shape: EngineShape = EngineShape(),
    seed: int = 0,
    duration_s: float | None = None,
) -> Outcome:
    """One run: `duration_s` of the trace (a whole day by default), the replicas the HPA keeps."""
    import simpy

    env, rng, stats = simpy.Environment(), random.Random(seed), Stats()
    router = Router(policy)
    replicas: list[Replica] = []
    indices = itertools.count()

    def add_replica(ready: bool) -> None:
        on_ready = lambda r: router.serving.__setitem__(r.index, r)  # noqa: E731
        replicas.append(
            Replica(env, next(indices), cost, shape if not ready else _ready_now(shape), stats, on_ready)
        )

    for _ in range(autoscaler.min_replicas):
        add_replica(ready=True)

    def session(number: int) -> Generator[simpy.Event, Any, None]:
        system = rng.randrange(workload.system_prompts)
        system_tokens = random.Random(system).randint(*workload.system_tokens)  # the same for every session
        history = 0
        for _ in range(max(1, round(rng.expovariate(1 / workload.turns_mean)))):
            request = Request(
                number,
                system,
                system_tokens,
                history,
                rng.randint(*workload.user_tokens),
                rng.randint(*workload.output_tokens),
                env.now,
            )
            done = request.done = env.event()
            router.pick(request).submit(request)
            yield done
            history += request.new_tokens + request.output_tokens
            yield env.timeout(rng.expovariate(1 / workload.think_s_mean))

    def arrivals() -> Generator[simpy.Event, Any, None]:
        peak = workload.peak_sessions_per_s
        for number in itertools.count():  # thinning: a Poisson process at the day's varying rate
            yield env.timeout(rng.expovariate(peak))
            if rng.random() < workload.rate(env.now) / peak:
                env.process(session(number))

    def hpa() -> Generator[simpy.Event, Any, None]:
        history: deque[tuple[float, int]] = deque()
        while True:
            yield env.timeout(autoscaler.period_s)
            ready = list(router.serving.values())
            current = len([r for r in replicas if not r.draining])
            if not ready:
                continue
            waiting = sum(len(r.waiting) for r in ready) / len(ready)
            usage = sum(r.kv_cache_usage for r in ready) / len(ready)
            ratio = max(waiting / autoscaler.target_queue_depth, usage / autoscaler.target_kv_cache_usage)
            desired = current if abs(ratio - 1) <= autoscaler.tolerance else math.ceil(len(ready) * ratio)
            desired = max(autoscaler.min_replicas, min(autoscaler.max_replicas, desired, 2 * current))
            history.append((env.now, desired))
            while history[0][0] < env.now - autoscaler.scale_down_window_s:
                history.popleft()
            desired = max(desired, min(current, max(d for _, d in history)))  # scale down only what held
            for _ in range(desired - current):
                add_replica(ready=False)
            alive = [r for r in replicas if not r.draining]  # those still starting go first, then the newest
            for replica in sorted(alive, key=lambda r: (r.ready, -r.index))[: max(0, current - desired)]:
                router.serving.pop(replica.index, None)
                replica.drain()

    env.process(arrivals())
    env.process(hpa())
    end = duration_s if duration_s is not None else workload.day_s
    env.run(until=end)
    replica_seconds = sum((r.stopped if r.stopped is not None else end) - r.started for r in replicas)
    return Outcome(
        policy=policy,
        target_queue_depth=autoscaler.target_queue_depth,
        requests=stats.requests,
        hit_rate=stats.cached_tokens / max(1, stats.prompt_tokens),
        ttft_p50_s=percentile(stats.ttft, 0.5),
        ttft_p99_s=percentile(stats.ttft, 0.99),
        gpu_hours=replica_seconds / 3600,
        peak_replicas=max_replicas_seen(replicas),
    )


def _ready_now(shape: EngineShape) -> EngineShape:
    return EngineShape(shape.max_num_seqs, shape.max_num_batched_tokens, shape.kv_tokens, startup_s=0.0)


def max_replicas_seen(replicas: list[Replica]) -> int:
    """The most replicas alive at once, starting and draining ones included (they hold a GPU)."""
    changes = sorted(
        [(r.started, 1) for r in replicas] + [(r.stopped, -1) for r in replicas if r.stopped is not None]
    )
    alive = peak = 0
    for _, change in changes:
        alive += change
        peak = max(peak, alive)
    return peak


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-replicas", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--target-queue-depth", type=float, nargs="+", default=[8.0, 2.0])
    parser.add_argument(
        "--sessions-per-replica",
        type=float,
        default=1.5,
        help="the peak's new sessions per second for each replica the HPA may add",
    )
    parser.add_argument("--day-seconds", type=float, default=1800.0)
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="one run per seed; a row per run (the spread is large)",
    )
    parser.add_argument("--output", default=None, help="append the Markdown result to this file")


def run(args: argparse.Namespace, progress: Callable[[str], None] = print) -> int:
    lines = [
        f"### routing simulation: a {args.day_seconds:.0f} s day, {args.sessions_per_replica} sessions/s "
        "per replica at the peak",
        "",
        "| max replicas | HPA target queue depth | policy | seed | requests | prefix hit | TTFT p50 s "
        "| TTFT p99 s | GPU-hours | peak replicas |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for max_replicas in args.max_replicas:
        workload = Workload(args.sessions_per_replica * max_replicas, day_s=args.day_seconds)
        for target in args.target_queue_depth:
            autoscaler = Autoscaler(max(1, max_replicas // 8), max_replicas, target_queue_depth=target)
            for policy, seed in itertools.product(args.policies, args.seeds):
                o = simulate(policy, workload, autoscaler, seed=seed)
                lines.append(
                    f"| {max_replicas} | {target:g} | {policy} | {seed} | {o.requests:,} | {o.hit_rate:.1%} "
                    f"| {o.ttft_p50_s:.3f} | {o.ttft_p99_s:.3f} | {o.gpu_hours:.2f} | {o.peak_replicas} |"
                )
                progress(lines[-1])
    text = "\n".join(lines) + "\n"
    progress(text)
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n" + text)
    return 0
