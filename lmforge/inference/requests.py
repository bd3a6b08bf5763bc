"""A request as the serving engine holds it: its parameters (`RequestParams`), the events it
hands its consumer (`Event`), and its state while it has a row (`EngineRequest`): tokens, text,
generator, stop ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lmforge.inference.grammar import CompiledGrammar
from lmforge.inference.logprobs import TokenLogprob
from lmforge.inference.penalties import RowSettings
from lmforge.inference.sampling import SamplingParams, seeded_generator
from lmforge.inference.text import TextStream


@dataclass
class RequestParams:
    max_tokens: int = 16
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # stop strings: generation ends at the first, which the text leaves out
    stop: Sequence[str] = ()
    seed: int | None = None  # reproducible sampling (a generator of the request's own)
    skip_special_tokens: bool = True  # special tokens left out of the text (vLLM's default)
    frequency_penalty: float = 0.0  # OpenAI's, over the output tokens (penalties.py)
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its score
    # eos and stop_token_ids masked, stop strings not matched, until this many are generated
    min_tokens: int = 0
    # ids that end generation besides eos (not shown in the text)
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False  # eos does not end generation (stop_token_ids still do)
    # each chosen token's log-probability and this many alternatives; None = off
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the prompt's tokens' too (echo); then max_tokens may be 0
    # a response_format (Grammars.compile): the tokens are masked to fit it
    grammar: CompiledGrammar | None = None
    # prefix-cache blocks are shared only with requests of the same salt (vLLM's cache_salt)
    cache_salt: str | None = None


@dataclass
class Event:
    text: str  # text added since the previous event
    completion_tokens: int  # tokens generated so far (a stop token included)
    # "stop" (eos or stop string), "length", "error", or None while running
    finish_reason: str | None = None
    error: str | None = None
    client_error: bool = False  # the error came from the request's own settings (a 400, not a 500)
    # the stop string that ended it (left out of the text), if one did
    stop_string: str | None = None
    # the tokens generated since the previous event (those shown)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # on the request's first event, where asked


class EngineRequest:
    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        on_event: Callable[[Event], None],
        tokenizer,
        device: torch.device,
        eos_ids: set[int],
    ):
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.on_event = on_event
        self.output_ids: list[int] = []
        self.text = TextStream(
            tokenizer, self.prompt_ids, params.stop, params.skip_special_tokens, params.min_tokens
        )
        self.cancelled = False  # set from the server's thread; read by the engine between steps
        self.finish_reason: str | None = None
        self.slot: int | None = None
        self.admitted_at_step: int | None = None  # the engine's decode step count when it got a row
        self.length = 0  # tokens of this request in the cache
        self.generator = seeded_generator(params.seed, device)
        self.stop_ids = (set() if params.ignore_eos else set(eos_ids)) | set(params.stop_token_ids)
        self.settings = RowSettings(
            params.sampling.repetition_penalty,
            params.frequency_penalty,
            params.presence_penalty,
            params.logit_bias,
            params.min_tokens,
            tuple(sorted(self.stop_ids)),
        )
        self.prompt_logprobs: list[TokenLogprob] | None = None  # handed out with the first event
        self.grammar = None  # its RowGrammar, made by the engine when it gets a row
