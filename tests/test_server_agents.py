"""What agents send today, answered as they expect (issue: "The agents people
run work unchanged"): Anthropic system messages inside `messages` (Claude
Code's), its per-session billing line, context errors in the words clients
parse, OpenAI's `n`, unknown fields, `GET /v1/models/{id}`, and the
Responses API (Codex CLI, the Agents SDK). The server runs the demo model
with a chat template that takes a system message only first, as Qwen3.5 /
3.6's do (testing.synthetic.FIRST_SYSTEM_TEMPLATE). The real clients
themselves run in tests/test_real_clients.py (slow tier)."""

import json
import re
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from serving import Server, chat_text  # noqa: E402

from mlx_mtp.server import anthropic as am  # noqa: E402
from mlx_mtp.server import responses as rs  # noqa: E402
from mlx_mtp.server.roles import late_system_role, place_system  # noqa: E402
from mlx_mtp.testing.synthetic import CHAT_TEMPLATE, FIRST_SYSTEM_TEMPLATE  # noqa: E402

SERVED = "mlx-mtp-demo"
LIMIT = 4096  # --max-tokens-limit: the demo's whole context
CONTEXT = 4096
# Claude Code 2.1.332's own patterns for the two context errors (it compacts
# on the first, asks again with a smaller max_tokens on the second) and for
# max_tokens past a model's limit (it lowers max_tokens to the number named)
PROMPT_TOO_LONG = re.compile(r"^prompt is too long: \d+ tokens > \d+ maximum$")
CONTEXT_LIMIT = re.compile(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) "
                           r"> (\d+)")
MAX_TOKENS = re.compile(r"^max_tokens: \d+ > (\d+), which is the maximum allowed number of "
                        r"output tokens for .+$")
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{}; cc_entrypoint=sdk-cli;"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(["mlx_mtp.server", "--chat-template", FIRST_SYSTEM_TEMPLATE,
                "--max-tokens-limit", str(LIMIT)], tmp_path_factory.mktemp("agents") / "log")
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def tok():
    from mlx_lm.tokenizer_utils import load

    import mlx_mtp.demo

    return load(Path(mlx_mtp.demo.__file__).parent, {"chat_template": FIRST_SYSTEM_TEMPLATE})


def rendered(tok, messages, tools=None) -> list:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)


def post(srv, path, body, **kw):
    return requests.post(srv.url + path, json=body, timeout=120, **kw)


# -- system messages anywhere ------------------------------------------------------------------
def test_late_system_role_follows_what_the_template_renders():
    """The probe: a template that takes a system message anywhere gets it as
    sent (the demo's, Qwen3's; the test tool template, which renders only the
    first, as mlx_lm.server would); one that refuses (Qwen3.5's rule) makes
    it a user turn."""
    from mlx_lm.tokenizer_utils import load

    import mlx_mtp.demo
    from mlx_mtp.testing.synthetic import tool_chat_template

    path = Path(mlx_mtp.demo.__file__).parent
    assert late_system_role(load(path)) == "system"
    assert late_system_role(load(path, {"chat_template": CHAT_TEMPLATE})) == "system"
    assert late_system_role(load(path, {"chat_template": FIRST_SYSTEM_TEMPLATE})) == "user"
    assert late_system_role(load(path, {"chat_template": tool_chat_template("json")})) == "system"


def test_place_system_joins_the_leading_ones_and_keeps_later_ones_in_place():
    msgs = [{"role": "system", "content": "a"}, {"role": "developer", "content": [
        {"type": "text", "text": "b"}]}, {"role": "user", "content": "q"},
        {"role": "system", "content": ""}, {"role": "system", "content": "c"},
        {"role": "assistant", "content": "r"}]
    assert place_system(msgs, "user") == [
        {"role": "system", "content": "a\n\nb"}, {"role": "user", "content": "q"},
        {"role": "user", "content": "c"}, {"role": "assistant", "content": "r"}]
    assert place_system(msgs, "system") is msgs  # (as sent: mlx_lm.server's rendering)
    one = [{"role": "system", "content": ""}, {"role": "user", "content": "q"}]
    assert place_system(one, "user") is one  # (one system message, first: as sent)


MINIMAL = {"model": "x", "max_tokens": 8, "messages": [
    {"role": "user", "content": "def add(a, b):"}, {"role": "system", "content": "Be brief."}]}
