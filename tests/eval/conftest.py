"""Tiny transformers-built NeoX and Llama models with real byte-level BPE tokenizers (300 ids,
trained here on WikiText), saved as HF folders that lm-eval's `hf` backend loads, and the same
models imported to lmforge."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import make_hf_model

# family -> (special tokens, first ids in that order; bos, eos; whether prompts start with bos)
TOKENIZERS = {
    "gpt_neox": (["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", False),
    "llama": (["<unk>", "<s>", "</s>"], "<s>", "</s>", True),
}


def train_tokenizer(
    text: str, specials: list[str], bos: str, eos: str, add_bos: bool, out: Path
) -> Path:
    """A 300-id byte-level BPE over `text` (ids fit the tiny models' vocabularies), with the
    config files a transformers AutoTokenizer reads; with add_bos its template prepends bos, as
    Llama's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, specials.index(bos))]
        )
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": add_bos,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def eval_models(shared_data, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (HF folder with tokenizer, lmforge folder imported from it)."""
    pytest.importorskip("transformers")
    from lmforge.models.hf import import_hf

    root = tmp_path_factory.mktemp("eval_models")
    text = (shared_data / "corpora" / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")[
        :200_000
    ]
    out = {}
    for family, spec in TOKENIZERS.items():
        tokenizer = train_tokenizer(text, *spec, root / f"{family}_tokenizer")
        hf = root / f"{family}_hf"
        make_hf_model(family).save_pretrained(hf)
        for f in tokenizer.iterdir():
            shutil.copy(f, hf / f.name)
        import_hf(hf, root / f"{family}_lmforge")
        out[family] = (hf, root / f"{family}_lmforge")
    return out


@pytest.fixture(scope="session")
def hf_backend(eval_models):
    """lm-eval's own `hf` backend on each family's HF folder (built once: loading is the slow
    part)."""
    pytest.importorskip("lm_eval")
    from lm_eval.models.huggingface import HFLM

    cache = {}

    def get(family: str, batch_size: int = 4):
        if (family, batch_size) not in cache:
            cache[family, batch_size] = HFLM(
                pretrained=str(eval_models[family][0]), batch_size=batch_size, device="cpu"
            )
        return cache[family, batch_size]

    return get
