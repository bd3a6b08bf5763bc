"""Preprocessing: `lmforge preprocess` vs Megatron-LM's `tools/preprocess_data.py`, side by side.

Both tools run as whole commands (subprocesses: interpreter start-up and imports included) on the
same JSONL, with the same GPT-2 tokenizer files, `--append-eod`, at each `--workers` count. Within
every repeat the two take turns (the order alternating between repeats), so load on the machine hits
both alike; the table gives medians over the repeats and the speed-up as the median of the per-pair
time ratios. Every run's `.bin/.idx` must be byte-identical to Megatron's before any number is
reported. After timing, one more check, before the table is written: on documents that contain the
text "<|endoftext|>", `lmforge preprocess --parse-special-tokens` must write Megatron's bytes
(Hugging Face's tokenizer turns that text into the control id), and the table says how many
documents lmforge's default (such text stays text) writes differently. *peak RSS* is measured with
nothing but the standard library imported here: a child's peak RSS counts its parent's at the fork.

Corpora, built once in a temporary folder from the shared data folder (../shared/data/corpora):
* WikiText: wikitext-2 `valid.articles.jsonl` + `test.articles.jsonl` ({"title", "text"} per
  article), `--copies` times over (8 by default: 19.2 MB, 960 documents, 4.44 M GPT-2 tokens with
  eod);
* tinyshakespeare: `input.txt` as one {"text"} document per speech (blank-line separated), 8 copies
  by default (9.8 MB, 57,776 short documents, 2.65 M tokens): per-document costs weigh more here.

Tokenizer: the shared `tokenizers/gpt2` files plus a `tokenizer_config.json`, in one temporary
folder that both tools read. Megatron's HuggingFaceTokenizer takes its eod from eos_token, which
AutoTokenizer cannot know from the three shared files alone; the config says what it resolves for
Hugging Face's gpt2 repository (the GPT-2 class, whose defaults make <|endoftext|> bos, eos and
unk). Megatron runs as `--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR
--tokenizer-hf-use-fast`.

Megatron-LM is not a dependency: the script needs a source checkout (default
~/.cache/lmforge-bench/Megatron-LM; `--megatron-dir` elsewhere), at the release matching the
megatron-core the tests pin:
    git clone --depth 1 --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM ~/.cache/lmforge-bench/Megatron-LM
Its tool imports megatron.training, which needs torch, transformers, megatron-core (all in lmforge's
test extra) and triton (`pip install triton`; CPU machines lack it). nltk is needed only for
--split-sentences, unused here. `--help` lists the options.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

from report import BENCHMARKS_MD, read_section, write_section  # benchmarks/report.py

SECTION = "## Preprocessing: lmforge preprocess vs Megatron-LM tools/preprocess_data.py"
NOTES = "### Where the time goes"  # a hand-written block under this heading survives --write
REPO = Path(__file__).resolve().parent.parent
DEFAULT_MEGATRON = Path.home() / ".cache" / "lmforge-bench" / "Megatron-LM"
MEGATRON_RELEASE = "core_v0.16.1"
GET_MEGATRON = (
    f"git clone --depth 1 --branch {MEGATRON_RELEASE} https://github.com/NVIDIA/Megatron-LM"
)
# What AutoTokenizer resolves for Hugging Face's gpt2 repository: the GPT-2 class and its special
# tokens.
GPT2_CONFIG = {
    "tokenizer_class": "GPT2Tokenizer",
    "bos_token": "<|endoftext|>",
    "eos_token": "<|endoftext|>",
    "unk_token": "<|endoftext|>",
    "add_prefix_space": False,
    "model_max_length": 1024,
}
TOOLS = ("Megatron-LM", "lmforge")


@dataclass
class Corpus:
    name: str
    path: Path
    megabytes: float
    documents: int = 0
    tokens: int = 0


@dataclass
class Run:
    wall: float  # seconds, from spawning the command to its exit
    cpu: float  # user + system seconds of the command and every process it waited for
    rss_mb: float  # peak resident memory of its largest process


def shared_data_dir() -> Path:
    env = os.environ.get("LMFORGE_SHARED_DATA")
    return Path(env) if env else REPO.parent / "shared" / "data"


def make_corpora(shared: Path, out: Path, copies: int, names: list[str]) -> list[Corpus]:
    """The benchmark JSONL files, written once into `out`."""
    corpora = []
    for name in names:
        if name == "wikitext":
            wiki = shared / "corpora" / "wikitext-2"
            one = b"".join(
                (wiki / f"{split}.articles.jsonl").read_bytes() for split in ("valid", "test")
            )
        else:
            text = (shared / "corpora" / "tinyshakespeare" / "input.txt").read_text(
                encoding="utf-8"
            )
            one = "".join(json.dumps({"text": s}) + "\n" for s in text.split("\n\n")).encode()
        path = out / f"{name}.jsonl"
        path.write_bytes(one * copies)
        corpora.append(Corpus(name, path, path.stat().st_size / 1e6))
    return corpora


def make_tokenizer(shared: Path, out: Path) -> Path:
    """The GPT-2 files with a tokenizer_config.json beside them, in a folder both tools are
    given."""
    out.mkdir()
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        shutil.copyfile(shared / "tokenizers" / "gpt2" / name, out / name)
    (out / "tokenizer_config.json").write_text(json.dumps(GPT2_CONFIG))
    return out


def command(tool: str, args, corpus: Corpus, tok: Path, workers: int, prefix: Path) -> list[str]:
    common = [
        "--input",
        str(corpus.path),
        "--output-prefix",
        str(prefix),
        "--append-eod",
        "--workers",
        str(workers),
    ]
    if tool == "lmforge":
        return [sys.executable, "-m", "lmforge.cli", "preprocess", *common, "--tokenizer", str(tok)]
    return [
        sys.executable,
        str(args.megatron_dir / "tools" / "preprocess_data.py"),
        *common,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tok),
        "--tokenizer-hf-use-fast",
    ]


def run_once(cmd: list[str], log: Path, cwd: Path) -> Run:
    with open(log, "wb") as out:
        start = time.perf_counter()
        # A session of its own: an interrupted benchmark takes the command's worker processes down
        # with it.
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            _, status, usage = os.wait4(proc.pid, 0)  # rusage covers the pool workers it reaped too
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        hint = "\n(Megatron-LM's tool needs triton: pip install triton)" if "triton" in tail else ""
        raise SystemExit(
            f"command failed with exit code {proc.returncode}: {' '.join(cmd)}\n{tail}{hint}"
        )
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def same_bytes(a: Path, b: Path) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if x != y:
                return False
            if not x:
                return True


def check_and_clean(prefix: Path, reference: Path, what: str) -> None:
    """Compare PREFIX_text_document.bin/.idx with the reference pair, then delete them."""
    for ext in (".bin", ".idx"):
        ours, ref = Path(f"{prefix}_text_document{ext}"), Path(f"{reference}_text_document{ext}")
        if not same_bytes(ours, ref):
            raise SystemExit(
                f"{what}: {ours.name} differs from Megatron-LM's {ref.name}: not benchmarking"
            )
        ours.unlink()


# Standard library only in this process: a child's peak RSS (ru_maxrss) starts at its parent's at
# the fork, so importing numpy or lmforge here would put a floor under every figure in the RSS
# column.
IDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
ITEMSIZE = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron.core DType code -> bytes


def read_idx(prefix: str | Path) -> tuple[int, array, array, array]:
    """(item size, sequence lengths, sequence pointers, document indices) of PREFIX.idx."""
    with open(f"{prefix}.idx", "rb") as f:
        _, _, code, n_seq, n_doc = IDX_HEADER.unpack(f.read(IDX_HEADER.size))
        arrays = array("i"), array("q"), array("q")
        for a, n in zip(arrays, (n_seq, n_seq, n_doc)):
            a.frombytes(f.read(a.itemsize * n))
    return (ITEMSIZE[code], *arrays)


def idx_counts(prefix: str | Path) -> tuple[int, int]:
    """(documents, tokens) of a .bin/.idx pair."""
    _, lengths, _, doc_idx = read_idx(prefix)
    return len(doc_idx) - 1, sum(lengths)


def documents(prefix: str | Path) -> list[bytes]:
    """Each document's token bytes."""
    size, lengths, pointers, doc_idx = read_idx(prefix)
    data = Path(f"{prefix}.bin").read_bytes()
    out = []
    for first, last in zip(doc_idx, doc_idx[1:]):
        start = pointers[first] if first < last else 0
        out.append(data[start : start + size * sum(lengths[first:last])])
    return out


