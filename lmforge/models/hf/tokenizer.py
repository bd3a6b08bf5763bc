"""What transformers' AutoTokenizer needs beside an export to encode text as lmforge does.

A folder holding only a tokenizer file lets AutoTokenizer guess from config.json's model_type, and it guesses
wrong: from Llama 2's bare tokenizer.model it built a tokenizer without bos and with another whitespace rule
("The game": [1576, 3748] or [450, 3748] where sentencepiece gives [1, 450, 3748]), from GPT-2's vocab.json on a
Llama-shaped model nothing at all, and on a GPT-NeoX-shaped model it added a pad token past the vocabulary.
So an export whose tokenizer came without a tokenizer_config.json gets one naming the class to build, bos, eos,
pad and whether bos starts a text; and a SentencePiece BPE model gets a tokenizer.json that encodes as
sentencepiece does (dummy prefix "▁", spaces as "▁", byte fallback), which the generic fast tokenizer reads
as it is.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import tokenizers as hf
from tokenizers import AddedToken, decoders, normalizers, processors

from lmforge.tokenizers import SentencePieceTokenizer, Tokenizer

log = logging.getLogger(__name__)

FAST = "PreTrainedTokenizerFast"  # transformers' class that takes tokenizer.json as it is


def write_tokenizer_files(tok: Tokenizer, folder: Path, max_length: int, pad_id: int | None) -> None:
    """tokenizer_config.json (and for SentencePiece tokenizer.json) in `folder`, unless the source had them."""
    if (folder / "tokenizer_config.json").exists():
        return
    if isinstance(tok, SentencePieceTokenizer) and not (folder / "tokenizer.json").exists():
        converted = sentencepiece_tokenizer_json(tok)
        if converted is not None:
            converted.save(str(folder / "tokenizer.json"))
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
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _token(tok: Tokenizer, i: int | None) -> str | None:
    return None if i is None or i < 0 else tok.id_to_token(i)


def sentencepiece_tokenizer_json(tok: SentencePieceTokenizer) -> hf.Tokenizer | None:
    """A `tokenizers` BPE with sentencepiece's ids for a BPE SentencePiece model (Llama 2, Mistral), or None for
    another kind (unigram, text normalisation) or without protobuf to read the model's settings.

    Sentencepiece's BPE joins, at each step, the adjacent pair whose joined piece scores highest; a BPE merge
    list ranked by that score makes the same choices. Every way a piece splits into two pieces of the vocabulary
    is a merge of that rank."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf absent
        log.info("protobuf is not installed: the export's SentencePiece model gets no tokenizer.json")
        return None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.files[0].read_bytes())
    norm = proto.normalizer_spec
    if proto.trainer_spec.model_type != proto.trainer_spec.BPE or norm.remove_extra_whitespaces or (
            norm.name not in ("identity", "") and norm.precompiled_charsmap):
        log.info("%s is not a plain BPE SentencePiece model: its export gets no tokenizer.json", tok.files[0])
        return None
    pieces = proto.pieces
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    kinds = proto.SentencePiece.Type
    merges = []
    for i in sorted((i for i, p in enumerate(pieces) if p.type == kinds.NORMAL), key=lambda i: (-pieces[i].score, i)):
        piece = pieces[i].piece
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        known = [s for s in splits if s[0] in vocab and s[1] in vocab]
        merges += sorted(known, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    unk = next(p.piece for p in pieces if p.type == kinds.UNKNOWN)
    out = hf.Tokenizer(hf.models.BPE(vocab, merges, unk_token=unk, fuse_unk=True,
                                     byte_fallback=proto.trainer_spec.byte_fallback))
    steps = [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
    out.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    out.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     *([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else [])])
    out.add_special_tokens([AddedToken(p.piece, normalized=False, special=True) for p in pieces
                            if p.type in (kinds.CONTROL, kinds.UNKNOWN)])
    if tok.bos_id is not None and tok.add_bos_token:
        bos = pieces[tok.bos_id].piece
        out.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.bos_id)])
    return out
