"""One decoder for every decoder family (GPT-NeoX/Pythia, Llama, Qwen, Mistral, GPT-2, GPT-J
...): embeddings, blocks, norm, head.

A pipeline stage (lmforge.parallel.pipeline) is a Decoder without the modules it does not hold: one
that is not the first (`Decoder.is_first`) takes the previous stage's hidden states in place of
input_ids, one that is not the last (`is_last`) returns its blocks' output. Flags, not the modules'
presence, say which: a tied model's last stage holds `embed` for its head but must not embed its
input. A whole model is both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lmforge.models import documents
from lmforge.models.config import ModelConfig
from lmforge.models.documents import Documents
from lmforge.models.kv_cache import KVCache
from lmforge.models.layers import (
    Block,
    SoftCappedVocabProjection,
    VocabProjection,
    make_norm,
    padding_mask,
    window_band,
)
from lmforge.models.rope import RotaryEmbedding


class Decoder(nn.Module):
    # Parameters whose first dimension is the padded vocabulary (rows past vocab_size are padding).
    vocab_parameters = ("embed.weight", "lm_head.weight", "lm_head.bias")
    # Which ends of a pipeline this stage holds (see the module docstring): flags, since a tied
    # model's last stage holds `embed` for its head but must not embed its input.
    is_first = is_last = True
    # How a packed batch's segment ids become its layers' Documents (Documents.of); a parallel plan
    # may set its own: lmforge.parallel.context's attends across the ranks of a context group.
    documents_fn: Callable | None = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        learned = cfg.position_embedding == "learned"
        self.pos_embed = (
            nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size) if learned else None
        )
        self.rope = RotaryEmbedding(cfg) if cfg.position_embedding == "rotary" else None
        # Gemma 3: the sliding-window layers rotate with their own base, unscaled.
        self.rope_local = (
            RotaryEmbedding(cfg, local=True)
            if self.rope is not None and cfg.rotary_base_local
            else None
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.window(i), cfg.is_moe_layer(i)) for i in range(cfg.num_layers)
        )
        self.norm = make_norm(cfg)
        self.lm_head = None
        if not cfg.tie_embeddings and not cfg.num_labels:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.padded_vocab_size, bias=cfg.lm_head_bias)
        softcap = cfg.final_logit_softcapping
        self.vocab_projection = (
            SoftCappedVocabProjection(cfg.vocab_size, softcap)
            if softcap
            else VocabProjection(cfg.vocab_size)
        )
        # Sequence classification (GPT-2 on SST-2 ...): a bias-free score head on the last real
        # token.
        self.score = (
            nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False) if cfg.num_labels else None
        )

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_position: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states (batch, seq, hidden). attention_mask: 1 = token, 0 = padding;
        none: causal attention over the whole row, which is also exact for right padding (no real
        token sees one after it).

        segment_ids (batch, seq), a packed batch's documents 1, 2, ... and 0 on padding, in place of
        attention_mask: each token attends within its own document (lmforge.models.documents,
        without a dense mask); position_ids then restart at 0 with each document.

        With a KV cache (lmforge.inference.KVCache) the tokens are written to the cache slots
        `cache_position` (seq,) and attend to every real token cached before them; attention_mask
        then covers only the new tokens, and position_ids default to the slots.
        """
        if self.is_first:
            b, s = input_ids.shape
            if position_ids is None:
                positions = (
                    torch.arange(s, device=input_ids.device)
                    if cache_position is None
                    else cache_position
                )
                position_ids = positions.expand(b, s)
            x = self.embed(input_ids)
            # Gemma: by sqrt(hidden) rounded to the embedding's dtype, as there
            if self.config.scale_embeddings:
                x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
            if self.pos_embed is not None:
                x = x + self.pos_embed(position_ids)
            x = self.drop(x)
        else:
            x = input_ids  # (batch, seq, hidden) from the previous pipeline stage
            # under SP x holds 1/TP of the sequence
            if position_ids is None and self.rope is not None:
                raise ValueError(
                    "pipeline stages after the first need position_ids (pipeline_step passes them)"
                )
        rope = self.rope(position_ids, x.dtype) if self.rope is not None else None
        ropes = {
            None: rope,
            "local": self.rope_local(position_ids, x.dtype)
            if self.rope_local is not None
            else rope,
        }
        if cache is not None:
            if cache_position is None:
                raise ValueError(
                    "a KV cache needs cache_position: the slots the new tokens are written to"
                )
            masks = cache.attention_masks(attention_mask, cache_position)
            for i, layer in enumerate(self.layers):
                x = layer(
                    x,
                    ropes[self._rope_of(layer)],
                    masks[cache.mask_of(i)],
                    cache.layer(i, cache_position),
                )
            return self.norm(x)
        if self.documents_fn is not None and segment_ids is None:
            raise ValueError(
                "this decoder's attention is laid out over documents (documents_fn): give segment_ids"
            )
        if segment_ids is not None:
            if attention_mask is not None:
                raise ValueError(
                    "give attention_mask or segment_ids, not both (segment_ids marks padding as 0)"
                )
            windows = [layer.attn.window for layer in self.layers]
            docs = (self.documents_fn or Documents.of)(segment_ids, windows)
            for layer in self.layers:
                x = layer(x, ropes[self._rope_of(layer)], docs)
            return self.norm(x) if self.is_last else x
        mask = None
        # (batch, seq) padding mask, or a ready (batch, 1, q, k) bool mask
        if attention_mask is not None:
            mask = (
                attention_mask if attention_mask.dim() == 4 else padding_mask(attention_mask, True)
            )
        # Under sequence parallelism x holds a slice of the sequence; the positions span all of it.
        s = position_ids.shape[-1] if position_ids is not None else x.shape[1]
        if mask is None and self._flex_causal(x.device):
            docs = Documents.causal(
                x.shape[0], s, [layer.attn.window for layer in self.layers], x.device
            )
            for layer in self.layers:
                x = layer(x, ropes[self._rope_of(layer)], docs)
            return self.norm(x) if self.is_last else x
        windowed = {w: self._window_mask(mask, s, w, x.device) for w in self._windows() if w < s}
        for layer in self.layers:
            x = layer(x, ropes[self._rope_of(layer)], windowed.get(layer.attn.window, mask))
        return self.norm(x) if self.is_last else x

    @staticmethod
    def _rope_of(layer: nn.Module) -> str | None:
        return "local" if layer.attn.window is not None else None

    def _flex_causal(self, device: torch.device) -> bool:
        """Whether a causal batch without padding attends through FlexAttention
        (lmforge.models.documents): on its devices, for a model with sliding windows or
        soft-capped scores, which SDPA's is_causal cannot express."""
        special = self._windows() or self.config.attn_logit_softcapping is not None
        return bool(special) and documents.document_backend(device) == "flex"

    def _windows(self) -> set[int]:
        return {layer.attn.window for layer in self.layers if layer.attn.window is not None}

    @staticmethod
    def _window_mask(
        mask: torch.Tensor | None, s: int, window: int, device: torch.device
    ) -> torch.Tensor:
        """The causal (and padding) mask narrowed to each token's last `window` slots, itself
        included."""
        slots = torch.arange(s, device=device)
        band = window_band(slots, slots, window)
        return band & (slots[None, :] <= slots[:, None]) if mask is None else mask & band

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output head's weight and bias (LM head or tied embedding), padded_vocab_size rows."""
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        return weight, self.lm_head.bias if self.lm_head is not None else None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary only (see VocabProjection)."""
        return self.vocab_projection(h, *self.head())

    def classify(
        self, h: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Class logits (batch, num_labels) read at each row's last real token (right padding).
        On a pipeline's last stage `input_ids` are the hidden states it received: the rows'
        lengths come from the mask."""
        b, s = h.shape[:2]
        if (
            attention_mask is None
            and self.config.pad_token_id is not None
            and not input_ids.is_floating_point()
        ):
            attention_mask = input_ids != self.config.pad_token_id
        if attention_mask is None:
            last = torch.full((b,), s - 1, device=h.device)
        else:
            last = (torch.arange(s, device=h.device) * attention_mask.to(torch.long)).argmax(-1)
        last_h = h[torch.arange(b, device=h.device), last]
        # a LoRA run trains an fp32 head on a bf16 base
        return self.score(last_h.to(self.score.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        cache_position: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        head_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
        | None = None,
        right_padded: bool = False,
    ) -> torch.Tensor:
        """Logits (batch, seq, vocab_size), or (batch, num_labels) for a classification model.

        head_fn(hidden, head weight, head bias), if given, is returned instead of the logits: a loss
        that never materialises them (lmforge.train.loss), run inside forward for DDP/FSDP. A
        pipeline stage that is not the last returns its hidden states (batch, seq, hidden).
        right_padded: attention_mask pads on the right only (as the training collators do), where
        causal attention alone is exact for every real token: SDPA runs is_causal, no (batch, 1,
        seq, seq) mask is built, and the mask serves only to find each row's last token for the
        classification head.
        """
        mask = None if right_padded and cache is None else attention_mask
        h = self.hidden_states(input_ids, mask, position_ids, cache, cache_position, segment_ids)
        if not self.is_last:
            return h
        if self.score is not None:
            return self.classify(h, input_ids, attention_mask)
        if head_fn is not None:
            return head_fn(h, *self.head())
        return self.logits(h)