SYSTEM_SHAPES = {  # body, the chat it is rendered as under a first-system-only template
    "minimal": (MINIMAL, [{"role": "user", "content": "def add(a, b):"},
                          {"role": "user", "content": "Be brief."}]),
    "blocks": ({"model": "x", "max_tokens": 8, "system": "S", "messages": [
        {"role": "system", "content": [{"type": "text", "text": "first"}]},
        {"role": "user", "content": "def f():"},
        {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": {
            "type": "ephemeral"}}]}]},
        [{"role": "system", "content": "S\n\nfirst"}, {"role": "user", "content": "def f():"},
         {"role": "user", "content": "env"}]),
    # Claude Code 2.1.332 --bare: an empty system message carrying output_config
    "bare": ({"model": "x", "max_tokens": 8, "messages": [
        {"role": "user", "content": "def f():"},
        {"role": "system", "content": [], "output_config": {"effort": "low"}}]},
        [{"role": "user", "content": "def f():"}]),
}


@pytest.mark.parametrize("shape", SYSTEM_SHAPES)
def test_system_messages_inside_messages_are_served_and_counted(srv, tok, shape):
    body, chat = SYSTEM_SHAPES[shape]
    want = rendered(tok, chat)
    r = post(srv, "/v1/messages", body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert sum(usage[k] for k in ("input_tokens", "cache_read_input_tokens",
                                  "cache_creation_input_tokens")) == len(want)
    # count_tokens takes the same body (max_tokens and stream included)
    count = post(srv, "/v1/messages/count_tokens", dict(body, stream=True, max_tokens=128000))
    assert count.status_code == 200 and count.json() == {"input_tokens": len(want)}, count.text
    # the answer is the chat path's for the placed messages (greedy)
    text = "".join(b["text"] for b in r.json()["content"] if b["type"] == "text")
    assert text == chat_text(srv, dict(messages=chat, max_tokens=8))[0]
    with requests.post(srv.url + "/v1/messages", json=dict(body, stream=True), stream=True,
                       timeout=120) as s:
        assert s.status_code == 200
        events = [line[7:] for line in s.iter_lines(decode_unicode=True)
                  if line.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "message_stop", events


def test_openai_late_system_and_developer_messages_follow_the_same_rule(srv, tok):
    msgs = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "def f():"},
            {"role": "system", "content": "Use tabs."}]
    r = srv.openai(timeout=120).chat.completions.create(model="m", messages=msgs, max_tokens=4)
    assert r.usage.prompt_tokens == len(rendered(tok, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"},
        {"role": "user", "content": "Use tabs."}]))


def test_the_billing_line_is_left_out_so_a_new_session_reads_the_shared_prefix(srv, tok):
    """Claude Code's first system block changes with every session: left out
    of the prompt, a second session's first request reads the first one's
    system prompt from the cache (issue: >= 90% of the prefix they share)."""
    system = "You are a careful coding agent. " * 60

    def session(tag, ask):
        return {"model": "claude-opus-5-5", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": ask}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment " + tag}]}],
            "system": [{"type": "text", "text": BILLING.format(tag)},
                       {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}]}

    first, second = session("0b8", "def add(a, b):"), session("1c9", "class Stack:")
    chats = [am.to_chat(b)[0] for b in (first, second)]
    assert all(BILLING[:20] not in json.dumps(c) for c in chats)
    prompts = [rendered(tok, place_system(c, "user")) for c in chats]
    shared = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)
    assert post(srv, "/v1/messages", first).status_code == 200
    usage = post(srv, "/v1/messages", second).json()["usage"]
    assert usage["cache_read_input_tokens"] >= 0.9 * shared, (usage, shared)
    assert sum(usage.values()) - usage["output_tokens"] == len(prompts[1])



# Claude Code's first user message: reminder blocks (environment, tools, skills, date), each
# its own text block, then the user's text
REMINDERS = [f"<system-reminder>\n{what}: " + " ".join(f"{what}-{i}" for i in range(12))
             + "\n</system-reminder>" for what in ("environment", "tools", "agents", "skills",
                                                    "memory", "todos", "git", "date")]


def test_a_new_session_reads_the_reminders_it_shares_from_the_cache(srv, tok):
    """A second session whose first request shares the system prompt and the
    reminder blocks at the head of its first user message (not the user's
    text, nor the billing line) reads >= 97% of its prompt from the cache:
    a snapshot at the last block's end but one, not only at message ends."""
    def session(tag, ask):
        return {"model": "claude-opus-5-5", "max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "text", "text": r} for r in REMINDERS]
             + [{"type": "text", "text": ask}]}],
            "system": [{"type": "text", "text": BILLING.format(tag)},
                       {"type": "text", "text": "You are an agent for software work. " * 12}]}

    first, second = session("2d4", "Say hi"), session("3e5", "def fibonacci(n):")
    assert post(srv, "/v1/messages", first).status_code == 200
    usage = post(srv, "/v1/messages", second).json()["usage"]
    messages = am.to_chat(second)[0]
    messages[1]["content"] = "".join(b["text"] for b in messages[1]["content"])  # (mlx_lm's join)
    prompt = rendered(tok, messages)
    assert sum(usage.values()) - usage["output_tokens"] == len(prompt)
    assert usage["cache_read_input_tokens"] >= 0.97 * len(prompt), (usage, len(prompt))

