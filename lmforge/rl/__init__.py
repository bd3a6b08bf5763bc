"""Reinforcement learning from verifiable rewards (GRPO): the parts a GRPO task builds on.

    config.py      GRPOConfig: the grpo.* settings, TRL's names and defaults
    data.py        prompts JSONL: a text or chat prompt per record, the other fields kept for the rewards
    rewards.py     reward functions with TRL's signature: built-ins, module:function, weights, None = left out
    advantages.py  group-relative advantages, scaled by the group's, the batch's or no std
    rollout.py     num_generations completions per prompt on lmforge's own decoder, with the sampled tokens'
                   log-probabilities; the trainer-side recomputation of them (one forward)
    loss.py        the clipped policy loss with KL to a reference, normalised as TRL's loss types

A package of its own beside train/ and inference/: a rollout is inference on the training weights and the loss is
training, and both the trainer's task and anything else (scoring a model's completions) use these parts.
"""
