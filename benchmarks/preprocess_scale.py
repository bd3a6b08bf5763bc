"""Preprocessing at scale: input formats, shards on N processes, memory; lmforge and Megatron-LM
side by side.

On the corpora and GPT-2 tokenizer folder of benchmarks/preprocess.py (its builders are reused),
whole commands as subprocesses, every output compared byte for byte with Megatron-LM's output for
the same documents:

* formats: the same documents as JSONL, JSONL.zst, Parquet (row groups of 250 documents, snappy, no
  dictionary) and a Hugging Face `datasets` folder (save_to_disk), each read by `lmforge preprocess
  --workers 1`; Megatron-LM's tool (JSONL only) on the JSONL, `--workers 1`, in the same repeat.
* shards: the WikiText corpus over N = 1..cores processes on N cores (taskset: with --workers 1
  lmforge keeps two tokenizer calls in flight, which would otherwise spread one process over two
  cores). lmforge: N `lmforge preprocess --shard I/N` processes started together, shard I on core I
  (TOKENIZERS_PARALLELISM=false), then `lmforge data merge`. Megatron-LM's own way to spread one
  machine's work over N processes: `--partitions N --workers N --keep-sequential-samples` (split the
  JSONL into N files, one process and one pool worker each, merge) on cores 0..N-1; at N = 1 its
  plain `--workers 1` on core 0. Scaling = the N = 1 wall time / the N wall time, merge included.
* memory: lmforge's peak resident memory (largest process) on the WikiText corpus at `--copies` and
  at four times that, JSONL and Parquet, and of the merge: bounded means the same at both sizes.

Needs pyarrow, zstandard and datasets (`pip install -e .[test]`) besides what
benchmarks/preprocess.py needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preprocess import (  # benchmarks/preprocess.py
    DEFAULT_MEGATRON,
    GET_MEGATRON,
    Corpus,
    Run,
    check_and_clean,
    command,
    idx_counts,
    make_corpora,
    make_tokenizer,
    run_once,
    say,
    shared_data_dir,
    versions,
)
from report import BENCHMARKS_MD, write_section  # benchmarks/report.py

SECTION = "## Preprocessing at scale: input formats, shards on N processes, memory (lmforge vs Megatron-LM)"
FORMATS = ("jsonl", "jsonl.zst", "parquet", "datasets")
# documents: the 1x WikiText file already spans 4 row groups, so memory is seen past the first
ROW_GROUP = 250


def format_paths(corpus: Corpus, out: Path) -> dict[str, Path]:
    return {
        "jsonl": corpus.path,
        "jsonl.zst": out / f"{corpus.name}.jsonl.zst",
        "parquet": out / f"{corpus.name}.parquet",
        "datasets": out / f"{corpus.name}-datasets",
    }


def convert(jsonl: Path, zst: Path, parquet: Path, folder: Path) -> None:
    """JSONL -> zstd JSONL, Parquet, a datasets folder. Run in a child process (see
    write_formats)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    raw = jsonl.read_bytes()
    zst.write_bytes(zstandard.ZstdCompressor(level=3).compress(raw))
    table = pa.Table.from_pylist([json.loads(line) for line in raw.splitlines()])
    # No dictionary encoding: the corpus is copies of one text, which a dictionary would shrink to
    # one copy; real corpora's documents are distinct.
    pq.write_table(table, parquet, row_group_size=ROW_GROUP, use_dictionary=False)
    datasets.disable_progress_bars()
    datasets.Dataset(table).save_to_disk(str(folder))


def write_formats(corpus: Corpus, out: Path) -> dict[str, Path]:
    """The corpus's documents in every format. Converted in a child: pyarrow and datasets loaded
    here would put a floor under every later child's peak RSS (ru_maxrss starts at the parent's
    at the fork)."""
    paths = format_paths(corpus, out)
    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import preprocess_scale as p; "
        f"p.convert(*map(p.Path, sys.argv[1:]))"
    )
    subprocess.run([sys.executable, "-c", code, *map(str, paths.values())], check=True)
    return paths


