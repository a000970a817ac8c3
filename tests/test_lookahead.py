"""The loop with lookahead 1 (pipelined) samples exactly what lookahead 0
(synchronous) samples: the same keys split in the same order, so the same
seed gives the same tokens; a sampled EOS stops both at the same place."""

import mlx.core as mx
import pytest

import mlx_mtp
from mlx_mtp.stats import MTPStats
from util import SAME, SHORT, mtp

SAMPLING = [(0, dict(temp=1.0)), (1, dict(temp=10.0)), (2, dict(temp=5.0, top_k=100)),
            (3, dict(temp=10.0, top_p=0.98))]


@pytest.mark.parametrize("k,cfg", SAMPLING, ids=["plain", "temp", "top_k", "top_p"])
def test_sampling_same_keys(loaded, k, cfg):
    """Unbounded generation (max_tokens=-1, 40 tokens read). High
    temperatures make the random head's drafts accepted often, so accepting
    and rejecting cycles both occur."""
    model, _, tok = loaded("dense")
    ids = tok.encode(SHORT)
    sampler, stats = mlx_mtp.make_sampler(**cfg), MTPStats()
    pipe, rows = mtp(model, ids, k, -1, take=40, sampler=sampler, seed=k, stats=stats, rows=True)
    sync, sync_rows = mtp(model, ids, k, -1, take=40, sampler=sampler, seed=k, rows=True,
                          lookahead=False)
    assert pipe == sync
    assert SAME(rows, sync_rows)
    assert k == 0 or 0 < stats.accepted < stats.drafted
    if k == 1:  # the seed decides the tokens: the comparison above is not vacuous
        assert pipe != mtp(model, ids, k, -1, take=40, sampler=sampler, seed=k + 100)


def test_sampling_same_keys_bounded(loaded):
    """Neither loop caps the depth by max_tokens (the pipelined one cannot know
    how many tokens the cycle in flight emits), so with a limit too the two
    split the same keys."""
    model, _, tok = loaded("dense")
    ids = tok.encode(SHORT)
    sampler = mlx_mtp.make_sampler(temp=10.0)
    assert mtp(model, ids, 3, 33, sampler=sampler, seed=3) == \
        mtp(model, ids, 3, 33, sampler=sampler, seed=3, lookahead=False)


def test_sampled_eos_stops_like_synchronous(loaded, dense_ckpt):
    model, _, _ = loaded("dense")
    _, tok = mlx_mtp.load(dense_ckpt, quiet=True)
    own = set(tok.eos_token_ids)
    sampler = mlx_mtp.make_sampler(temp=10.0)

    def tokens(lookahead):
        return [r.token for r in mlx_mtp.stream_generate(
            model, tok, SHORT, max_tokens=60, draft_tokens=3, sampler=sampler, seed=5,
            lookahead=lookahead)]

    sync = tokens(False)
    stop = next(i for i in range(6, 40) if sync.index(sync[i]) == i)
    tok._eos_token_ids = own | {sync[stop]}
    assert tokens(False) == sync[:stop + 1]
    assert tokens(True) == sync[:stop + 1]
    tok._eos_token_ids = own


def test_old_lookahead_spelling_still_works(loaded, dense_ckpt, capsys):
    """`pipeline=` / `--no-pipeline` were lookahead's names before the word
    was left to pipeline parallelism: accepted, with a deprecation notice."""
    from mlx_mtp.cli import main

    model, _, tok = loaded("dense")
    ids = tok.encode(SHORT)
    sync = mtp(model, ids, 2, 20, lookahead=False)
    with pytest.warns(DeprecationWarning, match="lookahead="):
        old = [t for t, _ in mlx_mtp.generate_step(mx.array(ids), model,
                                                   max_tokens=20, draft_tokens=2, pipeline=False)]
    assert old == sync
    main(["--model", str(dense_ckpt), "--prompt", SHORT, "--max-tokens", "4",
          "--no-pipeline", "--ignore-chat-template"])
    assert "--no-pipeline is deprecated; use --no-lookahead" in capsys.readouterr().err


def test_host_side_drafter_sees_the_rows_tokens(loaded):
    """A host-side drafter drafts from the tokens emitted so far: the loop
    reports them (`Drafter.observe`) as each cycle is read, and `start`s it
    for a new row."""
    from mlx_mtp.testing.drafters import DistributionDrafter

    model, _, tok = loaded("dense")
    V = model.vocab_size
    prefixes = []

    def dist(prefix):
        prefixes.append(prefix)
        return [1.0 / V] * V

    drafter = DistributionDrafter(dist, V, seed=1)
    sampler = mlx_mtp.make_sampler(temp=1.0)
    for seed in (1, 2):  # the second generation starts from an empty history
        prefixes.clear()
        got = mtp(model, tok.encode(SHORT), 2, 12, sampler=sampler, seed=seed, drafter=drafter)
        assert drafter.generated == got
        # each cycle's first draft comes from exactly the tokens emitted before it
        firsts = [p for p in prefixes if got[:len(p)] == list(p)]
        assert firsts[0] == () and len(set(map(len, firsts))) > 3


def test_stats_add_pools_generations_of_different_depths():
    a, b = MTPStats(), MTPStats()
    a.record(1, 1)
    b.record(3, 2)
    b.record(2, 0)
    a.add(b)
    assert (a.cycles, a.emitted) == (3, 6)
    assert a.drafted_at == [3, 2, 1] and a.accepted_at == [2, 1, 0]
