"""Structured output under MTP is exactly constrained plain decoding
(docs/design.md, "Structured output"): greedy token for token at depths 1-3
and auto, alone and per row in a batch, dense, MoE, fp32 and 4-bit, over two
turns on one prompt cache; sampled, the constrained plain distribution (χ²);
and whatever is generated parses and validates, or is reported cut."""

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from mlx_lm.models.cache import make_prompt_cache
from test_sampling import ALPHA, chi2_pvalue
from util import assert_trunk_equal, reference, slow

import mlx_mtp
from mlx_mtp.stats import MTPStats
from mlx_mtp.constraint import MaskingProcessor
from mlx_mtp.testing.constrained import constrained_plain_generate

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"},
                                           "b": {"type": "string", "maxLength": 6},
                                           "c": {"enum": ["x", "y"]}},
          "required": ["a", "c"], "additionalProperties": False}
OTHER = {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}


def mtp_tokens(model, tok, prompt, constraint, n, k, **kw):
    return [t for t, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=n,
                                                draft_tokens=k, constraint=constraint,
                                                tokenizer=tok, **kw)]


# every depth on the dense model, one on each other (the rest in the slow tier)
@pytest.mark.parametrize("name,k", [
    (name, k) if name == "dense" or (name, k) in (("moe", 3), ("q4", 2)) else slow(name, k)
    for name in ("dense", "moe", "q4") for k in (1, 2, 3, "auto")])
def test_greedy_is_constrained_plain_decoding(loaded, name, k):
    model, ref_model, tok = loaded(name)
    prompt = tok.encode("hello world")
    for constraint in (mlx_mtp.constrain(SCHEMA), mlx_mtp.constrain(regex=r"(ab|cd)+e")):
        want = constrained_plain_generate(ref_model, tok, prompt, constraint, max_tokens=40)
        got = mtp_tokens(model, tok, prompt, constraint, 40, k)
        assert got[:len(want.tokens)] == want.tokens
        assert len(got) == len(want.tokens) + (want.finish_reason == "stop")


@pytest.mark.parametrize("k", [2, "auto", "parked"])
def test_constrained_rows_with_context_runs_are_constrained_plain_decoding(loaded, k):
    """Context drafts under grammars, in one batch: a regex row re-typing
    what its context holds (its index starts from the prompt, the answer,
    the prompt: `cached_tokens`) drafts context runs; a schema row (whose
    forced tokens win over any run) and a free row decode beside it; each
    row's tokens are plain constrained (or plain) decoding's."""
    from mlx_mtp.batch import make_batch
    from mlx_mtp.depth import DepthController

    model, ref_model, tok = loaded("dense")
    prompts = [tok.encode(p) for p in ("hello world", "def f(x):", "a b c")]
    constraints = [mlx_mtp.constrain(regex=r"[a-z ]{10,40}"), None, mlx_mtp.constrain(SCHEMA)]
    wants = []
    for prompt, constraint in zip(prompts, constraints):
        if constraint is None:
            want = reference(ref_model, prompt, 24)
            stop = next((i for i, t in enumerate(want) if t in tok.eos_token_ids), None)
            wants.append(want[:stop])
        else:
            wants.append(constrained_plain_generate(ref_model, tok, prompt, constraint,
                                                    max_tokens=24).tokens)
    class Parked(DepthController):  # auto's controller held at depth 0: the head drafts
        def next_depth(self):  # nothing, a row's run is drafted alone
            return 0

    batch = make_batch(model, draft_tokens="auto" if k == "parked" else k, context_drafts=True,
                       controller=Parked(initial=0) if k == "parked" else None)
    stats = MTPStats()
    cached = [prompts[0] + wants[0] + prompts[0], (), ()]
    rows = batch.add([batch.prepare(p, None, 24, cached_tokens=c, constraint=con, tokenizer=tok,
                                    stop_tokens=tok.eos_token_ids,
                                    stats=stats if i == 0 else None)
                      for i, (p, c, con) in enumerate(zip(prompts, cached, constraints))])
    got = {id(r): [] for r in rows}
    while batch.rows:
        for ev in batch.step():
            if ev.token not in tok.eos_token_ids:
                got[id(ev.row)].append(ev.token)
    for row, want, constraint in zip(rows, wants, constraints):
        assert got[id(row)] == want, (k, constraint)
    assert 0 < stats.context_accepted, stats.usage()