def lmforge_cmd(path: Path, tok: Path, prefix: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lmforge.cli",
        "preprocess",
        "--input",
        str(path),
        "--output-prefix",
        str(prefix),
        "--tokenizer",
        str(tok),
        "--append-eod",
        "--no-progress",
        *extra,
    ]


def run_together(cmds: list[list[str]], tmp: Path, env: dict) -> Run:
    """Start every command at once; wall until the last exits, CPU summed, RSS of the largest
    process."""
    start, procs = time.perf_counter(), []
    try:
        for i, cmd in enumerate(cmds):
            with open(tmp / f"together-{i}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        cmd,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=tmp,
                        env=env,
                        start_new_session=True,
                    )
                )
        cpu, rss = 0.0, 0.0
        for i, proc in enumerate(procs):
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            if proc.returncode:
                tail = (tmp / f"together-{i}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(
                    f"command failed with exit code {proc.returncode}: {' '.join(cmds[i])}\n{tail}"
                )
            cpu += usage.ru_utime + usage.ru_stime
            rss = max(rss, usage.ru_maxrss / 1024)
    except BaseException:
        for proc in procs:
            if proc.returncode is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        raise
    return Run(time.perf_counter() - start, cpu, rss)


def pinned(cores: str, cmd: list[str]) -> list[str]:
    """`cmd` on those cores only (taskset): a process's threads cannot spread past the cores it
    is counted for."""
    return ["taskset", "-c", cores, *cmd]


def megatron_partitions(args, corpus: Corpus, tok: Path, n: int, tmp: Path) -> Run:
    """Megatron-LM --partitions N on a private copy of the JSONL (it writes its partition files
    beside it)."""
    work = tmp / "partitions"
    work.mkdir(exist_ok=True)
    path = work / corpus.path.name
    if not path.exists():
        os.link(corpus.path, path)
    cmd = command("Megatron-LM", args, dataclasses.replace(corpus, path=path), tok, n, work / "out")
    run = run_once(
        pinned(f"0-{n - 1}", [*cmd, "--partitions", str(n), "--keep-sequential-samples"]),
        tmp / "megatron.log",
        tmp,
    )
    # partition inputs and outputs: it would reuse them next time
    for stale in work.glob("*_[0-9]*"):
        stale.unlink()
    check_and_clean(work / "out", tmp / f"ref-{corpus.name}", f"Megatron-LM --partitions {n}")
    return run


