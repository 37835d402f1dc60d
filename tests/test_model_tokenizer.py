"""Our `tokenizers`-based Tokenizer against transformers', and the incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.service.model import load_tokenizer
from pagoda.service.tokenizer import RELEASE_GIL_CHARS, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\nnewlines\r\n",
    "What is the capital of France? 12345 + 6789 = 19134",
    "Ünïcödé: naïve café, 日本語のテキスト, Ελληνικά, русский",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 and ∑∫√",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi 😀"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Say «bonjour»"},
    ],
]


@pytest.fixture(scope="module")
def gguf_pair(smollm2_gguf: Path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    return Tokenizer.from_gguf(smollm2_gguf), hf


@pytest.fixture(scope="module")
def folder_pair(llama_ckpt: Path):
    from transformers import AutoTokenizer

    return load_tokenizer(llama_ckpt), AutoTokenizer.from_pretrained(llama_ckpt)


@pytest.mark.parametrize("pair", ["gguf_pair", "folder_pair"])
def test_encode_decode_match_transformers(pair: str, request: pytest.FixtureRequest) -> None:
    ours, hf = request.getfixturevalue(pair)
    assert ours.vocab_size == len(hf)
    for text in TEXTS:
        for add_special in (True, False):
            ids = ours.encode(text, add_special_tokens=add_special)
            assert ids == hf.encode(text, add_special_tokens=add_special), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        if "<|" not in text:
            assert ours.decode(ids) == text


@pytest.mark.parametrize("pair", ["gguf_pair", "folder_pair"])
def test_chat_template_matches_transformers(pair: str, request: pytest.FixtureRequest) -> None:
    ours, hf = request.getfixturevalue(pair)
    for messages in MESSAGES:
        for add_generation_prompt in (True, False):
            expected = hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
            assert got == expected


def test_special_ids(gguf_pair, folder_pair) -> None:
    gguf_tok, _ = gguf_pair
    assert gguf_tok.bos_token_id == 1 and gguf_tok.eos_token_ids == {2}
    assert gguf_tok.id_to_token(2) == "<|im_end|>"
    assert gguf_tok.id_to_token(gguf_tok.encode(" Paris", add_special_tokens=False)[0]) == " Paris"
    folder_tok, _ = folder_pair
    assert folder_tok.bos_token_id == 1  # tokenizer_config's bos_token <|im_start|>
    assert folder_tok.eos_token_ids == {2}  # generation_config.json, config.json and eos_token agree


def test_chat_template_helpers(tmp_path: Path, llama_ckpt: Path) -> None:
    """raise_exception, strftime_now and a tojson that leaves non-ASCII and HTML characters alone."""
    tokenizer = load_tokenizer(llama_ckpt)
    tokenizer.chat_template = (
        "{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') | length }}"
    )
    out = tokenizer.apply_chat_template([{"role": "user", "content": "<b>é</b>"}])
    assert out == json.dumps({"role": "user", "content": "<b>é</b>"}, ensure_ascii=False) + "|4"
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="no messages"):
        tokenizer.apply_chat_template([])
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_detokenizer_streams_full_decode(gguf_pair, skip_special_tokens: bool) -> None:
    tokenizer, _ = gguf_pair
    text = "".join(TEXTS) + "<|im_end|>"
    ids = tokenizer.encode(text)
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push([token]) for token in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    # The window stays short however long the stream.
    assert len(detok.ids) <= 16


def test_incremental_detokenizer_holds_back_split_characters(gguf_pair) -> None:
    tokenizer, _ = gguf_pair
    ids = tokenizer.encode("𓀀", add_special_tokens=False)  # one rare 4-byte character
    assert len(ids) > 1  # ... spread over several byte-level tokens
    detok = tokenizer.detokenizer()
    assert [detok.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "𓀀"
    detok = tokenizer.detokenizer()
    assert detok.push(ids) == "𓀀"  # several tokens in one push


def test_finish_many_adds_what_push_then_flush_would(gguf_pair) -> None:
    """The final-only streams of one step, decoded in two batched calls, end with the text that
    `push(ids)` then `flush()` gives each: split characters, mid-stream state and either setting of
    `skip_special_tokens` alike."""
    tokenizer, _ = gguf_pair
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    streams = [tokenizer.encode(t) for t in (*TEXTS, "𓀀 x 𓀀")] + [tokenizer.encode("𓀀")[:-1]]
    cases = [(ids, skip, split) for ids in streams for skip in (True, False) for split in (0, 3)]
    one_by_one, together = [], []
    for ids, skip, split in cases:
        pair = [IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip) for _ in range(2)]
        for detok in pair:  # some tokens already streamed, some held back
            detok.push(ids[:split])
        one_by_one.append(pair[0].push(ids[split:]) + pair[0].flush())
        together.append(pair[1])
    deltas = IncrementalDetokenizer.finish_many(together, [ids[split:] for ids, _, split in cases])
    assert deltas == one_by_one
    assert [d.text for d in together] == [
        tokenizer.decode(ids, skip_special_tokens=skip) for ids, skip, _ in cases
    ]
    assert "\ufffd" in deltas[-1]  # a stream that ends inside a character shows the broken bytes
    assert IncrementalDetokenizer.finish_many([], []) == []


def test_missing_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope"):
        load_tokenizer(tmp_path / "nope")


def test_a_long_text_is_encoded_without_holding_the_gil(gguf_pair) -> None:
    """A long prompt tokenized in a worker thread must leave the event loop's thread running: a thread
    that ticks every millisecond is never stalled for long, and the ids are the ones `encode` gives."""
    import itertools
    import threading
    import time

    ours, _ = gguf_pair
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # 1.8 MB: about 1 s of tokenizing
    assert len(text) > RELEASE_GIL_CHARS
    ticks: list[float] = []
    stop = threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.02)
    ids = ours.encode(text)
    stop.set()
    ticker.join()
    longest_stall = max(b - a for a, b in itertools.pairwise(ticks))
    assert longest_stall < 0.5, f"the GIL was held for {longest_stall:.2f} s"
    assert ids == ours.backend.encode(text).ids
    assert ours.max_token_chars >= max(len(ours.decode([t])) for t in ids[:50])


def test_widened_vocab_gives_every_id_text_and_encodes_as_before(tokenizer_files: Path) -> None:
    """The 8B bench checkpoint's tokenizer (Llama-3's 128256 ids): ids past SmolLM2's 49152 decode to
    text, so a random model's stream carries text on (nearly) every token; encoding is SmolLM2's."""
    import random

    from pagoda.bench.gpu_check import widen_vocab

    original = json.loads((tokenizer_files / "tokenizer.json").read_text())
    folder = tokenizer_files.parent / "widened"
    folder.mkdir(exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(widen_vocab(original, 128256)))
    (folder / "tokenizer_config.json").write_text((tokenizer_files / "tokenizer_config.json").read_text())
    base, wide = Tokenizer.from_path(tokenizer_files), Tokenizer.from_path(folder)
    assert wide.backend.get_vocab_size() == 128256
    new_ids = range(49152, 128256)
    assert all(wide.decode([i]) and "\ufffd" not in wide.decode([i]) for i in new_ids)
    text = "Paged attention keeps the KV cache in blocks; ünïcödé 東京 too."
    assert wide.encode(text) == base.encode(text)

    rng = random.Random(0)
    detokenizer = wide.detokenizer()
    pushes = [detokenizer.push([rng.randrange(128256)]) for _ in range(2000)]
    assert sum(bool(p) for p in pushes) >= 0.95 * len(pushes)
