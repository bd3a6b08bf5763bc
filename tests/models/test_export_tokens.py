"""An export reads as the model was trained: the special ids in config.json are the tokenizer's
(transformers' generate stops where lmforge's does), a classifier has the pad id transformers
needs for a batch, and AutoTokenizer on the export gives lmforge's ids. Real tokenizers from
../shared/data/tokenizers."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from lmforge.models import ModelConfig, build, init_weights, load_pretrained, preset
from lmforge.models.hf import export_hf
from lmforge.models.io import read_config, save_model
from lmforge.tokenizers import load_tokenizer

IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _trained_tokenizer(tmp_path):
    """A byte-level BPE trained as `lmforge quickstart` trains its own (<|endoftext|> = 0)."""
    from lmforge.data.tokenizer_train import train_tokenizer

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(200)
        )
    )
    train_tokenizer([corpus], 300, tmp_path / "tok", overwrite=True)
    return tmp_path / "tok"


def _export(cfg, tokenizer, tmp_path, seed=0):
    model = build(cfg, device="cpu")
    init_weights(model, cfg, seed)
    save_model(model, tmp_path / "model", tokenizer_from=tokenizer)
    export_hf(tmp_path / "model", tmp_path / "hf")
    return model.eval()


# (preset, tokenizer under ../shared/data/tokenizers, the ids the export must carry: bos, eos, pad)
SPECIAL = [
    # the Pythia preset's eos 0 is "!" to GPT-2's vocabulary
    ("tiny-neox", "gpt2", (50256, 50256, None)),
    ("tiny-neox", "gpt2/vocab.json", (50256, 50256, None)),
    ("tiny-gpt2", "gpt-neox-20b", (0, 0, 1)),  # GPT-2's 50256 is an ordinary token to NeoX's
    ("tiny-neox", "gpt-neox-20b", (0, 0, 1)),
    ("tiny-llama", "llama2", (1, 2, None)),
    ("tiny-qwen3", "llama2", (1, 2, None)),  # Qwen's ids (151643, 151645) are past this vocabulary
    # the quickstart's fields name no ids; its tokenizer has <|endoftext|>
    ("quickstart", None, (0, 0, None)),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, tokenizer, expected", SPECIAL, ids=[f"{n}-{t}" for n, t, _ in SPECIAL]
)
def test_special_ids_of_an_export_are_the_tokenizers(
    name, tokenizer, expected, shared_data, tmp_path
):
    from lmforge.quickstart import MODEL

    path = (
        _trained_tokenizer(tmp_path)
        if tokenizer is None
        else shared_data / "tokenizers" / tokenizer
    )
    tok = load_tokenizer(path)
    base = preset(name) if name != "quickstart" else ModelConfig(**MODEL)
    cfg = dataclasses.replace(base, vocab_size=tok.vocab_size, max_position_embeddings=64)
    _export(cfg, path, tmp_path)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert tuple(hf[k] for k in IDS) == expected
    # lmforge's own folder too
    assert tuple(getattr(read_config(tmp_path / "model"), k) for k in IDS) == expected


def test_the_tokenizers_ids_win_and_a_configs_special_ids_stay_beside_them(shared_data):
    gpt2, llama = (load_tokenizer(shared_data / "tokenizers" / name) for name in ("gpt2", "llama2"))
    # Pythia's eos 0 is "!" to GPT-2: replaced; 50256 stays; a list of special ids keeps its order
    assert gpt2.model_special_ids({"bos_token_id": 0, "eos_token_id": 0}) == dict(
        zip(IDS, (50256, 50256, None))
    )
    assert gpt2.model_special_ids({"eos_token_id": [50256]})["eos_token_id"] == [50256]
    # a config's eos that is a control token of the tokenizer also stops generation (Llama 3
    # Instruct's several)
    assert llama.model_special_ids({"eos_token_id": 1})["eos_token_id"] == [1, 2]
    assert llama.model_special_ids({"eos_token_id": 450})["eos_token_id"] == 2  # "▁The" is text
    # a classifier is padded as lmforge's classification batches are: pad, else eos
    assert llama.model_special_ids({}, classifier=True)["pad_token_id"] == 2 == llama.padding_id
    assert gpt2.model_special_ids({"pad_token_id": 5}, classifier=True)["pad_token_id"] == 50256


def _always(model, token: int) -> None:
    """Make greedy decoding pick `token` at every step: the final LayerNorm outputs one vector u
    whatever it reads (weight 0, bias u), and the head's row for `token` is 10 u."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        u = torch.randn(model.config.hidden_size, generator=g)
        model.norm.weight.zero_()
        model.norm.bias.copy_(u)
        model.head()[0][token] = 10 * u


