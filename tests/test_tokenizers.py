"""Tokenizer ids checked against implementations someone else wrote, on real tokenizer files and
text.

References: tiktoken for GPT-2 (OpenAI's own BPE, built offline from the same
vocab.json/merges.txt), transformers for GPT-NeoX-20B and Llama 2. The files live in the shared data
folder (see its SOURCES.md), never in the repo; tests that need them skip when it is absent.
"""

import filecmp
import json
import os
import shutil
from pathlib import Path

import pytest

from lmforge.errors import UserError
from lmforge.tokenizers import Tokenizer, load_tokenizer

SHARED_DATA = Path(
    os.environ.get("LMFORGE_SHARED_DATA") or Path(__file__).resolve().parents[2] / "shared" / "data"
)
GPT2 = SHARED_DATA / "tokenizers" / "gpt2"
NEOX = SHARED_DATA / "tokenizers" / "gpt-neox-20b" / "20B_tokenizer.json"
LLAMA = SHARED_DATA / "tokenizers" / "llama2" / "tokenizer.model"
# tiktoken's sha256 pins for OpenAI's GPT-2 files (tiktoken_ext/openai_public.py): proves ours are
# those.
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
CHUNK = 200_000  # characters of each corpus compared as one text


def shared(path: Path) -> Path:
    if not path.exists():
        pytest.skip(reason=f"{path} not found: set LMFORGE_SHARED_DATA to the shared data folder")
    return path


def corpus(name: str) -> str:
    return shared(SHARED_DATA / "corpora" / name).read_text(encoding="utf-8")


def specials(tok: Tokenizer) -> tuple:
    return tok.vocab_size, tok.eod_id, tok.bos_id, tok.eos_id, tok.pad_id


@pytest.fixture(scope="module")
def wiki() -> str:
    return corpus("wikitext-2/valid.txt")


@pytest.fixture(scope="module")
def texts(wiki: str) -> list[str]:
    """Long texts compared in one piece: a WikiText chunk and a Shakespeare chunk."""
    return [wiki[:CHUNK], corpus("tinyshakespeare/input.txt")[:CHUNK]]


@pytest.fixture(scope="module")
def lines(wiki: str) -> list[str]:
    return wiki.splitlines()  # 3,760 lines as they are: leading/trailing spaces, blank lines


@pytest.fixture(scope="module")
def gpt2_bpe() -> Tokenizer:
    return load_tokenizer(shared(GPT2 / "vocab.json"))


@pytest.fixture(scope="module")
def gpt2_json() -> Tokenizer:
    return load_tokenizer(shared(GPT2 / "tokenizer.json"))


@pytest.fixture(scope="module")
def neox() -> Tokenizer:
    return load_tokenizer(shared(NEOX))


@pytest.fixture(scope="module")
def llama() -> Tokenizer:
    return load_tokenizer(shared(LLAMA))


@pytest.fixture(scope="module", params=["gpt2_bpe", "gpt2_json", "neox", "llama"])
def any_tok(request) -> Tokenizer:
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def tiktoken_gpt2():
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    # An empty cache dir turns tiktoken's file cache off, so nothing is written outside the test.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_CACHE_DIR", "")
        ranks = data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(shared(GPT2 / "merges.txt")),
            encoder_json_file=str(shared(GPT2 / "vocab.json")),
            vocab_bpe_hash=GPT2_MERGES_SHA256,
            encoder_json_hash=GPT2_VOCAB_SHA256,
        )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": 50256},
    )


@pytest.fixture(scope="module")
def hf_neox():
    transformers = pytest.importorskip("transformers")
    # split_special_tokens: like lmforge, read "<|endoftext|>" in text as text (see
    # lmforge/tokenizers.py).
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(shared(NEOX)), split_special_tokens=True
    )


@pytest.fixture(scope="module")
def hf_llama():
    """transformers' Llama tokenizer built from tokenizer.model as its from_pretrained would build
    it.

    from_pretrained reads the .model with protobuf, which lmforge does not depend on; it takes the
    pieces in id order and derives BPE merges with `generate_merges`, which is what we do here
    (checked equal to from_pretrained on 4,461 WikiText/Shakespeare lines). The BPE itself is then
    Hugging Face's code.
    """
    transformers = pytest.importorskip("transformers")
    import sentencepiece as spm
    from transformers.tokenization_utils_base import generate_merges

    sp = spm.SentencePieceProcessor(model_file=str(shared(LLAMA)))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    return transformers.LlamaTokenizer(
        vocab=vocab, merges=generate_merges(vocab), add_bos_token=False, split_special_tokens=True
    )


