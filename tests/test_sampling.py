"""Exact speculative sampling: the output distribution with MTP is the target's.

Layers of proof:
  1. χ² goodness-of-fit of the joint distribution of the first 3 generated
     tokens against the exact distribution enumerated from trunk logits
     (p(t1) from the prompt, p(t2|t1) from a forward over prompt+t1, ...),
     for temperature, top-p, top-k, min-p and repetition penalty at depths
     1–3, on 2·10⁴ samples each. The decode cycle is simulated vectorised
     (many samples at once) around the decoder's own Leviathan–Chen kernel
     `speculative_sample`, with target rows from the trunk and a drafter q that
     overlaps p (so acceptances AND rejections happen), including multi-cycle
     paths (rejections at depth 1 need a second cycle for t3).
  2. Drafters that lie about q (claim uniform; claim q = p, i.e. the naive
     "accept what the head sampled"; claim another drafter's q) must FAIL the
     same χ² test: the tests have power.
  3. End to end through the decode loop with the real head (also over a trimmed
     draft vocabulary) or a DistributionDrafter: χ² on the first 3 tokens at
     800 samples (10⁴ and every setting × depth with MLX_MTP_SLOW_TESTS=1);
     the log-prob rows the decoder yields equal mlx_lm's teacher-forced
     processed ones at every emitted position (so GDN commit / KV trim /
     processor history are right after every accept pattern); a head that
     matches the trunk is accepted ~always (q is computed like p); one host
     sync per cycle; seed reproducibility (API and CLI); greedy unchanged.
  4. On the demo model (when shipped): χ² end to end with its trained head,
     and acceptance at temperatures 0, 0.6, 1.0.
A restricted support S (logit bias -1e9 elsewhere) keeps the χ² bins populated.
"""

import itertools
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

from mlx_mtp.cycle import Spec
from mlx_mtp.testing.drafters import DistributionDrafter, OracleDrafter
from mlx_mtp.decode import generate_tokens
from mlx_mtp.stats import MTPStats
from mlx_mtp.acceptance import speculative_sample
from mlx_mtp.sampling import make_sampler
from util import slow

scipy_stats = pytest.importorskip("scipy.stats")

SLOW = os.environ.get("MLX_MTP_SLOW_TESTS", "0") not in ("", "0")
V = 259
S = [171, 95, 225, 117, 160, 197]  # support of every target distribution here
PROMPT = [10, 20, 225, 30, 40]
L = 3  # generated tokens whose joint distribution is tested
N = 20000
ALPHA = 1e-3

CONFIGS = {
    "temp": (dict(temp=0.6), None),
    "top_p": (dict(temp=1.0, top_p=0.72), None),
    "top_k": (dict(temp=1.0, top_k=3), None),
    "min_p": (dict(temp=1.0, min_p=0.2), None),
    "rep": (dict(temp=1.0), (3.0, 20)),
    "xtc": (dict(temp=1.0, min_p=0.1, xtc_probability=0.6, xtc_threshold=0.1), None),
}


def bias():
    return {t: -1e9 for t in range(V) if t not in S}


def processors(cfg):
    rep = CONFIGS[cfg][1]
    return make_logits_processors(bias(), rep[0] if rep else None, rep[1] if rep else 20)


def sampler(cfg, **kw):
    return make_sampler(**CONFIGS[cfg][0], **kw)


# -- the exact target distribution, in float64 NumPy (independent of mlx_lm's code)
def _log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def reference_p(raw_logits, history, cfg):
    """p(. | history) over the full vocabulary, as mlx_lm would sample it."""
    s, rep = CONFIGS[cfg]
    mask = np.zeros(V, bool)
    mask[S] = True
    return reference_p_general(raw_logits, history, s, rep, support=mask)


def reference_p_general(raw_logits, history, s, rep=None, support=None):
    """mlx_lm's sampling distribution in float64: logit bias (-1e9 outside
    `support`), repetition penalty (penalty, context), log-softmax, top-p,
    min-p, top-k (mlx_lm's order and tie rules), temperature."""
    x = np.asarray(raw_logits, np.float64).copy()
    if support is not None:
        x[~support] += -1e9
    if rep:
        for t in set(history[-rep[1]:]):
            x[t] = x[t] * rep[0] if x[t] < 0 else x[t] / rep[0]
    lp = _log_softmax(x)
    keep = np.isfinite(lp) & (lp > -1e6)
    if 0 < s.get("top_p", 0) < 1:  # smallest top set with mass >= top_p
        order = np.argsort(-lp)
        cum = np.cumsum(np.exp(lp[order]))
        n = int(np.searchsorted(cum, s["top_p"] * cum[-1]) + 1)
        thr = lp[order][n - 1]
        keep &= lp >= thr
    if s.get("min_p", 0):
        keep &= lp >= lp.max() + np.log(s["min_p"])
    if s.get("top_k", 0):
        keep &= lp >= np.sort(lp)[-s["top_k"]]

    def dist(keep):
        z = np.where(keep, lp / s["temp"], -np.inf)
        p = np.exp(z - z.max())
        return p / p.sum()

    if not s.get("xtc_probability", 0):
        return dist(keep)
    # XTC (no top_k in these configs): with probability xtc_probability every
    # token above the least probable one over the threshold is removed
    probs = dist(keep) if s["temp"] == 1 else None
    above = probs > s["xtc_threshold"]
    excluded = keep & ~(probs > probs[above].min()) if above.any() else keep
    w = s["xtc_probability"]
    return w * dist(excluded) + (1 - w) * dist(keep)


def enumerate_joint(ref_model, prompt, s, rep, n_tokens, min_prob=1e-7):
    """Exact joint distribution of the first n_tokens from trunk logits: one
    forward over prompt + prefix for every prefix in the support."""
    joint = {}

    def rec(prefix, pr):
        if len(prefix) == n_tokens:
            joint[prefix] = pr
            return
        x = mx.array(list(prompt) + list(prefix))[None]
        raw = np.array(ref_model(x)[0, -1].astype(mx.float32))
        p = reference_p_general(raw, list(prompt) + list(prefix), s, rep)
        for t in np.nonzero(p * pr > min_prob)[0]:
            rec(prefix + (int(t),), pr * p[t])

    rec((), 1.0)
    return joint


LM_HEAD_SCALE = 0.25  # flatter logits than the shared fixtures: more outcomes per position


