"""mlx_mtp.server as a real process on a local port, driven by the official
`openai` and `anthropic` clients, and compared with a real mlx_lm.server
process on the same (demo) model: same text at temperature 0, prefix cache
across turns, concurrency, a client leaving mid-stream, bad input; and a
qwen4_exp model served against in-process greedy decoding."""

import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from mlx_mtp.loader import demo_model_path  # noqa: E402
from serving import (LONG_MESSAGES, Server, chat_text, cpu_seconds, cut_at_stop,  # noqa: E402
                     greedy_ids, greedy_until_eos, stopped_chat_text)

DEMO = str(demo_model_path())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("servers")
    started = []
    try:
        started.append(Server(["mlx_mtp.server"], logs / "mtp.log"))
        started.append(Server(["mlx_lm", "server", "--model", DEMO], logs / "mlx_lm.log"))
        yield started
    finally:
        for s in started:
            s.close()


@pytest.fixture(scope="module")
def mtp(servers):
    return servers[0]


# -- same answers as mlx_lm.server --------------------------------------------------------
CHATS = [
    dict(messages=[{"role": "user", "content": "def fibonacci(n):"}], max_tokens=24),
    dict(messages=[{"role": "system", "content": "You write Python."},
                   {"role": "user", "content": "class Stack:"}], max_tokens=20),
    dict(messages=[{"role": "user", "content": "import os"},
                   {"role": "assistant", "content": "import sys"},
                   {"role": "user", "content": "def main():"}], max_tokens=16),
    dict(messages=[{"role": "user", "content": "def parse(argv):"}], max_tokens=30, stop=["\n\n"]),
    dict(messages=[{"role": "user", "content": "for i in range(10):"}], max_tokens=1),
    dict(messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=12,
         tools=[{"type": "function", "function": {"name": "add", "description": "adds",
                 "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]),
    dict(messages=[{"role": "user", "content": "x = "}], max_tokens=12,
         logit_bias={"13": -100}),
]


@pytest.mark.parametrize("i", range(len(CHATS)))
def test_chat_same_text_as_mlx_lm_server(servers, i):
    mtp, lm = servers
    req = CHATS[i]
    want = stopped_chat_text(lm, req)
    assert want[0] or want[1] == "length"
    assert chat_text(mtp, req) == want
    assert chat_text(mtp, req, stream=True) == want


def test_a_stop_string_ends_the_text_where_mlx_lm_server_deletes_it(servers):
    """CHATS[3]'s stop ("\n\n") occurs in its answer: mlx_lm.server strips it
    and goes on; here the answer ends there."""
    mtp, lm = servers
    req = CHATS[3]
    text, _ = chat_text(lm, {k: v for k, v in req.items() if k != "stop"})
    assert "\n\n" in text and chat_text(lm, req)[0] != text[:text.index("\n\n")]
    assert chat_text(mtp, req) == (text[:text.index("\n\n")], "stop")


def test_completions_same_text_as_mlx_lm_server(servers):
    mtp, lm = servers
    for prompt, kw in [("def fibonacci(n):", {}), ("import numpy as np\n", dict(stop=["\n"]))]:
        free = lm.openai().completions.create(model="default_model", prompt=prompt,
                                              max_tokens=20, temperature=0).choices[0]
        want = cut_at_stop(free.text, free.finish_reason, kw.get("stop"))
        got = mtp.openai().completions.create(model="default_model", prompt=prompt,
                                              max_tokens=20, temperature=0, **kw).choices[0]
        assert (got.text, got.finish_reason) == want
        streamed = "".join(c.choices[0].text for c in mtp.openai().completions.create(
            model="default_model", prompt=prompt, max_tokens=20, temperature=0, stream=True,
            **kw) if c.choices)
        assert streamed == want[0]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "def mul(a, b):"}],
                                  presence_penalty=1.5)),
    ("/v1/completions", dict(prompt="def mul(a, b):\n", repetition_penalty=1.5)),
    ("/v1/completions", dict(prompt="class Queue:\n", frequency_penalty=1.0)),
])
def test_penalties_see_the_cached_prefix(servers, path, body):
    """Penalties (logits processors) count every token in the context, the
    prefix served from the prompt cache included, as mlx_lm.server's batch
    does: the same request twice (the second mostly cached) gives
    mlx_lm.server's text both times."""
    mtp, lm = servers
    body = dict(body, max_tokens=30)
    want = greedy_ids(lm, body, path)[1]
    got = [greedy_ids(mtp, body, path) for _ in range(2)]
    # the second one starts from the cached prompt
    assert (got[1][2].get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0
    assert [text for _, text, _ in got] == [want, want]


def test_usage_and_mtp_statistics(mtp):
    r = requests.post(mtp.url + "/v1/chat/completions", json=dict(
        CHATS[0], stream=False)).json()
    usage = r["usage"]
    assert usage["completion_tokens"] == 24 and usage["prompt_tokens"] > 0
    assert "cached_tokens" in usage["prompt_tokens_details"]
    m = usage["mtp"]
    assert m["cycles"] > 0 and m["tokens_per_cycle"] >= 1 and m["drafted"] >= m["accepted"]
    assert all(0 <= a <= 1 for a in m["acceptance"])
    chunks = [json.loads(line[6:]) for line in requests.post(
        mtp.url + "/v1/chat/completions", stream=True,
        json=dict(CHATS[0], stream=True, stream_options={"include_usage": True})).iter_lines(
        decode_unicode=True) if line.startswith("data: {")]
    assert chunks[-1]["usage"]["mtp"]["cycles"] > 0


def test_multi_turn_reuses_the_cached_prefix(mtp):
    client = mtp.openai()
    messages = [{"role": "system", "content": "You are a terse Python assistant."},
                {"role": "user", "content": "def read_config(path):"}]
    first = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "def write_config(path, data):"}]
    second = client.chat.completions.create(model="default_model", messages=messages,
                                            max_tokens=16, temperature=0)
    # turn 1's prompt is not prefilled again (a snapshot at its last token; the
    # answer itself matches only where its text re-tokenizes to the same tokens)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1
    # and the answer is what a cold cache gives (mlx_mtp library, same weights)
    import mlx_mtp

    model, tok = mlx_mtp.load(DEMO, quiet=True)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert mlx_mtp.generate(model, tok, prompt, max_tokens=16) == \
        second.choices[0].message.content


