"""Helpers shared by the exactness tests (not a test module)."""

import itertools
import os

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_mtp
from mlx_mtp.cache import head_caches
from mlx_mtp.decode import generate_tokens

def slow(*values, id=None):
    """A parametrize case for the slow tier (pytest -m slow): it repeats a
    claim another, default case proves."""
    return pytest.param(*values, marks=pytest.mark.slow, id=id)


SHORT = "def f(x):"
LONG = "import os\nclass Spam(object):\n    def eggs(self, n):\n        return [i * n for i in range(n)]\n"

OPENBLAS = "openblas" in os.environ.get("LD_PRELOAD", "").lower()
# Bit for bit with MLX's bundled BLAS (CI); OpenBLAS rounds padded or
# multi-row matmuls differently (~1e-7), where only token identity holds.
SAME = mx.array_equal if not OPENBLAS else (lambda a, b: mx.allclose(a, b, atol=1e-4))


def reference(ref_model, ids, max_tokens=40, step=2048, processors=None, rows=False,
              prompt_cache=None):
    """mlx_lm.generate_step's tokens (and log-prob rows [n, V] with rows=True)."""
    out = list(generate_step(mx.array(ids), ref_model, max_tokens=max_tokens,
                             prefill_step_size=step, logits_processors=processors,
                             prompt_cache=prompt_cache))
    tokens = [t for t, _ in out]
    return (tokens, mx.stack([r for _, r in out])) if rows else tokens


# arguments only the loop takes (tests and benchmarks), not the public generate_step
HOOKS = ("drafter", "controller", "timeline")


def mtp(model, ids, k, max_tokens=40, take=None, rows=False, **kw):
    """mlx_mtp's tokens (the first `take` when given), optionally with rows:
    through the public `mlx_mtp.generate_step`, or the loop's `generate_tokens`
    when a test hook (a drafter, a controller) is passed."""
    if any(h in kw for h in HOOKS):
        gen = generate_tokens(mx.array(ids), model, max_tokens=max_tokens, draft_tokens=k, **kw)
    else:
        gen = mlx_mtp.generate_step(mx.array(ids), model, max_tokens=max_tokens,
                                    draft_tokens=k, **kw)
    out = list(itertools.islice(gen, take))
    gen.close()
    tokens = [o[0] for o in out]
    return (tokens, mx.stack([o[1] for o in out])) if rows else tokens


def plain_cache(ref_model, fed, step=2048, cache=None):
    """mlx_lm's cache after plain decoding fed the tokens `fed` (prefill of all
    but the last in chunks of `step`, then one at a time, as generate_step)."""
    cache = make_prompt_cache(ref_model) if cache is None else cache
    p = mx.array(fed)
    for s in range(0, len(fed) - 1, step):
        ref_model(p[s:min(s + step, len(fed) - 1)][None], cache=cache)
        mx.eval([c.state for c in cache])
    ref_model(p[-1:][None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def assert_trunk_equal(mine: list, want: list, where=""):
    """Trunk caches (mlx_lm objects) equal: attention K/V up to the length, GDN
    conv window and state (bitwise with the bundled BLAS)."""
    for i, (a, b) in enumerate(zip(mine, want)):
        if isinstance(b, KVCache):
            assert a.offset == b.offset, f"{where} layer {i}: length {a.offset} != {b.offset}"
            n = b.offset
            assert SAME(a.keys[..., :n, :], b.keys[..., :n, :]), f"{where} keys, layer {i}"
            assert SAME(a.values[..., :n, :], b.values[..., :n, :]), f"{where} values, layer {i}"
        else:
            assert SAME(a[0], b[0]), f"{where} conv window, layer {i}"
            assert SAME(a[1], b[1]), f"{where} GDN state, layer {i}"


def assert_head_follows(model, prompt_cache, context, since=0):
    """The head's cache holds the pairs (h_p, tok_{p+1}) of the trunk's own
    hiddens over `context` (positions from `since`), and the last hidden is
    the trunk's at the last position: nothing drafted or rejected is left."""
    n_trunk = len(model.is_linear)
    seq = mx.array(context)[None]
    h = model.trunk_hidden(seq, None)
    fresh = model.mtp.layers and [KVCache() for _ in model.mtp.layers]
    model.mtp(h[:, since:-1], model.embed(seq[:, since + 1:]), fresh)
    n = len(context) - 1 - since
    for mine, want in zip(head_caches(prompt_cache, n_trunk), fresh):
        assert mine.offset == want.offset == n, (mine.offset, n)
        assert mx.allclose(mine.keys[..., :n, :], want.keys[..., :n, :], atol=1e-4)
        assert mx.allclose(mine.values[..., :n, :], want.values[..., :n, :], atol=1e-4)
    assert mx.allclose(prompt_cache[-1][0], h[:, -1:], atol=1e-4)


def assert_pooled_block_keys(indexer, entry, where=""):
    """qwen4_exp's QSA cache entry (CacheList: attention K/V, the indexer's raw
    keys, its pooled block keys) holds, at each complete block's last position,
    bit for bit what pooling every complete block of the raw keys at once gives
    (the indexer's rule before it cached them: mean in float32, RMS norm, rope
    at the block's first position), and zeros elsewhere."""
    raw, pooled = entry[1], entry[2]
    n, r = raw.offset, indexer.ratio
    assert pooled.offset == n, f"{where}: pooled {pooled.offset} != raw {n}"
    B, _, _, d = raw.keys.shape
    nb = n // r
    blocks = raw.keys[:, 0, : nb * r].reshape(B, nb, r, d).astype(mx.float32).mean(axis=2)
    blocks = mx.fast.rope(indexer.k_layernorm(blocks.astype(raw.keys.dtype))[:, None],
                          indexer.rope_dims, traditional=False, base=indexer.rope_base,
                          scale=float(r), offset=0)[:, 0]
    got = pooled.keys[:, 0, :n]
    assert mx.array_equal(got[:, r - 1 : nb * r : r], blocks), f"{where}: pooled block keys"
    ends = (mx.arange(n) % r) == r - 1
    assert not mx.any(mx.where(ends[:, None], 0, got)).item(), f"{where}: not zero between block ends"


def row_tokens(rows):
    """(request index, token) of each event `decode_rows` yields."""
    return ((i, event.token) for i, event in rows if event is not None)


def assert_tower_is_transformers(path, tower, config_cls, model_cls, images):
    """transformers' vision model (`model_cls` built from the folder's
    `vision_config` as `config_cls`, its `model.visual.*` weights) on the same
    pixel values gives the tower's features to fp32 rounding."""
    import json

    import numpy as np
    import torch

    from mlx_mtp import vision

    config = json.loads((path / "config.json").read_text())
    ref = model_cls(config_cls(**config["vision_config"])).float().eval()
    state = {k[len("model.visual."):]: torch.from_numpy(np.array(v))
             for k, v in mx.load(str(path / "model.safetensors")).items()
             if k.startswith("model.visual.")}
    missing, unexpected = ref.load_state_dict(state, strict=False)
    assert not unexpected and not [k for k in missing if "inv_freq" not in k]
    pixels, grid = vision.preprocess(tower.decode(images), tower.processor)
    with torch.no_grad():
        want = ref(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grid)).pooler_output.numpy()
    got = np.array(tower.encode(images)[0])
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())