@pytest.fixture(scope="module")
def flat_ckpt(tmp_path_factory):
    from mlx_mtp.testing.synthetic import random_weights, tiny_text_config, write_checkpoint

    w = random_weights(tiny_text_config(), seed=5)
    w["lm_head.weight"] = w["lm_head.weight"] * LM_HEAD_SCALE
    return write_checkpoint(tmp_path_factory.mktemp("flat"), weights=w)


@pytest.fixture(scope="module")
def models(flat_ckpt):
    """(mlx_mtp model, mlx_lm model) of the flat checkpoint."""
    import mlx_lm

    import mlx_mtp

    return mlx_mtp.load(flat_ckpt)[0], mlx_lm.load(str(flat_ckpt))[0]


@pytest.fixture(scope="module")
def trunk_logits(models):
    """Raw trunk logits after prompt + every prefix over S of length < L."""
    ref_model = models[1]
    out = {}
    for n in range(L):
        for prefix in itertools.product(S, repeat=n):
            x = mx.array(PROMPT + list(prefix))[None]
            out[prefix] = np.array(ref_model(x)[0, -1].astype(mx.float32))
    return out


def exact_tables(trunk_logits, cfg):
    """prefix -> p over the full vocabulary, and the exact joint of L tokens."""
    p = {pre: reference_p(lg, PROMPT + list(pre), cfg) for pre, lg in trunk_logits.items()}
    joint = {}
    for seq in itertools.product(S, repeat=L):
        pr = 1.0
        for i in range(L):
            pr *= p[seq[:i]][seq[i]]
        if pr > 0:
            joint[seq] = pr
    return p, joint


def chi2_pvalue(samples, joint):
    """samples: iterable of L-tuples. Bins with expected count < 10 are pooled
    (keeps Pearson's χ² near its asymptotic law with many bins); a sample
    outside the support fails outright."""
    n = len(samples)
    counts = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    outside = sum(c for s, c in counts.items() if s not in joint)
    if outside:
        return 0.0
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for seq, pr in joint.items():
        if pr * n >= 10:
            obs.append(counts.get(seq, 0))
            exp.append(pr * n)
        else:
            pool_o += counts.get(seq, 0)
            pool_e += pr * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = np.array(exp) * (n / np.sum(exp))
    return float(scipy_stats.chisquare(obs, exp).pvalue)


# -- vectorised simulation of the decode cycles around the decoder's kernel -----
def _draft_table(p_tab, mix=0.4, seed=0):
    """q(. | prefix): overlaps p but differs (a mixture with a random
    distribution over S), so drafts are often but not always accepted; it
    also proposes tokens p has filtered out."""
    rng = np.random.default_rng(seed)
    q = {}
    for pre, p in p_tab.items():
        r = np.zeros(V)
        r[S] = rng.dirichlet(np.ones(len(S)))
        q[pre] = (1 - mix) * p + mix * r
    return q


def _copy_table(p_tab, seed=0):
    """A point drafter's choice after each prefix (q = δ there): the most
    probable token half of the time, else any token of S (often one that p
    gives little mass, or that a filter removed), like a copied run that
    is sometimes right."""
    rng = np.random.default_rng(seed)
    copy = {}
    for pre, p in p_tab.items():
        t = S[int(np.argmax(p[S]))] if rng.random() < 0.5 else S[rng.integers(len(S))]
        copy[pre] = (np.arange(V) == t).astype(np.float64)
    return copy


def simulate(p_tab, q_tab, k, n, seed, claimed=None, copy=None, point_share=0.0):
    """First L tokens of n independent generations at depth k: t1 ~ p, then
    cycles of (drafts ~ q, Leviathan–Chen on the verify rows), exactly the
    decoder's cycle, on restricted-support tables. With a `copy` table, each
    draft is instead, with probability `point_share`, the copy table's token,
    verified as a point draft (all of them: q None). Returns [n, L] tokens."""
    m = len(S)
    prefixes = [pre for i in range(L) for pre in itertools.product(range(m), repeat=i)]
    pid = {pre: i for i, pre in enumerate(prefixes)}
    dummy = len(prefixes)  # prefixes of length >= L: rows never used for the tested tokens
    child = np.full((dummy + 1, m), dummy)
    for pre, i in pid.items():
        for t in range(m):
            child[i, t] = pid.get(pre + (t,), dummy)

    def table(tab):
        rows = np.full((dummy + 1, m), 1.0 / m)
        for pre, i in pid.items():
            rows[i] = tab[tuple(S[t] for t in pre)][S]
        return rows

    P, Q = table(p_tab), table(q_tab)
    C = table(claimed) if claimed is not None else Q
    X = table(copy).argmax(axis=1) if copy is not None else None
    rng = np.random.default_rng(seed)
    key = mx.random.key(seed)

    def draw(rows):
        c = np.cumsum(rows, axis=1)
        u = rng.random(len(rows))[:, None] * c[:, -1:]
        return np.minimum((u >= c).sum(axis=1), m - 1)

    gen = np.full((n, L + k + 1), -1)
    cur = np.zeros(n, int)
    t1 = draw(P[np.zeros(n, int)])
    gen[:, 0], cur[:] = t1, child[0, t1]
    length = np.ones(n, int)
    rows_n = np.arange(n)
    with np.errstate(divide="ignore"):
        while (length < L).any():
            ids, drafts, claims, points = [cur], [], [], []
            for _ in range(k):
                d = draw(Q[ids[-1]])
                point = rng.random(n) < point_share
                if X is not None:
                    d = np.where(point, X[ids[-1]], d)
                drafts.append(d)
                claims.append(C[ids[-1]])
                points.append(point)
                ids.append(child[ids[-1], d])
            target = np.log(np.stack([P[i] for i in ids], axis=1))  # [n, k+1, m]
            key, sub = mx.random.split(key)
            q = mx.array(np.stack(claims, 1).astype(np.float32))
            point = mx.array(np.stack(points, 1))
            if point_share == 1:
                q, point = None, None
            elif point_share == 0:
                point = None
            a, out = speculative_sample(mx.array(target.astype(np.float32)), q,
                                        mx.array(np.stack(drafts, 1)), sub, point)
            a, out = np.array(a), np.array(out)
            for j in range(k + 1):
                on = j <= a
                pos = np.minimum(length + j, L + k)
                gen[rows_n[on], pos[on]] = out[on, j]
                cur = np.where(on, child[cur, np.clip(out[:, j], 0, m - 1)], cur)
            length += a + 1
    return [tuple(S[t] for t in row[:L]) for row in gen]


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_exact_tables_are_nontrivial(trunk_logits, cfg):
    """The settings under test really act: many outcomes, filters cut."""
    p, joint = exact_tables(trunk_logits, cfg)
    assert sum(1 for v in joint.values() if v * N >= 5) >= 12
    if cfg == "xtc":  # XTC moves much of the mass (it is a mixture: nothing is 0)
        plain = dict(CONFIGS["xtc"][0], xtc_probability=0)
        mask = np.isin(np.arange(V), S)
        assert max(np.abs(v - reference_p_general(trunk_logits[pre], PROMPT + list(pre), plain,
                                                  support=mask)).max()
                   for pre, v in p.items()) > 0.1
    if cfg in ("top_p", "top_k", "min_p", "xtc"):
        assert cfg == "xtc" or any((v[S] == 0).sum() >= 2 for v in p.values())
        # no near-tie at a filter's threshold: float32 decode vs float64
        # reference (and verify vs full-sequence logits) keep the same tokens
        st = CONFIGS[cfg][0]
        for raw in trunk_logits.values():
            lp = np.sort(_log_softmax(np.asarray(raw, np.float64)[S]))[::-1]
            if cfg == "xtc":  # min-p's cut, then XTC's threshold over what it kept
                cut = lp[0] + np.log(st["min_p"])
                kept = lp[lp >= cut]
                probs = np.exp(kept - np.log(np.exp(kept).sum()))
                above = np.sort(probs[probs > st["xtc_threshold"]])
                # (probabilities: 1e-4 is ~1000x float32's error on them)
                margin = min(np.abs(lp - cut).min(), 10 * np.abs(probs - st["xtc_threshold"]).min(),
                             10 * (above[1] - above[0]) if len(above) > 1 else 1.0)
            elif cfg == "top_p":
                margin = np.abs(np.cumsum(np.exp(lp)) - st["top_p"]).min()
            elif cfg == "min_p":
                margin = np.abs(lp - (lp[0] + np.log(st["min_p"]))).min()
            else:
                margin = lp[st["top_k"] - 1] - lp[st["top_k"]]
            assert margin > 1e-3, (cfg, margin)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("k", [1, 2, 3])
