"""mlx_mtp.server at its boundary, as a real process: what clients send
(their own model ids, Claude Code's request shape, logprobs), what is
refused instead of silently ignored, HTTP's small print (methods, deep
JSON, lone surrogates), and the resources a hostile or broken client can
hold (a 50 MB body, a prompt far past the context, stalled uploads).
Each case is answered in one clear line and the server keeps serving."""

import json
import re
import socket
import subprocess
import sys
import time

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from serving import (LONG_PROMPT, PeakRSS, Server, chat_text, greedy_ids,  # noqa: E402
                     threads)

SERVED = "mlx-mtp-demo"  # the demo model's id (no --model)
READ_TIMEOUT = 2  # the server's --read-timeout here
MSGS = [{"role": "user", "content": "def fibonacci(n):"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "adds", "parameters": {
    "type": "object", "properties": {"a": {"type": "number"}}}}}]
ANTHROPIC_TOOLS = [{"name": "add", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    s = Server(["mlx_mtp.server", "--read-timeout", str(READ_TIMEOUT)],
               tmp_path_factory.mktemp("protocol") / "server.log")
    try:
        yield s
    finally:
        s.close()


def healthy(srv) -> bool:
    return requests.get(srv.url + "/health", timeout=10).json() == {"status": "ok"}


def sse(response):
    """(event, data) of a server-sent event stream, data parsed as JSON
    ([DONE] kept as the string)."""
    event = None
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
            yield event, data if data == "[DONE]" else json.loads(data)
            event = None


# -- any model name: the client's own ids ----------------------------------------------------
@pytest.mark.filterwarnings("ignore:The model .* is deprecated")  # (the anthropic SDK's list)
def test_any_model_name_is_served_and_answered_with_the_served_id(srv):
    """The OpenAI SDK's and Claude Code's own model ids are served (a
    one-model server), and every answer names the model that answered."""
    client = srv.openai(timeout=60)
    r = client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=4)
    assert r.model == SERVED and r.choices[0].message.content
    chunks = list(client.chat.completions.create(model="gpt-4o", messages=MSGS, max_tokens=4,
                                                 stream=True))
    assert chunks and {c.model for c in chunks} == {SERVED}
    c = client.completions.create(model="gpt-3.5-turbo-instruct", prompt=LONG_PROMPT,
                                  max_tokens=4)
    assert c.model == SERVED and c.choices[0].text
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0)
    m = a.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=MSGS)
    assert m.model == SERVED and m.content[0].text
    assert a.messages.count_tokens(model="claude-opus-4-1", messages=MSGS).input_tokens > 0


# A Messages request shaped like Claude Code's (pointed here by
# ANTHROPIC_BASE_URL): its path has ?beta=true, its headers the API version
# and betas, its system prompt and message are lists of text blocks with
# cache_control, it sends tools, metadata and streams.
CLAUDE_CODE_HEADERS = {
    "x-api-key": "none", "anthropic-version": "2023-06-01", "content-type": "application/json",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
    "user-agent": "claude-cli/2.0.0 (external, cli)", "x-app": "cli"}
CLAUDE_CODE_BODY = {
    "model": "claude-sonnet-4-5-20250929", "max_tokens": 32, "temperature": 1, "stream": True,
    "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI.",
                "cache_control": {"type": "ephemeral"}},
               {"type": "text", "text": "You are an interactive CLI tool for software work.",
                "cache_control": {"type": "ephemeral"}}],
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
        {"type": "text", "text": "def fibonacci(n):", "cache_control": {"type": "ephemeral"}}]}],
    "tools": [{"name": "Bash", "description": "Run a shell command", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}},
        "required": ["command"], "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#"}}],
    "metadata": {"user_id": "user_0123_account__session_4567"},
}


