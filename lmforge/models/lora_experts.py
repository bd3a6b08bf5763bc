"""LoRA on a mixture of experts' stacked expert weights (moe.Experts): one low-rank update per
expert and weight.

For a stacked weight W (experts, out, in) each expert e gets its own factors, stacked too:

    expert e's rows x:  x W_e^T + scaling * (x A_e^T) B_e^T      A: (experts, rank, in), B: (experts, out, rank)

A drawn as PEFT draws it (Kaiming-uniform over each expert's (rank, in) rows), B zeros: at
initialisation the experts compute what the base computes. The update runs in the experts' grouped
pass (lmforge.models.moe), two grouped GEMMs through the rank per adapted weight; the merged weight
is never formed while training. gate_up's B is (experts, 2, moe_intermediate, rank), its rows laid
out like gate_up's (gate rows, then up rows), so splitting the intermediate dimension (tensor
parallelism) cuts B where it cuts the weight, and every factor shards on the expert dimension like
the weights (expert parallelism).

This is the layout of PEFT's `LoraConfig(target_parameters=[...])` (its ParamWrapper): for
transformers' `mlp.experts.gate_up_proj` (experts, 2 * moe_intermediate, hidden) and `down_proj`
(experts, hidden, moe_intermediate), lora_A is (rank * experts, in) with expert e's rows at e *
rank, lora_B (out, rank * experts) with expert e's column j at j * experts + e; lmforge.models.peft
converts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.models.moe import ExpertLoRA, Experts, stacked

WEIGHTS = ("gate_up", "down")
# Target names (lora.targets) of the stacked weights, each adapted at lora.rank.
EXPERT_TARGETS = {
    "experts": ("gate_up", "down"),
    "experts.gate_up": ("gate_up",),
    "experts.down": ("down",),
}
# The MLP's names on the stacked experts: gate and up are one weight there, adapted at twice the
# rank (expert_ranks).
MLP_ON_EXPERTS = {"gate": "gate_up", "up": "gate_up", "down": "down"}


class LoRAExperts(Experts):
    """moe.Experts (the same gate_up and down tensors as the one it replaces) plus adapters on
    `ranks`' weights: lora_A.<weight>, lora_B.<weight> (module docstring), each weight its own
    rank and alpha."""

    def __init__(
        self,
        base: Experts,
        ranks: dict[str, int],
        alphas: dict[str, float],
        generator: torch.Generator | None = None,
    ):
        nn.Module.__init__(self)
        self.gate_up, self.down = base.gate_up, base.down
        # QLoRA's NF4 ones are 2-D
        experts, _, inter, hidden = stacked(base.gate_up, base.down)[0].shape
        self.rank = {w: ranks[w] for w in WEIGHTS if w in ranks}
        self.scaling = {w: alphas[w] / r for w, r in self.rank.items()}
        inputs, outputs = (
            {"gate_up": hidden, "down": inter},
            {"gate_up": (2, inter), "down": (hidden,)},
        )
        # Drawn on the CPU (a CPU generator makes them the same on every device and rank); the
        # caller moves them.
        device = "meta" if base.gate_up.is_meta else "cpu"
        self.lora_A = nn.ParameterDict(
            {
                w: nn.Parameter(torch.empty(experts, r, inputs[w], device=device))
                for w, r in self.rank.items()
            }
        )
        self.lora_B = nn.ParameterDict(
            {
                w: nn.Parameter(torch.zeros(experts, *outputs[w], r, device=device))
                for w, r in self.rank.items()
            }
        )
        self.adapters_enabled = True
        if device != "meta":
            # PEFT's init of its (rank * experts, in) lora_A: fan_in is `in`
            for a in self.lora_A.values():
                nn.init.kaiming_uniform_(
                    a.data.view(-1, a.shape[-1]), a=math.sqrt(5), generator=generator
                )

    def lora(self) -> ExpertLoRA | None:
        if not self.adapters_enabled:
            return None
        factors = {
            f"{kind}.{w}": getattr(self, kind)[w]
            for w in self.rank
            for kind in ("lora_A", "lora_B")
        }
        return ExpertLoRA(factors, dict(self.scaling))

    def delta(self, weight: str) -> torch.Tensor:
        """What merging adds to `weight`, fp32, shaped like it."""
        return expert_delta(self.lora_A[weight], self.lora_B[weight], self.scaling[weight])

    def extra_repr(self) -> str:
        return f"lora_rank={self.rank}"


def expert_ranks(
    targets: list[str],
    rank: int,
    family: str,
    has_experts: bool,
    as_given: Callable[[list[str]], str] = ",".join,
) -> dict[str, int]:
    """The stacked expert weights that lora.targets `targets` adapt, with their ranks: `experts`,
    `experts.gate_up`, `experts.down` at lora.rank `rank` (PEFT's target_parameters with r). On a
    mixture of experts gate, up and down name the experts too: down at rank r, gate and up (two
    rank-r adapters on a dense MLP) one adapter of rank 2r on their stacked weight, its alpha
    doubled too (the same scaling), which is what PEFT makes of gate_proj,up_proj (Mixtral's
    w1,w3) or all-linear on transformers 5's stacked experts. `as_given` spells target names in
    errors as the user wrote them (LoRAConfig.as_given)."""
    named = [t for t in targets if t in EXPERT_TARGETS]
    if named and not has_experts:
        raise UserError(
            f"lora.targets: {named[0]} names a mixture of experts' stacked experts, and this "
            f"{family} model has none (model.num_experts=0): drop it"
        )
    ranks, asked = {}, {}
    for t in named:
        for w in EXPERT_TARGETS[t]:
            ranks[w], asked[w] = rank, [*asked.get(w, []), t]
    mlp = [t for t in MLP_ON_EXPERTS if t in targets] if has_experts else []
    if ("gate" in mlp) != ("up" in mlp):
        raise UserError(
            f"lora.targets: {family}'s experts keep gate and up in one stacked weight (Hugging Face's "
            f"gate_up_proj), so one adapter covers both: target gate,up together, not "
            f"{as_given(mlp[:1])} alone"
        )
    for t in mlp:
        w = MLP_ON_EXPERTS[t]
        if t != "up":
            ranks[w], asked[w] = rank * (2 if w == "gate_up" else 1), [*asked.get(w, []), t]
    both = {w: names for w, names in asked.items() if len(names) > 1}
    if both:
        w, names = next(iter(both.items()))
        raise UserError(
            f"lora.targets: {' and '.join(as_given([n]) for n in names)} both adapt the experts' {w} "
            "weight: keep one"
        )
    return {w: ranks[w] for w in ("gate_up", "down") if w in ranks}


def expert_delta(a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """scaling * B_e A_e for every expert e, fp32, (experts, out..., in): a (experts, rank, in),
    b (experts, out..., rank)."""
    delta = torch.bmm(b.float().flatten(1, -2), a.float()) * scaling
    return delta.view(*b.shape[:-1], a.shape[-1])


def to_peft(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One stacked weight's factors -> PEFT's ParamWrapper lora_A (rank * experts, in), lora_B
    (out, rank * experts)."""
    experts, rank = a.shape[:2]
    b = b.flatten(1, -2)  # (experts, out, rank)
    return a.reshape(experts * rank, a.shape[-1]), b.permute(1, 2, 0).reshape(
        b.shape[1], rank * experts
    )


def from_peft(a: torch.Tensor, b: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of to_peft: A (experts, rank, in), B (experts, out, rank) (gate_up's B: view
    it as its weight)."""
    rank = a.shape[0] // experts
    return a.reshape(experts, rank, a.shape[1]), b.reshape(b.shape[0], rank, experts).permute(
        2, 0, 1
    )