def test_chi2_kernel_exact(trunk_logits, cfg, k):
    p, joint = exact_tables(trunk_logits, cfg)
    q = _draft_table(p, seed=k)
    samples = simulate(p, q, k, N, seed=100 * k + len(cfg))
    assert chi2_pvalue(samples, joint) > ALPHA


def test_chi2_kernel_greedy_drafts(trunk_logits):
    """q one-hot (draft_temp=0): accept with p(d), else sample p without d."""
    p, joint = exact_tables(trunk_logits, "rep")
    q = {}
    for pre, row in p.items():
        oh = np.zeros(V)
        oh[S[int(np.argmax(row[S] + np.arange(len(S)) * 1e-3))]] = 1.0
        q[pre] = oh
    assert chi2_pvalue(simulate(p, q, 2, N, seed=7), joint) > ALPHA


@pytest.mark.parametrize("cfg", ["temp", "top_k", "rep"])
@pytest.mark.parametrize("lie", ["uniform", "target", "other_q"])
def test_chi2_detects_wrong_q(trunk_logits, cfg, lie):
    """Power: drafts sampled from q but a wrong q reported -> the output
    distribution is wrong and the χ² test must reject it. Lies: uniform over
    S; q = p (drafts then always accepted: the naive "accept what the head
    sampled" bug); another drafter's q of the same kind (a subtle error)."""
    p, joint = exact_tables(trunk_logits, cfg)
    q = _draft_table(p, seed=3)
    if lie == "uniform":
        uniform = np.zeros(V)
        uniform[S] = 1.0 / len(S)
        claimed = {pre: uniform for pre in p}
    elif lie == "target":
        claimed = p
    else:
        claimed = _draft_table(p, seed=4)
    samples = simulate(p, q, 2, N, seed=11, claimed=claimed)
    assert chi2_pvalue(samples, joint) < ALPHA


@pytest.mark.parametrize("cfg,k", [("rep", 2), ("top_k", 3)])
def test_the_end_to_end_sample_size_has_power(trunk_logits, cfg, k):
    """The power of the end-to-end χ² below, which runs 800 samples: at that
    size, on the decoder's own acceptance kernel, it rejects the naive
    "accept what the head sampled" bug (q claimed = p) and a drafter that
    reports another drafter's q in at least 19 of 20 seeded runs each
    (measured: 20 of 20, both cases, both lies)."""
    p, joint = exact_tables(trunk_logits, cfg)
    q = _draft_table(p, seed=3)
    naive = sum(chi2_pvalue(simulate(p, q, k, 800, seed=s, claimed=p), joint) < ALPHA
                for s in range(20))
    other = _draft_table(p, seed=4)
    subtle = sum(chi2_pvalue(simulate(p, q, k, 800, seed=s, claimed=other), joint) < ALPHA
                 for s in range(20))
    print(f"{cfg} depth {k}: naive bug rejected {naive}/20, another q {subtle}/20")
    assert naive >= 19 and subtle >= 19


def test_kernel_accept_rates():
    """q == p accepts everything; disjoint q rejects everything and the
    residual is then p itself."""
    p = mx.array(np.log(np.array([[0.5, 0.5, 0, 0]] * 3, np.float32)))
    same = mx.softmax(p[:2], axis=-1)
    a, out = speculative_sample(p, same, mx.array([0, 1]), mx.random.key(0))
    assert a.item() == 2 and out.tolist()[:2] == [0, 1]
    other = mx.array([[0, 0, 1.0, 0], [0, 0, 0, 1.0]])
    for s in range(20):
        a, out = speculative_sample(p, other, mx.array([2, 3]), mx.random.key(s))
        assert a.item() == 0 and out.tolist()[0] in (0, 1)
    # batched: leading dims broadcast through
    a, out = speculative_sample(mx.stack([p, p]), mx.stack([same, other]),
                                mx.array([[0, 1], [2, 3]]), mx.random.key(1))
    assert a.tolist() == [2, 0]


# -- point drafts (a copied token: q = δx) through the same rule --------------------------
POINT_CASES = ["temp", "top_p", "top_k", "min_p", "rep", "xtc"]  # (~0.1 s each)


@pytest.mark.parametrize("cfg", POINT_CASES)
def test_chi2_point_drafts_exact(trunk_logits, cfg):
    """Copied drafts, verified as point drafts (q None: keep x with
    probability p(x), else sample p without x), every sampler setting: the
    joint of the first 3 tokens is the target's. Depth 3, 2·10⁴ samples."""
    p, joint = exact_tables(trunk_logits, cfg)
    samples = simulate(p, p, 3, N, seed=31 + len(cfg), copy=_copy_table(p, seed=1),
                       point_share=1.0)
    assert chi2_pvalue(samples, joint) > ALPHA


@pytest.mark.parametrize("cfg", ["top_p", "rep"])
def test_chi2_point_and_sampled_drafts_mixed(trunk_logits, cfg):
    """Point drafts and drafts sampled from q in one run (per position, as
    rows of a batch may carry runs of different sources): exact."""
    p, joint = exact_tables(trunk_logits, cfg)
    samples = simulate(p, _draft_table(p, seed=2), 3, N, seed=41, copy=_copy_table(p, seed=3),
                       point_share=0.5)
    assert chi2_pvalue(samples, joint) > ALPHA


def _accept_always(q, point, drafts):
    return mx.zeros(drafts.shape, mx.float32)  # u * 0 < p(x): x kept whenever p(x) > 0


def _residual_keeps_x(p_a, q, point, drafts, accepted):
    return p_a  # on rejection, p itself: x not removed


SABOTAGE = {"accept_always": ("_draft_probability", _accept_always),
            "residual_keeps_x": ("_residual", _residual_keeps_x)}


@pytest.mark.parametrize("cfg", POINT_CASES)
@pytest.mark.parametrize("bug", list(SABOTAGE))
def test_chi2_point_drafts_catch_a_sabotaged_rule(trunk_logits, monkeypatch, cfg, bug):
    """Power: the point-draft χ² above fails when the rule is broken in the
    module itself: x kept with probability 1, or the rejection's sample
    drawn from p with x still in it."""
    from mlx_mtp import acceptance

    monkeypatch.setattr(acceptance, *SABOTAGE[bug])
    p, joint = exact_tables(trunk_logits, cfg)
    samples = simulate(p, p, 3, N, seed=31 + len(cfg), copy=_copy_table(p, seed=1),
                       point_share=1.0)
    assert chi2_pvalue(samples, joint) < ALPHA


def test_point_drafts_are_one_hot_q_bitwise():
    """A point draft (q None, or `point` set with any q there) is verified
    exactly as the one-hot q it stands for: the same acceptances and the
    same tokens, draw for draw, batched with a key per row."""
    from mlx_mtp.acceptance import speculative_sample_rows

    rng = np.random.default_rng(0)
    B, k, Vs = 64, 4, 7
    logits = rng.normal(size=(B, k + 1, Vs)) * 2
    logits[rng.random((B, k + 1, Vs)) < 0.3] = -np.inf  # filtered tokens
    logits[..., 0] = 0.0  # at least one allowed token per position
    target = mx.array(logits.astype(np.float32))
    drafts = mx.array(rng.integers(0, Vs, (B, k)), dtype=mx.int32)
    keys = mx.random.split(mx.random.key(3), B)
    one_hot = (mx.arange(Vs) == drafts[..., None]).astype(mx.float32)
    want = speculative_sample_rows(target, one_hot, drafts, keys)
    got = speculative_sample_rows(target, None, drafts, keys)
    assert all(mx.array_equal(w, g).item() for w, g in zip(want, got))
    # a mix: sampled drafts with their q, point drafts with garbage q under `point`
    q = mx.array(rng.dirichlet(np.ones(Vs), (B, k)).astype(np.float32))
    point = mx.array(rng.random((B, k)) < 0.5)
    want = speculative_sample_rows(target, mx.where(point[..., None], one_hot, q), drafts, keys)
    got = speculative_sample_rows(target, mx.where(point[..., None], 7.0, q), drafts, keys, point)
    assert all(mx.array_equal(w, g).item() for w, g in zip(want, got))
    assert 0 < int(want[0].sum()) < B * k  # accepts and rejections both happened


def test_accept_greedy_and_sampled_rows_in_one_batch():
    """`accept`: a greedy row keeps the longest prefix of drafts equal to the
    arg-max and emits the arg-max after it, whatever the drafts' source
    (q None); a sampled row beside it draws what it draws alone; an opaque
    sampler keeps drafts while they equal its draws."""
    from mlx_mtp.acceptance import DraftRun, accept, speculative_sample_rows
    from mlx_mtp.sampling import Filters, RowSampling, SamplerArrays, target_rows

    rng = np.random.default_rng(1)
    k, Vs = 5, 11
    logprobs = mx.array(rng.normal(size=(4, k + 1, Vs)).astype(np.float32))
    best = np.array(mx.argmax(logprobs, axis=-1))
    drafts = best[:, :k].copy()
    for row, right in enumerate([0, 2, 5, 3]):  # drafts right up to `right`
        if right < k:
            drafts[row, right] = (best[row, right] + 1) % Vs
    drafts = mx.array(drafts, dtype=mx.int32)
    rows = [RowSampling(), RowSampling(), RowSampling(), RowSampling(temp=0.8)]
    f = Filters.of(rows)
    arrays = SamplerArrays.of(rows, f, Vs)
    keys = mx.random.split(mx.random.key(5), 4)
    for q in (None, mx.ones((4, k, Vs)) / Vs):
        accepted, out = accept(logprobs, DraftRun(drafts, q), arrays, f, keys)
        assert accepted.tolist()[:3] == [0, 2, 5]
        for row, a in enumerate(accepted.tolist()[:3]):
            assert out[row, :a + 1].tolist() == best[row, :a + 1].tolist()
        alone = speculative_sample_rows(target_rows(logprobs[3:], arrays.take_rows(mx.array([3])),
                                                    f, arrays.inv_temp[3:]),
                                        None if q is None else q[3:], drafts[3:], keys[3:])
        assert accepted[3].item() == alone[0].item()
        assert out[3, :alone[0].item() + 1].tolist() == alone[1][0, :alone[0].item() + 1].tolist()
    # greedy only (no sampled row: no keys) and an opaque sampler
    g = Filters.of(rows[:3])
    accepted, _ = accept(logprobs[:3], DraftRun(drafts[:3]), SamplerArrays(), g, None)
    assert accepted.tolist() == [0, 2, 5]
    accepted, out = accept(logprobs, DraftRun(drafts), SamplerArrays(), g, None,
                           sampler=lambda lp: mx.argmax(lp, axis=-1))
    assert accepted.tolist() == [0, 2, 5, 3] and mx.array_equal(out, mx.array(best)).item()