def _sampled_text(server, seed):
    r = server.openai().chat.completions.create(
        model="default_model", messages=CHATS[0]["messages"], max_tokens=16, temperature=0.8,
        top_p=0.9, seed=seed, extra_body={"num_draft_tokens": 2})
    return r.choices[0].message.content


def test_concurrent_clients(mtp):
    """Clients at once (batched: rows joining and leaving; a logit_bias row,
    added in-graph; seeded sampling beside greedy) get complete answers, each
    equal to its serial one. (Seeded draws repeat at a fixed depth: with auto
    the depth schedule, which follows timing, decides which draws are made.)"""
    serial = [chat_text(mtp, r) for r in CHATS] + [_sampled_text(mtp, s) for s in (1, 2)]
    jobs = [lambda r=r: chat_text(mtp, r, stream=True) for r in CHATS] + \
        [lambda s=s: _sampled_text(mtp, s) for s in (1, 2)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        parallel = list(pool.map(lambda job: job(), jobs))
    assert parallel == serial
    assert serial[-1] != serial[-2]  # the seeds matter


def test_disconnect_mid_stream(mtp):
    """A client leaving mid-stream: its generation stops (the next request does
    not wait for 3000 tokens), the server keeps serving, the next answer is right."""
    want = chat_text(mtp, CHATS[1])
    with socket.create_connection(("127.0.0.1", mtp.port)) as s:
        body = json.dumps(dict(messages=LONG_MESSAGES, max_tokens=3000, stream=True))
        s.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}").encode())
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += s.recv(4096)
    t0 = time.time()
    assert chat_text(mtp, CHATS[1]) == want
    assert time.time() - t0 < 15
    assert requests.get(mtp.url + "/health").json() == {"status": "ok"}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", dict(messages=LONG_MESSAGES, max_tokens=3000)),
    ("/v1/messages", dict(model="default_model", messages=LONG_MESSAGES,
                          max_tokens=3000)),
])
def test_client_leaving_a_non_streamed_request_stops_it(mtp, path, body):
    """A non-streamed request whose client closes the connection stops
    decoding (mlx_lm.server's would run to max_tokens): the server is idle
    a moment later, and keeps answering right."""
    want = chat_text(mtp, CHATS[1])
    payload = json.dumps(body)
    with socket.create_connection(("127.0.0.1", mtp.port)) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   f"Content-Length: {len(payload)}\r\n\r\n{payload}").encode())
        deadline = time.time() + 30
        while True:  # until it decodes
            busy = cpu_seconds(mtp.proc.pid)
            time.sleep(0.5)
            if cpu_seconds(mtp.proc.pid) - busy > 0.2 or time.time() > deadline:
                break
        assert cpu_seconds(mtp.proc.pid) - busy > 0.2  # (it was decoding)
    deadline = time.time() + 30  # the watch polls 4 times a second; the row leaves at its next cycle
    while "non-streamed request left" not in mtp.text() and time.time() < deadline:
        time.sleep(0.1)
    # idle within seconds (idle-time work for earlier chats' next turns is a
    # few hundred tokens of prefill; the row left would decode 3000 tokens)
    deadline = time.time() + 10
    while True:
        idle = cpu_seconds(mtp.proc.pid)
        time.sleep(1.5)
        if cpu_seconds(mtp.proc.pid) - idle < 0.25 or time.time() > deadline:
            break
    assert cpu_seconds(mtp.proc.pid) - idle < 0.25
    assert chat_text(mtp, CHATS[1]) == want
    assert "non-streamed request left" in mtp.text()


BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 5.5}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 0}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 10**9}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "temperature": -1}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                         "functions": [{"name": "f"}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/cat.png"}}]}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x"}, {"type": "image_url", "image_url": {
            "url": "data:image/png;base64,AAAA"}}]}]}).encode(), 400),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
        "x"]}]}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400),
    ("/v1/completions", json.dumps({"prompt": "x" * 70000, "max_tokens": 32768}).encode(), 400),
    ("/v1/unknown", b"{}", 404),
]


@pytest.mark.parametrize("path,body,status", BAD, ids=range(len(BAD)))
def test_bad_input_gets_an_openai_error(mtp, path, body, status):
    r = requests.post(mtp.url + path, data=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert requests.get(mtp.url + "/health").status_code == 200


def test_openai_client_raises_on_bad_input(mtp):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        mtp.openai().chat.completions.create(model="default_model", max_tokens=0,
                                             messages=[{"role": "user", "content": "x"}])


def test_models_and_health(mtp):
    models = mtp.openai().models.list()
    assert [m.id for m in models.data] == ["mlx-mtp-demo"]
    assert requests.get(mtp.url + "/health").json() == {"status": "ok"}
    assert requests.get(mtp.url + "/nowhere").status_code == 404


# -- Anthropic Messages ------------------------------------------------------------------
def test_anthropic_messages(mtp):
    client = anthropic.Anthropic(base_url=mtp.url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "def fibonacci(n):"}]
    r = client.messages.create(model="mlx-mtp-demo", max_tokens=24, messages=msgs)
    want = chat_text(mtp, dict(messages=msgs, max_tokens=24))[0]
    assert r.content[0].type == "text" and r.content[0].text == want
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 24
    with client.messages.stream(model="mlx-mtp-demo", max_tokens=24, messages=msgs) as stream:
        assert "".join(stream.text_stream) == want
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens"
    stopped = client.messages.create(model="mlx-mtp-demo", max_tokens=60, messages=msgs,
                                     stop_sequences=["\n"])
    assert stopped.stop_reason in ("stop_sequence", "end_turn", "max_tokens")
    if stopped.stop_reason == "stop_sequence":
        assert stopped.stop_sequence == "\n"
    count = client.messages.count_tokens(model="mlx-mtp-demo", messages=msgs)
    assert count.input_tokens == (r.usage.input_tokens + r.usage.cache_read_input_tokens
                                  + r.usage.cache_creation_input_tokens)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="mlx-mtp-demo", max_tokens=0, messages=msgs)