# --- GPT-2
# -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2_bpe", "gpt2_json"])
def test_gpt2_known_ids_and_specials(name, request):
    tok = request.getfixturevalue(name)
    assert tok.encode("The quick brown fox") == [464, 2068, 7586, 21831]
    assert specials(tok) == (50257, 50256, 50256, 50256, None)
    assert tok.id_to_token(50256) == "<|endoftext|>" and tok.token_to_id("Ġfox") == 21831


@pytest.mark.parametrize("name", ["gpt2_bpe", "gpt2_json"])
def test_gpt2_matches_tiktoken(name, request, tiktoken_gpt2, texts, lines):
    tok = request.getfixturevalue(name)
    for text in texts:
        assert tok.encode(text) == tiktoken_gpt2.encode_ordinary(text)
    assert tok.encode_batch(lines) == tiktoken_gpt2.encode_ordinary_batch(lines)


def test_gpt2_json_equals_vocab_merges(gpt2_bpe, gpt2_json, wiki):
    # Both also equal tiktoken above; this is the direct check that the two file kinds agree.
    assert gpt2_json.encode(wiki[:CHUNK]) == gpt2_bpe.encode(wiki[:CHUNK])


# --- GPT-NeoX-20B
# ------------------------------------------------------------------------------------------


def test_neox_known_ids_and_specials(neox):
    assert neox.encode("Hello world") == [12092, 1533]
    assert neox.vocab_size == 50277
    assert neox.eod_id == neox.eos_id == neox.token_to_id("<|endoftext|>") == 0
    assert neox.pad_id == neox.token_to_id("<|padding|>") == 1


def test_neox_matches_transformers(neox, hf_neox, texts, lines):
    for text in texts:
        assert neox.encode(text) == hf_neox.encode(text, add_special_tokens=False)
    assert neox.encode_batch(lines) == hf_neox(lines, add_special_tokens=False)["input_ids"]


# --- Llama 2
# -----------------------------------------------------------------------------------------------


def test_llama_known_ids_and_specials(llama):
    assert llama.encode("Hello world") == [15043, 3186]
    assert llama.encode("Hello world", add_bos=True) == [1, 15043, 3186]
    assert specials(llama) == (32000, 2, 1, 2, None)  # eod is eos
    assert llama.decode([1, 15043, 3186, 2]) == "<s>Hello world</s>"
    assert llama.decode([1, 15043, 3186, 2], skip_special_tokens=True) == "Hello world"


def test_llama_matches_transformers(llama, hf_llama, lines):
    # HF's BPE port differs from sentencepiece at leading spaces and some space runs (pinned in the
    # next test), so compare whitespace-normalised lines; every other piece of each line still must
    # match.
    normalised = [" ".join(line.split()) for line in lines]
    assert (
        llama.encode_batch(normalised)
        == hf_llama(normalised, add_special_tokens=False)["input_ids"]
    )


def test_llama_follows_sentencepiece_where_transformers_differs(llama):
    # sentencepiece (Meta's reference encode) gives these; transformers 5's LlamaTokenizer gives
    # [8236], [259, 10184, 8162] and [1] (a parsed control token) instead.
    assert llama.encode(" leading") == [29871, 8236]
    assert llama.encode("  two spaces") == [259, 1023, 8162]
    assert llama.encode("<s>") == [529, 29879, 29958]


# --- every kind
# --------------------------------------------------------------------------------------------


def test_decode_inverts_encode(any_tok, texts):
    for text in texts:
        assert any_tok.decode(any_tok.encode(text)) == text


def test_encode_batch_equals_encode(any_tok, lines):
    sample = lines[:300]
    assert any_tok.encode_batch(sample) == [any_tok.encode(t) for t in sample]
    assert any_tok.encode_batch(sample, add_bos=True) == [
        any_tok.encode(t, add_bos=True) for t in sample
    ]
    assert any_tok.encode_batch([]) == []