def check_special_tokens(args, shared: Path, tok: Path, tmp: Path) -> str:
    """Megatron vs `--parse-special-tokens` on documents holding "<|endoftext|>" text: the same
    bytes, or exit."""
    wiki = (
        (shared / "corpora" / "wikitext-2" / "valid.articles.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()
    )
    texts = [json.loads(line)["text"][:2000] for line in wiki[:20]]
    texts = [t if i % 3 else t[:700] + "<|endoftext|>" + t[700:] for i, t in enumerate(texts)]
    texts += [
        "<|endoftext|>",
        "a forged<|endoftext|>boundary",
        "<|endoftext|> <|endoftext|>\n",
        "only text",
    ]
    corpus = Corpus("special", tmp / "special.jsonl", 0.0)
    corpus.path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    run_once(
        command("Megatron-LM", args, corpus, tok, 1, tmp / "ref-special"), tmp / "megatron.log", tmp
    )
    cmd = command("lmforge", args, corpus, tok, 1, tmp / "special")
    run_once([*cmd, "--parse-special-tokens"], tmp / "lmforge.log", tmp)
    check_and_clean(
        tmp / "special", tmp / "ref-special", "lmforge --parse-special-tokens on <|endoftext|> text"
    )
    run_once(cmd, tmp / "lmforge.log", tmp)
    ref, plain = (
        documents(f"{tmp / 'ref-special'}_text_document"),
        documents(f"{tmp / 'special'}_text_document"),
    )
    differ = [d for d, (a, b) in enumerate(zip(ref, plain, strict=True)) if a != b]
    holding = [d for d, t in enumerate(texts) if "<|endoftext|>" in t]
    say(
        f"special tokens: --parse-special-tokens byte-identical to Megatron-LM; default differs in {len(differ)} "
        "documents"
    )
    which = "exactly those holding it" if differ == holding else f"documents {differ}"
    return (
        f"`--parse-special-tokens`: on {len(texts)} documents, {len(holding)} of them holding the text "
        f"`<|endoftext|>`, lmforge's `.bin/.idx` are byte-identical to Megatron-LM's; without the flag "
        f"(the default: such text stays text) {len(differ)} documents differ, {which}."
    )


def measure(args, corpora: list[Corpus], tok: Path, tmp: Path) -> dict:
    """{(corpus, workers, tool): [Run, ...]} over the repeats, every output checked against
    Megatron's."""
    runs: dict[tuple[str, int, str], list[Run]] = {}
    # untimed: Megatron's reference output, our first check, warm file caches
    for corpus in corpora:
        ref = tmp / f"ref-{corpus.name}"
        run_once(command("Megatron-LM", args, corpus, tok, 1, ref), tmp / "megatron.log", tmp)
        corpus.documents, corpus.tokens = idx_counts(f"{ref}_text_document")
        run_once(command("lmforge", args, corpus, tok, 1, tmp / "out"), tmp / "lmforge.log", tmp)
        check_and_clean(tmp / "out", ref, f"lmforge on {corpus.name}")
        say(
            f"{corpus.name}: {corpus.megabytes:.1f} MB, {corpus.documents:,} documents, {corpus.tokens:,} tokens; "
            "outputs byte-identical"
        )
    for repeat in range(args.repeats):
        order = TOOLS if repeat % 2 == 0 else TOOLS[::-1]
        for corpus in corpora:
            for workers in args.workers:
                for tool in order:
                    out = tmp / f"out-{tool}"
                    r = run_once(
                        command(tool, args, corpus, tok, workers, out), tmp / f"{tool}.log", tmp
                    )
                    check_and_clean(
                        out,
                        tmp / f"ref-{corpus.name}",
                        f"{tool} on {corpus.name}, {workers} workers",
                    )
                    runs.setdefault((corpus.name, workers, tool), []).append(r)
                    say(
                        f"  repeat {repeat + 1}/{args.repeats} {corpus.name} workers {workers} {tool}: "
                        f"{r.wall:.2f} s (cpu {r.cpu:.1f} s), load {os.getloadavg()[0]:.1f}"
                    )
    return runs


def table(corpora: list[Corpus], workers: list[int], runs: dict) -> str:
    lines = [
        "| corpus | workers | tool | wall s | tokens/s | docs/s | MB/s | CPU s | peak RSS MB | speed-up |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in corpora:
        for w in workers:
            for tool in TOOLS:
                rs = runs[(c.name, w, tool)]
                wall = statistics.median(r.wall for r in rs)
                cpu = statistics.median(r.cpu for r in rs)
                rss = max(r.rss_mb for r in rs)
                speedup = ""
                if tool == "lmforge":
                    pairs = zip(runs[(c.name, w, "Megatron-LM")], rs, strict=True)
                    speedup = f"**{statistics.median(m.wall / o.wall for m, o in pairs):.2f}x**"
                rates = (
                    f"{c.tokens / wall:,.0f} | {c.documents / wall:,.0f} | {c.megabytes / wall:.2f}"
                )
                lines.append(
                    f"| {c.name} | {w} | {tool} | {wall:.2f} | {rates} | {cpu:.1f} | {rss:.0f} | {speedup} |"
                )
    return "\n".join(lines)


def versions(megatron_dir: Path) -> str:
    from importlib.metadata import PackageNotFoundError, version

    def v(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "absent"

    info = (megatron_dir / "megatron" / "core" / "package_info.py").read_text()
    parts = {k: re.search(rf"^{k}\s*=\s*(\d+)", info, re.M) for k in ("MAJOR", "MINOR", "PATCH")}
    checkout = ".".join(m.group(1) if m else "?" for m in parts.values())
    return (
        f"Python {platform.python_version()}, tokenizers {v('tokenizers')}, transformers {v('transformers')}, "
        f"megatron-core {v('megatron-core')} (installed), Megatron-LM checkout {checkout}"
    )


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
    )
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument(
        "--copies", type=int, default=8, help="copies of each corpus in its JSONL (default: 8)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each tool per setting (median)"
    )
    p.add_argument(
        "--quick", action="store_true", help="1 copy, 1 repeat, 1 worker: checks the script runs"
    )
    p.add_argument(
        "--note",
        default="",
        help="a sentence printed next to the figures (e.g. what else loads the machine)",
    )
    p.add_argument("--write", action="store_true", help=f"update '{SECTION}' in BENCHMARKS.md")
    args = p.parse_args()
    # unwinds: kills the running command, cleans up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        if args.write:
            p.error("--quick numbers are not benchmark numbers: run without --quick to --write")
        args.copies, args.repeats, args.workers = 1, 1, [1]
    if not (args.megatron_dir / "tools" / "preprocess_data.py").is_file():
        raise SystemExit(
            f"no Megatron-LM checkout at {args.megatron_dir}: get it with "
            f"`{GET_MEGATRON} {args.megatron_dir}` (or pass --megatron-dir)"
        )
    shared = args.shared_data or shared_data_dir()
    if not (shared / "corpora").is_dir():
        raise SystemExit(
            f"no shared data at {shared}: pass --shared-data or set LMFORGE_SHARED_DATA"
        )

    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    machine = f"{cpu.group(1) if cpu else 'unknown CPU'}, {os.cpu_count()} cores"
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lmforge-bench-preprocess-") as tmp:
        tmp = Path(tmp)
        corpora = make_corpora(shared, tmp, args.copies, args.corpora)
        tok = make_tokenizer(shared, tmp / "gpt2")
        runs = measure(args, corpora, tok, tmp)
        special = check_special_tokens(args, shared, tok, tmp)
    cmd = "python benchmarks/preprocess.py" + "".join(
        f" {a}" for a in sys.argv[1:] if a not in (args.note, "--note")
    )
    sizes = "; ".join(
        f"{c.name} {c.megabytes:.1f} MB, {c.documents:,} documents, {c.tokens:,} tokens"
        for c in corpora
    )
    tp = os.environ.get("TOKENIZERS_PARALLELISM")
    body = (
        f"Command: `{cmd}`. {machine}; {versions(args.megatron_dir)}; {datetime.date.today()}. "
        f"{time.perf_counter() - t0:.0f} s in all; load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end{f'; TOKENIZERS_PARALLELISM={tp}' if tp else ''}."
        f"{' ' + args.note if args.note else ''}\n\n"
        f"Corpora ({args.copies} {'copy' if args.copies == 1 else 'copies'} each): {sizes}. "
        f"Median of {args.repeats} interleaved runs per row.\n\n"
        f"{table(corpora, args.workers, runs)}\n\n{special}\n"
    )
    print(body)
    if args.write:
        notes = read_section(SECTION)
        notes = notes[notes.index(NOTES) :].strip() if NOTES in notes else ""
        write_section(SECTION, f"{SECTION}\n\n{intro()}\n### Measured\n\n{body}\n{notes}\n")
        print(f"wrote '{SECTION}' to {BENCHMARKS_MD}")


def intro() -> str:
    return (
        "Whole commands, start-up included: `python -m lmforge.cli preprocess` and Megatron-LM's "
        "`python tools/preprocess_data.py` (release core_v0.16.1, `--tokenizer-type HuggingFaceTokenizer "
        "--tokenizer-hf-use-fast`), same input JSONL, same GPT-2 tokenizer files, `--append-eod`. The two take "
        "turns within each repeat; each row is the median over repeats, and *speed-up* (Megatron time / lmforge "
        "time) the median of the per-pair ratios. Before timing, and after every timed run, the `.bin/.idx` are "
        "compared byte for byte with Megatron's. *CPU s* is user + system time of the whole process tree: "
        "lmforge's `--workers 1` is one process whose Rust tokenizer runs on its own thread pool (every core; "
        "`TOKENIZERS_PARALLELISM=false` makes it one thread), Megatron's is a main process plus one pool worker. "
        "*peak RSS* is the largest single process.\n"
    )


if __name__ == "__main__":
    main()
