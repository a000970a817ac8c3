"""A NumPy forward of the `qwen4_exp` trunk, written from transformers 5.24's
modeling_qwen4_exp.py (no torch), on the raw HF tensors (zero-centred norms,
torch conv layout, sharded n-gram tables). Float64, one sequence, no cache:
the reference the MLX trunk (mlx_mtp/families/qwen4_exp.py) is held to.
Nothing here imports the MLX implementation. See docs/qwen4_exp.md."""

from __future__ import annotations

import math

import numpy as np

# ---------------------------------------------------------------- helpers


def rms(x, w, eps, group=None, zero_centred=True):
    shape = x.shape
    if group is not None:
        x = x.reshape(*shape[:-1], -1, group)
    y = (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)).reshape(shape)
    return y * ((1.0 + w) if zero_centred else w)


def silu(x):
    return x / (1 + np.exp(-x))


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def softplus(x):
    return np.log1p(np.exp(x))


def rope_tables(positions, rotary_dim, base):
    inv = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None]
    return np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))


def apply_rope(x, cos, sin):
    """x [..., T, D]; rotate_half over the first cos.shape[-1] features."""
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    rot = np.concatenate([-xr[..., r // 2:], xr[..., : r // 2]], -1)
    return np.concatenate([xr * cos + rot * sin, rest], -1)


# ---------------------------------------------------------------- PLE hashing

_MASK64 = (1 << 64) - 1


def _splitmix64(v):
    v = (v + 0x9E3779B97F4A7C15) & _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (v ^ (v >> 31)) & _MASK64


def layer_multipliers(vocab, ngram_size, ple_index, seed):
    half = max(1, (((1 << 63) - 1) // max(vocab, 1)) // 2)
    base = seed + 10007 * ple_index
    return [2 * (_splitmix64((base + 0x9E3779B97F4A7C15 * (i + 1)) & _MASK64) % half) + 1
            for i in range(ngram_size)]


def _is_prime(v):
    if v < 2:
        return False
    if v % 2 == 0:
        return v == 2
    return all(v % d for d in range(3, math.isqrt(v) + 1, 2))


def _nth_prime_after(start, count):
    p = start
    for _ in range(count):
        p += 1
        while not _is_prime(p):
            p += 1
    return p


def head_sizes(tc, ple_index):
    heads = (tc["ngram_size"] - 1) * tc["heads_per_ngram"]
    return [_nth_prime_after(tc["ngram_vocab_size_base"] - 1, ple_index * heads + h + 1) for h in range(heads)]


def _shift_right_ignore_eos(ids, shift, eos):
    if shift == 0:
        return ids
    T = ids.shape[0]
    pos = np.arange(T)
    eos_pos = np.where(ids == eos, pos, -1)
    prev_incl = np.maximum.accumulate(eos_pos)
    prev = np.concatenate([[-1], prev_incl[:-1]])
    in_seg = pos - (prev + 1)
    src = pos - shift
    shifted = ids[np.clip(src, 0, None)]
    return np.where((in_seg >= shift) & (src >= 0), shifted, eos)


def ngram_ids(tc, ple_index, ids):
    n, per, eos = tc["ngram_size"], tc["heads_per_ngram"], tc["eos_token_id"]
    mult = layer_multipliers(tc["vocab_size"], n, ple_index, tc["seed"])
    sizes = head_sizes(tc, ple_index)
    offsets = np.cumsum([0] + sizes[:-1])
    hist = np.concatenate([np.full(n - 1, eos), ids]).astype(np.int64)
    shifted = [_shift_right_ignore_eos(hist, s, eos) for s in range(n)]
    blocks = []
    for g in range(2, n + 1):
        mixed = shifted[0] * np.int64(mult[0])
        for p in range(1, g):
            mixed = np.bitwise_xor(mixed, shifted[p] * np.int64(mult[p]))
        lo = (g - 2) * per
        sz = np.array(sizes[lo:lo + per], dtype=np.int64)
        blocks.append(np.remainder(mixed[:, None], sz[None]) + offsets[lo:lo + per][None])
    return np.concatenate(blocks, -1)[-len(ids):]


# ---------------------------------------------------------------- blocks


class Reference:
    def __init__(self, w, tc):
        self.w = {k: np.asarray(v, dtype=np.int64 if v.dtype == np.int64 else np.float64) for k, v in w.items()}
        self.tc = tc
        self.eps = tc["rms_norm_eps"]
        self.min_margin = np.inf  # smallest gap at QSA's top-k cut seen so far

    def g(self, name):
        return self.w[name]

    def hyper(self, p, x, combine=True):
        tc = self.tc
        hc, H = tc["hc_count"], tc["hidden_size"]
        xn = rms(x, self.g(f"{p}.hc_norm.weight"), self.eps, group=H)
        a = silu(xn @ self.g(f"{p}.input_mix_weight_down.weight").T / hc)
        a = sigmoid(a @ self.g(f"{p}.input_mix_weight_up.weight").T)
        mixed = (a * xn).reshape(*x.shape[:-1], hc, H).mean(-2)
        if not combine:
            return mixed
        return mixed, 2 * sigmoid(xn @ self.g(f"{p}.block_inject_weight.weight").T / hc)

    def ple(self, p, x, ids, ple_index):
        tc = self.tc
        hc, H, L = tc["hc_count"], tc["hidden_size"], len(ids)
        table = np.concatenate([self.g(f"{p}.ple_embedding.ngram_embedding.shard_{i}.weight")
                                for i in range(tc["split_ngram_parts"])
                                if f"{p}.ple_embedding.ngram_embedding.shard_{i}.weight" in self.w])
        emb = table[ngram_ids(tc, ple_index, ids)].reshape(L, -1)
        key = rms(emb @ self.g(f"{p}.key_proj.weight").T, self.g(f"{p}.norm_key.weight"), self.eps, group=H)
        value = emb @ self.g(f"{p}.value_proj.weight").T
        query = rms(x, self.g(f"{p}.norm_query.weight"), self.eps, group=H)
        gate = (key.reshape(L, hc, H) * query.reshape(L, hc, H)).sum(-1, keepdims=True) / math.sqrt(H)
        gate = np.sqrt(np.maximum(np.abs(gate), 1e-6)) * np.sign(gate)
        gated = (sigmoid(gate) * value[:, None, :]).reshape(L, -1)
        normed = rms(gated, self.g(f"{p}.norm_conv.weight"), self.eps, group=H)
        wconv = self.g(f"{p}.conv1d.weight")[:, 0, :]  # [C, K]
        K, dil = wconv.shape[1], tc["ngram_size"]
        pad = (K - 1) * dil
        xp = np.concatenate([np.zeros((pad, normed.shape[1])), normed])
        conv = sum(xp[k * dil:k * dil + L] * wconv[:, k] for k in range(K))
        return gated + silu(conv)

    def gdn(self, p, h):
        tc = self.tc
        L = h.shape[0]
        hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
        dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        qkv = h @ self.g(f"{p}.in_proj_qkv.weight").T
        wc = self.g(f"{p}.conv1d.weight")[:, 0, :]
        K = wc.shape[1]
        xp = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
        qkv = silu(sum(xp[k:k + L] * wc[:, k] for k in range(K)))
        q = qkv[:, :hk * dk].reshape(L, hk, dk)
        k = qkv[:, hk * dk:2 * hk * dk].reshape(L, hk, dk)
        v = qkv[:, 2 * hk * dk:].reshape(L, hv, dv)
        z = (h @ self.g(f"{p}.in_proj_z.weight").T).reshape(L, hv, dv)
        beta = sigmoid(h @ self.g(f"{p}.in_proj_b.weight").T)
        gdecay = -np.exp(self.g(f"{p}.A_log")) * softplus(h @ self.g(f"{p}.in_proj_a.weight").T + self.g(f"{p}.dt_bias"))
        q, k = np.repeat(q, hv // hk, axis=1), np.repeat(k, hv // hk, axis=1)
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        q = q / math.sqrt(dk)
        S = np.zeros((hv, dk, dv))
        out = np.zeros((L, hv, dv))
        for t in range(L):
            S = S * np.exp(gdecay[t])[:, None, None]
            kv_mem = (S * k[t][:, :, None]).sum(-2)
            delta = (v[t] - kv_mem) * beta[t][:, None]
            S = S + k[t][:, :, None] * delta[:, None, :]
            out[t] = (S * q[t][:, :, None]).sum(-2)
        act = tc.get("output_gate_type") or tc["hidden_act"]
        y = rms(out, self.g(f"{p}.norm.weight"), self.eps, zero_centred=False)
        y = y * (sigmoid(z) if act == "sigmoid" else silu(z))
        return y.reshape(L, -1) @ self.g(f"{p}.out_proj.weight").T

    def indexer(self, p, h, cos, sin):
        """The token mask [L, L] of transformers' QSA indexer, query by query."""
        tc = self.tc
        L = h.shape[0]
        nih, d = tc["indexer_n_heads"], tc["indexer_head_dim"]
        r = tc["indexer_compress_ratio"]
        topk = tc["indexer_budget"] // r
        qk = h @ self.g(f"{p}.index_qk_proj.weight").T
        q = rms(qk[:, :nih * d].reshape(L, nih, d), self.g(f"{p}.q_layernorm.weight"), self.eps)
        q = apply_rope(q.transpose(1, 0, 2), cos, sin).transpose(1, 0, 2)  # [L, nih, d]
        raw = qk[:, nih * d:]
        sel = np.zeros((L, L), dtype=bool)
        for i in range(L):
            visible = np.arange(i + 1)
            nb = len(visible) // r
            chosen = []
            if nb > 0:
                groups = raw[:nb * r].reshape(nb, r, d).mean(1)
                keys = rms(groups, self.g(f"{p}.k_layernorm.weight"), self.eps)
                keys = apply_rope(keys, cos[np.arange(nb) * r], sin[np.arange(nb) * r])
                scores = np.maximum(q[i] @ keys.T, 0).sum(0) / math.sqrt(d)  # [nb]
                order = np.argsort(-scores, kind="stable")
                if nb > topk:  # how far the cut is from a tie (the test asks for a clear one)
                    self.min_margin = min(self.min_margin, scores[order[topk - 1]] - scores[order[topk]])
                for b in order[:min(topk, nb)]:
                    chosen.extend(range(b * r, b * r + r))
            chosen.extend(visible[nb * r:])
            sel[i, chosen] = True
        return sel

    def attention(self, p, h, cos, sin):
        tc = self.tc
        L = h.shape[0]
        nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
        qg = (h @ self.g(f"{p}.q_proj.weight").T).reshape(L, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(L, nh * hd)
        q = rms(q, self.g(f"{p}.q_norm.weight"), self.eps).transpose(1, 0, 2)
        k = rms((h @ self.g(f"{p}.k_proj.weight").T).reshape(L, nkv, hd), self.g(f"{p}.k_norm.weight"),
                self.eps).transpose(1, 0, 2)
        v = (h @ self.g(f"{p}.v_proj.weight").T).reshape(L, nkv, hd).transpose(1, 0, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = np.repeat(k, nh // nkv, axis=0), np.repeat(v, nh // nkv, axis=0)
        mask = np.tril(np.ones((L, L), dtype=bool))
        if f"{p}.indexer.index_qk_proj.weight" in self.w:
            mask &= self.indexer(f"{p}.indexer", h, cos, sin)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd)
        s = np.where(mask[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = (s @ v).transpose(1, 0, 2).reshape(L, -1) * sigmoid(gate)
        return o @ self.g(f"{p}.o_proj.weight").T

    def moe(self, p, h):
        tc = self.tc
        logits = h @ self.g(f"{p}.gate.weight").T
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        k = tc["num_experts_per_tok"]
        top = np.argsort(-probs, -1)[:, :k]
        wts = np.take_along_axis(probs, top, -1)
        if tc.get("norm_topk_prob", True):
            wts = wts / wts.sum(-1, keepdims=True)
        gu, down = self.g(f"{p}.experts.gate_up_proj"), self.g(f"{p}.experts.down_proj")
        I = gu.shape[1] // 2
        out = np.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(k):
                e = top[t, j]
                a = gu[e] @ h[t]
                out[t] += wts[t, j] * (down[e] @ (silu(a[:I]) * a[I:]))
        sh = (silu(h @ self.g(f"{p}.shared_expert.gate_proj.weight").T) * (h @ self.g(f"{p}.shared_expert.up_proj.weight").T)
              ) @ self.g(f"{p}.shared_expert.down_proj.weight").T
        return out + sigmoid(h @ self.g(f"{p}.shared_expert_gate.weight").T) * sh

    def _rope(self, n):
        tc = self.tc
        rp = tc["rope_parameters"]
        return rope_tables(np.arange(n), int(tc["head_dim"] * rp.get("partial_rotary_factor", 1.0)),
                           rp["rope_theta"])

    def layer(self, p, x, kind, cos, sin):
        """One decoder layer after its PLE: hyper-connected attention/GDN, then MoE."""
        h, inj = self.hyper(f"{p}.attn_hyper_connection", x)
        h = self.gdn(f"{p}.linear_attn", h) if kind == "linear_attention" else \
            self.attention(f"{p}.self_attn", h, cos, sin)
        x = x + (h[:, None, :] * inj[:, :, None]).reshape(x.shape)
        h, inj = self.hyper(f"{p}.mlp_hyper_connection", x)
        return x + (self.moe(f"{p}.mlp", h)[:, None, :] * inj[:, :, None]).reshape(x.shape)

    def streams(self, ids):
        """The hc_count residual streams after the last layer [L, hc*H]."""
        tc = self.tc
        ids = np.asarray(ids)
        L, hc = len(ids), tc["hc_count"]
        pre = "model.language_model"
        cos, sin = self._rope(L)
        x = np.tile(self.g(f"{pre}.embed_tokens.weight")[ids], (1, hc))
        ple_ids = sorted(set(tc.get("ple_layer_ids") or []))
        types = ["indexed_attention" if t == "full_attention" else t for t in tc["layer_types"]]
        for i, kind in enumerate(types):
            p = f"{pre}.layers.{i}"
            if i + 1 in ple_ids:
                x = x + self.ple(f"{p}.ple", x, ids, ple_ids.index(i + 1))
            x = self.layer(p, x, kind, cos, sin)
        return x

    def logits(self, ids):
        h = self.hyper("model.language_model.hyper_connection_mixer", self.streams(ids), combine=False)
        return h @ self.g("lm_head.weight").T

    def head(self, streams, next_ids):
        """The MTP head over pairs (streams_p [N, hc*H], next_ids[p]) at
        positions 0..N-1, causal (a chained draft is one more pair: the
        head's own streams and the token it drafted). Written from vLLM's
        `Qwen4ExpMultiTokenPredictor.forward` and mlx-vlm 0.7.10's
        `Qwen4ExpMTPDraftModel.fuse_inputs`: the embedding branch
        fc_embedding(norm(embed)) is added to every stream of
        fc_hidden(norm over all hc*H features, then per stream); one
        indexed-attention layer; the head's own mixer; the trunk's lm_head.
        Returns (logits [N, V], the head's streams [N, hc*H])."""
        tc = self.tc
        hc, H = tc["hc_count"], tc["hidden_size"]
        N = streams.shape[0]
        e = rms(self.g("model.language_model.embed_tokens.weight")[np.asarray(next_ids)],
                self.g("mtp.pre_fc_norm_embedding.weight"), self.eps) @ self.g("mtp.fc_embedding.weight").T
        s = rms(streams, self.g("mtp.pre_fc_norm_hidden.weight"), self.eps).reshape(N, hc, H)
        x = (s @ self.g("mtp.fc_hidden.weight").T + e[:, None, :]).reshape(N, hc * H)
        cos, sin = self._rope(N)
        x = self.layer("mtp.layers.0", x, "indexed_attention", cos, sin)
        h = self.hyper("mtp.hyper_connection_mixer", x, combine=False)
        return h @ self.g("lm_head.weight").T, x