def test_special_token_text_stays_text(gpt2_bpe, gpt2_json, neox, tiktoken_gpt2, hf_neox):
    text = "end<|endoftext|>start"
    for gpt2 in (gpt2_bpe, gpt2_json):
        assert gpt2.encode(text) == tiktoken_gpt2.encode_ordinary(text)
    assert neox.encode(text) == hf_neox.encode(text, add_special_tokens=False)
    assert 0 not in neox.encode(text)


@pytest.mark.parametrize("name", ["gpt2_bpe", "gpt2_json", "neox", "llama"])
def test_save_round_trip(name, request, tmp_path, wiki):
    tok = request.getfixturevalue(name)
    tok.save(tmp_path / "out")
    for src in tok.files:
        assert filecmp.cmp(src, tmp_path / "out" / src.name, shallow=False)
    again = load_tokenizer(tmp_path / "out")
    assert again.encode(wiki[:20_000]) == tok.encode(wiki[:20_000])
    assert specials(again) == specials(tok)


def test_tokenizer_config_overrides_and_travels(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(shared(LLAMA), src / "tokenizer.model")
    (src / "tokenizer_config.json").write_text(
        json.dumps({"pad_token": {"content": "<unk>"}, "eos_token": "</s>"})
    )
    tok = load_tokenizer(src)
    assert (tok.pad_id, tok.eos_id, tok.eod_id) == (0, 2, 2)
    tok.save(tmp_path / "out")
    assert filecmp.cmp(
        src / "tokenizer_config.json", tmp_path / "out" / "tokenizer_config.json", shallow=False
    )
    assert load_tokenizer(tmp_path / "out").pad_id == 0


def test_add_bos_token_follows_the_files_then_the_eod_rule(
    gpt2_bpe, gpt2_json, neox, llama, hf_neox, tmp_path
):
    # GPT-2 and NeoX: bos, eos and eod are all <|endoftext|>; transformers starts their texts
    # without it.
    assert not any(t.add_bos_token for t in (gpt2_bpe, gpt2_json, neox))
    assert hf_neox("Hello world")["input_ids"] == neox.encode(
        "Hello world", add_bos=neox.add_bos_token
    )
    # Llama 2: a bare tokenizer.model (Meta's format; its generate prepends bos) and its Hugging
    # Face folder, whose tokenizer_config.json says add_bos_token: true; a config that says false is
    # obeyed.
    assert llama.add_bos_token and llama.encode("Hello world", add_bos=llama.add_bos_token) == [
        1,
        15043,
        3186,
    ]
    for declared in (True, False):
        folder = tmp_path / f"llama-{declared}"
        folder.mkdir()
        shutil.copyfile(shared(LLAMA), folder / "tokenizer.model")
        (folder / "tokenizer_config.json").write_text(
            json.dumps({"add_bos_token": declared, "bos_token": "<s>"})
        )
        assert load_tokenizer(folder).add_bos_token is declared
    # A tokenizer.json whose template prepends bos (as Llama 3's does) declares it, even where bos
    # is eod.
    import tokenizers as hf

    inner = hf.Tokenizer.from_file(str(shared(GPT2 / "tokenizer.json")))
    eot = inner.token_to_id("<|endoftext|>")
    inner.post_processor = hf.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", eot)]
    )
    (tmp_path / "template").mkdir()
    inner.save(str(tmp_path / "template" / "tokenizer.json"))
    assert load_tokenizer(tmp_path / "template").add_bos_token
    # Qwen's chat kind: eos <|im_end|>, no bos named; <|endoftext|> is eod, not a bos to prepend.
    inner.post_processor = None
    inner.add_special_tokens(["<|im_end|>"])
    (tmp_path / "chat").mkdir()
    inner.save(str(tmp_path / "chat" / "tokenizer.json"))
    (tmp_path / "chat" / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": None, "eos_token": "<|im_end|>"})
    )
    chat = load_tokenizer(tmp_path / "chat")
    assert chat.eos_id == inner.token_to_id("<|im_end|>") and not chat.add_bos_token


