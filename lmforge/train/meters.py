"""A run's meters: what its throughput, MFU and cost are measured against (the device's peak, the
model's FLOPs per token, the nodes paid for), each step's figures, and the totals of this
invocation's steps (its last line)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmforge.devices import device_label
from lmforge.models.config import ModelConfig
from lmforge.train.config import Precision, RunConfig
from lmforge.train.lora import LORA_FLOPS_FRACTION
from lmforge.train.metrics import (
    MFU,
    RunTotals,
    cpu_peak_key,
    float8_mfu,
    flops_per_token,
    peak_flops,
    tokens_per_dollar,
)
from lmforge.train.setup import memory_gb


@dataclass
class RunMeters:
    peak: float  # FLOP/s per process
    # where `peak` comes from: "config", a measurement, a datasheet ("unused": nothing trains)
    peak_source: str
    flops_per_token: float
    mfu: MFU
    mfu_fp8: MFU | None  # trainer.float8: MFU against the FP8 peak too
    totals: RunTotals
    nodes: int  # cost.usd_per_hour prices one machine; a multi-node torchrun pays for every node
    usd_per_hour: float
    global_batch_size: int
    device: torch.device

    @classmethod
    def of(
        cls,
        cfg: RunConfig,
        mcfg: ModelConfig,
        precision: Precision,
        device: torch.device,
        world_size: int,
        first_step: int,
        nodes: int,
        trains: bool = True,
    ) -> RunMeters:
        """`trains` false (a finished run's rerun): no seconds spent measuring a peak nothing is
        measured against."""
        cost = cfg.cost
        if cost.peak_flops or not trains:
            peak, source = cost.peak_flops or 1.0, "config" if cost.peak_flops else "unused"
        else:
            peak, source = peak_flops(device, precision.compute_dtype)
        per_token = flops_per_token(mcfg, cfg.data.seq_length)
        if cfg.lora is not None:
            per_token *= LORA_FLOPS_FRACTION
        measured = not cost.peak_flops and device.type == "cpu"
        mfu = MFU(
            per_token,
            peak,
            source,
            world_size,
            cpu_peak_key(precision.compute_dtype) if measured else None,
        )
        fp8 = (
            float8_mfu(device, per_token, world_size, cost.peak_flops_fp8)
            if cfg.trainer.float8
            else None
        )
        return cls(
            peak,
            source,
            per_token,
            mfu,
            fp8,
            RunTotals(first_step),
            nodes,
            cost.usd_per_hour,
            cfg.trainer.global_batch_size,
            device,
        )

    def describe(self, processes: int) -> str:
        return (
            f"{processes} process{'es' * (processes > 1)} on {device_label(self.device)}; peak "
            f"{self.peak / 1e12:.3g} TFLOP/s per process ({self.peak_source}); {self.flops_per_token:.3g} model "
            "FLOPs per token"
        )

    @property
    def usd_per_hour_paid(self) -> float:
        return self.usd_per_hour * self.nodes

    def step(self, step_time: float, tokens: float) -> dict[str, float]:
        """A step's figures (added to the totals): its time, tokens and sequences per second,
        MFU, memory, cost."""
        self.totals.add(tokens, step_time)
        tps = tokens / step_time
        per_dollar = tokens_per_dollar(tps, self.usd_per_hour, nodes=self.nodes)
        return {
            "step_time": step_time,
            "tokens_per_second": tps,
            "sequences_per_second": self.global_batch_size / step_time,
            "mfu": self.mfu(tps),
            **({"mfu_fp8": self.mfu_fp8(tps)} if self.mfu_fp8 is not None else {}),
            "memory_gb": memory_gb(self.device),
            **(
                {"tokens_per_dollar": per_dollar, "usd_per_million_tokens": 1e6 / per_dollar}
                if per_dollar
                else {}
            ),
        }

    def summary(self, step: int, wall: float, last: dict[str, float]) -> str:
        return self.totals.summary(step, wall, last, self.mfu, self.usd_per_hour_paid)
