"""`lmforge generate`'s min_p and penalties against transformers: --repetition-penalty greedy and
--min-p (at 1.0 only the most likely token is left, so sampling is deterministic) print what
transformers' generate decodes; min_p filters the scores as its MinPLogitsWarper does; frequency and
presence penalties follow OpenAI's definition on transformers' logits."""

from __future__ import annotations

import pytest
import torch

from lmforge.cli import main
from lmforge.inference import generate
from lmforge.inference.sampling import SamplingParams, process_logits
from tests.inference.test_generate import text_model  # noqa: F401 (a fixture)

tf = pytest.importorskip("transformers")
PROMPT = "t5 t17 t33 t5 t17 t2 t99"


def _hf(folder, **kwargs) -> list[int]:
    hf = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = [int(w[1:]) for w in PROMPT.split()]
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=8, pad_token_id=0, **kwargs)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize(
    "flags, hf_kwargs",
    [
        (
            ["--temperature", "0", "--repetition-penalty", "1.8"],
            dict(do_sample=False, repetition_penalty=1.8),
        ),
        (
            ["--temperature", "0", "--repetition-penalty", "0.6"],
            dict(do_sample=False, repetition_penalty=0.6),
        ),
        (
            ["--temperature", "1.7", "--min-p", "1.0", "--seed", "3"],
            dict(do_sample=True, temperature=1.7, min_p=1.0, top_k=0),
        ),
    ],
)
def test_generate_prints_what_transformers_generates(text_model, capsys, flags, hf_kwargs):  # noqa: F811
    folder, _, tok = text_model
    want = _hf(folder, **hf_kwargs)
    assert main(["generate", str(folder), "--prompt", PROMPT, "--max-new-tokens", "8", *flags]) == 0
    # the words (a completion's text starts with the space between it and the prompt)
    assert capsys.readouterr().out.split() == tok.decode(want, skip_special_tokens=True).split()


def test_min_p_filters_as_transformers_min_p_warper():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g) * 3
    for min_p, temperature in ((0.05, 1.0), (0.2, 0.7), (0.5, 1.5)):
        ours = process_logits(logits, SamplingParams(temperature, min_p=min_p))
        ref = tf.MinPLogitsWarper(min_p)(
            None, tf.TemperatureLogitsWarper(temperature)(None, logits)
        )
        assert torch.equal(ours.isinf(), ref.isinf())
        kept = ~ref.isinf()
        # the same distribution over the kept tokens
        assert torch.allclose(ours.softmax(-1)[kept], ref.softmax(-1)[kept], atol=1e-6)


def test_frequency_and_presence_penalties_follow_openai_on_transformers_logits(text_model):  # noqa: F811
    folder, model, _ = text_model
    hf = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = [int(w[1:]) for w in PROMPT.split()]
    f, p = 1.3, 0.6
    want, seq = [], list(ids)
    with torch.no_grad():
        for _ in range(10):
            scores = hf(torch.tensor([seq])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(want, dtype=torch.long), minlength=scores.numel())
            scores = scores - counts * f - (counts > 0) * p  # OpenAI's definition
            token = int(scores.argmax())
            want.append(token)
            seq.append(token)
    got = generate(
        model,
        [ids],
        10,
        temperature=0,
        frequency_penalty=f,
        presence_penalty=p,
        stop_token_ids=[],
    )[0]
    assert got == want
    assert got != generate(model, [ids], 10, temperature=0, stop_token_ids=[])[0]
