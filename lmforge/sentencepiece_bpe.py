"""A SentencePiece BPE model (Llama 2's tokenizer.model) as a `tokenizers` tokenizer.json with the
same ids.

lmforge's export writes it beside the model (lmforge.models.hf.tokenizer), so AutoTokenizer reads
the export as lmforge does; a SentencePieceTokenizer reads special-token text with it
(lmforge.tokenizers), so both read "<unk>" in a text alike.
"""

from __future__ import annotations

import logging

import tokenizers as hf
from tokenizers import AddedToken, decoders, normalizers, processors

log = logging.getLogger(__name__)


def sentencepiece_tokenizer_json(tok) -> hf.Tokenizer | None:
    """A `tokenizers` BPE with sentencepiece's ids for `tok`, a
    lmforge.tokenizers.SentencePieceTokenizer of a BPE model (Llama 2, Mistral), or None for
    another kind (unigram, text normalisation) or without protobuf to read the model's settings.

    Sentencepiece's BPE joins, at each step, the adjacent pair whose joined piece scores highest;
    a BPE merge list ranked by that score makes the same choices. Every way a piece splits into
    two pieces of the vocabulary is a merge of that rank."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf absent
        log.info(
            "protobuf is not installed: the export's SentencePiece model gets no tokenizer.json"
        )
        return None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.files[0].read_bytes())
    norm = proto.normalizer_spec
    if (
        proto.trainer_spec.model_type != proto.trainer_spec.BPE
        or norm.remove_extra_whitespaces
        or (norm.name not in ("identity", "") and norm.precompiled_charsmap)
    ):
        log.info(
            "%s is not a plain BPE SentencePiece model: its export gets no tokenizer.json",
            tok.files[0],
        )
        return None
    pieces = proto.pieces
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    kinds = proto.SentencePiece.Type
    merges = []
    for i in sorted(
        (i for i, p in enumerate(pieces) if p.type == kinds.NORMAL),
        key=lambda i: (-pieces[i].score, i),
    ):
        piece = pieces[i].piece
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        known = [s for s in splits if s[0] in vocab and s[1] in vocab]
        merges += sorted(known, key=lambda s: (vocab[s[0]], vocab[s[1]]))
    unk = next(p.piece for p in pieces if p.type == kinds.UNKNOWN)
    out = hf.Tokenizer(
        hf.models.BPE(
            vocab,
            merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=proto.trainer_spec.byte_fallback,
        )
    )
    steps = [normalizers.Prepend("▁")] if norm.add_dummy_prefix else []
    out.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    out.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []),
        ]
    )
    out.add_special_tokens(
        [
            AddedToken(p.piece, normalized=False, special=True)
            for p in pieces
            if p.type in (kinds.CONTROL, kinds.UNKNOWN)
        ]
    )
    if tok.bos_id is not None and tok.add_bos_token:
        bos = pieces[tok.bos_id].piece
        out.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.bos_id)]
        )
    return out