def test_anthropic_conversion_of_tools_and_system():
    from mlx_mtp.server import anthropic as am

    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "be brief"}],
            "messages": [
                {"role": "user", "content": "weather?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "checking"},
                    {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "thanks"}]}],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "stop_sequences": ["END"], "thinking": {"type": "disabled"}}
    messages, tools, stops, template = am.to_chat(body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "user"]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "weather",
                                                        "arguments": {"city": "Oslo"}}
    assert messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "sunny"}
    assert tools[0]["function"]["name"] == "weather" and stops == ["END"]
    assert template == {"enable_thinking": False}
    from mlx_mtp.server.answer import Part, ToolCall, finish

    msg = am.Message("m", 10, 4, 5)
    for part in [Part("reasoning", "hmm"), Part("text", "ok "),
                 Part("calls", calls=(ToolCall("weather", {"c": 1}),))]:
        msg.feed(part)
    msg.finish(finish("stop", None, True), 7)
    r = msg.response()
    assert [b["type"] for b in r["content"]] == ["thinking", "text", "tool_use"]
    assert r["content"][2]["input"] == {"c": 1}
    assert r["stop_reason"] == "tool_use" and r["usage"]["cache_read_input_tokens"] == 4
    assert r["usage"]["cache_creation_input_tokens"] == 5 and r["usage"]["input_tokens"] == 1


# -- access and load ---------------------------------------------------------------------
def test_api_key_strict_model_and_busy_server(tmp_path):
    s = Server(["mlx_mtp.server", "--api-key", "sesame", "--max-queued-requests", "0",
                "--decode-concurrency", "1", "--strict-model"],
               tmp_path / "key.log")
    try:
        r = requests.post(s.url + "/v1/chat/completions", json=CHATS[0])
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.openai(api_key="wrong").chat.completions.create(model="default_model", **CHATS[0])
        ok = s.openai(api_key="sesame")
        assert ok.chat.completions.create(model="default_model", **CHATS[0]).choices
        # RFC 7235: the scheme is case-insensitive; Anthropic clients send x-api-key
        for headers in ({"Authorization": "bearer sesame"}, {"authorization": "BEARER sesame"},
                        {"x-api-key": "sesame"}):
            r = requests.post(s.url + "/v1/chat/completions", json=CHATS[4], headers=headers)
            assert r.status_code == 200, (headers, r.text)
        # --strict-model: another model's name is a 404 (the default serves any name)
        with pytest.raises(openai.NotFoundError, match="not served here"):
            ok.chat.completions.create(model="gpt-4o", **CHATS[4])
        r = requests.post(s.url + "/v1/messages", headers={"x-api-key": "sesame"}, json=dict(
            model="claude-sonnet-4-5", max_tokens=4, messages=CHATS[4]["messages"]))
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert ok.chat.completions.create(model="mlx-mtp-demo", **CHATS[4]).choices
        # a batch of one, nothing waiting: a second request while the first runs gets 503
        first = ok.chat.completions.create(model="default_model", messages=LONG_MESSAGES,
                                           max_tokens=1000, stream=True)
        next(iter(first))  # (it is decoding)
        r = requests.post(s.url + "/v1/chat/completions", json=CHATS[1],
                          headers={"Authorization": "Bearer sesame"})
        first.close()  # (the client leaves: its row ends, the batch has room again)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
        deadline = time.time() + 30
        while True:
            r = requests.post(s.url + "/v1/chat/completions", json=CHATS[1],
                              headers={"Authorization": "Bearer sesame"})
            if r.status_code != 503 or time.time() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 200 and r.json()["choices"], r.text
    finally:
        s.close()
    assert s.proc.returncode == 0


