"""The MTP head: one extra full-attention decoder layer that drafts token t+2.

Forward (docs/design.md, "Models"), at position t:
    x = fc(concat[pre_fc_norm_embedding(embed(tok_{t+1})), pre_fc_norm_hidden(h_t)])
    x = decoder_layer(x)                   # mlx_lm's own Qwen3.5 layer, own KV cache
    g = norm(x)                            # fed back as h for the next draft step
    logits = lm_head(g)                    # shared with the trunk
h_t is the trunk's final hidden after its final norm. Embedding and lm_head are
the trunk's; the head owns none.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

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
    def __init__(self, args: TextModelArgs, num_layers: int = 1):
        super().__init__()
        H = args.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=args.rms_norm_eps)
        # layer_idx = interval - 1 makes mlx_lm build a full-attention layer
        # (MoE MLP when the trunk is MoE, as in the released checkpoints).
        attn_idx = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, attn_idx) for _ in range(num_layers)]
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