@pytest.mark.slow
@pytest.mark.parametrize("name, tokenizer", [("tiny-neox", "gpt2"), ("tiny-gpt2", "gpt-neox-20b")])
def test_transformers_generate_stops_where_lmforges_does(name, tokenizer, shared_data, tmp_path):
    """Issue 18 item 9: a Pythia-shaped model trained with GPT-2's tokenizer exported
    eos_token_id 0, "!" there: transformers' generate stopped at every "!". Each generates from
    the export: a model that always says "!" runs to max_new_tokens in both, one that always says
    eos stops after it in both."""
    import transformers

    from lmforge.inference.generate import generate
    from lmforge.inference.text import eos_token_ids

    path = shared_data / "tokenizers" / tokenizer
    tok = load_tokenizer(path)
    cfg = dataclasses.replace(preset(name), vocab_size=tok.vocab_size, max_position_embeddings=64)
    bang = tok.encode("!")
    assert len(bang) == 1
    prompt = tok.encode("The game began")
    for token, length in ((bang[0], 8), (tok.eos_id, 1)):
        model = build(cfg, device="cpu")
        init_weights(model, cfg, 0)
        _always(model, token)
        save_model(model, tmp_path / "model", tokenizer_from=path, overwrite=True)
        export_hf(tmp_path / "model", tmp_path / "hf", overwrite=True)
        ours_model, ours_tok = load_pretrained(tmp_path / "hf"), load_tokenizer(tmp_path / "hf")
        ours = generate(
            ours_model,
            [prompt],
            8,
            do_sample=False,
            stop_token_ids=eos_token_ids(ours_model, ours_tok),
        )
        theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
            .eval()
            .generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
            .tolist()
        )
        assert ours[0] == theirs == [token] * length


CLASSIFIERS = [("tiny-gpt2", "gpt2"), ("tiny-neox", "gpt-neox-20b"), ("tiny-llama", "llama2")]


@pytest.mark.slow
@pytest.mark.parametrize("name, tokenizer", CLASSIFIERS, ids=[f"{n}-{t}" for n, t in CLASSIFIERS])
def test_a_classifier_export_scores_a_padded_batch_of_two_as_lmforge(
    name, tokenizer, shared_data, tmp_path
):
    """Issue 18 item 10: a classification export had no pad_token_id, and transformers refuses a
    batch of two without one. With it, a right-padded batch of two real sentences scores as
    lmforge scores it."""
    import transformers

    path = shared_data / "tokenizers" / tokenizer
    tok = load_tokenizer(path)
    cfg = dataclasses.replace(
        preset(name), vocab_size=tok.vocab_size, max_position_embeddings=64, num_labels=3
    )
    model = _export(cfg, path, tmp_path)
    lines = (shared_data / "corpora" / "tinyshakespeare" / "input.txt").read_text().splitlines()
    # two lines of different lengths
    rows = tok.encode_batch(lines[1:5:3], add_bos=tok.add_bos_token)
    assert len(rows[0]) != len(rows[1])
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.padding_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf").eval()
    assert hf.config.pad_token_id == tok.padding_id
    with torch.no_grad():
        ours = model(ids, attention_mask=mask)
        torch.testing.assert_close(hf(input_ids=ids, attention_mask=mask).logits, ours)
        one = torch.stack([model(torch.tensor([r]))[0] for r in rows])
    torch.testing.assert_close(ours, one)  # padding changes nobody's score


