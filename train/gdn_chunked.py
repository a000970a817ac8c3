"""Chunked (parallel) form of the Gated-DeltaNet recurrence, for training only.

mlx_lm's GDN training path on CPU is `gated_delta_ops`: a Python loop over the
sequence with one compiled step per token, whose backward pass dominates a
training step here. This module computes the same function chunk by chunk
with batched matmuls (the WY / "chunked delta rule" form used by FLA and
transformers' `torch_chunk_gated_delta_rule`), so training is several times
faster. Inference never uses it: the exported model runs mlx_lm's own code,
and `train.py` checks that the loaded model reproduces the training model's
logits.

Derivation (one head, state S [Dv, Dk], chunk of C tokens, start state S0,
gamma_t = sum_{s<=t} log g_s inside the chunk):
    u_s = beta_s (v_s - exp(gamma_s) S0 k_s - sum_{r<s} exp(gamma_s-gamma_r) (k_r.k_s) u_r)
    => U = (I + M)^-1 (beta*V - beta*exp(gamma)*K S0^T),
       M[s, r] = beta_s exp(gamma_s - gamma_r) (k_s.k_r)  for r < s
    y_t = exp(gamma_t) S0 q_t + sum_{s<=t} exp(gamma_t-gamma_s) (k_s.q_t) u_s
    S_C = exp(gamma_C) S0 + sum_s exp(gamma_C-gamma_s) u_s k_s^T
(I + M)^-1 is built by forward substitution, row by row (C steps, batched
over all chunks), which is stable where a Neumann series is not.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gated_delta import normalize_qk
from mlx_lm.models.qwen3_5 import GatedDeltaNet


def _unit_lower_inverse(M: mx.array) -> mx.array:
    """(I + M)^-1 for strictly lower-triangular M [..., C, C]."""
    C = M.shape[-1]
    eye = mx.eye(C, dtype=M.dtype)
    rows = [mx.broadcast_to(eye[0], M.shape[:-2] + (C,))]
    for i in range(1, C):
        prev = mx.stack(rows, axis=-2)  # [..., i, C]
        r = eye[i] - (M[..., i : i + 1, :i] @ prev)[..., 0, :]
        rows.append(r)
    return mx.stack(rows, axis=-2)


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    chunk: int = 16,
):
    """Same contract as mlx_lm's `gated_delta_ops` but with log decay.

    q, k: [B, T, Hk, Dk] (already normalized); v: [B, T, Hv, Dv];
    log_g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk].
    Returns y [B, T, Hv, Dv], final state.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    if Hv // Hk > 1:
        q = mx.repeat(q, Hv // Hk, -2)
        k = mx.repeat(k, Hv // Hk, -2)
    pad = (-T) % chunk
    if pad:
        # Padding at the end: beta = 0, log_g = 0 leaves the state unchanged.
        z = lambda a: mx.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        q, k, v, log_g, beta = z(q), z(k), z(v), z(log_g), z(beta)
    Tp = T + pad
    N, C = Tp // chunk, chunk
    # -> [B, H, N, C, D]
    tr = lambda a: a.reshape(B, N, C, Hv, -1).transpose(0, 3, 1, 2, 4)
    q, k, v = tr(q), tr(k), tr(v)
    lg = log_g.astype(mx.float32).reshape(B, N, C, Hv).transpose(0, 3, 1, 2)
    bt = beta.reshape(B, N, C, Hv).transpose(0, 3, 1, 2)[..., None]
    gam = mx.cumsum(lg, axis=-1)  # [B, H, N, C]
    diff = gam[..., :, None] - gam[..., None, :]  # [t, s] = gamma_t - gamma_s
    tril_incl = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    tril_strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    decay_incl = mx.where(tril_incl, mx.exp(mx.where(tril_incl, diff, 0.0)), 0.0)
    kk = k @ k.swapaxes(-1, -2)
    M = mx.where(tril_strict, bt * decay_incl * kk, 0.0)
    Tinv = _unit_lower_inverse(M)
    eg = mx.exp(gam)[..., None]  # [B, H, N, C, 1]
    Vb = Tinv @ (bt * v)  # [B, H, N, C, Dv]
    Kb = Tinv @ (bt * eg * k)  # [B, H, N, C, Dk]
    Qg = eg * q
    A = (q @ k.swapaxes(-1, -2)) * decay_incl  # [t, s]
    tail = mx.exp(gam[..., -1:] - gam)[..., None]  # exp(gamma_C - gamma_s)
    kt = k * tail
    gC = mx.exp(gam[..., -1])[..., None, None]  # [B, H, N, 1, 1]
    S = state if state is not None else mx.zeros((B, Hv, Dv, Dk), mx.float32)
    ys = []
    for n in range(N):
        St = S.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        U = Vb[:, :, n] - Kb[:, :, n] @ St
        ys.append(Qg[:, :, n] @ St + A[:, :, n] @ U)
        S = gC[:, :, n] * S + U.swapaxes(-1, -2) @ kt[:, :, n]
    y = mx.stack(ys, axis=2)  # [B, H, N, C, Dv]
    y = y.transpose(0, 2, 3, 1, 4).reshape(B, Tp, Hv, Dv)[:, :T]
    return y.astype(q.dtype), S


class ChunkedGatedDeltaNet(GatedDeltaNet):
    """mlx_lm's GatedDeltaNet (same parameters, same projections, norms and
    conv) whose full-sequence, cache-free forward uses the chunked recurrence.
    Swapped into the training model's instances only; with a cache it is the
    parent's code."""

    chunk = 16

    def __call__(self, inputs, mask=None, cache=None):
        if cache is not None or mask is not None:
            return super().__call__(inputs, mask, cache)
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)
        # Depthwise causal conv as K shifted products (same sum as mlx_lm's
        # grouped Conv1d with zero initial state, much faster on the CPU).
        K = self.conv_kernel_size
        xp = mx.pad(qkv, [(0, 0), (K - 1, 0), (0, 0)])
        w = self.conv1d.weight  # [C, K, 1]
        conv = xp[:, 0:S, :] * w[:, 0, 0]
        for j in range(1, K):
            conv = conv + xp[:, j : j + S, :] * w[:, j, 0]
        conv_out = nn.silu(conv)
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        beta = mx.sigmoid(b)
        # log of mlx_lm's compute_g: g = exp(-exp(A_log) * softplus(a + dt_bias))
        log_g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(a + self.dt_bias)
        out, _ = gated_delta_chunked(q, k, v, log_g, beta, None, self.chunk)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))
