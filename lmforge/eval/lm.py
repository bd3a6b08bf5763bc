"""lmforge models as an lm-evaluation-harness backend: `LMForgeLM`, registered with lm-eval as
"lmforge".

It answers lm-eval's three request types on an lmforge model and tokenizer (a folder read by
lmforge.models.source, or a live model handed over by the trainer):

    loglikelihood           (context, continuation) -> (log p(continuation | context), greedy?)
    loglikelihood_rolling   text -> log p(text), in windows of the model's context (perplexity tasks)
    generate_until          (context, gen_kwargs) -> text, through lmforge.inference.generate (KV cache)

What is scored is what lm-eval's own causal `hf` backend scores, token for token: the continuation's
tokens are those of encode(context + continuation) after encode(context) (a context's trailing
spaces move to the continuation), an empty context is the prefix token (the hf backend's:
`prefix_token_id` where given, else the tokenizer's bos, else its eos; Qwen's declare no bos), text
starts with bos exactly when the tokenizer's rule says so (Tokenizer.add_bos_token: Llama yes, GPT-2
and NeoX no), inputs are cut from the left to the model's context, and a generation is decoded on
its own, special tokens skipped, and cut at the first stop string. The computing is
lmforge.eval.scoring's and lmforge.inference's.

    lm = LMForgeLM("runs/x/checkpoints/step-00001000", batch_size=16)
    lm_eval.simple_evaluate(model=lm, tasks=["sst2_local"], metadata={"data_dir": "/data"})
    LMForgeLM("BASE", peft="runs/sft/hf-adapter")  # base + a PEFT LoRA adapter (the hf backend's peft=)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from torch import nn

from lmforge.errors import UserError
from lmforge.eval.scoring import score_requests
from lmforge.inference.generate import check_can_generate, generate
from lmforge.inference.text import eos_token_ids

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 16  # what batch_size="auto" means here: rows of one forward


@register_model("lmforge")
class LMForgeLM(TemplateLM):
    """An lmforge decoder and its tokenizer, as lm-eval sees a model."""

    def __init__(
        self,
        pretrained: str | Path | None = None,
        *,
        model: nn.Module | None = None,
        tokenizer=None,
        tokenizer_path: str | Path | None = None,
        # a PEFT LoRA adapter folder, merged into `pretrained` (the hf backend's name)
        peft: str | Path | None = None,
        batch_size: int | str | None = DEFAULT_BATCH_SIZE,
        max_batch_size: int | None = None,  # lm-eval passes it; rows per forward are batch_size
        device: str | torch.device | None = "auto",
        dtype: str | None = None,
        max_length: int | str | None = None,
        max_gen_toks: int | str = 256,
        # what an empty context is conditioned on (the hf backend's name)
        prefix_token_id: int | str | None = None,
        progress: bool = True,  # False: no progress bars (an eval inside training logs one line)
    ):
        super().__init__()
        self.progress = progress
        if model is None:
            if pretrained is None:
                raise UserError(
                    "LMForgeLM needs a model folder (pretrained=...) or a model and tokenizer"
                )
            model, tokenizer = load_model_and_tokenizer(
                pretrained, tokenizer_path, device, dtype, peft
            )
        elif tokenizer is None:
            raise UserError("LMForgeLM was given a model without its tokenizer: pass tokenizer=...")
        elif peft is not None:
            raise UserError(
                "LMForgeLM's peft= adapter goes onto a model folder (pretrained=...), not a live model: "
                "load it into the model first (lmforge.models.peft_read.load_peft_adapter)"
            )
        check_can_generate(model, "score lm-eval's requests (log-likelihoods, generations)")
        if tokenizer.vocab_size > model.config.vocab_size:
            raise UserError(
                f"the tokenizer has {tokenizer.vocab_size} ids but the model only "
                f"{model.config.vocab_size}: evaluate the model with its own tokenizer"
            )
        self.model, self.tokenizer = model, tokenizer
        self.name = str(pretrained) if pretrained is not None else "live-model"
        if peft is not None:
            self.name += f" --lora {peft}"
        self.batch_size = _batch_size(batch_size)
        self.max_length = context_length(max_length, model.config.max_position_embeddings)
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(model.parameters()).device
        eos = (
            tokenizer.eos_id
            if tokenizer.eos_id is not None
            else min(eos_token_ids(model), default=None)
        )
        if eos is None:
            raise UserError(
                "neither the tokenizer nor the model config names an eos token, which lm-eval "
                "needs (the prefix of an empty context, the end of a generation)"
            )
        self._eos = eos
        self.custom_prefix_token_id = _token_id(prefix_token_id, model.config.vocab_size)

    # -- what lm-eval asks of a model ------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._eos

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context (and a rolling window's first) is conditioned on, as
        lm-eval's HFLM picks it: the one given, else bos, else eos. bos is the one the tokenizer
        files declare, none where they say null (Qwen2.5): AutoTokenizer's, which the hf backend
        reads."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        return self.tokenizer.bos_id if self.tokenizer.bos_id is not None else self._eos

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.files[0]).replace("/", "__")

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, **kwargs
    ) -> list[int]:
        """Ids of `string`, as the hf backend encodes it: with bos when the tokenizer's rule says
        so (add_special_tokens None or True) and the text does not already start with bos's text;
        never with add_special_tokens=False."""
        bos = self.tokenizer.add_bos_token and add_special_tokens is not False
        if (
            bos
            and add_special_tokens is None
            and string.startswith(self.tokenizer.decode([self.prefix_token_id]))
        ):
            bos = False
        # Special-token text in a task ("<unk>" all over WikiText v1) is that token, as the hf
        # backend reads it, here only: lmforge.tokenizers reads it as characters elsewhere.
        with self.tokenizer.reading_special_tokens():
            return self.tokenizer.encode(string, add_bos=bos)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        # lm-eval's own (it tokenizes under a bar of its own, then calls _loglikelihood_tokens),
        # quiet when asked.
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

    def _loglikelihood_tokens(
        self, requests, disable_tqdm: bool = False, **kwargs
    ) -> list[tuple[float, bool]]:
        with _progress(
            len(requests), "loglikelihood", disable_tqdm or not self.progress
        ) as progress:
            results = score_requests(
                self.model,
                [(ctx, cont) for _, ctx, cont in requests],
                batch_size=self.batch_size,
                max_length=self.max_length,
                progress=progress,
            )
        for (strings, _, _), answer in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for window in get_rolling_token_windows(
                self.tok_encode(text), self.prefix_token_id, self.max_length, 1
            ):
                windows.append(make_disjoint_window(window))
                owner.append(i)
        with _progress(
            len(windows), "loglikelihood_rolling", disable_tqdm or not self.progress
        ) as progress:
            scores = score_requests(
                self.model,
                windows,
                batch_size=self.batch_size,
                max_length=self.max_length,
                greedy=False,
                progress=progress,
            )
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, scores):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}  # requests with the same generation settings run together
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        with _progress(
            len(requests), "generate_until", disable_tqdm or not self.progress
        ) as progress:
            for members in groups.values():
                self._generate_group([requests[i] for i in members], members, results, progress)
        return results

    # -- generation ------------------------------------------------------------------------------

    def _generate_group(
        self, requests, members: list[int], results: list, progress: Callable[[int], None]
    ) -> None:
        kwargs = normalize_gen_kwargs(requests[0].args[1], self.max_gen_toks)
        until = handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tokenizer.decode([self._eos])
        )
        max_new = kwargs.pop("max_gen_toks")
        room = self.max_length - max_new
        if room <= 0:
            raise UserError(
                f"the task asks for up to {max_new} new tokens but the model's context is "
                f"{self.max_length}: lower the task's max_gen_toks"
            )
        sampling = {
            "do_sample": bool(kwargs.pop("do_sample", False)),
            "temperature": kwargs.pop("temperature", 0.0),
        }
        for key in ("top_k", "top_p", "seed"):
            if key in kwargs:
                sampling[key] = kwargs.pop(key)
        if kwargs:
            log.warning("generation settings lmforge does not use: %s", sorted(kwargs))
        prompts = [self.tok_encode(req.args[0])[-room:] for req in requests]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        stops = eos_token_ids(self.model, self.tokenizer)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]

            def has_stop(row: int, ids: list[int]) -> bool:
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                return any(s and s in text for s in until)

            outputs = generate(
                self.model,
                [prompts[i] for i in batch],
                max_new,
                stop_token_ids=sorted(stops),
                should_stop=has_stop,
                **sampling,
            )
            for i, ids in zip(batch, outputs):
                text = postprocess_generated_text(
                    self.tokenizer.decode(ids, skip_special_tokens=True), until, None
                )
                results[members[i]] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
            progress(len(batch))


def context_length(max_length: int | str | None, positions: int, param: str = "max_length") -> int:
    """The context to score in: `max_length` (`param`, as the user wrote it), else the model's
    `positions`.

    Past its positions a model does not run as trained (a rotary one goes on without an error,
    its perplexity changed; a learned table has no row), so a longer context is refused, as
    `generate` refuses one."""
    if max_length in (None, ""):
        return positions
    length = _at_least_one(max_length, param, " of tokens")
    if length > positions:
        raise UserError(
            f"this model's context is {positions} tokens (max_position_embeddings) and {param} is "
            f"{length}: give {param} {positions} or less, or omit it to use the model's"
        )
    return length


def _token_id(value: int | str | None, vocab_size: int) -> int | None:
    """`prefix_token_id` as given (None: not given), checked to be one of the model's ids."""
    if value in (None, ""):
        return None
    try:
        token = int(value)
    except ValueError:
        raise UserError(
            f"prefix_token_id must be a token id (a whole number), got {value!r}"
        ) from None
    if not 0 <= token < vocab_size:
        raise UserError(
            f"prefix_token_id {token} is not one of the model's ids (0 to {vocab_size - 1}): give one"
        )
    return token


