"""`lmforge eval MODEL --lora ADAPTER`: base + a PEFT adapter scores what the merged model scores
(PEFT's merge_and_unload, saved and evaluated as a folder) and what lm-eval's hf backend scores
with peft=; a wrong adapter or an adapter given as the model is one line before any task data or
weights are read."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("lm_eval")
peft = pytest.importorskip("peft")

from lm_eval.api.instance import Instance  # noqa: E402

from lmforge.cli import main  # noqa: E402
from lmforge.eval.lm import LMForgeLM  # noqa: E402
from tests.conftest import hf_tiny_configs  # noqa: E402

TOL = 1e-5
REQUESTS = [
    ("The cat sat on", " the mat"),
    ("", "An empty context"),
    ("Question: is it good?\nAnswer:", " positive"),
    ("Question: is it good?\nAnswer:", " negative"),
    ("In 1998 the band", " released its second album"),
]


def _peft_model(hf_dir, targets):
    import transformers as tf

    return peft.get_peft_model(
        tf.AutoModelForCausalLM.from_pretrained(hf_dir),
        peft.LoraConfig(
            # B random, as after training
            r=4,
            lora_alpha=8,
            target_modules=targets,
            init_lora_weights=False,
        ),
    )


@pytest.fixture(scope="module")
def adapted(eval_models, tmp_path_factory):
    """(the Llama's HF folder, PEFT's adapter of it, the merged model saved with the tokenizer
    files)."""
    hf_dir = eval_models["llama"][0]
    root = tmp_path_factory.mktemp("eval_lora")
    model = _peft_model(hf_dir, ["q_proj", "v_proj", "o_proj", "down_proj"])
    model.save_pretrained(root / "adapter")
    model.merge_and_unload().save_pretrained(root / "merged")
    for f in hf_dir.glob("tokenizer*"):
        shutil.copy(f, root / "merged" / f.name)
    return hf_dir, root / "adapter", root / "merged"


def _loglikelihoods(lm) -> list[tuple[float, bool]]:
    return lm.loglikelihood(
        [Instance("loglikelihood", {}, r, i) for i, r in enumerate(REQUESTS)], disable_tqdm=True
    )


def test_base_plus_adapter_scores_as_the_merged_model(adapted, eval_models):
    from lm_eval.models.huggingface import HFLM

    hf_dir, adapter, merged = adapted
    # the same weights imported: lmforge.json names the HF folder
    lmforge_dir = eval_models["llama"][1]
    got = _loglikelihoods(LMForgeLM(lmforge_dir, peft=adapter, batch_size=2, device="cpu"))
    # lm-eval's model_args, as the hf backend takes them
    assert (
        _loglikelihoods(
            LMForgeLM.create_from_arg_string(
                f"pretrained={lmforge_dir},peft={adapter}", {"batch_size": 2, "device": "cpu"}
            )
        )
        == got
    )
    expected = _loglikelihoods(LMForgeLM(merged, batch_size=2, device="cpu"))
    base = _loglikelihoods(LMForgeLM(lmforge_dir, batch_size=2, device="cpu"))
    assert max(abs(g[0] - e[0]) for g, e in zip(got, expected)) <= TOL
    assert [g[1] for g in got] == [e[1] for e in expected]
    # the adapter does change the scores
    assert max(abs(b[0] - e[0]) for b, e in zip(base, expected)) > 1e-2
    reference = _loglikelihoods(
        HFLM(pretrained=str(hf_dir), peft=str(adapter), batch_size=2, device="cpu")
    )
    # as test_parity: fp32 sums
    assert max(abs(g[0] - r[0]) for g, r in zip(got, reference)) <= 1e-4


def _results(path) -> dict:
    return {
        task: {k: v for k, v in m.items() if "stderr" not in k and k != "alias"}
        for task, m in json.loads(path.read_text())["results"].items()
    }


@pytest.mark.slow
def test_eval_with_lora_equals_eval_of_the_merged_folder(adapted, shared_data, tmp_path, caplog):
    hf_dir, adapter, merged = adapted
    args = [
        "--tasks",
        "sst2_local,wikitext2_local",
        "--data-dir",
        str(shared_data),
        "--limit",
        "3",
        "--device",
        "cpu",
    ]
    with caplog.at_level("WARNING", logger="lmforge.models.peft_read"):
        assert (
            main(
                [
                    "eval",
                    str(hf_dir),
                    "--lora",
                    str(adapter),
                    *args,
                    "--output-path",
                    str(tmp_path / "a.json"),
                ]
            )
            == 0
        )
    # its own base: no warning
    assert not [r for r in caplog.records if r.name == "lmforge.models.peft_read"]
    assert main(["eval", str(merged), *args, "--output-path", str(tmp_path / "m.json")]) == 0
    with_lora, with_merged = _results(tmp_path / "a.json"), _results(tmp_path / "m.json")
    assert with_lora.keys() == with_merged.keys() == {"sst2_local", "wikitext2_local"}
    for task, metrics in with_merged.items():
        for key, value in metrics.items():
            assert with_lora[task][key] == (
                value if isinstance(value, str) else pytest.approx(value, rel=TOL)
            ), key
    config = json.loads((tmp_path / "a.json").read_text())["config"]
    assert config["model_args"] == f"{hf_dir} --lora {adapter}"


def _no_evaluation(monkeypatch):
    """Reading a task or the model fails the test: the bad input must be refused before either."""
    import lmforge.eval.harness
    import lmforge.eval.lm

    def refuse(*args, **kwargs):
        raise AssertionError("tasks or the model were read before the bad input was refused")

    monkeypatch.setattr(lmforge.eval.harness, "load_tasks", refuse)
    monkeypatch.setattr(lmforge.eval.lm, "LMForgeLM", refuse)


def test_a_wrong_adapter_or_an_adapter_as_the_model_is_one_line_first(
    eval_models, tmp_path, monkeypatch, capsys
):
    hf_dir, lmforge_dir = eval_models["gpt_neox"]
    cls, cfg = hf_tiny_configs()["gpt_neox"]
    cls(type(cfg)(**{**cfg.to_dict(), "hidden_size": 128})).save_pretrained(tmp_path / "wide")
    _peft_model(tmp_path / "wide", ["query_key_value"]).save_pretrained(tmp_path / "adapter")
    adapter = tmp_path / "adapter"
    _no_evaluation(monkeypatch)
    capsys.readouterr()
    cases = [
        (
            [str(lmforge_dir), "--lora", str(adapter)],
            f"error: '{adapter}' does not fit this gpt_neox model: its gpt_neox.layers.0.attention.query_key_value."
            f"lora_A.weight has shape (4, 128), the layer it adapts here takes (4, 64): load it onto the model it was "
            f"trained on, {tmp_path / 'wide'} (its base_model_name_or_path)",
        ),
        (
            [str(lmforge_dir), "--lora", str(tmp_path)],
            f"error: no adapter_config.json in '{tmp_path}': point --lora at a PEFT LoRA adapter folder",
        ),
        (
            [str(adapter)],
            f"error: '{adapter}' is a PEFT adapter (adapter_config.json), not a model: pass its base "
            f"model ({tmp_path / 'wide'}) and the adapter with --lora {adapter}",
        ),
        (
            [str(adapter), "--max-length", "16"],
            f"error: '{adapter}' is a PEFT adapter (adapter_config.json), not a "
            f"model: pass its base model ({tmp_path / 'wide'}) and the adapter with "
            f"--lora {adapter}",
        ),
    ]
    for args, message in cases:
        assert main(["eval", *args, "--tasks", "sst2_local", "--device", "cpu"]) == 1, args
        assert capsys.readouterr().err == message + "\n"


def test_eval_help_names_lora():
    import argparse

    from lmforge.cli import parser

    verbs = next(a for a in parser("eval")._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(verbs.choices["eval"].format_help().split())
    assert "--lora DIR a PEFT LoRA adapter folder" in text and "MODEL is its base" in text
