"""KV-cache events for routers that follow what each server's prefix cache holds, published as vLLM's
`--kv-events-config` publishes them, so an event-driven router written for vLLM reads Pagoda's too.

The wire (the schema of vLLM's `vllm/distributed/kv_events.py`, v0.34):
- a ZMQ PUB socket sends each step's events as three frames: topic, an 8-byte big-endian sequence
  number (from 0), and the msgpack payload;
- the payload is a `KVEventBatch`, a positional array `[ts, events, data_parallel_rank]`;
- each event is a map tagged `"type"`: `BlockStored` (block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, lora_name), `BlockRemoved` (block_hashes, medium), `AllBlocksCleared`;
- block hashes are the low 64 bits as an unsigned int (vLLM's default, int hashes);
- an optional ROUTER socket replays the batches still buffered: a client sends `[b"", start_seq]`
  and gets each `[b"", topic, seq, payload]` from there on, then `[b"", b"", seq -1, b""]`.

Pagoda's block hashes are its own (a chained hash of the token ids, block_manager.py), not vLLM's
sha256-CBOR: a router that recomputes vLLM's hashes from a prompt cannot match them; one that takes
hashes and token ids from the events can.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import msgspec

from pagoda.service.engine.config import KVEventsConfig

_UINT64 = (1 << 64) - 1


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: int) -> int:
    """A block hash as it goes on the wire: unsigned 64 bits."""
    return block_hash & _UINT64


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Sends each step's events (one batch per call) on a PUB socket, keeping the last `buffer_steps`
    batches for the optional replay socket. Runs in the engine core's thread: `publish` never blocks
    (a PUB socket drops for slow subscribers past its high-water mark)."""

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self._zmq = zmq
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One batch of this step's events (nothing is sent for none); then any replay asked for."""
        if events:
            payload = self._encoder.encode(KVEventBatch(time.time(), events, 0))
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload), copy=False)
            self._buffer.append((self._seq, payload))
            self._seq += 1
        if self._replay is not None:
            self._answer_replays()

    def _answer_replays(self) -> None:
        zmq = self._zmq
        while self._replay is not None and self._replay.poll(0, zmq.POLLIN):
            frames = self._replay.recv_multipart()
            identity, start = frames[0], int.from_bytes(frames[-1], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", b"", (-1).to_bytes(8, "big", signed=True), b""))

    def close(self) -> None:
        """Idempotent."""
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)


def build_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    return ZmqEventPublisher(config) if config is not None and config.publishes else None


def decode_batch(payload: bytes) -> dict[str, Any]:
    """A payload as plain data (`ts`, `events` as dicts with "type"), for tests and debugging."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    return {"ts": ts, "events": events, "data_parallel_rank": rank}
