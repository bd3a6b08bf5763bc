"""Layout checks and the pipeline split, in one process (no process group needed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lmforge.errors import UserError
from lmforge.models import build, preset
from lmforge.parallel import ParallelConfig, check_model
from lmforge.parallel.pipeline import StageShapes, split_model, stage_examples, stage_ids


def test_data_shard_fills_the_world():
    assert ParallelConfig(pipeline=2, tensor=2).resolved(8).data_shard == 2
    assert ParallelConfig(pipeline=2, tensor=2).resolved(8).data_parallel == 2


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (ParallelConfig(tensor=3), 4, "tensor=3 = 3 does not divide the world size 4"),
        (ParallelConfig(tensor=2, data_shard=3), 4, "= 6 processes, but the world has 4"),
    ],
)
def test_layout_that_does_not_fit_the_world(cfg, world, message):
    with pytest.raises(UserError, match=message):
        cfg.resolved(world)


def test_bad_schedule_settings():
    with pytest.raises(UserError, match="unknown parallel.pipeline_schedule 'interleaved'"):
        ParallelConfig(pipeline_schedule="interleaved")
    with pytest.raises(UserError, match="needs parallel.virtual_stages >= 2"):
        ParallelConfig(pipeline=2, pipeline_schedule="interleaved_1f1b")


@pytest.mark.parametrize(
    ("model", "cfg", "message"),
    [
        (
            preset("tiny-llama"),
            ParallelConfig(tensor=4),
            "num_kv_heads=2 is not divisible by parallel.tensor=4",
        ),
        (
            preset("tiny-neox"),
            ParallelConfig(pipeline=4),
            "num_layers=2 is not divisible by parallel.pipeline=4",
        ),
        (
            preset("tiny-neox"),
            ParallelConfig(pipeline=2, pipeline_schedule="interleaved_1f1b", virtual_stages=2),
            r"x virtual_stages=2 = 4",
        ),
        # GPT-2's 50257 ids pad to 50304 = 128 x 393: not splittable over 2 ranks in 128-row pieces.
        (
            replace(preset("gpt2")),
            ParallelConfig(tensor=2),
            "set model.make_vocab_size_divisible_by=256",
        ),
        (
            replace(preset("tiny-mixtral"), moe_intermediate_size=91),
            ParallelConfig(tensor=2),
            "model.moe_intermediate_size=91 is not divisible by parallel.tensor=2",
        ),
    ],
)
def test_model_that_does_not_split(model, cfg, message):
    with pytest.raises(UserError, match=message):
        check_model(cfg.resolved(cfg.tensor * cfg.pipeline), model)


@pytest.mark.parametrize(
    ("name", "tp", "pp"),
    [("gpt2", 2, 1), ("pythia-6.9b", 8, 1), ("gpt-neox-20b", 8, 4), ("llama-2-7b", 8, 1)],
)
def test_the_advised_vocabulary_padding_splits(name, tp, pp):
    """The error above says to pad to 128 x TP rows; a model padded that way splits (each rank: a
    multiple of 128)."""
    model = replace(preset(name), make_vocab_size_divisible_by=128 * tp)
    check_model(ParallelConfig(tensor=tp, pipeline=pp).resolved(tp * pp), model)
    assert model.padded_vocab_size % (128 * tp) == 0


def test_interleaved_stage_assignment_is_looped():
    assert [stage_ids(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "name",
    [
        "tiny-neox",
        "tiny-llama",
        "tiny-gpt2",
        "tiny-gptj",
        "tiny-bert",
        "tiny-llama3",
        "tiny-qwen2",
        "tiny-mistral",
        "tiny-qwen3",
        "tiny-olmo2",
        "tiny-phi3",
        "tiny-gemma2",
        "tiny-gemma3",
        "tiny-mixtral",
        "tiny-qwen3-moe",
    ],
)
def test_stages_chained_equal_the_model(name):
    """The stages of every rank, run one after another, give the model's logits; every parameter
    keeps its model name (so DCP checkpoints move between pipeline layouts)."""
    cfg = preset(name)
    # local/global layers: keep the pattern
    types = None if cfg.layer_types is None else (cfg.layer_types * 4)[:4]
    cfg = replace(cfg, num_layers=4, layer_types=types)
    model = build(cfg, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    stages = sorted(
        (s for r in range(2) for s in zip(stage_ids(r, 2, 2), split_model(model, r, 2, 2))),
        key=lambda t: t[0],
    )
    x = ids
    positions = torch.arange(12).expand(2, 12)
    for _, stage in stages:
        x = stage(x, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(x, model(ids, attention_mask=mask), rtol=0, atol=0)
    names = {n for _, s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("name", ["tiny-neox", "tiny-llama", "tiny-gpt2", "tiny-bert"])
def test_a_stage_is_the_model_without_what_it_does_not_hold(name):
    """A stage is the model's class, so it runs the model's own forward; it holds the model's own
    parameter objects under their names (nothing copied); a tied last stage keeps the word embedding
    for its head but never runs it on its input; splitting leaves the whole model as it was."""
    cfg = replace(preset(name), num_layers=4)
    model = build(cfg, seed=0).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    before = model(ids)
    params = dict(model.named_parameters())
    word = model.embeddings.word if cfg.family == "bert" else model.embed
    stages = [s for r in range(2) for s in split_model(model, r, 2)]
    assert all(type(s) is type(model) for s in stages)
    for s in stages:
        assert all(p is params[n] for n, p in s.named_parameters())
    assert [[n for n, _ in s.layers.named_children()] for s in stages] == [["0", "1"], ["2", "3"]]
    assert [(s.is_first, s.is_last) for s in stages] == [(True, False), (False, True)]
    tied = {"tiny-gpt2": ("embed.weight",), "tiny-bert": ("embeddings.word.weight",)}.get(name, ())
    assert [s.tied_parameters for s in stages] == [(), tied]
    calls = []
    word.register_forward_hook(lambda *_: calls.append(1))
    # the stage's own hooks, not the model's
    stages[1].register_forward_hook(lambda *_: calls.append("stage"))
    positions = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(
        stages[1](stages[0](ids), position_ids=positions), before, rtol=0, atol=0
    )
    assert calls == [1, "stage"]
    calls.clear()
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    assert calls == [1]
    assert dict(model.named_parameters()).keys() == params.keys()


@pytest.mark.parametrize(
    ("name", "dtype", "labels"),
    [
        ("tiny-neox", torch.float32, 0),
        ("tiny-llama", torch.bfloat16, 0),
        ("tiny-gpt2", torch.float32, 0),
        ("tiny-bert", torch.float32, 0),
        ("tiny-gpt2", torch.float32, 3),
    ],
)
def test_static_stage_shapes_are_what_the_stages_exchange(name, dtype, labels):
    """lmforge plan builds pipeline stages with static shapes (its fake process group carries no
    messages): they must be what each stage really takes and gives, in the run's parameter dtype."""
    cfg = replace(preset(name), num_layers=3, num_labels=labels)
    model = build(cfg, seed=0).to(dtype).eval()
    stages = [s for r in range(3) for s in split_model(model, r, 3)]
    shapes = StageShapes(rows=2, seq_length=12, dtype=dtype)
    x = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    kwargs = {} if cfg.family == "bert" else {"position_ids": torch.arange(12).expand(2, 12)}
    if labels:  # a classifier's last stage reads each row's last real token through the mask
        kwargs["attention_mask"] = torch.ones(2, 12, dtype=torch.long)
    for index, stage in enumerate(stages):
        inputs, outputs = stage_examples(
            stage.config, index, len(stages), shapes, torch.device("cpu")
        )
        assert (x.shape, x.dtype) == (inputs.shape, inputs.dtype), index
        with torch.no_grad():
            x = stage(x, **kwargs)
        assert (x.shape, x.dtype) == (outputs.shape, outputs.dtype), index
        # gradients flow back through them
        assert inputs.requires_grad == (index > 0) and outputs.requires_grad