@pytest.mark.parametrize("cfg", ["rep", "top_p"])
def test_point_drafts_through_the_decoder_are_one_hot_q_bitwise(models, cfg):
    """Through the decode loop: a drafter reporting point drafts (q None)
    emits, seeded, the tokens and log-probs of the same drafter claiming
    the one-hot q, over accepts and rejections (depth 3)."""
    model = models[0]
    ref = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=24,
                                            draft_tokens=0, logits_processors=processors(cfg))]
    runs = []
    for point in (False, True):
        stats = MTPStats()
        runs.append([(t, np.array(row).tobytes()) for t, row, _ in generate_tokens(
            mx.array(PROMPT), model, max_tokens=24, draft_tokens=3, sampler=sampler(cfg),
            logits_processors=processors(cfg), seed=3, stats=stats,
            drafter=OracleDrafter(ref, 0.6, V, seed=1, point=point))])
        assert 0 < stats.accepted < stats.drafted
    assert runs[0] == runs[1]


# -- end to end through the decoder ---------------------------------------------
def _first_tokens(model, cfg, k, n_tokens, seed, oracle=None, draft_temp=None):
    return [t for t, _, _ in generate_tokens(
        mx.array(PROMPT), model, max_tokens=n_tokens, draft_tokens=k,
        sampler=sampler(cfg, draft_temp=draft_temp), logits_processors=processors(cfg),
        seed=seed, drafter=oracle)]


def decoder_samples(model, cfg, k, n, oracle=None, seed0=1 << 20, stats=None, n_tokens=L,
                    draft_vocab=None, context_drafts=False):
    """First n_tokens of n generations (prefill, then cycles at depth k;
    every token after the first comes from a draft/verify cycle)."""
    out = []
    for i in range(n):
        out.append(tuple(t for t, _, _ in generate_tokens(
            mx.array(PROMPT), model, max_tokens=n_tokens, draft_tokens=k, sampler=sampler(cfg),
            logits_processors=processors(cfg), drafter=oracle, seed=seed0 + i, stats=stats,
            draft_vocab=draft_vocab, context_drafts=context_drafts)))
    return out


def _context_drafter():
    """Context runs over the prompt and output from 1-grams (the first 3
    tokens rarely repeat a longer suffix), often proposing tokens outside S
    (kept with probability 0) and runs of tokens of S (kept or not)."""
    from mlx_mtp.context_draft import ContextDrafter

    return ContextDrafter(PROMPT + S[:3] + PROMPT + S[3:], sizes=(2, 1))


def _q_drafter(trunk_logits, cfg, mix, seed):
    p, _ = exact_tables(trunk_logits, cfg)
    q = _draft_table(p, mix=mix, seed=seed)
    fallback = np.zeros(V)
    fallback[S] = 1.0 / len(S)
    return DistributionDrafter(lambda pre: q.get(pre, fallback), V, seed=seed)


# the default tier: a drafter whose q is rejected part of the time, through
# the whole decoder; each sampler setting (penalties included) is proven on
# the kernel at 2·10⁴ samples above, the rest here in the slow tier
E2E_CASES = [slow("rep", 2, "head"), ("top_k", 3, "q"), slow("temp", 1, "q"),
             slow("min_p", 2, "head_vocab"), slow("xtc", 2, "head"),
             *[slow(c, 3, "context") for c in ("temp", "top_p", "top_k", "min_p", "rep")],
             *[slow(c, 2, "device_context") for c in ("temp", "top_k", "rep")]]
DRAFT_VOCAB = sorted(set(range(50)) | set(S[:3]))  # q = 0 on S[3:]: only the residual emits them
if SLOW:  # every setting at every depth
    E2E_CASES = [(c, k, "head" if k < 3 or c == "xtc" else "q") for c in CONFIGS
                 for k in (1, 2, 3)]
    E2E_CASES += [("min_p", 2, "head_vocab")]
    E2E_CASES += [(c, 3, "context") for c in ("temp", "top_p", "top_k", "min_p", "rep")]
    E2E_CASES += [(c, 2, "device_context") for c in CONFIGS]


@pytest.mark.parametrize("cfg,k,mode", E2E_CASES)
def test_chi2_end_to_end(models, trunk_logits, cfg, k, mode, monkeypatch):
    """The real decoder, with the real head's sampled drafts or with a
    DistributionDrafter whose q overlaps p (accepts and rejections): joint of
    the first 3 tokens. 10^4 samples with MLX_MTP_SLOW_TESTS=1, else 800, at
    which the test has power (test_the_end_to_end_sample_size_has_power; the
    2·10^4-sample proofs per setting are the kernel tests above)."""
    model = models[0]
    n = 10000 if SLOW else 800  # (~20 s at 800: each sample is a whole generation)
    _, joint = exact_tables(trunk_logits, cfg)
    oracle = (_q_drafter(trunk_logits, cfg, 0.4, 5) if mode == "q" else
              _context_drafter() if mode == "context" else None)
    vocab = mx.array(DRAFT_VOCAB) if mode == "head_vocab" else None
    if mode == "device_context":  # the batch's own index, of 1-grams (3 tokens repeat little)
        monkeypatch.setattr("mlx_mtp.batch.NGRAM_SIZES", (1,))
    stats = MTPStats()
    samples = decoder_samples(model, cfg, k, n, oracle=oracle, stats=stats, draft_vocab=vocab,
                              context_drafts=mode == "device_context")
    pvalue = chi2_pvalue(samples, joint)
    print(f"end-to-end {cfg} depth {k} {mode}: n={n} chi2 p={pvalue:.4f} "
          f"acceptance={stats.acceptance}")
    assert pvalue > ALPHA
    if mode in ("q", "context"):
        assert 0 < stats.accepted < stats.drafted  # both paths exercised
    if mode == "device_context":  # runs drafted and rejected (kept too at temp: a row's
        # source follows what it keeps, so under top_k's 3 tokens runs stop once rejected)
        assert stats.context_accepted < stats.context_drafted
        assert cfg != "temp" or stats.context_accepted > 0


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("k,mode", [(1, "head"), (3, "head"), (2, "head_greedy"), (2, "oracle"),
                                    (3, "q"), ("auto", "q"), (3, "head_vocab"), (4, "context"),
                                    (4, "device_context")])
