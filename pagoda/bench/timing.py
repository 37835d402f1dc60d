"""What the offline benchmarks share: a device sync around timed work, the device's name for the table,
and one timed `LLM.generate` from an empty prefix cache."""

from __future__ import annotations

import platform
import time
from typing import Any


def sync(device: Any) -> None:
    """Waits for the device's queued work (CUDA kernels run asynchronously); nothing on the CPU."""
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: Any) -> str:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def timed_generate(
    llm: Any, device: Any, prompts: Any, params: Any, **kwargs: Any
) -> tuple[float, list[Any]]:
    """(seconds, outputs) of `llm.generate(prompts, params, **kwargs)`, the prefix cache emptied first so
    a repeated run prefills again."""
    llm.reset_prefix_cache()
    sync(device)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, **kwargs)
    sync(device)
    return time.perf_counter() - start, outs


def emit_markdown(lines: list[str], output: str | None) -> None:
    """Print a bench's Markdown result and, with `--output FILE`, append it there after a blank line."""
    text = "\n".join(lines) + "\n"
    print(text)
    if output:
        with open(output, "a") as f:
            f.write("\n" + text)
