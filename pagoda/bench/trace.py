"""Where the GPU idles in a profiler trace: the gaps between its kernels and what the host was doing.

    python -m pagoda.bench.trace TRACE.json [--min-gap-us 5] [--top 15]

TRACE.json is a Chrome trace from `torch.profiler` with CPU and CUDA activities, as
`pagoda bench offline --busy-steps N --busy-trace TRACE.json` writes it. The GPU's work (kernels,
copies, memsets, on any stream) is merged into busy intervals; a gap is the time between two. Each gap
is put down to the host call that was running when it began: the innermost CUDA runtime call or
operator on the host covering that moment (a `cudaStreamSynchronize` there means the host waited for
the GPU, an operator means the host was still preparing work), or "(host between calls)" when none
covers it; and, where the trace names phases (`record_function`, as `--busy-trace` does for the
engine's), to the innermost phase as well ("core: schedule / (host between calls)"). The report:
busy and idle time over the traced span, idle by gap size (inside a CUDA graph's replay consecutive
kernels sit under a microsecond apart; longer gaps are waits), idle by the device ops on either side of
each gap, of every size (a memset cuBLASLt issues before its kernel shows up there), idle by host call,
and the longest gaps.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver", "cpu_op", "user_annotation", "python_function"})
IDLE_HOST = "(host between calls)"


@dataclass(frozen=True)
class Gap:
    start_us: float
    end_us: float
    host: str  # the innermost host call covering `start_us`, or IDLE_HOST
    phase: str = ""  # the innermost named phase covering it (`record_function`: user annotations)

    @property
    def us(self) -> float:
        return self.end_us - self.start_us


# Gap sizes the report sums idle time by, in us: (upper bound, label).
SIZE_BUCKETS = ((1.0, "under 1 us"), (5.0, "1-5 us"), (50.0, "5-50 us"), (float("inf"), "50 us or more"))


@dataclass
class Report:
    start_us: float  # the first GPU event's start
    span_us: float  # first GPU start to last GPU end
    busy_us: float
    gaps: list[Gap]  # those of at least the threshold
    # Every gap, of any size: (the device op before it, the one after) -> (count, idle us).
    neighbours: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    by_size: dict[str, tuple[int, float]] = field(default_factory=dict)  # SIZE_BUCKETS label -> (count, us)

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def _complete_events(trace: dict) -> list[dict]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _merged(events: list[dict]) -> list[tuple[float, float, str, str]]:
    """The GPU's events merged into disjoint (start, end, first op, last op to end) intervals, in time
    order."""
    ops = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "")))
        for e in events
        if e.get("cat") in GPU_CATEGORIES
    )
    merged: list[tuple[float, float, str, str]] = []
    for start, end, name in ops:
        if merged and start <= merged[-1][1]:
            first_start, last_end, first, last = merged[-1]
            merged[-1] = (first_start, max(last_end, end), first, name if end >= last_end else last)
        else:
            merged.append((start, end, name, name))
    return merged


def _host_at(host: list[dict], t: float) -> str:
    """The shortest host event covering time t (the innermost call), by name."""
    covering = [e for e in host if float(e["ts"]) <= t < float(e["ts"]) + float(e["dur"])]
    if not covering:
        return IDLE_HOST
    return str(min(covering, key=lambda e: float(e["dur"]))["name"])


def analyze(trace: dict, min_gap_us: float = 5.0) -> Report:
    events = _complete_events(trace)
    busy = _merged(events)
    if not busy:
        raise ValueError("no GPU events in the trace: record it with CUDA activity, on a GPU")
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES - {"user_annotation"}]
    phases = [e for e in events if e.get("cat") == "user_annotation"]
    gaps = []
    neighbours: dict[tuple[str, str], tuple[int, float]] = {}
    by_size: dict[str, tuple[int, float]] = {}
    for (_, end, _, before), (nxt, _, after, _) in pairwise(busy):
        idle = nxt - end
        count, total = neighbours.get((before, after), (0, 0.0))
        neighbours[before, after] = (count + 1, total + idle)
        label = next(name for bound, name in SIZE_BUCKETS if idle < bound)
        count, total = by_size.get(label, (0, 0.0))
        by_size[label] = (count + 1, total + idle)
        if idle >= min_gap_us:
            gaps.append(Gap(end, nxt, _host_at(host, end), _host_at(phases, end) if phases else ""))
    busy_us = sum(end - start for start, end, _, _ in busy)
    return Report(busy[0][0], busy[-1][1] - busy[0][0], busy_us, gaps, neighbours, by_size)


def format_report(report: Report, top: int = 15) -> str:
    lines = [
        f"traced span {report.span_us / 1000:.2f} ms: GPU busy {report.busy_us / 1000:.2f} ms "
        f"({100 * report.busy_us / report.span_us:.0f}%), idle {report.idle_us / 1000:.2f} ms; "
        f"{len(report.gaps)} gaps of at least the threshold, {sum(g.us for g in report.gaps) / 1000:.2f} ms",
        "",
        "| gap size | gaps | idle ms |",
        "| --- | ---: | ---: |",
        *(
            f"| {label} | {report.by_size[label][0]} | {report.by_size[label][1] / 1000:.3f} |"
            for _, label in SIZE_BUCKETS
            if label in report.by_size
        ),
        "",
        "| device op before the gap | device op after it | gaps | idle ms |",
        "| --- | --- | ---: | ---: |",
        *(
            f"| {before[:60]} | {after[:60]} | {count} | {us / 1000:.3f} |"
            for (before, after), (count, us) in sorted(report.neighbours.items(), key=lambda kv: -kv[1][1])[
                :top
            ]
        ),
        "",
        "| host call when the gap began | gaps | idle ms | longest us |",
        "| --- | ---: | ---: | ---: |",
    ]
    by_host: dict[str, list[Gap]] = defaultdict(list)
    for gap in report.gaps:
        by_host[f"{gap.phase} / {gap.host}" if gap.phase else gap.host].append(gap)
    for name, gaps in sorted(by_host.items(), key=lambda kv: -sum(g.us for g in kv[1])):
        lines.append(
            f"| {name} | {len(gaps)} | {sum(g.us for g in gaps) / 1000:.3f} | {max(g.us for g in gaps):.0f} |"
        )
    lines += ["", f"longest {min(top, len(report.gaps))} gaps (us after the span's start):"]
    for gap in sorted(report.gaps, key=lambda g: -g.us)[:top]:
        where = f"{gap.phase} / {gap.host}" if gap.phase else gap.host
        lines.append(f"  {gap.us:8.1f} us at {gap.start_us - report.start_us:10.0f}: {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.bench.trace", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument(
        "trace", help="a Chrome trace (JSON) from torch.profiler with CPU and CUDA activities"
    )
    parser.add_argument("--min-gap-us", type=float, default=5.0, help="shorter gaps are not counted")
    parser.add_argument("--top", type=int, default=15, help="list this many of the longest gaps")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        trace = json.load(f)
    try:
        report = analyze(trace, args.min_gap_us)
    except ValueError as exc:
        print(f"bench_trace: {exc}", file=sys.stderr)
        return 2
    print(format_report(report, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
