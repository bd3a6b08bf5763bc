"""GRPO (Shao et al. 2024) in the training loop: rollouts on the live training weights inside each
step, rewards, group advantages, and the clipped policy loss of lmforge.rl (docs/rl.md).

Batch sizes count completions, as TRL's per_device_train_batch_size does: a micro-batch of
trainer.micro_batch_size completions holds micro_batch_size / grpo.num_generations prompts with all
their completions, so a group's advantages never span two micro-batches or two ranks. The data
stream counts completion slots too (slot g is prompt g // num_generations of the shuffled prompts),
so consumed_samples, resume and data parallelism stay the trainer's.

Before a step's forward (`before_step`) each micro-batch of prompt records becomes a rollout batch:
the model itself (no copy, DDP's module unwrapped, FSDP2's units gathered) in eval mode under
no_grad samples the completions, then goes back to train mode; under tensor or pipeline
parallelism a whole copy of the live weights on each rank does, freed before the forward
(grpo_layout, which also scores rollout batches through a pipeline). A micro-batch's sampling seed is drawn from
(trainer.seed, its first slot): the same rows draw the same tokens in one process or over
data-parallel ranks, and a resumed run draws what the uninterrupted one drew, with no generator
state to keep. With grpo.num_iterations = 1 the old policy's log-probabilities are the training
forward's own, detached: the trainer's recomputation bit for bit (docs/rl.md), so the ratio is
exactly 1 and no extra forward runs.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math

import numpy as np
import torch

from lmforge.errors import UserError
from lmforge.parallel.data_parallel import unwrap
from lmforge.rl.advantages import STD_EPS, group_advantages
from lmforge.rl.data import read_prompts, reward_completions, reward_inputs
from lmforge.rl.loss import policy_loss
from lmforge.rl.rewards import Rewards, RewardState
from lmforge.rl.rollout import completion_logps, rollout
from lmforge.train.config import RunConfig
from lmforge.train.loss import IGNORE_INDEX
from lmforge.train.tasks import grpo_layout
from lmforge.train.tasks.base import (
    Batch,
    Epochs,
    Task,
    TaskData,
    data_files,
    reference_forward,
    total_samples,
)

log = logging.getLogger(__name__)

# The statistics a micro-batch's loss returns, summed over micro-batches and ranks (then one triple
# per function).
STATS = (
    "tokens",
    "kl",
    "clipped_low",
    "clipped_high",
    "clipped",
    "entropy",
    "logprob_diff",
    "completions",
    "truncated",
    "completion_tokens",
    "zero_std",
    "reward_sum",
    "reward_sq",
    "reward_n",
)


class Slots(torch.utils.data.Dataset):
    """Completion slots over prompts: slot g is prompt g // group, with its slot number (the
    rollout's seed)."""

    def __init__(self, prompts: torch.utils.data.Dataset, group: int):
        self.prompts, self.group = prompts, group

    def __len__(self) -> int:
        return len(self.prompts) * self.group

    def __getitem__(self, g: int):
        return int(g), self.prompts[int(g) // self.group]


def collate_slots(items: list) -> dict:
    """A micro-batch of slots: its records (each repeated num_generations times) and its first
    slot."""
    return {"first_slot": items[0][0], "records": [record for _, record in items]}


def _std(total: float, squares: float, n: float) -> float:
    """The Bessel-corrected std from a sum, a sum of squares and a count (0 with fewer than two)."""
    return math.sqrt(max(squares - total * total / n, 0.0) / (n - 1)) if n > 1 else 0.0


class GRPO(Task):
    name = "grpo"
    num_stats = len(STATS)

    reference = None  # beta > 0 without LoRA: a frozen copy of the initial model (a ParallelModel)
    lora_reference = False
    skeleton = None  # tensor or pipeline parallelism: the model on meta, which a rollout fills

    def build_data(self, cfg: RunConfig, tokenizer) -> TaskData:
        g, t = cfg.grpo, cfg.trainer
        g.check()
        if g.num_iterations > 1:
            raise UserError(
                f"grpo.num_iterations={g.num_iterations}: reusing a batch of rollouts for several steps "
                "is coming; set grpo.num_iterations=1"
            )
        if t.micro_batch_size % g.num_generations:
            raise UserError(
                f"trainer.micro_batch_size={t.micro_batch_size} is not a multiple of "
                f"grpo.num_generations={g.num_generations}: batch sizes count completions (as TRL's) and "
                "a prompt's completions share one micro-batch; set it to a multiple of "
                f"{g.num_generations}"
            )
        self.cfg, self.tokenizer, self.group = cfg, tokenizer, g.num_generations
        self.rewards = Rewards(g.rewards, g.reward_weights, g.format_pattern)
        self.num_stats = len(STATS) + 3 * len(self.rewards.names)
        from lmforge.train.tasks.sft import run_chat_template

        template = run_chat_template(cfg, tokenizer, log)
        train_file, _ = data_files(cfg)
        records = read_prompts(
            train_file, tokenizer, template, cfg.data.seq_length, g.max_completion_length
        )
        if cfg.data.max_train_examples:
            records = records[: cfg.data.max_train_examples]
        prompts = Epochs(records, total_samples(cfg) // g.num_generations, t.seed)
        # The export and `serve` prompt as the chat prompts were rendered.
        rendered = (
            template.source if template is not None and any(r.chat for r in records) else None
        )
        return TaskData(
            Slots(prompts, g.num_generations), None, collate_slots, chat_template=rendered
        )

    def prepare(self, model: torch.nn.Module, cfg: RunConfig, layout, device: torch.device) -> None:
        if getattr(layout, "expert", 1) > 1:
            raise UserError(
                f"data.task=grpo under expert parallelism (parallel.expert={layout.expert}) is not "
                "supported: set parallel.expert=1 (tensor, pipeline and data parallelism roll out)"
            )
        self.vocab_size = model.config.vocab_size if model is not None else 0
        # tensor or pipeline parallelism: the rollout fills a meta copy with the whole weights
        if layout.tensor > 1 or layout.pipeline > 1:
            self.skeleton = grpo_layout.meta_copy(model)
        if not cfg.grpo.beta:
            return
        if cfg.lora is not None:
            self.lora_reference = True
            log.info(
                "GRPO reference (grpo.beta=%s): the base model without its adapters", cfg.grpo.beta
            )
        else:
            log.info(
                "GRPO reference (grpo.beta=%s): a frozen copy of the initial model", cfg.grpo.beta
            )
            # built on the meta device: each rank fills its own shards, as the
            # policy's
            if layout.shards_model:
                from lmforge.train.setup import init_model

                dtype = cfg.precision_for(device).param_dtype
                reference, fill = init_model(cfg, meta=True, device=device, dtype=dtype)
                if fill is None:
                    reference.to(device, dtype)
            else:
                reference, fill = copy.deepcopy(model), None
            self._unlaid = (reference.eval().requires_grad_(False), fill)

    def lay_out(self, lay_out) -> None:
        # laid out as the policy: a ParallelModel, no gradients
        if getattr(self, "_unlaid", None) is not None:
            self.reference, self._unlaid = lay_out(*self._unlaid), None

    # -- the rollouts, before the step's forward ---------------------------------------------

    def before_step(self, micro: list, training, step: int) -> list[Batch]:
        """The step's micro-batches of prompt records as rollout batches, sampled by the training
        model itself."""
        with training._autocast(), self._rollout_model(training.pm) as model:
            rolled = [self._roll_out(model, m, step) for m in micro]
        # the std of every reward of the step, over the ranks too
        if self.cfg.grpo.reward_scaling == "batch":
            from lmforge.parallel import all_reduce_data_parallel

            sums = torch.zeros(3, dtype=torch.float64)
            for _, total in rolled:
                ok = total[~total.isnan()].double()
                sums += torch.stack([ok.sum(), (ok * ok).sum(), torch.tensor(float(ok.numel()))])
            device = rolled[0][0]["input_ids"].device
            s, sq, n = all_reduce_data_parallel(sums.to(device), training.mesh).tolist()
            for batch, _ in rolled:
                batch["advantages"] = batch["advantages"] / (_std(s, sq, n) + STD_EPS)
        batches = [batch for batch, _ in rolled]
        if training.pm.pipelined:
            self.rollout_stats = len(batches[0]["rollout_stats"])
            batches = [grpo_layout.pipeline_batch(b, self.rollout_stats) for b in batches]
        return batches

    @contextlib.contextmanager
    def _rollout_model(self, pm):
        """The model a rollout samples from, in eval mode: a whole copy of the live weights under
        tensor or pipeline parallelism (grpo_layout), else the model itself (DDP's module
        unwrapped, FSDP2's units gathered)."""
        if self.skeleton is not None:
            with grpo_layout.rollout_copy(self.skeleton, pm) as model:
                yield model
            return
        model = unwrap(pm.parts[0])
        was_training = model.training
        model.eval()
        try:
            with grpo_layout.gathered(model):
                yield model
        finally:
            model.train(was_training)

    def _seed(self, first_slot: int) -> int:
        return int(
            np.random.SeedSequence([self.cfg.trainer.seed, 0x67727030, first_slot]).generate_state(
                1
            )[0]
        )

    def _roll_out(
        self, model: torch.nn.Module, micro: dict, step: int
    ) -> tuple[Batch, torch.Tensor]:
        g, G = self.cfg.grpo, self.group
        records = micro["records"][::G]
        stops = _stop_ids(model)
        out = rollout(
            model,
            [r.ids for r in records],
            G,
            g.max_completion_length,
            temperature=g.temperature,
            top_k=g.top_k or None,
            top_p=g.top_p if g.top_p < 1 else None,
            stop_token_ids=stops,
            seed=self._seed(micro["first_slot"]),
        )
        ids = out.completions()
        prompts, columns = reward_inputs(records, G)
        texts = reward_completions(self.tokenizer, records, ids, G, stops)
        scores = self.rewards(
            prompts, texts, ids, columns, RewardState(step, self.cfg.trainer.max_steps)
        )
        scaling = "none" if g.reward_scaling == "batch" else g.reward_scaling
        adv = group_advantages(scores.total, G, scaling)
        rows, width = out.completion_ids.shape[0], out.prompt_ids.shape[1]
        device = out.prompt_ids.device

        # completion-width -> prompt + completion (0 on the prompt)
        def full(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t.new_zeros(rows, width), t], 1)

        stats = [
            rows,
            float(out.truncated.sum()),
            float(out.completion_mask.sum()),
            adv.zero_std_fraction * rows,
        ]
        for column in [scores.total, *scores.per_function.unbind(1)]:
            ok = column[~column.isnan()].double()
            stats += [float(ok.sum()), float((ok * ok).sum()), float(ok.numel())]
        batch = {
            "input_ids": torch.cat([out.prompt_ids, out.completion_ids], 1),
            "attention_mask": torch.cat([out.prompt_mask, out.completion_mask], 1),
            "loss_mask": full(out.loss_mask(g.mask_truncated_completions)),
            "sampling_logps": full(out.sampling_logps),
            "advantages": adv.advantages.to(device),
            "prompt_length": torch.tensor(width),
            "rollout_stats": torch.tensor(stats, dtype=torch.float64),
        }
        return batch, scores.total

    # -- the loss ------------------------------------------------------------------------------

    # A batch without rollout fields (lmforge plan's stand-in, which samples nothing) is read as a
    # language-model batch of the same rows: the step's forward and backward, without the rollout's
    # KV cache.

    def inputs(self, batch: Batch):
        if "loss_mask" not in batch:
            return super().inputs(batch)
        labels = batch["input_ids"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)
        inputs = {"attention_mask": batch["attention_mask"]}
        if "position_ids" in batch:  # a pipeline's (grpo_layout.pipeline_batch)
            inputs["position_ids"] = batch["position_ids"]
        return batch["input_ids"], labels, inputs

    def count(self, batch: Batch) -> int:
        """What the step's summed loss is divided by (lmforge.rl.loss): completions, or tokens
        for dapo."""
        if "loss_mask" not in batch:
            return super().count(batch)
        g, rows = self.cfg.grpo, batch["input_ids"].shape[0]
        if g.loss_type in ("grpo", "bnpo"):
            return rows
        if g.loss_type == "dr_grpo":
            return rows * g.max_completion_length
        return int(batch["loss_mask"].sum())

    def split(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """(prompt ids, prompt mask, completion ids, completion mask) of a rollout batch."""
        p = int(batch["prompt_length"])
        ids, mask = batch["input_ids"], batch["attention_mask"]
        return ids[:, :p], mask[:, :p], ids[:, p:], mask[:, p:]

    def reference_logps(
        self, model: torch.nn.Module, parts: tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        temperature = self.cfg.grpo.temperature
        return reference_forward(
            self.reference, model, lambda m: completion_logps(unwrap(m), *parts, temperature)[0]
        )

    def loss(self, model: torch.nn.Module, batch: Batch, fused: bool = True):
        if "loss_mask" not in batch:
            loss, count, _ = super().loss(model, batch, fused)
            return loss, count, (0,) * self.num_stats
        g = self.cfg.grpo
        parts = self.split(batch)
        completion_mask = parts[3]
        p = parts[0].shape[1]
        logps, entropy = completion_logps(model, *parts, g.temperature, with_entropy=True)
        ref = None
        if g.beta:
            with torch.no_grad():
                ref = self.reference_logps(model, parts)
        mask = batch["loss_mask"][:, p:]
        loss, count, stats = policy_loss(
            logps,
            batch["advantages"],
            mask,
            loss_type=g.loss_type,
            epsilon=g.epsilon,
            epsilon_high=g.epsilon_high,
            beta=g.beta,
            ref_logps=ref,
            max_completion_length=g.max_completion_length,
        )
        with torch.no_grad():
            spent = (entropy * mask).sum()
            diff = ((batch["sampling_logps"][:, p:] - logps) * completion_mask).abs().sum()
        return loss, count, (*stats.as_tuple(), spent, diff, *batch["rollout_stats"].unbind())

    # Under a pipeline (grpo_layout): the reference's log-probabilities first, over the local
    # batch; then the loss per microbatch on the last stage, in sequence positions.

    def pipeline_target(self, pm, batch: Batch) -> torch.Tensor:
        g = self.cfg.grpo
        ref = (
            grpo_layout.pipelined_reference_logps(self.reference, pm, batch, g.temperature)
            if g.beta
            else None
        )
        return grpo_layout.pipeline_target(batch, ref, self.rollout_stats)

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor):
        return grpo_layout.pipeline_loss(self.cfg.grpo, self.vocab_size, logits, target)

    def train_metrics(self, count: float, *stats: float) -> dict[str, float]:
        if len(stats) < len(STATS):
            return {}
        s = dict(zip(STATS, stats))
        tokens, rows = max(s["tokens"], 1.0), max(s["completions"], 1.0)
        out = {
            "reward": s["reward_sum"] / max(s["reward_n"], 1.0),
            "reward_std": _std(s["reward_sum"], s["reward_sq"], s["reward_n"]),
        }
        for i, name in enumerate(self.rewards.names):
            total, squares, n = stats[len(STATS) + 3 * i : len(STATS) + 3 * i + 3]
            out[f"rewards/{name}/mean"] = total / n if n else math.nan
            out[f"rewards/{name}/std"] = _std(total, squares, n)
        if self.cfg.grpo.beta:
            out["kl"] = s["kl"] / tokens
        out |= {
            "clip_ratio/low_mean": s["clipped_low"] / tokens,
            "clip_ratio/high_mean": s["clipped_high"] / tokens,
            "clip_ratio/region_mean": s["clipped"] / tokens,
            "entropy": s["entropy"] / tokens,
            "logprob_diff": s["logprob_diff"] / max(s["completion_tokens"], 1.0),
            "completions/mean_length": s["completion_tokens"] / rows,
            "completions/truncated_fraction": s["truncated"] / rows,
            "frac_reward_zero_std": s["zero_std"] / rows,
        }
        return out


def _stop_ids(model: torch.nn.Module) -> list[int]:
    from lmforge.inference.text import eos_token_ids

    return sorted(eos_token_ids(model))