def test_rows_of_a_batch_each_get_their_own_constraint(loaded):
    """Rows with different constraints and rows without decode in one batch;
    each gets what it gets alone (mlx_lm's plain output for the free row)."""
    model, ref_model, tok = loaded("dense")
    prompts = [tok.encode(p) for p in ("hello world", "def f(x):", "import os", "a b c")]
    constraints = [mlx_mtp.constrain(SCHEMA), None, mlx_mtp.constrain(OTHER),
                   mlx_mtp.constrain(regex="[a-z]{3,9}")]
    for k in (2, "auto"):
        out = mlx_mtp.batch_generate(model, tok, prompts, max_tokens=24, draft_tokens=k,
                                     constraint=constraints, return_token_ids=True)
        for prompt, constraint, got in zip(prompts, constraints, out.token_ids):
            if constraint is None:
                want = reference(ref_model, prompt, 24)
                stop = next((i for i, t in enumerate(want) if t in tok.eos_token_ids), None)
                want = want[:stop]
            else:
                want = constrained_plain_generate(ref_model, tok, prompt, constraint,
                                                  max_tokens=24).tokens
            assert got == want, (k, constraint)


def test_two_constrained_turns_on_one_prompt_cache(loaded):
    """The prompt cache keeps working across constrained turns: the second
    turn prefills only its new tokens and equals mlx_lm's on its own cache."""
    from mlx_lm.generate import generate_step

    model, ref_model, tok = loaded("dense")
    cache, ref_cache = model.make_cache(), make_prompt_cache(ref_model)
    for turn, constraint in (("hello world", mlx_mtp.constrain(SCHEMA)),
                             (" and then", mlx_mtp.constrain(OTHER))):
        prompt = tok.encode(turn)
        got = mtp_tokens(model, tok, prompt, constraint, 30, 2, prompt_cache=cache)
        processor = MaskingProcessor(constraint, tok)
        want = []
        for t, _ in generate_step(mx.array(prompt), ref_model, max_tokens=30,
                                  logits_processors=[processor], prompt_cache=ref_cache):
            want.append(t)
            if t in tok.eos_token_ids:
                break
        assert got == want
        assert_trunk_equal(cache, ref_cache)


def test_sampled_output_has_the_constrained_distribution(loaded):
    """χ² of the first three tokens under `[ab]{3}c` at temperature 1 with
    drafts (depth 2) against the exact constrained plain distribution:
    the trunk's softmax masked to {a, b} at each position, renormalized.
    The samples are rows of batches, each with its own seed: rows that
    leaked into one another would fail it too."""
    model, ref_model, tok = loaded("dense")
    prompt = tok.encode("hello world")
    constraint = mlx_mtp.constrain(regex="[ab]{3}c")
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]
    joint = {}
    for seq in ((x, y, z) for x in (a, b) for y in (a, b) for z in (a, b)):
        p, ctx = 1.0, list(prompt)
        for t in seq:
            logits = ref_model(mx.array([ctx]))[0, -1].astype(mx.float32)
            two = np.array(mx.softmax(logits[mx.array([a, b])]))
            p *= float(two[0] if t == a else two[1])
            ctx.append(t)
        joint[seq] = p
    n = 600  # drawn as rows of batches (each its own seed): ~3x faster than one by one
    stats = []
    out = mlx_mtp.batch_generate(model, tok, [prompt] * n, max_tokens=5, draft_tokens=2,
                                 constraint=constraint, sampler=mlx_mtp.make_sampler(temp=1.0),
                                 seeds=list(range(n)), return_token_ids=True, stats=stats,
                                 completion_batch_size=48)
    samples = [tuple(ids[:3]) for ids in out.token_ids]
    assert sum(s.drafted for s in stats) > 0
    assert chi2_pvalue(samples, joint) > ALPHA


def _schemas():
    leaf = st.sampled_from([{"type": "integer"}, {"type": "boolean"},
                            {"type": "string", "maxLength": 5}, {"enum": ["p", "q", 3]},
                            {"type": "number"}, {"type": "null"}])

    def objects(children):
        return st.dictionaries(st.sampled_from(["a", "b", "cd", "e_f"]), children,
                               min_size=1, max_size=3).map(
            lambda props: {"type": "object", "properties": props, "required": sorted(props),
                           "additionalProperties": False})

    def arrays(children):
        return children.map(lambda item: {"type": "array", "items": item, "maxItems": 3})

    return st.recursive(leaf, lambda c: st.one_of(objects(c), arrays(c)), max_leaves=5)


