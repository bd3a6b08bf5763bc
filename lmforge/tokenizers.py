"""One `Tokenizer` interface over the tokenizer files that checkpoints ship with.

Three kinds of file are read:

* a Hugging Face `tokenizer.json` (GPT-NeoX/Pythia's `20B_tokenizer.json`, GPT-2, ...), run by
  `tokenizers`;
* OpenAI's GPT-2 `vocab.json` + `merges.txt` (byte-level BPE), also run by `tokenizers`;
* a SentencePiece `.model` (Llama 2), run by `sentencepiece`, so ids are exactly Meta's.

`encode` treats its input as plain text: a literal "<|endoftext|>" or "<s>" inside a document is
tokenized as characters, never turned into a control id. Control ids are added by id (`add_bos`,
Megatron's `append_eod`), so text scraped from the web cannot forge document boundaries. Hugging
Face tokenizers parse such strings by default; `split_special_tokens=True` there gives our ids.
Setting `parse_special_tokens = True` gives theirs (and Megatron's preprocessing tool's); a
SentencePiece model then encodes as the tokenizer.json of its export does (sentencepiece itself
never parses its control pieces in text).

Where the files say nothing about bos, `HFTokenizer` adds it as AutoTokenizer does, by what the
post-processor adds: a template that prepends bos (Llama 3) shows in the encoding of an empty text;
one that does not (transformers 5 writes "single": "$A" for every tokenizer it saves), GPT-2's
ByteLevel one or none at all add no bos. Batches are encoded with `encode_batch_fast` where the
installed `tokenizers` has it (older releases: `encode_batch`): the same ids without tracking
character offsets, which lmforge never reads, for about a quarter less CPU time on GPT-2 BPE.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path

import sentencepiece as spm
import tokenizers as hf
from tokenizers import decoders, models, pre_tokenizers

from lmforge.errors import UserError
from lmforge.fsutil import folder_file
from lmforge.tokenizer_specials import declared_special_tokens

logger = logging.getLogger(__name__)

# Files Hugging Face keeps next to a tokenizer: they name bos/eos/pad and travel with it on export.
CONFIG_FILES = ("special_tokens_map.json", "tokenizer_config.json")
_SAID: set[Path] = set()  # tokenizer files whose loading was logged at INFO
# GPT-NeoX's own HFTokenizer takes "<|padding|>" as pad; the other two are the BERT/T5-era names.
PAD_TOKENS = ("<|padding|>", "<pad>", "[PAD]")
ENDOFTEXT = "<|endoftext|>"
KINDS_HINT = "give a tokenizer.json, vocab.json + merges.txt, a SentencePiece .model, or a folder holding one"


class Tokenizer(ABC):
    """Text <-> ids, plus the special ids that data pipelines and models need."""

    vocab_size: int  # ids the tokenizer can produce, added/special tokens included
    eod_id: int | None = None  # appended after each document (Megatron's append_eod)
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    files: list[Path]
    parse_special_tokens: bool = False  # see the module docstring
    # What the files themselves say about bos (tokenizer_config.json's add_bos_token, a
    # tokenizer.json template that prepends it); None when they say nothing. Read by add_bos_token.
    _declared_add_bos: bool | None = None

    @contextlib.contextmanager
    def reading_special_tokens(self):
        """Inside, special-token text becomes those tokens, as a Hugging Face tokenizer reads it
        by default: for a whole model input its caller controls (an eval task, a raw completions
        prompt), never for a chat turn."""
        parsing = self.parse_special_tokens
        self.parse_special_tokens = True
        try:
            yield self
        finally:
            self.parse_special_tokens = parsing

    @property
    def add_bos_token(self) -> bool:
        """Whether the texts this tokenizer's models read start with bos: prompts (generate, serve,
        the chat fallback) and fine-tuning examples get one exactly when this is True. transformers'
        name and rule:

        * the files decide when they say: tokenizer_config.json's "add_bos_token" (Llama 2's
          published folders say true), else a tokenizer.json's post-processor, as in AutoTokenizer
          (transformers 5 reads no add_bos_token beside a tokenizer.json): a template that prepends
          bos (Llama 3's "<|begin_of_text|> $A") says yes; one that does not (transformers 5's
          re-saved "$A"), GPT-2's ByteLevel or none say no;
        * files that say nothing (a bare SentencePiece .model, GPT-2's vocab.json + merges.txt): bos
          is added when it is a control token of its own, distinct from the end-of-document token.
          Llama 2's <s> is; GPT-2 and GPT-NeoX/Pythia have only <|endoftext|> for bos, eos and eod,
          and their prompts start without it, as with AutoTokenizer. Comparing with eod, not eos,
          matters where the two differ: Qwen's chat tokenizers name <|im_end|> eos, and their
          <|endoftext|> is no bos to prepend.
        """
        if self.bos_id is None:
            return False
        if self._declared_add_bos is not None:
            return self._declared_add_bos
        return self.bos_id != self.eod_id

    @property
    def padding_id(self) -> int:
        """The id batches are right-padded with: pad, else eos (GPT-2 and Llama 2 have no pad),
        else 0."""
        return (
            self.pad_id
            if self.pad_id is not None
            else self.eos_id
            if self.eos_id is not None
            else 0
        )

    def model_special_ids(self, declared: dict, classifier: bool = False) -> dict:
        """bos_token_id, eos_token_id and pad_token_id for a model that reads this tokenizer's
        ids, from those a config `declared` (a preset's are its own tokenizer's: Pythia's eos 0
        is "!" to GPT-2's vocabulary).

        The tokenizer's id wins; a declared id stays where the tokenizer names none and it is a
        special token of this tokenizer (Llama 3's bos from a tokenizer.json that does not say),
        and declared eos ids that are special tokens stay beside the tokenizer's (Llama 3
        Instruct's <|eot_id|> and <|end_of_text|>). A classifier always gets a pad id, the one
        its batches are padded with: transformers' decoder classifiers find each row's last token
        by it, and without one refuse a batch of two."""
        ids = {}
        for key, own in (("bos", self.bos_id), ("eos", self.eos_id), ("pad", self.pad_id)):
            value = declared.get(f"{key}_token_id")
            listed = value if isinstance(value, list) else [] if value is None else [value]
            special = bool(listed) and all(self.is_special(i) for i in listed)
            if own is None:
                ids[key] = value if special else None
            elif own in listed:
                ids[key] = value
            elif key == "eos" and special:
                # an eos the config names stops generation as well as the
                # tokenizer's
                ids[key] = [*listed, own]
            else:
                ids[key] = own
        if classifier and ids["pad"] is None:
            ids["pad"] = self.padding_id
        return {f"{key}_token_id": value for key, value in ids.items()}

    def is_special(self, i: int) -> bool:
        """Whether id `i` is one of this tokenizer's control tokens (never text)."""
        return False

    @property
    def special_tokens(self) -> dict[str, int]:
        """Every control token by its text, each one id to transformers' tokenizer(text): a
        tokenizer.json's added tokens flagged special; a SentencePiece model's control and
        unknown pieces (its export's tokenizer.json's)."""
        return {}

    @abstractmethod
    def _encode(self, text: str) -> list[int]: ...

    @abstractmethod
    def _encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_batch_offsets(
        self, texts: list[str], continued: Sequence[bool] | None = None
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text's ids and, per id, the characters [start, end) of the text it covers (no
        bos). `continued[i]`: text i follows a special token in the same input (a chat's run
        after "<s>"), which a tokenizer that puts a prefix space only at the start of an input
        (Metaspace's prepend_scheme "first") does not give one. This generic way decodes each
        prefix of the ids (quadratic); the tokenizers lmforge loads override it."""
        out = []
        for ids in self._encode_batch(list(texts)):
            ends = [len(self.decode(ids[: k + 1])) for k in range(len(ids))]
            out.append((ids, list(zip([0, *ends[:-1]], ends))))
        return out

    @abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    @abstractmethod
    def id_to_token(self, i: int) -> str | None: ...

    @abstractmethod
    def token_to_id(self, tok: str) -> int | None: ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return [*self._bos(add_bos), *self._encode(text)]

    def encode_batch(self, texts: list[str], add_bos: bool = False) -> list[list[int]]:
        bos = self._bos(add_bos)
        return [[*bos, *ids] for ids in self._encode_batch(list(texts))]

    def _bos(self, add_bos: bool) -> list[int]:
        if add_bos and self.bos_id is None:
            raise UserError(f"tokenizer {self.files[0]} has no bos token: turn add_bos off for it")
        return [self.bos_id] if add_bos else []

    def save(self, out_dir: Path) -> None:
        """Copy the source files (and HF's config files beside them) into `out_dir`, keeping
        names."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        # The chat template travels with the tokenizer: a fine-tuned model is then prompted as it
        # was trained.
        extras = [
            folder_file(f.parent, name)
            for f in self.files
            for name in (*CONFIG_FILES, "chat_template.jinja")
            if (f.parent / name).is_file()
        ]
        for src in dict.fromkeys(self.files + extras):
            dst = out_dir / src.name
            if not (dst.exists() and dst.samefile(src)):
                shutil.copyfile(src, dst)
        logger.debug("saved tokenizer files %s to %s", [f.name for f in self.files], out_dir)

    def _set_special_ids(self) -> None:
        """Let HF config files beside the tokenizer decide bos/eos/pad, a null there meaning
        none, as transformers reads them (lmforge.tokenizer_specials); then pick eod."""
        declared, self._declared_add_bos = declared_special_tokens(self.files[0].parent)
        for key, text in declared.items():
            if text is None or (i := self.token_to_id(text)) is not None:
                setattr(self, f"{key}_id", None if text is None else i)
        # GPT-2 and NeoX separate documents with <|endoftext|>; Llama with eos </s>.
        endoftext = self.token_to_id(ENDOFTEXT)
        self.eod_id = endoftext if endoftext is not None else self.eos_id

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.files[0].name}, vocab_size={self.vocab_size}, eod={self.eod_id}, "
            f"bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id})"
        )


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer`: from tokenizer.json, or GPT-2's vocab.json + merges.txt."""

    def __init__(self, tok: hf.Tokenizer, files: list[Path]):
        tok.encode_special_tokens = True  # plain text in, see the module docstring
        self._tok = tok
        self.files = files
        # max id + 1 rather than a count: an embedding needs a row for every id, holes included.
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        # Guesses, for files that say nothing: the config files' bos/eos/pad (nulls too) win in
        # _set_special_ids.
        self.eos_id = self._first_id(ENDOFTEXT, "</s>")
        self.bos_id = self._first_id(ENDOFTEXT, "<s>")
        self.pad_id = self._first_id(*PAD_TOKENS)
        self._set_special_ids()
        if self._declared_add_bos is None and self.bos_id is not None:
            # As AutoTokenizer: bos when the post-processor adds it to an empty text (Llama 3's
            # template); transformers 5's "single": "$A", GPT-2's ByteLevel or none add no bos.
            self._declared_add_bos = tok.encode("", add_special_tokens=True).ids[:1] == [
                self.bos_id
            ]

    @property
    def parse_special_tokens(self) -> bool:
        return not self._tok.encode_special_tokens

    @parse_special_tokens.setter
    def parse_special_tokens(self, value: bool) -> None:
        self._tok.encode_special_tokens = not value

    def _first_id(self, *names: str) -> int | None:
        return next((i for n in names if (i := self._tok.token_to_id(n)) is not None), None)

    def is_special(self, i: int) -> bool:
        added = self._tok.get_added_tokens_decoder().get(i)
        return added is not None and added.special

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def _encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        # add_special_tokens=False: bos is add_bos's, never a template's (Llama's "<s> $A").
        # encode_batch_fast (no offsets): about a quarter less CPU on GPT-2 BPE (module docstring).
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in batch(texts, add_special_tokens=False)]

    def encode_batch_offsets(
        self, texts: list[str], continued: Sequence[bool] | None = None
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        out: list = [None] * len(texts)
        inner = self._inner_tokenizer() if continued is not None and any(continued) else None
        for tok, wanted in ((self._tok, False), (inner, True)):
            picked = [
                i for i in range(len(texts)) if (inner is not None and bool(continued[i])) == wanted
            ]
            if tok is None or not picked:
                continue
            for i, e in zip(
                picked, tok.encode_batch([texts[i] for i in picked], add_special_tokens=False)
            ):
                out[i] = (e.ids, e.offsets)
        return out

    def _inner_tokenizer(self) -> hf.Tokenizer | None:
        """This tokenizer without its prefix space, for text inside an input, where a Metaspace
        pre-tokenizer with prepend_scheme "first" (transformers' non-legacy Llama/Mistral
        conversion) writes none; None where text inside an input is tokenized as at its start
        anyway."""
        if not hasattr(self, "_inner"):
            self._inner = None
            pre = self._tok.pre_tokenizer
            if isinstance(pre, pre_tokenizers.Metaspace) and pre.prepend_scheme == "first":
                inner = hf.Tokenizer.from_str(self._tok.to_str())
                inner.pre_tokenizer = pre_tokenizers.Metaspace(
                    replacement=pre.replacement, prepend_scheme="never", split=pre.split
                )
                inner.encode_special_tokens = True
                self._inner = inner
        return self._inner

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def token_to_id(self, tok: str) -> int | None:
        return self._tok.token_to_id(tok)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` (Llama 2): ids are what Meta's `sp.encode(text)` gives."""

    def __init__(self, sp: spm.SentencePieceProcessor, files: list[Path]):
        self._sp = sp
        self.files = files
        self.vocab_size = sp.get_piece_size()
        ids = (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id())
        # -1 means none
        self.bos_id, self.eos_id, self.pad_id, self.unk_id = (i if i >= 0 else None for i in ids)
        self._set_special_ids()

    def is_special(self, i: int) -> bool:
        return 0 <= i < self.vocab_size and self._sp.is_control(i)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {
            self._sp.id_to_piece(i): i
            for i in range(self.vocab_size)
            if self._sp.is_control(i) or self._sp.is_unknown(i)
        }

    def _encode(self, text: str) -> list[int]:
        return self._encode_batch([text])[0]

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.parse_special_tokens:
            return [ids for ids, _ in self.encode_batch_offsets(texts)]
        return self._sp.encode(texts)  # a list in is encoded on sentencepiece's thread pool

    def _parser(self) -> hf.Tokenizer | None:
        """The tokenizer.json lmforge's export writes for this model: AutoTokenizer on the export
        reads special-token text (WikiText's "<unk>") with it. None for a model it cannot
        convert."""
        if not hasattr(self, "_parsing"):
            from lmforge.sentencepiece_bpe import sentencepiece_tokenizer_json

            self._parsing = sentencepiece_tokenizer_json(self)
        return self._parsing

    def encode_batch_offsets(
        self, texts: list[str], continued: Sequence[bool] | None = None
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        if self.parse_special_tokens and (parser := self._parser()) is not None:
            return [
                (e.ids, e.offsets)
                for e in parser.encode_batch(list(texts), add_special_tokens=False)
            ]
        # Meta's tokenizer.model encodes every text with its prefix space (Llama 2's "<s>" then
        # "▁[INST]").
        try:
            protos = self._sp.encode(texts, out_type="proto")
        except (ValueError, TypeError, RuntimeError):  # sentencepiece before 0.2.1 names it so
            protos = self._sp.encode(texts, out_type="immutable_proto")
        out = []
        for text, proto in zip(texts, protos):
            # sentencepiece counts UTF-8 bytes: map each byte offset to its character's.
            chars = [i for i, c in enumerate(text) for _ in range(len(c.encode("utf-8")))] + [
                len(text)
            ]
            out.append(
                (
                    [p.id for p in proto.pieces],
                    [(chars[p.begin], chars[p.end]) for p in proto.pieces],
                )
            )
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        if skip_special_tokens:
            return self._sp.decode(ids)  # sentencepiece drops control pieces (<s>, </s>) itself
        # Otherwise show them as text, as Hugging Face does: decode the runs between control ids.
        parts, run = [], []
        for i in ids:
            if self._sp.is_control(i):
                parts += [self._sp.decode(run), self._sp.id_to_piece(i)]
                run = []
            else:
                run.append(i)
        return "".join(parts) + self._sp.decode(run)

    def id_to_token(self, i: int) -> str | None:
        return self._sp.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def token_to_id(self, tok: str) -> int | None:
        i = self._sp.piece_to_id(tok)  # unknown pieces come back as unk's id
        return i if self._sp.id_to_piece(i) == tok else None


def load_tokenizer(path: str | Path, quiet: bool = False) -> Tokenizer:
    """Load a tokenizer from a file or a folder (see the module docstring for the kinds);
    `quiet`: its line at DEBUG (a copy being exported, not the run's tokenizer)."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"tokenizer path {path} does not exist: {KINDS_HINT}")
    file = find_tokenizer_file(path) if path.is_dir() else path
    if file is None:
        raise UserError(f"no single tokenizer file found in {path}: {KINDS_HINT}")
    # a file the folder names; one given by itself is the user's choice, a link or not
    if path.is_dir():
        folder_file(path, file.name)
    if file.name.endswith(("vocab.json", "merges.txt")):
        # Pairs share a prefix: HF's vocab.json + merges.txt, Megatron's gpt2-vocab.json +
        # gpt2-merges.txt
        prefix = file.name.removesuffix("vocab.json").removesuffix("merges.txt")
        vocab, merges = file.with_name(prefix + "vocab.json"), file.with_name(prefix + "merges.txt")
        missing = merges if file == vocab else vocab
        if not missing.is_file():
            raise UserError(f"{file} needs {missing.name} beside it for GPT-2 BPE: copy it there")
        folder_file(file.parent, missing.name)
        tok = _load_gpt2_bpe(vocab, merges)
    elif file.suffix == ".json":
        tok = HFTokenizer(_wrap("a tokenizer.json", hf.Tokenizer.from_file, file), [file])
    elif file.suffix == ".model":
        tok = SentencePieceTokenizer(
            _wrap("a SentencePiece model", spm.SentencePieceProcessor, file), [file]
        )
    else:
        raise UserError(f"unknown tokenizer file kind {file}: {KINDS_HINT}")
    # Once per file and process at INFO: a run's start, its export and the export's folder each load
    # it again.
    logger.log(
        logging.DEBUG if quiet or file.resolve() in _SAID else logging.INFO, "loaded %r", tok
    )
    _SAID.add(file.resolve())
    # no real vocabulary is this small; a byte-level one alone has 256 pieces
    if tok.vocab_size < 100:
        others = (
            sorted(
                f.name
                for f in file.parent.iterdir()
                if f != file and f.name.endswith((".json", ".model")) and "tokenizer" in f.name
            )
            if path.is_dir()
            else []
        )
        logger.warning(
            "tokenizer %s has only %d tokens: is it the model's? Every text will come out as a few ids%s",
            file,
            tok.vocab_size,
            f" (the folder also holds {', '.join(others)})" if others else "",
        )
    return tok


def folder_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer among a model folder's files, None where it holds none lmforge reads."""
    return None if find_tokenizer_file(folder) is None else load_tokenizer(folder, quiet=True)


def find_tokenizer_file(folder: str | Path) -> Path | None:
    """The tokenizer file load_tokenizer reads in `folder`, None where it holds no single one."""
    d = Path(folder)
    if (d / "tokenizer.json").is_file():
        return d / "tokenizer.json"
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        return d / "vocab.json"
    if (d / "tokenizer.model").is_file():
        return d / "tokenizer.model"
    # Names like GPT-NeoX's 20B_tokenizer.json; a single match only, so the choice is never a guess.
    for pattern in ("*tokenizer.json", "*vocab.json", "*.model"):
        found = sorted(d.glob(pattern))
        if len(found) == 1:
            return found[0]
    return None


def _load_gpt2_bpe(vocab: Path, merges: Path) -> HFTokenizer:
    tok = hf.Tokenizer(_wrap("GPT-2 BPE", models.BPE.from_file, vocab, merges))
    # OpenAI's encoder.py adds no prefix space: "Hello" at the start of a text stays one token
    # without "Ġ".
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(ENDOFTEXT) is not None:
        # keeps its id 50256; marks it special for skip_special_tokens
        tok.add_special_tokens([ENDOFTEXT])
    return HFTokenizer(tok, [vocab, merges])


def _wrap(what: str, load, *files: Path):
    """Call a third-party loader, turning its failure on a bad file into a one-line UserError."""
    try:
        return load(*map(str, files))
    # the libraries raise bare Exception/RuntimeError with their parser's message
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        names = " + ".join(map(str, files))
        raise UserError(
            f"cannot read {names} as {what} ({reason}): check the file is intact"
        ) from e