def test_a_claude_code_shaped_request_streams_an_answer(srv):
    r = requests.post(srv.url + "/v1/messages?beta=true", json=CLAUDE_CODE_BODY,
                      headers=CLAUDE_CODE_HEADERS, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    events = list(sse(r))
    kinds = [e for e, _ in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert events[0][1]["message"]["model"] == SERVED
    text = "".join(d["delta"].get("text", "") for e, d in events if e == "content_block_delta")
    assert text
    count = requests.post(srv.url + "/v1/messages/count_tokens?beta=true",
                          json={k: v for k, v in CLAUDE_CODE_BODY.items()
                                if k not in ("max_tokens", "stream", "temperature")},
                          headers=CLAUDE_CODE_HEADERS, timeout=60)
    assert count.status_code == 200 and count.json()["input_tokens"] > 0


# -- logprobs in OpenAI's shape ---------------------------------------------------------------
def _token_ok(t: dict):
    """A token's entry: decoded text (no byte-level BPE pieces), its bytes."""
    assert {"token", "logprob", "bytes"} <= set(t), t
    assert not any(c in t["token"] for c in "ĠĊĉ"), t
    if not t["token"].startswith("bytes:"):
        assert bytes(t["bytes"]).decode("utf-8") == t["token"], t


def test_top_logprobs_name_the_chosen_token_sorted_with_bytes(srv):
    """Greedy: each position's entry is the generated token (the ids of a
    plain `logprobs` request), its top list sorted by logprob with the chosen
    token first, texts decoded, and the bytes joined give the answer."""
    ids, want_text, _ = greedy_ids(srv, dict(messages=MSGS, max_tokens=16))
    client = srv.openai(timeout=60)
    r = client.chat.completions.create(model="default_model", messages=MSGS, max_tokens=16,
                                       temperature=0, logprobs=True, top_logprobs=5)
    content = [e.model_dump() for e in r.choices[0].logprobs.content]
    assert [e["id"] for e in content] == ids
    for e in content:
        _token_ok(e)
        top = e["top_logprobs"]
        assert len(top) == 5
        for t in top:
            _token_ok(t)
        lps = [t["logprob"] for t in top]
        assert lps == sorted(lps, reverse=True)
        assert top[0]["id"] == e["id"] and top[0]["logprob"] == pytest.approx(e["logprob"])
    text = b"".join(bytes(e["bytes"]) for e in content).decode("utf-8")
    assert want_text == r.choices[0].message.content
    assert text.strip() == want_text.strip()  # (the detokenizer drops a leading space)


def test_sampled_top_logprobs_are_sorted_and_agree_with_the_chosen_token(srv):
    body = dict(messages=MSGS, max_tokens=24, temperature=1.0, seed=7, logprobs=True,
                top_logprobs=11)
    choice = requests.post(srv.url + "/v1/chat/completions", json=body,
                           timeout=60).json()["choices"][0]
    content = choice["logprobs"]["content"]
    # A sampled answer may end early at EOS (where it does depends on the machine's numerics).
    assert choice["finish_reason"] in ("length", "stop") and 0 < len(content) <= 24
    assert choice["finish_reason"] == "stop" or len(content) == 24
    for e in content:
        top = e["top_logprobs"]
        lps = [t["logprob"] for t in top]
        assert len(top) == 11 and lps == sorted(lps, reverse=True)
        assert e["logprob"] <= lps[0] + 1e-6
        same = [t for t in top if t["id"] == e["id"]]
        if same:  # the chosen token's own entry, where it is among the most likely
            assert same[0]["token"] == e["token"] and same[0]["logprob"] == pytest.approx(
                e["logprob"])
    assert any(e["id"] != e["top_logprobs"][0]["id"] for e in content)  # (it did sample)


def test_streamed_chunks_carry_logprobs(srv):
    ids, _, _ = greedy_ids(srv, dict(messages=MSGS, max_tokens=20))
    r = requests.post(srv.url + "/v1/chat/completions", stream=True, timeout=60, json=dict(
        messages=MSGS, max_tokens=20, temperature=0, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True}))
    chunks = [d for _, d in sse(r) if d != "[DONE]"]
    streamed, entries = "", []
    for c in chunks:
        for choice in c["choices"]:
            streamed += choice["delta"].get("content") or ""
            entries += (choice.get("logprobs") or {}).get("content") or []
    assert [e["id"] for e in entries] == ids
    assert len(entries) == chunks[-1]["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == 2 for e in entries)
    assert b"".join(bytes(e["bytes"]) for e in entries).decode().strip() == streamed.strip()


# -- what cannot be honoured is refused (mlx_lm.server would silently ignore it) -----------------
CHAT = dict(messages=MSGS, max_tokens=4)
ANTHROPIC = dict(model=SERVED, max_tokens=4, messages=MSGS)  # (any name is served: see above)
REFUSED = [  # (path, body, the field the error names)
    ("/v1/chat/completions", dict(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}),
     "response_format.json_schema.schema"),
    # the demo model's chat template cannot call tools: a forced call cannot be made
    ("/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice="required"), "tool_choice"),
    ("/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "add"}}), "tool_choice"),
    ("/v1/chat/completions", dict(CHAT, tool_choice="required"), "tool_choice"),
    ("/v1/messages", dict(ANTHROPIC, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}),
     "tool_choice"),
    ("/v1/messages", dict(ANTHROPIC, tools=ANTHROPIC_TOOLS, tool_choice={
        "type": "tool", "name": "add"}), "tool_choice"),
    ("/v1/messages", dict(ANTHROPIC, messages=[{"role": "user", "content": [{"type": "foo"}]}]),
     "messages.0.content.0"),
    ("/v1/messages", dict(ANTHROPIC, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "foo", "text": "hidden"}]}]),
     "messages.0.content.1"),
    ("/v1/messages", dict(ANTHROPIC, system=[{"type": "foo", "text": "x"}]), "system.0"),
]
SERVED_AS_ASKED = [
    ("/v1/chat/completions", dict(CHAT, response_format={"type": "text"})),
    # (structured output: tests/test_server_structured.py)
    ("/v1/chat/completions", dict(CHAT, response_format={"type": "json_object"})),
    ("/v1/chat/completions", dict(CHAT, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}})),
    ("/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice="auto")),
    ("/v1/chat/completions", dict(CHAT, tools=TOOLS, tool_choice="none")),
    ("/v1/messages", dict(ANTHROPIC, tools=ANTHROPIC_TOOLS, tool_choice={"type": "auto"})),
    ("/v1/messages", dict(ANTHROPIC, messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}])),
]


