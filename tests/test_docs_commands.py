"""Every lmforge command in the README's and docs/'s code blocks is one the CLI accepts as
written: the verb exists, each option is the verb's, and a shipped recipe with the command's
key=value overrides reads as a run config (a renamed key or a removed recipe fails here, not for
the first user who copies the line). The commands quoted inline (`lmforge eval MODEL --tasks
T1,T2 [--limit N]`) name only options their verb has."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/reference/ is generated from the parsers themselves (tests/test_reference.py keeps it so):
# its usage lines are argparse's, not commands to copy.
DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts),
]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(file:line, the arguments after `lmforge` or `-m lmforge.cli`) for each command line of
    each fenced code block, continuation lines joined and shell comments dropped."""
    found = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for block in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
            first = text.count("\n", 0, block.start()) + 2
            lines = block.group(1).split("\n")
            i = 0
            while i < len(lines):
                where, line = f"{path.relative_to(ROOT)}:{first + i}", lines[i]
                while line.rstrip().endswith("\\") and i + 1 < len(lines):
                    i += 1
                    line = line.rstrip()[:-1] + " " + lines[i]
                i += 1
                tokens = shlex.split(line, comments=True)
                starts = [k for k, t in enumerate(tokens) if t in ("lmforge", "lmforge.cli")]
                if starts:
                    rest = tokens[starts[-1] + 1 :]
                    # The command ends where the shell's next one starts (`&&`, `;`, `|`) or it goes
                    # to the background.
                    end = next(
                        (k for k, t in enumerate(rest) if t in ("&&", "&", ";", "|")), len(rest)
                    )
                    found.append((where, [t for t in rest[:end] if t != "..."]))
    return found


COMMANDS = documented_commands()


def test_the_docs_hold_the_commands_a_user_copies():
    verbs = {args[0] for _, args in COMMANDS}
    assert (
        len(COMMANDS) > 40
        and {"quickstart", "pretrain", "finetune", "plan", "serve", "eval"} <= verbs
    )


@pytest.mark.parametrize(
    "args", [args for _, args in COMMANDS], ids=[where for where, _ in COMMANDS]
)
def test_a_documented_command_parses(args, monkeypatch):
    from lmforge.cli import VERBS, parser
    from lmforge.train.config import load_run_config

    assert args[0] in VERBS, f"no verb {args[0]!r}"
    monkeypatch.chdir(ROOT)
    try:
        parsed, extra = parser(args[0]).parse_known_args(args)
    except SystemExit as e:  # --help prints and exits 0; a wrong option exits 2
        assert e.code == 0, f"lmforge {' '.join(args)}"
        return
    overrides = getattr(parsed, "overrides", None)
    if (
        extra
        and isinstance(overrides, list)
        and all("=" in a and not a.startswith("-") for a in extra)
    ):
        overrides += extra  # as lmforge.cli.main: overrides may follow the verb's options
    else:
        assert not extra, f"lmforge {args[0]} does not take {extra}"
    config = getattr(parsed, "config", None)
    if isinstance(config, str) and config.startswith("configs/"):
        assert (ROOT / config).is_file(), f"no recipe {config}"
        # An elided value (data.paths=[...]), a loop's variable (trainer.precision=$p) and a
        # variable holding overrides ($TINY) are left out; a folder named through a variable
        # ($OUT/imported) stays, as a name.
        kept = [o for o in overrides if "..." not in o and not re.fullmatch(r"([^=]+=)?\$\w+", o)]
        load_run_config(config, [o.replace("$", "") for o in kept])


def inline_commands() -> list[tuple[str, str]]:
    """(file, text) of each inline code span that starts with `lmforge VERB`."""
    return [
        (f"{path.relative_to(ROOT)}", m.group(1))
        for path in DOCS
        for m in re.finditer(r"`(lmforge [a-z][^`]*)`", path.read_text(encoding="utf-8"))
    ]


def _options(p, words: list[str]) -> set[str]:
    """The options of the (sub)command `words` name under parser p: `data inspect` is the inspect
    parser's."""
    import argparse

    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((w for w in words if w in action.choices), None)
            if chosen is not None:
                return _options(action.choices[chosen], words[words.index(chosen) + 1 :])
    return {o for action in p._actions for o in action.option_strings}


def test_inline_commands_name_only_options_their_verb_has():
    from lmforge.cli import VERBS, parser

    spans = inline_commands()
    assert len(spans) > 20
    wrong = []
    for where, text in spans:
        words = text.split()
        for verb in words[1].split("/"):  # `lmforge serve/generate --lora`: each verb takes it
            if verb not in VERBS:
                wrong.append(f"{where}: {text} (no verb {verb!r})")
            elif verb != "bench":  # options after a benchmark's name are the benchmark script's own
                known = _options(parser(verb), [verb, *words[2:]])
                wrong += [
                    f"{where}: {text} ({o})"
                    for o in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text)
                    if o not in known
                ]
    assert not wrong, "\n".join(wrong)


def test_the_readme_verb_table_names_lora_on_each_verb_that_takes_it():
    """A base + PEFT adapter is how most users meet a fine-tune: the verb table's row says which
    verbs take one."""
    from lmforge.cli import VERBS, parser

    rows = {
        m.group(1): m.group(0)
        for m in re.finditer(
            r"^\| `lmforge ([a-z-]+)[^\n]*", (ROOT / "README.md").read_text(encoding="utf-8"), re.M
        )
    }
    takes = [verb for verb in VERBS if "--lora" in _options(parser(verb), [verb])]
    assert {"generate", "serve", "eval"} <= set(takes)
    assert [verb for verb in takes if "--lora DIR" not in rows.get(verb, "")] == []
