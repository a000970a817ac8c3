"""The embedded demo model (mlx_mtp/demo, trained by train/train.py).

Checks that it loads as the default model, that its MTP head is really
trained (agreement with the trunk far above what an untrained head of the
same shape reaches), that greedy MTP decoding is token-identical to mlx_lm on
it, and that it writes Python-looking code.
"""


import mlx.core as mx
import pytest

import mlx_mtp
from mlx_mtp.loader import demo_model_path
from train.probe import OPENINGS, answer, complete_statements, judge

pytestmark = pytest.mark.skipif(demo_model_path() is None, reason="demo model not installed")

# From a held-out file of the training corpus (CPython's Lib/sched.py; the
# split is by path hash, see train/data.py), so the model never trained on it.
HELDOUT = '''
    def enterabs(self, time, priority, action, argument=(), kwargs=_sentinel):
        """Enter a new event in the queue at an absolute time.

        Returns an ID for the event which can be used to remove it,
        if necessary.

        """
        if kwargs is _sentinel:
            kwargs = {}

        with self._lock:
            event = Event(time, priority, next(self._sequence_generator),
                          action, argument, kwargs)
            heapq.heappush(self._queue, event)
        return event # The ID

    def enter(self, delay, priority, action, argument=(), kwargs=_sentinel):
        """A variant that specifies the time as a relative time.

        This is actually the more commonly used interface.

        """
        time = self.timefunc() + delay
        return self.enterabs(time, priority, action, argument, kwargs)

    def cancel(self, event):
        """Remove an event from the queue.

        This must be presented the ID as returned by enter().
        If the event is not in the queue, this raises ValueError.

        """
        with self._lock:
            self._queue.remove(event)
            heapq.heapify(self._queue)

    def empty(self):
        """Check whether the queue is empty."""
        with self._lock:
            return not self._queue
'''

# Teacher-forced top-1 agreement between the head's draft for t+2 and the
# trunk's own greedy choice there. The trained head is far above this; an
# untrained head of the same shape (measured below) is far below it.
MIN_AGREEMENT = 0.35
# Chained: two drafts in a row accepted (teacher-forced, mlx_mtp.evaluate);
# the head trained on its chained drafts (train/head.py) reaches 14% here.
MIN_CHAINED_2 = 0.08


@pytest.fixture(scope="module")
def demo():
    return mlx_mtp.load()


def head_agreement(model, tokens):
    x = mx.array(tokens)[None]
    h = model.trunk_hidden(x, None)
    greedy = mx.argmax(model.logits_from_hidden(h), axis=-1)[0]  # trunk's choice for t+1
    g = model.mtp(h[:, :-1], model.embed(x[:, 1:]))
    draft = mx.argmax(model.logits_from_hidden(g), axis=-1)[0]  # head's choice for t+2
    return (draft == greedy[1:]).astype(mx.float32).mean().item()


def test_demo_is_the_default_and_small(demo):
    model, tok = demo
    assert model.has_mtp
    cfg = model.language_model.args
    assert cfg.full_attention_interval == 4 and cfg.partial_rotary_factor == 0.25
    kinds = [l.is_linear for l in model.language_model.model.layers]
    assert kinds.count(True) == 3 * kinds.count(False)
    size = sum(f.stat().st_size for f in demo_model_path().glob("*.safetensors"))
    assert size <= 42 * 2**20


@pytest.mark.slow  # ~25 s; test_greedy_parity_with_mlx_lm_and_code drafts with the head by default
def test_head_is_trained(demo):
    model, tok = demo
    tokens = tok.encode(HELDOUT)
    assert len(tokens) > 150
    trained = head_agreement(model, tokens)
    assert trained > MIN_AGREEMENT, trained
    from mlx_mtp.evaluate import expected_acceptance

    chained = expected_acceptance(model, tokens, depth=2, max_starts=512)["acceptance"][1]
    assert chained > MIN_CHAINED_2, chained

    # Same trunk, head re-initialized: the threshold must reject it.
    saved = model.mtp.parameters()
    try:
        mx.random.seed(0)
        fresh = model.make_head(model.text_args, model.mtp_layers)
        model.mtp.update(fresh.parameters())
        untrained = head_agreement(model, tokens)
        untrained_chained = expected_acceptance(model, tokens, depth=2, max_starts=512)["acceptance"][1]
    finally:
        model.mtp.update(saved)
    assert untrained < MIN_AGREEMENT / 2, untrained
    assert untrained_chained < MIN_CHAINED_2 / 2, untrained_chained
    assert head_agreement(model, tokens) == trained


