"""`lmforge eval` against lm-eval's own `hf` backend on the same tiny NeoX and Llama
(transformers-built, saved as HF folders, imported to lmforge): the same loglikelihoods, word
perplexity, multiple-choice accuracy and greedy generations, request by request and through whole
tasks."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402

from lmforge.eval.harness import evaluate, load_tasks  # noqa: E402
from lmforge.eval.lm import LMForgeLM  # noqa: E402

FAMILIES = ["gpt_neox", "llama"]
TOL = 1e-4


@pytest.fixture(scope="module")
def ours(eval_models):
    return {f: LMForgeLM(eval_models[f][1], batch_size=3, device="cpu") for f in FAMILIES}


def _requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


LOGLIKELIHOOD = [
    # trailing space
    ("The cat sat on", " the mat"),
    ("The cat sat on", " a hat"),
    ("The cat sat on ", "the mat"),
    ("", "An empty context"),
    ("Question: is it good?\nAnswer:", " positive"),
    ("Question: is it good?\nAnswer:", " negative"),
    ("<unk> and <s> in text", " are special tokens"),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_loglikelihoods_match_the_hf_backend(family, ours, hf_backend):
    requests = _requests("loglikelihood", LOGLIKELIHOOD)
    expected = hf_backend(family).loglikelihood(requests, disable_tqdm=True)
    got = ours[family].loglikelihood(requests, disable_tqdm=True)
    assert [g[1] for g in got] == [e[1] for e in expected]
    assert max(abs(g[0] - e[0]) for g, e in zip(got, expected)) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_rolling_loglikelihoods_match_the_hf_backend(family, ours, hf_backend, shared_data):
    text = (shared_data / "corpora" / "wikitext-2" / "test.txt").read_text(encoding="utf-8")
    requests = _requests("loglikelihood_rolling", [(text[:2500],), (text[5000:5300],), ("short",)])
    expected = hf_backend(family).loglikelihood_rolling(requests, disable_tqdm=True)
    got = ours[family].loglikelihood_rolling(requests, disable_tqdm=True)
    # A sum over ~1000 tokens near -10^4: the hf backend adds each window's terms in fp32 (a step of
    # 1e-3 there), lmforge in fp64, so the totals agree to fp32's relative precision, not to 1e-4
    # absolute.
    assert all(abs(g - e) <= max(TOL, 1e-7 * abs(e)) for g, e in zip(got, expected)), (
        got,
        expected,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generations_match_the_hf_backend(family, ours, hf_backend):
    prompts = ["The history of", "In 1998 the band", "A", "Robert is an English film , television"]
    free = ours[family].generate_until(
        _requests(
            "generate_until",
            [(p, {"until": [], "max_gen_toks": 24, "do_sample": False}) for p in prompts],
        ),
        disable_tqdm=True,
    )
    # Stop strings the model does reach: a piece from the middle of each free completion (and one
    # never met).
    settings = [
        {"until": [text[8:11] or "never", "zzz"], "max_gen_toks": 24, "do_sample": False}
        for text in free
    ]
    settings[-1] = {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False}
    requests = _requests("generate_until", [*zip(prompts, settings)])
    expected = hf_backend(family).generate_until(requests, disable_tqdm=True)
    got = ours[family].generate_until(requests, disable_tqdm=True)
    assert got == expected
    assert any(len(g) < len(f) for g, f in zip(got, free))  # the stop strings cut something


def _task_results(lm, tasks, **kw) -> dict:
    results = evaluate(lm, tasks, **kw)["results"]
    return {
        task: {k: v for k, v in metrics.items() if "stderr" not in k and k != "alias"}
        for task, metrics in results.items()
    }


GEN_TASK = """
task: sst2_gen_local
custom_dataset: !function lmforge.eval.data.local_dataset
dataset_kwargs:
  data_files:
    validation: classification/sst-2/dev.tsv
output_type: generate_until
validation_split: validation
doc_to_text: "{{sentence}}\\nSentiment:"
doc_to_target: "{{['negative', 'positive'][label]}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_whole_tasks_match_the_hf_backend(family, ours, hf_backend, shared_data, tmp_path):
    """WikiText word perplexity, SST-2 accuracy zero- and few-shot, and a generation task,
    through lm-eval's evaluator on both backends."""
    (tmp_path / "gen.yaml").write_text(GEN_TASK)
    runs = [
        (["wikitext2_local"], 0, 2),
        (["sst2_local", "sst2_gen_local"], 0, 16),
        # (tasks, shots, documents): WikiText articles are long
        (["sst2_local", "sst2_gen_local"], 3, 8),
    ]
    for tasks, shots, limit in runs:
        mine, ref = (
            _task_results(
                lm, load_tasks(tasks, [tmp_path], shared_data), num_fewshot=shots, limit=limit
            )
            for lm in (ours[family], hf_backend(family))
        )
        assert mine.keys() == ref.keys() == set(tasks)
        for task in tasks:
            assert ref[task] and mine[task].keys() == ref[task].keys()
            for metric, value in ref[task].items():
                # A metric lm-eval cannot compute is a string ("N/A"): pytest 9.2's approx refuses
                # strings.
                expected = value if isinstance(value, str) else pytest.approx(value, rel=1e-5)
                assert mine[task][metric] == expected, (shots, task, metric)
