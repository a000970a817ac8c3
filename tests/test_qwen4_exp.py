"""Qwen3.8-Flash-Next (`qwen4_exp`) trunk: the MLX model against a NumPy
forward written from transformers' modeling code, its caches (token by token
equals the full forward; prompt-cache save/load), and `sanitize` on the
released and MLX layouts. Tiny random checkpoint in the released HF layout.
The MTP head, verify/rollback and loading through mlx_mtp are tested in
test_qwen4_exp_mtp.py (docs/qwen4_exp.md)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, load_prompt_cache, save_prompt_cache
from qwen4_exp_reference import Reference, head_sizes, layer_multipliers
from util import assert_pooled_block_keys

from mlx_mtp.models import qwen4_exp
from mlx_mtp.testing.synthetic import qwen4_exp_random_weights, write_qwen4_exp_checkpoint

# 16 tokens: QSA chooses 2 of up to 8 two-token blocks; an EOS (258) cuts the n-grams
PROMPT = [3, 17, 99, 42, 7, 7, 150, 258, 12, 64, 88, 5, 9, 200, 31, 1]


def _raw(path: Path):
    w = {}
    for f in sorted(path.glob("*.safetensors")):
        w.update({k: np.array(v) for k, v in mx.load(str(f)).items()})
    return w


def _model(config, weights):
    m = qwen4_exp.Model(qwen4_exp.ModelArgs.from_dict(config))
    m.load_weights(list(m.sanitize({k: mx.array(v) for k, v in weights.items()}).items()), strict=True)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_qwen4_exp_checkpoint(tmp_path_factory.mktemp("qwen4_exp"))
    config = json.loads((path / "config.json").read_text())
    raw = _raw(path)
    ref = Reference(raw, config["text_config"])
    want = ref.logits(PROMPT)
    return dict(path=path, config=config, raw=raw, ref=ref, want=want, model=_model(config, raw))


def _logits(model, ids, cache=None):
    return np.array(model(mx.array([ids]), cache)[0])


def test_config_and_layout_as_transformers_reads_them(ckpt):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen4ExpConfig"):
        pytest.skip("this transformers has no qwen4_exp")
    # strict config class: unknown keys or broken invariants raise
    cfg = transformers.Qwen4ExpConfig(**ckpt["config"])
    tc = cfg.text_config
    assert tc.layer_types == ["linear_attention", "indexed_attention"] * 2
    assert tc.ple_layer_ids == [1, 3] and tc.indexer_budget == 4
    raw = ckpt["raw"]
    assert "model.language_model.layers.1.self_attn.indexer.index_qk_proj.weight" in raw
    assert "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_2.weight" in raw
    assert raw["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert any(k.startswith("mtp.layers.0.self_attn.indexer.") for k in raw)


def test_ngram_hash_constants_agree_with_reference(ckpt):
    # the checkpoint's buffers come from the family's code; the reference derives its own
    raw, tc = ckpt["raw"], ckpt["config"]["text_config"]
    for j, layer in enumerate((0, 2)):
        p = f"model.language_model.layers.{layer}.ple.ple_embedding"
        assert raw[f"{p}.layer_multipliers"].tolist() == layer_multipliers(259, 3, j, tc["seed"])
        assert raw[f"{p}.ngram_heads_vocab_sizes"].tolist() == head_sizes(tc, j)
    # heads of different PLE layers hash into different prime tables
    assert set(head_sizes(tc, 0)).isdisjoint(head_sizes(tc, 1))


def test_trunk_logits_match_numpy_reference(ckpt):
    # the QSA cut must be clear of ties, or the top-k choice is arbitrary
    assert ckpt["ref"].min_margin > 1e-4
    diff = np.abs(_logits(ckpt["model"], PROMPT) - ckpt["want"]).max()
    assert diff < 1e-4, diff


@pytest.mark.parametrize("part", ["qsa", "ple_conv", "ngram_table", "hyper_streams"])
def test_each_part_shows_in_the_logits(ckpt, part):
    """The reference comparison can fail: break one part of the MLX trunk and
    it no longer matches."""
    m = _model(ckpt["config"], ckpt["raw"])
    layers = m.layers
    if part == "qsa":  # attend to every key
        for l in layers:
            if not l.is_linear:
                l.self_attn.indexer.block_topk = 10**6
    elif part == "ple_conv":
        layers[0].ple.conv1d.weight = mx.zeros_like(layers[0].ple.conv1d.weight)
    elif part == "ngram_table":  # an n-gram hashed one row off (within its row shard)
        t = layers[2].ple.ple_embedding.ngram_embedding
        for name, _, _ in t.pieces():
            t[name].weight = mx.roll(t[name].weight, 1, axis=0)
    else:  # the streams' injection weights swapped
        hc = layers[1].attn_hyper_connection.block_inject_weight
        hc.weight = hc.weight[::-1]
    assert np.abs(_logits(m, PROMPT) - ckpt["want"]).max() > 1e-3


def test_caches_are_mlx_lm_kinds(ckpt):
    kinds = [(type(c), getattr(c, "cache", None) and len(c.cache)) for c in ckpt["model"].make_cache()]
    assert kinds == [(ArraysCache, 4), (CacheList, None), (ArraysCache, 4), (CacheList, None)]
    cl = ckpt["model"].make_cache()[1]
    assert all(isinstance(c, KVCache) for c in cl.caches)


@pytest.mark.parametrize("chunks", [[1] * 16, [5, 6, 1, 4]], ids=["token_by_token", "chunks"])
def test_cached_decoding_equals_full_forward(ckpt, chunks):
    m = ckpt["model"]
    full = _logits(m, PROMPT)
    cache, outs, at = m.make_cache(), [], 0
    for n in chunks:
        outs.append(_logits(m, PROMPT[at:at + n], cache))
        at += n
    got = np.concatenate(outs)
    assert np.abs(got - full).max() < 1e-5
    # every new state was used: the PLE windows and n-gram context, the indexer's keys
    assert cache[0][2].shape == (1, 6, 96) and cache[0][3].tolist() == [PROMPT[-2:]]
    assert cache[1][1].offset == len(PROMPT) == cache[1][0].offset
    assert_pooled_block_keys(m.layers[1].self_attn.indexer, cache[1])
    assert_pooled_block_keys(m.layers[3].self_attn.indexer, cache[3])
    # and matters: the same tokens without the cache do not give these logits
    fresh = np.concatenate([_logits(m, PROMPT[i:i + 1]) for i in range(4, 8)])
    assert np.abs(fresh - full[4:8]).max() > 1e-3


def test_prompt_cache_save_load_round_trip(ckpt, tmp_path):
    m = ckpt["model"]
    full = _logits(m, PROMPT)
    cache = m.make_cache()
    _logits(m, PROMPT[:9], cache)
    f = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(f, cache, metadata={"model": "qwen4_exp"})
    loaded, meta = load_prompt_cache(f, return_metadata=True)
    assert meta == {"model": "qwen4_exp"}
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    assert loaded[0][3].dtype == cache[0][3].dtype  # token ids stay integers
    a = _logits(m, PROMPT[9:], loaded)
    b = _logits(m, PROMPT[9:], cache)
    assert np.array_equal(a, b)
    assert np.abs(a - full[9:]).max() < 1e-5
    assert_pooled_block_keys(m.layers[1].self_attn.indexer, loaded[1])


def _qsa_entries(model, cache):
    return [(l.self_attn.indexer, c) for l, c in zip(model.layers, cache) if not l.is_linear]


def test_pooled_block_keys_are_cached_not_recomputed(ckpt):
    """Each block's pooled key is kept in the cache when the block completes,
    and later steps read it there: corrupting the raw keys of complete blocks
    leaves the next step's logits unchanged, corrupting the pooled keys moves
    them (the indexer no longer pools every raw key at every step)."""
    m = ckpt["model"]
    cache = m.make_cache()
    for t in PROMPT:  # token by token: a 2-token block completes every other step
        _logits(m, [t], cache)
    for indexer, c in _qsa_entries(m, cache):
        assert_pooled_block_keys(indexer, c)
    want = _logits(m, [77], copy.deepcopy(cache))

    def corrupted(slot):
        bad = copy.deepcopy(cache)
        for _, c in _qsa_entries(m, bad):  # 16 keys: every one in a complete block
            k = c[slot].keys
            c[slot].keys = k + 5 * mx.random.normal(k.shape, key=mx.random.key(slot)).astype(k.dtype)
        return _logits(m, [77], bad)

    assert np.array_equal(corrupted(1), want)
    assert np.abs(corrupted(2) - want).max() > 1e-3


def test_sanitize_mlx_layout_and_per_expert_tensors(ckpt):
    m, want = ckpt["model"], _logits(ckpt["model"], PROMPT)
    # MLX layout in (a converted model's own weights): loaded as is, norms not shifted twice
    own = dict(tree_flatten(m.parameters()))
    m2 = qwen4_exp.Model(qwen4_exp.ModelArgs.from_dict(ckpt["config"]))
    m2.load_weights(list(m2.sanitize(own).items()), strict=True)
    assert np.array_equal(_logits(m2, PROMPT), want)
    # HF with one tensor per expert (the other layout transformers' loader accepts)
    raw = dict(ckpt["raw"])
    for k in [k for k in raw if k.endswith(".mlp.experts.gate_up_proj") and not k.startswith("mtp.")]:
        p = k[: -len(".gate_up_proj")]
        gu, down = raw.pop(k), raw.pop(f"{p}.down_proj")
        half = gu.shape[1] // 2
        for e in range(gu.shape[0]):
            raw[f"{p}.{e}.gate_proj.weight"] = gu[e, :half]
            raw[f"{p}.{e}.up_proj.weight"] = gu[e, half:]
            raw[f"{p}.{e}.down_proj.weight"] = down[e]
    assert np.abs(_logits(_model(ckpt["config"], raw), PROMPT) - want).max() < 1e-6


def _tables(model):
    """{layer: the n-gram table's parameters, by name under `ngram_embedding.`}."""
    params = dict(tree_flatten(model.parameters()))
    out = {}
    for layer in (0, 2):  # ple_layer_ids [1, 3]
        p = f"language_model.model.layers.{layer}.ple.ple_embedding.ngram_embedding."
        out[layer] = {k[len(p):]: v for k, v in params.items() if k.startswith(p)}
    return out


_PIECE = re.compile(r"^(.*\.ngram_embedding)\.shards?_(\d+)(?:_\d+)?\.(\w+)$")


def _joined(weights):
    """MLX-layout weights with each n-gram table joined into one tensor (as
    conversions were written before the row shards were kept)."""
    out, parts = {}, {}
    for k, v in weights.items():
        m = _PIECE.match(k)
        if m:
            parts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = v
        else:
            out[k] = v
    out.update({k: mx.concatenate([p[i] for i in sorted(p)]) for k, p in parts.items()})
    return out


# 7 parts (torch.chunk's cut: 6 equal, the last shorter) in groups of at most G
GROUPINGS = {8: [(i, i) for i in range(7)], 3: [(0, 1), (2, 3), (4, 6)]}


@pytest.mark.parametrize("groups", sorted(GROUPINGS))
def test_ngram_tables_load_in_groups_of_row_shards(ckpt, monkeypatch, groups):
    """The n-gram tables are never joined whole: with 7 checkpoint shards the
    loaded model holds one array per group of consecutive shards (G=8: each
    shard itself, the same array; G=3: shards 0-1, 2-3, 4-6 joined), each
    fewer rows than the table, and its logits equal the 3-shard checkpoint's
    bit for bit (a lookup is a gather). What it holds (as convert writes it)
    loads again as the same arrays, and into the other grouping. An older
    conversion (each table one tensor) loads cut into the groups (views),
    same logits; and into a one-shard config (a plain take)."""
    monkeypatch.setattr(qwen4_exp, "NGRAM_GROUPS", groups)
    tc = dict(ckpt["config"]["text_config"], split_ngram_parts=7)
    config = dict(ckpt["config"], text_config=tc)
    raw = qwen4_exp_random_weights(tc)  # the fixture's seed: the same table, cut in 7
    m = _model(config, raw)
    want = _logits(ckpt["model"], PROMPT)
    assert np.array_equal(_logits(m, PROMPT), want)
    for layer, held in _tables(m).items():
        p = f"model.language_model.layers.{layer}.ple.ple_embedding.ngram_embedding."
        src = [raw[f"{p}shard_{i}.weight"] for i in range(7)]
        rows = [s.shape[0] for s in src]
        assert len(rows) == 7 and rows[-1] < rows[0] and len(set(rows[:-1])) == 1, rows
        assert sorted(held) == sorted(f"{qwen4_exp.piece_name(a, b)}.weight" for a, b in GROUPINGS[groups])
        for a, b in GROUPINGS[groups]:
            v = np.concatenate(src[a : b + 1])
            got = held[f"{qwen4_exp.piece_name(a, b)}.weight"]
            assert got.shape == v.shape and got.shape[0] < sum(rows) and np.array_equal(np.array(got), v), (a, b)

    written = dict(tree_flatten(m.parameters()))  # what convert writes
    again = qwen4_exp.Model(qwen4_exp.ModelArgs.from_dict(config)).sanitize(dict(written))
    for k, v in written.items():
        if ".ngram_embedding." in k:
            assert again[k] is v, k  # loads as it is: not joined again
    other = 3 if groups == 8 else 8
    monkeypatch.setattr(qwen4_exp, "NGRAM_GROUPS", other)
    m2 = _model(config, {k: np.array(v) for k, v in written.items()})
    assert [len(t) for t in _tables(m2).values()] == [len(GROUPINGS[other])] * 2
    assert np.array_equal(_logits(m2, PROMPT), want)
    monkeypatch.setattr(qwen4_exp, "NGRAM_GROUPS", groups)

    joined = _joined(written)
    assert "language_model.model.layers.0.ple.ple_embedding.ngram_embedding.weight" in joined
    for parts in (7, 1):
        cfg = dict(ckpt["config"], text_config=dict(tc, split_ngram_parts=parts))
        old = qwen4_exp.Model(qwen4_exp.ModelArgs.from_dict(cfg))
        old.load_weights(list(old.sanitize(dict(joined)).items()), strict=True)
        assert [len(t) for t in _tables(old).values()] == [min(parts, groups)] * 2
        assert np.array_equal(_logits(old, PROMPT), want), parts


def test_ngram_groups_of_512_shards():
    """The release's 512 parts: 8 groups of 64 consecutive shards, their
    bounds from the rows alone; a group that joins shards needs them all."""
    rows = qwen4_exp.chunk_rows(5 * 512 - 3, 512)
    assert len(rows) == 512
    t = qwen4_exp.RowShardedEmbedding(rows, 2)
    assert [name for name, _, _ in t.pieces()] == [f"shards_{64 * g}_{64 * g + 63}" for g in range(8)]
    assert sum(n for _, _, n in t.pieces()) == sum(rows) and t.rows_of("shards_64_127") == (t.pieces()[1][1], t.pieces()[2][1])
    parts = [(t.shard_starts[i], mx.full((r, 2), i)) for i, r in enumerate(rows) if i != 70]
    got = t.regroup(parts)
    assert "shards_64_127" not in got and len(got) == 7  # shard 70 missing: left out, a strict load names it
    assert np.array_equal(np.array(got["shards_0_63"])[:, 0], np.repeat(np.arange(64), rows[:64]))


@pytest.mark.parametrize("groups", [8, 3])
@pytest.mark.parametrize("ranks", [2, 3])
def test_tensor_parallel_rows_exact_without_joining(ranks, groups):
    """`keep_rows` (what `Model.shard` does per rank): rank r keeps rows
    [r*R/N, (r+1)*R/N), groups inside whole, a group across a bound
    sliced, the rest dropped; the ranks' lookups (zeros for rows held
    elsewhere) sum to the whole table's, bit for bit."""
    rows = qwen4_exp.chunk_rows(312, 7)  # 6 x 45, then 42
    full = qwen4_exp.RowShardedEmbedding(rows, 4, groups)
    assert len(full.pieces()) == min(groups, 7)
    mx.eval(full.parameters())
    ids = mx.array([[5, 44, 45, 311, 0, 150], [156, 157, 208, 104, 270, 269]])
    want = np.array(full(ids))
    whole = np.concatenate([np.array(full[name].weight) for name, _, _ in full.pieces()])
    assert whole.shape[0] == 312 and np.array_equal(want, whole[np.array(ids)])
    total = np.zeros_like(want)
    for r in range(ranks):
        part = qwen4_exp.RowShardedEmbedding(rows, 4, groups)
        part.update(full.parameters())
        lo, hi = r * 312 // ranks, (r + 1) * 312 // ranks
        part.keep_rows(lo, hi)
        pieces = part.pieces()
        assert pieces[0][1] == lo and sum(n for _, _, n in pieces) == hi - lo
        assert len(tree_flatten(part.parameters())) == len(pieces)
        for name, start, n in pieces:  # a group inside is kept whole
            a, b = part.rows_of(name)
            inside = lo <= a and b <= hi
            assert (start, n) == (a, b - a) if inside else n < b - a, name
        got = np.array(part(ids))
        assert not np.any(got[(np.array(ids) < lo) | (np.array(ids) >= hi)])
        total += got
    assert np.array_equal(total, want)


def test_rows_of_a_batch_decode_as_alone(ckpt):
    m = ckpt["model"]
    other = PROMPT[::-1]
    both = np.array(m(mx.array([PROMPT, other])))
    assert np.abs(both[0] - ckpt["want"]).max() < 1e-4
    assert np.abs(both[1] - _logits(m, other)).max() < 1e-5


def test_loads_and_decodes_through_mlx_lm(ckpt):
    """mlx_lm's loader (safetensors glob, sanitize, strict load) and its
    generate_step (prefill in steps, then one token at a time on the cache)
    give the greedy tokens a full forward per step gives."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    m, _ = load_model(ckpt["path"], get_model_classes=lambda config: (qwen4_exp.Model, qwen4_exp.ModelArgs))
    assert np.array_equal(_logits(m, PROMPT), _logits(ckpt["model"], PROMPT))
    got = [int(t) for t, _ in generate_step(mx.array(PROMPT), m, max_tokens=8, prefill_step_size=5)]
    ids = list(PROMPT)
    for _ in range(8):
        ids.append(int(np.argmax(_logits(m, ids)[-1])))
    assert got == ids[len(PROMPT):]


def test_second_geometry_matches_reference(tmp_path):
    """Other choices the config allows: silu output gate (mlx_lm's gated norm),
    4 streams, 4-grams with one head each, 3-token QSA blocks, one PLE layer,
    one n-gram shard, GDN layers back to back, EOS runs in the prompt."""
    overrides = dict(
        hc_count=4, output_gate_type=None, ngram_size=4, heads_per_ngram=1, ple_embed_dim=12,
        ple_conv_kernel_size=4, indexer_compress_ratio=3, indexer_budget=6, ple_layer_ids=[1],
        split_ngram_parts=1, num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0]})
    path = write_qwen4_exp_checkpoint(tmp_path, seed=1, mtp=False, text_overrides=overrides)
    config, raw = json.loads((path / "config.json").read_text()), _raw(path)
    ids = PROMPT + [258, 258, 4]
    ref = Reference(raw, config["text_config"])
    want = ref.logits(ids)
    assert ref.min_margin > 1e-4
    m = _model(config, raw)
    full = _logits(m, ids)
    assert np.abs(full - want).max() < 1e-4
    cache = m.make_cache()
    assert [type(c) for c in cache] == [ArraysCache, ArraysCache, CacheList, ArraysCache, CacheList]
    assert len(cache[0].cache) == 4 and len(cache[1].cache) == 2
    inc = np.concatenate([_logits(m, [t], cache) for t in ids])
    assert np.abs(inc - full).max() < 1e-5