# -- context errors in the words clients parse -------------------------------------------------
def test_context_errors_are_anthropics_and_openais_own(srv, tok):
    long = "def f(x):\n    return x + 1\n" * 400  # (~5K tokens: tokenized, not refused by size)
    a = post(srv, "/v1/messages", {"model": "x", "max_tokens": 8, "messages": [
        {"role": "user", "content": long}]})
    assert a.status_code == 400 and a.json()["error"]["type"] == "invalid_request_error"
    n = len(rendered(tok, [{"role": "user", "content": long}]))
    assert PROMPT_TOO_LONG.match(a.json()["error"]["message"]), a.text
    assert a.json()["error"]["message"] == f"prompt is too long: {n} tokens > {CONTEXT} maximum"
    short = [{"role": "user", "content": "def f():"}]
    p = len(rendered(tok, short))
    b = post(srv, "/v1/messages", {"model": "x", "max_tokens": LIMIT, "messages": short})
    assert b.status_code == 400
    assert CONTEXT_LIMIT.search(b.json()["error"]["message"]).groups() == (
        str(p), str(LIMIT), str(CONTEXT)), b.text
    c = post(srv, "/v1/messages", {"model": "x", "max_tokens": 128000, "messages": short})
    assert MAX_TOKENS.match(c.json()["error"]["message"]).group(1) == str(LIMIT), c.text
    with pytest.raises(openai.BadRequestError) as e:
        srv.openai(timeout=60).chat.completions.create(model="m", messages=short,
                                                       max_tokens=LIMIT)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    assert e.value.body["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
        f"{p + LIMIT} tokens ({p} in the messages, {LIMIT} in the completion). Please reduce "
        "the length of the messages or completion.")


# -- the OpenAI surface ------------------------------------------------------------------------
@pytest.mark.slow  # (test_server_bounds: n's choices each a lone answer, greedy and sampled)
def test_n_choices_are_batch_rows_each_its_own_lone_request(srv):
    """Choice i is what a lone request seeded seed + i answers (sampled, at
    a fixed depth: with 'auto' the depths follow timings, and a seeded
    request repeats only at a fixed one), streamed or not; greedy choices
    are the greedy answer."""
    client = srv.openai(timeout=120)
    req = dict(model="m", messages=[{"role": "user", "content": "def fibonacci(n):"}],
               max_tokens=12, temperature=1.0, extra_body={"num_draft_tokens": 2})
    many = client.chat.completions.create(n=3, seed=7, **req)
    assert [c.index for c in many.choices] == [0, 1, 2]
    lone = [client.chat.completions.create(seed=7 + i, **req).choices[0].message.content
            for i in range(3)]
    assert [c.message.content for c in many.choices] == lone
    assert many.usage.completion_tokens == sum(
        client.chat.completions.create(seed=7 + i, **req).usage.completion_tokens
        for i in range(3))
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(n=3, seed=7, stream=True, **req):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == lone
    greedy = client.chat.completions.create(n=2, **dict(req, temperature=0))
    alone = client.chat.completions.create(**dict(req, temperature=0))
    assert [c.index for c in greedy.choices] == [0, 1]
    assert [c.message.content for c in greedy.choices] == [alone.choices[0].message.content] * 2
    assert greedy.usage.completion_tokens == 2 * alone.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(n=33, **req)  # (past --decode-concurrency)
    assert e.value.param == "n"


