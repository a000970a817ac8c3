"""qwen4_exp: prompts prefilled together, on mlx_lm's batch caches
(BatchKVCache with left padding for the QSA K/V and indexer keys, ArraysCache
masks for the GDN and PLE states), leave each row exactly as it is prefilled
alone, and batch_generate's rows (joining a running batch too) decode as each
prompt alone. See docs/qwen4_exp.md, "Batched prefill"."""

from __future__ import annotations

import types

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, make_prompt_cache
from util import OPENBLAS, reference

import mlx_mtp
from mlx_mtp import batch as batch_module
from mlx_mtp import prefill as prefill_module
from mlx_mtp.cycle import Spec
from mlx_mtp.prefill import prefill
from mlx_mtp.models import qwen4_exp
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

EOS = 258  # the tiny config's: QSA blocks of 2 tokens, a PLE conv window of 6 positions


def _prompt(n: int, seed: int) -> list:
    ids = [(seed * 31 + i * 57) % 250 + 3 for i in range(n)]
    if n > 8:
        ids[n // 2] = EOS  # an n-gram cut inside the prompt
    return ids


# rows of 5, 17, 33 tokens: several indexer blocks and conv windows apart
FRESH = [_prompt(5, 1), _prompt(17, 2), _prompt(33, 3)]
# a second turn: the first two rows hold 4 and 17 tokens (left padding 13 and 0
# when merged: odd, so a block counted from the padded start would be cut
# elsewhere), the third row is fresh (its n-gram context must start as EOS)
HISTORY = [_prompt(5, 4), _prompt(18, 5), None]
TURN2 = [_prompt(12, 6), _prompt(3, 7), _prompt(33, 8)]
STEP = 8  # prefill pieces: rows go on after others' padded last pieces
# a stop mid-prompt (the server's prefix-cache snapshots): the third row's next
# pieces run with left padding (5) in its trunk caches
STOPS = {"fresh": [(), (), (3,)], "turn2": [(), (5,), ()]}
TOL = 1e-5 if OPENBLAS else 0.0  # bitwise with MLX's bundled BLAS


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return mlx_mtp.load(write_qwen4_exp_checkpoint(tmp_path_factory.mktemp("q4x_prefill")),
                        quiet=True)


@pytest.fixture(scope="module")
def model(loaded):
    return loaded[0]


def _caches(model, case):
    """Each row's prompt cache (trunk, head, last hidden) before the prompts."""
    out = []
    for h in (HISTORY if case == "turn2" else [None] * 3):
        c = model.make_cache() + model.mtp.make_cache() + [ArraysCache(size=2)]
        if h is not None:
            prefill(Spec(model), [c], [h], STEP)
        out.append(c)
    return out


def _prefill(model, case, together: bool):
    prompts = TURN2 if case == "turn2" else FRESH
    caches = _caches(model, case)
    spec = Spec(model)
    if together:
        done = prefill(spec, caches, prompts, STEP, stops=STOPS[case])
    else:
        done = [prefill(spec, [c], [p], STEP)[0] for c, p in zip(caches, prompts)]
    mx.eval([c.state for row in caches for c in row], [(d.h, d.g) for d in done])
    return caches, done


@pytest.fixture(scope="module")
def alone(model):
    return {case: _prefill(model, case, False) for case in ("fresh", "turn2")}


def _worst(a, b) -> float:
    """Largest difference between two prompt caches (every KVCache of a
    CacheList, every ArraysCache entry: GDN conv window and state, PLE conv
    window and n-gram context, the kept hidden): inf where lengths, kinds or
    integer entries differ."""
    worst = 0.0
    for x, y in zip(a, b):
        if isinstance(y, CacheList):
            for u, v in zip(x.caches, y.caches):
                if u.offset != v.offset:
                    return float("inf")
                n = v.offset
                for p, q in ((u.keys, v.keys), (u.values, v.values)):
                    if q is not None and q[..., :n, :].size:
                        worst = max(worst, mx.abs(p[..., :n, :] - q[..., :n, :]).max().item())
            continue
        for u, v in zip(x.cache, y.cache):
            if (u is None) != (v is None):
                return float("inf")
            if v is None:
                continue
            if u.shape != v.shape or (mx.issubdtype(v.dtype, mx.integer)
                                      and not mx.array_equal(u, v)):
                return float("inf")
            worst = max(worst, mx.abs(u.astype(mx.float32) - v.astype(mx.float32)).max().item())
    return worst


def _rows_worst(got, want) -> float:
    worst = 0.0
    for (c, d), (wc, wd) in zip(zip(*got), zip(*want)):
        worst = max(worst, _worst(c, wc))
        for x, y in ((d.h, wd.h), (d.g, wd.g)):
            if (x is None) != (y is None):
                return float("inf")
            if y is not None:
                worst = max(worst, mx.abs(x - y).max().item())
    return worst


@pytest.mark.parametrize("case", ["fresh", "turn2"])
def test_prefilled_together_equals_alone(model, alone, case):
    """Rows of 5, 17 and 33 tokens (fresh), and a second turn over histories
    of 4, 17 and no tokens, prefilled together in pieces of 8 with a stop
    mid-prompt: every trunk and head state of each row (QSA K/V and indexer
    keys, GDN conv window and state, PLE conv window and n-gram context) and
    its last trunk hidden (its logits) and head hidden are the row's alone."""
    worst = _rows_worst(_prefill(model, case, True), alone[case])
    assert worst <= TOL, worst


def _blind_indexer(monkeypatch):
    """The indexer sees no left padding: blocks counted from the buffer's
    start, padded keys selectable."""
    call = qwen4_exp.QSAIndexer.__call__

    def blind(self, x, cache=None, offset=0):
        c = cache and tuple(types.SimpleNamespace(update_and_fetch=k.update_and_fetch) for k in cache)
        return call(self, x, c, offset)
    monkeypatch.setattr(qwen4_exp.QSAIndexer, "__call__", blind)


BREAKS = {
    "indexer_padding": _blind_indexer,
    # the PLE ignores the mask: n-grams and conv reach into padding, windows cut at the end
    "ple_mask": lambda mp: mp.setattr(qwen4_exp.PLELayer, "__call__", (
        lambda f: lambda self, x, inputs, mask=None, cache=None: f(self, x, inputs, None, cache)
    )(qwen4_exp.PLELayer.__call__)),
    # no mask for the GDN (and PLE): padded positions enter the recurrence
    "gdn_mask": lambda mp: mp.setattr(qwen4_exp, "create_ssm_mask", lambda h, c=None: None),
    # a fresh row merged beside rows with history starts from mlx_lm's zeros
    "fresh_row_start": lambda mp: mp.setattr(prefill_module, "fill_empty", lambda *a: None),
}


@pytest.mark.parametrize("broken", list(BREAKS))
def test_prefilled_together_would_differ(model, alone, broken, monkeypatch):
    """The comparison can fail: with one part of the padding handling
    undone, some row's states move."""
    BREAKS[broken](monkeypatch)
    assert _rows_worst(_prefill(model, "turn2", True), alone["turn2"]) > 1e-3


def test_batch_generate_rows_equal_alone(loaded, monkeypatch):
    """Greedy batch_generate at depths 0, 2 and auto, three rows at a time:
    prompts of 5, 17 and 33 tokens (the first two after a cached first turn
    of 4 and 17 tokens: left padding in the trunk's caches) prefill
    together; the next two (one after a cached turn of 7) join together while
    a row still decodes. Each row's tokens are its prompt's decoded alone
    (mlx_lm's generate_step on mlx_lm's cache of the same turn), and so is
    its trunk's cache after (every QSA, GDN and PLE state)."""
    model, tokenizer = loaded
    prompts = FRESH + [_prompt(9, 9), _prompt(6, 10)]
    history = [_prompt(4, 11), _prompt(17, 12), None, _prompt(7, 13), None]
    limits = [14, 4, 4, 6, 6]
    caches, want, refs = [], [], []
    for p, h, m in zip(prompts, history, limits):
        cache, ref = model.make_cache(), make_prompt_cache(model)
        if h is not None:
            list(mlx_mtp.generate_step(mx.array(h), model, max_tokens=0, prompt_cache=cache))
            model(mx.array([h]), cache=ref)
        caches.append(cache)
        want.append(reference(model, p, m, prompt_cache=ref))
        refs.append(ref)
    assert not any(EOS in w for w in want)  # every row runs to max_tokens
    joins = []
    join = batch_module.Batch._join

    def spy(self, requests):
        joins.append((len(requests), len(self.rows)))
        return join(self, requests)
    monkeypatch.setattr(batch_module.Batch, "_join", spy)
    for k in (0, 2, "auto"):
        joins.clear()
        out = mlx_mtp.batch_generate(model, tokenizer, prompts, max_tokens=limits,
                                     prompt_caches=caches, draft_tokens=k,
                                     completion_batch_size=3, return_token_ids=True,
                                     return_prompt_caches=True)
        assert out.token_ids == want, f"depth {k}"
        n_trunk = len(model.is_linear)
        worst = max(_worst(c[:n_trunk], ref[:n_trunk]) for c, ref in zip(out.caches, refs))
        print(f"depth {k}: max state diff {worst:.1e}")
        assert worst <= TOL, f"depth {k}: {worst}"
        assert joins[0] == (3, 0) and any(n > 1 and running for n, running in joins[1:]), joins
