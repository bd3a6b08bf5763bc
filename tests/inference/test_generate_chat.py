"""`lmforge generate --chat`: prompts rendered with the model's chat template, as the server
renders a chat."""

from __future__ import annotations

import pytest

from lmforge.errors import UserError
from lmforge.inference import generate_text
from tests.inference.test_generate import _cli, run, text_model  # noqa: F401 (the fixture, shared)


def test_cli_chat_prompts_as_the_server_renders_a_chat(text_model, tmp_path, capsys):  # noqa: F811 (the fixture)
    """`generate --chat`: each prompt a user message (after --system), rendered with the folder's
    chat template into the ids /v1/chat/completions would send, and completed from there."""
    import shutil

    from lmforge.serve.chat import ChatFormat
    from lmforge.tokenizers import load_tokenizer

    folder, model, tok = text_model
    chat = tmp_path / "chat"
    shutil.copytree(folder, chat)
    (chat / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ 't3' if m.role == 'system' else 't4' }} {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}t2 {% endif %}"
    )
    ids = ChatFormat(load_tokenizer(chat), chat).encode([("system", "t9"), ("user", "t5 t17")])
    assert ids == tok.encode("t3 t9 t4 t5 t17 t2")
    expected = generate_text(model, tok, [ids], 6, do_sample=False)
    assert expected != generate_text(model, tok, ["t5 t17"], 6, do_sample=False)
    run(
        _cli(
            [
                str(chat),
                "--chat",
                "--system",
                "t9",
                "--prompt",
                "t5 t17",
                "--max-new-tokens",
                "6",
                "--temperature",
                "0",
            ]
        )
    )
    assert capsys.readouterr().out == f"{expected[0]}\n"
    with pytest.raises(UserError, match="--system is a chat message: add --chat"):
        run(_cli([str(chat), "--system", "t9", "--prompt", "t5"]))


def test_cli_is_greedy_by_default_unless_the_folder_asks_to_sample(text_model, tmp_path, capsys):  # noqa: F811
    """transformers' generate is greedy unless the model's generation_config.json says do_sample;
    `lmforge generate` sampled at temperature 1.0 whatever the folder said, so two runs of the
    same command differed."""
    import json
    import shutil

    from lmforge.cli.generate import sampling_defaults

    folder, model, tok = text_model
    greedy = generate_text(model, tok, ["t5 t17 t33"], 6, temperature=0)[0]
    run(_cli([str(folder), "--prompt", "t5 t17 t33", "--max-new-tokens", "6"]))
    assert capsys.readouterr().out == greedy + "\n"
    sampling = tmp_path / "sampling"
    shutil.copytree(folder, sampling)
    (sampling / "generation_config.json").write_text(
        json.dumps(
            {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9, "min_p": 0.05}
        )
    )
    assert sampling_defaults(_cli([str(sampling), "--prompt", "x"]), sampling) == (
        0.7,
        20,
        0.9,
        0.05,
    )
    assert sampling_defaults(
        _cli([str(sampling), "--prompt", "x", "--temperature", "0"]), sampling
    ) == (0, None, None, 0.0)
    assert sampling_defaults(_cli([str(folder), "--prompt", "x", "--top-k", "5"]), folder) == (
        1.0,
        5,
        None,
        0.0,
    )
    assert sampling_defaults(_cli([str(folder), "--prompt", "x", "--min-p", "0.1"]), folder) == (
        1.0,
        None,
        None,
        0.1,
    )
    (sampling / "generation_config.json").write_text(
        json.dumps({"do_sample": False, "temperature": 0.7})
    )
    assert sampling_defaults(_cli([str(sampling), "--prompt", "x"]), sampling) == (
        0.0,
        None,
        None,
        0.0,
    )
    with pytest.raises(UserError, match="--max-new-tokens must be >= 1, got 0"):
        run(_cli([str(folder), "--prompt", "t5", "--max-new-tokens", "0"]))


def test_a_classifier_is_refused_by_what_it_is():
    """`lmforge eval` of a fine-tuned SST-2 classifier said "cannot generate with a
    classification model model" for a log-likelihood task: say what the model is and what was
    asked of it."""
    import dataclasses

    from lmforge.inference.generate import check_can_generate
    from lmforge.models import build
    from lmforge.models.presets import preset

    classifier = build(dataclasses.replace(preset("tiny-gpt2"), num_labels=2), device="meta")
    with pytest.raises(
        UserError,
        match=r"^cannot score lm-eval's requests with a sequence classifier \(its head "
        r"scores labels, not tokens\): give a decoder language model$",
    ):
        check_can_generate(classifier, "score lm-eval's requests")


def test_cli_stops_at_the_eos_ids_of_generation_config(text_model, tmp_path, capsys):  # noqa: F811 (the fixture)
    """Phi-3 and Gemma list their end-of-turn token as an eos in generation_config.json only;
    transformers' generate and vLLM stop there, `lmforge generate` and `serve` ran on to
    max_tokens."""
    import json
    import shutil

    from tests.inference.test_generate import _word_tokenizer

    folder, model, tok = text_model
    words = generate_text(model, tok, ["t5 t17 t33"], 8, do_sample=False, stop_token_ids=[])[
        0
    ].split()
    # a word whose first place is the third or later
    end = next(w for w in words[2:] if w not in words[:2])
    turn = tmp_path / "turn"
    shutil.copytree(folder, turn)
    special = _word_tokenizer()
    # the end-of-turn token, special to its tokenizer as Phi-3's <|end|> is
    special.add_special_tokens([end])
    special.save(str(turn / "tokenizer.json"))
    run(_cli([str(turn), "--prompt", "t5 t17 t33", "--max-new-tokens", "8"]))
    # generated, but special: not text
    assert capsys.readouterr().out.split() == [w for w in words if w != end]
    (turn / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [0, tok.token_to_id(end)]})
    )
    run(_cli([str(turn), "--prompt", "t5 t17 t33", "--max-new-tokens", "8"]))
    assert capsys.readouterr().out.split() == words[: words.index(end)]


def test_cli_applies_the_repetition_penalty_of_generation_config(text_model, tmp_path, capsys):  # noqa: F811
    """transformers' generate applies generation_config.json's repetition_penalty, greedy too;
    lmforge ignored it."""
    import json
    import shutil

    folder, model, tok = text_model
    penalized = generate_text(
        model, tok, ["t5 t17 t33"], 12, do_sample=False, repetition_penalty=3.0
    )[0]
    assert penalized != generate_text(model, tok, ["t5 t17 t33"], 12, do_sample=False)[0]
    penalty = tmp_path / "penalty"
    shutil.copytree(folder, penalty)
    (penalty / "generation_config.json").write_text(json.dumps({"repetition_penalty": 3.0}))
    run(_cli([str(penalty), "--prompt", "t5 t17 t33", "--max-new-tokens", "12"]))
    assert capsys.readouterr().out == penalized + "\n"
    run(
        _cli(
            [
                str(penalty),
                "--prompt",
                "t5 t17 t33",
                "--max-new-tokens",
                "12",
                "--repetition-penalty",
                "1",
            ]
        )
    )
    assert capsys.readouterr().out != penalized + "\n"
