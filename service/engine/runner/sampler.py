"""Turns a batch of logits into next tokens: penalties, logit_bias, structured output's grammar masks,
greedy or temperature / top-k / top-p / min-p sampling, and log-probabilities. Everything is batched
over rows; seeded rows draw their noise from a hash of (seed, completion index, output position)
(`seeded_noise`), so a seeded request samples the same tokens whatever else is in the batch and even
after a preemption.

Nothing here waits for the GPU: parameters go over as page-locked, non-blocking copies (a blocking
copy would wait for every kernel queued before it, the step's forward pass included), and the sampled
tokens come back the same way, so the core can queue the next step before this one's tokens are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagoda import kernels
from pagoda.service.engine.core.request import Request
from pagoda.service.engine.core.scheduler import GrammarBitmask
from pagoda.service.engine.messages import NO_TOKEN, SampleResult
from pagoda.service.engine.runner.seeded_noise import row_key
from pagoda.service.grammar import LOGIT_BIAS_LIMIT


def _pins(device: torch.device) -> bool:
    """Whether copies to and from `device` go through page-locked host memory (a CUDA device's do)."""
    return device.type == "cuda"


def to_device(values: object, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list (or array) as a tensor on `device`, without waiting for the device's queue."""
    host = torch.as_tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if _pins(device) else host


def fill_seeded_noise(noise: torch.Tensor, rows: list[Any], uniform: torch.Tensor | None = None) -> None:
    """Overwrite the rows of `noise` (and of `uniform`) whose request is seeded with their hashed draws
    (`seeded_noise`); `rows`: a request (or a verifier's row of one) per row."""
    seeded = [
        (i, *row_key(seed, r.index, r.num_output_tokens))
        for i, r in enumerate(rows)
        if (seed := r.params.seed) is not None
    ]
    if seeded:
        kernels.fill_seeded_noise(noise, to_device(seeded, torch.int32, noise.device), uniform)


def _to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Copies of device tensors into page-locked host memory, queued behind what computes them; the
    event says when they have landed."""
    if not _pins(tensors[0].device):
        return tensors, None
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors, strict=True):
        h.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass
class SampledBatch:
    """One step's sampled tokens, on their way to the host. `tokens` stays on the device: the next step
    reads its input ids from it before the host has seen them."""

    tokens: torch.Tensor  # [rows] int64, on the device
    _host: list[torch.Tensor]  # tokens, and when a row asked for them: chosen logprobs, top values, top ids
    _ready: torch.cuda.Event | None
    _num_logprobs: list[int | None]  # per row

    def results(self) -> list[SampleResult]:
        """Wait for this batch's copies (not for later work on the device) and build the results."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, *logprobs = (h.tolist() for h in self._host)
        results = [SampleResult(t) for t in tokens]
        if logprobs:
            chosen, top_vals, top_ids = logprobs
            for i, k in enumerate(self._num_logprobs):
                if k is not None:
                    results[i].logprob = chosen[i]
                    results[i].top = list(zip(top_ids[i][:k], top_vals[i][:k], strict=True))
        return results


def _token_counts(rows: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab_size] occurrence counts of each row's tokens (`rows` not empty)."""
    width = max(len(r) for r in rows)
    counts = torch.zeros(len(rows), vocab_size, device=device)
    if width:
        ids = torch.zeros((len(rows), width), dtype=torch.long)  # padding: token 0, counted with weight 0
        weights = torch.zeros((len(rows), width))
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            weights[i, : len(r)] = 1.0
        counts.scatter_add_(1, to_device(ids, torch.long, device), to_device(weights, torch.float32, device))
    return counts


def _apply_logit_bias(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """OpenAI's `logit_bias`: added to the logits; -100 bans the token outright (-inf)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, r in enumerate(reqs):
        for token_id, bias in (r.params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            values.append(float("-inf") if bias <= -LOGIT_BIAS_LIMIT else bias)
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
    return logits.index_put(index, to_device(values, torch.float32, device), accumulate=True)


def unpack_forbidden(bitmask: torch.Tensor) -> torch.Tensor:
    """int32 [rows, words] bitmask (bit t: token t allowed) -> bool [rows, words * 32], True where
    forbidden, on the bitmask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((~bitmask).unsqueeze(-1) >> shifts).bitwise_and_(1).bool().flatten(1)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bits: torch.Tensor) -> torch.Tensor:
    """Set to -inf the logits of tokens a row's grammar forbids. `bits`: int32 [len(rows), words] on the
    host (page-locked when bound for a GPU), bit t of a row allows token t; tokens past its 32 * words
    bits are forbidden.

    On a GPU the bits travel (4 bytes per 32 tokens per row: 6 KiB for a 49k vocabulary) and unpack
    there in one batched op; on the CPU numpy unpacks them (0.06 ms for 16 rows x 49k tokens, where
    torch's shift-and-mask takes 14 ms)."""
    device, vocab = logits.device, logits.shape[1]
    if _pins(device):
        forbidden = unpack_forbidden(bits.to(device, non_blocking=True))
    else:
        # Unpack the inverted words: set bits are then the forbidden tokens (little-endian words).
        unpacked = np.unpackbits((~bits.numpy()).view(np.uint8), axis=1, bitorder="little")
        forbidden = torch.from_numpy(unpacked.view(np.bool_))
    # Past the mask's bits everything is forbidden: pad by a whole vocabulary, then cut to it.
    forbidden = torch.nn.functional.pad(forbidden, (0, vocab), value=True)[:, :vocab]
    index = to_device(rows, torch.long, device)
    logits[index] = logits[index].masked_fill_(forbidden, float("-inf"))
    return logits


def _pinned_int32(shape: tuple[int, int]) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.int32, pin_memory=True)


class BitmaskStaging:
    """One host buffer for the grammar bitmasks bound for a GPU, reused across steps: page-locked,
    because a copy from pageable memory would wait for the forward pass to finish first. The step syncs
    before the next one reuses it. Room for 64 rows at first; it grows with the batch and follows the
    number of words."""

    def __init__(self, alloc: Callable[[tuple[int, int]], torch.Tensor] = _pinned_int32) -> None:
        self._alloc = alloc
        self._buffer: torch.Tensor | None = None

    def stage(self, bitmask: np.ndarray) -> torch.Tensor:
        """`bitmask` copied into the buffer: a view of its first rows."""
        rows, words = bitmask.shape
        if self._buffer is None or self._buffer.shape[0] < rows or self._buffer.shape[1] != words:
            self._buffer = self._alloc((max(rows, 64), words))
        staged = self._buffer[:rows]
        staged.numpy()[:] = bitmask
        return staged


def _argmax_of_raw_logits(r: Request) -> bool:
    """Whether `r`'s next token is the argmax of its logits as the model gave them: greedy, without
    log-probabilities, and nothing moves a logit (penalties, logit_bias, min_tokens' bans)."""
    p = r.params
    return (
        p.is_greedy
        and p.logprobs is None
        and not p.logit_bias
        and p.allowed_token_ids is None
        and not (p.presence_penalty or p.frequency_penalty)
        and p.repetition_penalty == 1.0
        and r.num_output_tokens >= p.min_tokens
    )


def mark_unsamplable(
    tokens: torch.Tensor, logits: torch.Tensor, grammar: GrammarBitmask | None
) -> torch.Tensor:
    """`tokens` with NO_TOKEN in the rows whose `logits` are all -inf, for the host to read (the next
    step's input ids keep a real id). Only masks make -inf (logit_bias is bounded), and without a
    grammar the others always leave a token: admission refuses an allowed_token_ids list of only stop
    tokens under min_tokens. So a batch without a grammar costs nothing here."""
    if grammar is None:
        return tokens
    return torch.where(torch.isneginf(logits).all(dim=1), NO_TOKEN, tokens)


# At most this many allowed token ids kept on the device between steps (8 bytes each: 32 MiB), however
# many requests list how many: a request may list up to the vocabulary.
ALLOWED_IDS_HELD = 1 << 22


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._staging = BitmaskStaging()
        # Each allowed_token_ids list on the device, made once per request: id(list) -> (list, ids).
        self._allowed: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._allowed_ids_held = 0  # token ids in `_allowed`, bounded by ALLOWED_IDS_HELD

    def __call__(
        self, logits: torch.Tensor, reqs: list[Request], grammar: GrammarBitmask | None = None
    ) -> SampledBatch:
        """`logits`: [num_rows, vocab] float32 (or the LM head's dtype, from a step graph), one row per
        request in `reqs`; `grammar`: the allowed tokens of the rows under a grammar (its rows index
        `reqs`). Queues the sampling and the copies back; `results()` of what it returns waits for them.

        A batch of plain greedy rows takes the argmax of the logits as they are: the same token as
        through float32 (a widening is exact, and argmax keeps the first of equal values either way),
        without a float32 copy of the batch's logits (0.18-0.26 ms a step at 448-640 rows of a 128k
        vocabulary on an H100, BENCHMARKS.md)."""
        if grammar is None and all(_argmax_of_raw_logits(r) for r in reqs):
            tokens = kernels.argmax(logits[:, : self.vocab_size])
            host, ready = _to_host([tokens])
            return SampledBatch(tokens, host, ready, [None] * len(reqs))
        device = logits.device
        params = [r.params for r in reqs]
        logits = self.adjusted_logits(logits, reqs)

        # Structured output last: whatever the biases did, only the grammar's tokens stay possible.
        logits = self.apply_grammar(logits, grammar)

        greedy = [p.is_greedy for p in params]
        if all(greedy):
            tokens = kernels.argmax(logits)
        elif not any(greedy):
            tokens = self._sample(logits, reqs)
        else:
            tokens = torch.where(
                to_device(greedy, torch.bool, device), kernels.argmax(logits), self._sample(logits, reqs)
            )

        wanted = [mark_unsamplable(tokens, logits, grammar)]  # the device keeps `tokens`
        num_logprobs = [p.logprobs for p in params]
        widest = max((k for k in num_logprobs if k is not None), default=None)
        if widest is not None:
            logprobs = torch.log_softmax(logits, dim=1)
            chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1)
            top_vals, top_ids = logprobs.topk(widest, dim=1)
            wanted += [chosen, top_vals, top_ids]
        host, ready = _to_host(wanted)
        return SampledBatch(tokens, host, ready, num_logprobs)

    def apply_grammar(self, logits: torch.Tensor, grammar: GrammarBitmask | None) -> torch.Tensor:
        """`logits` with the tokens each grammar row forbids at -inf (`grammar.rows` index its rows)."""
        if grammar is None:
            return logits
        mask = grammar.bitmask
        bits = self._staging.stage(mask) if _pins(logits.device) else torch.from_numpy(mask)
        return apply_token_bitmask(logits, grammar.rows, bits)

    def _ban_stops_before_min_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """min_tokens: end-of-sequence and stop tokens are not allowed yet."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                banned = [*r.params.stop_token_ids, *([] if r.params.ignore_eos else self.eos_token_ids)]
                cols += [t for t in banned if t < self.vocab_size]
                rows += [i] * (len(cols) - len(rows))
        if not rows:
            return logits
        device = logits.device
        index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
        return logits.index_put(index, torch.full((len(rows),), float("-inf"), device=device))

    def adjusted_logits(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The logits sampling starts from: penalties, logit_bias, allowed_token_ids and min_tokens
        applied (no grammar)."""
        logits = self._apply_penalties(logits[:, : self.vocab_size].float(), reqs)
        logits = self._keep_allowed_tokens(_apply_logit_bias(logits, reqs), reqs)
        return self._ban_stops_before_min_tokens(logits, reqs)

    def _keep_allowed_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """vLLM's `allowed_token_ids`: a row that lists them keeps those tokens' logits, the rest -inf."""
        rows = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids is not None]
        if not rows:
            return logits
        device = logits.device
        cols = [self._allowed_ids(reqs[i].params.allowed_token_ids or [], device) for i in rows]
        row_index = torch.cat([torch.full_like(c, i) for i, c in zip(rows, cols, strict=True)])
        col_index = torch.cat(cols)
        kept = logits[row_index, col_index]
        banned = logits.index_fill(0, to_device(rows, torch.long, device), float("-inf"))
        return banned.index_put((row_index, col_index), kept)

    def _allowed_ids(self, allowed: list[int], device: torch.device) -> torch.Tensor:
        """`allowed` as a tensor on `device`, uploaded at a request's first step only (a list may be as
        long as the vocabulary). Keyed by the list's identity; the list is kept so its id is not reused."""
        cached = self._allowed.get(id(allowed))
        if cached is None or cached[0] is not allowed:
            if self._allowed_ids_held + len(allowed) > ALLOWED_IDS_HELD:  # finished requests' lists mostly:
                self._allowed.clear()  # dropped wholesale, running ones uploaded again at their next step
                self._allowed_ids_held = 0
            cached = self._allowed[id(allowed)] = (allowed, to_device(allowed, torch.long, device))
            self._allowed_ids_held += len(allowed)
        return cached[1]

    def _apply_penalties(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        device = logits.device
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            counts = _token_counts([r.output_token_ids for r in reqs], self.vocab_size, device)
            presence = to_device([p.presence_penalty for p in params], torch.float32, device).view(-1, 1)
            frequency = to_device([p.frequency_penalty for p in params], torch.float32, device).view(-1, 1)
            logits = logits - presence * counts.bool() - frequency * counts
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = _token_counts([r.token_ids for r in reqs], self.vocab_size, device).bool()
            penalty = to_device([p.repetition_penalty for p in params], torch.float32, device).view(-1, 1)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        return logits

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        probs = self.filtered_probs(logits, reqs)
        # Exponential race (Gumbel-max): argmax(p / E), E ~ Exp(1), samples from p.
        noise = torch.empty_like(probs)
        if any(r.params.seed is None for r in reqs):  # else every row's noise is hashed below
            noise.exponential_()
        fill_seeded_noise(noise, reqs)
        return kernels.argmax(probs / noise)

    def filtered_probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """[rows, vocab] what each row samples from, unnormalised after min-p: temperature, then top-k
        and top-p, then min-p (penalties and biases are already in `logits`)."""
        params = [r.params for r in reqs]
        device = logits.device
        temperature = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        logits = logits / to_device(temperature, torch.float32, device).view(-1, 1)

        top_k = [min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size for p in params]
        # top_p = 1 keeps everything: no threshold, which a float cumsum can reach (rounding) and drop
        # the tail (seen with torch 2.15, a row at temperature 0.7 beside top-p rows).
        top_p = [p.top_p if p.top_p < 1.0 else float("inf") for p in params]
        if any(k < self.vocab_size for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=1, descending=True)
            ranks = torch.arange(self.vocab_size, device=device).view(1, -1)
            drop = ranks >= to_device(top_k, torch.long, device).view(-1, 1)
            probs_sorted = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            drop |= (probs_sorted.cumsum(dim=1) - probs_sorted) >= to_device(
                top_p, torch.float32, device
            ).view(-1, 1)
            logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))

        probs = logits.softmax(dim=1)
        min_p = [p.min_p for p in params]
        if any(m > 0 for m in min_p):
            floor = probs.max(dim=1, keepdim=True).values * to_device(min_p, torch.float32, device)[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs
