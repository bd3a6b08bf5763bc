"""Parallelism applied to a model from outside: data parallel (DDP, FSDP2) for now."""
