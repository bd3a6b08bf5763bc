"""Continuous batching: one engine thread decodes every running request together, one token per
step.

Waiting requests queue by group (the server makes one group of the requests behind one HTTP request:
its prompts x n choices), and free rows go to the waiting groups in turn, round-robin, each group's
requests in the order they came: one client's 1000 prompts take every other free row, not the next
1000, so a single request behind them waits a few rows rather than all of them. Between two decode
steps the free slots (rows of one preallocated KVCache) take the next requests so chosen, and their
prompts are prefilled together in one forward (at most `prefill_batch` requests and
`max_prefill_tokens` padded tokens a forward; fewer on the CPU, where a few hundred tokens already
fill the matmuls): requests that arrive together, or while a step runs, get their first token after
one prefill instead of one prefill each. The decode step then feeds every running row its last token
at the row's own position (rows hold different lengths, so the cache writes per-row slots). A
request that arrives while others decode therefore joins at the next step instead of waiting for the
batch to drain (iteration-level scheduling, Yu et al., Orca, OSDI 2022), and a finished or cancelled
request frees its row at once.

Every row starts at cache slot 0, so its slot is also its position id: prompts of a prefill batch
are padded on the right (slots past a prompt's end are masked out, and its decode overwrites them),
so each request computes exactly what `generate` does on its prompt alone, and greedy output is the
same token for token. Each row keeps its request's own sampling settings; a step chooses every row's
token in one call (penalties.py over per-row tables, then sampling.choose_rows with a value per
row), a seeded row drawing from its own generator, so a request gets the same tokens whatever shares
its batch. A prompt that starts with blocks an earlier prompt left in the prefix cache
(prefix_cache.py) copies their keys/values into its row and computes only the rest. A request with
a response_format also has a grammar (grammar.py): its row's disallowed tokens go to -inf between
the penalties and the sampling call, and the grammar takes each token chosen; rows without one
compute nothing.

The engine never waits for a consumer: it hands each request's events to a callback (the server puts
them on that request's asyncio queue), so a slow reader only lets its own queue grow.

One request never fails the others: what goes wrong in one row (its scores, its sampling call, its
detokenizer or stop strings, its consumer) ends that request alone with an "error" event (a consumer
that raised is dropped), and a prefill forward that raises is retried one request at a time, so only
the prompt that breaks it fails. Only a decode forward that raises fails every running request, as
it is one computation for all of them.

    engine = Engine(model, tokenizer, EngineConfig(max_batch=8)).start()
    req = engine.submit(prompt_ids, RequestParams(max_tokens=64), on_event=print)
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from lmforge.errors import UserError
from lmforge.inference.cache import KVCache
from lmforge.inference.generate import check_can_generate, check_fits
from lmforge.inference.grammar import Grammars, RowGrammar, allowed_tokens
from lmforge.inference.logprobs import TokenLogprob, prompt_logprobs, token_logprobs
from lmforge.inference.penalties import RowPenalties
from lmforge.inference.prefix_cache import BLOCK_TOKENS, PrefixCache, prefill_after_prefix
from lmforge.inference.requests import EngineRequest, Event, RequestParams
from lmforge.inference.sampling import (
    NO_TOKEN,
    RowSampling,
    choose_rows,
    model_scores_broken,
    no_token_reason,
)
from lmforge.inference.text import eos_token_ids
from lmforge.models.sizes import check_cache_memory

log = logging.getLogger(__name__)


class EngineBusy(Exception):
    """The waiting queue is full: the caller should answer 'try again later' (HTTP 503)."""


@dataclass
class EngineConfig:
    max_batch: int = 8  # requests decoded together (rows of the KV cache)
    # cache slots per row; default the model's max_position_embeddings
    max_context: int | None = None
    max_queue: int = 1024  # waiting requests before submit raises EngineBusy
    # most requests prefilled in one forward; None = max_batch, 1 = one at a time
    prefill_batch: int | None = None
    # Most padded tokens (requests x longest prompt) one prefill forward takes (a longer prompt
    # still goes, alone); None: CPU_PREFILL_TOKENS on the CPU, ACCELERATOR_PREFILL_TOKENS elsewhere.
    max_prefill_tokens: int | None = None
    # keep prompt blocks' keys/values for later prompts that start alike (prefix_cache.py)
    prefix_cache: bool = True
    # blocks of BLOCK_TOKENS tokens the prefix cache holds; None: one row's worth (max_context)
    prefix_cache_blocks: int | None = None


# On the CPU a forward of a few hundred tokens already runs its matmuls at full rate: batching more
# prompts saves no time and only delays the first ones' first token (benchmarks/prefill.py: 8
# prompts of 16 tokens prefill 2x faster together than one by one, 8 of 128 no faster). An
# accelerator's forward is far from full at that size.
CPU_PREFILL_TOKENS = 256
ACCELERATOR_PREFILL_TOKENS = 8192


class Engine:
    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig | None = None):
        check_can_generate(model)
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config or EngineConfig()
        if config.max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {config.max_batch}")
        if config.prefill_batch is not None and config.prefill_batch < 1:
            raise UserError(f"prefill_batch must be >= 1, got {config.prefill_batch}")
        limit = model.config.max_position_embeddings
        scaling = model.config.rope_scaling
        if (
            scaling is not None
            and scaling.type == "longrope"
            and scaling.original_max_position_embeddings < limit
        ):
            # Past its pretraining context LongRoPE switches every position of a forward to its long
            # factors, for the whole batch at once: rows decoded together would change one another,
            # and their cached keys would need rotating again. Until the engine re-encodes rows one
            # by one, it serves the short context only.
            limit = scaling.original_max_position_embeddings
            log.warning(
                "LongRoPE model: the engine serves its %d-token pretraining context only (generate() goes "
                "to %d)",
                limit,
                model.config.max_position_embeddings,
            )
        self.context = min(config.max_context or limit, limit)
        p = next(model.parameters())
        self.device = p.device
        self.prefill_batch = min(config.prefill_batch or config.max_batch, config.max_batch)
        self.prefill_tokens = config.max_prefill_tokens or (
            CPU_PREFILL_TOKENS if p.device.type == "cpu" else ACCELERATOR_PREFILL_TOKENS
        )
        check_cache_memory(
            model.config,
            config.max_batch,
            self.context,
            p.dtype,
            p.device,
            "max_context" if config.max_context else "the model's max_position_embeddings",
            "lower max_context or max_batch (serve: --max-context, --max-batch)",
            ring=False,
        )
        # Every layer keeps a slot per position (no rings for sliding-window layers): a batched
        # prefill is right- padded, and a ring keeps the last `window` slots of the forward, the
        # padding's for a shorter prompt.
        self.cache = KVCache(
            model.config, config.max_batch, self.context, p.dtype, p.device, ring=False
        )
        self.prefix = (
            PrefixCache.for_engine(model, self.cache, self.context, config.prefix_cache_blocks)
            if config.prefix_cache
            else None
        )
        self.stop_ids = eos_token_ids(model, tokenizer)
        self.penalties = RowPenalties(config.max_batch, model.config.vocab_size, self.device)
        # response_format's
        self.grammars = Grammars(tokenizer, model.config.vocab_size, self.stop_ids)
        self.slots: list[EngineRequest | None] = [None] * config.max_batch
        # Waiting requests by group, the groups in the order they take turns (first = next to be
        # served).
        self.waiting: dict[object, deque[EngineRequest]] = {}
        self._queued = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.steps = 0  # decode steps run
        # sum of running requests over those steps (mean batch = rows / steps)
        self.rows_decoded = 0
        self.prefills = 0  # prefill forwards run
        self.rows_prefilled = 0  # requests prefilled by them (mean prefill batch = rows / prefills)

    @property
    def running(self) -> int:
        return sum(r is not None for r in self.slots)

    @property
    def queued(self) -> int:
        return self._queued

    @property
    def alive(self) -> bool:
        """Whether the engine thread is running (and so requests will be answered)."""
        return self._thread is not None and self._thread.is_alive()

    def check(self, prompt_len: int, max_tokens: int, scored: bool = False) -> None:
        """Raise UserError unless a prompt of prompt_len tokens and max_tokens new ones fit in a
        row; max_tokens may be 0 where the prompt is `scored` (its log-probabilities are the
        answer)."""
        if prompt_len < 1:
            raise UserError("the prompt is empty: give it at least one token")
        if max_tokens < (0 if scored else 1):
            raise UserError(f"max_tokens must be >= 1, got {max_tokens}")
        check_fits(prompt_len, max(max_tokens, 1), self.context, "max_tokens")

    def submit(
        self,
        prompt_ids: Sequence[int],
        params: RequestParams,
        on_event: Callable[[Event], None],
        group: object = None,
    ) -> EngineRequest:
        """Queue a request (thread-safe). on_event is called from the engine thread and must not
        block.

        Requests of one group (any hashable; None = a group of its own) take turns for free rows
        with the other groups, round-robin, rather than all going first.
        """
        self.check(len(prompt_ids), params.max_tokens, params.prompt_logprobs is not None)
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise UserError(
                f"prompt token id {bad[0]} is outside this model's vocabulary [0, {vocab})"
            )
        named = [*(params.logit_bias or ()), *params.stop_token_ids]
        bad = [t for t in named if not 0 <= t < vocab]
        if bad:
            raise UserError(
                f"token id {bad[0]} (in logit_bias or stop_token_ids) is outside this model's vocabulary "
                f"[0, {vocab})"
            )
        req = EngineRequest(
            prompt_ids, params, on_event, self.tokenizer, self.device, self.stop_ids
        )
        with self._cond:
            if self._queued >= self.config.max_queue:
                raise EngineBusy(f"{self._queued} requests are already waiting")
            self.waiting.setdefault(req if group is None else group, deque()).append(req)
            self._queued += 1
            self._cond.notify()
        return req

    def cancel(self, req: EngineRequest) -> None:
        """Stop a request (its client went away); its row is freed before the next step.
        Thread-safe."""
        req.cancelled = True
        with self._cond:
            self._cond.notify()

    # ------------------------------------------------------------------ the engine thread

    def start(self) -> Engine:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="lmforge-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        waiting = [req for group in self.waiting.values() for req in group]
        for req in [*waiting, *(r for r in self.slots if r is not None)]:
            self._finish(
                req, Event("", len(req.output_ids), "error", "the server is shutting down")
            )
        self.waiting.clear()
        self._queued = 0

    def _loop(self) -> None:
        with torch.inference_mode():
            while self._running:
                try:
                    worked = self.step()
                # the decode forward (out of memory) or a bug: fail the running,
                # keep serving
                except Exception as e:
                    log.exception("engine step failed")
                    for req in [r for r in self.slots if r is not None]:
                        self._finish(
                            req, Event("", len(req.output_ids), "error", f"{type(e).__name__}: {e}")
                        )
                    worked = True
                if not worked:
                    with self._cond:
                        while self._running and not self.waiting and not self.running:
                            self._cond.wait()

    @torch.inference_mode()
    def step(self) -> bool:
        """Admit waiting requests into free rows (prefill), then one decode step; False when
        idle."""
        for req in self.slots:
            if req is not None and req.cancelled:
                self._release(req, "cancelled")
        self._admit()
        running = [r for r in self.slots if r is not None]
        if not running:
            return bool(self.waiting)
        self._decode(running)
        return True

    def _admit(self) -> None:
        """Give free rows to waiting requests, prefilling them a batch at a time."""
        while batch := self._take_waiting():
            self._prefill_apart(batch)

    def _prefill_apart(self, reqs: list[EngineRequest]) -> None:
        """_prefill, and where its forward raises, each request again on its own: only one that
        fails alone fails (out of memory for a long prompt, or a prompt that breaks the model),
        never the rows already decoding."""
        try:
            self._prefill(reqs)
        except Exception as e:
            if len(reqs) == 1:
                return self._fail(reqs[0], e)
            log.warning(
                "a prefill of %d requests failed (%s: %s): prefilling them one at a time",
                len(reqs),
                type(e).__name__,
                e,
            )
            for req in reqs:
                # not one that got its token before the error
                if not req.output_ids and req.finish_reason is None:
                    self._prefill_apart([req])

    def _take_waiting(self) -> list[EngineRequest]:
        """The next requests to prefill together, each given a free row: up to prefill_batch of
        them, while the padded batch (requests x longest prompt) stays within max_prefill_tokens.
        A prompt whose first block another one of the batch computes waits for the next batch,
        which reads it from the prefix cache instead of computing it again."""
        taken: list[EngineRequest] = []
        firsts: set[bytes] = set()
        with self._cond:
            free = [i for i, r in enumerate(self.slots) if r is None]
            longest = 0
            while free and self.waiting and len(taken) < self.prefill_batch:
                head = self.waiting[next(iter(self.waiting))][0]
                n = len(head.prompt_ids)
                if taken and (len(taken) + 1) * max(longest, n) > self.prefill_tokens:
                    break
                first = None if self.prefix is None else self.prefix.missing_first_block(head)
                if first in firsts:
                    break
                req = self._next_waiting()
                if req.cancelled:
                    req.finish_reason = "cancelled"
                    continue
                req.slot = free.pop(0)
                self.slots[req.slot] = req
                req.admitted_at_step = self.steps
                longest = max(longest, n)
                taken.append(req)
                if first is not None:
                    firsts.add(first)
        return taken

    def _prefill(self, reqs: list[EngineRequest]) -> None:
        """One forward over the prompts of `reqs`, right-padded: each row's prompt sits at slots
        0..n-1 as it would alone; the padding's slots are marked empty (never attended) and the
        row's decode overwrites them. Where the prefix cache holds a prompt's first blocks, the
        batch copies them in and computes the rest only (prefill_after_prefix)."""
        lengths = [len(r.prompt_ids) for r in reqs]
        k, longest = len(reqs), max(lengths)
        names, cached = self._match_prefixes(reqs)
        if any(cached):
            return self._prefilled(
                reqs,
                names,
                cached,
                prefill_after_prefix(
                    self.model,
                    self.prefix,
                    self.cache,
                    [r.slot for r in reqs],
                    [r.prompt_ids for r in reqs],
                    cached,
                ),
            )
        ids = torch.zeros(k, longest, dtype=torch.long)
        mask = torch.zeros(k, longest, dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, : lengths[i]] = torch.tensor(r.prompt_ids)
            mask[i, : lengths[i]] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        slots = [r.slot for r in reqs]
        first = slots[0]
        rows = torch.tensor(slots, device=self.device)
        # what the rows' previous requests left is never attended
        self.cache.valid.index_fill_(0, rows, False)
        contiguous = slots == list(range(first, first + k))
        # Rows next to each other are prefilled in place; others through a cache of their own,
        # copied into theirs.
        cache = (
            self.cache.view(slice(first, first + k), longest)
            if contiguous
            else KVCache(
                self.model.config, k, longest, self.cache.k[0].dtype, self.device, ring=False
            )
        )
        h = self.model.hidden_states(
            ids, mask, None, cache, torch.arange(longest, device=self.device)
        )
        if not contiguous:
            for full, part in zip((*self.cache.k, *self.cache.v), (*cache.k, *cache.v)):
                full[:, :, :longest].index_copy_(0, rows, part)
            self.cache.valid[:, :longest].index_copy_(0, rows, cache.valid)
        self._prefilled(reqs, names, cached, h)

    def _prefilled(
        self,
        reqs: list[EngineRequest],
        names: list[list[bytes]],
        cached: list[list[int]],
        h: torch.Tensor,
    ) -> None:
        """After the prefill forward (hidden states `h`, row i's from its first token past its
        `cached` blocks): keep the prompts' blocks, set the rows up, choose each first token."""
        k = len(reqs)
        slots = [r.slot for r in reqs]
        lengths = [len(r.prompt_ids) for r in reqs]
        longest = max(lengths)
        if self.prefix is not None:
            for r, blocks, own, n in zip(reqs, cached, names, lengths):
                self.prefix.count(len(blocks) * BLOCK_TOKENS, n - len(blocks) * BLOCK_TOKENS)
                self.prefix.store(r, own, self.cache, r.slot)
        for i, (r, n) in enumerate(zip(reqs, lengths)):
            r.length = n
            self.penalties.admit(r.slot, r.prompt_ids, r.settings)
            if r.params.grammar is not None:
                r.grammar = RowGrammar(r.params.grammar)
            if r.params.prompt_logprobs is not None:
                r.prompt_logprobs = prompt_logprobs(
                    self.model.logits(h[i, : n - 1]), r.prompt_ids, r.params.prompt_logprobs
                )
        self.prefills += 1
        self.rows_prefilled += k
        log.debug(
            "prefilled %d request(s) in one forward (%d x %d tokens, rows %s)", k, k, longest, slots
        )
        # the prompt's logprobs: done
        scored = [i for i, r in enumerate(reqs) if r.params.max_tokens == 0]
        for i in scored:
            self._finish(reqs[i], Event("", 0, "length"))
        if scored:
            keep = [i for i in range(k) if i not in scored]
            if not keep:
                return
            reqs, lengths = [reqs[i] for i in keep], [lengths[i] for i in keep]
            cached = [cached[i] for i in keep]
            h = h[torch.tensor(keep, device=self.device)]
        rests = [n - len(blocks) * BLOCK_TOKENS for n, blocks in zip(lengths, cached)]
        last = h[
            torch.arange(len(reqs), device=self.device),
            torch.tensor(rests, device=self.device) - 1,
        ]
        self._accept(reqs, self.model.logits(last))

    def _match_prefixes(
        self, reqs: list[EngineRequest]
    ) -> tuple[list[list[bytes]], list[list[int]]]:
        """Each prompt's block names and the pool blocks of its longest cached prefix."""
        if self.prefix is None:
            return [[] for _ in reqs], [[] for _ in reqs]
        return self.prefix.match_requests(reqs)

    def _next_waiting(self) -> EngineRequest:
        """The first group's first request; the group then goes to the back of the line (under
        self._cond)."""
        key = next(iter(self.waiting))
        group = self.waiting.pop(key)
        req = group.popleft()
        if group:
            self.waiting[key] = group  # dicts keep insertion order: re-inserting moves it last
        self._queued -= 1
        return req

    def _decode(self, running: list[EngineRequest]) -> None:
        # free rows below it decode a throwaway token at slot 0
        rows = max(r.slot for r in running) + 1
        tokens, positions = [0] * rows, [0] * rows
        for r in running:
            tokens[r.slot], positions[r.slot] = r.output_ids[-1], r.length
            r.length += 1
        tokens = torch.tensor(tokens, device=self.device)[:, None]
        positions = torch.tensor(positions, device=self.device)[:, None]
        view = self.cache.view(slice(0, rows), max(r.length for r in running))
        logits = self.model.logits(
            self.model.hidden_states(tokens, None, positions, view, positions)[:, -1]
        )
        self.steps += 1
        self.rows_decoded += len(running)
        self._accept(running, logits[torch.tensor([r.slot for r in running], device=self.device)])

    def _accept(self, reqs: list[EngineRequest], logits: torch.Tensor) -> None:
        """Choose each request's next token from its row of logits (len(reqs), vocab); tell the
        consumers.

        One call for the whole batch, each row with its own settings (penalties.py, then
        sampling.choose_rows); a seeded row draws from its own generator alone, so it gets exactly
        the tokens it gets alone. A batch call that raises is made again one row at a time (a seeded
        row's generator put back first), so that only the row that raises alone fails.
        """
        device = logits.device
        slots = torch.tensor([r.slot for r in reqs], device=device)
        scores = torch.nan_to_num(logits.float(), nan=float("-inf"))
        generators = [r.generator for r in reqs]
        states = [None if g is None else g.get_state() for g in generators]
        failed: dict[int, Exception] = {}
        try:
            penalized = self.penalties.apply(
                scores, slots, [r.settings for r in reqs], [len(r.output_ids) for r in reqs]
            )
            penalized = constrain(penalized, reqs)
            chosen = choose_rows(
                penalized, RowSampling.of([r.params.sampling for r in reqs], device), generators
            )
        except Exception as e:
            log.warning(
                "sampling %d rows together failed (%s: %s): sampling them one at a time",
                len(reqs),
                type(e).__name__,
                e,
            )
            chosen = torch.full((len(reqs),), NO_TOKEN, dtype=torch.long, device=device)
            for k, r in enumerate(reqs):
                if states[k] is not None:
                    generators[k].set_state(states[k])
                try:
                    one = self.penalties.apply(
                        scores[k : k + 1], slots[k : k + 1], [r.settings], [len(r.output_ids)]
                    )
                    one = constrain(one, [r])
                    chosen[k] = choose_rows(
                        one, RowSampling.of([r.params.sampling], device), [generators[k]]
                    )[0]
                except Exception as err:
                    failed[k] = err
        self.penalties.record(slots, chosen)
        wanted = [
            k for k, r in enumerate(reqs) if r.params.logprobs is not None and k not in failed
        ]
        logprobs: dict[int, TokenLogprob] = {}
        if wanted:
            index = torch.tensor(wanted, device=device)
            found = token_logprobs(
                scores[index], chosen[index], [reqs[k].params.logprobs for k in wanted]
            )
            logprobs = dict(zip(wanted, found))
        # one device sync for the whole batch
        for k, (req, token) in enumerate(zip(reqs, chosen.tolist())):
            if k in failed:
                self._fail(req, failed[k])
            elif token == NO_TOKEN:
                reason, settings = no_token_reason(logits[k]), not model_scores_broken(logits[k])
                log.warning("a request ended with no token to choose: %s", reason)
                self._finish(
                    req, Event("", len(req.output_ids), "error", reason, client_error=settings)
                )
            else:
                try:
                    if req.grammar is not None:
                        req.grammar.accept(token)
                    self._take(req, token, logprobs.get(k))
                # its grammar, detokenizer or stop strings: that request alone
                # ends
                except Exception as e:
                    self._fail(req, e)

    def _take(self, req: EngineRequest, token: int, logprob: TokenLogprob | None = None) -> None:
        req.output_ids.append(token)
        n = len(req.output_ids)
        if token in req.stop_ids:  # eos or a stop_token_id: counted as generated, never shown
            return self._finish(req, Event(req.text.flush(), n, "stop"))
        text, stopped = req.text.push(token)
        shown = None if logprob is None else [logprob]
        if stopped:
            return self._finish(
                req, Event(text, n, "stop", stop_string=req.text.matched, logprobs=shown)
            )
        if n >= req.params.max_tokens:
            return self._finish(req, Event(text + req.text.flush(), n, "length", logprobs=shown))
        self._emit(req, Event(text, n, logprobs=shown))

    def _emit(self, req: EngineRequest, event: Event) -> None:
        if req.prompt_logprobs is not None:
            event.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
        try:
            req.on_event(event)
        except Exception:  # the consumer is gone (its event loop closed): stop generating for it
            log.debug("dropping a request whose consumer failed", exc_info=True)
            req.cancelled = True

    def _fail(self, req: EngineRequest, error: Exception) -> None:
        """End one request with the error that broke it (logged with its traceback for the
        operator)."""
        log.error("a request failed: %s: %s", type(error).__name__, error, exc_info=error)
        self._finish(
            req, Event("", len(req.output_ids), "error", f"{type(error).__name__}: {error}")
        )

    def _finish(self, req: EngineRequest, event: Event) -> None:
        self._emit(req, event)
        self._release(req, event.finish_reason)

    def _release(self, req: EngineRequest, reason: str | None) -> None:
        req.finish_reason = req.finish_reason or reason
        holds_row = req.slot is not None and self.slots[req.slot] is req
        if self.prefix is not None:
            if holds_row and reason != "error":
                self.prefix.keep_generated(req, self.cache, req.slot)
            self.prefix.release(req)
        if holds_row:
            self.slots[req.slot] = None


def constrain(logits: torch.Tensor, reqs: list[EngineRequest]) -> torch.Tensor:
    """The rows whose request has a response_format grammar with the tokens it forbids at -inf
    (after logit_bias and the penalties, before temperature and the filters, where vLLM applies
    guided decoding); the others untouched. The masks are computed on the host for those rows
    only: a batch without a grammar pays nothing."""
    rows = [k for k, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return logits
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    allowed[rows] = allowed_tokens([reqs[k].grammar for k in rows], logits.shape[-1])
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))