def chat_tokenizer_json(folder: Path) -> dict[str, int]:
    """A small tokenizer.json with Qwen's specials (<|endoftext|> first, then <|im_start|> and
    <|im_end|>)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    inner = HF(models.WordLevel({f"w{i}": i for i in range(200)}, unk_token="w0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    inner.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir()
    inner.save(str(folder / "tokenizer.json"))
    return {t: inner.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}


QWEN_CHAT = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
# transformers 4's AddedToken in a tokenizer_config.json (Llama 2's published folders)
ADDED_TOKEN = {
    "__type": "AddedToken",
    "lstrip": False,
    "normalized": False,
    "rstrip": False,
    "single_word": False,
}
# (tokenizer_config.json, special_tokens_map.json or None, the bos then named: a token, or None for
# none)
DECLARED = {
    "qwen2.5-null": (
        {**QWEN_CHAT, "tokenizer_class": "Qwen2Tokenizer", "bos_token": None},
        None,
        None,
    ),
    # transformers 5's save
    "resaved-absent": ({**QWEN_CHAT, "tokenizer_class": "TokenizersBackend"}, None, None),
    "qwen2-class-absent": ({**QWEN_CHAT, "tokenizer_class": "Qwen2Tokenizer"}, None, None),
    "no-class-null": ({**QWEN_CHAT, "bos_token": None}, None, None),
    # its default
    "gpt2-class-absent": ({**QWEN_CHAT, "tokenizer_class": "GPT2Tokenizer"}, None, "<|endoftext|>"),
    "declared": (
        {**QWEN_CHAT, "bos_token": ADDED_TOKEN | {"content": "<|im_start|>"}},
        None,
        "<|im_start|>",
    ),
    "map-wins": (
        {**QWEN_CHAT, "bos_token": "<|endoftext|>"},
        {"bos_token": "<|im_start|>"},
        "<|im_start|>",
    ),
    "map-null-wins": ({**QWEN_CHAT, "bos_token": "<|endoftext|>"}, {"bos_token": None}, None),
}


@pytest.mark.parametrize("name", DECLARED)
def test_declared_special_tokens_win_over_guesses_as_autotokenizer_reads_them(name, tmp_path):
    """Qwen2.5's tokenizer_config.json says "bos_token": null; lmforge guessed <|endoftext|> for
    bos all the same, so lmforge eval conditioned an empty context on it where lm-eval's hf
    backend (AutoTokenizer: no bos, so eos) used <|im_end|>, and the export wrote that bos into
    config.json. A declaration wins, nulls and special_tokens_map.json's included, and so does a
    class without a default bos (transformers 5 re-saves Qwen's tokenizer without the key)."""
    transformers = pytest.importorskip("transformers")
    config, tokens_map, bos = DECLARED[name]
    ids = chat_tokenizer_json(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(config))
    if tokens_map is not None:
        (tmp_path / "tok" / "special_tokens_map.json").write_text(json.dumps(tokens_map))
    ours = load_tokenizer(tmp_path / "tok")
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        ids.get(bos),
        ids["<|im_end|>"],
        ids["<|endoftext|>"],
    )
    assert ours.eod_id == ids["<|endoftext|>"] and not ours.add_bos_token
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (
        ours.bos_id,
        ours.eos_id,
        ours.pad_id,
    )
    assert ours.encode("w5 w7", add_bos=ours.add_bos_token) == [5, 7]