def test_verify_rows_match_teacher_forcing(models, trunk_logits, cfg, k, mode, monkeypatch):
    """Every emitted token's log-prob row (what plain decoding would sample
    from, processors applied with that position's history) equals mlx_lm's
    teacher-forced one on the generated sequence, across accepts and
    rejections: the state after each commit is the plain-decoding state."""
    model, ref_model = models
    if cfg == "xtc" and mode == "q":
        pytest.skip("a host-side drafter drafts with MTPSampler's own filters, without XTC")
    oracle = None
    if mode == "oracle":  # OracleDrafter: fixed proposals, q claimed one-hot
        ref = _first_tokens(model, cfg, 0, 20, seed=9)
        oracle = OracleDrafter(ref, 0.6, V, seed=2)
    elif mode == "q":
        oracle = _q_drafter(trunk_logits, cfg, 0.2, 4)
    elif mode == "context":  # copied runs (point drafts), the head's drafts elsewhere
        oracle = _context_drafter()
    elif mode == "device_context":  # the batch's own index (1-grams: the row repeats little)
        monkeypatch.setattr("mlx_mtp.batch.NGRAM_SIZES", (1,))
    stats = MTPStats()
    got = list(generate_tokens(
        mx.array(PROMPT), model, max_tokens=20, draft_tokens=k,
        sampler=sampler(cfg, draft_temp=0.0 if mode == "head_greedy" else None),
        logits_processors=processors(cfg), seed=9, drafter=oracle, stats=stats,
        draft_vocab=mx.array(DRAFT_VOCAB) if mode == "head_vocab" else None,
        context_drafts=mode == "device_context"))
    toks = [t for t, _, _ in got]
    seq = mx.array(PROMPT + toks)
    logits = ref_model(seq[None])[0, len(PROMPT) - 1 : -1].astype(mx.float32)
    procs = processors(cfg)
    for i, (t, row, _) in enumerate(got):
        lg = logits[i : i + 1]
        for proc in procs:
            lg = proc(seq[: len(PROMPT) + i], lg)
        want = np.array(lg - mx.logsumexp(lg, axis=-1, keepdims=True))[0]
        row = np.array(row)
        keep = want > -1e6
        assert np.array_equal(keep, row > -1e6)
        np.testing.assert_allclose(row[keep], want[keep], atol=2e-4, err_msg=f"{cfg} {i}")
        assert keep[t]  # never a token outside the support
    if mode == "q" and k != "auto":  # (auto's depths follow timings: not a fixed mix)
        assert 0 < stats.accepted < stats.drafted
    if mode == "context":
        assert oracle.runs > 0
    if mode == "device_context":
        assert stats.context_drafted > 0


def test_seed_reproducible(models):
    model = models[0]
    a = _first_tokens(model, "temp", 2, 20, seed=123)
    b = _first_tokens(model, "temp", 2, 20, seed=123)
    c = _first_tokens(model, "temp", 2, 20, seed=124)
    assert a == b and a != c
    # without `seed`, mx.random.seed makes runs repeatable (the CLI's --seed)
    runs = []
    for _ in range(2):
        mx.random.seed(77)
        runs.append(_first_tokens(model, "temp", 3, 20, seed=None))
    assert runs[0] == runs[1]


def test_cli_seed(flat_ckpt, capsys):
    from mlx_mtp.cli import main

    args = ["--model", str(flat_ckpt), "--prompt", "hi", "--max-tokens", "12", "--temp", "0.8",
            "--top-k", "20", "--repetition-penalty", "1.2", "--draft-tokens", "2",
            "--ignore-chat-template"]
    outs = []
    for seed in (5, 5, 6):
        assert main(args + ["--seed", str(seed)]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_one_host_sync_per_sampling_cycle(models, count_host_syncs):
    """Sampling with processors (the synchronous loop): one async_eval per
    cycle, read once; nothing else waits for the device."""
    model = models[0]
    stats = MTPStats()
    gen = generate_tokens(mx.array(PROMPT), model, max_tokens=-1, draft_tokens=3,
                          sampler=sampler("top_k"), logits_processors=processors("top_k"),
                          seed=0, stats=stats)
    next(gen)  # the first cycle
    start = stats.cycles
    calls = count_host_syncs()
    for _ in range(12):
        next(gen)
    assert "eval" not in calls and calls.count("async_eval") == stats.cycles - start
    gen.close()


def test_sampler_is_mlx_lm_compatible():
    """make_sampler(...) samples exactly as mlx_lm's (same random stream)."""
    lp = mx.log(mx.softmax(mx.random.normal((4, 50), key=mx.random.key(0)), axis=-1))
    for kw in [dict(temp=0.7), dict(temp=1.0, top_p=0.9), dict(temp=0.6, top_k=5),
               dict(temp=1.2, min_p=0.05, min_tokens_to_keep=2)]:
        mx.random.seed(3)
        a = make_sampler(**kw)(lp)
        mx.random.seed(3)
        b = mlx_lm_make_sampler(**kw)(lp)
        assert a.tolist() == b.tolist()
    assert make_sampler(0.0).greedy and not make_sampler(0.5, xtc_probability=0.5).speculative


def test_greedy_sampler_unchanged(models):
    """make_sampler(temp=0) keeps the greedy path: identical to sampler=None."""
    model = models[0]
    for k in (1, 3):
        a = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=16,
                                                draft_tokens=k)]
        b = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=16,
                                                draft_tokens=k, sampler=make_sampler(0.0))]
        assert a == b


def test_opaque_sampler_fallback_is_exactly_mlx_lm_plain(models):
    """An mlx_lm sampler (not introspectable) uses match verification; with
    depth 0 and the same random stream it equals plain sampling, and at
    depth>0 it still only emits tokens in the target's support."""
    model = models[0]
    s = mlx_lm_make_sampler(temp=1.0, top_k=3)
    assert not Spec(model, s).speculative
    with pytest.warns(UserWarning, match="introspected"):
        toks = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=12,
                                                   draft_tokens=2, sampler=s,
                                                   logits_processors=processors("temp"))]
    assert all(t in S for t in toks)


