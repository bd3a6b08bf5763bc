"""BENCHMARKS.md sections: each benchmark owns one `## ` section and rewrites only that."""

from __future__ import annotations

import re
from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nMeasured by the scripts in `benchmarks/`, each comparison side by side in one run.\n"


def _locate(text: str, heading: str) -> tuple[int, int]:
    """[start, end) of the section headed `heading`, or (-1, -1)."""
    start = text.find(heading)
    if start < 0:
        return -1, -1
    end = text.find("\n## ", start + len(heading))
    return start, len(text) if end < 0 else end + 1


def read_section(heading: str) -> str:
    """The section's text (heading included), or '' when BENCHMARKS.md has none yet."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else ""
    start, end = _locate(text, heading)
    return text[start:end] if start >= 0 else ""


def write_section(heading: str, section: str) -> None:
    """Replace the section headed `heading` by `section` (or append it); leave the rest alone."""
    text = BENCHMARKS_MD.read_text() if BENCHMARKS_MD.exists() else HEADER
    start, end = _locate(text, heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n"
        start = end = len(text)
    rest = text[end:].lstrip("\n")
    tmp = BENCHMARKS_MD.with_suffix(".md.tmp")  # a killed run never leaves a torn BENCHMARKS.md
    tmp.write_text(text[:start] + section.strip() + "\n" + (f"\n{rest}" if rest else ""))
    tmp.replace(BENCHMARKS_MD)


def publish(heading: str, body: str, write: bool) -> None:
    """Print a benchmark's section body; with --write also put it in BENCHMARKS.md under
    `heading`."""
    print(body)
    if write:
        write_section(heading, f"{heading}\n\n{body}")
        print(f"wrote '{heading}' to {BENCHMARKS_MD}")


def accelerator_description(device) -> str:
    """What a benchmark ran on when it is not the CPU: 'NVIDIA H100 80GB HBM3 (79.1 GiB, CUDA
    13.0)'."""
    import torch

    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
        return f"{torch.cuda.get_device_name(device)} ({memory / 2**30:.1f} GiB, CUDA {torch.version.cuda})"
    return f"{device.type} accelerator"


def write_block(heading: str, intro: str, label: str, body: str) -> None:
    """In the section `heading` (intro first), replace the `### label` block by `body`; keep the
    other ### blocks (other devices' runs, hand-written notes) in their order."""
    parts = re.split(r"^### (.+)\n", read_section(heading), flags=re.M)
    blocks = dict(zip(parts[1::2], (p.strip() for p in parts[2::2]), strict=True))
    blocks[label] = body.strip()
    text = "".join(f"### {k}\n\n{v}\n\n" for k, v in blocks.items())
    write_section(heading, f"{heading}\n\n{intro.strip()}\n\n{text}")


def cpu_run_line(script: str) -> str:
    """'Command: `python benchmarks/X.py ARGS`. AMD EPYC, 2 threads, fp32, torch 2.13.0+cpu,
    YYYY-MM-DD': how a CPU fp32 benchmark section starts."""
    import datetime
    import re
    import sys

    import torch

    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    command = " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])
    return (
        f"Command: `{command}`. {cpu.group(1) if cpu else 'CPU'}, {torch.get_num_threads()} threads, fp32, "
        f"torch {torch.__version__}, {datetime.date.today()}"
    )
