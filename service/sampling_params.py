"""How one request is sampled and when it stops. Checked once, when built (as vLLM's are): every
transport (HTTP, gRPC, the offline `LLM`) builds one, and what depends on the model (the vocabulary, the
context length) is the input processor's to check."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagoda.service.errors import InvalidRequestError, quoted
from pagoda.service.grammar import Grammar

# Bounds on what one request may ask for, whatever the transport (HTTP, gRPC, offline).
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # more than any vocabulary: the input processor bounds it by the model's
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what a 64-bit generator seed can hold


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the text ends after the stop string, not before
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token; None: none
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Structured output and biases (pagoda.service.grammar checks both against the vocabulary).
    grammar: Grammar | None = None  # the output must follow it (JSON Schema, regex, choice, Lark)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit; -100 bans it
    # vLLM's: only these tokens may be sampled (end-of-sequence too only if listed); None: any.
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep the prompt's last k tokens (-1: as many as the context holds); None: the whole prompt.
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise `InvalidRequestError` naming the first bad field. Floats must be finite (JSON allows
        NaN and Infinity through Python's parser), integers fit what the engine's messages carry."""
        floats = (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
        for name in floats:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {quoted(value)}", param=name)
        checks: list[tuple[str, bool, str]] = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}"),
            ("temperature", self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                "repetition_penalty",
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be > 0, got {self.repetition_penalty}",
            ),
            (
                "presence_penalty",
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                "frequency_penalty",
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                "seed",
                self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
                f"seed must be a 64-bit integer, got {self.seed}",
            ),
            (
                "max_tokens",
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
            ),
            (
                "stop",
                len(self.stop) <= MAX_STOP_STRINGS,
                f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (
                "stop",
                all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
                f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}",
            ),
            (
                "allowed_token_ids",
                self.allowed_token_ids is None or 0 < len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                "allowed_token_ids must list at least one token id (leave it out to allow every token)",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens is None
                or self.truncate_prompt_tokens == -1
                or self.truncate_prompt_tokens >= 1,
                f"truncate_prompt_tokens must be -1 or at least 1, got {self.truncate_prompt_tokens}",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidRequestError(message, param=param)
