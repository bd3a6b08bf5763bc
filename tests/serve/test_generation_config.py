"""`lmforge serve` takes a request's missing sampling fields from the model folder's
generation_config.json, as `lmforge generate` reads the folder and as vLLM's --generation-config
auto does: a request's own fields win, and `--generation-config none` keeps OpenAI's defaults."""

from __future__ import annotations

import argparse
import json
import shutil

import httpx
import pytest

from lmforge.inference import generate_text
from tests.serve.conftest import serve

PROMPT = "t5 t17 t33 t101"
# The audit's folder: deterministic (top_k 1) sampling, with a penalty that changes the tiny model's
# greedy text.
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 1, "repetition_penalty": 1.3}


def _with_generation_config(src, dst, config: dict):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, **config}))
    return dst


def test_the_folders_sampling_defaults_are_read_as_generate_reads_them(model_dir, tmp_path, caplog):
    from lmforge.cli.serve import generation_defaults

    folder = _with_generation_config(model_dir, tmp_path / "gc", SAMPLING)
    with caplog.at_level("INFO", logger="lmforge.cli.serve"):
        assert generation_defaults(folder) == {
            "temperature": 0.7,
            "top_k": 1,
            "repetition_penalty": 1.3,
        }
    assert (
        "default sampling parameters from" in caplog.text
        and "temperature 0.7, top_k 1, repetition_penalty 1.3" in caplog.text
    )
    # greedy, as transformers reads it
    cases = [
        ({"do_sample": False, "temperature": 0.6}, {"temperature": 0.0}),
        # no do_sample: transformers' generate is greedy, not these
        ({"temperature": 0.6, "top_p": 0.9}, {}),
        # each one off
        ({"do_sample": True, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}, {}),
        (
            {
                "do_sample": True,
                "temperature": "hot",
                "top_k": True,
                "top_p": 2.0,
                "repetition_penalty": -1,
            },
            {},
        ),
        (
            {"do_sample": True, "top_p": 0.9, "repetition_penalty": 1.1},
            {"top_p": 0.9, "repetition_penalty": 1.1},
        ),
        ({"do_sample": True, "min_p": 0.05}, {"min_p": 0.05}),
        ({"do_sample": True, "min_p": 0}, {}),
        # (transformers' MinPLogitsWarper)
        ({"do_sample": True, "min_p": 1.5}, {}),
        ({"min_p": 0.05}, {}),
    ]
    for config, expected in cases:
        (folder / "generation_config.json").write_text(json.dumps(config))
        assert generation_defaults(folder) == expected, config
    (folder / "generation_config.json").unlink()
    caplog.clear()
    with caplog.at_level("INFO", logger="lmforge.cli.serve"):
        assert generation_defaults(folder) == {}
    assert not caplog.text


def test_the_generation_config_flag_takes_vllms_spelling():
    from lmforge.cli.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["m"]).generation_config == "auto"
    assert p.parse_args(["m", "--generation-config", "none"]).generation_config == "none"
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--generation-config", "greedy"])


@pytest.fixture(scope="module")
def gc_server(model_dir, tmp_path_factory):
    from lmforge.cli.serve import generation_defaults

    folder = _with_generation_config(model_dir, tmp_path_factory.mktemp("gc") / "tiny-gc", SAMPLING)
    with serve(folder, sampling_defaults=generation_defaults(folder)) as s:
        yield s


def _text(server, route: str = "/v1/completions", **body) -> str:
    if route == "/v1/completions":
        r = httpx.post(
            server.url + route, json={"prompt": PROMPT, "max_tokens": 10, **body}, timeout=60
        )
        return r.json()["choices"][0]["text"]
    r = httpx.post(
        server.url + route,
        json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 10, **body},
        timeout=60,
    )
    return r.json()["choices"][0]["message"]["content"]


def test_a_request_without_sampling_fields_gets_the_folders_and_its_own_fields_win(
    gc_server, reference
):
    model, tok = reference
    folders = generate_text(
        model, tok, [PROMPT], 10, temperature=0.7, top_k=1, repetition_penalty=1.3
    )[0]
    greedy = generate_text(model, tok, [PROMPT], 10, temperature=0)[0]
    assert folders != greedy  # else this test could not tell the defaults were used
    assert _text(gc_server) == folders  # as `lmforge generate` of the folder samples
    # null: the default, the folder's
    assert _text(gc_server, temperature=None, repetition_penalty=None) == folders
    # temperature 0 is greedy; the penalty the request left out is still the folder's (as vLLM
    # merges them).
    assert (
        _text(gc_server, temperature=0)
        == generate_text(model, tok, [PROMPT], 10, temperature=0, repetition_penalty=1.3)[0]
    )
    assert _text(gc_server, temperature=0, repetition_penalty=1.0) == greedy
    chat = dict(route="/v1/chat/completions")
    assert _text(gc_server, **chat) == _text(
        gc_server, **chat, temperature=0.7, top_k=1, repetition_penalty=1.3
    )
