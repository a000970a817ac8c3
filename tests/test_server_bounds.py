"""The server's memory and latency bounds (server/lane.py, generation.py), in
process on the demo: OpenAI's `n` choices prefill their prompt once; mlx_lm's
warning about tools on a template without tool calling is said once per
process, not on every render."""

import logging
from types import SimpleNamespace

import pytest

from mlx_mtp.loader import demo_model_path
from mlx_mtp.mlx_lm_compat import CompletionRequest
from mlx_mtp.server.generation import ONCE_PER_PROCESS, MTPResponseGenerator
from mlx_mtp.server.prompt_store import cache_bytes
from serving import LONG_PROMPT

TOOLS_WARNING = "Received tools but model does not support tool calling"


def test_the_tools_warning_is_logged_once_per_process(caplog):
    """Every render of a request with tools on a template without tool
    calling (a client sends its tools with every turn) made mlx_lm log it;
    the tools still reach the template."""
    given = []
    tokenizer = SimpleNamespace(
        has_chat_template=True, has_tool_calling=False, has_thinking=False,
        response_initial_state=None,
        apply_chat_template=lambda messages, **kw: given.append(kw.get("tools")) or [1, 2, 3])
    gen = MTPResponseGenerator.__new__(MTPResponseGenerator)  # (no generation thread)
    gen.model_provider = SimpleNamespace(processor=None,
                                         cli_args=SimpleNamespace(chat_template_args={}))
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    request = CompletionRequest("chat", "", [{"role": "user", "content": "hi"}], tools, None)
    ONCE_PER_PROCESS._seen.clear()  # (another test in this process may have said it)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            out = gen._tokenize(tokenizer, request, SimpleNamespace(chat_template_kwargs=None))
            assert out[0] == [1, 2, 3]
    assert caplog.text.count(TOOLS_WARNING) == 1, caplog.text
    assert given and all(t == tools for t in given)


@pytest.fixture(scope="module")
def generator():
    """The server's generation thread on the demo, in this process; prompt
    snapshots only at answers' ends (so no stored prefix starts a choice by
    chance)."""
    from mlx_mtp.server.cli import parse_args
    from mlx_mtp.server.generation import MTPModelProvider
    from mlx_mtp.server.prompt_store import TieredPromptCache

    args = parse_args(["--model", str(demo_model_path()), "--prompt-snapshots", "end"])
    args.num_draft_tokens = None  # (as server/cli.py's main sets it)
    gen = MTPResponseGenerator(MTPModelProvider(args, "demo"), TieredPromptCache(64, 1 << 40))
    try:
        yield gen
    finally:
        gen.stop_and_join()


def _args(seed=None, temperature=0.0, max_tokens=12):
    from mlx_mtp.mlx_lm_compat import NEUTRAL, generation_arguments

    return generation_arguments(
        **dict(NEUTRAL, num_draft_tokens=2, seed=seed), model="default_model", draft="default_model",
        temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, stop_words=[],
        max_tokens=max_tokens, chat_template_kwargs=None)


def _tokens(gen, requests, seeds, temperature):
    """Each request's tokens, generated as the handler does a request's
    choices (each queued once the one before started)."""
    started = [gen.generate(r, _args(seed, temperature)) for r, seed in zip(requests, seeds)]
    return [[x.token for x in responses] for _, responses in started]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_n_choices_prefill_their_prompt_once_each_a_lone_answer(generator, monkeypatch,
                                                                temperature):
    """OpenAI's `n`: the first choice prefills the prompt, the others start
    from a copy of its state before the last token (only that token's head
    pair runs for them); each choice is what a lone request with its seed
    answers (greedy: the greedy answer)."""
    from mlx_mtp import batch
    from mlx_mtp.server.handler import fork

    fed = []  # prompt tokens fed by each prefill (all but each prompt's last)
    real = batch.prefill
    monkeypatch.setattr(batch, "prefill", lambda spec, caches, prompts, *a, **k: (
        fed.append(sum(len(p) - 1 for p in prompts)), real(spec, caches, prompts, *a, **k))[1])
    seeds = [7, 8, 9]
    lone = [_tokens(generator, [CompletionRequest("text", LONG_PROMPT, [], None, None)],
                    [seed], temperature)[0] for seed in seeds]
    cold = len(generator.model_provider.tokenizer.encode(LONG_PROMPT)) - 1
    assert fed == [cold] * 3
    del fed[:]
    first = CompletionRequest("text", LONG_PROMPT, [], None, None)
    first.mtp = None
    choices = [first] + [fork(first, None, generator.model_provider) for _ in seeds[1:]]
    assert _tokens(generator, choices, seeds, temperature) == lone
    assert sum(fed) == cold, fed
    if temperature:
        assert len({tuple(t) for t in lone}) == 3  # (the choices are not one another's)


def _conversation(gen, i: int):
    """A one-message chat of its own (`i`), answered (3 tokens)."""
    request = CompletionRequest("chat", "", [{"role": "user", "content": f"def f{i}(x):"}],
                                None, None)
    list(gen.generate(request, _args(max_tokens=3))[1])


def _settled(gen):
    """Once the finished chats' next turns are prefilled in idle time."""
    import time

    deadline = time.monotonic() + 60
    while gen.lane is not None and gen.lane.idle_work:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.fixture
