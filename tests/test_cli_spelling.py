"""An option spelt with underscores (lm-eval's --num_fewshot) is answered with the verb's
spelling and usage."""

from __future__ import annotations

import argparse

import pytest

from lmforge.cli import VERBS, main, parser


def _error(capsys, *argv: str) -> tuple[str, str]:
    """(the usage's first line, the error line) of `lmforge ARGV`, which must exit 2."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2, err
    return err[0], err[-1]


def test_lm_evals_spelling_is_answered_with_evals(capsys):
    """`lmforge eval runs/x --tasks t --num_fewshot 2` printed lmforge's usage and 'unrecognized
    arguments'."""
    usage, line = _error(capsys, "eval", "runs/x", "--tasks", "t", "--num_fewshot", "2")
    assert usage.startswith("usage: lmforge eval ")
    assert (
        line
        == "lmforge eval: error: unknown option --num_fewshot: lmforge eval spells it --num-fewshot"
    )
    assert _error(capsys, "eval", "runs/x", "--tasks=t", "--batch_size=4")[1].endswith(
        "unknown option --batch_size: lmforge eval spells it --batch-size"
    )
    # before a missing required argument, which would otherwise be said first
    assert _error(capsys, "eval", "runs/x", "--output_path", "r.json")[1].endswith(
        "unknown option --output_path: lmforge eval spells it --output-path"
    )
    # any other unknown option: the verb's usage, the words as argparse says them
    usage, line = _error(capsys, "eval", "runs/x", "--tasks", "t", "--bogus")
    assert (
        usage.startswith("usage: lmforge eval ")
        and line == "lmforge eval: error: unrecognized arguments: --bogus"
    )


def _long_options(p: argparse.ArgumentParser, words: list[str]):
    """(words that select a parser, one of its dashed long options), through nested verbs
    (`lmforge data merge`)."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, sub in action.choices.items():
                yield from _long_options(sub, [*words, word])
        for option in action.option_strings:
            if option.startswith("--") and "-" in option[2:]:
                yield words, option


def test_every_verbs_dashed_options_are_named_when_spelt_with_underscores(capsys):
    checked = 0
    for verb in VERBS:
        for words, option in _long_options(parser(verb), []):
            if words[0] != verb:
                continue
            under = "--" + option[2:].replace("-", "_")
            prog = " ".join(["lmforge", *words])
            assert _error(capsys, *words, under)[1] == (
                f"{prog}: error: unknown option {under}: {prog} spells it {option}"
            ), (words, option)
            checked += 1
    assert checked > 30  # 36 when written