_FUZZ = dict(deadline=None, derandomize=True,
             suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
_DRAWN = dict(schema=_schemas(), seed=st.integers(0, 2**16), k=st.sampled_from([0, 1, 2, 3]),
              sampled=st.booleans())


def _validates_or_is_cut(loaded, schema, seed, k, sampled):
    model, _, tok = loaded("dense")
    last = None
    text = ""
    for last in mlx_mtp.stream_generate(
            model, tok, "hello", max_tokens=48, draft_tokens=k, seed=seed,
            constraint=mlx_mtp.constrain(schema),
            sampler=mlx_mtp.make_sampler(temp=0.8) if sampled else None):
        text += last.text
    assert last.finish_reason in ("stop", "length")
    if last.finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert last.generation_tokens == 48


@settings(max_examples=25, **_FUZZ)
@given(**_DRAWN)
def test_generated_output_validates_or_is_cut(loaded, schema, seed, k, sampled):
    """25 generated schemas, random seeds, depths 0-3, greedy or sampled:
    an output that ends with the stop token parses and validates; one that
    max_tokens cut is reported as finish_reason "length"."""
    _validates_or_is_cut(loaded, schema, seed, k, sampled)


@pytest.mark.slow
@settings(max_examples=100, **_FUZZ)
@given(**_DRAWN)
def test_more_generated_outputs_validate_or_are_cut(loaded, schema, seed, k, sampled):
    """The same over 100 other draws."""
    _validates_or_is_cut(loaded, schema, seed, k, sampled)


def _guided_run(model, tok, prompt, constraint, k, n, rows=1, controller=None, **kw):
    """A batch of `rows` copies of one constrained request at depth k: (each
    row's tokens, the rows' stats, host reads per cycle, the batch)."""
    from mlx_mtp.batch import make_batch

    batch = make_batch(model, draft_tokens=k, controller=controller)
    stats = [MTPStats() for _ in range(rows)]
    made = batch.add([batch.prepare(prompt, None, n, stats=s, constraint=constraint, tokenizer=tok,
                                    stop_tokens=tok.eos_token_ids, **kw) for s in stats])
    tokens = {id(r): [] for r in made}
    reads = []
    while any(not r.done for r in made):
        before = batch.reads
        for e in batch.step():
            tokens[id(e.row)].append(e.token)
        reads.append(batch.reads - before)
    return [tokens[id(r)] for r in made], stats, reads, batch


@pytest.mark.parametrize("k", [2, 3])
def test_a_constrained_batch_stays_compiled_with_one_host_read_per_cycle_besides_its_own(
        loaded, k):
    """A row's grammar keeps the batch compiled (two graphs per drafted cycle)
    and costs one host read per cycle (the drafts, whose masks the host then
    computes) besides the cycle's own read; the tokens are constrained plain
    decoding's."""
    model, ref_model, tok = loaded("dense")
    prompt = tok.encode("hello world")
    constraint = mlx_mtp.constrain(SCHEMA)
    want = constrained_plain_generate(ref_model, tok, prompt, constraint, max_tokens=40)
    (got,), (stats,), reads, batch = _guided_run(model, tok, prompt, constraint, k, 40)
    assert got[:len(want.tokens)] == want.tokens
    assert batch.spec.compilable and batch.graphs.compiled
    assert max(reads) <= 2 and sum(reads) <= 2 * stats.cycles
    names = {key[0] for key in model.runtime.traces}
    assert {"propose", "settle"} <= names


def test_a_guided_plain_step_queues_its_forward_before_the_cycle_before_is_read(
        loaded, monkeypatch):
    """At depth 0 a constrained batch still looks ahead: each plain step's
    trunk forward is queued before the previous token is read, its masked
    sample once the grammars have that token (two graphs, "forward" and
    "sample"). Rows with a grammar, another grammar and none, greedy and
    seeded sampling, each get what they get alone without the lookahead."""
    from mlx_mtp.batch import Batch

    model, ref_model, tok = loaded("dense")
    prompts = [tok.encode(p) for p in ("hello world", "def f(x):", "import os")]
    constraints = [mlx_mtp.constrain(SCHEMA), None, mlx_mtp.constrain(regex="[a-z]{3,30}")]
    completed = []
    complete = Batch._complete
    monkeypatch.setattr(Batch, "_complete", lambda self, c: (completed.append(c.k),
                                                             complete(self, c))[1])
    for sampler in (None, mlx_mtp.make_sampler(temp=0.9)):
        kw = dict(max_tokens=24, sampler=sampler, return_token_ids=True, seeds=[5, 6, 7])
        completed.clear()
        got = mlx_mtp.batch_generate(model, tok, prompts, draft_tokens=0,
                                     constraint=constraints, **kw).token_ids
        assert len(completed) >= 10 and set(completed) == {0}
        alone = [[t for t, _ in mlx_mtp.generate_step(
            mx.array(p), model, max_tokens=24, draft_tokens=0, constraint=c, tokenizer=tok,
            sampler=sampler, seed=s, lookahead=False)] for p, c, s in zip(prompts, constraints,
                                                                       kw["seeds"])]
        assert got == [a[:len(g)] for g, a in zip(got, alone)]  # (the stop token left out)
        assert all(len(a) - len(g) in (0, 1) for g, a in zip(got, alone))
        if sampler is None:  # and what plain decoding gives
            assert got[0] == constrained_plain_generate(ref_model, tok, prompts[0],
                                                        constraints[0], max_tokens=24).tokens
    assert {"forward", "sample"} <= {key[0] for key in model.runtime.traces}
    # one host read per plain step: the cycle's own (the masks need no other)
    (got,), (stats,), reads, _ = _guided_run(model, tok, prompts[0], constraints[0], 0, 24)
    want = constrained_plain_generate(ref_model, tok, prompts[0], constraints[0], max_tokens=24)
    assert got[:len(want.tokens)] == want.tokens
    assert len(got) == len(want.tokens) + (want.finish_reason == "stop")
    assert max(reads) <= 1 and sum(reads) == stats.cycles


def test_forced_tokens_are_drafted_by_the_grammar(loaded):
    """Where the grammar leaves one token, it drafts it, not the head (q
    one-hot: kept with probability 1), and a cycle whose drafts are all forced
    runs no head; the output is constrained plain decoding's."""
    model, ref_model, tok = loaded("dense")
    prompt = tok.encode("hello world")
    constraint = mlx_mtp.constrain(regex=r"(ab|cd)e[f]{6}ghij(k|l)")
    want = constrained_plain_generate(ref_model, tok, prompt, constraint, max_tokens=30)
    (got,), (stats,), _, _ = _guided_run(model, tok, prompt, constraint, 3, 30)
    assert got[:len(want.tokens)] == want.tokens
    assert stats.forced >= 6
    assert any(key[0] == "propose" and key[4] for key in model.runtime.traces)  # forced_all


@pytest.mark.parametrize("k", [1, "auto", "parked"])
def test_a_forced_run_longer_than_the_depth_is_verified_in_one_forward(loaded, k, monkeypatch):
    """A run the grammar forces past the depth is verified alone in one
    forward (a "jump": its drafts the grammar's, no head draft, no host read
    besides the cycle's own), for one row and for rows that all have a run,
    also where `auto` is parked at depth 0 (its plain steps looking ahead);
    the tokens are constrained plain decoding's, also where max_tokens cuts
    a run short."""
    from mlx_mtp.batch import Batch
    from mlx_mtp.depth import DepthController

    controller, completed = None, []
    if k == "parked":  # no probe within the test
        k, controller = "auto", DepthController(initial=0, probe_every=10**6)
        complete = Batch._complete  # (a plain step's sample queued after the read)
        monkeypatch.setattr(Batch, "_complete", lambda self, c: (completed.append(c.k),
                                                                 complete(self, c))[1])
    model, ref_model, tok = loaded("dense")
    prompt = tok.encode("hello world")
    constraint = mlx_mtp.constrain(regex=r"(ab|cd)e[f]{6}ghij(k|l)mnopqrstuv")
    for n, rows in ((40, 1), (40, 2), (7, 1)):
        want = constrained_plain_generate(ref_model, tok, prompt, constraint, max_tokens=n)
        got, stats, reads, batch = _guided_run(model, tok, prompt, constraint, k, n, rows=rows,
                                               controller=controller)
        for row, row_stats in zip(got, stats):
            assert row[:len(want.tokens)] == want.tokens
            assert len(row) == len(want.tokens) + (want.finish_reason == "stop")
            assert sum(reads) <= 2 * row_stats.cycles - row_stats.jumps  # a jump reads once
            if n == 40:  # 25 tokens: 2 choices, the runs after them in 1-2 jumps each
                assert row_stats.jumps >= 3 and row_stats.cycles <= 5
    assert any(key[0] == "propose" and key[1] > 3 for key in model.runtime.traces)
    if controller is not None:  # parked throughout, its plain steps looking ahead
        assert controller.k == 0 and completed


@pytest.mark.slow
def test_a_sampled_jump_keeps_the_constrained_distribution(loaded):
    """Sampled rows jump too (under auto): χ² of the tokens before and after
    a forced run, at temperature 1, against the exact constrained plain
    distribution (the trunk's softmax masked to {a, b}, the run between).
    Slow tier: the greedy jump test is the default tier's."""
    from mlx_mtp.constraint import row_matcher

    model, ref_model, tok = loaded("dense")
    prompt = tok.encode("hello world")
    constraint = mlx_mtp.constrain(regex="[ab]efghijklm[ab]")
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]
    joint = {}
    for first in (a, b):
        matcher = row_matcher(constraint, tok, model.vocab_size).advance([first])
        run = matcher.forced()
        assert len(run) >= 3
        ctx = list(prompt)
        probs = []
        for prefix in ([], [first] + run):
            logits = ref_model(mx.array([ctx + prefix]))[0, -1].astype(mx.float32)
            probs.append(np.array(mx.softmax(logits[mx.array([a, b])])))
        for last in (a, b):
            joint[(first, last)] = float(probs[0][int(first == b)] * probs[1][int(last == b)])
        skip = 1 + len(run)
    n = 400
    stats = []
    out = mlx_mtp.batch_generate(model, tok, [prompt] * n, max_tokens=skip + 2,
                                 draft_tokens="auto", constraint=constraint,
                                 sampler=mlx_mtp.make_sampler(temp=1.0), seeds=list(range(n)),
                                 return_token_ids=True, stats=stats, completion_batch_size=50)
    samples = [(ids[0], ids[skip]) for ids in out.token_ids]
    assert sum(s.jumps for s in stats) >= n // 2
    assert chi2_pvalue(samples, joint) > ALPHA


