"""The router's training losses of a mixture of experts (lmforge.models.moe): Switch
Transformer's load-balancing loss and ST-MoE's router z-loss, from the router logits the MoE
layers keep in a training forward, as sums additive over any split of the layers (a pipeline's
stages)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lmforge.models.config import ModelConfig
from lmforge.models.moe import moe_layers


@dataclass
class RouterLosses:
    aux_loss: torch.Tensor  # the load-balancing loss, unscaled (transformers' aux_loss)
    z_loss: torch.Tensor  # the router z-loss, unscaled
    # router_aux_loss_coef * aux_loss + router_z_loss_coef * z_loss: what training adds
    loss: torch.Tensor


def router_losses(
    model: nn.Module,
    cfg: ModelConfig,
    attention_mask: torch.Tensor | None = None,
) -> RouterLosses | None:
    """The router losses of the model's last training forward (None for a dense model), over the
    tokens where attention_mask (batch, seq) is 1; the layers' kept logits are released."""
    logits = take_router_logits(model)
    if not logits:
        return None
    sums = router_sums(logits, cfg.experts_per_token, attention_mask)
    aux, z = sums.load_balancing_loss(cfg.num_experts), sums.z_loss()
    return RouterLosses(aux, z, cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z)


def take_router_logits(model: nn.Module) -> list[torch.Tensor]:
    """The router logits the model's MoE layers kept in their last training forward, released
    from the layers."""
    logits = []
    for layer in moe_layers(model):
        if layer.router_logits is not None:
            logits.append(layer.router_logits)
            layer.router_logits = None
    return logits


def _row_mask(logits: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(logits.shape[0], device=logits.device)
    return attention_mask.reshape(-1).to(device=logits.device, dtype=torch.float32)


@dataclass
class RouterSums:
    """What the router losses are made of, summed over MoE layers and (unmasked) tokens: additive
    over any split of the layers (a pipeline's stages), the losses being functions of the sums."""

    # (experts,) how many (token, slot) choices went to each expert; no gradient
    choices: torch.Tensor
    probs: torch.Tensor  # (experts,) each expert's router probability summed
    z: torch.Tensor  # () logsumexp(router logits)^2 summed
    rows: torch.Tensor  # () tokens counted, once per layer

    def load_balancing_loss(self, num_experts: int) -> torch.Tensor:
        return num_experts * torch.sum((self.choices / self.rows) * (self.probs / self.rows))

    def z_loss(self) -> torch.Tensor:
        return self.z / self.rows


def router_sums(
    router_logits: list[torch.Tensor],
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> RouterSums:
    """The RouterSums of some MoE layers' router logits (each (tokens, experts)) over the tokens
    where attention_mask (batch, seq) is 1."""
    device, num_experts = router_logits[0].device, router_logits[0].shape[-1]
    choices = torch.zeros(num_experts, device=device)
    probs_sum = torch.zeros(num_experts, device=device)
    z, rows = torch.zeros((), device=device), torch.zeros((), device=device)
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        keep = _row_mask(logits, attention_mask)
        chosen = probs.topk(top_k, dim=-1).indices.reshape(-1)
        choices = choices.index_add(0, chosen, keep.repeat_interleave(top_k))
        probs_sum = probs_sum + (probs * keep[:, None]).sum(0)
        z = z + (torch.logsumexp(logits.float(), dim=-1).square() * keep).sum()
        rows = rows + keep.sum()
    return RouterSums(choices, probs_sum, z, rows)


def load_balancing_loss(
    router_logits: list[torch.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (its eqs. 4-6) over every MoE layer at once, as
    transformers' load_balancing_loss_func computes it: num_experts * sum_e f_e * P_e, f_e the
    fraction of (token, slot) choices that went to expert e and P_e its mean router probability,
    both averaged over the layers' (unmasked) tokens together. Gradient flows through P only (f
    counts choices)."""
    return router_sums(router_logits, top_k, attention_mask).load_balancing_loss(num_experts)


def router_z_loss(
    router_logits: list[torch.Tensor], attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """ST-MoE's router z-loss: the mean over layers and (unmasked) tokens of logsumexp(router
    logits)^2."""
    return router_sums(router_logits, 1, attention_mask).z_loss()