@pytest.mark.parametrize("path,body,param", REFUSED, ids=range(len(REFUSED)))
def test_what_cannot_be_honoured_is_refused(srv, path, body, param):
    r = requests.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and param in r.json()["error"]["message"]
    else:
        assert r.json()["error"]["param"] == param
    assert healthy(srv)


@pytest.mark.parametrize("path,body", SERVED_AS_ASKED, ids=range(len(SERVED_AS_ASKED)))
def test_what_can_be_honoured_is_served(srv, path, body):
    assert requests.post(srv.url + path, json=body, timeout=60).status_code == 200


# -- tool definitions are checked whatever tool_choice is --------------------------------------
BAD_TOOLS = [  # (tools, the field the 400 names)
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "oops"}}],
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools.0.function.parameters"),
    (TOOLS + [{"type": "function"}], "tools.1"),
]


@pytest.mark.parametrize("choice", [None, "auto", "none"])
@pytest.mark.parametrize("tools,param", BAD_TOOLS, ids=range(len(BAD_TOOLS)))
def test_malformed_tools_are_refused_whatever_tool_choice(srv, tools, param, choice):
    """(a call is never forced here: the demo model's template cannot call tools)"""
    kw = {} if choice is None else {"tool_choice": choice}
    with pytest.raises(openai.BadRequestError) as e:
        srv.openai(timeout=60).chat.completions.create(model="m", messages=MSGS, max_tokens=4,
                                                       tools=tools, **kw)
    assert e.value.param == param and param in e.value.message
    assert healthy(srv)


@pytest.mark.parametrize("schema", [{"type": "objekt"}, "oops", {"type": "array"}])
def test_anthropic_malformed_input_schema_is_refused(srv, schema):
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=SERVED, max_tokens=4, messages=MSGS,
                          tools=[{"name": "f", "input_schema": schema}])
    assert e.value.body["type"] == "error" and "tools.0.input_schema" in str(e.value)


