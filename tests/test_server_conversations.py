"""Agent conversations through the server, each turn against a cold prefill
of the history it was served with: the guarantee is greedy equality up to
ties. A turn that starts from a re-used state (the prompt cache, the
next-turn prefix prefilled in idle time, in chunks, or read back from disk)
computes the same function as a cold prefill in another rounding order, so
where the cold run's two most likely tokens are within TIE of each other
(log-probabilities, nats) it may take the other; anywhere else it must
take the cold run's token. Shapes: answers cut by max_tokens, ended by EOS,
by a stop string; Anthropic with a system prompt; two conversations at
once; a restart from --prompt-cache-dir. Also here, by the order of
events: a request arriving while idle time prefills a next turn starts
before that work ends, and a next turn arriving then starts from it."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from serving import LONG_MESSAGES, Server  # noqa: E402

from mlx_mtp.loader import demo_model_path  # noqa: E402

DEMO = str(demo_model_path())
TIE = 1e-4  # nats: the cold top-2 margin below which either token is the model's answer
SYSTEM = "You are a terse Python assistant."


@pytest.fixture(scope="module")
def cold():
    """The demo in this process (mlx_lm): a history's greedy tokens and, at
    each, the margin between its two most likely tokens."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    model, tok = mlx_lm.load(DEMO)

    def run(messages, max_tokens):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids, margins = [], []
        for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
            top2 = mx.topk(logprobs, 2).tolist()
            ids.append(int(token))
            margins.append(abs(top2[1] - top2[0]))
            if token in tok.eos_token_ids:
                break
        return ids, margins

    return run, tok


def equal_up_to_ties(served_text: str, cold_ids: list, margins: list, tok, stop=None):
    """The served answer is the cold one (cut at `stop`), or it leaves it at a
    token where the cold margin is below TIE."""
    eos = set(tok.eos_token_ids)
    text = tok.decode([t for t in cold_ids if t not in eos])
    for word in stop or ():
        if word in text:
            text = text[:text.index(word)]
    if served_text == text:
        return
    k = 0  # the cold tokens the served text begins with
    while k < len(cold_ids) and served_text.startswith(
            tok.decode([t for t in cold_ids[:k + 1] if t not in eos])):
        k += 1
    assert k < len(margins) and margins[k] < TIE, (
        f"the served answer leaves the cold one at token {k}, where the cold top-2 margin "
        f"is {margins[k] if k < len(margins) else None} (not a tie):\n{served_text!r}\n{text!r}")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    folder = tmp_path_factory.mktemp("conversations")
    s = Server(["mlx_mtp.server", "--prompt-cache-dir", str(folder / "cache"),
                "--log-level", "DEBUG", "--idle-chunk-ms", "1"], folder / "server.log")
    s.folder = folder
    try:
        yield s
    finally:
        s.close()


STORED = "next turn: its prefix of"  # (the server's log line)


def openai_turns(srv, cold, asks, max_tokens, stop=None, system=True, idle=False):
    """A conversation of len(asks) turns, each checked against a cold prefill
    of its history; returns the usage of each turn. idle: each next turn is
    sent once the server stored its prefix (an agent running its tool);
    else at once."""
    run, tok = cold
    client = srv.openai(timeout=300)
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    usages = []
    stored = srv.text().count(STORED)
    for i, ask in enumerate(asks):
        if idle and i:
            assert srv.wait_for_log(STORED, stored + 1)
        stored = srv.text().count(STORED)
        messages.append({"role": "user", "content": ask})
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens,
                                           temperature=0, stop=stop)
        text = r.choices[0].message.content or ""
        equal_up_to_ties(text, *run(messages, max_tokens), tok, stop)
        usages.append((r.usage, len(tok.apply_chat_template(messages, add_generation_prompt=True)),
                       r.usage.completion_tokens))
        messages.append({"role": "assistant", "content": text})
    return usages


SHAPES = {  # asks, max_tokens, stop strings, next turns sent after idle time
    "cut by max_tokens": (["class Stack:", "class Queue:", "def push(x):"], 40, None, True),
    "ended by EOS": (["def fibonacci(n):", "def factorial(n):"], 120, None, False),
    "ended by a stop string": (["def read_config(path):", "def write_config(path, data):",
                                "def main():"], 60, ["return"], True),  # (cold: cut at it)
}