def measure(args, corpora: list[Corpus], tok: Path, tmp: Path) -> tuple[dict, dict, dict]:
    inputs = {}
    # untimed: Megatron's reference output, each format's first check, warm caches
    for corpus in corpora:
        ref = tmp / f"ref-{corpus.name}"
        run_once(command("Megatron-LM", args, corpus, tok, 1, ref), tmp / "megatron.log", tmp)
        corpus.documents, corpus.tokens = idx_counts(f"{ref}_text_document")
        inputs[corpus.name] = write_formats(corpus, tmp)
        for fmt, path in inputs[corpus.name].items():
            run_once(lmforge_cmd(path, tok, tmp / "out"), tmp / "lmforge.log", tmp)
            check_and_clean(tmp / "out", ref, f"lmforge on {corpus.name} {fmt}")
        say(
            f"{corpus.name}: {corpus.documents:,} documents, {corpus.tokens:,} tokens; every format byte-identical"
        )
    wiki = corpora[0]
    one_thread = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    formats: dict[tuple[str, str], list[Run]] = {}
    shards: dict[tuple[int, str], list[tuple[Run, Run | None]]] = {}
    for repeat in range(args.repeats):
        for corpus in corpora:
            order = ["Megatron-LM", *FORMATS]
            for what in order if repeat % 2 == 0 else order[::-1]:
                if what == "Megatron-LM":
                    r = run_once(
                        command(what, args, corpus, tok, 1, tmp / "out"), tmp / "megatron.log", tmp
                    )
                else:
                    r = run_once(
                        lmforge_cmd(inputs[corpus.name][what], tok, tmp / "out"),
                        tmp / "lmforge.log",
                        tmp,
                    )
                check_and_clean(tmp / "out", tmp / f"ref-{corpus.name}", f"{what} on {corpus.name}")
                formats.setdefault((corpus.name, what), []).append(r)
                say(
                    f"  repeat {repeat + 1} {corpus.name} {what}: {r.wall:.2f} s, load {os.getloadavg()[0]:.1f}"
                )
        for n in args.shards:
            for tool in (
                ("lmforge", "Megatron-LM") if repeat % 2 == 0 else ("Megatron-LM", "lmforge")
            ):
                merge = None
                if tool == "Megatron-LM" and n > 1:
                    r = megatron_partitions(args, wiki, tok, n, tmp)
                elif tool == "Megatron-LM":
                    r = run_once(
                        pinned("0", command(tool, args, wiki, tok, 1, tmp / "out")),
                        tmp / "megatron.log",
                        tmp,
                    )
                    check_and_clean(tmp / "out", tmp / f"ref-{wiki.name}", "Megatron-LM")
                elif n == 1:
                    r = run_together(
                        [pinned("0", lmforge_cmd(wiki.path, tok, tmp / "out"))], tmp, one_thread
                    )
                    check_and_clean(tmp / "out", tmp / f"ref-{wiki.name}", "lmforge, one thread")
                else:
                    r = run_together(
                        [
                            pinned(
                                str(i),
                                lmforge_cmd(wiki.path, tok, tmp / "sh", "--shard", f"{i}/{n}"),
                            )
                            for i in range(n)
                        ],
                        tmp,
                        one_thread,
                    )
                    merge = run_once(
                        [sys.executable, "-m", "lmforge.cli", "data", "merge", str(tmp / "sh")],
                        tmp / "merge.log",
                        tmp,
                    )
                    check_and_clean(
                        tmp / "sh", tmp / f"ref-{wiki.name}", f"lmforge {n} shards merged"
                    )
                    for stale in tmp.glob("sh_text_document.shard-*"):
                        stale.unlink()
                shards.setdefault((n, tool), []).append((r, merge))
                total = r.wall + (merge.wall if merge else 0)
                say(
                    f"  repeat {repeat + 1} {n} processes {tool}: {total:.2f} s, load {os.getloadavg()[0]:.1f}"
                )
    memory = {}
    big = (
        make_corpora(args.shared, tmp / "big", args.copies * 4, ["wikitext"])[0]
        if args.memory
        else None
    )
    if big:
        big_inputs = write_formats(big, tmp / "big")
        for fmt in ("jsonl", "parquet"):
            r = run_once(
                lmforge_cmd(big_inputs[fmt], tok, tmp / f"big-{fmt}"), tmp / "lmforge.log", tmp
            )
            if idx_counts(f"{tmp / f'big-{fmt}'}_text_document") != (
                4 * wiki.documents,
                4 * wiki.tokens,
            ):
                raise SystemExit(f"lmforge on 4x wikitext {fmt}: not 4x the documents and tokens")
            memory[fmt] = (big, r)
            say(f"  4x wikitext {fmt}: {r.wall:.1f} s, peak RSS {r.rss_mb:.0f} MB")
        same = [
            Path(f"{tmp / 'big-jsonl'}_text_document{e}").read_bytes()
            == Path(f"{tmp / 'big-parquet'}_text_document{e}").read_bytes()
            for e in (".bin", ".idx")
        ]
        if not all(same):
            raise SystemExit("lmforge on 4x wikitext: Parquet and JSONL outputs differ")
    return formats, shards, memory


