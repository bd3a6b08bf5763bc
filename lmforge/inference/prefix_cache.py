"""Prefix caching: keys/values of prompt blocks kept after their request, so a later prompt that
starts with the same tokens (a system prompt, few-shot examples, the earlier turns of a chat) copies
them into its row instead of computing them again.

A block is BLOCK_TOKENS tokens; it is named by a SHA-256 chained over every token up to its end and
the request's adapter and cache_salt (as vLLM names its blocks), so two prompts share a block only
where all their tokens up to it are equal, under the same adapter and salt, and a client cannot make
a collision to read another's keys. Only whole blocks are kept, and a prompt reuses at most its
length minus one token: its last token is always computed, since its logits are the first token's.
A request's generated tokens are kept too when it ends (the next turn of a chat repeats them).
Whether a prefix is cached shows in the time to the first token: a client can learn whether another
sent it recently (vLLM's documented side channel), unless their requests carry different salts.

The pool is bounded (a number of blocks, preallocated) and evicted least recently used. A block a
running request matched or stored is pinned while that request holds its row, never evicted;
released, a request's blocks go to the LRU end in reverse order, so its last blocks leave before
its first ones (the first are those other prompts share). Rows keep their own copy of the keys
(the engine's cache is one buffer per row), so a block evicted later changes no running row.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from lmforge.errors import UserError
from lmforge.inference.cache import KVCache
from lmforge.models.sizes import check_cache_memory

log = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # vLLM's default block size


def sharing_key(req) -> tuple:
    """What two engine requests must have in common to share blocks: the adapter they decode with
    (0: the base model) and their cache_salt."""
    adapter = getattr(req, "adapter", getattr(req.params, "adapter", 0))
    return adapter, getattr(req.params, "cache_salt", None)


def block_hashes(tokens: Sequence[int], key: object = (0, None)) -> list[bytes]:
    """The name of each whole block of `tokens`: a digest of the sharing key (adapter, cache_salt)
    and every token up to the block's end."""
    parent = hashlib.sha256(repr(key).encode()).digest()
    names = []
    for end in range(BLOCK_TOKENS, len(tokens) + 1, BLOCK_TOKENS):
        block = array("q", tokens[end - BLOCK_TOKENS : end]).tobytes()
        parent = hashlib.sha256(parent + block).digest()
        names.append(parent)
    return names