def test_greedy_parity_with_mlx_lm_and_code(demo):
    from mlx_lm.generate import generate_step

    model, tok = demo
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "def fibonacci(n):"}], add_generation_prompt=True
    )
    n = 48
    ref = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        ref.append(int(t))
    out = []
    stats = None
    for r in mlx_mtp.stream_generate(model, tok, mx.array(prompt), max_tokens=n, draft_tokens=2):
        out.append(int(r.token))
        stats = r
    # stream_generate stops at EOS (its last response carries the EOS token)
    assert out == ref[: len(out)]
    assert len(out) == n or out[-1] in tok.eos_token_ids
    assert stats.accepted > 0

    text = tok.decode([t for t in out if t not in tok.eos_token_ids])
    assert_python_looking(text)


def assert_python_looking(text):
    lines = text.split("\n")
    assert len(lines) >= 2, text
    assert lines[0].startswith(("def ", "class ", "    ", '"""')), text
    assert any(l.startswith("    ") for l in lines[1:]), text  # an indented block
    assert sum(c.isprintable() or c == "\n" for c in text) == len(text), text
    assert any(w in text for w in ("return", "self", "if ", "for ", " = ", '"""')), text


def test_completes_code_without_chat_template(demo):
    model, tok = demo
    # In a file's context: most of the demo's training signatures that stand
    # alone are a chat user's turn, so a bare `def f(n):` is answered with
    # <|im_end|>; after an import it is the start of code to continue.
    text = mlx_mtp.generate(model, tok, tok.encode("import os\n\ndef fibonacci(n):"), max_tokens=40)
    assert_python_looking("def fibonacci(n):" + text)


@pytest.mark.slow  # a guard for the server tests' own inputs, which fail too if it breaks
def test_the_server_tests_long_requests_run_long(demo):
    """tests/serving.py's LONG_MESSAGES and LONG_PROMPT, which the server tests
    use for a request still decoding when they act, run 600 tokens (greedy)
    without an EOS on this demo: a new demo that ends them fails here first."""
    from serving import LONG_MESSAGES, LONG_PROMPT

    model, tok = demo
    chat = tok.apply_chat_template(LONG_MESSAGES, add_generation_prompt=True)
    for ids in (chat, tok.encode(LONG_PROMPT)):
        last = None
        for last in mlx_mtp.stream_generate(model, tok, mx.array(ids), max_tokens=600):
            pass
        assert last.finish_reason == "length" and last.generation_tokens == 600


def test_parallel_chain_training_forward_matches_decoding(demo):
    """train/head.py trains every chained draft step of every position at once
    (one boolean mask over the concatenated keys of steps 1..k); it must equal
    the decode-time chain (mlx_mtp.evaluate's sequential head cache)."""
    head = pytest.importorskip("train.head")
    model, tok = demo
    tokens = tok.encode(HELDOUT)[:120]
    assert head.check_chain(model, tokens, depth=4) < 1e-4
    assert head.check_chain(model, tokens, depth=3, first=70) < 1e-4


def test_complete_statements_cuts_at_the_last_complete_one():
    two = "def a():\n    return 1\n\ndef b(x):\n    if x:\n        return 2\n    else:\n"
    assert complete_statements(two, ended=False) == "def a():\n    return 1"
    assert complete_statements("def a():\n    return 1\n", ended=True) == "def a():\n    return 1"
    assert complete_statements("def a():\n    return (1 +", ended=False) == ""
    long = "\n".join(["def fib(n):"] + ["    x = 1"] * 3 + ["    y = 2"] * 5) + "\n"
    assert judge("def fib(n):", long, ended=True) == {
        "parses": True, "lines": 9, "max_repeat": 5, "names_it": True, "ok": False}


# Issue 36's bar. The shipped demo names what its prompt opens in every
# answer, but most answers are still too short, loop or do not parse;
# `python -m train.probe mlx_mtp/demo` prints each criterion. The openings it
# fails are strict xfails: one that starts to pass turns red until it moves
# into PASSES.
PASSES = {"class Matrix:"}
NOT_YET = pytest.mark.xfail(strict=True, raises=AssertionError,
                            reason="the demo model does not yet write this opening's code (issue 36)")


@pytest.mark.parametrize("opening", [  # (the openings it fails: in the slow tier)
    o if o in PASSES else pytest.param(o, marks=[NOT_YET, pytest.mark.slow]) for o in OPENINGS])
def test_writes_the_code_its_prompt_opens(demo, opening):
    """Greedy, 200 tokens, through the chat template (as the README's first
    command), MTP decoding: cut at its last complete top-level statement, the
    answer parses, is at least 8 lines, repeats no line more than twice in a
    row, and defines what the prompt opened (its name in the first two
    lines)."""
    model, tok = demo
    text, ended = answer(model, tok, opening, stream_generate=mlx_mtp.stream_generate)
    verdict = judge(opening, text, ended)
    assert verdict["ok"], (verdict, text)