@pytest.mark.parametrize("saved_by", ["transformers", "lmforge"])
def test_a_tokenizer_json_adds_bos_where_its_post_processor_does(saved_by, tmp_path):
    """A distinct bos (Llama 3's <|begin_of_text|>, a trained tokenizer's <s>) beside a
    tokenizer.json whose post-processor adds none (GPT-2's ByteLevel) and a config without
    add_bos_token: AutoTokenizer starts a text without it, and so does lmforge now (generate,
    serve and the chat fallback prepended it)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "tok"
    if saved_by == "transformers":
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(shared(GPT2 / "tokenizer.json")),
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
        )
        tok.save_pretrained(folder)
    else:
        from lmforge.data.tokenizer_train import train_tokenizer

        (tmp_path / "corpus.jsonl").write_text(
            "".join(json.dumps({"text": f"Hello world {i}"}) + "\n" for i in range(50))
        )
        train_tokenizer([tmp_path / "corpus.jsonl"], 300, folder, special_tokens=("<s>", "</s>"))
    ours = load_tokenizer(folder)
    assert ours.bos_id is not None and ours.bos_id != ours.eod_id
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert reference("Hello world")["input_ids"] == ours.encode(
        "Hello world", add_bos=ours.add_bos_token
    )


def test_sentencepiece_reads_special_tokens_as_its_export_does(llama, tmp_path):
    """lmforge eval reads WikiText's literal "<unk>" with reading_special_tokens(): from Llama
    2's tokenizer.model it was characters, from the exported folder (lm-eval's hf backend,
    AutoTokenizer) the unk id, so the same weights scored 3.6937 and 3.6473 bits per byte. Both
    now give AutoTokenizer's ids; plain encoding stays sentencepiece's."""
    import sentencepiece as spm

    transformers = pytest.importorskip("transformers")
    from lmforge.models.hf.tokenizer import write_tokenizer_files

    llama.save(tmp_path)
    write_tokenizer_files(llama, tmp_path, 128, None)
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = [
        "<unk>",
        " = Robert <unk> = \n",
        "<s>Hello</s>",
        "a <s> b </s> c<unk>d",
        "</s> x <unk> <unk>",
        "The <unk> of <s>1</s> (née <unk>) , \n\n <unk>",
        "no specials at all",
    ]
    sp = spm.SentencePieceProcessor(model_file=str(shared(LLAMA)))
    # plain text: sentencepiece's
    assert [llama.encode(t) for t in texts] == [sp.encode(t) for t in texts]
    with llama.reading_special_tokens():
        parsed = [llama.encode(t) for t in texts]
        assert llama.encode_batch(texts) == parsed
    assert parsed == [reference(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert parsed[1].count(0) == 1 and parsed[2] == [1, *parsed[2][1:-1], 2]
    assert [llama.encode(t) for t in texts] == [sp.encode(t) for t in texts]  # and again after


# --- errors a user can cause
# ---------------------------------------------------------------------------------


def _user_error(path: Path) -> str:
    with pytest.raises(UserError) as e:
        load_tokenizer(path)
    msg = str(e.value)
    assert "\n" not in msg and ":" in msg  # one line: the problem, then the fix
    return msg


def test_missing_path(tmp_path):
    assert "does not exist" in _user_error(tmp_path / "nope.json")


def test_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.txt").write_text("x")
    assert "no single tokenizer file" in _user_error(tmp_path)


def test_vocab_json_without_merges(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0}))
    assert "merges.txt" in _user_error(tmp_path / "vocab.json")
    assert "merges.txt" in _user_error(tmp_path)  # the folder lookup reports the same missing half


@pytest.mark.parametrize(
    "name, content",
    [
        ("tokenizer.model", b"\x00\xffnot a protobuf"),
        ("tokenizer.json", b"{not json"),
        ("t.json", b"[1, 2]"),
    ],
)
def test_corrupt_file(tmp_path, name, content):
    (tmp_path / name).write_bytes(content)
    assert name in _user_error(tmp_path / name)


def test_unknown_file_kind(tmp_path):
    (tmp_path / "tokenizer.txt").write_text("hello")
    assert "unknown tokenizer file kind" in _user_error(tmp_path / "tokenizer.txt")


def test_a_tokenizer_of_a_few_tokens_is_said(tmp_path, caplog):
    """transformers 5's LlamaTokenizer(vocab_file=...).save_pretrained writes a 3-token
    tokenizer.json beside tokenizer.model; lmforge preferred it, and preprocess then blamed the
    data ("every document empty")."""
    import logging

    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json")
    )
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="lmforge.tokenizers"):
        load_tokenizer(tmp_path)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "has only 3 tokens: is it the model's?" in line and "also holds tokenizer.model" in line


def test_a_template_without_bos_means_no_bos_as_autotokenizer_reads_it(shared_data, tmp_path):
    """transformers 5 re-saves every tokenizer with a post-processor template "$A" and no
    add_bos_token: AutoTokenizer then adds no bos, where lmforge added Llama's <s> (its rule for
    files that say nothing), so greedy output on the same folder differed."""
    tf = pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    folder.mkdir()
    shutil.copy(shared_data / "tokenizers" / "llama2" / "tokenizer.model", folder)
    (folder / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", '
        '"eos_token": "</s>", "unk_token": "<unk>"}'
    )
    tf.AutoTokenizer.from_pretrained(folder).save_pretrained(tmp_path / "resaved")
    reference = tf.AutoTokenizer.from_pretrained(tmp_path / "resaved")
    ours = load_tokenizer(tmp_path / "resaved")
    assert (
        ours.encode("Hello there", add_bos=ours.add_bos_token)
        == reference("Hello there").input_ids
        == [15043, 727]
    )
    # the bare tokenizer.model: Llama's <s>, as Meta's code adds it
    assert load_tokenizer(folder).add_bos_token