def test_thinking_under_a_grammar_is_one_rule(tmp_path):
    """Thinking is off under a grammar unless asked for (the chat template's
    `enable_thinking`: the CLI and the server call constraint.thinking_args);
    a prompt that still leaves the model inside its think block (an API
    caller's, or thinking asked for) gets the grammar after the reasoning:
    free text first, then only what the grammar allows after the think-end."""
    from mlx_mtp.constraint import row_matcher, thinking_args
    from mlx_mtp.testing.synthetic import write_checkpoint

    assert thinking_args({}, {}, True) == {"enable_thinking": False}
    assert thinking_args({"enable_thinking": True}, {}, True) == {"enable_thinking": True}
    assert thinking_args({}, {"enable_thinking": True}, True) == {}
    assert thinking_args({}, {}, False) == {}
    model, tok = mlx_mtp.load(write_checkpoint(tmp_path / "thinks", tools="json", thinking=True,
                                               seed=7), quiet=True)
    c = mlx_mtp.constrain(regex="yes|no")
    msgs = [{"role": "user", "content": "ok?"}]
    on = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(msgs, add_generation_prompt=True, enable_thinking=False)
    V = model.vocab_size
    allowed = lambda m: int(np.bitwise_count(m.mask()).sum())
    assert allowed(row_matcher(c, tok, V, context=off)) <= 2
    thinking = row_matcher(c, tok, V, context=on)
    assert allowed(thinking) > V // 2  # the reasoning is free
    end = tok.encode(tok.think_end, add_special_tokens=False)
    thinking.advance(tok.encode("hm", add_special_tokens=False) + end)
    assert allowed(thinking) <= 3  # then "\n" (Qwen's gap) or the answer
