"""Text <-> token ids over the `tokenizers` library (the server image has no `transformers`).

A checkpoint folder brings `tokenizer.json`; a GGUF file brings its vocabulary, merges and chat
template as metadata, from which a byte-level BPE is rebuilt the way transformers rebuilds it.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

# How many already-emitted tokens the incremental detokenizer re-decodes for context: enough for a
# byte-level BPE character (at most 4 bytes) and a sentencepiece word boundary.
_DETOKENIZE_CONTEXT = 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> the split regex its merges were learned with (transformers' table, in part);
# any other value keeps GPT-2's regex inside the ByteLevel pre-tokenizer.
_GGUF_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4


RELEASE_GIL_CHARS = 16_384  # longer texts are encoded with the GIL released


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token, eos_token, ... for the chat template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer source not found: {path}")
        return cls.from_gguf(path) if path.is_file() else cls.from_folder(path)

    @classmethod
    def from_folder(cls, folder: Path) -> Tokenizer:
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"tokenizer.json not found: {tokenizer_file}")
        backend = Backend.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        special = {
            name: value["content"] if isinstance(value, dict) else value
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if isinstance(value := config.get(name), str | dict)
        }
        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # named templates: [{"name": "default", "template": ...}]
            chat_template = {t["name"]: t["template"] for t in chat_template}.get("default")
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():  # transformers >= 4.43 saves the template beside the config
            chat_template = jinja_file.read_text()
        eos_ids: set[int] = set()
        for source in (_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")):
            value = source.get("eos_token_id")
            eos_ids.update([value] if isinstance(value, int) else value or [])
        if "eos_token" in special and (eos_id := backend.token_to_id(special["eos_token"])) is not None:
            eos_ids.add(eos_id)
        bos_id = backend.token_to_id(special["bos_token"]) if "bos_token" in special else None
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            chat_template=chat_template,
            special_tokens=special,
        )

    @classmethod
    def from_gguf(cls, path: Path) -> Tokenizer:
        """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`), built as transformers' GGUF loader does."""
        from pagoda.service.model.gguf_file import read_gguf

        value = read_gguf(path).metadata.get

        kind = value("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"{path}: unsupported GGUF tokenizer {kind!r}; supported: 'gpt2' (byte-level BPE)"
            )
        tokens: list[str] = value("tokenizer.ggml.tokens")
        token_types: list[int] = value("tokenizer.ggml.token_type", [])
        merges: list[str] = value("tokenizer.ggml.merges", [])
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
            for index, token in enumerate(tokens)
        }
        backend = Backend(
            models.BPE(
                vocab=vocab,
                merges=[_merge_pair(m) for m in merges],
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = _GGUF_SPLITS.get(value("tokenizer.ggml.pre"))
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel (transformers skips it).
        backend.add_special_tokens(
            [
                AddedToken(token, normalized=False, special=True)
                for token, kind in zip(tokens, token_types, strict=False)
                if kind == _GGUF_CONTROL and set(token) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, normalized=False, special=False)
                for token, kind in zip(tokens, token_types, strict=False)
                if kind == _GGUF_USER_DEFINED and token in vocab
            ]
        )
        bos_id = value("tokenizer.ggml.bos_token_id")
        eos_id = value("tokenizer.ggml.eos_token_id")
        if value("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
            bos = tokens[bos_id]
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
            )
        special = {
            name: tokens[token_id]
            for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"))
            if (token_id := value(f"tokenizer.ggml.{key}_token_id")) is not None
        }
        return cls(
            backend,
            bos_token_id=bos_id,
            eos_token_ids=set() if eos_id is None else {eos_id},
            chat_template=value("tokenizer.chat_template"),
            special_tokens=special,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:
            # `encode` holds the GIL for its whole run (about 1 s per 2 MB); `encode_batch` releases it,
            # so a long prompt tokenized in a worker thread leaves the event loop free meanwhile.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text longer than this times the context
        length cannot fit, whatever it says, so it is refused without tokenizing it."""
        return max(len(token) for token in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """`decode` of each sequence, in one call that the Rust backend spreads over the CPU's cores."""
        return self.backend.decode_batch(sequences, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The token's text as decoded alone (what logprobs show)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; send a plain completion prompt instead")
        template = _compile_template(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
        )

    def detokenizer(
        self, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one completion's token stream into text deltas, never splitting a UTF-8 character.

    Each push decodes only a short window: the tokens since the last emitted text plus a few before
    them for context, and emits what the window added beyond the context (vLLM's prefix/read offsets).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids or [])[-_DETOKENIZE_CONTEXT:]
        self.prefix_offset = 0  # start of the context window
        self.read_offset = len(self.ids)  # first token whose text is not yet emitted
        self.text = ""

    def push(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = max(self.read_offset, len(self.ids) - _DETOKENIZE_CONTEXT)
        self.read_offset = len(self.ids)
        self.ids = self.ids[self.prefix_offset :]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0
        self.text += delta
        return delta

    @staticmethod
    def finish_many(detokenizers: list[IncrementalDetokenizer], token_ids: list[list[int]]) -> list[str]:
        """For each stream, `push(ids)` then `flush()`: the text its last tokens add, held-back bytes
        included. The streams' windows are decoded in two batched calls instead of four calls a
        stream: an offline batch's requests finish together, and their whole text is decoded then."""
        deltas = [""] * len(detokenizers)
        for skip in (True, False):
            picked = [i for i, d in enumerate(detokenizers) if d.skip_special_tokens is skip]
            if not picked:
                continue
            for i in picked:
                detokenizers[i].ids.extend(token_ids[i])
            tokenizer = detokenizers[picked[0]].tokenizer
            windows = [detokenizers[i] for i in picked]
            prefixes = tokenizer.decode_batch([d.ids[d.prefix_offset : d.read_offset] for d in windows], skip)
            fulls = tokenizer.decode_batch([d.ids[d.prefix_offset :] for d in windows], skip)
            for i, d, prefix_text, full_text in zip(picked, windows, prefixes, fulls, strict=True):
                deltas[i] = full_text[len(prefix_text) :]
                d.read_offset = len(d.ids)
                d.text += deltas[i]
        return deltas

    def flush(self) -> str:
        """At the end of the stream: whatever is held back (a truly broken character shows as U+FFFD)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special_tokens)
        full_text = decode(self.ids[self.prefix_offset :], self.skip_special_tokens)
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.ids)
        self.text += delta
        return delta


def _merge_pair(merge: str) -> tuple[str, str]:
    left, right = merge.split(" ")
    return left, right


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' (and so every template) expects plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _compile_template(source: str) -> jinja2.Template:
    """A sandboxed environment with the helpers transformers gives chat templates."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
