"""lm-eval's `local-completions` backend (its OpenAI API client: echo + logprobs) scoring
`lmforge serve` gives the loglikelihoods `lmforge eval` gives on the same model, request by
request and through a whole task."""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

from lm_eval.models.openai_completions import LocalCompletionsAPI  # noqa: E402

from lmforge.eval.harness import load_tasks  # noqa: E402
from lmforge.eval.lm import LMForgeLM  # noqa: E402
from tests.eval.test_parity import LOGLIKELIHOOD, TOL, _requests, _task_results  # noqa: E402

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def served(eval_models):
    """The NeoX model's HF folder served over HTTP, lm-eval's API backend pointed at it, and
    lmforge's own backend on the lmforge folder imported from it."""
    from tests.serve.conftest import serve

    hf, imported = eval_models["gpt_neox"]
    with serve(hf, max_batch=4) as server:
        api = LocalCompletionsAPI(
            base_url=server.url + "/v1/completions",
            model=hf.name,
            tokenizer=str(hf),
            tokenized_requests=False,
            batch_size=3,
            max_retries=1,
            max_length=server.engine.context - 1,
        )  # room for the one token it asks for
        yield api, LMForgeLM(imported, batch_size=3, device="cpu")


@pytest.mark.slow
def test_the_api_backend_scores_what_lmforge_eval_scores(served):
    api, ours = served
    requests = _requests("loglikelihood", LOGLIKELIHOOD)
    got = api.loglikelihood(requests, disable_tqdm=True)
    want = ours.loglikelihood(requests, disable_tqdm=True)
    assert [g[1] for g in got] == [w[1] for w in want]
    assert max(abs(g[0] - w[0]) for g, w in zip(got, want)) <= TOL


@pytest.mark.slow
def test_a_whole_task_through_the_server_matches_lmforge_eval(served, shared_data):
    """SST-2 zero-shot (its prompts fit the tiny model's 128 positions, where both backends score
    the same window)."""
    api, ours = served
    tasks = ["sst2_local"]
    mine, theirs = (
        _task_results(lm, load_tasks(tasks, [], shared_data), num_fewshot=0, limit=8)
        for lm in (ours, api)
    )
    assert mine.keys() == theirs.keys() == set(tasks)
    for metric, value in mine["sst2_local"].items():
        expected = value if isinstance(value, str) else pytest.approx(value, rel=1e-5)
        assert theirs["sst2_local"][metric] == expected, metric
