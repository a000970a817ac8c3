"""The MTP head: one extra full-attention decoder layer that drafts token t+2.

Forward (docs/design.md, "Models"), at position t:
    x = fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])
    x = decoder_layer(x)                   # the family's mlx_lm layer, own KV cache
    g = norm(x)                            # fed back as h for the next draft step
    logits = lm_head(g)                    # shared with the trunk
h_t is the trunk's final hidden after its final norm. Embedding and lm_head are
the trunk's; the head owns none. The decoder layer is built by the family
(`head_layer`, docs/design.md "Families").
"""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .mlx_lm_compat import create_attention_mask

# Zero-centred RMSNorm weights of the head (stored as w, applied as 1+w in HF).
HEAD_NORM_SUFFIXES = (
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
    "norm.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
)


class MTPHead(nn.Module):
    def __init__(self, args, num_layers: int,
                 make_layer: Callable[[object, int], nn.Module]):
        """args: the trunk's text args; make_layer(args, i): head layer i, a
        full-attention decoder layer of the family (its `head_layer`)."""
        super().__init__()
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.layers = [make_layer(args, i) for i in range(num_layers)]
        self.norm = nn.RMSNorm(H, eps=args.rms_norm_eps)

    def make_cache(self):
        return [KVCache() for _ in self.layers]

    def __call__(
        self,
        hidden: mx.array,
        token_embeddings: mx.array,
        cache: Optional[list] = None,
    ) -> mx.array:
        """hidden: [B, T, H] post-norm trunk (or head) hiddens at positions p;
        token_embeddings: [B, T, H] embeddings of the tokens at p+1.
        Returns the head's post-norm hidden [B, T, H]."""
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(token_embeddings), self.pre_fc_norm_hidden(hidden)],
            axis=-1,
        )
        x = self.fc(x)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=c)
        return self.norm(x)
