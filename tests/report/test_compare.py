"""`lmforge compare`: the numbers of its table, its plots and page, labels, and the runs it
refuses."""

from __future__ import annotations

import base64
import io
import json
import math
import shutil
from html.parser import HTMLParser

import pytest
import yaml
from PIL import Image

from lmforge.cli import main
from lmforge.errors import UserError
from lmforge.report import compare, derive_labels, load_run, summarize, text_table
from lmforge.report.compare import table_rows, wall_clock
from lmforge.train.config import to_yaml
from lmforge.train.trainer import Trainer
from tests.train.conftest import run_config


def _write_run(path, rows, config=None):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def _config(**trainer):
    cfg = run_config("/nonexistent", "/tmp/x")
    text = yaml.safe_load(to_yaml(cfg))  # exactly what the trainer writes as config.yaml
    text["trainer"].update(trainer)
    return text


def _rows(step_times, tokens_per_step=100.0, first_wait=3.0, start=0, seqs=4):
    """Metric rows as the trainer logs them; the first carries time_to_first_step."""
    rows = []
    for i, st in enumerate(step_times):
        row = {
            "step": start + i + 1,
            "loss": 5.0 - 0.5 * i,
            "grad_norm": 1.0 + i,
            "lr": 1e-3,
            "step_time": st,
            "tokens_per_second": tokens_per_step / st,
            "sequences_per_second": seqs / st,
            "mfu": 0.01 / st,
        }
        if i == 0:
            row["time_to_first_step"] = st + first_wait
        rows.append(row)
    return rows


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs, self.other_refs = [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.srcs.append(attrs["src"])
        elif tag in ("link", "script") or "href" in attrs:
            self.other_refs.append((tag, attrs))


def test_table_numbers_equal_the_jsonl_computed_by_hand(tmp_path):
    cfg = _config()
    cfg["cost"]["usd_per_hour"] = 3.6
    rows = _rows([2.0, 1.0, 1.0, 0.5])
    rows[1]["val_loss"], rows[1]["val_ppl"] = 4.2, math.exp(4.2)
    rows[3]["loss"] = 4.9  # final loss above the minimum (4.0 at step 3)
    run = load_run(_write_run(tmp_path / "a", rows, cfg))
    s = summarize(run)
    # By hand from the rows: 4 steps of 100 tokens; the first step (2 s, after 3 s of start-up) is
    # warm-up, so steady throughput is 300 tokens / 2.5 s; time 3 + 4.5 s; $3.6/h = $0.001/s.
    assert s["steps"] == 4 and s["tokens"] == pytest.approx(400)
    assert s["final_loss"] == 4.9 and s["min_loss"] == 4.0
    assert (
        s["val_loss"] == 4.2
        and s["val_ppl"] == pytest.approx(math.exp(4.2))
        and s["val_accuracy"] is None
    )
    assert s["tokens_per_second"] == pytest.approx(120.0)
    assert s["sequences_per_second"] == pytest.approx(12 / 2.5)
    assert s["mfu"] == pytest.approx(0.03 / 2.5)  # FLOPs done / (peak x time), not a mean of ratios
    assert s["time_s"] == pytest.approx(7.5) and s["startup_s"] == pytest.approx(3.0)
    assert s["cost_usd"] == pytest.approx(0.0075)
    assert s["tokens_per_dollar"] == pytest.approx(400 / 0.0075)
    run.label, run.summary = "a", s
    header, row = table_rows([run])
    cells = dict(zip(header, row))
    assert cells["tokens/s"] == "120" and cells["time (s)"] == "7.5" and cells["tokens"] == "400"
    assert cells["final loss"] == "4.9000" and cells["val ppl"] == f"{math.exp(4.2):,.2f}"
    assert (
        cells["cost ($)"] == "0.0075" and cells["tokens/$"] == "53,333" and cells["val acc"] == "-"
    )


def test_a_recompiled_step_is_not_steady_state(tmp_path):
    """A compiled run recompiling for a new shape (several 2-4.5 s steps among 0.2 s ones) read
    3x slower than eager in compare's tokens/s; those steps count in its time and cost, not in
    its throughput."""
    rows = _rows([40.0] + [0.2] * 8 + [4.5, 0.2, 2.5, 0.2])
    s = summarize(load_run(_write_run(tmp_path / "a", rows, _config())))
    assert s["tokens_per_second"] == pytest.approx(100 / 0.2)  # the 0.2 s steps
    # all of them, start-up included
    assert s["time_s"] == pytest.approx(3.0 + 40.0 + 0.2 * 10 + 4.5 + 2.5)


def test_the_cost_of_a_multi_node_run_counts_every_node(tmp_path):
    """cost.usd_per_hour prices one node and the trainer's tokens_per_dollar pays for every node;
    compare priced the run at one node's rate (a 2-node run at half its cost)."""
    cfg = _config()
    cfg["cost"]["usd_per_hour"] = 3.6
    rows = _rows([2.0, 1.0, 1.0, 0.5])
    for r in rows:  # as the trainer logs it on 2 nodes: $7.2/h in all
        r["tokens_per_dollar"] = r["tokens_per_second"] * 3600 / 7.2
    s = summarize(load_run(_write_run(tmp_path / "a", rows, cfg)))
    assert s["usd_per_hour"] == pytest.approx(7.2) and s["cost_usd"] == pytest.approx(0.015)


def test_mfu_against_the_fp8_peak_is_a_column_only_where_a_run_logged_it(tmp_path):
    """trainer.float8 runs log mfu_fp8 beside mfu: summed the same way (FLOPs done / (peak x
    time)), shown in its own column, which other runs' tables leave out."""
    rows = _rows([2.0, 1.0, 1.0, 0.5])
    for r in rows:
        r["mfu_fp8"] = r["mfu"] / 2
    fp8 = load_run(_write_run(tmp_path / "fp8", rows, _config()))
    bf16 = load_run(_write_run(tmp_path / "bf16", _rows([2.0, 1.0]), _config()))
    for run in (fp8, bf16):
        run.label, run.summary = run.path.name, summarize(run)
    assert fp8.summary["mfu_fp8"] == pytest.approx(0.015 / 2.5) and bf16.summary["mfu_fp8"] is None
    header, row, other = table_rows([fp8, bf16])
    assert (
        dict(zip(header, row))["MFU vs FP8 peak"] == "0.6%"
        and dict(zip(header, other))["MFU vs FP8 peak"] == "-"
    )
    assert "MFU vs FP8 peak" not in table_rows([bf16])[0]


def test_no_price_is_said_not_guessed(tmp_path):
    run = load_run(_write_run(tmp_path / "a", _rows([1.0, 1.0]), _config()))
    run.label, run.summary = "a", summarize(run)
    assert run.summary["cost_usd"] is None and run.summary["tokens_per_dollar"] is None
    assert "no price configured" in text_table([run])


@pytest.mark.slow
def test_real_runs_of_different_lengths_give_one_decodable_png_per_plot(
    tiny_corpus, tmp_path, capsys
):
    for name, steps, lr in (("short", 6, "3e-3"), ("long", 10, "1e-2")):
        Trainer(
            run_config(
                tiny_corpus,
                tmp_path / name,
                f"trainer.max_steps={steps}",
                f"optim.lr={lr}",
                "trainer.val_check_interval=3",
                "cost.usd_per_hour=2.0",
            )
        ).fit()
    out = tmp_path / "report"
    assert (
        main(["compare", str(tmp_path / "short"), str(tmp_path / "long"), "--out", str(out)]) == 0
    )
    printed = capsys.readouterr().out
    pngs = sorted(p.stem for p in out.glob("*.png"))
    assert pngs == ["cost", "grad_norm", "loss", "loss_difference", "throughput", "time"]

    parser = _Images()
    parser.feed((out / "index.html").read_text())
    assert len(parser.srcs) == len(pngs) and not parser.other_refs  # self-contained
    for src in parser.srcs:
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data in [(out / f"{name}.png").read_bytes() for name in pngs]
        image = Image.open(io.BytesIO(data))
        image.verify()
        assert image.format == "PNG" and image.size[0] >= 600

    # The table printed on the terminal holds the numbers of the JSONL.
    rows = [json.loads(x) for x in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    table = printed.splitlines()
    # labels: what differs
    assert [x.split()[:2] for x in table[2:4]] == [["lr=0.003", "6"], ["lr=0.01", "10"]]
    line = table[3]
    assert f"{rows[-1]['loss']:.4f}" in line and f"{min(r['loss'] for r in rows):.4f}" in line
    assert f"{rows[-1]['val_loss']:.4f}" in line and f"{10 * 8 * 32:,d}" in line


def test_plots_follow_each_run_to_its_own_last_step(tmp_path):
    from lmforge.report import plots

    runs = [
        load_run(_write_run(tmp_path / n, _rows([1.0] * k), _config(precision=p)))
        for n, k, p in (("a", 5, "fp32"), ("b", 12, "bf16-sr"))
    ]
    for run, label in zip(runs, derive_labels(runs)):
        run.label, run.summary = label, summarize(run)
    full = plots.loss_figure(runs).axes[0]
    assert [int(line.get_xdata()[-1]) for line in full.lines] == [5, 12]
    norms = plots.grad_norm_figure(runs).axes[0]
    assert [list(line.get_ydata()) for line in norms.lines] == [
        [1.0 + i for i in range(k)] for k in (5, 12)
    ]


def test_labels_come_from_what_differs_in_the_configs(tmp_path):
    def labels(*configs):
        runs = [
            load_run(_write_run(tmp_path / f"r{len(list(tmp_path.iterdir()))}", _rows([1.0]), c))
            for c in configs
        ]
        return derive_labels(runs)

    assert labels(
        _config(precision="bf16-mixed"), _config(precision="bf16-sr"), _config(precision="bf16")
    ) == ["bf16-mixed", "bf16-sr", "bf16"]
    assert labels(_config(compile=False), _config(compile=True)) == ["eager", "compiled"]
    assert labels(_config(compile=True, micro_batch_size=8), _config(micro_batch_size=4)) == [
        "compiled micro=8",
        "eager micro=4",
    ]
    assert labels(_config()) == ["tiny-neox fp32"]  # one run: its model and precision
    lora, qlora = _config(), _config()
    lora["lora"] = {"rank": 16, "alpha": 32, "base_dtype": "fp32"}
    qlora["lora"] = {"rank": 8, "alpha": 16, "base_dtype": "nf4"}
    # fine-tuned the same way
    assert labels(_config(), lora, qlora) == ["full-weights", "lora-r16", "qlora-r8"]
    assert labels(_config(compile=True)) == ["tiny-neox fp32 compiled"]
    # The layout, where it differs (two runs equal but for TP, or for the pipeline, read alike
    # before).
    tp, pp = _config(), _config()
    tp["parallel"], pp["parallel"] = {"tensor": 2}, {"pipeline": 2}
    fsdp = _config()
    fsdp["trainer"]["data_parallel"] = "fsdp"
    assert labels(_config(), tp, pp, fsdp) == ["ddp", "tp2", "pp2", "fsdp"]
    # Activation checkpointing's modes, and the true/false of runs from before them; off is not "no
    # checkpoints".
    assert labels(
        *(_config(activation_checkpointing=m) for m in ("none", "selective", "full"))
    ) == ["no-act-ckpt", "act-ckpt-selective", "act-ckpt"]
    assert labels(
        _config(activation_checkpointing=False), _config(activation_checkpointing=True)
    ) == ["no-act-ckpt", "act-ckpt"]
    same = labels(_config(), _config())
    assert same[0] != same[1] and all(s.startswith("tiny-neox fp32 (r") for s in same)
    no_config = _write_run(tmp_path / "bare-run", _rows([1.0]))
    assert derive_labels([load_run(no_config)]) == ["bare-run"]


def test_given_labels_win_and_must_match_the_runs(tmp_path):
    a = _write_run(tmp_path / "a", _rows([1.0, 1.0]), _config())
    b = _write_run(tmp_path / "b", _rows([1.0, 1.0]), _config(precision="bf16"))
    report = compare([a, b], tmp_path / "out", labels=["mine", "theirs"])
    assert [r.label for r in report.runs] == ["mine", "theirs"]
    assert "mine" in report.html.read_text()
    with pytest.raises(UserError, match="2 runs"):
        compare([a, b], tmp_path / "out", labels=["only-one"])


def test_a_folder_that_is_not_a_run_is_one_clear_error(tmp_path, capsys):
    good = _write_run(tmp_path / "good", _rows([1.0]), _config())
    (tmp_path / "empty").mkdir()
    for bad, words in (
        (tmp_path / "empty", "not a run folder"),
        (tmp_path / "missing", "not a directory"),
    ):
        assert main(["compare", str(good), str(bad), "--out", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert (
            len(err) == 1
            and err[0].startswith("error: ")
            and words in err[0]
            and str(bad) in err[0]
        )
    assert not (tmp_path / "out").exists()  # nothing written before every run was read
    (tmp_path / "empty" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no rows yet"):
        load_run(tmp_path / "empty")


@pytest.mark.slow
def test_a_resumed_run_reads_as_one_history(tiny_corpus, tmp_path):
    """Kill after step 6 with the last checkpoint at 4, resume: the trainer drops the rows past the
    checkpoint and logs them again; compare sees steps 1..8 once, with the resumed curve."""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    extra = (
        "trainer.max_steps=8",
        "checkpoint.every_n_steps=4",
        "checkpoint.save_top_k=-1",
        "trainer.val_check_interval=4",
    )
    Trainer(run_config(tiny_corpus, whole, *extra)).fit()
    shutil.copytree(whole, killed)
    # the kill came before the step-8 checkpoint
    shutil.rmtree(killed / "checkpoints" / "step-00000008")
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    stale = [dict(json.loads(x), loss=99.0) for x in lines[4:6]]  # rows 5, 6 a killed run logged
    (killed / "metrics.jsonl").write_text(
        "".join(x + "\n" for x in lines[:4])
        + "".join(json.dumps(r) + "\n" for r in stale)
        + '{"step": 7, "lo'
    )
    torn = load_run(killed)  # not resumed yet: the cut-off last row is skipped
    assert [r["step"] for r in torn.rows] == [1, 2, 3, 4, 5, 6]
    (killed / "metrics.jsonl").write_text(
        "".join(x + "\n" for x in lines[:4]) + "".join(json.dumps(r) + "\n" for r in stale)
    )
    Trainer(run_config(tiny_corpus, killed, *extra)).fit()

    run, ref = load_run(killed), load_run(whole)
    assert [r["step"] for r in run.rows] == list(range(1, 9))
    assert run.series("loss") == ref.series("loss") and 99.0 not in run.series("loss")[1]
    assert run.series("val_loss") == ref.series("val_loss")
    s = summarize(run)
    assert s["resumes"] == 1 and s["tokens"] == pytest.approx(8 * 8 * 32)
    by_hand = sum(
        r["time_to_first_step"] - r["step_time"] for r in run.rows if "time_to_first_step" in r
    )
    assert s["startup_s"] == pytest.approx(by_hand)
    assert s["time_s"] == pytest.approx(by_hand + sum(r["step_time"] for r in run.rows))
    # The trainer's wall clock goes on from the checkpoint after the resume, and covers more than
    # the timed steps (validation, checkpoint writes); compare prefers it.
    elapsed = [r["elapsed"] for r in run.rows]
    assert all(a < b for a, b in zip(elapsed, elapsed[1:]))
    wall = wall_clock(run, s)
    # to the run's end: the last save included
    end = json.loads((killed / "finished.json").read_text())["elapsed"]
    assert wall["time_s"] == end >= elapsed[-1] >= s["time_s"] and wall["train_s"] == pytest.approx(
        end - by_hand
    )


def test_wall_clock_time_and_cost_are_preferred_when_logged(tmp_path):
    rows = _rows([1.0, 2.0, 2.0], first_wait=3.0)
    # 12 s of wall clock: 4 s more than start-up + steps
    for row, elapsed in zip(rows, (4.0, 9.0, 12.0)):
        row["elapsed"] = elapsed
    cfg = _config()
    cfg["cost"]["usd_per_hour"] = 3.6
    run = load_run(_write_run(tmp_path / "a", rows, cfg))
    run.label = "a"
    run.summary = wall_clock(run, summarize(run))
    assert run.summary["time_s"] == 12.0 and run.summary["train_s"] == 9.0
    assert run.summary["cost_usd"] == pytest.approx(0.012)  # $3.6/h = $0.001/s
    assert run.summary["tokens_per_dollar"] == pytest.approx(300 / 0.012)
    assert dict(zip(table_rows([run])[0], table_rows([run])[1]))["time (s)"] == "12.0"


def test_a_step_logged_twice_is_merged(tmp_path):
    """A run stopped by trainer.max_minutes logs its last step, then again with the validation
    added."""
    rows = _rows([1.0, 1.0])
    rows.append({**rows[-1], "val_loss": 3.0, "val_ppl": math.exp(3.0)})
    run = load_run(_write_run(tmp_path / "a", rows, _config()))
    assert [r["step"] for r in run.rows] == [1, 2] and run.rows[-1]["val_loss"] == 3.0
    assert summarize(run)["tokens"] == pytest.approx(200)


def test_loss_difference_is_each_run_minus_the_first_at_the_same_step(tmp_path):
    from lmforge.report import plots

    ref_rows, other_rows = _rows([1.0] * 6), _rows([1.0] * 4)
    for i, row in enumerate(other_rows):
        row["loss"] = ref_rows[i]["loss"] + 0.01 * i
    runs = [
        load_run(_write_run(tmp_path / n, r, _config(precision=p)))
        for n, r, p in (("ref", ref_rows, "bf16-mixed"), ("other", other_rows, "bf16"))
    ]
    for run, label in zip(runs, derive_labels(runs)):
        run.label = label
    ax = plots.loss_difference_figure(runs).axes[0]
    zero, diff = ax.lines
    assert list(zero.get_ydata()) == [0.0, 0.0]
    assert list(diff.get_xdata()) == [1, 2, 3, 4]
    assert list(diff.get_ydata()) == pytest.approx([0.0, 0.01, 0.02, 0.03])
    assert "bf16-mixed" in ax.get_title()


def _with_evals(rows, evals):
    """`rows` with downstream-eval metrics added at some steps: {step: {"eval/<task>/<metric>":
    value}}."""
    for row in rows:
        row.update(evals.get(row["step"], {}))
    return rows


def test_downstream_evals_get_a_panel_each_and_table_columns(tmp_path):
    from lmforge.report import plots

    a_evals = {
        2: {"eval/sst2_local/acc": 0.5, "eval/wikitext2_local/word_perplexity": 9000.0},
        4: {"eval/sst2_local/acc": 0.625, "eval/wikitext2_local/word_perplexity": 310.5},
    }
    # another task set: its missing metric is "-" in the table
    b_evals = {3: {"eval/sst2_local/acc": 0.75}}
    a = _write_run(
        tmp_path / "a", _with_evals(_rows([1.0] * 4), a_evals), _config(precision="fp32")
    )
    b = _write_run(
        tmp_path / "b", _with_evals(_rows([1.0] * 3), b_evals), _config(precision="bf16")
    )
    report = compare([a, b], tmp_path / "out")
    assert report.files["downstream"].is_file()
    parser = _Images()
    parser.feed(report.html.read_text())
    embedded = [base64.b64decode(src.split(",", 1)[1]) for src in parser.srcs]
    assert report.files["downstream"].read_bytes() in embedded

    # The plotted points are the logged ones, panel by panel (task, then metric), run by run.
    axes = [ax for ax in plots.downstream_figure(report.runs).axes if ax.axison]
    assert [ax.get_title() for ax in axes] == ["sst2_local acc", "wikitext2_local word_perplexity"]
    acc, ppl = (
        [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines] for ax in axes
    )
    assert acc == [([2, 4], [0.5, 0.625]), ([3], [0.75])]
    assert ppl == [([2, 4], [9000.0, 310.5])]
    assert axes[1].get_yscale() == "log" and axes[0].get_yscale() == "linear"

    header, *rows = table_rows(report.runs)
    assert header[-2:] == ["sst2_local acc", "wikitext2_local word_perplexity"]
    # the last value each run logged
    assert [r[-2:] for r in rows] == [["0.625", "310.5"], ["0.75", "-"]]
    assert "sst2_local acc" in text_table(
        report.runs
    ) and "<th>wikitext2_local word_perplexity</th>" in (report.html.read_text())


def test_runs_without_downstream_evals_get_no_such_plot_or_columns(tmp_path):
    report = compare([_write_run(tmp_path / "a", _rows([1.0, 1.0]), _config())], tmp_path / "out")
    assert "downstream" not in report.files and not (tmp_path / "out" / "downstream.png").exists()
    assert table_rows(report.runs)[0][-1] == "tokens/$"


def test_the_table_gives_the_time_and_tokens_per_dollar_of_the_runs_last_line(
    tiny_corpus, tmp_path
):
    """compare took the last row's `elapsed` (before the final checkpoint save), the run's line
    the time to its end: two tokens/$ for one run. Logged every 3 steps, step 1 was never logged
    and start-up read 0.0."""
    import re

    trainer = Trainer(
        run_config(
            tiny_corpus,
            tmp_path / "run",
            "trainer.max_steps=4",
            "trainer.log_every_n_steps=3",
            "cost.usd_per_hour=3.6",
        )
    )
    line = trainer.summary(trainer.fit())
    run = load_run(tmp_path / "run")
    run.label = "run"
    run.summary = wall_clock(run, summarize(run))
    cells = dict(zip(*table_rows([run])))
    assert cells["tokens/$"] == re.search(r", ([\d,]+) tokens/\$ at \$3.6/h", line)[1]
    assert cells["tokens"] == re.search(r"([\d,]+) tokens in ", line)[1] == f"{4 * 8 * 32:,}"
    assert cells["time (s)"] == f"{trainer.ended:,.1f}"
    first = run.rows[0]  # logged though 1 is no multiple of 3: it carries the start-up
    assert [r["step"] for r in run.rows] == [1, 3, 4] and cells["start-up (s)"] != "-"
    assert run.summary["startup_s"] == pytest.approx(
        first["time_to_first_step"] - first["step_time"]
    )
    assert run.summary["startup_s"] > 0


def test_start_up_is_not_shown_as_zero_where_the_first_step_was_not_logged(tmp_path):
    """An older run logged every 3 steps from step 3: its start-up is unknown ("-"), not 0.0."""
    rows = [r for r in _rows([1.0] * 6) if r["step"] % 3 == 0]
    run = load_run(_write_run(tmp_path / "a", rows, _config(log_every_n_steps=3)))
    run.label = "a"
    run.summary = wall_clock(run, summarize(run))
    assert dict(zip(*table_rows([run])))["start-up (s)"] == "-"