def median(runs: list[Run], attr: str = "wall") -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def formats_table(corpora: list[Corpus], formats: dict) -> str:
    lines = [
        "| corpus | input | tool | wall s | tokens/s | CPU s | peak RSS MB | vs lmforge JSONL | vs Megatron-LM |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in corpora:
        megatron, jsonl = formats[(c.name, "Megatron-LM")], formats[(c.name, "jsonl")]
        for what in ("Megatron-LM", *FORMATS):
            rs = formats[(c.name, what)]
            wall = median(rs)
            ratio = (
                ""
                if what == "Megatron-LM"
                else (
                    f"{statistics.median(j.wall / r.wall for j, r in zip(jsonl, rs)):.2f}x | "
                    f"**{statistics.median(m.wall / r.wall for m, r in zip(megatron, rs)):.2f}x**"
                )
            )
            tool, fmt = (what, "JSONL") if what == "Megatron-LM" else ("lmforge", what)
            lines.append(
                f"| {c.name} | {fmt} | {tool} | {wall:.2f} | {c.tokens / wall:,.0f} | {median(rs, 'cpu'):.1f} "
                f"| {max(r.rss_mb for r in rs):.0f} | {ratio or ' | '} |"
            )
    return "\n".join(lines)


def shards_table(wiki: Corpus, shards: dict, counts: list[int]) -> str:
    lines = [
        "| processes | tool | how | tokenize s | merge s | total s | tokens/s | CPU s | peak RSS MB | scaling |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for tool in ("lmforge", "Megatron-LM"):
        base = [r.wall + (m.wall if m else 0) for r, m in shards[(counts[0], tool)]]
        for n in counts:
            pairs = shards[(n, tool)]
            tok_s = statistics.median(r.wall for r, _ in pairs)
            merges = [m.wall for _, m in pairs if m]
            totals = [r.wall + (m.wall if m else 0) for r, m in pairs]
            total = statistics.median(totals)
            how = (
                ("one process, core 0" if n == 1 else f"{n} x `--shard I/{n}` + `data merge`")
                if tool == "lmforge"
                else ("`--workers 1`" if n == 1 else f"`--partitions {n} --workers {n}`")
            )
            scaling = statistics.median(b / t for b, t in zip(base, totals))
            lines.append(
                f"| {n} | {tool} | {how} | {tok_s:.2f} | {statistics.median(merges) if merges else 0:.2f} | "
                f"{total:.2f} | {wiki.tokens / total:,.0f} | {statistics.median(r.cpu for r, _ in pairs):.1f} "
                f"| {max(r.rss_mb for r, _ in pairs):.0f} | **{scaling:.2f}x** |"
            )
    return "\n".join(lines)


def memory_table(wiki: Corpus, formats: dict, shards: dict, memory: dict, counts: list[int]) -> str:
    lines = [
        "| input | corpus | documents | tokens | lmforge peak RSS MB |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for fmt in ("jsonl", "parquet"):
        rows = [(wiki, max(r.rss_mb for r in formats[(wiki.name, fmt)]))]
        if fmt in memory:
            big, r = memory[fmt]
            rows.append((big, r.rss_mb))
        for c, rss in rows:
            lines.append(
                f"| {fmt} | {c.megabytes:.0f} MB | {c.documents or 4 * wiki.documents:,} | "
                f"{c.tokens or 4 * wiki.tokens:,} | {rss:.0f} |"
            )
    merges = [m.rss_mb for n in counts for _, m in shards[(n, "lmforge")] if m]
    if merges:
        lines.append(
            f"| `data merge` of {counts[-1]} shards | {wiki.megabytes:.0f} MB | {wiki.documents:,} | "
            f"{wiki.tokens:,} | {max(merges):.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--megatron-dir",
        type=Path,
        default=DEFAULT_MEGATRON,
        help=f"a Megatron-LM source checkout (default: {DEFAULT_MEGATRON})",
    )
    p.add_argument(
        "--shared-data",
        type=Path,
        default=None,
        help="the shared data folder (default: $LMFORGE_SHARED_DATA or ../shared/data)",
    )
    p.add_argument(
        "--corpora",
        nargs="+",
        choices=["wikitext", "tinyshakespeare"],
        default=["wikitext", "tinyshakespeare"],
        help="the first one is also sharded",
    )
    p.add_argument(
        "--shards",
        type=int,
        nargs="+",
        default=None,
        help="process counts to shard over (default: 1 to the number of cores)",
    )
    p.add_argument("--copies", type=int, default=8, help="copies of each corpus (default: 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setting (median)")
    p.add_argument(
        "--no-memory", dest="memory", action="store_false", help="skip the 4x-corpus memory runs"
    )
    p.add_argument(
        "--note",
        default="",
        help="a sentence to print next to the figures (e.g. who else loads the machine)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="1 copy, 1 repeat, no memory runs: checks the script runs",
    )
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.copies, args.repeats, args.memory = 1, 1, False
    args.shards = args.shards or list(range(1, (os.cpu_count() or 1) + 1))
    if args.shards[0] != 1:
        p.error("--shards must start at 1: scaling is measured against one process")
    if not (args.megatron_dir / "tools" / "preprocess_data.py").is_file():
        raise SystemExit(
            f"no Megatron-LM checkout at {args.megatron_dir}: get it with "
            f"`{GET_MEGATRON} {args.megatron_dir}` (or pass --megatron-dir)"
        )
    args.shared = args.shared_data or shared_data_dir()
    if not (args.shared / "corpora").is_dir():
        raise SystemExit(
            f"no shared data at {args.shared}: pass --shared-data or set LMFORGE_SHARED_DATA"
        )

    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    machine = f"{cpu.group(1) if cpu else 'unknown CPU'}, {os.cpu_count()} cores"
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-preprocess-scale-") as tmp:
        tmp = Path(tmp)
        (tmp / "big").mkdir()
        corpora = make_corpora(args.shared, tmp, args.copies, args.corpora)
        tok = make_tokenizer(args.shared, tmp / "gpt2")
        formats, shards, memory = measure(args, corpora, tok, tmp)
    from importlib.metadata import version

    shown = [a for a in sys.argv[1:] if a not in (args.note, "--note")]
    cmd = "python benchmarks/preprocess_scale.py" + "".join(f" {a}" for a in shown)
    sizes = "; ".join(
        f"{c.name} {c.megabytes:.1f} MB, {c.documents:,} documents, {c.tokens:,} tokens"
        for c in corpora
    )
    wiki = corpora[0]
    body = (
        f"Command: `{cmd}`. {machine}; {versions(args.megatron_dir)}, pyarrow {version('pyarrow')}; "
        f"{datetime.date.today()}. {time.perf_counter() - t0:.0f} s in all; load average {load_before:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end.{' ' + args.note if args.note else ''}\n\n"
        f"Corpora ({args.copies} copies each): {sizes}. Median of {args.repeats} interleaved runs per row; ratios "
        "are medians of per-repeat ratios.\n\n"
        f"**Input formats** (`--workers 1`; lmforge tokenizes on the tokenizer's own threads, every core):\n\n"
        f"{formats_table(corpora, formats)}\n\n"
        f"**Shards on N processes** ({wiki.name}; N processes pinned to N cores: lmforge's shard I on core I with "
        f"TOKENIZERS_PARALLELISM=false, Megatron-LM's partitions on cores 0..N-1):\n\n"
        f"{shards_table(wiki, shards, args.shards)}\n\n"
        f"**Memory** (peak resident memory of the largest process; `--workers 1`):\n\n"
        f"{memory_table(wiki, formats, shards, memory, args.shards)}\n"
    )
    print(body)
    if args.write:
        write_section(SECTION, f"{SECTION}\n\n{intro()}\n### Measured\n\n{body}")
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


def intro() -> str:
    return (
        "`python benchmarks/preprocess_scale.py` (or `lmforge bench preprocess_scale`): whole commands on the "
        "corpora and tokenizer of the section above, every output compared byte for byte with Megatron-LM's for "
        "the same documents before its time counts. *Input formats*: the same documents as JSONL, zstd JSONL, "
        f"Parquet (row groups of {ROW_GROUP:,} documents, snappy, no dictionary) and a `datasets` save_to_disk "
        "folder, read by "
        "`lmforge preprocess`; Megatron-LM's tool reads JSONL only. *Shards*: N processes started together, pinned "
        "to one core each (taskset), then the merge; Megatron-LM's equivalent on one machine is `--partitions N` with "
        "`--keep-sequential-samples` (its default deals lines round-robin, which reorders the documents). "
        "*Scaling* is the 1-process time over the N-process time. *Memory*: lmforge's peak RSS at the corpus size "
        "and four times it.\n"
    )


if __name__ == "__main__":
    main()
