"""Training checkpoints: torch.distributed.checkpoint, atomic, with top-k + last retention."""

from lmforge.checkpoint.manager import CheckpointManager, load_model_weights

__all__ = ["CheckpointManager", "load_model_weights"]
