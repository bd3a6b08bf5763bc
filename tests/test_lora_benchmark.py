"""benchmarks/lora.py, LoRA fine-tuning lmforge vs PEFT: what a CUDA run chooses (its memory
figure, its block of BENCHMARKS.md, the lmforge side's settings, the device each side's process
is told), checked here on the CPU without touching CUDA, and the CPU run end to end (slow)."""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
CUDA = torch.device("cuda", 0)  # a device object only: nothing here asks CUDA for anything


def _bench(name: str):
    """A module of benchmarks/ (they import each other by their bare names: report, train)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _args(device: torch.device, precision: str = "bf16", **kw) -> Namespace:
    return Namespace(
        **{
            **dict(
                device=device,
                precision=precision,
                shape="pythia-410m",
                batch=8,
                seq=1024,
                steps=10,
                rounds=1,
                threads=0,
                qlora=True,
            ),
            **kw,
        }
    )


def test_the_device_type_decides_the_memory_figure_the_block_and_the_lmforge_settings():
    lora = _bench("lora")
    cpu = lora.device_choices(torch.device("cpu"), "fp32")
    assert (cpu.label, cpu.memory, cpu.cpu_clock, cpu.digits) == ("CPU, fp32", "peak RSS", True, 2)
    assert cpu.overrides == ("trainer.device=cpu", "cost.peak_flops=1e12")
    # The CPU runs keep rewriting the blocks they wrote before this script knew CUDA.
    section = _bench("report").read_section(lora.SECTION)
    for precision in ("fp32", "bf16"):
        assert f"\n### {lora.device_choices(torch.device('cpu'), precision).label}\n" in section
    gpu = lora.device_choices(CUDA, "bf16")
    assert (gpu.label, gpu.memory, gpu.cpu_clock, gpu.digits) == (
        "CUDA, bf16",
        "peak GPU memory (allocated)",
        False,
        4,
    )
    assert gpu.overrides == ("trainer.device=cuda:0",)  # no cost.peak_flops: the datasheet's peak
    assert lora.device_choices(CUDA, "fp32").overrides == (
        "trainer.device=cuda:0",
        "trainer.tf32=false",
    )


def test_the_lmforge_side_on_cuda_is_a_run_config_lmforge_accepts(tmp_path):
    """The overrides a GPU child hands to load_run_config: every key known, the values valid, the
    device and the QLoRA base as meant (a typo here would cost a GPU session its stage)."""
    from lmforge.train.config import load_run_config

    lora = _bench("lora")
    cfg = load_run_config(
        None, lora.lmforge_overrides(_args(CUDA), tmp_path / "hf", tmp_path, qlora=True)
    )
    assert cfg.trainer.device == "cuda:0" and cfg.cost.peak_flops is None and cfg.trainer.tf32
    assert (
        cfg.trainer.precision == "bf16-mixed"
        and cfg.lora.base_dtype == "nf4"
        and cfg.lora.rank == lora.RANK
    )
    assert (cfg.trainer.micro_batch_size, cfg.data.seq_length) == (8, 1024)
    assert (
        load_run_config(
            None, lora.lmforge_overrides(_args(CUDA), tmp_path, tmp_path)
        ).lora.base_dtype
        == "bf16"
    )
    cfg = load_run_config(None, lora.lmforge_overrides(_args(CUDA, "fp32"), tmp_path, tmp_path))
    assert (
        cfg.trainer.precision == "fp32" and cfg.lora.base_dtype == "fp32" and not cfg.trainer.tf32
    )
    cfg = load_run_config(
        None, lora.lmforge_overrides(_args(torch.device("cpu"), "fp32"), tmp_path, tmp_path)
    )
    assert cfg.trainer.device == "cpu" and cfg.cost.peak_flops == 1e12


def test_each_side_process_is_told_the_device_and_parses_it_back():
    lora = _bench("lora")
    cmd = lora.child_command(_args(CUDA), "lmforge-qlora", Path("/tmp/hf"))
    assert (
        cmd[cmd.index("--device") + 1] == "cuda:0"
        and cmd[cmd.index("--child") + 1] == "lmforge-qlora"
    )
    assert cmd[cmd.index("--precision") + 1] == "bf16" and cmd[cmd.index("--steps") + 1] == "10"
    # The parent resolves --device once ('cuda' is cuda:0) and its children get that; the CPU stays
    # the CPU.
    from lmforge.devices import accelerator

    assert lora.resolve("cpu") == torch.device("cpu")
    # the suite hides a GPU unless LMFORGE_TEST_DEVICE says otherwise (conftest.py)
    if accelerator() is None:
        with pytest.raises(SystemExit, match=r"^error: --device=cuda: cuda is not available here"):
            lora.resolve("cuda")  # one line, not a traceback


def test_first_losses_agree_to_the_arithmetic_and_qlora_to_five_percent():
    check = _bench("lora").check_first_losses
    check({"peft": 10.0, "lmforge": 10.0005}, "fp32")
    with pytest.raises(SystemExit, match="first-step losses differ"):
        check({"peft": 10.0, "lmforge": 10.002}, "fp32")
    check({"peft": 10.0, "lmforge": 10.1, "lmforge-qlora": 10.4}, "bf16")
    with pytest.raises(SystemExit, match="lmforge-qlora"):
        check({"peft": 10.0, "lmforge": 10.0, "lmforge-qlora": 10.6}, "bf16")
    with pytest.raises(SystemExit, match="lmforge 10.300000"):  # QLoRA's 5% is QLoRA's alone
        check({"peft": 10.0, "lmforge": 10.3}, "bf16")
    # a NaN loss compares false with anything: refused all the same
    with pytest.raises(SystemExit, match="nan"):
        check({"peft": 10.0, "lmforge": math.nan}, "bf16")


def _runs(peaks: tuple[int, int, int]) -> dict:
    return {
        side: [{"first_loss": 10.0, "times": [t, t], "cpu": [t, t], "peak": peak}]
        for side, t, peak in zip(("peft", "lmforge", "lmforge-qlora"), (0.05, 0.04, 0.08), peaks)
    }


def test_the_cuda_block_names_the_gpu_and_its_memory_figure_and_the_cpu_block_reads_as_before(
    monkeypatch,
):
    lora = _bench("lora")
    monkeypatch.setattr(
        lora,
        "accelerator_description",
        lambda device: f"NVIDIA H200 (139.8 GiB, CUDA 13.0) {device}",
    )
    monkeypatch.setattr(
        sys, "argv", ["benchmarks/lora.py", "--device", "cuda", "--precision", "bf16", "--qlora"]
    )
    body = lora.report(_args(CUDA), _runs((10 * 2**30, 8 * 2**30, 4 * 2**30)), 61.0, (0.5, 0.7))
    first, _, header, rule, peft_row, lmforge_row, qlora_row, *rest = body.splitlines()
    assert first.startswith(
        "Command: `python benchmarks/lora.py --device cuda --precision bf16 --qlora`. GPU: "
        "NVIDIA H200 (139.8 GiB, CUDA 13.0) cuda:0; torch "
    )
    assert "CPU" not in first and "threads" not in first and "max_memory_allocated" in first
    assert header == (
        "| side | step s (wall) | tokens/s | wall s | peak GPU memory (allocated) | tokens/s vs PEFT | "
        "peak memory vs PEFT |"
    )
    assert peft_row.endswith("| 0.0500 | 163,840 | 0.0500 | 10.00 GiB | 1.00 | 1.00 |")
    assert (
        lmforge_row
        == "| lmforge finetune | 0.0400 | 204,800 | 0.0400 | 8.00 GiB | **1.25x** | **0.80x** |"
    )
    assert qlora_row.startswith("| lmforge finetune, QLoRA (lora.base_dtype=nf4) | 0.0800 |")
    goal, qlora_note = [line for line in rest if line]
    assert goal == (
        "Goal (>= 1.2x PEFT's tokens/s at no more peak memory): lmforge finetune: met — 1.25x the tokens/s "
        "at 0.80x the peak memory."
    )  # the QLoRA row is not the goal's recipe
    assert (
        "PEFT's own QLoRA (bitsandbytes' 4-bit base) is not" in qlora_note
        and "base is in bf16" in qlora_note
    )
    # The CPU's block as the script wrote it before CUDA: its header byte for byte as in
    # BENCHMARKS.md.
    monkeypatch.setattr(sys, "argv", ["benchmarks/lora.py", "--threads", "1"])
    runs = {k: v for k, v in _runs((2 * 2**30, 2**30, 2**30)).items() if k != "lmforge-qlora"}
    body = lora.report(
        _args(torch.device("cpu"), "fp32", threads=1, qlora=False), runs, 54.0, (0.9, 1.0)
    )
    first, _, header, *_ = body.splitlines()
    assert (
        first.startswith("Command: `python benchmarks/lora.py --threads 1`. CPU: ")
        and "GPU" not in first
    )
    assert first.endswith(
        "torch threads per process: 1. Median of 1 x 10 steps per side (CPU time of the step: at "
        "one thread the work, less the waits for the shared cores); 54 s in all, load average 0.9 "
        "at the start and 1.0 at the end (a shared machine)."
    )
    assert f"\n{header}\n" in _bench("report").read_section(lora.SECTION)
    assert "QLoRA" not in body and "| 0.05 | 163,840 | 0.05 | 2.00 GiB | 1.00 | 1.00 |" in body


def test_a_cuda_block_leaves_the_cpu_blocks_as_they_are(tmp_path, monkeypatch):
    report, lora = _bench("report"), _bench("lora")
    md, text = tmp_path / "BENCHMARKS.md", report.BENCHMARKS_MD.read_text()
    md.write_text(text)
    monkeypatch.setattr(report, "BENCHMARKS_MD", md)
    before = report.read_section(lora.SECTION)
    # as it stands (a --write puts the docstring's)
    intro = before.split("\n### ", 1)[0].split("\n\n", 1)[1]
    report.write_block(lora.SECTION, intro, "CUDA, bf16", "Command: `python ...`. GPU: H200.\n")
    after = report.read_section(lora.SECTION)
    assert after.startswith(
        before.rstrip("\n") + "\n\n### CUDA, bf16\n\nCommand: `python ...`. GPU: H200.\n"
    )
    # the other sections as they were
    assert md.read_text().replace(after, "") == text.replace(before, "")


@pytest.mark.slow
@pytest.mark.parametrize("extra", [[], ["--device", "cpu", "--precision", "bf16", "--qlora"]])
def test_the_quick_run_agrees_on_the_first_loss_and_prints_its_table(extra):
    r = subprocess.run(
        [sys.executable, str(BENCH / "lora.py"), "--quick", *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    logged = [line for line in r.stderr.splitlines() if line.startswith("round 1: ")]
    losses = {line.split()[2]: float(line.split()[5].rstrip(",")) for line in logged}
    assert set(losses) == {"peft", "lmforge", *(["lmforge-qlora"] if extra else [])}
    assert abs(losses["lmforge"] - losses["peft"]) <= (2e-2 if extra else 1e-4) * losses["peft"]
    table = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| side | step s (wall) |") and "| peak RSS |" in table[0]
    assert len(table) == 2 + len(losses)
    assert ("The QLoRA row" in r.stdout) == bool(extra)


@pytest.mark.slow
def test_a_side_process_runs_past_the_trainers_max_steps_and_reports_json(tmp_path):
    """The child alone, as the parent starts it: more timed steps than the Trainer's max_steps
    (its schedule is not the loop here), one JSON line with a time per step and the process's
    peak."""
    import transformers as tf

    lora = _bench("lora")
    folder = tmp_path / "hf"
    tf.GPTNeoXForCausalLM(
        tf.GPTNeoXConfig(**lora.SHAPES["quick"], bos_token_id=0, eos_token_id=0)
    ).save_pretrained(folder)
    lora.save_stand_in_tokenizer(folder, lora.SHAPES["quick"]["vocab_size"])
    args = _args(torch.device("cpu"), "fp32", batch=2, seq=16, steps=4)
    r = subprocess.run(
        lora.child_command(args, "lmforge", folder), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert (
        len(out["times"]) == len(out["cpu"]) == 4
        and out["peak"] > 2**20
        and math.isfinite(out["first_loss"])
    )
