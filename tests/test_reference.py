"""docs/reference/ is what scripts/gen_reference.py writes from the source: a key or option
added, renamed or re-documented without regenerating the page fails here, and so does a config
key or an option with no meaning."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "scripts" / "gen_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_reference", module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_pages_are_what_the_generator_writes():
    for path, text in _generator().pages().items():
        committed = path.read_text(encoding="utf-8") if path.is_file() else ""
        assert committed == text, (
            f"{path.relative_to(ROOT)} is stale: run python scripts/gen_reference.py"
        )


def test_every_config_key_and_section_says_what_it_means():
    sections = _generator().config_sections()
    assert [name for name, _, _ in sections][:3] == ["model", "data", "trainer"]
    keys = [key for _, _, section in sections for key in section]
    assert {
        "trainer.max_steps",
        "data.paths",
        "lora.rank",
        "parallel.tensor",
        "model.init_from",
    } <= {k.name for k in keys}
    assert [name for name, doc, _ in sections if not doc] == []
    assert [k.name for k in keys if len(k.doc) < 8] == []


def test_a_field_comment_is_read_from_above_and_beside_the_field(tmp_path, monkeypatch):
    (tmp_path / "commented.py").write_text(
        "from dataclasses import dataclass, field\n\n\n@dataclass\nclass C:\n"
        "    a: int = 1  # beside a\n"
        "    # above b,\n    # on two lines\n    b: list[int] = field(\n        default_factory=list)  # and beside\n"
        "    c: str = 'x'\n\n    # not c's: a blank line and d's own\n\n    d: bool = False\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import commented

    assert _generator().field_docs(commented.C) == {
        "a": "beside a",
        "b": "above b, on two lines and beside",
        "c": "",
        "d": "",
    }


def test_every_cli_argument_has_help():
    from lmforge.cli import VERBS, parser

    gen = _generator()
    verbs = gen.subparsers(parser())
    missing = []

    def walk(p, title):
        missing.extend(
            f"{title} {row.split('`')[1]}" for row in gen.parser_rows(p) if row.endswith("|  |")
        )
        for name, sub in gen.subparsers(p).items():
            walk(sub, f"{title} {name}")

    for verb in VERBS:
        walk(verbs[verb], verb)
    assert missing == []
