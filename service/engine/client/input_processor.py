"""Admission on the API side: check a request and turn its prompt into token ids, before the engine core
sees it. Everything the core receives is already valid, so nothing a client sends can fail there."""

from __future__ import annotations

from pagoda.service.errors import InvalidRequestError
from pagoda.service.grammar import check_logit_bias, validate_grammar
from pagoda.service.sampling_params import SamplingParams
from pagoda.service.tokenizer import Tokenizer

MAX_N = 128  # completions per request, as OpenAI allows


def check_text_fits(text: str, max_model_len: int, tokenizer: Tokenizer) -> None:
    """Refuse, before spending time tokenizing it, text that no context of `max_model_len` tokens can
    hold (no token spans more than `tokenizer.max_token_chars` characters)."""
    if len(text) > max_model_len * tokenizer.max_token_chars:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, and the prompt's "
            f"{len(text)} characters are more than that many tokens can hold; shorten the prompt",
            param="prompt",
        )


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def process(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids; `InvalidRequestError` naming the field when the request cannot run on
        this model (`params` checked their own fields when built)."""
        self._check_token_params(params)
        keep = self._kept_prompt_tokens(params.truncate_prompt_tokens)
        if isinstance(prompt, str):
            if keep is None:
                check_text_fits(prompt, self.max_model_len, self.tokenizer)
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
            if keep is None and len(token_ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                    f"{len(token_ids)} tokens; shorten the prompt",
                    param="prompt",
                )
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", param="prompt"
                )
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if keep is not None:
            token_ids = token_ids[-keep:]
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(token_ids)} tokens; shorten the prompt",
                param="prompt",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(token_ids)} tokens and max_tokens is {params.max_tokens} (at most {room} fit)",
                param="max_tokens",
            )
        return token_ids

    def _stops(self, params: SamplingParams) -> set[int]:
        """The tokens min_tokens bans: stop token ids, and end-of-sequence unless ignore_eos."""
        return set(params.stop_token_ids) | (
            set() if params.ignore_eos else set(self.tokenizer.eos_token_ids)
        )

    def _kept_prompt_tokens(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of the prompt's last tokens `truncate_prompt_tokens` keeps (vLLM's: -1 is the
        context length); None: the whole prompt, which must then fit."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens ({truncate_prompt_tokens}) must not exceed this model's maximum "
                f"context length ({self.max_model_len})",
                param="truncate_prompt_tokens",
            )
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    def _check_token_params(self, params: SamplingParams) -> None:
        """What only the model's vocabulary can judge. A top_k of the vocabulary or more keeps every
        token, so it becomes 0 (off) here rather than reaching the sampler as a huge integer."""
        if params.n > MAX_N:
            raise InvalidRequestError(f"n must be at most {MAX_N}, got {params.n}", param="n")
        if params.top_k >= self.vocab_size:
            params.top_k = 0
        if params.min_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"min_tokens must be less than the context length ({self.max_model_len}), "
                f"got {params.min_tokens}",
                param="min_tokens",
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids out of range [0, {self.vocab_size}): {bad[:5]}", param="stop_token_ids"
            )
        check_logit_bias(params.logit_bias, self.vocab_size)
        allowed = params.allowed_token_ids
        if allowed is not None:
            bad = [t for t in allowed if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"allowed_token_ids out of range [0, {self.vocab_size}): {bad[:5]}",
                    param="allowed_token_ids",
                )
            # Before min_tokens the end-of-sequence and stop tokens are banned: a list of only those
            # would leave nothing to sample (the sampler would draw a token outside it).
            if params.min_tokens > 0 and set(allowed) <= self._stops(params):
                raise InvalidRequestError(
                    "allowed_token_ids holds only end-of-sequence and stop tokens, which min_tokens bans "
                    "until it is reached: nothing could be sampled",
                    param="allowed_token_ids",
                )
            # Each id once, and no list at all where every token is allowed (the sampler's fast paths).
            distinct = sorted(set(allowed))
            params.allowed_token_ids = distinct if len(distinct) < self.vocab_size else None
        if params.grammar is not None:
            params.grammar = validate_grammar(params.grammar)  # invalid: a 400 here; valid: converted
