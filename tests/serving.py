"""A server as a real process (or mlx.launch ranks) on a free local port, for
the server tests (not a test module)."""

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import requests


# Requests the demo model answers at length (greedy, it loops on them: 1,500
# tokens without an EOS; tests/test_demo_model.py checks 600):
# for tests that need a request still decoding when they act. A short answer
# (`def fibonacci(n):` ends in 36 tokens) would finish first.
LONG_MESSAGES = [{"role": "user", "content": "class Stack:"}]
LONG_PROMPT = "x = [1, 2, 3]\nprint("

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m ARGV --port P` in its own process group (behind `launch`,
    e.g. mlx.launch's arguments, when given), ready when /health answers.
    `close` stops it as a Ctrl-C does (SIGINT to the group), then kills the
    group if it has not exited in 30 s; `code` is its exit status. `env`:
    variables set for it besides ours."""

    def __init__(self, argv, log, launch=(), timeout=120, env=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.code = None
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.log_path = log
        self.log = open(log, "w")
        cmd = [*launch, *(["--python"] if launch else []), sys.executable, "-m", *argv,
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.time() + timeout
        while True:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.close()
                raise RuntimeError(f"{argv} did not start: see {log}")
            time.sleep(0.3)

    def _signal_group(self, sig) -> bool:
        try:
            os.killpg(self.proc.pid, sig)
            return True
        except ProcessLookupError:
            return False

    def close(self) -> bool:
        """Stop it; True when every process of the group exited by itself."""
        clean = True
        if self.proc.poll() is None:
            self._signal_group(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                clean = False
        deadline = time.time() + 30  # the group's other processes (ranks) too
        while self._signal_group(0) and time.time() < deadline:
            time.sleep(0.2)
        if self._signal_group(signal.SIGKILL):
            clean = False
        if self.proc.poll() is None:
            self.proc.wait()
        self.code = self.proc.returncode
        self.log.close()
        return clean

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait_for_log(self, words: str, count: int = 1, timeout: float = 60) -> bool:
        """Wait until the log holds `words` at least `count` times."""
        deadline = time.time() + timeout
        while self.text().count(words) < count:
            if time.time() > deadline or self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return True

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"),
                             max_retries=0, **kw)


def chat_text(server, req, stream=False):
    """A chat request's text and finish reason at temperature 0 (official
    OpenAI client; streamed or not)."""
    client = server.openai(timeout=120)
    if not stream:
        r = client.chat.completions.create(model="default_model", temperature=0, **req)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model="default_model", temperature=0,
                                                stream=True, **req):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def cut_at_stop(text: str, finish: str, stops) -> tuple:
    """An answer generated without stop strings, ended where the first one
    begins: (text, finish_reason) as the stop strings make it here.
    (mlx_lm.server deletes each one from the text and generates on: docs/server.md,
    the table of differences.)"""
    found = [text.find(s) for s in stops or () if s in text]
    return (text[:min(found)], "stop") if found else (text, finish)


def stopped_chat_text(server, req) -> tuple:
    """`chat_text` of `req` generated without its stop strings, cut at them
    (`cut_at_stop`): what mlx_mtp.server answers to `req` when `server` is
    mlx_lm.server."""
    return cut_at_stop(*chat_text(server, {k: v for k, v in req.items() if k != "stop"}),
                       req.get("stop"))


def greedy_ids(server, req, path="/v1/chat/completions"):
    """A request's generated token ids at temperature 0 (as `logprobs: true`
    returns them; the end-of-sequence token included where it stopped there),
    its text and its usage (not streamed)."""
    r = requests.post(server.url + path, json=dict(req, temperature=0, logprobs=True), timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return [t["id"] for t in choice["logprobs"]["content"]], text, body["usage"]


def greedy_until_eos(model, prompt, max_tokens, eos):
    """Plain greedy decoding's tokens (mlx_lm's generate_step, no prompt
    cache), through the first EOS."""
    from util import reference

    want = reference(model, prompt, max_tokens)
    stop = next((i for i, t in enumerate(want) if t in eos), None)
    return want if stop is None else want[:stop + 1]


# A process's memory, threads and CPU time, read portably (psutil: Linux,
# macOS, Windows), so the bounded-memory tests run where users run.
def rss(pid: int) -> int:
    """Resident memory of a process, bytes."""
    return psutil.Process(pid).memory_info().rss


def threads(pid: int) -> int:
    return psutil.Process(pid).num_threads()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _high_water_mark(pid: int):
    """Linux's peak resident memory (VmHWM), None elsewhere."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(line for line in f if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


class PeakRSS:
    """The peak resident memory of a process while the block runs, less its
    resident memory before: resident memory sampled every 5 ms, and on Linux
    the kernel's high-water mark too (reset at the start through
    /proc/PID/clear_refs, where that is allowed). `growth`: bytes."""

    def __init__(self, pid: int):
        self.pid = pid

    def __enter__(self):
        self.before = rss(self.pid)
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self.sampled, self.done = self.before, threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.005):
            self.sampled = max(self.sampled, rss(self.pid))

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        peak = max(self.sampled, (_high_water_mark(self.pid) or 0) if self.hwm else 0)
        self.growth = peak - self.before


@contextlib.contextmanager
def local_http(handler):
    """A ThreadingHTTPServer on a free loopback port (handler threads are
    daemons), its base URL, shut down and closed at the end."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
