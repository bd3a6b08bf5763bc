"""What transformers' AutoTokenizer needs beside an export to encode text as lmforge does.

A folder holding only a tokenizer file lets AutoTokenizer guess from config.json's model_type, and
it guesses wrong: from Llama 2's bare tokenizer.model it built a tokenizer without bos and with
another whitespace rule ("The game": [1576, 3748] or [450, 3748] where sentencepiece gives [1, 450,
3748]), from GPT-2's vocab.json on a Llama-shaped model nothing at all, and on a GPT-NeoX-shaped
model it added a pad token past the vocabulary. So an export whose tokenizer came without a
tokenizer_config.json gets one naming the class to build, bos, eos, pad and whether bos starts a
text; and a SentencePiece BPE model gets a tokenizer.json that encodes as sentencepiece does (dummy
prefix "▁", spaces as "▁", byte fallback), which the generic fast tokenizer reads as it is. That
tokenizer.json is written beside the source's tokenizer_config.json too, which then names the
generic fast class: transformers 5's LlamaTokenizer, from tokenizer.model or tokenizer.json alike,
puts no prefix space after a special token where "legacy" is false (Llama 2's published folders say
so) or absent, and sentencepiece, so lmforge's training, does ("<s>[INST]": 29961 "[" there, 518
"▁[" here).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from lmforge.sentencepiece_bpe import sentencepiece_tokenizer_json
from lmforge.tokenizer_specials import read_json
from lmforge.tokenizers import SentencePieceTokenizer, Tokenizer

log = logging.getLogger(__name__)

FAST = "PreTrainedTokenizerFast"  # transformers' class that takes tokenizer.json as it is


def write_tokenizer_files(
    tok: Tokenizer, folder: Path, max_length: int, pad_id: int | None
) -> None:
    """tokenizer.json for a SentencePiece model in `folder` unless the source had one, and
    tokenizer_config.json: lmforge's where the source had none, else the source's, naming the
    fast class where tokenizer.json was written (the keys it lacks lmforge's: that class has no
    default bos or eos)."""
    source = folder / "tokenizer_config.json"
    converted = None
    if isinstance(tok, SentencePieceTokenizer) and not (folder / "tokenizer.json").exists():
        converted = sentencepiece_tokenizer_json(tok)
        if converted is not None:
            converted.save(str(folder / "tokenizer.json"))
    if source.exists() and converted is None:
        return
    if (folder / "tokenizer.json").exists():
        kind = FAST
    else:  # GPT-2's vocab.json + merges.txt, or a SentencePiece model the conversion does not cover
        kind = "LlamaTokenizer" if isinstance(tok, SentencePieceTokenizer) else "GPT2Tokenizer"
    pad = pad_id if pad_id is not None else tok.pad_id
    config = {
        "tokenizer_class": kind,
        "bos_token": _token(tok, tok.bos_id),
        "eos_token": _token(tok, tok.eos_id),
        "pad_token": _token(tok, pad),
        "add_bos_token": tok.add_bos_token,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if isinstance(tok, SentencePieceTokenizer):
        config["unk_token"] = _token(tok, tok.unk_id)
    if source.exists():
        config = {**config, **read_json(source), "tokenizer_class": FAST}
        log.debug(
            "%s: the source's, naming %s for the tokenizer.json written beside it", source, FAST
        )
    source.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _token(tok: Tokenizer, i: int | None) -> str | None:
    return None if i is None or i < 0 else tok.id_to_token(i)