# Every family's tokenizer in ../shared/data/tokenizers, on a model of its own family and on one of
# another (a run may train any shape with any tokenizer).
AUTO = [
    ("tiny-llama", "llama2"),
    ("tiny-mistral", "llama2"),
    ("tiny-neox", "gpt-neox-20b"),
    ("tiny-gpt2", "gpt2"),
    ("tiny-gpt2", "gpt2/vocab.json"),
    ("tiny-neox", "gpt2"),
    ("tiny-llama", "gpt2/vocab.json"),
    ("tiny-gpt2", "gpt-neox-20b"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, tokenizer", AUTO, ids=[f"{n}-{t}" for n, t in AUTO])
def test_autotokenizer_on_the_export_gives_lmforges_ids(name, tokenizer, shared_data, tmp_path):
    """Issue 18 item 11: a Llama export of a bare tokenizer.model had no tokenizer_config.json,
    and AutoTokenizer encoded "The game" as [1576, 3748] where lmforge and sentencepiece give [1,
    450, 3748]. On a WikiText article and a Shakespeare scene, AutoTokenizer on the export gives
    lmforge's ids (bos included where lmforge adds it), decodes them back to lmforge's text, and
    names the config's special ids."""
    import transformers

    path = shared_data / "tokenizers" / tokenizer
    tok = load_tokenizer(path)
    cfg = dataclasses.replace(preset(name), vocab_size=tok.vocab_size, max_position_embeddings=64)
    _export(cfg, path, tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    if tokenizer == "llama2":
        assert (
            auto("The game")["input_ids"] == tok.encode("The game", add_bos=True) == [1, 450, 3748]
        )
    article = json.loads(
        (shared_data / "corpora" / "wikitext-2" / "valid.articles.jsonl").open().readline()
    )["text"]
    scene = (shared_data / "corpora" / "tinyshakespeare" / "input.txt").read_text()[:4000]
    for text in (article, scene):
        ours = tok.encode(text, add_bos=tok.add_bos_token)
        # lmforge reads "<unk>" in text as text; transformers parses it unless told not to
        # (tokenizers.py)
        assert auto(text, split_special_tokens=True)["input_ids"] == ours
        plain = text.replace("<unk>", "unk")
        assert auto(plain)["input_ids"] == tok.encode(plain, add_bos=tok.add_bos_token)
        assert auto.decode(ours, skip_special_tokens=True) == tok.decode(
            ours, skip_special_tokens=True
        )
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == tuple(hf[k] for k in IDS)
    assert max(auto.get_vocab().values()) < cfg.vocab_size  # no token added past the model's rows
    # lmforge reads the export's tokenizer files as it read the source's
    again = load_tokenizer(tmp_path / "hf")
    assert again.encode(article, add_bos=again.add_bos_token) == tok.encode(
        article, add_bos=tok.add_bos_token
    )


def test_a_list_of_eos_ids_is_read_back_and_exported(tmp_path):
    """Llama 3.1 Instruct's and Gemma 3's config.json list several eos ids: the imported folder
    could not be read again (generate, serve, export-hf and a fine-tune's export all failed on
    'expected an integer')."""
    cfg = dataclasses.replace(preset("tiny-neox"), eos_token_id=[0, 2])
    save_model(build(cfg), tmp_path / "m")
    assert read_config(tmp_path / "m").eos_token_id == [0, 2]
    export_hf(tmp_path / "m", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == [0, 2]


def test_an_export_keeps_a_declared_null_bos(tmp_path):
    """A Qwen-style tokenizer says "bos_token": null; lmforge took <|endoftext|> for bos all the
    same and the export wrote its id into config.json, where the source's config said null and
    AutoTokenizer on the export has none."""
    transformers = pytest.importorskip("transformers")
    from tests.test_tokenizers import chat_tokenizer_json

    ids = chat_tokenizer_json(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
            }
        )
    )
    tok = load_tokenizer(tmp_path / "tok")
    cfg = dataclasses.replace(
        preset("tiny-qwen3"),
        vocab_size=tok.vocab_size,
        max_position_embeddings=64,
        bos_token_id=None,
    )
    _export(cfg, tmp_path / "tok", tmp_path)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert tuple(hf[k] for k in IDS) == (None, ids["<|im_end|>"], ids["<|endoftext|>"])
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == tuple(hf[k] for k in IDS)


# Llama 2's published tokenizer_config.json (meta-llama/Llama-2-7b-chat-hf), its chat template
# shortened; "legacy" as there (false), as transformers 4 wrote it when asked (true), and absent
# (transformers 5 reads absent as false).
LLAMA2_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "bos_token": {
        "__type": "AddedToken",
        "content": "<s>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    },
    "eos_token": {
        "__type": "AddedToken",
        "content": "</s>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    },
    "unk_token": {
        "__type": "AddedToken",
        "content": "<unk>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    },
    "pad_token": None,
    "padding_side": "right",
    "sp_model_kwargs": {},
    "tokenizer_class": "LlamaTokenizer",
    "model_max_length": 1000000000000000019884624838656,
    "chat_template": "{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + "
    "m['content'].strip() + ' [/INST]' }}{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}",
}
CHAT = [
    ("user", "Hi there"),
    ("assistant", "Hello!  How can I help?"),
    ("user", " Tell me a joke."),
]


@pytest.mark.parametrize(
    "legacy", [False, True, None], ids=["legacy-false", "legacy-true", "legacy-absent"]
)
def test_autotokenizer_on_an_export_of_a_tokenizer_model_with_its_config_gives_lmforges_ids(
    legacy, shared_data, tmp_path
):
    """A Llama folder with tokenizer.model and tokenizer_config.json but no tokenizer.json: the
    export kept the source's config and wrote no tokenizer.json, so AutoTokenizer built
    transformers' LlamaTokenizer from tokenizer.model, which puts no prefix space after a special
    token ("<s>[INST]": "[" where sentencepiece, so lmforge's training, has "▁["; 300 of 300 of
    the audit's chats differed). Now the export carries lmforge's tokenizer.json and the source's
    config, naming the class that reads it as it is."""
    transformers = pytest.importorskip("transformers")
    from lmforge.chat_template import ChatTemplate
    from lmforge.models.hf.tokenizer import FAST

    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(shared_data / "tokenizers" / "llama2" / "tokenizer.model", src)
    config = LLAMA2_CONFIG | ({} if legacy is None else {"legacy": legacy})
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(src)
    cfg = dataclasses.replace(
        preset("tiny-llama"), vocab_size=tok.vocab_size, max_position_embeddings=64
    )
    _export(cfg, src, tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    chat = [{"role": role, "content": content} for role, content in CHAT]
    # as lmforge finetune encodes it
    trained = ChatTemplate(config["chat_template"], tok, src).prompt_ids(CHAT)
    assert trained[:2] == [1, 518]  # <s> "▁["
    assert auto.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"] == trained
    for text in ("Hello world", " leading  and two spaces", "a\n\n b"):
        assert auto(text)["input_ids"] == tok.encode(text, add_bos=True)
    written = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert written == {**written, **config, "tokenizer_class": FAST}  # the source's, but the class
    again = load_tokenizer(tmp_path / "hf")  # and lmforge reads the export as the source
    assert ChatTemplate(config["chat_template"], again, tmp_path / "hf").prompt_ids(CHAT) == trained