def test_a_rotary_stage_after_the_first_needs_position_ids():
    """Under sequence parallelism a later stage sees 1/TP of the sequence: it cannot count
    positions."""
    model = build(replace(preset("tiny-llama"), num_layers=2), seed=0)
    later = split_model(model, 1, 2)[0]
    with pytest.raises(ValueError, match="need position_ids"):
        later(torch.zeros(1, 4, model.config.hidden_size))


@pytest.fixture
def fake_two_ranks():
    """A 2-rank process group inside this process ("fake" backend): enough for checks that fire
    before any communication."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-bert"])
def test_sequence_parallel_rejects_an_uneven_sequence(fake_two_ranks, name):
    """An odd length would give the ranks different message sizes (gloo aborts the process): a
    UserError must come first, on every rank alike (the shape is the same everywhere)."""
    from lmforge.parallel.tensor_parallel import apply_tensor_parallel

    model = build(name, seed=0)
    apply_tensor_parallel(model, fake_two_ranks)
    with pytest.raises(UserError, match="sequence length 15 is not divisible by parallel.tensor=2"):
        model(torch.zeros(2, 15, dtype=torch.long))


def test_gradients_are_laid_out_like_their_parameters_before_the_optimizer(fake_two_ranks):
    """Under sequence parallelism a norm's gradient leaves the backward as a partial sum over the
    tensor ranks (and a vocabulary-parallel embedding's replicated). torch 2.6's optimizer
    stepped each rank's norms with its own partial sum, silently (7e-4 off one process's weights
    after two steps): clipping lays every gradient out like its parameter first, so no optimizer
    meets a partial one."""
    from torch.distributed.tensor import DTensor

    from lmforge.parallel.state import align_gradients
    from lmforge.parallel.tensor_parallel import apply_tensor_parallel

    model = build("tiny-neox", seed=0)
    apply_tensor_parallel(model, fake_two_ranks)
    logits = model(torch.zeros(2, 16, dtype=torch.long))
    logits.to_local().sum().backward()
    params = dict(model.named_parameters())
    unlike = {n for n, p in params.items() if p.grad.placements != p.placements}
    assert {"layers.0.norm1.weight", "layers.0.norm1.bias", "norm.weight"} <= unlike, unlike
    align_gradients(type("PM", (), {"parts": [model]}))
    assert all(
        isinstance(p.grad, DTensor) and p.grad.placements == p.placements for p in params.values()
    )


def test_bert_under_tensor_parallelism_before_torch_2_11_is_one_line(monkeypatch):
    """torch 2.6-2.10 fail BERT's first backward under TP (checked on each): refused before any
    process starts."""
    import lmforge.parallel.mesh as mesh

    monkeypatch.setattr(mesh, "torch_version", lambda: (2, 10))
    with pytest.raises(
        UserError, match=r"BERT under tensor parallelism needs torch 2.11 .* set parallel.tensor=1"
    ):
        check_model(ParallelConfig(tensor=2), preset("tiny-bert"))
    check_model(ParallelConfig(tensor=2), preset("tiny-gpt2"))  # other families are not
    monkeypatch.setattr(mesh, "torch_version", lambda: (2, 11))
    check_model(ParallelConfig(tensor=2), preset("tiny-bert"))


def test_fsdp2_on_the_cpu_before_torch_2_7_is_one_line(monkeypatch):
    """torch 2.6's FSDP2 records events on CPU streams, which have none (its first step failed
    with an AttributeError): refused when the model is laid out, naming DDP."""
    import lmforge.parallel.compose as compose
    from lmforge.parallel import build_mesh, parallelize
    from lmforge.parallel.fake import fake_world

    monkeypatch.setattr(compose, "torch_version", lambda: (2, 6))
    cfg, layout, cpu = preset("tiny-gpt2"), ParallelConfig(data_shard=2), torch.device("cpu")
    with (
        fake_world(cpu, 2, 0),
        pytest.raises(
            UserError, match="FSDP2 on the CPU needs a newer torch .* set trainer.data_parallel=ddp"
        ),
    ):
        parallelize(
            build(cfg, device="meta"),
            layout,
            build_mesh(layout, cfg, device_type="cpu"),
            device=cpu,
        )


def test_pipeline_parallelism_on_the_cpu_before_torch_2_8_is_one_line(monkeypatch):
    """Over gloo the 1F1B schedule's first step never ends on torch 2.6 and 2.7 (both ranks wait
    in its p2p; 2.8 runs it): refused when the model is laid out. lmforge plan's trace (a fake
    process group sends nothing) is not."""
    import lmforge.parallel.compose as compose
    from lmforge.parallel import build_mesh, parallelize
    from lmforge.parallel.fake import fake_world

    cfg, layout, cpu = preset("tiny-gpt2"), ParallelConfig(pipeline=2), torch.device("cpu")
    monkeypatch.setattr(compose, "torch_version", lambda: (2, 7))
    with fake_world(cpu, 2, 0):
        mesh = build_mesh(layout, cfg, device_type="cpu")
        parallelize(build(cfg, device="meta"), layout, mesh, device=cpu)  # the plan's trace
        monkeypatch.setattr(compose.dist, "get_backend", lambda *a: "gloo")
        with pytest.raises(
            UserError,
            match=r"pipeline parallelism on the CPU needs torch 2.8 or later .* this is "
            r"torch .*: upgrade torch, or set parallel.pipeline=1",
        ):
            parallelize(build(cfg, device="meta"), layout, mesh, device=cpu)
        monkeypatch.setattr(compose, "torch_version", lambda: (2, 8))
        parallelize(build(cfg, device="meta"), layout, mesh, device=cpu)


def test_lora_under_tensor_parallelism_before_torch_2_9_is_one_line(tmp_path, monkeypatch):
    """torch 2.6 and 2.8 train LoRA (q,k,v together; experts) under tensor parallelism to other
    gradients than one process, with no error (its layout tests fail there, pass on 2.9+):
    refused before anything is built. Full fine-tuning and DPO without adapters train there like
    one process (since the gradients are laid out like their parameters before the optimizer,
    lmforge.parallel.state.align_gradients)."""
    import lmforge.parallel.mesh as mesh
    from lmforge.train.config_checks import check_torch_for_layout
    from tests.train.conftest import run_config

    monkeypatch.setattr(mesh, "torch_version", lambda: (2, 8))
    lora = run_config("c", tmp_path, "lora.rank=4")
    with pytest.raises(
        UserError,
        match=r"^LoRA under tensor parallelism needs torch 2.9 or later .* this is "
        r"torch .*: upgrade torch, or set parallel.tensor=1$",
    ):
        check_torch_for_layout(lora, 2)
    check_torch_for_layout(lora, 1)
    for task in ("sft", "dpo"):
        check_torch_for_layout(run_config("c", tmp_path, f"data.task={task}", "data.paths=[]"), 2)
    monkeypatch.setattr(mesh, "torch_version", lambda: (2, 9))
    check_torch_for_layout(lora, 2)
