"""Verifying drafts (speculative decoding) so that the output keeps the target model's distribution.

A sequence that drafted d_1..d_k has k + 1 rows of logits: row j scores the token after d_j (row 0 the
token after its last real one). Each row is processed as the sampler processes a decode row at that
output position (logit_bias, min_tokens, a grammar's mask after d_1..d_j, temperature, top-k, top-p,
min-p), giving p_j. Then, for
j = 0, 1, ...:

- greedy: d_{j+1} stays while it is p_j's argmax; the first that is not is replaced by the argmax, and
  if all stay the last row's argmax follows. The output is token for token what decoding one token a
  step gives.
- sampled (Leviathan et al., 2023; Chen et al., 2023): d_{j+1} stays with probability
  min(1, p_j(d) / q_j(d)). A prompt-lookup draft is certain (q_j is one-hot on d), so that is p_j(d);
  the first rejected position samples from the residual max(p_j - q_j, 0), which is p_j without d,
  renormalised; if all stay, row k samples from p_k. Each emitted token is then distributed as p_j.

A seeded request's row noise (one uniform, one exponential race over the vocabulary) is a hash of
(seed, completion index, output position), as the sampler's is (`seeded_noise`), so it samples the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda import kernels
from pagoda.service.engine.core.request import Request
from pagoda.service.engine.core.scheduler import GrammarBitmask
from pagoda.service.engine.runner.sampler import Sampler, fill_seeded_noise, mark_unsamplable, to_device
from pagoda.service.sampling_params import SamplingParams


@dataclass
class _Row:
    """A drafting sequence as the sampler sees it at row `j`: the drafts before the row count as its
    output, as if they were accepted. No token ids: only penalties read them, and those never draft."""

    req: Request
    j: int

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    @property
    def index(self) -> int:
        return self.req.index

    @property
    def num_output_tokens(self) -> int:
        return self.req.num_output_tokens - self.req.num_drafts + self.j


def verify_drafts(
    sampler: Sampler, logits: torch.Tensor, reqs: list[Request], grammar: GrammarBitmask | None = None
) -> list[tuple[int, int]]:
    """`logits`: [sum(1 + k_i), vocab], each request's 1 + k_i rows in order (its drafts are the last
    k_i of its token ids); `grammar`: the allowed tokens of rows under a grammar (its rows index
    `logits`). Returns, per request, (the token after its kept drafts, how many drafts it keeps).
    Waits for the device."""
    rows: list[_Row] = []
    drafts: list[int] = []  # per row: the draft it judges, or -1 on each request's last row
    for req in reqs:
        rows += [_Row(req, j) for j in range(req.num_drafts + 1)]
        drafts += [*req.draft_token_ids, -1]
    device = logits.device
    adjusted = sampler.adjusted_logits(logits, rows)  # type: ignore[arg-type]  # rows quack as requests
    adjusted = sampler.apply_grammar(adjusted, grammar)
    tokens = kernels.argmax(adjusted)
    accept = tokens == to_device(drafts, torch.int64, device)
    greedy = [r.params.is_greedy for r in rows]
    if not all(greedy):
        probs = sampler.filtered_probs(adjusted, rows)  # type: ignore[arg-type]
        probs = probs / probs.sum(dim=1, keepdim=True)
        uniform, noise = _noise(rows, probs.shape[1], device)
        judged = to_device([max(d, 0) for d in drafts], torch.int64, device).view(-1, 1)
        has_draft = to_device([d >= 0 for d in drafts], torch.bool, device)
        p_draft = probs.gather(1, judged).view(-1)
        residual = torch.where(has_draft.view(-1, 1), probs.scatter(1, judged, 0.0), probs)
        sampled = (residual / noise).argmax(dim=1)  # the last row: p itself; other rows: p without d
        is_greedy = to_device(greedy, torch.bool, device)
        tokens = torch.where(is_greedy, tokens, sampled)
        accept = torch.where(is_greedy, accept, (uniform < p_draft) & has_draft)
    tokens = mark_unsamplable(tokens, adjusted, grammar)
    tokens_host, accept_host = tokens.tolist(), accept.tolist()
    verdicts = []
    start = 0
    for req in reqs:
        k = req.num_drafts
        kept = next((j for j in range(k) if not accept_host[start + j]), k)
        verdicts.append((tokens_host[start + kept], kept))
        start += k + 1
    return verdicts


def _noise(rows: list[_Row], vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row one uniform (accept or not) and exponential noise over the vocabulary (the race that
    samples); a seeded row's are hashed from its key (`seeded_noise`: the vocabulary's columns as the
    sampler's, the uniform the column after them)."""
    uniform = torch.rand(len(rows), device=device)
    noise = torch.empty(len(rows), vocab_size, device=device).exponential_()
    fill_seeded_noise(noise, rows, uniform)
    return uniform, noise