def _batch_size(value: int | str | None) -> int:
    if value in (None, "auto") or str(value).startswith("auto:"):
        return DEFAULT_BATCH_SIZE
    return _at_least_one(value, "batch size", " or 'auto'")


def _at_least_one(value: int | str, what: str, or_else: str) -> int:
    """`value` as a whole number >= 1, else a UserError naming `what` (and `or_else`, what else
    it may be)."""
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"{what} must be a whole number{or_else}, got {value!r}") from None
    if number < 1:
        raise UserError(f"{what} must be >= 1, got {number}")
    return number


class _progress:
    """A tqdm bar over `total` requests (off when lm-eval says so), as a progress(n) callback."""

    def __init__(self, total: int, what: str, disable: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=f"lmforge {what}", disable=disable or total == 0)

    def __enter__(self) -> Callable[[int], None]:
        return self.bar.update

    def __exit__(self, *exc) -> None:
        self.bar.close()


def load_model_and_tokenizer(
    path: str | Path,
    tokenizer_path: str | Path | None = None,
    device: str | torch.device | None = "auto",
    dtype: str | None = None,
    peft: str | Path | None = None,
):
    """The model of an lmforge folder, HF folder or training checkpoint (read directly: no
    export), with the PEFT LoRA adapter `peft` merged in, and its tokenizer: `tokenizer_path`,
    else the folder's own files, else (a checkpoint) the one its run used."""
    from lmforge.devices import resolve_device
    from lmforge.models.io import parse_dtype
    from lmforge.models.lora import merge_lora
    from lmforge.models.peft_read import load_peft_adapter
    from lmforge.models.source import load_pretrained, model_tokenizer

    folder = Path(path)
    tokenizer = model_tokenizer(folder, tokenizer_path, "pass --tokenizer PATH")
    resolved = device if isinstance(device, torch.device) else resolve_device(device or "auto")
    model = load_pretrained(folder, device=resolved, dtype=parse_dtype(dtype))
    # as generate and serve read --lora (lmforge.cli.serve.load_served): merged, so scored
    # fast
    if peft is not None:
        load_peft_adapter(model, peft)
        model = merge_lora(model)
    return model, tokenizer