class PrefixCache:
    def __init__(self, cache: KVCache, blocks: int):
        """A pool of `blocks` blocks shaped like the rows of `cache` (every layer's keys/values)."""
        self.blocks = blocks
        self.k = [_pool(k, blocks) for k in cache.k]
        self.v = [_pool(v, blocks) for v in cache.v]
        self.ids: dict[bytes, int] = {}  # block name -> pool block
        self.names: list[bytes | None] = [None] * blocks
        self.refs = [0] * blocks
        self.free = list(range(blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached blocks, oldest first
        self.held: dict[object, list[int]] = {}  # request -> the blocks it pins
        self.hit_tokens = 0  # prompt tokens read from the pool
        self.miss_tokens = 0  # prompt tokens computed
        self.evicted = 0  # blocks evicted for others

    @classmethod
    def for_engine(
        cls, model: torch.nn.Module, cache: KVCache, context: int, blocks: int | None
    ) -> PrefixCache:
        """The serving engine's pool of `blocks` (None: one row of `context` slots' worth),
        checked against free memory first (the rows' `cache` is allocated already)."""
        if blocks is None:
            blocks = -(-context // BLOCK_TOKENS)
        if blocks < 1:
            raise UserError(f"prefix_cache_blocks must be >= 1, got {blocks}")
        check_cache_memory(
            model.config,
            1,
            blocks * BLOCK_TOKENS,
            cache.k[0].dtype,
            cache.k[0].device,
            "the prefix cache's blocks",
            "lower prefix_cache_blocks or turn the prefix cache off (serve: --prefix-cache-blocks, "
            "--no-enable-prefix-caching)",
            ring=False,
        )
        pool = cls(cache, blocks)
        log.info(
            "prefix cache: %d blocks of %d tokens (%.0f MiB)",
            blocks,
            BLOCK_TOKENS,
            pool.nbytes / 2**20,
        )
        return pool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def used(self) -> int:
        return self.blocks - len(self.free)

    def match(self, req, names: list[bytes], usable: int) -> list[int]:
        """Pin and return the pool blocks of the longest cached prefix of `names` that leaves at
        least one of the prompt's `usable` + 1 tokens to compute (`usable` < 0: none reused)."""
        self.release(req)
        found = []
        for name in names[: max(usable, 0) // BLOCK_TOKENS]:
            block = self.ids.get(name)
            if block is None:
                break
            found.append(block)
        for block in found:
            self._pin(block)
        self.held[req] = list(found)
        return found

    def match_requests(self, reqs: list) -> tuple[list[list[bytes]], list[list[int]]]:
        """Each engine request's block names and the pool blocks of its longest cached prefix,
        pinned for it; a prompt whose own log-probabilities are asked for is computed whole."""
        names = [block_hashes(r.prompt_ids, sharing_key(r)) for r in reqs]
        cached = [
            self.match(
                r, own, -1 if r.params.prompt_logprobs is not None else len(r.prompt_ids) - 1
            )
            for r, own in zip(reqs, names)
        ]
        return names, cached

    def missing_first_block(self, req) -> bytes | None:
        """The name of the first block an engine request could read from the pool, where it is
        not there yet (None: nothing to wait for)."""
        if req.params.prompt_logprobs is not None or len(req.prompt_ids) <= BLOCK_TOKENS:
            return None
        name = block_hashes(req.prompt_ids[:BLOCK_TOKENS], sharing_key(req))[0]
        return None if name in self.ids else name

    def count(self, cached: int, computed: int) -> None:
        self.hit_tokens += cached
        self.miss_tokens += computed

    def load(self, blocks: list[int], cache: KVCache, row: int) -> None:
        """Copy `blocks` into slots 0.. of `cache`'s `row`, marked real."""
        n = len(blocks) * BLOCK_TOKENS
        index = torch.tensor(blocks, device=self.k[0].device)
        for pool, buf in zip((*self.k, *self.v), (*cache.k, *cache.v), strict=True):
            part = pool.index_select(0, index).transpose(0, 1)  # (heads, blocks, block, dim)
            buf[row, :, :n] = part.reshape(buf.shape[1], n, buf.shape[3])
        cache.valid[row, :n] = True

    def store(self, req, names: list[bytes], cache: KVCache, row: int) -> None:
        """Keep the blocks of `names` past those `req` pins, read from `cache`'s `row` (just
        prefilled), pinned for `req`: a block already kept is pinned instead; where every block is
        pinned the rest are not kept."""
        held = self.held.setdefault(req, [])
        first = len(held)
        new: list[tuple[int, int]] = []  # (block of the prompt, pool block)
        for j in range(first, len(names)):
            block = self.ids.get(names[j])
            if block is None:
                block = self._allocate()
                if block is None:
                    break
                self.ids[names[j]], self.names[block] = block, names[j]
                new.append((j, block))
            self._pin(block)
            held.append(block)
        for j, block in new:
            span = slice(j * BLOCK_TOKENS, (j + 1) * BLOCK_TOKENS)
            for pool, buf in zip((*self.k, *self.v), (*cache.k, *cache.v), strict=True):
                pool[block] = buf[row, :, span]

    def keep_generated(self, req, cache: KVCache, row: int) -> None:
        """Keep the whole blocks of an ending engine request's prompt and output that its row holds
        (its last token never went in): the next turn of a chat starts with them."""
        tokens = [*req.prompt_ids, *req.output_ids][: req.length]
        self.store(req, block_hashes(tokens, sharing_key(req)), cache, row)

    def release(self, req) -> None:
        """Unpin `req`'s blocks, its last first into the LRU order (evicted before its first)."""
        for block in reversed(self.held.pop(req, [])):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.lru[block] = None

    def clear(self) -> None:
        """Forget every unpinned block."""
        for block in list(self.lru):
            self._forget(block)
            self.free.append(block)
        self.lru.clear()

    def _pin(self, block: int) -> None:
        self.refs[block] += 1
        self.lru.pop(block, None)

    def _allocate(self) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.lru:
            return None
        block, _ = self.lru.popitem(last=False)
        self._forget(block)
        self.evicted += 1
        return block

    def _forget(self, block: int) -> None:
        del self.ids[self.names[block]]
        self.names[block] = None


def _pool(buf: torch.Tensor, blocks: int) -> torch.Tensor:
    """(blocks, kv_heads, BLOCK_TOKENS, head_dim) like the row buffer `buf` (batch, kv_heads,
    slots, head_dim)."""
    shape = (blocks, buf.shape[1], BLOCK_TOKENS, buf.shape[3])
    return torch.zeros(shape, dtype=buf.dtype, device=buf.device)


def prefill_after_prefix(
    model: torch.nn.Module,
    pool: PrefixCache,
    cache: KVCache,
    slots: list[int],
    prompts: list[list[int]],
    blocks: list[list[int]],
) -> torch.Tensor:
    """Prefill `prompts` into `cache`'s rows `slots`, each row's cached `blocks` copied in and only
    the tokens after them computed: hidden states (rows, longest rest, hidden), row i's rest at
    0..len(prompts[i]) - len(blocks[i]) * BLOCK_TOKENS - 1.

    The rows go through a cache of their own (they need not be next to each other), each rest
    right-padded at its own slots (the padding's slots are marked empty, as in a plain prefill),
    then copied into theirs."""
    device = cache.valid.device
    starts = [len(b) * BLOCK_TOKENS for b in blocks]
    rests = [len(p) - s for p, s in zip(prompts, starts)]
    width = max(rests)
    own = KVCache(
        model.config, len(prompts), max(starts) + width, cache.k[0].dtype, device, ring=False
    )
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, (prompt, start, rest) in enumerate(zip(prompts, starts, rests)):
        ids[i, :rest] = torch.tensor(prompt[start:])
        mask[i, :rest] = 1
        if blocks[i]:
            pool.load(blocks[i], own, i)
    positions = torch.tensor(starts)[:, None] + torch.arange(width)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    # a padding token's position may pass the model's last (GPT-2's learned positions end there)
    position_ids = positions.clamp(max=model.config.max_position_embeddings - 1)
    h = model.hidden_states(ids, mask, position_ids, own, positions)
    # past the row's length only padding's slots, which no row reads
    span = min(own.max_len, cache.max_len)
    rows = torch.tensor(slots, device=device)
    cache.valid.index_fill_(0, rows, False)  # what the rows' previous requests left
    for full, part in zip((*cache.k, *cache.v), (*own.k, *own.v), strict=True):
        full[:, :, :span].index_copy_(0, rows, part[:, :, :span])
    cache.valid[:, :span].index_copy_(0, rows, own.valid[:, :span])
    return h