def test_refused_flags(capsys):
    from mlx_mtp.server.cli import main  # (in this process: refused before any load)

    for flag in (["--adapter-path", "x"], ["--kv-bits", "4"]):
        assert main(flag) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: mlx_mtp.server does not support --") and err.count("\n") == 1


def test_draft_model_folder(tmp_path):
    """--draft-model attaches a split drafter (mlx-vlm's layout) to a trunk
    without a head; a folder without a head is refused in one line."""
    from mlx_mtp.testing.synthetic import write_checkpoint, write_mlx_vlm_drafter

    hf = write_checkpoint(tmp_path / "hf", seed=31)
    nohead = write_checkpoint(tmp_path / "nohead", seed=31, mtp=False)
    vlm = write_mlx_vlm_drafter(hf, tmp_path / "vlm")
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.server", "--model", str(nohead),
                        "--draft-model", str(nohead)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "holds no MTP head" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    s = Server(["mlx_mtp.server", "--model", str(nohead), "--draft-model", str(vlm),
                "--draft-tokens", "2"], tmp_path / "draft.log")
    try:
        body = requests.post(s.url + "/v1/completions",
                             json={"prompt": "def f():", "max_tokens": 8}).json()
        assert body["usage"]["completion_tokens"] == 8
        assert body["usage"]["mtp"]["drafted"] > 0
    finally:
        s.close()


# -- qwen4_exp ---------------------------------------------------------------------------
def test_qwen4_exp_concurrent_greedy_equals_in_process(tmp_path):
    """A qwen4_exp model served (its rows prefill one at a time, then decode
    together, every draft verified and rolled back): four concurrent greedy
    chat requests get in-process plain greedy decoding's tokens (one ending at
    EOS) and mlx_mtp.generate's text, and a second turn, started from the
    first turn's stored prompt cache, still gets them."""
    import mlx_mtp
    from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

    # a seed and prompts whose answers differ from the first token (the tiny random
    # model follows the chat template's last tokens, the same in every prompt)
    path = write_qwen4_exp_checkpoint(tmp_path / "q4x", seed=12)
    reqs = [dict(messages=[{"role": "user", "content": c}], max_tokens=m)
            for c, m in [("def fibonacci(n):", 24), ("class Stack:", 16), ("print('hi')", 20),
                         ("Tell me a story about a dragon.", 24)]]
    s = Server(["mlx_mtp.server", "--model", str(path), "--draft-tokens", "2"], tmp_path / "q4x.log")
    try:
        with ThreadPoolExecutor(len(reqs)) as pool:
            got = list(pool.map(lambda r: greedy_ids(s, r), reqs))
        second = reqs[0]["messages"] + [{"role": "assistant", "content": got[0][1]},
                                        {"role": "user", "content": "and in Python?"}]
        turn2 = greedy_ids(s, dict(messages=second, max_tokens=16))
    finally:
        s.close()
    assert s.code == 0
    model, tok = mlx_mtp.load(path, quiet=True)
    eos = set(tok.eos_token_ids)
    for r, (ids, text, usage) in zip(reqs + [dict(messages=second, max_tokens=16)], got + [turn2]):
        prompt = tok.apply_chat_template(r["messages"], add_generation_prompt=True)
        assert usage["prompt_tokens"] == len(prompt)
        assert ids == greedy_until_eos(model, prompt, r["max_tokens"], eos), r["messages"][-1]
        assert text == mlx_mtp.generate(model, tok, prompt, max_tokens=r["max_tokens"])
        assert usage["mtp"]["drafted"] > 0
    assert len({ids[0] for ids, _, _ in got}) == len(reqs) and got[3][0][-1] in eos
    # the second turn started from the first turn's cache: its prompt is not prefilled again
    assert turn2[2]["prompt_tokens_details"]["cached_tokens"] >= got[0][2]["prompt_tokens"] - 1
