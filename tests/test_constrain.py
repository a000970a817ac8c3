"""Structured output's foundation (mlx_mtp/constraint.py): constraints and
their errors, the matcher's verify masks against llguidance's own
step-by-step masks, rollback, forced tokens, stop tokens, a padded
vocabulary, the device-side unpack, and the reference (plain constrained
decoding) on the demo model. docs/design.md, "Structured output".
"""

import json
import re
import subprocess
import sys

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_mtp.constraint import (Matcher, apply_bitmask, batch_masks, constrain,
                                unpack_bitmask)
from mlx_mtp.loader import DEMO_MODEL_DIR, demo_model_path

pytestmark = pytest.mark.skipif(demo_model_path() is None, reason="demo model not installed")

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
EXPRESSION = """
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""
GRAMMARS = {"schema": dict(json_schema=PERSON), "json_object": dict(json_object=True),
            "regex": dict(regex=r"(ab|cd)*e[0-9]{1,3}"), "lark": dict(grammar=EXPRESSION)}


@pytest.fixture(scope="module")
def tok():
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(DEMO_MODEL_DIR, eos_token_ids=[0, 2])  # as mlx_mtp.load does


@pytest.fixture(scope="module")
def constraints():
    return {name: constrain(**kw) for name, kw in GRAMMARS.items()}


# -- constraints ---------------------------------------------------------------

def test_each_kind_compiles(tok):
    assert constrain(PERSON).kind == "json_schema"
    assert constrain(json.dumps(PERSON)).grammar == constrain(PERSON).grammar
    assert constrain(json_object=True).kind == "json_object"
    assert constrain(regex="a+").kind == "regex"
    assert constrain(grammar=EXPRESSION).kind == "grammar"


@pytest.mark.parametrize("kwargs", [{}, dict(regex="a", grammar="start: \"a\""),
                                    dict(json_schema=PERSON, json_object=True)])
def test_exactly_one_kind(kwargs):
    with pytest.raises(ValueError, match="exactly one of"):
        constrain(**kwargs)


@pytest.mark.parametrize("kwargs, names", [
    (dict(json_schema='{"type": '), "not valid JSON"),
    (dict(json_schema=[1, 2]), "must be a JSON object"),
    (dict(json_schema={"type": "strin"}), "strin"),
    (dict(json_schema={"type": "string", "pattern": "(a"}), "pattern"),
    (dict(json_schema={"$ref": "#/$defs/missing"}), "missing"),
    # features llguidance cannot enforce: refused, never ignored
    (dict(json_schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (dict(json_schema={"type": "array", "contains": {"const": 1}}), "contains"),
    (dict(json_schema={"if": {"required": ["a"]}, "then": {"required": ["b"]}}), "if"),
    (dict(json_schema={"oneOf": [{"type": "integer"}, {"type": "number"}]}), "oneOf"),
    (dict(json_schema={"type": "string", "format": "no-such-format"}), "no-such-format"),
    # a schema's own options cannot turn the refusal off
    (dict(json_schema={"type": "array", "uniqueItems": True, "x-guidance": {"lenient": True}}),
     "uniqueItems"),
    (dict(regex="(a"), "unclosed group"),
    (dict(regex="a{2,1}"), "repetition"),
    (dict(grammar="start: foo"), "unknown name"),
])
def test_refused_with_one_line(kwargs, names):
    with pytest.raises(ValueError) as e:
        constrain(**kwargs)
    message = str(e.value)
    assert "\n" not in message and names in message


def test_pydantic_model_class():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    c = constrain(Person)
    assert c.kind == "json_schema" and json.loads(c.source) == Person.model_json_schema()


def test_package_exports_constrain():
    """`mlx_mtp.constrain` stays the function once the module is loaded: the
    module is `constraint`, so importing it binds no `constrain` on the package."""
    import mlx_mtp
    import mlx_mtp.constraint

    assert mlx_mtp.constrain is mlx_mtp.constraint.constrain


def test_nothing_loads_llguidance_or_pydantic_until_used():
    code = ("import sys, mlx_mtp, mlx_mtp.constraint, mlx_mtp.api, mlx_mtp.server, mlx_mtp.cli\n"
            "assert 'llguidance' not in sys.modules and 'pydantic' not in sys.modules\n"
            "mlx_mtp.constraint.constrain({'type': 'object'})\n"
            "assert 'llguidance' in sys.modules and 'pydantic' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# -- masks -----------------------------------------------------------------------

def bits(words) -> set:
    """The token ids a packed mask row allows."""
    return set(np.flatnonzero(np.unpackbits(np.asarray(words).view(np.uint8),
                                            bitorder="little")).tolist())


def step_mask(matcher: Matcher) -> np.ndarray:
    """llguidance's own mask of the matcher's current state (no drafts, no
    rollback); it has a spare word past the vocabulary, always zero."""
    words = np.frombuffer(matcher._matcher.compute_bitmask(), dtype=np.uint32)
    assert not words[matcher.words:].any()
    return words[:matcher.words]


@st.composite
def walks(draw, matcher_factory, max_len=12):
    """A token sequence the grammar allows, drawn token by token from its masks."""
    m = matcher_factory()
    tokens = []
    for _ in range(draw(st.integers(0, max_len))):
        allowed = sorted(bits(step_mask(m)) - m.stop_tokens)
        if not allowed:
            break
        tokens.append(draw(st.sampled_from(allowed)))
        m.advance(tokens[-1:])
    return tokens


def expected_masks(constraint, tok, prefix, drafts):
    """Step by step on a fresh matcher: the masks after prefix + drafts[:i] and
    how many positions are valid (up to the first refused draft or stop token)."""
    m = constraint.matcher(tok)
    m.advance(prefix)
    rows = [step_mask(m)]
    for d in drafts:
        if d in m.stop_tokens or d not in bits(rows[-1]):
            break
        m.advance([d])
        rows.append(step_mask(m))
    return rows


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), name=st.sampled_from(sorted(GRAMMARS)))
def test_verify_masks_are_the_step_by_step_masks(tok, constraints, data, name):
    c = constraints[name]
    walk = data.draw(walks(lambda: c.matcher(tok), max_len=14))
    cut = data.draw(st.integers(0, len(walk)))
    prefix, drafts = walk[:cut], walk[cut:cut + 4]
    if data.draw(st.booleans()):  # a draft the grammar may refuse, or a stop token
        drafts = drafts[:data.draw(st.integers(0, len(drafts)))]
        drafts.append(data.draw(st.sampled_from([0, 2, data.draw(st.integers(0, 4095))])))
    m = c.matcher(tok)
    m.advance(prefix)
    before = step_mask(m)

    words, valid = m.masks(drafts)

    expected = expected_masks(c, tok, prefix, drafts)
    assert words.shape == (len(drafts) + 1, (4096 + 31) // 32)
    assert valid == len(expected)
    for i in range(len(words)):  # rows past `valid` repeat the last valid one
        np.testing.assert_array_equal(words[i], expected[min(i, valid - 1)])
    # rolled back: the same state, and it goes on like a fresh one
    np.testing.assert_array_equal(step_mask(m), before)
    m.advance(drafts[:valid - 1])
    np.testing.assert_array_equal(step_mask(m), expected[valid - 1])


def test_batch_masks_rows_are_each_rows_own(tok, constraints):
    a, b = constraints["schema"].matcher(tok), constraints["regex"].matcher(tok)
    a.advance(tok.encode('{"name": "A'))
    drafts_a, drafts_b = tok.encode('l", "age"'), tok.encode("abcd")
    words, valid = batch_masks([(a, drafts_a), (b, drafts_b[:2])], 4)
    for row, (m, drafts) in enumerate([(a, drafts_a[:3]), (b, drafts_b[:2] + [0])]):
        own, own_valid = m.masks(drafts)
        assert valid[row] == own_valid
        np.testing.assert_array_equal(words[row], own)


def test_mask_after_drafts_is_the_next_draft_position(tok, constraints):
    c = constraints["schema"]
    m = c.matcher(tok)
    drafts = tok.encode('{"name": "Al')
    np.testing.assert_array_equal(m.mask(drafts), expected_masks(c, tok, [], drafts)[-1])
    with pytest.raises(ValueError, match="not allowed"):
        m.mask(tok.encode("[1"))


# -- forced tokens and stops --------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(GRAMMARS)))
def test_forced_is_the_run_of_one_token_masks(tok, constraints, data, name):
    c = constraints[name]
    prefix = data.draw(walks(lambda: c.matcher(tok)))
    m = c.matcher(tok).advance(prefix)
    before = step_mask(m)

    forced = m.forced()

    fresh = c.matcher(tok).advance(prefix)
    run = []
    while len(bits(step_mask(fresh))) == 1:
        (token,) = bits(step_mask(fresh))
        run.append(token)
        if token in fresh.stop_tokens:
            break
        fresh.advance([token])
    assert forced == run
    np.testing.assert_array_equal(step_mask(m), before)


def test_forced_tokens_of_a_literal_and_of_a_schema(tok):
    assert constrain(regex=r"\{").matcher(tok).forced() == tok.encode("{")
    # the demo vocabulary has no token for '{"' or '":': each byte run is one token
    m = constrain(PERSON).matcher(tok)
    assert tok.decode(m.forced()) == '{"name":'
    assert m.fast_forward_tokens() == m.forced()


def test_stop_tokens_follow_the_grammar(tok):
    stops = {0, 2}
    m = constrain({"type": "integer"}).matcher(tok)
    assert m.stop_tokens == stops and not m.accepting and not (bits(m.mask()) & stops)
    m.advance(tok.encode("42"))  # complete, yet more digits may follow
    assert m.accepting and not m.must_stop
    assert stops <= bits(m.mask()) and bits(m.mask()) - stops
    assert m.forced() == []
    m.advance([2])
    assert m.finished and not m.must_stop
    with pytest.raises(ValueError, match="already ended"):
        m.advance(tok.encode("1"))

    m = constrain(regex="ab").matcher(tok).advance(tok.encode("ab"))
    assert m.must_stop and bits(m.mask()) == stops
    words, valid = m.masks([0, 5])  # a stop draft: nothing after it is decoded
    assert valid == 1 and bits(words[0]) == stops
    assert m.forced() == []  # two stop tokens: the sampler still picks one
    m.advance([0])
    assert m.finished


def test_a_single_stop_token_is_forced(tok):
    from mlx_lm.utils import load_tokenizer

    one_eos = load_tokenizer(DEMO_MODEL_DIR)
    one_eos.eos_token_ids = [2]
    m = constrain(regex="ab").matcher(one_eos).advance(one_eos.encode("ab"))
    assert m.forced() == [2]
    assert m.forced() == [2]  # the stop token was not consumed
    m.advance([2])
    assert m.finished


def test_advance_refuses_what_the_grammar_refuses(tok):
    m = constrain(regex="ab").matcher(tok)
    with pytest.raises(ValueError, match="not allowed"):
        m.advance(tok.encode("b"))
    m = constrain({"type": "integer"}).matcher(tok)
    with pytest.raises(ValueError, match="follow a stop token"):
        m.advance(tok.encode("4") + [0] + tok.encode("2"))


# -- every output a schema's grammar allows is valid under it --------------------------

# Short tokens a walk favours, so that objects close, keys repeat and walks end
_FAVOURED = ('{', '}', '"', ',', ':', ' ', 'p', 'q', 'a', 'b', '0', '1', 'u', 'true', '"p"',
             '"q"')
_CLOSERS = ('}', '"', ']')


def _single_tokens(tok, texts) -> set:
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    return {i[0] for i in ids if len(i) == 1}


def walk_output(constraint, tok, rng, limit=120):
    """One text the grammar allows, drawn token by token from its masks
    (short tokens favoured, closers past half the limit), or None when it
    did not end within `limit` tokens."""
    favoured, closers = _single_tokens(tok, _FAVOURED), _single_tokens(tok, _CLOSERS)
    m = constraint.matcher(tok)
    out = []
    for step in range(limit):
        allowed = bits(m.mask())
        late = step > limit // 2
        choices = sorted(allowed - m.stop_tokens)
        if allowed & m.stop_tokens and (late or not choices or rng.random() < 0.3):
            return tok.decode(out)
        pool = ([t for t in choices if t in closers] if late else []) or (
            [t for t in choices if t in favoured] if rng.random() < 0.9 else []) or choices
        out.append(rng.choice(pool))
        m.advance(out[-1:])
    return None


@st.composite
def open_objects(draw):
    """Object schemas with listed, pattern and additional properties and
    key counts, sometimes nested in an array or an object."""
    value = st.sampled_from([{"type": "integer", "minimum": 0, "maximum": 9},
                             {"type": "boolean"}, {"enum": ["u", "v"]}])
    listed = draw(st.dictionaries(st.sampled_from(["a", "b"]), value, max_size=2))
    schema = {"type": "object", "properties": listed,
              "required": sorted(k for k in listed if draw(st.booleans()))}
    if draw(st.booleans()):
        schema["patternProperties"] = {"^[pq]$": draw(value)}
    extra = draw(st.sampled_from(["absent", "false", "true", "schema"]))
    if extra != "absent":
        schema["additionalProperties"] = {"false": False, "true": True}.get(extra) \
            if extra != "schema" else draw(value)
    for count in ("minProperties", "maxProperties"):
        if draw(st.booleans()):
            schema[count] = draw(st.integers(0, 4))
    nest = draw(st.sampled_from(["no", "array", "object"]))
    if nest == "array":
        return {"type": "array", "items": schema, "maxItems": 2}
    if nest == "object":
        return {"type": "object", "properties": {"o": schema}, "required": ["o"],
                "additionalProperties": False}
    return schema


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=open_objects(), seed=st.integers(0, 2**16))
def test_every_output_of_a_schema_validates_or_the_schema_is_refused(tok, schema, seed):
    """Generated schemas with pattern and additional properties and key
    counts: a schema is refused naming what cannot be enforced, or every
    text its grammar lets a walk end with parses and validates (a repeated
    key under patternProperties once parsed as one, under minProperties)."""
    import random

    try:
        c = constrain(schema)
    except ValueError as e:
        assert re.search(r"Properties|required", str(e)), str(e)
        return
    rng = random.Random(seed)
    for _ in range(3):
        text = walk_output(c, tok, rng)
        if text is not None:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
     "minProperties": 2, "maxProperties": 3},  # the issue's: {"x_origs": 0, "x_origs": 0, ...}
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    {"type": "array", "items": {"type": "object", "patternProperties": {"^[pq]$": {}},
                                "additionalProperties": False, "minProperties": 3}},
])
def test_min_properties_over_repeatable_keys_is_refused(schema):
    with pytest.raises(ValueError, match="minProperties") as e:
        constrain(schema)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "patternProperties": {"^x_": {"type": "integer"}}, "maxProperties": 3},
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1},
    {"type": "object", "properties": {"minProperties": {"type": "integer"}}},  # a name, no keyword
])
def test_counts_that_hold_are_served(schema):
    assert constrain(schema).kind == "json_schema"


# -- vocabulary width ----------------------------------------------------------------

def test_padded_vocabulary_rows_are_never_allowed(tok):
    width = 4096 + 37  # a model's logits padded beyond the tokenizer's 4096 tokens
    m = constrain(grammar="start: /(.|\\n)*/").matcher(tok, vocab_size=width)
    drafts = tok.encode("hello")
    words, valid = m.masks(drafts)
    assert valid == len(drafts) + 1 and words.shape[-1] == (width + 31) // 32
    assert all(max(bits(row)) < 4096 for row in words)
    allowed = unpack_bitmask(mx.array(words), width)
    assert allowed.shape == (len(drafts) + 1, width) and not allowed[:, 4096:].any().item()
    with pytest.raises(ValueError, match="smaller than its tokenizer"):
        constrain(json_object=True).matcher(tok, vocab_size=4000)


def test_device_unpack_equals_numpy(tok):
    rng = np.random.default_rng(0)
    vocab = 1000
    words = rng.integers(0, 2 ** 32, size=(3, (vocab + 31) // 32), dtype=np.uint32)
    expected = np.unpackbits(words.view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
    np.testing.assert_array_equal(np.array(unpack_bitmask(mx.array(words), vocab)), expected == 1)
    np.testing.assert_array_equal(  # llguidance's int32 words unpack the same
        np.array(unpack_bitmask(mx.array(words.view(np.int32)), vocab)), expected == 1)
    logits = mx.array(rng.standard_normal((3, vocab)).astype(np.float32))
    masked = np.array(apply_bitmask(logits, mx.array(words)))
    assert np.all(np.isneginf(masked[expected == 0]))
    np.testing.assert_array_equal(masked[expected == 1], np.array(logits)[expected == 1])


# -- the reference: plain constrained decoding on the demo model ---------------------

@pytest.fixture(scope="module")
def demo():
    import mlx_mtp

    return mlx_mtp.load(quiet=True)


def _prompt(tok, ask):
    return tok.apply_chat_template([{"role": "user", "content": ask}],
                                   add_generation_prompt=True, tokenize=False)


SCHEMAS = [
    PERSON,
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
     "required": ["ok", "tags"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS, ids=["object", "enum_array", "nested"])
def test_reference_output_validates(demo, schema):
    from mlx_mtp.testing.constrained import constrained_plain_generate

    model, tok = demo
    out = constrained_plain_generate(model, tok, _prompt(tok, "Answer in JSON."),
                                     constrain(schema), max_tokens=64)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)


def test_reference_sampled_output_validates(demo):
    from mlx_lm.sample_utils import make_sampler

    from mlx_mtp.testing.constrained import constrained_plain_generate

    model, tok = demo
    for seed in range(2):
        mx.random.seed(seed)
        out = constrained_plain_generate(model, tok, _prompt(tok, "A person, in JSON."),
                                         constrain(PERSON), max_tokens=64,
                                         sampler=make_sampler(temp=1.0))
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


def test_reference_any_json_and_regex(demo):
    from mlx_mtp.testing.constrained import constrained_plain_generate

    model, tok = demo
    out = constrained_plain_generate(model, tok, _prompt(tok, "JSON please."),
                                     constrain(json_object=True), max_tokens=64)
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text), dict)
    else:  # a cut-off object is reported as such
        assert out.text.startswith("{")
    out = constrained_plain_generate(model, tok, _prompt(tok, "A code."),
                                     constrain(regex=r"[A-Z]{2}-[0-9]{3}"), max_tokens=16)
    assert out.finish_reason == "stop" and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.text)


def test_reference_cut_by_max_tokens_is_length(demo):
    from mlx_mtp.testing.constrained import constrained_plain_generate

    model, tok = demo
    out = constrained_plain_generate(model, tok, _prompt(tok, "A person, in JSON."),
                                     constrain(PERSON), max_tokens=4)
    assert out.finish_reason == "length" and len(out.tokens) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_reference_masks_padded_logits(demo):
    """Logits wider than the tokenizer (a padded vocabulary): the padded rows,
    however large, are never drawn."""
    from mlx_mtp.constraint import MaskingProcessor

    _, tok = demo
    processor = MaskingProcessor(constrain(json_object=True), tok)
    logits = mx.concatenate([mx.zeros((1, 4096)), mx.full((1, 64), 1e9)], axis=-1)
    masked = processor(mx.array(tok.encode("hi")), logits)
    assert processor.matcher.vocab_size == 4160
    assert mx.argmax(masked, axis=-1).item() == tok.encode("{")[0]


def test_processor_follows_a_speculative_history(tok, constraints):
    """Called with drafts that are later rejected (a history that shrinks and
    changes), the processor's masks are those of a fresh matcher on the same
    history; a refused token or a stop token leaves the mask where it was."""
    from mlx_mtp.constraint import MaskingProcessor

    c = constraints["schema"]
    prompt = tok.encode("hi")
    processor = MaskingProcessor(c, tok)
    logits = mx.zeros((1, 4096))

    def allowed(generated):
        return set(np.flatnonzero(np.array(processor(mx.array(prompt + generated), logits)[0])
                                  > -np.inf).tolist())

    doc = tok.encode('{"name": "Al", "age": 7}')
    for generated in [[], doc[:5], doc[:3], doc[:3] + tok.encode("Z"), doc[:8], doc[:2],
                      doc, doc + [0], doc[:6] + [4095, 17]]:
        fresh = c.matcher(tok)
        n = fresh.allowed_drafts(generated)
        fresh.advance(generated[:n])
        assert allowed(generated) == bits(fresh.mask()), generated


@pytest.mark.parametrize("depth", [1, 3])
def test_mtp_through_the_processor_path_is_the_reference(demo, depth):
    """Today's engine runs host logits processors at every draft and verify
    position: with MaskingProcessor it drafts from masked head logits and
    verifies masked, and greedy output is token for token the reference's
    (depth 2 runs the same code)."""
    import mlx_mtp
    from mlx_mtp.constraint import MaskingProcessor
    from mlx_mtp.stats import MTPStats
    from mlx_mtp.testing.constrained import constrained_plain_generate

    model, tok = demo
    c = constrain(SCHEMAS[2])
    prompt = tok.encode(_prompt(tok, "Answer in JSON."))
    reference = constrained_plain_generate(model, tok, prompt, c, max_tokens=48)
    tokens, stats = [], MTPStats()
    for token, _ in mlx_mtp.generate_step(mx.array(prompt), model, max_tokens=48,
                                          draft_tokens=depth, stats=stats,
                                          logits_processors=[MaskingProcessor(c, tok)]):
        if token in tok.eos_token_ids:
            break
        tokens.append(token)
    assert tokens == reference.tokens
    assert 0 < stats.accepted < stats.drafted  # drafts were kept and rejected: rollbacks ran


def test_text_an_added_token_spells_is_written_in_bytes(tmp_path):
    """llguidance treats every added token of a tokenizer (`<tool_call>`,
    `<think>`) as special. Where a grammar forces the text one spells,
    llguidance 1.9.1's mask allows that token alone and its parser then
    refuses it: decoding would emit it forever. The matcher's masks allow
    what the parser takes, so the text is written byte by byte."""
    import mlx_mtp
    from mlx_mtp.testing.synthetic import write_checkpoint

    model, tok = mlx_mtp.load(write_checkpoint(tmp_path / "ck", tools="json"), quiet=True)
    c = constrain(regex="<tool_call>x")
    special = tok.encode("<tool_call>")
    assert len(special) == 1  # an added token
    assert not (Matcher(c, tok, model.vocab_size).mask()[special[0] >> 5] >> (special[0] & 31)) & 1
    for k in (0, 2):
        assert mlx_mtp.generate(model, tok, tok.encode("hi"), max_tokens=30, draft_tokens=k,
                                constraint=c) == "<tool_call>x"
