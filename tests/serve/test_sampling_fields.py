"""The per-request sampling fields through the official openai client, with requests of different
settings sent at once (so the engine decodes them in one batch): each choice gets the text it
gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai

PROMPT = "t5 t17 t33 t101 t7"

SETTINGS = [
    {"temperature": 0, "frequency_penalty": 1.2, "presence_penalty": 0.4},
    {"temperature": 0.9, "seed": 5, "extra_body": {"min_p": 0.05}, "logit_bias": {"9": 3}},
    {
        "temperature": 0,
        "extra_body": {"repetition_penalty": 1.4, "min_tokens": 6, "ignore_eos": True},
    },
    {"temperature": 1.1, "top_p": 0.9, "seed": 8, "presence_penalty": -0.5},
]


def test_requests_with_different_settings_sent_together_get_what_they_get_alone(server, model_dir):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    def ask(settings: dict) -> str:
        return (
            c.completions.create(model=model_dir.name, prompt=PROMPT, max_tokens=10, **settings)
            .choices[0]
            .text
        )

    alone = [ask(s) for s in SETTINGS]
    engine = server.engine
    steps, rows = engine.steps, engine.rows_decoded
    with ThreadPoolExecutor(len(SETTINGS) * 2) as pool:
        together = list(pool.map(ask, SETTINGS * 2))
    assert together == alone * 2
    # they did share decode steps
    assert (engine.rows_decoded - rows) / (engine.steps - steps) > 1.5