def capped(generator, monkeypatch):
    """The generator's prefix cache emptied, its byte cap set by the test
    (put back after); next-turn prefixes prefilled 2 tokens a chunk, so
    each is reserved beside the entries for a while before it is stored."""
    from mlx_mtp.server.lane import _Lane

    store = generator.prompt_cache
    monkeypatch.setattr(_Lane, "_chunk", lambda self: 2)  # (a prefix here: ~7 tokens to go)
    saved = store.max_bytes
    _settled(generator)
    store.trim_to(n_sequences=0)  # (the other tests' entries; the thread is idle)
    try:
        yield store
    finally:
        store.max_bytes = saved


def test_a_stored_next_turn_prefix_evicts_only_what_it_needs(generator, capped, monkeypatch):
    """A next turn's prefix is reserved beside the prefix cache's entries
    while it is prefilled, and no longer once it is stored: the entry made of
    it counts once (counted twice, it evicted one entry too many). With a cap
    that holds two conversations' entries exactly (each its answer's state
    and its next turn's prefix), all four are there once the second is
    settled."""
    store, reserved = capped, []
    real = type(store).reserve
    monkeypatch.setattr(store, "reserve", lambda n: (reserved.append(n), real(store, n))[1])

    def two_conversations():  # -> (entries, bytes) once both are settled
        store.trim_to(n_sequences=0)
        for i in range(2):
            _conversation(generator, i)
            _settled(generator)
        return len(store), store.nbytes

    held = two_conversations()  # (uncapped)
    store.max_bytes = held[1]
    capped_held = two_conversations()
    assert max(reserved) > 0  # (each prefix was reserved before it was stored)
    assert held[0] == 4 and capped_held == held, (capped_held, held)


def test_next_turns_count_against_the_prompt_cache_bytes(generator, capped, monkeypatch):
    """The caches the finished chats' next turns hold (their answers' states,
    a prefix being prefilled) count against --prompt-cache-bytes with the
    prefix cache's entries: with a cap that holds two conversations' caches,
    20 conversations sent back to back (their next turns pile up, up to
    NEXT_TURNS_HELD) never hold more, after any step of the generation
    thread, nor once their idle work is done; and the cache is not kept
    below its cap by holding less: once settled, the last conversation's
    next-turn prefix is an entry, and the entries fill the cap up to less
    than one such prefix."""
    from mlx_mtp.server.lane import _Lane

    store = capped
    _conversation(generator, 0)
    _settled(generator)
    cap = 2 * generator.held_bytes()  # (its answer's state and its next turn's prefix)
    store.max_bytes = cap
    seen, turns, stored = [], [], []
    real, store_real = _Lane._bound, generator.store

    def bound(self):
        real(self)
        seen.append(generator.held_bytes())
        turns.append(len(self.next_turns))

    monkeypatch.setattr(_Lane, "_bound", bound)
    monkeypatch.setattr(generator, "store", lambda tokens, cache, *a, **k: (
        stored.append((list(tokens), cache)), store_real(tokens, cache, *a, **k))[1])
    for i in range(1, 21):
        _conversation(generator, i)
    _settled(generator)
    seen.append(generator.held_bytes())
    assert max(turns) > 2  # (more chats waiting than the cap holds)
    assert max(seen) <= cap, (max(seen), cap)
    prefix, cache = stored[-1]  # (the last conversation's next turn)
    assert generator.fetch(prefix)[1] == len(prefix)
    assert store.nbytes > cap - cache_bytes(cache), (store.nbytes, cap, cache_bytes(cache))


def test_a_request_arriving_during_a_next_turn_render_waits_for_that_render_only(
        generator, monkeypatch):
    """A finished chat's next turn is rendered in idle time, one template
    render a piece: a request that arrives during the first render is
    served before the second."""
    import threading
    import time

    from mlx_mtp.server.lane import _Lane

    events, served, sent = [], [], []
    render, join = generator.next_turn_render, _Lane.join

    def other():
        request = CompletionRequest("text", LONG_PROMPT, [], None, None)
        served.append(list(generator.generate(request, _args(max_tokens=2))[1]))

    def rendering(request, args, answer, text):
        events.append(("render", text))
        if not sent:  # a request arrives meanwhile (queued before this render ends)
            sent.append(text)
            threading.Thread(target=other, daemon=True).start()
            deadline = time.monotonic() + 10
            while generator.requests.empty():
                assert time.monotonic() < deadline
                time.sleep(0.001)
        return render(request, args, answer, text)

    def joining(self, requests):
        events.append(("join", len(requests)))
        return join(self, requests)

    monkeypatch.setattr(generator, "next_turn_render", rendering)
    monkeypatch.setattr(_Lane, "join", joining)
    chat = CompletionRequest("chat", "", [{"role": "user", "content": "def g(x):"}], None, None)
    list(generator.generate(chat, _args(max_tokens=6))[1])
    deadline = time.monotonic() + 60
    while len(events) < 4 or not served:
        assert time.monotonic() < deadline, events
        time.sleep(0.05)
    assert events[1:4] == [("render", "A"), ("join", 1), ("render", "B")], events
