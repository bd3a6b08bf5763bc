"""`lmforge generate MODEL_DIR --tokenizer PATH`: a model folder without tokenizer files (a
weights-only import) is generated from with a tokenizer found elsewhere, in the forms `lmforge
eval --tokenizer` takes; without one, the error names the option."""

from __future__ import annotations

import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.inference import generate_text
from tests.inference.test_generate import _cli, _word_tokenizer, run, text_model  # noqa: F401 (the fixture, shared)

PROMPT = "t5 t17 t33"
# Renders a chat as "t3 SYSTEM t4 USER ... t2": one word-token per marker, so the prompt's ids are
# easy to write.
TEMPLATE = (
    "{% for m in messages %}{{ 't3' if m.role == 'system' else 't4' }} {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}t2 {% endif %}"
)
OTHER_TEMPLATE = "{% for m in messages %}t9 {{ m.content }} {% endfor %}{% if add_generation_prompt %}t8 {% endif %}"
# The chat below (system "t9", user "t5 t17") as each renders it.
RENDERED = {TEMPLATE: "t3 t9 t4 t5 t17 t2", OTHER_TEMPLATE: "t9 t9 t9 t5 t17 t8"}


@pytest.fixture
def split(text_model, tmp_path):  # noqa: F811 (the fixture)
    """(the model folder without its tokenizer, a folder holding only that tokenizer, the model,
    the tokenizer)."""
    folder, model, tok = text_model
    bare, tokenizer = tmp_path / "bare", tmp_path / "tokenizer"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    tokenizer.mkdir()
    shutil.copy2(folder / "tokenizer.json", tokenizer / "tokenizer.json")
    return bare, tokenizer, model, tok


def test_generate_reads_the_tokenizer_given(split, capsys):
    bare, tokenizer, model, tok = split
    greedy = generate_text(model, tok, [PROMPT], 6, temperature=0)[0]
    # a folder or the file, as eval's --tokenizer
    for given in (tokenizer, tokenizer / "tokenizer.json"):
        run(
            _cli(
                [str(bare), "--prompt", PROMPT, "--max-new-tokens", "6", "--tokenizer", str(given)]
            )
        )
        assert capsys.readouterr().out == greedy + "\n"


def test_a_folder_without_tokenizer_names_the_option(split, tmp_path, capsys):
    """It said "give a tokenizer.json, ..." while generate took none: the one fix it offered was
    not possible."""
    bare, _, _, _ = split
    assert main(["generate", str(bare), "--prompt", PROMPT]) == 1
    assert capsys.readouterr().err == (
        f"error: no single tokenizer file found in {bare}: pass --tokenizer PATH (a tokenizer.json, vocab.json + "
        "merges.txt, a SentencePiece .model, or a folder holding one), or copy the model's tokenizer files into that "
        "folder\n"
    )
    with pytest.raises(UserError, match=f"^tokenizer path {tmp_path / 'nope'} does not exist"):
        run(_cli([str(bare), "--prompt", PROMPT, "--tokenizer", str(tmp_path / "nope")]))


def test_a_tokenizer_with_more_ids_than_the_model_is_refused(split, tmp_path):
    """Its ids past the embedding rows would be an index error at the first prompt that holds
    one."""
    bare, _, _, _ = split
    words = [f"t{i}" for i in range(400)]
    big = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="t1"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(
        UserError,
        match=r"^--tokenizer .*big\.json has 400 ids but the model only 300: give the "
        r"tokenizer the model was trained with$",
    ):
        run(_cli([str(bare), "--prompt", PROMPT, "--tokenizer", str(tmp_path / "big.json")]))


def test_chat_template_the_model_folders_first_else_the_tokenizers(split, capsys):
    """With --tokenizer the chat template still comes from the model folder (the one it was
    fine-tuned with); only a model folder without one takes the tokenizer folder's (a
    weights-only import left it there)."""
    from lmforge.cli.serve import chat_folder

    bare, tokenizer, model, tok = split

    def chat() -> str:
        run(
            _cli(
                [
                    str(bare),
                    "--chat",
                    "--system",
                    "t9",
                    "--prompt",
                    "t5 t17",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "0",
                    "--tokenizer",
                    str(tokenizer),
                ]
            )
        )
        return capsys.readouterr().out

    def expected(template: str) -> str:
        return (
            generate_text(model, tok, [tok.encode(RENDERED[template])], 6, temperature=0)[0] + "\n"
        )

    # the output tells which template prompted it
    assert expected(TEMPLATE) != expected(OTHER_TEMPLATE)
    (tokenizer / "chat_template.jinja").write_text(TEMPLATE)
    assert chat_folder(bare, None, str(tokenizer)) == tokenizer
    # the folder holding the file
    assert chat_folder(bare, None, str(tokenizer / "tokenizer.json")) == tokenizer
    # no --tokenizer: as before, the model folder's (here none)
    assert chat_folder(bare, None, None) == bare
    assert chat() == expected(TEMPLATE)
    (bare / "chat_template.jinja").write_text(OTHER_TEMPLATE)  # the model folder's wins
    assert chat_folder(bare, None, str(tokenizer)) == bare
    assert chat() == expected(OTHER_TEMPLATE)
