"""The checks of scripts/gpu_check.py, registered in the order they run (CHECKS): each module
registers its own."""

# isort: off
from gpu_checks import environment, models, moe, training  # noqa: F401
from gpu_checks import lora  # noqa: F401  (last: LoRA and QLoRA runs after the training path has passed)
from gpu_checks import plan_memory  # noqa: F401  (after the runs it measures have passed on their own)

# isort: on
from gpu_checks.base import CHECKS, Context, Result, Skip, free, log

__all__ = ["CHECKS", "Context", "Result", "Skip", "free", "log"]
