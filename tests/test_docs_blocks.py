"""The shell blocks of the journey pages run as written.

A block on a docs page is either run here (slow lane: the pages in RUN, in order, each in the one
working folder the earlier ones filled, with `lmforge` this checkout's and `$DATA` the tests' real
assets) or titled *illustrative* (```` ```bash title="illustrative: why" ````: it needs the reader's
corpus, a GPU, several processes or a cluster). A `DATA=...` line in a block names the reader's
folder; here DATA is the tests' shared data. The README's journey lines are lines these pages run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SHELLS = ("bash", "sh", "shell", "console")
# The pages whose blocks run, each after the pages it reads the outputs of.
RUN = {
    "data.md": (),
    "pretraining.md": ("data.md",),
    "checkpoints.md": ("pretraining.md",),
    "fine-tuning.md": ("pretraining.md",),
    "evaluation.md": ("pretraining.md",),
    "serving.md": ("pretraining.md",),
    "planning.md": (),
    "rl.md": (),
}


def fences(path: Path) -> list[tuple[str, str, str]]:
    """(language, the rest of the info string, body) of each fenced block of `path`."""
    text = path.read_text(encoding="utf-8")
    return [
        (m.group(1), m.group(2), m.group(3))
        for m in re.finditer(r"^```(\w*)([^\n]*)\n(.*?)^```", text, re.S | re.M)
    ]


def runnable(path: Path) -> list[str]:
    return [
        body for lang, info, body in fences(path) if lang in SHELLS and "illustrative" not in info
    ]


def journey_pages() -> list[Path]:
    return sorted(
        p
        for p in DOCS.rglob("*.md")
        if not {"reference", "experiments"} & set(p.relative_to(DOCS).parts)
    )


def test_every_shell_block_of_a_page_runs_here_or_says_it_is_illustrative():
    unmarked = [
        f"{p.relative_to(ROOT)}: {body.splitlines()[0]}"
        for p in journey_pages()
        if p.name not in RUN
        for body in runnable(p)
    ]
    assert unmarked == [], "mark them illustrative, or run their page (RUN)"
    assert all(runnable(DOCS / page) for page in RUN)


def _commands(body: str) -> list[str]:
    """The block's command lines, continuations joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", "", body)
    return [
        line.split("  #")[0].strip()
        for line in joined.splitlines()
        if line.strip().startswith("lmforge ")
    ]


def test_the_readme_journeys_are_lines_the_pages_run():
    ran = {line for page in RUN for body in runnable(DOCS / page) for line in _commands(body)}
    readme = [
        line
        for lang, info, body in fences(ROOT / "README.md")
        if lang in SHELLS and "illustrative" not in info
        for line in _commands(body)
    ]
    assert len(readme) >= 8
    assert [
        line for line in readme if line not in ran and not line.startswith("lmforge quickstart")
    ] == []


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, shared_data):
    """One working folder for every page: the checkout's recipes, `lmforge` this checkout's."""
    work = tmp_path_factory.mktemp("docs-blocks")
    (work / "configs").symlink_to(ROOT / "configs")
    bin_dir = work / ".bin"
    bin_dir.mkdir()
    (bin_dir / "lmforge").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m lmforge.cli "$@"\n')
    (bin_dir / "lmforge").chmod(0o755)
    env = {
        **os.environ,
        "DATA": str(shared_data),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "TQDM_DISABLE": "1",
    }
    return {"dir": work, "env": env, "ran": {}}


def run_page(workspace, page: str) -> str:
    """Run `page`'s blocks (after the pages it needs, once each); their output."""
    if page not in workspace["ran"]:
        for need in RUN[page]:
            run_page(workspace, need)
        script = "\n".join(
            re.sub(r"^DATA=.*$", "", body, flags=re.M) for body in runnable(DOCS / page)
        )
        r = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=workspace["dir"],
            env=workspace["env"],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert r.returncode == 0, f"{page}:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        workspace["ran"][page] = r.stdout + r.stderr
    return workspace["ran"][page]


@pytest.mark.slow
def test_data_page(workspace):
    out = run_page(workspace, "data.md")
    work = workspace["dir"]
    assert (work / "data/wiki_text_document.idx").is_file() and "60 documents" in out
    assert (work / "data/wiki-tokenizer/tokenizer.json").is_file()


@pytest.mark.slow
def test_pretraining_page_trains_and_resumes(workspace):
    out = run_page(workspace, "pretraining.md")
    run = workspace["dir"] / "runs/tiny"
    assert (run / "checkpoints/step-00000020").is_dir() and (run / "hf/config.json").is_file()
    assert "resumed at 10" in out and "trainer.max_steps" in (run / "history.jsonl").read_text()


@pytest.mark.slow
def test_checkpoints_page_round_trips_through_hugging_face(workspace):
    from safetensors.torch import load_file

    run_page(workspace, "checkpoints.md")
    runs = workspace["dir"] / "runs"
    exported, final = (
        load_file(runs / "tiny-exported/model.safetensors"),
        load_file(runs / "tiny/hf/model.safetensors"),
    )
    assert exported.keys() == final.keys() and all((exported[k] == final[k]).all() for k in final)
    assert (runs / "tiny-imported/lmforge.json").is_file() and (
        runs / "llama-imported/lmforge.json"
    ).is_file()
    assert sorted(p.name for p in (runs / "llama-test").iterdir() if "token" in p.name) == [
        "tokenizer.model"
    ]


@pytest.mark.slow
def test_fine_tuning_page(workspace):
    """The first try visibly learns: the tiny model answers noise before, the trained record's
    answer after."""
    out = run_page(workspace, "fine-tuning.md")
    assert (workspace["dir"] / "runs/sft-tiny/hf/chat_template.jinja").is_file()
    before, after = out.split("finished at step 200", 1)
    answer = "What lies under the shade of a big tree, yet is seen in the sky?\nAnswer: A kite."
    assert "kite" not in before.lower() and answer in after


@pytest.mark.slow
def test_evaluation_page(workspace):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[eval]')")
    assert "word_perplexity" in run_page(workspace, "evaluation.md")


@pytest.mark.slow
def test_serving_page(workspace):
    assert "generated 1 completion(s)" in run_page(workspace, "serving.md")


@pytest.mark.slow
def test_planning_page(workspace):
    assert "peak per device" in run_page(workspace, "planning.md")


@pytest.mark.slow
def test_the_wikitext_split_gives_the_tests_articles_byte_for_byte(tmp_path, shared_data):
    """The data page's snippet (illustrative there, as it writes into $DATA) on a copy of
    WikiText-2's valid.txt."""
    (block,) = [
        body
        for lang, _, body in fences(DOCS / "data.md")
        if lang in SHELLS and "articles.jsonl" in body and "python" in body
    ]
    folder = tmp_path / "corpora" / "wikitext-2"
    folder.mkdir(parents=True)
    shutil.copy(shared_data / "corpora/wikitext-2/valid.txt", folder)
    r = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        env={**os.environ, "DATA": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    made = (folder / "valid.articles.jsonl").read_bytes()
    assert made == (shared_data / "corpora/wikitext-2/valid.articles.jsonl").read_bytes()


@pytest.mark.slow
def test_rl_page_learns_the_toy_task(workspace):
    out = run_page(workspace, "rl.md")
    first, last = (
        float(x) for x in re.search(r"first 5 steps ([\d.]+), last 5 steps ([\d.]+)", out).groups()
    )
    assert first < 0.3 and last > first + 0.5
