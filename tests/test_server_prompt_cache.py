"""The server's prefix cache across turns and restarts (real processes, the
official clients): a turn that extends the previous one finds its prompt
and its answer cached, though the chat template re-tokenizes the answer;
with --prompt-cache-dir a restarted server prefills only the new tokens and
answers bit for bit as a warm RAM cache and no cache do; bad files cost a
log line and a cold prefill, never an error; the folder keeps its cap and
the server its memory under many requests. Usage reports the hits in both
APIs, streamed or not."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from mlx_mtp.loader import demo_model_path  # noqa: E402
from serving import Server, greedy_until_eos, rss  # noqa: E402

DEMO = str(demo_model_path())
# the demo answers this with code whose indentation it writes as one token
# ('\n   ') where the chat template's tokenizer writes two ('\n', '   ')
SYSTEM = {"role": "system", "content": "You are a terse Python assistant."}
FIRST = [SYSTEM, {"role": "user", "content": "def read_config(path):"}]
NEXT = {"role": "user", "content": "def write_config(path, data):"}
NEXT_TURN_STORED = "next turn: its prefix of"  # (the server's log line)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    s = Server(["mlx_mtp.server", "--prompt-cache-dir", str(folder / "cache")],
               folder / "server.log")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def demo_reference():
    """(mlx_lm model, tokenizer) of the demo, in this process: plain greedy, no cache."""
    import mlx_lm

    return mlx_lm.load(DEMO)


def greedy(server, messages, max_tokens, **fields):
    """A chat request at temperature 0: (ids, logprobs, text, usage)."""
    r = requests.post(server.url + "/v1/chat/completions", timeout=300, json=dict(
        messages=messages, max_tokens=max_tokens, temperature=0, logprobs=True, **fields))
    assert r.status_code == 200, r.text
    body = r.json()
    content = body["choices"][0]["logprobs"]["content"]
    return ([t["id"] for t in content], [t["logprob"] for t in content],
            body["choices"][0]["message"]["content"], body["usage"])


def folder_bytes(folder) -> int:
    total = 0
    for p in folder.iterdir():
        try:
            total += p.stat().st_size
        except FileNotFoundError:  # (removed meanwhile)
            pass
    return total


def cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


# -- item 0: the answer re-used --------------------------------------------------------------
def test_the_next_turn_finds_the_prompt_and_the_answer_cached(demo, demo_reference):
    """OpenAI client: turn 2 finds turn 1's prompt and answer in the cache
    (at least all but the last 4 tokens) though the template re-tokenizes
    the answer, and answers as a cold prefill of its messages does."""
    model, tok = demo_reference
    client = demo.openai(timeout=300)
    first = client.chat.completions.create(model="m", messages=FIRST, max_tokens=100,
                                           temperature=0)
    answer = first.choices[0].message.content
    messages = FIRST + [{"role": "assistant", "content": answer}, NEXT]
    prompt1 = tok.apply_chat_template(FIRST, add_generation_prompt=True)
    prompt2 = tok.apply_chat_template(messages, add_generation_prompt=True)
    stored = demo.text().count(NEXT_TURN_STORED)
    ids1 = greedy(demo, FIRST, 100)[0]  # (the same answer, its ids: a RAM hit)
    assert tok.decode(ids1[:-1]) == answer and first.usage.completion_tokens == len(ids1)
    # the next turn's prefix is prefilled in idle time (an agent runs its tool meanwhile)
    assert demo.wait_for_log(NEXT_TURN_STORED, stored + 1)
    # the seam: the ids generated are not what the template writes for them
    assert prompt2[:len(prompt1) + len(ids1)] != prompt1 + ids1
    second = client.chat.completions.create(model="m", messages=messages, max_tokens=30,
                                            temperature=0, logprobs=True)
    got = second.usage.prompt_tokens_details.cached_tokens
    assert got >= first.usage.prompt_tokens + first.usage.completion_tokens - 4
    assert second.usage.prompt_tokens == len(prompt2) and got < len(prompt2)
    ids = [t.model_extra["id"] for t in second.choices[0].logprobs.content]  # (ours: "id")
    want = greedy_until_eos(model, prompt2, 30, set(tok.eos_token_ids))
    assert ids == want
    assert second.choices[0].message.content == tok.decode(
        [t for t in want if t not in tok.eos_token_ids])


def test_anthropic_usage_counts_cache_reads_and_writes(demo, demo_reference):
    """Anthropic client, streamed and not: the next turn's cache read covers
    the first turn's prompt and answer; input + read + created is the
    prompt; message_start and message_delta both carry them."""
    model, tok = demo_reference
    client = anthropic.Anthropic(base_url=demo.url, api_key="none", max_retries=0, timeout=300)
    msgs = [{"role": "user", "content": "class LRUCache:"}]
    system = SYSTEM["content"]
    stored = demo.text().count(NEXT_TURN_STORED)
    r1 = client.messages.create(model="m", max_tokens=80, system=system, messages=msgs)
    assert demo.wait_for_log(NEXT_TURN_STORED, stored + 1)  # (idle time before turn 2)
    u1 = r1.usage
    total1 = u1.input_tokens + u1.cache_read_input_tokens + u1.cache_creation_input_tokens
    chat1 = [SYSTEM] + msgs
    assert total1 == len(tok.apply_chat_template(chat1, add_generation_prompt=True))
    assert u1.cache_creation_input_tokens > 0 and u1.input_tokens == 1
    msgs2 = msgs + [{"role": "assistant", "content": r1.content[0].text},
                    {"role": "user", "content": "class Queue:"}]
    prompt2 = tok.apply_chat_template([SYSTEM] + msgs2, add_generation_prompt=True)
    want = greedy_until_eos(model, prompt2, 24, set(tok.eos_token_ids))
    want_text = tok.decode([t for t in want if t not in tok.eos_token_ids])
    events = []
    with client.messages.stream(model="m", max_tokens=24, system=system, messages=msgs2) as s:
        for event in s:
            events.append(event)
        final = s.get_final_message()
    start = next(e for e in events if e.type == "message_start").message.usage
    delta = next(e for e in events if e.type == "message_delta").usage
    assert start.cache_read_input_tokens >= total1 + u1.output_tokens - 4
    for u in (start, delta, final.usage):
        assert (u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens
                == len(prompt2))
        assert u.cache_read_input_tokens == start.cache_read_input_tokens
    assert final.content[0].text == want_text
    again = client.messages.create(model="m", max_tokens=24, system=system, messages=msgs2)
    assert again.content[0].text == want_text
    # the same prompt again: all but its last token read, nothing new stored
    assert again.usage.cache_read_input_tokens == len(prompt2) - 1
    assert (again.usage.cache_creation_input_tokens, again.usage.input_tokens) == (0, 1)


def test_openai_stream_usage_counts_cached_tokens(demo):
    messages = [{"role": "user", "content": "def parse_args(argv):"}]
    body = dict(messages=messages, max_tokens=8, temperature=0, stream=True,
                stream_options={"include_usage": True})
    usages = []
    for _ in range(2):
        chunks = [json.loads(line[6:]) for line in requests.post(
            demo.url + "/v1/chat/completions", json=body, stream=True, timeout=300).iter_lines(
            decode_unicode=True) if line.startswith("data: {")]
        usages.append(chunks[-1]["usage"])
    assert cached(usages[1]) == usages[1]["prompt_tokens"] - 1 > cached(usages[0])


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_an_agents_tool_loop_finds_its_history_cached(tmp_path):
    """An agent's turn: a (forced) tool call, then the tool's result sent
    back once the tool ran (the server's idle time: the next turn's prefix
    is stored by then). OpenAI without thinking: the result's turn finds the
    call's prompt and answer cached (all but 4 tokens at most), however the
    template writes the call's JSON. Anthropic with thinking (Claude Code's
    way: the thinking and tool_use blocks sent back, the template dropping
    the reasoning): only the tool result's message is prefilled. Both answer
    as a cold prefill does."""
    from mlx_mtp.testing.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path / "ck", tools="json", thinking=True, seed=7)
    s = Server(["mlx_mtp.server", "--model", str(path)], tmp_path / "server.log")
    try:
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        r1 = requests.post(s.url + "/v1/chat/completions", timeout=300, json=dict(
            messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120, temperature=0,
            **off)).json()
        call = r1["choices"][0]["message"]["tool_calls"][0]
        assert s.wait_for_log(NEXT_TURN_STORED, 1)  # (the tool runs)
        messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        ids, _, _, usage = greedy(s, messages, 12, tools=TOOLS, **off)
        assert cached(usage) >= (r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"]
                                 - 4)
        client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0,
                                     timeout=300)
        tools = [{"name": "get_weather", "input_schema": WEATHER}]
        thinking = {"type": "enabled", "budget_tokens": 16}
        a1 = client.messages.create(model="m", max_tokens=120, messages=ASK, tools=tools,
                                    tool_choice={"type": "any"}, thinking=thinking)
        use = next(b for b in a1.content if b.type == "tool_use")
        assert s.wait_for_log(NEXT_TURN_STORED, 3)  # (the tool runs)
        assert any(b.type == "thinking" for b in a1.content)
        history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in a1.content]},
                         {"role": "user", "content": [{"type": "tool_result",
                                                       "tool_use_id": use.id,
                                                       "content": "sunny"}]}]
        a2 = client.messages.create(model="m", max_tokens=12, messages=history, tools=tools,
                                    thinking=thinking)
    finally:
        s.close()
    fresh = Server(["mlx_mtp.server", "--model", str(path)], tmp_path / "fresh.log")
    try:  # the same request on an empty cache: a cold prefill
        cold = anthropic.Anthropic(base_url=fresh.url, api_key="none", max_retries=0,
                                   timeout=300).messages.create(
            model="m", max_tokens=12, messages=history, tools=tools, thinking=thinking)
    finally:
        fresh.close()
    assert cold.usage.cache_read_input_tokens == 0
    assert [b.model_dump() for b in a2.content] == [b.model_dump() for b in cold.content]
    import mlx_mtp

    model, tok = mlx_mtp.load(path, quiet=True)
    call["function"]["arguments"] = json.loads(call["function"]["arguments"])  # (as mlx_lm's)
    prompt = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                     enable_thinking=False)
    assert usage["prompt_tokens"] == len(prompt)
    assert ids == greedy_until_eos(model, prompt, 12, set(tok.eos_token_ids))
    # Anthropic: what is prefilled is the tool result's message, from its <|im_start|> on
    chat = ASK + [{"role": "assistant", "content": "", "tool_calls": [{
        "type": "function", "function": {"name": use.name, "arguments": use.input}}]},
        {"role": "tool", "content": "sunny"}]
    text = tok.apply_chat_template(chat, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=False)
    tail = text[text.rindex("<|im_start|>user\n<tool_response>") + len("<|im_start|>"):]
    u = a2.usage
    assert u.input_tokens + u.cache_creation_input_tokens == len(tok.encode(tail))


# -- items 1 and 2: the disk tier across restarts --------------------------------------------
CHECKPOINTS = ["dense", pytest.param("q4", marks=pytest.mark.slow),
               pytest.param("moe", marks=pytest.mark.slow),
               pytest.param("next", marks=pytest.mark.slow),
               pytest.param("qwen4_exp", marks=pytest.mark.slow)]


@pytest.fixture
def checkpoint(request, tmp_path_factory):
    name = request.param
    if name in ("dense", "q4", "moe"):
        return request.getfixturevalue(f"{name}_ckpt")
    from mlx_mtp.testing.synthetic import write_checkpoint, write_qwen4_exp_checkpoint

    folder = tmp_path_factory.mktemp(name)
    if name == "next":
        return write_checkpoint(folder, family="qwen3_next", seed=4)
    return write_qwen4_exp_checkpoint(folder, seed=12)


TURN1 = [{"role": "system", "content": "Answer in Python."},
         {"role": "user", "content": "def fibonacci(n):"}]


def _two_turns(checkpoint, tmp_path):
    """A server with a --prompt-cache-dir (depth 2) answers turn 1 (12
    tokens) and turn 2 (16, from the RAM cache), then stops: (its argv,
    turn 2's messages, turn 2's `greedy`)."""
    argv = ["mlx_mtp.server", "--model", str(checkpoint), "--prompt-cache-dir",
            str(tmp_path / "cache"), "--draft-tokens", "2"]
    s = Server(argv, tmp_path / "before.log")
    try:
        text = greedy(s, TURN1, 12)[2]
        assert s.wait_for_log(NEXT_TURN_STORED, 1)  # (idle time before turn 2)
        messages = TURN1 + [{"role": "assistant", "content": text},
                            {"role": "user", "content": "and in C?"}]
        warm = greedy(s, messages, 16)
        assert s.wait_for_log(NEXT_TURN_STORED, 2)  # (and before the stop)
    finally:
        s.close()
    assert s.code == 0
    return argv, messages, warm


def _cold(checkpoint, messages, max_tokens):
    """Plain greedy decoding's ids of the messages (mlx_lm's generate_step),
    in this process, no cache."""
    import mlx_mtp

    model, tok = mlx_mtp.load(checkpoint, quiet=True)  # (mlx_lm has no qwen4_exp)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    return greedy_until_eos(model, prompt, max_tokens, set(tok.eos_token_ids))


@pytest.mark.parametrize("checkpoint", CHECKPOINTS, indirect=True)
def test_a_restarted_server_prefills_only_the_new_tokens(checkpoint, tmp_path):
    """Turn 2 after a restart: the stored prefix is read from disk (usage
    says how many tokens), and the tokens are those of the warm RAM cache
    before the restart (their logprobs bit for bit) and of plain greedy
    decoding without a cache, at MTP depths 0 to 3."""
    argv, messages, warm = _two_turns(checkpoint, tmp_path)
    assert cached(warm[3]) > len(TURN1)  # (the RAM hit: the first turn's prompt and more)
    s = Server(argv, tmp_path / "after.log")
    try:
        after = [greedy(s, messages, 16, num_draft_tokens=k) for k in (2, 0, 1, 3)]
    finally:
        s.close()
    assert s.code == 0
    assert f"prompt cache: {cached(warm[3])} tokens restored from " in s.text()
    assert cached(after[0][3]) == cached(warm[3])  # only the new tokens prefilled
    assert after[0][:2] == warm[:2]  # the same state: the same logprobs, bit for bit
    assert [ids for ids, *_ in after] == [_cold(checkpoint, messages, 16)] * 4


def test_bad_files_cost_a_log_line_and_a_cold_prefill(dense_ckpt, tmp_path):
    """After a first server wrote its entries: a truncated one, a corrupt
    one (a flipped data byte), another model's under this model's name, and
    another model's own: the restarted server logs one line for each bad one
    (removing it; the corrupt one when a lookup reads it), leaves the other
    model's alone, and answers as a cold prefill does."""
    argv, messages, warm = _two_turns(dense_ckpt, tmp_path)
    folder = tmp_path / "cache"
    # the system prompt's end, and the next-turn prefixes of turns 1 and 2
    system, middle, longest = sorted(folder.iterdir(), key=lambda p: p.stat().st_size)
    data = bytearray(longest.read_bytes())
    data[-64] ^= 0x01
    longest.write_bytes(bytes(data))
    system.write_bytes(system.read_bytes()[:-100])
    data = middle.read_bytes()
    model_id = json.loads(data[8:8 + int.from_bytes(data[:8], "little")])[
        "__metadata__"]["0.model"]
    middle.write_bytes(data.replace(model_id.encode(), b"0" * len(model_id)))  # foreign
    theirs = folder / f"{'0' * 16}-{'1' * 32}.safetensors"
    theirs.write_bytes(data)
    s = Server(argv, tmp_path / "after.log")
    try:
        cold = greedy(s, messages, 16)
        # (the corrupt one is read by the lookup of this answer's next turn, in idle time)
        s.wait_for_log("is skipped and removed", 3, timeout=30)
    finally:
        s.close()
    lines = [line for line in s.text().splitlines() if "is skipped and removed" in line]
    assert sorted(line.split("prompt cache: ")[1].split()[0] for line in lines) == sorted(
        p.name for p in (system, middle, longest)), lines
    assert theirs.exists()  # (this model's entries were written again: whole)
    assert cached(cold[3]) == 0 and cold[0] == warm[0] == _cold(dense_ckpt, messages, 16)