def test_harmless_fields_are_ignored_with_one_warning_and_the_others_refused(srv):
    msgs = [{"role": "user", "content": "def f():"}]
    assistant = {"role": "assistant", "content": "pass", "annotations": [], "audio": None,
                 "function_call": None}  # (the SDK's message, sent back as it came)
    for _ in range(2):
        r = post(srv, "/v1/chat/completions", {
            "messages": msgs + [assistant] + msgs, "max_tokens": 2, "modalities": ["text"],
            "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
            "frobnicate": 1})
        assert r.status_code == 200, r.text
    log = srv.text()
    assert log.count("the field 'frobnicate' is not known here and is ignored") == 1
    assert log.count("the message field 'annotations' is not known here") == 1
    for field, value in [("audio", {"voice": "alloy", "format": "wav"}),
                         ("functions", [{"name": "f"}]), ("function_call", "auto"),
                         ("modalities", ["text", "audio"])]:
        r = post(srv, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(field), r.text


def test_a_model_can_be_retrieved_by_its_id(srv):
    client = srv.openai(timeout=30)
    assert client.models.retrieve(SERVED).id == SERVED
    assert client.models.retrieve("gpt-4o").id == "gpt-4o"  # (any name is served)
    assert [m.id for m in client.models.list().data] == [SERVED]


def test_anthropic_betas_are_accepted_and_logged_once(srv):
    headers = {"anthropic-beta": "mid-conversation-system-2026-04-07,effort-2025-11-24"}
    for _ in range(2):
        assert post(srv, "/v1/messages", MINIMAL, headers=headers).status_code == 200
    assert srv.text().count("anthropic-beta 'mid-conversation-system-2026-04-07'") == 1


def test_deferred_tools_stay_hidden_until_a_tool_search_names_them():
    body = {"model": "x", "max_tokens": 8, "tools": [
        {"name": "Read", "input_schema": {"type": "object"}},
        {"name": "Cron", "description": "schedules", "input_schema": {"type": "object"},
         "defer_loading": True}],
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"q": "cron"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "tool_reference", "tool_name": "Cron"}]}]}]}
    messages, tools, _, _ = am.to_chat(body)
    assert [t["function"]["name"] for t in tools] == ["Read"]
    assert json.loads(messages[2]["content"]) == {
        "name": "Cron", "description": "schedules", "parameters": {"type": "object"}}


# -- the Responses API -------------------------------------------------------------------------
CODEX_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "def f():"}]},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}],
     "encrypted_content": None},
    {"type": "function_call", "call_id": "c1", "name": "close_agent", "namespace": "agents",
     "arguments": "{\"target\": \"a\"}"},
    {"type": "function_call_output", "call_id": "c1", "output": "closed"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
    {"type": "message", "role": "user", "content": "def g():"}]


def test_responses_input_items_become_the_chat():
    chat = rs.to_chat({"input": CODEX_INPUT, "instructions": "You are Codex.", "tools": [
        {"type": "namespace", "name": "agents", "tools": [
            {"type": "function", "name": "close_agent", "parameters": {"type": "object"}}]},
        {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
        {"type": "web_search"}]})
    assert [m["role"] for m in chat.messages] == [
        "system", "system", "user", "assistant", "tool", "assistant", "user"]
    call = chat.messages[3]
    assert call["reasoning_content"] == "hm" and call["tool_calls"][0]["function"] == {
        "name": "agents.close_agent", "arguments": {"target": "a"}}
    assert chat.messages[4] == {"role": "tool", "tool_call_id": "c1", "name": "agents.close_agent",
                                "content": "closed"}
    assert [t["function"]["name"] for t in chat.tools] == ["agents.close_agent", "apply_patch"]
    assert chat.names["agents.close_agent"] == ("function", "agents", "close_agent")


def test_responses_answer_as_the_chat_path_does_streamed_or_not(srv):
    client = srv.openai(timeout=120)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f():"}]
    want, reason = chat_text(srv, dict(messages=msgs, max_tokens=16))
    r = client.responses.create(model="gpt-5", instructions="Be brief.", input="def f():",
                                max_output_tokens=16, temperature=0)
    assert r.output_text == want and r.model == SERVED
    assert r.status == ("incomplete" if reason == "length" else "completed")
    assert r.usage.input_tokens == client.chat.completions.create(
        model="m", messages=msgs, max_tokens=1).usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    kinds, text = [], ""
    for event in client.responses.create(model="gpt-5", instructions="Be brief.",
                                         input="def f():", max_output_tokens=16,
                                         temperature=0, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
    assert text == want
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done")
    # the whole conversation of a Codex turn is served
    r = client.responses.create(model="x", input=CODEX_INPUT, max_output_tokens=4)
    assert r.status in ("completed", "incomplete") and r.usage.input_tokens > 0


def test_responses_structured_output_and_refusals(srv):
    client = srv.openai(timeout=120)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = client.responses.create(model="x", input="def f():", max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}})
    assert r.status == "completed" and isinstance(json.loads(r.output_text)["n"], int)
    for body, param in [
            ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
            ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
             "input.0.content.0"),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
            ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n",
                                                "schema": {"type": "objekt"}}}},
             "text.format.schema")]:
        r = post(srv, "/v1/responses", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(srv, "/v1/responses", {"input": "def f():", "max_output_tokens": 2,
                                     "tools": [{"type": "web_search"}]})
    assert r.status_code == 200 and "'web_search' runs on OpenAI's servers" in srv.text()
