"""`pagoda bench sampler`: what seeded requests cost the sampler per step, against its peer.

Times one `Sampler` call (temperature 0.8, the engine's path for sampled rows) on random logits of
`--rows` rows: every row unseeded, every row seeded (each its own seed: `runner.seeded_noise` hashes
every seeded row's noise in one batched draw), and, as the peer in the same run, every row seeded the
way the sampler did it before that: a `torch.Generator` per seeded row, a fill and a copy each. Output
is a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pagoda.bench.timing import device_name, emit_markdown, sync


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="auto", help="auto: cuda where there is one, else cpu")
    parser.add_argument("--vocab", type=int, default=128256, help="logits' columns (Llama-3's vocabulary)")
    parser.add_argument("--rows", default="1,16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (after 3 untimed)")
    parser.add_argument("--output", default=None, help="append the Markdown result to this file")


def _ms_per_call(call: Any, device: Any, repeats: int) -> float:
    for _ in range(3):
        call()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    sync(device)
    return (time.perf_counter() - start) / repeats * 1e3


def _table_row(rows: int, vocab: int, device: Any, repeats: int) -> str:
    import torch

    from pagoda.service.engine.core.request import Request
    from pagoda.service.engine.runner.sampler import Sampler
    from pagoda.service.sampling_params import SamplingParams

    class PerRowGenerators(Sampler):
        """The peer: the sampler's draw as it was before the hashed noise."""

        def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
            probs = self.filtered_probs(logits, reqs)
            noise = torch.empty_like(probs).exponential_()
            for i, r in enumerate(reqs):
                if r.params.seed is not None:
                    seed = hash((r.params.seed, r.index, r.num_output_tokens))
                    generator = torch.Generator(device=logits.device).manual_seed(seed)
                    noise[i] = torch.empty(self.vocab_size, device=logits.device).exponential_(
                        generator=generator
                    )
            return (probs / noise).argmax(dim=1)

    def requests(seeded: bool) -> list[Request]:
        params = [
            SamplingParams(temperature=0.8, max_tokens=8, seed=i if seeded else None) for i in range(rows)
        ]
        return [Request(f"r{i}", [1, 2], p, 0.0) for i, p in enumerate(params)]

    logits = torch.randn(rows, vocab, device=device)
    sampler, peer = Sampler(vocab, set()), PerRowGenerators(vocab, set())
    plain, seeded = requests(False), requests(True)
    unseeded_ms = _ms_per_call(lambda: sampler(logits, plain).results(), device, repeats)
    hashed_ms = _ms_per_call(lambda: sampler(logits, seeded).results(), device, repeats)
    peer_ms = _ms_per_call(lambda: peer(logits, seeded).results(), device, repeats)
    return f"| {rows} | {unseeded_ms:.2f} | {hashed_ms:.2f} | {peer_ms:.2f} |"


def run(args: argparse.Namespace) -> int:
    import torch

    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    torch.manual_seed(0)
    lines = [
        f"### the sampler with seeded rows: {args.vocab}-token vocabulary, temperature 0.8",
        "",
        f"Device: {device_name(device)}. Command: `pagoda bench sampler --device {name} --vocab {args.vocab} "
        f"--rows {args.rows} --repeats {args.repeats}`",
        "",
        "| rows | unseeded ms | seeded, hashed ms | seeded, a generator per row (peer) ms |",
        "| ---: | ---: | ---: | ---: |",
    ]
    lines += [_table_row(int(rows), args.vocab, device, args.repeats) for rows in args.rows.split(",")]
    emit_markdown(lines, args.output)
    return 0
