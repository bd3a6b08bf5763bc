"""The checks of scripts/gpu_check.py, registered in the order they run (CHECKS)."""

from gpu_checks import environment, models, moe, training  # noqa: F401  (each module registers its checks)
from gpu_checks.base import CHECKS, Context, Result, Skip, free, log

__all__ = ["CHECKS", "Context", "Result", "Skip", "free", "log"]
