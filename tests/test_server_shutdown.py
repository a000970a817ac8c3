"""SIGTERM on a serving mlx_mtp.server (a real process): it stops accepting,
lets requests in flight finish within --shutdown-grace, then ends the rest
with an error their client's protocol reads (OpenAI: an SSE chunk holding
`error`; Anthropic: `event: error`; not streamed: a 503), never a stream that
just stops."""

import signal
import threading
import time

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

from serving import LONG_MESSAGES, Server  # noqa: E402

GRACE = 4  # seconds (--shutdown-grace)
MSGS = LONG_MESSAGES


def test_sigterm_finishes_what_it_can_and_ends_the_rest_in_protocol(tmp_path):
    s = Server(["mlx_mtp.server", "--shutdown-grace", str(GRACE)], tmp_path / "server.log")
    results, started = {}, {k: threading.Event() for k in ("openai", "anthropic", "short")}
    last_chunk = {}

    def openai_stream(name, max_tokens):
        text, finish = "", None
        try:
            for c in s.openai(timeout=120).chat.completions.create(
                    model="default_model", messages=MSGS, max_tokens=max_tokens, temperature=0,
                    stream=True):
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
                if len(text) > 8:
                    started[name].set()
                last_chunk[name] = time.monotonic()
            results[name] = ("finished", finish, text)
        except openai.APIError as e:
            results[name] = ("error", e.message, text)

    def anthropic_stream():
        client = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=120)
        text = ""
        try:
            with client.messages.stream(model="mlx-mtp-demo", max_tokens=3000,
                                        messages=MSGS) as stream:
                for piece in stream.text_stream:
                    text += piece
                    if len(text) > 8:
                        started["anthropic"].set()
                results["anthropic"] = ("finished", stream.get_final_message().stop_reason,
                                        text)
        except anthropic.APIError as e:
            results["anthropic"] = ("error", str(e), text)

    def not_streamed():
        r = requests.post(s.url + "/v1/chat/completions", timeout=120,
                          json=dict(messages=MSGS, max_tokens=3000))
        results["plain"] = (r.status_code, r.json())

    threads = [threading.Thread(target=openai_stream, args=("openai", 3000)),
               threading.Thread(target=anthropic_stream), threading.Thread(target=not_streamed)]
    try:
        for t in threads:
            t.start()
        assert started["openai"].wait(60) and started["anthropic"].wait(60)
        # one that can finish within the grace, running when the signal comes
        short = threading.Thread(target=openai_stream, args=("short", 24))
        short.start()
        threads.append(short)
        assert started["short"].wait(60)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(requests.ConnectionError):  # no longer accepting
            requests.get(s.url + "/health", timeout=5)
        for t in threads:
            t.join(60)
        code = s.proc.wait(GRACE + 30)
        stopped = time.monotonic() - t0
    finally:
        s.close()
    assert code == 0
    kind, finish, text = results["short"]
    assert (kind, finish) == ("finished", "length") and text
    assert last_chunk["short"] > t0  # it was still running when the signal came
    for name in ("openai", "anthropic"):
        kind, message, text = results[name]
        assert kind == "error" and "shut down" in message, results[name]
        assert text  # what was streamed before the end stays streamed
    status, body = results["plain"]
    assert status == 503 and body["error"]["code"] == "server_shutdown"
    assert GRACE <= stopped < GRACE + 15
    assert "3 requests did not finish within --shutdown-grace" in s.text()


def test_a_disk_fault_while_the_next_turns_go_to_disk_costs_a_log_line(caplog):
    """When a lane fails or the server stops, each finished chat's answer goes
    to disk (`_Lane.persist_all`); a disk that refuses one costs a warning,
    and the others still go (the shutdown then goes on to end the requests
    left, which an exception here would skip)."""
    from types import SimpleNamespace

    from mlx_mtp.server.lane import _Lane, _NextTurn

    stored = []

    def store(tokens, cache, persist=False):
        if tokens == [1]:
            raise OSError("disk full")
        stored.append((tokens, persist))

    lane = _Lane.__new__(_Lane)  # (no model: only the hand-over to the store)
    lane.gen = SimpleNamespace(store=store)
    turns = [_NextTurn(SimpleNamespace(key_tokens=list(t), cache=[]), answered=1, stored=1)
             for t in ([1, 2], [3, 4])]
    lane.next_turns = list(turns)
    with caplog.at_level("WARNING"):
        lane.persist_all()
    assert stored == [([3], True)] and lane.next_turns == []
    assert "not sent to disk: OSError: disk full" in caplog.text