@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow)
                                   if s == "cut by max_tokens" else s for s in SHAPES])
def test_each_turn_is_a_cold_prefill_of_its_history_up_to_ties(srv, cold, shape):
    asks, max_tokens, stop, idle = SHAPES[shape]
    usages = openai_turns(srv, cold, asks, max_tokens, stop, idle=idle)
    if idle:  # the answers are re-used: each next turn reads its previous prompt and answer
        for (u, _, _), (prev, prompt, answer) in zip(usages[1:], usages):
            assert u.prompt_tokens_details.cached_tokens >= prompt + answer - 4, (
                u, prompt, answer)


@pytest.mark.slow  # (the default tier: each shape alone; batch rows: test_batch, test_server)
def test_two_conversations_at_once(srv, cold):
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(openai_turns, srv, cold, asks, 48, None, system)
                   for asks, system in ((["def merge(a, b):", "def split(s):"], True),
                                        (["class Tree:", "class Node:"], False))]
        for f in futures:
            f.result()


@pytest.mark.slow  # (the default tier: Anthropic's cache reads, test_server_prompt_cache)
def test_anthropic_turns_with_a_system_prompt(srv, cold):
    run, tok = cold
    client = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=300)
    msgs = []
    for ask in ("class LRUCache:", "class Queue:", "def main():"):
        msgs.append({"role": "user", "content": ask})
        r = client.messages.create(model="m", max_tokens=48, system=SYSTEM, messages=msgs)
        text = "".join(b.text for b in r.content if b.type == "text")
        equal_up_to_ties(text, *run([{"role": "system", "content": SYSTEM}] + msgs, 48), tok)
        msgs.append({"role": "assistant", "content": text})


def test_a_restart_continues_from_the_disk(srv, cold, tmp_path):
    """Turn 1 on one server, turn 2 on another reading the same folder."""
    run, tok = cold
    folder = tmp_path / "cache"
    argv = ["mlx_mtp.server", "--prompt-cache-dir", str(folder)]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "def add(a, b):"}]
    first = Server(argv, tmp_path / "first.log")
    try:
        text = first.openai(timeout=300).chat.completions.create(
            model="m", messages=messages, max_tokens=40, temperature=0).choices[0].message.content
        assert first.wait_for_log("next turn: its prefix of")  # (stored before the stop)
    finally:
        first.close()
    equal_up_to_ties(text, *run(messages, 40), tok)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "def sub(a, b):"}]
    second = Server(argv, tmp_path / "second.log")
    try:
        r = second.openai(timeout=300).chat.completions.create(
            model="m", messages=messages, max_tokens=40, temperature=0)
    finally:
        second.close()
    assert r.usage.prompt_tokens_details.cached_tokens > len(tok.apply_chat_template(
        messages[:2], add_generation_prompt=True))  # (read from disk)
    equal_up_to_ties(r.choices[0].message.content, *run(messages, 40), tok)


# -- idle-time work never holds up a request ---------------------------------------------------
def _lines(srv, since: int) -> list:
    return srv.text().splitlines()[since:]


def _count(srv, words: str, before: int) -> int:
    """How many of the log's first `before` lines hold `words`."""
    return sum(words in line for line in srv.text().splitlines()[:before])


def test_a_request_arriving_during_idle_work_starts_before_it_ends(srv):
    """A long answer's next turn is prefilled in idle time, in chunks (this
    server: --idle-chunk-ms 1, 8 tokens a chunk). Another chat's request,
    sent once that work has begun, finds it midway (logged with how far it
    got) and is served; the work goes on and ends after it. Its own next
    turn, sent while that turn's prefix is being prefilled, starts from
    what was prefilled. Whether a request lands inside that window (a few
    hundred ms here) is up to the machine's load: each half tries fresh
    chats until one does (ATTEMPTS), and checks every try's order of events."""
    client = srv.openai(timeout=300)
    for attempt in range(ATTEMPTS):
        if _another_chat_during_idle_work(srv, client, attempt):
            break
    else:
        pytest.fail(f"in {ATTEMPTS} tries, another chat's request never arrived during idle work")
    for attempt in range(ATTEMPTS):
        if _its_next_turn_during_idle_work(srv, client, attempt):
            break
    else:
        pytest.fail(f"in {ATTEMPTS} tries, the next turn never arrived while its prefix was "
                    "prefilled")


