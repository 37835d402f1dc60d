"""KV-cache events as vLLM's --kv-events-config publishes them: which blocks enter and leave the prefix
cache (the block manager's record), and the wire (ZMQ frames, msgpack batch, replay). The payloads are
checked as plain msgpack data against vLLM's schema, written out here, not through our own Structs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from pagoda.service.engine.config import KVEventsConfig
from pagoda.service.engine.core.block_manager import BlockManager
from pagoda.service.engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ZmqEventPublisher,
)
from pagoda.service.engine.core.request import Request
from pagoda.service.sampling_params import SamplingParams

BS = 4


def _run(bm: BlockManager, tokens: list[int], rid: str) -> Request:
    """One request's prompt computed and cached in one step, as the scheduler and runner would."""
    req = Request(rid, tokens, SamplingParams(), arrival_time=0.0)
    assert bm.can_allocate(req, req.num_tokens)
    bm.allocate(req, req.num_tokens - req.num_computed_tokens)
    req.num_computed_tokens = req.num_tokens
    bm.cache_computed_blocks(req)
    return req


def test_blocks_entering_the_cache_are_stored_events_chained_by_their_parent() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS, record_events=True)
    first = _run(bm, list(range(13)), "a")  # 3 full blocks and one token
    [stored] = bm.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None and stored.token_ids == list(range(12))
    assert len(stored.block_hashes) == 3 and stored.block_size == BS and stored.medium == "GPU"
    assert all(0 <= h < 1 << 64 for h in stored.block_hashes)  # unsigned, as vLLM's int hashes
    assert bm.take_events() == []  # taken once

    # Shares the first two blocks, then differs: only its third block is new, its parent the second.
    _run(bm, [0, 1, 2, 3, 4, 5, 6, 7, 99, 98, 97, 96, 1], "b")
    [branch] = bm.take_events()
    assert isinstance(branch, BlockStored)
    assert branch.parent_block_hash == stored.block_hashes[1]
    assert branch.token_ids == [99, 98, 97, 96] and len(branch.block_hashes) == 1
    assert branch.block_hashes[0] != stored.block_hashes[2]
    bm.free(first)


def test_a_reused_block_is_removed_and_a_reset_clears_all() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, record_events=True)
    req = _run(bm, list(range(9)), "a")  # blocks 0, 1 hashed; block 2 holds one token
    [stored] = bm.take_events()
    bm.free(req)
    other = _run(bm, list(range(100, 115)), "b")  # 4 blocks: every free block, the hashed ones last
    events = bm.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(stored.block_hashes)
    assert all(e.medium == "GPU" for e in removed)
    bm.free(other)
    assert bm.reset_prefix_cache()
    assert [type(e) for e in bm.take_events()] == [AllBlocksCleared]


def test_no_events_are_kept_unless_asked() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.free(_run(bm, list(range(9)), "a"))
    assert bm.reset_prefix_cache() and bm.take_events() == []


def test_the_config_takes_vllms_json_and_refuses_what_it_does_not_know() -> None:
    on = KVEventsConfig.from_json(
        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}'
    )
    assert on.publishes and on.publisher == "zmq" and on.endpoint == "tcp://*:6000" and on.topic == "kv"
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}').publishes
    assert not KVEventsConfig.from_json("{}").publishes
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "kafka"}')


@pytest.fixture
def endpoints(tmp_path: Path) -> Iterator[tuple[str, str]]:
    name = uuid.uuid4().hex[:8]
    yield f"ipc://{tmp_path}/kv-{name}", f"ipc://{tmp_path}/replay-{name}"


def test_the_wire_is_vllms_three_frames_a_positional_batch_and_tagged_maps(
    endpoints: tuple[str, str],
) -> None:
    endpoint, replay_endpoint = endpoints
    config = KVEventsConfig(True, "zmq", endpoint, replay_endpoint, buffer_steps=2, topic="kv")
    publisher = ZmqEventPublisher(config)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    stored = BlockStored([7, 1 << 63], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None)
    try:
        # A PUB socket drops what it sends before the subscription arrives: send until one is read.
        first = None
        for _ in range(200):
            publisher.publish([stored])
            if sub.poll(50):
                first = sub.recv_multipart()
                break
        assert first is not None, "no batch reached the subscriber"
        topic, seq, payload = first
        assert topic == b"kv" and len(seq) == 8
        ts, events, rank = msgspec.msgpack.decode(payload)
        assert isinstance(ts, float) and rank == 0
        assert events == [
            {
                "type": "BlockStored",
                "block_hashes": [7, 1 << 63],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        ]
        publisher.publish([BlockRemoved([7], "GPU"), AllBlocksCleared()])
        assert sub.poll(5000)
        topic, seq2, payload = sub.recv_multipart()
        assert int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
        assert msgspec.msgpack.decode(payload)[1] == [
            {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ]
        publisher.publish([])  # nothing to say: nothing sent
        assert not sub.poll(200)

        # Replay from the last sequence number: the batch buffered there, then the end marker.
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay_endpoint)
        dealer.send_multipart([b"", seq2])
        replayed = []
        for _ in range(100):
            publisher.publish([])  # the core answers replays between steps
            if dealer.poll(50):
                while dealer.poll(200):
                    replayed.append(dealer.recv_multipart())
                break
        dealer.close(linger=0)
        assert [r[2] for r in replayed[:-1]] == [seq2]
        assert replayed[-1][1:] == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    finally:
        sub.close(linger=0)
        publisher.close()


def test_an_engine_publishes_the_blocks_of_the_prompts_it_runs(llama_ckpt: Path, tmp_path: Path) -> None:
    """The offline engine with vLLM's config: a prompt's full blocks arrive as BlockStored, in order,
    with its token ids (the block size is the engine's)."""
    from pagoda.service.llm import LLM

    endpoint = f"ipc://{tmp_path}/kv"
    config = KVEventsConfig.from_json(f'{{"enable_kv_cache_events": true, "endpoint": "{endpoint}"}}')
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(str(llama_ckpt), dtype="float32", kv_cache_memory_bytes=8 << 20, kv_events=config) as llm:
        for attempt in range(100):  # until the subscription has reached the publisher
            llm.generate([[5 + attempt] * 20], greedy)
            if sub.poll(50):
                while sub.poll(50):
                    sub.recv_multipart()
                break
        prompt = list(range(10, 50))  # 40 tokens: two full blocks of 16
        llm.generate([prompt], greedy)
        stored = []
        while sub.poll(500):
            _, _, payload = sub.recv_multipart()
            stored += [e for e in msgspec.msgpack.decode(payload)[1] if e["type"] == "BlockStored"]
    sub.close(linger=0)
    chain = [e for e in stored if e["token_ids"][:16] == prompt[:16]]
    assert chain and chain[0]["parent_block_hash"] is None and chain[0]["block_size"] == 16
    assert [t for e in chain for t in e["token_ids"]][:32] == prompt[:32]
    assert len({h for e in chain for h in e["block_hashes"]}) == len(
        [h for e in chain for h in e["block_hashes"]]
    )