def test_api_generate_with_sampling(models, flat_ckpt):
    """temp > 0 from the public API (generate / stream_generate), seeded."""
    import mlx_mtp

    model, tok = mlx_mtp.load(flat_ckpt)
    kw = dict(max_tokens=16, draft_tokens=3, sampler=mlx_mtp.make_sampler(0.7, top_p=0.95))
    a = mlx_mtp.generate(model, tok, "hello", seed=11, **kw)
    b = mlx_mtp.generate(model, tok, "hello", seed=11, **kw)
    assert a == b
    last = None
    for last in mlx_mtp.stream_generate(model, tok, "hello", seed=11, **kw):
        pass
    assert last.drafted > 0
    assert last.generation_tokens == 16 or last.finish_reason == "stop"


@pytest.fixture(scope="module")
def echo_model(tmp_path_factory):
    """A model whose head nearly IS the trunk: trunk blocks scaled by 1e-2
    (logits ~ a bigram of the current token), head = identity on the token's
    embedding with the trunk's final norm. q ~ p, so Leviathan–Chen must
    accept nearly every draft at any temperature, with every setting."""
    import mlx_mtp
    from mlx_mtp.testing.synthetic import random_weights, tiny_text_config, write_checkpoint

    tc = tiny_text_config()
    H = tc["hidden_size"]
    w = random_weights(tc, seed=7)
    for k in list(w):
        if k.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
            w[k] = w[k] * (0.0 if k.startswith("mtp.") else 1e-2)
    w["mtp.fc.weight"] = np.concatenate([np.eye(H), np.zeros((H, H))], axis=1).astype(np.float32)
    w["mtp.pre_fc_norm_embedding.weight"] = np.zeros(H, np.float32)
    w["mtp.norm.weight"] = w["model.language_model.norm.weight"].copy()
    return mlx_mtp.load(write_checkpoint(tmp_path_factory.mktemp("echo"), weights=w))[0]


# the two settings whose q is hardest to match (penalties with the drafted
# history, XTC); the other settings in the slow tier
@pytest.mark.parametrize("cfg", [c if c in ("rep", "xtc") else slow(c) for c in CONFIGS])
def test_head_matching_target_accepts_nearly_all(echo_model, cfg):
    """q is computed exactly like p (processors with the drafted history,
    filters, temperature): with a head that matches the trunk, acceptance is
    ~1 at temp 0.6 and 1.0; greedy drafts (draft_temp=0) accept less."""
    s, rep = CONFIGS[cfg]
    procs = make_logits_processors(None, rep[0] if rep else None, rep[1] if rep else 20)
    for temp in (0.6, 1.0):
        kw = {**s, "temp": temp}
        rates = {}
        for dt in (None, 0.0):
            stats = MTPStats()
            for seed in range(3):
                for _ in generate_tokens(mx.array(PROMPT), echo_model, max_tokens=24,
                                           draft_tokens=3, sampler=make_sampler(**kw, draft_temp=dt),
                                           logits_processors=procs, seed=seed, stats=stats):
                    pass
            rates[dt] = stats.accepted / stats.drafted
        print(cfg, temp, rates)
        # XTC keeps the least probable token over its threshold: where the head's
        # near-copy of the trunk orders two such tokens the other way, p and q
        # differ a lot (at xtc_probability 0 the same settings accept 100%)
        assert rates[None] > (0.75 if cfg == "xtc" else 0.9), (cfg, temp, rates)
        assert rates[0.0] < rates[None], (cfg, temp, rates)


@pytest.mark.parametrize("name", ["dense_bf16", "moe"])
def test_sampling_bf16_and_moe(loaded, name):
    """Speculative sampling runs on bf16 and MoE checkpoints, seeded."""
    model, _, _ = loaded(name)
    kw = dict(max_tokens=16, draft_tokens=2, sampler=make_sampler(0.8, top_k=40),
              logits_processors=make_logits_processors(None, 1.1, 16))
    runs = [[t for t, _, _ in generate_tokens(mx.array(PROMPT), model, seed=4, **kw)]
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16 and all(0 <= t < V for t in runs[0])


# -- the trained demo model (drafts mostly accepted) ------------------------------
def _demo_path():
    from mlx_mtp.loader import demo_model_path

    env = os.environ.get("MLX_MTP_DEMO_PATH")
    return env if env else demo_model_path()


@pytest.fixture(scope="module")
def demo():
    path = _demo_path()
    if path is None:
        pytest.skip("the demo model (mlx_mtp/demo) is not shipped in this checkout")
    import mlx_lm

    import mlx_mtp

    model, tok = mlx_mtp.load(path)
    return model, mlx_lm.load(str(path))[0], tok


DEMO_PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]


@pytest.mark.slow  # the same claim as test_chi2_end_to_end, on the shipped weights
@pytest.mark.parametrize("k", [2, 3] if SLOW else [3])
def test_demo_chi2_end_to_end(demo, k):
    """χ² of the first 3 tokens on the demo model, real head drafts (accepted
    much of the time): temp 1.0, top-k 2 (≤ 8 outcomes) with repetition
    penalty. 200 samples (10^4 with MLX_MTP_SLOW_TESTS=1)."""
    model, ref_model, tok = demo
    prompt = tok.encode(DEMO_PROMPTS[0])
    s, rep = dict(temp=1.0, top_k=2), (1.3, 20)
    joint = enumerate_joint(ref_model, prompt, s, rep, L)
    n = 10000 if SLOW else 200
    stats, samples = MTPStats(), []
    for i in range(n):
        samples.append(tuple(t for t, _, _ in generate_tokens(
            mx.array(prompt), model, max_tokens=L, draft_tokens=k, sampler=make_sampler(**s),
            logits_processors=make_logits_processors(None, *rep), seed=i, stats=stats)))
    pvalue = chi2_pvalue(samples, joint)
    print(f"demo depth {k}: n={n} chi2 p={pvalue:.4f} acceptance={stats.acceptance}")
    assert pvalue > ALPHA
    assert stats.accepted > 0


def test_demo_acceptance_at_temperature(demo):
    """Acceptance of the demo head at temp 0, 0.6 and 1.0 (printed with -s):
    sampled drafts (q = the head at the target's temperature) must be
    accepted a good part of the time, not only greedy ones."""
    model, _, tok = demo
    for temp in (0.0, 0.6, 1.0):
        stats = MTPStats()
        for seed, text in enumerate(DEMO_PROMPTS):
            for _ in generate_tokens(mx.array(tok.encode(text)), model, max_tokens=40,
                                       draft_tokens=3, sampler=make_sampler(temp), seed=seed,
                                       stats=stats):
                pass
        print(f"demo temp {temp}: acceptance {stats.acceptance}, "
              f"{stats.tokens_per_cycle:.2f} tokens/cycle")
        assert stats.acceptance[0] > 0.25