ATTEMPTS = 5  # fresh chats each half above tries (one missed the window about 1 in 8 here)
OPENINGS = ["class Heap:", "class Trie:", "class Deque:", "class Graph:", "class Matrix:"]


def _another_chat_during_idle_work(srv, client, attempt: int) -> bool:
    """True when the other chat's request found the idle work midway (and the
    events were in order); False when the work was done before it came."""
    since = len(srv.text().splitlines())
    messages = [{"role": "system", "content": f"Chat {attempt}."}] * bool(attempt) + LONG_MESSAGES
    long = client.chat.completions.create(model="m", messages=messages, max_tokens=400,
                                          temperature=0)
    assert long.usage.completion_tokens >= 100
    assert srv.wait_for_log("next turn: prefilling", 1 + _count(srv, "next turn: prefilling",
                                                                since))
    other = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"def other{attempt}(x):"}],
        max_tokens=8, temperature=0)
    assert other.choices[0].message.content
    assert srv.wait_for_log("is prefilled and stored", 1 + _count(srv, "is prefilled and stored",
                                                                  since))
    lines = _lines(srv, since)
    began = next(i for i, line in enumerate(lines) if "next turn: prefilling" in line)
    served = next(i for i, line in enumerate(lines)
                  if "POST /v1/chat/completions" in line and i > began)
    stored = next(i for i, line in enumerate(lines)
                  if "is prefilled and stored" in line and i > began)
    paused = [i for i, line in enumerate(lines) if "waits at" in line and i > began]
    if not paused:
        assert stored < served  # (the work was done before the request came)
        return False
    done, total = map(int, re.search(r"waits at (\d+) of (\d+)", lines[paused[0]]).groups())
    assert 0 < done < total  # (paused midway: the request did not wait for the rest)
    assert paused[0] < served < stored, (paused[0], served, stored)
    assert any("tokens prefilled in" in line for line in lines[served:stored])  # (went on)
    return True


def _its_next_turn_during_idle_work(srv, client, attempt: int) -> bool:
    """True when the chat's own next turn, sent while that turn's prefix is
    prefilled, stopped the work there (the request prefills the rest with
    its message) and started from what idle time prefilled; False when the
    prefix was done before it came."""
    since = len(srv.text().splitlines())
    first = [{"role": "user", "content": OPENINGS[attempt]}]
    r1 = client.chat.completions.create(model="m", messages=first, max_tokens=200,
                                        temperature=0)
    assert srv.wait_for_log("next turn: prefilling", 1 + _count(srv, "next turn: prefilling",
                                                                since))
    r2 = client.chat.completions.create(model="m", temperature=0, max_tokens=4, messages=first + [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "class Deque:"}])
    lines = _lines(srv, since)
    paused = [line for line in lines if "paused at" in line]
    if not paused:
        assert any("is prefilled and stored" in line for line in lines)
        return False
    done = int(re.search(r"paused at (\d+) of", paused[-1]).group(1))
    assert r2.usage.prompt_tokens_details.cached_tokens >= done > r1.usage.prompt_tokens
    return True


@pytest.mark.slow  # (a server of its own; the default tier: the batch's rows with context
# runs against mlx_lm, tests/test_context_draft.py)
def test_context_drafts_keep_each_turn_a_cold_prefill(cold, tmp_path):
    """--context-drafts: every row's index holds its whole conversation (the
    prefix cache's tokens and the new ones), and its runs are drafted beside
    the head's; each turn of a three-turn conversation whose last turn asks
    for an earlier answer again is still the cold prefill's answer (up to
    ties), and the server reports the runs it drafted (usage.mtp)."""
    run, tok = cold
    s = Server(["mlx_mtp.server", "--context-drafts"], tmp_path / "server.log")
    try:
        client = s.openai(timeout=300)
        messages, drafted = [{"role": "system", "content": SYSTEM}], 0
        for ask in ("def fibonacci(n):", "def factorial(n):",
                    "Write def fibonacci(n): again, exactly as before."):
            messages.append({"role": "user", "content": ask})
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=80,
                                               temperature=0)
            text = r.choices[0].message.content or ""
            equal_up_to_ties(text, *run(messages, 80), tok)
            drafted += (r.usage.model_extra or {}).get("mtp", {}).get("context_drafted", 0)
            messages.append({"role": "assistant", "content": text})
    finally:
        s.close()
    assert drafted > 0
