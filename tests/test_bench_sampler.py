"""`pagoda bench sampler` on the CPU, small: a table row per batch size, every time cell a number, the
command that made it written beside it (timings themselves are BENCHMARKS.md's, never asserted)."""

from __future__ import annotations

from pathlib import Path

from pagoda.bench.offline import main


def test_the_sampler_bench_writes_a_row_per_batch_size(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    argv = ["sampler", "--device", "cpu", "--vocab", "256", "--rows", "1,3", "--repeats", "1"]
    assert main([*argv, "--output", str(out)]) == 0
    text = out.read_text()
    assert "`pagoda bench sampler --device cpu --vocab 256 --rows 1,3 --repeats 1`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2].isdigit()]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [c[0] for c in cells] == ["1", "3"]
    assert all(len(c) == 4 and all(float(x) > 0 for x in c[1:]) for c in cells)