@pytest.mark.parametrize("bits", [0, 4])
def test_trimmed_draft_logits(flat_ckpt, bits):
    """Sampling drafts over a trimmed vocabulary project only its rows (float
    or quantized lm_head): equal to the full projection there, -inf elsewhere."""
    import mlx.nn as nn

    import mlx_mtp

    model = mlx_mtp.load(flat_ckpt)[0]
    if bits:
        nn.quantize(model.language_model, group_size=64, bits=bits,
                    class_predicate=lambda p, m: p.endswith("lm_head"))
    from types import SimpleNamespace

    from mlx_mtp.cycle import _draft_logprobs
    from mlx_mtp.sampling import Filters, SamplerArrays

    ids = mx.array(DRAFT_VOCAB)
    spec = Spec(model, filters=Filters(sampled=True), draft_vocab=ids)
    h = mx.random.normal((1, 1, model.text_args.hidden_size), key=mx.random.key(2))
    state = SimpleNamespace(y=mx.array([0], dtype=mx.int32), sampling=SamplerArrays(), window=None)
    got = np.array(_draft_logprobs(spec, spec.aux(), state, h, None, []))[0]
    full = np.array(model.logits_from_hidden(h))[0, 0].astype(np.float64)
    sub = full[DRAFT_VOCAB]
    want = sub - np.log(np.exp(sub - sub.max()).sum()) - sub.max()
    np.testing.assert_allclose(got[DRAFT_VOCAB], want, rtol=1e-5, atol=1e-5)
    rest = np.setdiff1d(np.arange(V), DRAFT_VOCAB)
    assert np.all(np.isneginf(got[rest]))


# -- penalties in-graph ------------------------------------------------------------------------
PENALTY_CASES = [  # (repetition, presence, frequency), each (penalty, context size) or None
    ((1.5, 20), None, None),
    (None, (2.0, 5), None),
    (None, None, (3.0, 20)),
    ((0.7, 3), (-1.0, 20), (0.5, 7)),
    (None, None, None),
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_penalties_are_mlx_lm_processors_bitwise(dtype):
    """`penalize_rows` gives, at every position of every row, bitwise the
    logits mlx_lm's repetition/presence/frequency processors give for that
    row's history at that point: short histories, repeated tokens (frequency
    counts each occurrence), context sizes shorter and longer than the
    history, drafts after the window (offset), each row its own settings."""
    from mlx_mtp.sampling import (Filters, Penalties, RowSampling, SamplerArrays, penalize_rows,
                                  start_window)

    V, T = 12, 3  # a small vocabulary: the histories repeat tokens
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, V, n).tolist() for n in (1, 4, 30, 9, 300)]
    rows = [RowSampling(penalties=Penalties(*case) or None) for case in PENALTY_CASES]
    f = Filters.of(rows)
    assert f.penalties == (True, True, True)
    arrays = SamplerArrays.of(rows, f, V)
    for offset in (0, 2):
        tokens = mx.array(rng.integers(0, V, (len(rows), offset + T)), dtype=mx.int32)
        logits = mx.array(rng.normal(size=(len(rows), T, V)) * 3).astype(dtype)
        window = mx.concatenate([start_window(h[:-1]) for h in histories])
        # the window holds the history before its last token; tokens[:, 0] is that token
        tokens[:, 0] = mx.array([h[-1] for h in histories], dtype=mx.int32)
        got = penalize_rows(logits, window, tokens, offset, arrays, f)
        for b, (h, case) in enumerate(zip(histories, PENALTY_CASES)):
            kw = {}
            for kind, value in zip(("repetition", "presence", "frequency"), case):
                if value is not None:
                    kw[f"{kind}_penalty"], kw[f"{kind}_context_size"] = value
            procs = make_logits_processors(**kw)
            for i in range(T):
                seen = mx.array(h[:-1] + tokens[b, : offset + i + 1].tolist())
                want = logits[b:b + 1, i]
                for proc in procs:
                    want = proc(seen, want)
                assert mx.array_equal(got[b:b + 1, i], want).item(), (b, i, offset)
                if procs:
                    changed = not mx.array_equal(want, logits[b:b + 1, i]).item()
                    assert changed or i > 0, (b, i)


def test_penalties_beyond_the_window_stay_processors():
    """A context size of 0 (mlx_lm: the whole history) or past the window is
    not taken in-graph."""
    from mlx_mtp.sampling import PENALTY_WINDOW, Penalties

    assert Penalties.of(repetition_penalty=1.2, repetition_context_size=0) is None
    assert Penalties.of(presence_penalty=1.0, presence_context_size=PENALTY_WINDOW + 1) is None
    assert Penalties.of(frequency_penalty=0.0, frequency_context_size=0) == Penalties()
    assert not Penalties.of()
    assert Penalties.of(presence_penalty=0.5) == Penalties(presence=(0.5, 20))


@pytest.mark.parametrize("cfg", ["xtc", "min_p", "temp"])
def test_target_rows_are_mlx_lms_distribution(trunk_logits, cfg):
    """The distribution a row samples from (`target_rows`, in-graph: filters
    in mlx_lm's order, XTC as the mixture of its coin's two outcomes) is the
    float64 reference's at every prefix, rows of a batch with different
    settings (one row with XTC, one without) each their own."""
    from mlx_mtp.sampling import Filters, RowSampling, SamplerArrays, target_rows

    rows = [RowSampling.of(sampler(cfg)), RowSampling.of(sampler("temp"))]
    f = Filters.of(rows)
    assert f.xtc == (cfg == "xtc")
    arrays = SamplerArrays.of(rows, f, V)
    mask = np.isin(np.arange(V), S)
    for pre, raw in trunk_logits.items():
        x = np.asarray(raw, np.float64) + np.where(mask, 0, -1e9)
        lp = mx.array(np.stack([x - np.log(np.exp(x - x.max()).sum()) - x.max()] * 2)
                      .astype(np.float32))
        got = np.array(mx.softmax(target_rows(lp, arrays, f, arrays.inv_temp), axis=-1))
        want = [reference_p(raw, PROMPT + list(pre), cfg), reference_p(raw, [], "temp")]
        np.testing.assert_allclose(got, np.stack(want), atol=2e-6)
