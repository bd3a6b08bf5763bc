"""The special tokens a tokenizer's Hugging Face config files declare, read as transformers'
AutoTokenizer reads them.

tokenizer_config.json and special_tokens_map.json name bos, eos and pad. A token they declare wins
over lmforge's guesses (lmforge.tokenizers), and a null declares that there is none: Qwen2.5's
"bos_token": null, where lmforge guessed <|endoftext|> and lm-eval's hf backend then conditioned an
empty context on another token than lmforge eval. As in transformers, special_tokens_map.json wins
over tokenizer_config.json, its nulls included. A key left out falls to the tokenizer class's
default there, which lmforge's guesses are for GPT-2's, GPT-NeoX's and Llama's classes; the classes
whose bos defaults to none (the generic fast tokenizer, Qwen2's) have no bos then: transformers 5
re-saves a Qwen tokenizer without its "bos_token" key. (transformers adds a declared token missing
from the vocabulary as a new id; lmforge, whose model has no row for it, keeps its guess.)
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.errors import UserError
from lmforge.fsutil import folder_file

TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer_config.json", "special_tokens_map.json"
KEYS = ("bos", "eos", "pad")
# transformers' tokenizer classes whose bos_token defaults to None (transformers 5.24)
NO_DEFAULT_BOS = frozenset(
    {
        "PreTrainedTokenizerFast",
        "TokenizersBackend",
        "Qwen2Tokenizer",
        "Qwen2TokenizerFast",
        "Qwen3_5Tokenizer",
    }
)


def declared_special_tokens(folder: Path) -> tuple[dict[str, str | None], bool | None]:
    """({"bos"/"eos"/"pad": token text, or None for none} for each key the files in `folder`
    decide, in transformers' order; tokenizer_config.json's add_bos_token, None where it says
    nothing)."""
    config = (
        read_json(folder_file(folder, TOKENIZER_CONFIG))
        if (folder / TOKENIZER_CONFIG).is_file()
        else None
    )
    tokens_map = (
        read_json(folder_file(folder, SPECIAL_TOKENS_MAP))
        if (folder / SPECIAL_TOKENS_MAP).is_file()
        else {}
    )
    declared: dict[str, str | None] = {}
    for key in KEYS:
        for data in (tokens_map, config or {}):
            value = data.get(f"{key}_token")
            if isinstance(value, dict):  # AddedToken serialised as {"content": ..., "lstrip": ...}
                value = value.get("content", 0)
            if f"{key}_token" in data and (value is None or isinstance(value, str)):
                declared[key] = value
                break
    if (
        config is not None
        and "bos" not in declared
        and config.get("tokenizer_class") in NO_DEFAULT_BOS
    ):
        declared["bos"] = None
    add_bos = config.get("add_bos_token") if config is not None else None
    return declared, add_bos if isinstance(add_bos, bool) else None


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read {path} as JSON ({e}): fix or delete the file") from e
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a JSON object: fix or delete the file")
    return data
