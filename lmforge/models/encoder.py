"""BERT: a bidirectional, post-norm encoder built from the decoder's blocks, with an MLM head
and a sequence-classification head.

The MLM head's logits (`MLMHead.forward`) are F.linear's 2-D product with a bias, viewed as (batch,
seq, vocab). A view returned by an FSDP2 unit (a pipeline's last stage) draws torch's warning that
an in-place op on it would drop the unit's pre-backward hook: none is made, but the warning would
hide one that matters. The head returns `aten._unsafe_view` of it instead, which is what torch's
matmul returns: the same storage, not tracked as a view (nothing else holds the product).
"""

from __future__ import annotations

import torch
from torch import nn

from lmforge.models.config import ModelConfig
from lmforge.models.layers import ACTIVATIONS, Block, VocabProjection, make_norm, padding_mask


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = (
            nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size else None
        )
        self.norm = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Summed word, position and token-type embeddings; positions default to 0..s-1, token
        types to 0."""
        if position_ids is None:
            b, s = input_ids.shape
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word(input_ids) + self.position(position_ids)
        if self.token_type is not None:
            x = x + self.token_type(token_type_ids)
        return self.drop(self.norm(x))


class MLMHead(nn.Module):
    """dense -> activation -> norm -> decoder tied to the word embeddings, plus a vocab bias."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.act = ACTIVATIONS[cfg.activation]
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = make_norm(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.padded_vocab_size))
        self.vocab_projection = VocabProjection(cfg.vocab_size)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    def forward(self, h: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        logits = self.vocab_projection(
            self.norm(self.act(self.dense(h))), word_embeddings, self.bias
        )
        # Not a view of F.linear's product: one returned by an FSDP2 unit draws torch's in-place
        # hook warning (see the module docstring). _unsafe_view is what torch's matmul returns.
        if type(logits) is torch.Tensor and logits._base is not None:
            logits = torch.ops.aten._unsafe_view(logits, logits.shape)
        return logits


class Bert(nn.Module):
    """Encoder + MLM head (num_labels == 0) or pooler + classifier (num_labels > 0)."""

    vocab_parameters = ("embeddings.word.weight", "mlm_head.bias")
    # A pipeline stage is a Bert without the modules it does not hold (see Decoder.is_first): the
    # last stage holds the word embedding for the MLM head but must not embed its input.
    is_first = is_last = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if cfg.pooler else None
        self.mlm_head = MLMHead(cfg) if cfg.num_labels == 0 else None
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels) if cfg.num_labels else None
        self.drop = nn.Dropout(cfg.dropout)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids, position_ids) if self.is_first else input_ids
        mask = padding_mask(attention_mask, False) if attention_mask is not None else None
        for layer in self.layers:
            x = layer(x, None, mask)
        return x

    def pooled(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.pooler(h[:, 0]))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MLM logits (batch, seq, vocab_size), or classification logits (batch, num_labels); a
        pipeline stage that is not the last returns its hidden states."""
        h = self.hidden_states(input_ids, attention_mask, token_type_ids, position_ids)
        if not self.is_last:
            return h
        if self.classifier is not None:
            pooled = self.drop(self.pooled(h))
            # a LoRA run's fp32 head, bf16 base
            return self.classifier(pooled.to(self.classifier.weight.dtype))
        return self.mlm_head(h, self.embeddings.word.weight)
