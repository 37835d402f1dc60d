"""The typed messages between the API process and the engine-core process, and their wire format.

Requests go in as token ids and sampling params; each step comes back as one `CoreOutputs`: the new
token of every sequence that got one, with its log-probabilities and, when the core finished it, why.
Text never crosses: tokenizing, detokenizing and stop strings are the API process's work.

Wire format: msgpack through msgspec. msgspec encodes these Structs and the engine's existing
dataclasses (`SamplingParams`, `EngineStats`) without per-type code, decodes straight into the typed
objects (a malformed message fails loudly, not as a missing key later), and takes about 1 µs per
token output, so a 256-sequence step costs well under a millisecond to send.
No torch here: both processes import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from pagoda.service.sampling_params import SamplingParams

# A row's token id when its constraints left no token possible: allowed_token_ids, min_tokens' bans
# and a grammar with nothing in common. The core fails that request (`RequestFailure.invalid`).
NO_TOKEN = -1


@dataclass
class SampleResult:
    token_id: int  # or NO_TOKEN
    logprob: float | None = None  # of the sampled token, when asked for
    top: list[tuple[int, float]] | None = None  # (token id, logprob), descending
    rank: int | None = None  # of a scored prompt token in its position's distribution, 1 the likeliest


@dataclass
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    block_size: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of which found
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    # Engine steps by kind ("decode": every sequence one token; "mixed": any prefill chunk), as counts
    # per STEP_SECONDS_BUCKETS bucket (not cumulative; the last one past the largest bound) and sums.
    step_bucket_counts: dict[str, list[int]] = field(default_factory=dict)
    step_seconds_sum: dict[str, float] = field(default_factory=dict)
    gc_pause_seconds_total: float = 0.0  # the core process's garbage-collector pauses (gc_pauses.py)
    gc_collections_total: int = 0
    # Speculative decoding (vLLM's spec_decode counters): sequences that drafted in a step, their draft
    # tokens, the accepted ones, and accepted ones by draft position (0 first). None: speculation off.
    spec_num_drafts_total: int | None = None
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_position_total: list[int] = field(default_factory=list)
    # LoRA adapters the core serves (name -> path; --enable-lora), so every API process knows them.
    lora_adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = 0  # GPU slots (0: LoRA off)
    lora_running: list[str] = field(default_factory=list)  # adapters of running / waiting requests
    lora_waiting: list[str] = field(default_factory=list)
    # Per adapter, since start (unloaded ones stay): requests, generated tokens, loads (reading and
    # checking its files) with their seconds, and placements into a GPU slot.
    lora_requests_total: dict[str, int] = field(default_factory=dict)
    lora_generation_tokens_total: dict[str, int] = field(default_factory=dict)
    lora_loads_total: dict[str, int] = field(default_factory=dict)
    lora_load_seconds_total: dict[str, float] = field(default_factory=dict)
    lora_slot_loads_total: dict[str, int] = field(default_factory=dict)


# Upper bounds, in seconds, of the step duration histogram (`pagoda_engine_step_duration_seconds`).
STEP_SECONDS_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)


# ---- API process -> engine core -------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True):
    """A validated request: `params.n` sequences share its prompt."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic(): one clock for every process of the host
    lora_name: str | None = None  # a LoRA adapter the core serves (None: the base model)


class Abort(msgspec.Struct, tag=True):
    """Stop sequences at once and free their KV blocks. `index` None: all of a request's sequences."""

    request_ids: list[str]
    index: int | None = None


class Shutdown(msgspec.Struct, tag=True):
    pass


class LoRAOp(msgspec.Struct, tag=True):
    """Load (`path` given) or unload a LoRA adapter; the core answers with a `LoRAReply` of `op_id`
    (routed as request ids are)."""

    op_id: str
    name: str
    path: str | None = None


CoreInput = AddRequest | Abort | Shutdown | LoRAOp


# ---- engine core -> API process -------------------------------------------------------------------


class TokenOutput(msgspec.Struct, array_like=True):
    """One sequence's new token. `finish_reason` is set when the core ended the sequence (EOS, a stop
    token id, max_tokens, the context length); stop strings are the API process's to find."""

    request_id: str
    index: int  # which of the request's n sequences
    sample: SampleResult
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | None = None  # the stop token id, when one ended it
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (set on the first token)
    scheduled_time: float | None = None  # when the request first got a slot (set on the first token)


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Scores of a request's prompt tokens from `position` on (asked for with `prompt_logprobs`)."""

    request_id: str
    position: int
    scores: list[SampleResult]


class RequestFailure(msgspec.Struct, array_like=True):
    """A client request that failed inside a step (and only it): the core has ended and freed it."""

    request_id: str
    message: str
    invalid: bool = False  # the request's own parameters are at fault (a 400), not the engine


class LoRAReply(msgspec.Struct, array_like=True):
    """A `LoRAOp` done (`error` None) or refused, with why."""

    op_id: str
    error: str | None = None


class CoreOutputs(msgspec.Struct, tag=True):
    outputs: list[TokenOutput]
    prompt_logprobs: list[PromptLogprobs]
    stats: EngineStats
    failures: list[RequestFailure] = []
    # time.monotonic() in the core as it sent this (CLOCK_MONOTONIC: one clock for every process of a
    # host), so an API process can time the hop (`pagoda_output_delay_seconds{stage="core_to_api"}`).
    sent_at: float = 0.0
    lora_replies: list[LoRAReply] = []


class CoreReady(msgspec.Struct, tag=True):
    """Sent once the model is loaded and the KV cache allocated."""

    max_model_len: int
    vocab_size: int
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag=True):
    """The core cannot go on (start-up error, a failed step); it exits after sending this."""

    message: str


CoreMessage = CoreOutputs | CoreReady | CoreFailed


def core_request_id(api_index: int, request_id: str) -> str:
    """The id the core knows a request by when several API processes share it (`--api-server-count`):
    the process's index first, so the core can route outputs without a table and ids from different
    processes never collide. With one API process the client's id goes unchanged."""
    return f"{api_index}:{request_id}"


def split_core_request_id(core_id: str) -> tuple[int, str]:
    """(API process index, its own request id) from `core_request_id`'s result."""
    api_index, _, request_id = core_id.partition(":")
    return int(api_index), request_id


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder[CoreInput]:
    return msgspec.msgpack.Decoder(CoreInput)  # type: ignore[arg-type]


def output_decoder() -> msgspec.msgpack.Decoder[CoreMessage]:
    return msgspec.msgpack.Decoder(CoreMessage)  # type: ignore[arg-type]
