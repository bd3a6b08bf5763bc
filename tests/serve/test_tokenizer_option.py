"""`lmforge serve MODEL_DIR --tokenizer PATH`: the real `serve` verb (uvicorn's loop replaced by
starlette's test client, so requests go through the app it built) on a model folder without
tokenizer files."""

from __future__ import annotations

import json
import shutil

import pytest

from lmforge.cli import main
from lmforge.inference import generate_text

TEMPLATE = (
    "{% for m in messages %}{{ 't3' if m.role == 'system' else 't4' }} {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}t2 {% endif %}"
)
OTHER_TEMPLATE = "{% for m in messages %}t9 {{ m.content }} {% endfor %}{% if add_generation_prompt %}t8 {% endif %}"
MESSAGES = [{"role": "system", "content": "t9"}, {"role": "user", "content": "t5 t17"}]
# MESSAGES as each renders them
RENDERED = {TEMPLATE: "t3 t9 t4 t5 t17 t2", OTHER_TEMPLATE: "t9 t9 t9 t5 t17 t8"}


@pytest.fixture
def split(model_dir, tmp_path):
    """(the model folder without its tokenizer, a folder holding only that tokenizer)."""
    bare, tokenizer = tmp_path / "bare", tmp_path / "tokenizer"
    shutil.copytree(model_dir, bare)
    (bare / "tokenizer.json").unlink()
    tokenizer.mkdir()
    shutil.copy2(model_dir / "tokenizer.json", tokenizer / "tokenizer.json")
    return bare, tokenizer


def _serve(monkeypatch, args: list[str], requests: list[tuple[str, dict]]) -> list:
    """Run `lmforge serve ARGS`, answering `requests` (route, body) in place of uvicorn's loop;
    their responses."""
    import uvicorn
    from starlette.testclient import TestClient

    answers = []

    def run(server, sockets=None):
        for sock in sockets or []:
            sock.close()
        # The app's lifespan runs the engine, as under uvicorn; TestClient's own Host (testserver)
        # would get 421.
        with TestClient(server.config.app, base_url="http://localhost") as client:
            answers.extend(client.post(route, json=body) for route, body in requests)

    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    assert main(["serve", *args, "--port", "0", "--max-batch", "2"]) == 0
    return answers


def test_serve_reads_the_tokenizer_given_and_the_model_folders_chat_template_first(
    split, reference, monkeypatch
):
    bare, tokenizer = split
    model, tok = reference

    def expected(template: str) -> str:
        return generate_text(model, tok, [tok.encode(RENDERED[template])], 6, temperature=0)[0]

    # the answer tells which template prompted it
    assert expected(TEMPLATE) != expected(OTHER_TEMPLATE)
    requests = [
        ("/v1/completions", {"prompt": "t5 t17 t33", "max_tokens": 6, "temperature": 0}),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "temperature": 0}),
    ]
    # a weights-only import: the template stayed there
    (tokenizer / "chat_template.jinja").write_text(TEMPLATE)
    completion, chat = _serve(monkeypatch, [str(bare), "--tokenizer", str(tokenizer)], requests)
    assert (
        completion.json()["choices"][0]["text"]
        == generate_text(model, tok, ["t5 t17 t33"], 6, temperature=0)[0]
    )
    assert chat.json()["choices"][0]["message"]["content"] == expected(TEMPLATE)
    # The model folder's template (tokenizer_config.json here) is the one it was fine-tuned with: it
    # wins.
    (bare / "tokenizer_config.json").write_text(json.dumps({"chat_template": OTHER_TEMPLATE}))
    _, chat = _serve(
        monkeypatch, [str(bare), "--tokenizer", str(tokenizer / "tokenizer.json")], requests
    )
    assert chat.json()["choices"][0]["message"]["content"] == expected(OTHER_TEMPLATE)


def test_a_folder_without_tokenizer_names_the_option(split, capsys, monkeypatch):
    monkeypatch.delenv("SAGEMAKER_BIND_TO_PORT", raising=False)
    bare, _ = split
    assert main(["serve", str(bare), "--port", "0"]) == 1
    assert capsys.readouterr().err == (
        f"error: no single tokenizer file found in {bare}: pass --tokenizer PATH (a tokenizer.json, vocab.json + "
        "merges.txt, a SentencePiece .model, or a folder holding one), or copy the model's tokenizer files into that "
        "folder\n"
    )
