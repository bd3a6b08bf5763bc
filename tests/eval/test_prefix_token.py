"""`lmforge eval` against lm-eval's `hf` backend on a Qwen-style tokenizer: no bos ("bos_token":
null, as Qwen2.5 publishes it, or no key at all, as transformers 5 re-saves it), eos <|im_end|>,
and <|endoftext|> in the vocabulary. lmforge took <|endoftext|> for bos and conditioned empty
contexts and rolling windows on it, the hf backend on eos: on the audit's tiny model rolling
log-likelihoods were -210.95 against -192.25."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from lmforge.errors import UserError  # noqa: E402
from lmforge.eval.lm import LMForgeLM  # noqa: E402
from tests.conftest import make_hf_model  # noqa: E402
from tests.eval.conftest import train_tokenizer  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CONFIGS = {
    "null": {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    },
    "absent": {
        "tokenizer_class": "TokenizersBackend",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
    },
}


@pytest.fixture(scope="module")
def qwen_folders(shared_data, tmp_path_factory):
    """style -> (HF folder of a tiny Qwen2 with that tokenizer_config.json, lmforge folder
    imported from it)."""
    pytest.importorskip("transformers")
    from lmforge.models.hf import import_hf

    root = tmp_path_factory.mktemp("qwen_style")
    text = (shared_data / "corpora" / "wikitext-2" / "valid.txt").read_text(encoding="utf-8")[
        :100_000
    ]
    tokenizer = train_tokenizer(
        text, SPECIALS, "<|endoftext|>", "<|im_end|>", False, root / "tokenizer"
    )
    out = {}
    for style, config in CONFIGS.items():
        hf = root / f"{style}_hf"
        model = make_hf_model("qwen2")
        model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = None, 2, 0
        model.save_pretrained(hf)
        shutil.copy(tokenizer / "tokenizer.json", hf)
        (hf / "tokenizer_config.json").write_text(json.dumps(config))
        import_hf(hf, root / f"{style}_lmforge")
        out[style] = (hf, root / f"{style}_lmforge")
    return out


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


@pytest.mark.parametrize("style", CONFIGS)
def test_empty_contexts_and_rolling_windows_start_as_the_hf_backends(
    style, qwen_folders, shared_data
):
    from lm_eval.models.huggingface import HFLM

    hf_folder, lmforge_folder = qwen_folders[style]
    theirs = HFLM(pretrained=str(hf_folder), batch_size=2, device="cpu")
    ours = LMForgeLM(lmforge_folder, batch_size=2, device="cpu")
    assert theirs.tokenizer.bos_token_id is None
    assert ours.prefix_token_id == theirs.prefix_token_id == 2  # no bos: eos, <|im_end|>
    text = (shared_data / "corpora" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")[:1500]
    rolling = _requests("loglikelihood_rolling", [(text,), ("short",)])
    got, expected = (lm.loglikelihood_rolling(rolling, disable_tqdm=True) for lm in (ours, theirs))
    assert got == pytest.approx(expected, abs=1e-3)
    requests = _requests(
        "loglikelihood", [("", "An empty context"), ("The cat sat", " on the mat")]
    )
    got, expected = (lm.loglikelihood(requests, disable_tqdm=True) for lm in (ours, theirs))
    assert [g[1] for g in got] == [e[1] for e in expected]
    assert [g[0] for g in got] == pytest.approx([e[0] for e in expected], abs=1e-4)


def test_a_prefix_token_given_is_the_one_used_as_by_the_hf_backend(qwen_folders):
    from lm_eval.models.huggingface import HFLM

    hf_folder, lmforge_folder = qwen_folders["null"]
    theirs = HFLM(pretrained=str(hf_folder), batch_size=2, device="cpu", prefix_token_id=1)
    # model_args come as text
    ours = LMForgeLM(lmforge_folder, batch_size=2, device="cpu", prefix_token_id="1")
    assert ours.prefix_token_id == theirs.prefix_token_id == 1
    requests = _requests("loglikelihood", [("", "An empty context")])
    got, expected = (lm.loglikelihood(requests, disable_tqdm=True) for lm in (ours, theirs))
    assert got[0][0] == pytest.approx(expected[0][0], abs=1e-4)
    with pytest.raises(UserError, match="prefix_token_id 300 is not one of the model's ids"):
        LMForgeLM(lmforge_folder, device="cpu", prefix_token_id=300)