# -- stop strings end the answer where they begin ------------------------------------------------
# The demo answers MSGS with '...if not n:\n        return ...': ' return' is one
# token, which the string 'return' (encoded alone) is not.
STOP_CHAT = dict(messages=MSGS, max_tokens=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_the_chat_answer_where_it_begins(srv, stream):
    """Streamed, the text that could begin the stop string is held back:
    the chunks joined are the answer, nothing of 'return' sent."""
    full, _ = chat_text(srv, STOP_CHAT)
    assert "return" in full
    got = chat_text(srv, dict(STOP_CHAT, stop=["zzz", "return"]), stream=stream)
    assert got == (full[:full.index("return")], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_ends_a_completion_where_it_begins(srv, stream):
    client = srv.openai(timeout=60)
    kw = dict(model="m", prompt=LONG_PROMPT, max_tokens=40, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = "edw"  # inside '...p|an|ed|window...': the end of one token, the start of the next
    assert stop in full
    if stream:
        text, finish = "", None
        for c in client.completions.create(stream=True, stop=stop, **kw):
            text += c.choices[0].text if c.choices else ""
            finish = (c.choices[0].finish_reason if c.choices else None) or finish
    else:
        c = client.completions.create(stop=stop, **kw).choices[0]
        text, finish = c.text, c.finish_reason
    assert (text, finish) == (full[:full.index(stop)], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_stop_sequences_end_the_answer_and_are_named(srv, stream):
    full, _ = chat_text(srv, STOP_CHAT)
    a = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
    kw = dict(model=SERVED, max_tokens=60, messages=MSGS,  # (greedy: the server's --temp)
              stop_sequences=["zzz", "return"])
    if stream:
        with a.messages.stream(**kw) as s:
            streamed = "".join(s.text_stream)
            m = s.get_final_message()
        assert streamed == full[:full.index("return")]
    else:
        m = a.messages.create(**kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "return"
    assert [b.text for b in m.content] == [full[:full.index("return")]]


# -- HTTP's small print -------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,status,allow", [
    ("PUT", "/v1/chat/completions", 405, "POST"),
    ("DELETE", "/v1/chat/completions", 405, "POST"),
    ("PATCH", "/v1/completions", 405, "POST"),
    ("GET", "/v1/chat/completions", 405, "POST"),
    ("GET", "/v1/messages", 405, "POST"),
    ("POST", "/v1/models", 405, "GET"),
    ("DELETE", "/health", 405, "GET"),
    ("PUT", "/v1/nowhere", 404, None),
    ("FROB", "/v1/chat/completions", 501, None),
])
def test_methods_get_a_json_error(srv, method, path, status, allow):
    r = requests.request(method, srv.url + path, timeout=10)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if allow is not None:
        assert allow in r.headers["Allow"]
    assert healthy(srv)


def test_deeply_nested_json_is_a_400(srv):
    for body in ("[" * 100_000 + "]" * 100_000,
                 '{"messages": ' + '{"a": ' * 100_000 + "1" + "}" * 100_001):
        r = requests.post(srv.url + "/v1/chat/completions", data=body, timeout=30)
        assert r.status_code == 400 and "deeply" in r.json()["error"]["message"]
    assert healthy(srv)


def test_a_lone_surrogate_is_named_as_such(srv):
    body = '{"messages": [{"role": "user", "content": "ab\\ud800cd"}], "max_tokens": 4}'
    for path in ("/v1/chat/completions", "/v1/messages"):
        data = body if path.endswith("completions") else body[:-1] + f', "model": "{SERVED}"}}'
        r = requests.post(srv.url + path, data=data, timeout=30)
        assert r.status_code == 400
        message = json.dumps(r.json())
        assert "surrogate" in message and "messages.0.content" in message
        assert "template" not in message


@pytest.mark.parametrize("path,body,kind", [
    ("/v1/chat/completions", dict(messages=MSGS), "chat.completion.chunk"),
    ("/v1/completions", dict(prompt=LONG_PROMPT), "text_completion"),
])
def test_the_usage_chunk_is_a_chunk(srv, path, body, kind):
    r = requests.post(srv.url + path, stream=True, timeout=60, json=dict(
        body, max_tokens=4, stream=True, stream_options={"include_usage": True}))
    chunks = [d for _, d in sse(r) if d != "[DONE]"]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
    assert {c["object"] for c in chunks} == {kind}


def test_a_bad_size_flag_is_one_line():
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.server", "--prompt-cache-bytes", "12XB"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--prompt-cache-bytes" in r.stderr.splitlines()[-1]
    assert "12XB" in r.stderr.splitlines()[-1]


# -- memory and threads a client can hold --------------------------------------------------------
def test_a_50_mb_body_is_refused_at_once_in_bounded_memory(srv):
    """Refused from its Content-Length (larger than a prompt filling the
    context can need), read and dropped a chunk at a time: under 2 s, and the
    server's peak resident memory grows by under 100 MB."""
    body = b'{"messages": [{"role": "user", "content": "' + b"x" * (50 << 20) + b'"}]}'
    with PeakRSS(srv.proc.pid) as rss:
        t0 = time.perf_counter()
        r = requests.post(srv.url + "/v1/chat/completions", data=body, timeout=30,
                          headers={"Content-Type": "application/json"})
        took = time.perf_counter() - t0
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert took < 2, f"{took:.2f} s"
    assert rss.growth < 100 << 20, f"the server grew by {rss.growth / 2**20:.0f} MiB"
    assert healthy(srv)


@pytest.mark.parametrize("path,field", [("/v1/chat/completions", "messages"),
                                        ("/v1/completions", "prompt"),
                                        ("/v1/messages", None)])
def test_a_prompt_longer_than_the_context_in_characters_is_refused_before_tokenizing(
        srv, path, field):
    """1.2 MB of text (within the body limit): more characters than the
    context's tokens can hold, refused from its length, not after
    tokenizing: under 2 s, in bounded memory."""
    text = "hello world " * 100_000
    body = (dict(prompt=text, max_tokens=16) if field == "prompt" else
            dict(messages=[{"role": "user", "content": text}], max_tokens=16))
    if field is None:
        body["model"] = SERVED
    with PeakRSS(srv.proc.pid) as rss:
        t0 = time.perf_counter()
        r = requests.post(srv.url + path, json=body, timeout=30)
        took = time.perf_counter() - t0
    assert r.status_code == 400, r.text
    if field is not None:  # (OpenAI's words and code; Anthropic's: Claude Code compacts)
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == field
        assert error["message"].startswith("This model's maximum context length is 4096 tokens")
    else:
        assert re.match(r"prompt is too long: \d+ tokens > 4096 maximum \(at least: counted "
                        r"from its 1199999 characters", r.json()["error"]["message"]), r.text
    assert "characters before tokenizing" in json.dumps(r.json())
    assert took < 2, f"{took:.2f} s"
    assert rss.growth < 100 << 20, f"the server grew by {rss.growth / 2**20:.0f} MiB"


def test_stalled_uploads_are_timed_out_and_free_their_threads(srv):
    """20 uploads that stop after 10 bytes of their body, and one that stops
    inside its headers: each is answered 408 (or closed) after
    --read-timeout, and the server's threads return to their number."""
    before = threads(srv.proc.pid)
    socks = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000\r\n\r\n" + b'{"messages"')
        socks.append(s)
    header = socket.create_connection(("127.0.0.1", srv.port))
    header.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    deadline = time.time() + 1.5
    while threads(srv.proc.pid) < before + 20 and time.time() < deadline:
        time.sleep(0.05)
    assert threads(srv.proc.pid) >= before + 20  # (each holds one)
    t0 = time.perf_counter()
    for s in socks + [header]:
        s.settimeout(READ_TIMEOUT + 5)
        data = b""
        while True:
            chunk = s.recv(65536)  # (a socket.timeout here: the server never let go)
            if not chunk:
                break
            data += chunk
        s.close()
        if s is not header:
            assert data.startswith(b"HTTP/1.0 408"), data[:200]
            assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == \
                "request_timeout"
    assert time.perf_counter() - t0 < READ_TIMEOUT + 3
    deadline = time.time() + 5
    while threads(srv.proc.pid) > before + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert threads(srv.proc.pid) <= before + 1
    assert healthy(srv)
