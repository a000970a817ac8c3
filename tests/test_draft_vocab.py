"""Trimmed draft vocabulary: drafts come only from the given ids, and a
vocabulary covering every id drafts exactly like the full lm_head."""

import mlx.core as mx

from mlx_mtp import draft_vocab as dv
from mlx_mtp.evaluate import expected_acceptance


def test_draft_tokens_restricted_to_vocab(loaded):
    model, _, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    g = mx.random.normal((6, model.language_model.args.hidden_size), key=mx.random.key(0))
    full = model.draft_tokens_from_hidden(g)
    assert mx.array_equal(model.draft_tokens_from_hidden(g, mx.arange(V, dtype=mx.int32)), full)
    ids = mx.array([3, 17, 40, 41, 200], dtype=mx.int32)
    got = model.draft_tokens_from_hidden(g, ids).tolist()
    logits = model.logits_from_hidden(g)[:, ids]
    assert got == ids[mx.argmax(logits, axis=-1)].tolist()


def test_vocab_sources(loaded, tmp_path):
    model, _, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    ids = dv.count([[5, 5, 5, 7, 7, 9]], 2, tok, V)
    assert 5 in ids and 7 in ids and 9 not in ids
    assert set(tok.eos_token_ids) <= set(ids)
    dv.save(tmp_path / "v.json", ids)
    assert dv.load(str(tmp_path / "v.json"), tok, V).tolist() == ids
    first = dv.load("50", tok, V).tolist()
    assert first[:50] == list(range(50))


def test_full_vocab_estimate_unchanged(loaded):
    model, _, tok = loaded("dense")
    V = model.language_model.args.vocab_size
    tokens = tok.encode("while True:\n    x += 1\n" * 3)
    a = expected_acceptance(model, tokens, depth=2, max_starts=8)
    b = expected_acceptance(model, tokens, depth=2, max_starts=8,
                            draft_vocab=mx.arange(V, dtype=mx.int32))
    assert a["acceptance"] == b["acceptance"]
