"""Where the GPU idles in a profiler trace: the gaps between its kernels and what the host was doing.

    python -m pagoda.service.bench_trace TRACE.json [--min-gap-us 5] [--top 15]

TRACE.json is a Chrome trace from `torch.profiler` with CPU and CUDA activities, as
`pagoda bench offline --busy-steps N --busy-trace TRACE.json` writes it. The GPU's work (kernels,
copies, memsets, on any stream) is merged into busy intervals; a gap is the time between two. Each gap
is put down to the host call that was running when it began: the innermost CUDA runtime call or
operator on the host covering that moment (a `cudaStreamSynchronize` there means the host waited for
the GPU, an operator means the host was still preparing work), or "(host between calls)" when none
covers it; and, where the trace names phases (`record_function`, as `--busy-trace` does for the
engine's), to the innermost phase as well ("core: schedule / (host between calls)"). The report:
busy and idle time over the traced span, idle by host call, and the longest gaps.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
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


@dataclass
class Report:
    start_us: float  # the first GPU event's start
    span_us: float  # first GPU start to last GPU end
    busy_us: float
    gaps: list[Gap]

    @property
    def idle_us(self) -> float:
        return self.span_us - self.busy_us


def _complete_events(trace: dict) -> list[dict]:
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def busy_intervals(events: list[dict]) -> list[tuple[float, float]]:
    """The GPU's events merged into disjoint (start, end) intervals, in time order."""
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in GPU_CATEGORIES
    )
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _host_at(host: list[dict], t: float) -> str:
    """The shortest host event covering time t (the innermost call), by name."""
    covering = [e for e in host if float(e["ts"]) <= t < float(e["ts"]) + float(e["dur"])]
    if not covering:
        return IDLE_HOST
    return str(min(covering, key=lambda e: float(e["dur"]))["name"])


def analyze(trace: dict, min_gap_us: float = 5.0) -> Report:
    events = _complete_events(trace)
    busy = busy_intervals(events)
    if not busy:
        raise ValueError("no GPU events in the trace: record it with CUDA activity, on a GPU")
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES - {"user_annotation"}]
    phases = [e for e in events if e.get("cat") == "user_annotation"]
    gaps = [
        Gap(end, nxt, _host_at(host, end), _host_at(phases, end) if phases else "")
        for (_, end), (nxt, _) in pairwise(busy)
        if nxt - end >= min_gap_us
    ]
    return Report(busy[0][0], busy[-1][1] - busy[0][0], sum(end - start for start, end in busy), gaps)


def format_report(report: Report, top: int = 15) -> str:
    lines = [
        f"traced span {report.span_us / 1000:.2f} ms: GPU busy {report.busy_us / 1000:.2f} ms "
        f"({100 * report.busy_us / report.span_us:.0f}%), idle {report.idle_us / 1000:.2f} ms; "
        f"{len(report.gaps)} gaps of at least the threshold, {sum(g.us for g in report.gaps) / 1000:.2f} ms",
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
        prog="python -m pagoda.service.bench_trace", description=(__doc__ or "").splitlines()[0]
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