@pytest.mark.parametrize("requests_", [30, pytest.param(200, marks=pytest.mark.slow)])
def test_the_folder_keeps_its_cap_and_the_server_its_memory(tmp_path, requests_):
    """Many requests (4 at a time), each storing entries: the folder never
    holds more than its cap, and the server's memory after the last two
    thirds of them is what it was after the first third."""
    folder = tmp_path / "cache"
    cap = 3 << 20  # (a demo entry: 0.5 to 1 MB)
    s = Server(["mlx_mtp.server", "--prompt-cache-dir", str(folder),
                "--prompt-cache-disk-bytes", str(cap)], tmp_path / "server.log")
    sizes = []

    def ask(i):
        greedy(s, [{"role": "user", "content": f"def f{i}(x, y):"}], 3)
        sizes.append(folder_bytes(folder))

    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(ask, range(requests_ // 3)))
            before = rss(s.proc.pid)
            list(pool.map(ask, range(requests_ // 3, requests_)))
        grown = rss(s.proc.pid) - before
    finally:
        s.close()
    assert s.code == 0
    assert max(sizes) <= cap and folder_bytes(folder) <= cap
    assert len(list(folder.iterdir())) >= 2
    assert grown < 48 << 20, f"{grown / 2**20:.1f} MiB more after the last two thirds"


# -- a conversation's branch point survives a restart -----------------------------------------
# a file the demo reads (~200 tokens) and questions about it
FILE = "\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(15))
ASK_FILE = [SYSTEM, {"role": "user", "content": f"{FILE}\nWhat does f7 return?"}]


def test_a_branch_point_is_on_disk_though_its_next_turn_came_at_once(tmp_path, demo_reference):
    """Turn 1 (a file and a question), turn 2 sent as soon as turn 1's
    answer is read (it starts from turn 1's state in RAM, before idle time
    stored its next-turn prefix: --idle-chunk-ms 1 makes that work slow),
    a graceful stop; after the restart, another follow-up of turn 1 (a
    retry, an edited question, a sub-agent) reads >= 90% of its prompt from
    disk: the state after turn 1's answer, which turn 2 passed through. Its
    answer is a cold prefill's."""
    model, tok = demo_reference
    argv = ["mlx_mtp.server", "--prompt-cache-dir", str(tmp_path / "cache"),
            "--idle-chunk-ms", "1"]
    s = Server(argv, tmp_path / "before.log")
    try:
        answer = greedy(s, ASK_FILE, 24)[2]
        history = ASK_FILE + [{"role": "assistant", "content": answer}]
        turn2 = greedy(s, history + [{"role": "user", "content": "And f8?"}], 8)
        # the premise: turn 2 started from turn 1's state in RAM, before the
        # branch point (had idle time stored the next-turn prefix first, it
        # would start there, and that prefix goes to disk on its own)
        assert len(tok.apply_chat_template(ASK_FILE, add_generation_prompt=True)) - 1 \
            <= cached(turn2[3]) < len(next_turn_prefix(tok, history)), (turn2[3], s.text())
    finally:
        s.close()
    assert s.code == 0
    other = history + [{"role": "user", "content": "Which one returns x + 9?"}]
    s = Server(argv, tmp_path / "after.log")
    try:
        ids, _, _, usage = greedy(s, other, 12)
    finally:
        s.close()
    prompt = tok.apply_chat_template(other, add_generation_prompt=True)
    assert usage["prompt_tokens"] == len(prompt)
    assert cached(usage) >= 0.9 * len(prompt), (usage, s.text()[-3000:])
    assert ids == greedy_until_eos(model, prompt, 12, set(tok.eos_token_ids))


def next_turn_prefix(tok, history) -> list:
    """The server's next-turn prefix of `history` (the tokens every next
    user message starts with), as generation.next_turn_prefix cuts it."""
    from types import SimpleNamespace

    from mlx_mtp.server.generation import MTPResponseGenerator
    from mlx_mtp.server.lane import NEXT_TURN_TEXTS

    a, b = (tok.apply_chat_template(history + [{"role": "user", "content": t}],
                                    add_generation_prompt=True) for t in NEXT_TURN_TEXTS)
    gen = SimpleNamespace(model_provider=SimpleNamespace(
        marker_ids=frozenset(tok.added_tokens_decoder)))
    return MTPResponseGenerator.next_turn_prefix(gen, a, b)


# Qwen3's rule in a few lines: an answer keeps its reasoning only after the
# last user query (`last_query_index`), decided on the whole conversation
QWEN3_REASONING_TEMPLATE = (
    "{%- set ns = namespace(multi=true, last=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi and m.role == 'user' and not m.content.startswith('<tool_response>') %}"
    "{%- set ns.multi = false %}{%- set ns.last = index %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last and m.reasoning_content %}"
    "{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{ m.content }}{%- for c in m.tool_calls or [] %}"
    "{{ '\n<tool_call>' + c.function.name + '</tool_call>' }}{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)


def test_the_branch_point_and_the_shared_head_are_what_other_requests_share(demo_reference):
    """prompt_points on the demo's template: the branch point of a turn is a
    prefix of every other follow-up of its answer; the shared head of a first
    request (reminder blocks, then the user's text) is a prefix of every
    other first request with those blocks, whatever its text begins with
    (BPE merges a block's last '>' with a '\\n' or '.' after it)."""
    from mlx_mtp.server import prompt_points as pp

    _, tok = demo_reference
    markers = [t.content for t in tok.added_tokens_decoder.values()]

    def points(messages, head=None, **template):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, **template)
        return prompt, pp.extra_points(
            lambda text: tok.encode(text, add_special_tokens=False),
            lambda m, g: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g,
                                                 **template),
            markers, messages, prompt, head)

    history = ASK_FILE + [{"role": "assistant", "content": "It returns x + 7.\n   Done."}]
    prompt, found = points(history + [{"role": "user", "content": "And f8?"}])
    (at, kind), = found.items()
    assert kind == "branch" and at > len(tok.apply_chat_template(ASK_FILE))
    for ask in ("\nAnd f9?", ". f9", "f9"):
        assert tok.apply_chat_template(history + [{"role": "user", "content": ask}],
                                       add_generation_prompt=True)[:at] == prompt[:at]
    # the one cut, after the last marker before the next message: the next-turn prefix's
    assert prompt[:at] == next_turn_prefix(tok, history)
    # Claude Code's shape on a Qwen3-style template: the answer's reasoning
    # is dropped because a user message follows its tool's result
    qwen3 = dict(chat_template=QWEN3_REASONING_TEMPLATE)
    called = ASK_FILE + [{"role": "assistant", "content": "", "reasoning_content": "Read it.",
                          "tool_calls": [{"function": {"name": "Read", "arguments": "{}"}}]}]
    after = [{"role": "tool", "content": FILE},
             {"role": "user", "content": "<system-reminder>\nThe date changed.</system-reminder>"}]
    prompt, found = points(called + after, **qwen3)
    (at, kind), = found.items()
    assert kind == "branch" and at > len(tok.apply_chat_template(ASK_FILE, **qwen3))
    for other in ([{"role": "tool", "content": "no such file"}, after[1]],
                  [{"role": "tool", "content": FILE}, {"role": "user", "content": "Stop."}]):
        assert tok.apply_chat_template(called + other, add_generation_prompt=True,
                                       **qwen3)[:at] == prompt[:at]
    blocks = [{"type": "text", "text": f"<system-reminder>\n{FILE}</system-reminder>"}] * 3
    opening = [SYSTEM, {"role": "user", "content": blocks + [{"type": "text", "text": "hi"}]}]
    head = pp.opening_head(opening)
    joined = [SYSTEM, {"role": "user", "content": "".join(b["text"] for b in
                                                          opening[1]["content"])}]
    prompt, found = points(joined, head)
    (at, kind), = found.items()
    assert kind == "head" and len(prompt) - 12 < at < len(prompt)
    for ask in ("\nhello", ". x", " there", "hello", "\n\n"):
        other = [SYSTEM, {"role": "user", "content": head[1] + ask}]
        assert tok.apply_chat_template(other, add_generation_prompt=True)[:at] == prompt[:at]
    assert pp.opening_head(opening + [{"role": "assistant", "content": "hi"}]) is None
