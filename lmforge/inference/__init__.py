"""Inference: a preallocated KV cache, sampling, and batched generation."""

from lmforge.inference.cache import KVCache
from lmforge.inference.generate import generate, generate_text, left_pad
from lmforge.inference.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    choose_next,
    process_logits,
    top_k_filter,
    top_p_filter,
)
from lmforge.inference.text import TextStream, completion_text, eos_token_ids

__all__ = [
    "KVCache",
    "SamplingParams",
    "TextStream",
    "apply_repetition_penalty",
    "choose_next",
    "completion_text",
    "eos_token_ids",
    "generate",
    "generate_text",
    "left_pad",
    "process_logits",
    "top_k_filter",
    "top_p_filter",
]
