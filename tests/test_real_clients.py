"""The agents people run, unchanged, against mlx_mtp.server (slow tier):
pinned releases of Claude Code and Codex CLI from npm and aider from PyPI,
installed here, each run non-interactively through a recording proxy
(tests/recording_proxy.py) that keeps every request and whole answer.

The model is the demo with a 262144-token context and short answers
(`write_agent_demo`: agent prompts are 6-20K tokens, and an agent waits for
an answer that ends) under a chat template with Qwen3.5's rules
(`FIRST_SYSTEM_TEMPLATE`: one system message, first; tools in the system
turn). The server runs with OpenBLAS preloaded where it is installed
(.ci/run installs it): a 17K-token prefill takes ~35 s with it, ~150 s with
MLX's bundled BLAS."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import requests

from recording_proxy import read_log, serve
from serving import Server, free_port

from mlx_mtp.server import anthropic as am
from mlx_mtp.server.prompt_points import BLOCK_END_SLACK
from mlx_mtp.server.roles import place_system
from mlx_mtp.testing.synthetic import FIRST_SYSTEM_TEMPLATE, write_agent_demo

pytestmark = pytest.mark.slow

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.337"
CODEX = "@openai/codex@0.171.0"
AIDER = "aider-chat==0.86.2"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
RUN_TIMEOUT = 900  # seconds a client may take (a cold 17K-token prefill included)
NODE_MIN = 18  # the oldest Node.js major Claude Code runs on (.ci/run warns below it)


def in_ci() -> bool:
    """CI (`CI=true`, as .ci/run and CI services set it): a client that
    cannot be installed fails the run; elsewhere it skips these tests."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def install(argv, timeout):
    """Run an installer; its failure is one clear line and its output's tail."""
    try:
        subprocess.run([str(a) for a in argv], check=True, capture_output=True, text=True,
                       timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"cannot install the clients: {' '.join(map(str, argv[:3]))} ... failed "
                    f"({e.__class__.__name__}):\n{(e.stderr or '')[-3000:]}", pytrace=False)


def unavailable(why: str):
    """A client that cannot be installed or run: skip, but fail under CI."""
    if in_ci():
        pytest.fail(f"{why} (CI=true: the real clients must run)", pytrace=False)
    pytest.skip(why)


def check_node():
    """npm, and a Node.js of at least NODE_MIN (Debian's nodejs may be
    older): otherwise one line naming what is missing or the version."""
    if shutil.which("npm") is None:
        unavailable("npm is not installed (Node.js): the npm clients cannot be installed "
                    "(.ci/run installs it)")
    try:
        version = subprocess.run(["node", "--version"], capture_output=True, text=True,
                                 timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        unavailable(f"node does not run ({e.__class__.__name__}): the npm clients need Node.js")
    major = re.match(r"v?(\d+)\.", version)
    if major is None or int(major.group(1)) < NODE_MIN:
        unavailable(f"Node.js {version or '(no version)'} is older than {NODE_MIN}, which "
                    f"Claude Code needs: install Node.js {NODE_MIN} or newer")


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    """The clients, installed: (claude, codex, aider) executables. Without
    npm or with a Node.js too old they skip, but under CI they fail: CI is
    never green without running them (.ci/run installs Node.js and npm)."""
    check_node()
    root = tmp_path_factory.mktemp("clients")
    install(["npm", "install", "--no-audit", "--no-fund", "--prefix", root, CLAUDE_CODE, CODEX],
            600)
    venv = root / "aider"
    install([sys.executable, "-m", "venv", venv], 120)
    install([venv / "bin" / "pip", "install", "-q", AIDER], 900)
    bin_ = root / "node_modules" / ".bin"
    return bin_ / "claude", bin_ / "codex", venv / "bin" / "aider"


@pytest.mark.parametrize("version,ci,outcome", [
    ("v12.22.12", "true", pytest.fail.Exception), ("v12.22.12", "", pytest.skip.Exception),
    ("v17.9.1", "1", pytest.fail.Exception), ("v18.19.0", "true", None),
    ("v20.20.2", "", None)])
def test_node_too_old_fails_under_ci_and_skips_elsewhere(tmp_path, monkeypatch, version, ci,
                                                          outcome):
    """check_node against a stand-in `node` (and `npm`) printing `version`:
    below NODE_MIN one line naming it, a failure under CI, else a skip."""
    for name, text in (("node", version), ("npm", "10.0.0")):
        exe = tmp_path / name
        exe.write_text(f"#!/bin/sh\necho {text}\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", ci)
    if outcome is None:
        check_node()
        return
    with pytest.raises(outcome) as e:
        check_node()
    assert str(e.value).startswith(f"Node.js {version} is older than {NODE_MIN}, which "
                                   "Claude Code needs"), str(e.value)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, proxy URL, the proxy's log) on the long-context demo."""
    root = tmp_path_factory.mktemp("served")
    model = write_agent_demo(root / "model")
    env = {"LD_PRELOAD": OPENBLAS, "OPENBLAS_NUM_THREADS": "2"} if Path(OPENBLAS).exists() \
        else {}
    server = Server(["mlx_mtp.server", "--model", str(model), "--chat-template",
                     FIRST_SYSTEM_TEMPLATE, "--max-tokens-limit", "131072"],
                    root / "server.log", env=env)
    log = root / "calls.jsonl"
    proxy = serve(server.url, free_port(), str(log))
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield server, f"http://127.0.0.1:{proxy.server_address[1]}", log
    finally:
        proxy.shutdown()
        proxy.server_close()
        server.close()


def run(argv, env, cwd):
    home = Path(cwd) / "home"
    home.mkdir(exist_ok=True)
    r = subprocess.run([str(a) for a in argv], env=dict(os.environ, HOME=str(home), **env),
                       cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, f"{argv[0]} exited {r.returncode}:\n{r.stdout[-3000:]}\n" \
                              f"{r.stderr[-3000:]}"
    return r.stdout


def calls_since(log, start: int, path: str) -> list:
    return [c for c in read_log(log)[start:] if c["path"].split("?")[0] == path]


def sse_events(text: str) -> list:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"]


def test_claude_code(tools, served, tmp_path):
    """`claude -p` with its default model, json and stream-json: every
    request 2xx, every stream whole; the second session (another prompt,
    another billing line) reads >= 97% of the prefix the two share from the
    cache (the system prompt and tools; what follows the user's text, `-p`'s
    environment as a system message rendered in its place, cannot be a
    shared prefix); count_tokens takes its request's body as sent. `-p`
    sends the user's text as one block, so this does not exercise the shared
    head (prompt_points.opening_head is None here: the system prompt's end
    alone meets the bound); the interactive shape, reminder blocks before
    the user's text, is tested on a synthetic request in
    test_server_agents.py (test_a_new_session_reads_the_reminders_...)."""
    server, url, log = served
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "anything",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    start = len(read_log(log)) if log.exists() else 0
    result = json.loads(run([tools[0], "-p", "Say hi", "--output-format", "json"], env,
                            tmp_path))
    assert result["is_error"] is False and result["type"] == "result", result
    first = len(read_log(log))
    lines = run([tools[0], "-p", "def fibonacci(n):", "--output-format", "stream-json",
                 "--verbose"], env, tmp_path).splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    assert events[-1]["type"] == "result" and events[-1]["is_error"] is False, events[-1]
    calls = calls_since(log, start, "/v1/messages")
    assert calls and all(200 <= c["status"] < 300 for c in read_log(log)[start:]), \
        [(c["path"], c["status"], c["response"][:300]) for c in read_log(log)[start:]]
    for c in calls:
        if c["body"].get("stream"):
            kinds = [e["type"] for e in sse_events(c["response"])]
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    # the second session's first request, against the first's
    a = calls_since(log, start, "/v1/messages")[0]
    b = calls_since(log, first, "/v1/messages")[0]
    assert a["body"]["system"][0]["text"] != b["body"]["system"][0]["text"]  # (the billing line)
    from mlx_lm.server import process_message_content
    from mlx_lm.tokenizer_utils import load

    tok = load(Path(server.proc.args[server.proc.args.index("--model") + 1]),
               {"chat_template": FIRST_SYSTEM_TEMPLATE})
    prompts = []
    for c in (a, b):
        messages, tools_, _, _ = am.to_chat(c["body"])
        process_message_content(messages)  # (text parts joined, as the server's mlx_lm does)
        prompts.append(tok.apply_chat_template(place_system(messages, "user"), tools=tools_,
                                               add_generation_prompt=True))
    shared = next(i for i, (x, y) in enumerate(zip(*prompts)) if x != y)
    usage = [e for e in sse_events(b["response"]) if e["type"] == "message_delta"][-1]["usage"]
    print(f"Claude Code's second session: {usage['cache_read_input_tokens']} of "
          f"{len(prompts[1])} prompt tokens read from the cache (the sessions share {shared})")
    # (the blocks' point is a few tokens before their end: prompt_points.BLOCK_END_SLACK)
    assert usage["cache_read_input_tokens"] >= max(0.97 * shared, shared - 4 * BLOCK_END_SLACK), (
        usage, shared, len(prompts[1]))
    counted = requests.post(server.url + "/v1/messages/count_tokens?beta=true", json=b["body"],
                            timeout=120)
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] == len(prompts[1]) == (
        usage["input_tokens"] + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"])


def all_2xx(log, start: int):
    """Every request the proxy recorded since `start` was answered 2xx."""
    calls = read_log(log)[start:]
    assert calls and all(200 <= c["status"] < 300 for c in calls), \
        [(c["path"], c["status"], c["response"][:300]) for c in calls]


def test_codex(tools, served, tmp_path):
    """`codex exec` through /v1/responses: exit 0, every request 2xx, each
    stream ends with response.completed, and what codex prints as its
    answer is the text of the server's last response."""
    server, url, log = served
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "qwen-demo"\nmodel_provider = "local"\n\n[model_providers.local]\n'
        f'name = "mlx_mtp"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
    start = len(read_log(log)) if log.exists() else 0
    out = run([tools[1], "exec", "--skip-git-repo-check", "Say hi"],
              {"CODEX_HOME": str(home), "OPENAI_API_KEY": "anything"}, tmp_path)
    all_2xx(log, start)
    calls = calls_since(log, start, "/v1/responses")
    assert calls
    for c in calls:
        kinds = [e["type"] for e in sse_events(c["response"])]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    completed = sse_events(calls[-1]["response"])[-1]["response"]
    text = "".join(part["text"] for item in completed["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")
    assert text.strip() and text.strip() in out, (text, out[-3000:])


def test_aider(tools, served, tmp_path):
    """aider with one message through /v1/chat/completions (streamed):
    every request 2xx, each stream whole (`[DONE]` after a finish reason),
    and aider prints the streamed answer."""
    server, url, log = served
    start = len(read_log(log)) if log.exists() else 0
    out = run([tools[2], "--model", "openai/qwen-demo", "--openai-api-base", f"{url}/v1",
         "--openai-api-key", "anything", "--message", "def add(a, b):", "--no-git",
         "--yes-always", "--no-show-model-warnings", "--no-check-update",
         "--analytics-disable", "--no-pretty", "--map-tokens", "0"],
        {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, tmp_path)
    all_2xx(log, start)
    calls = calls_since(log, start, "/v1/chat/completions")
    assert calls
    for c in calls:
        assert c["response"].rstrip().endswith("data: [DONE]"), c["response"][-300:]
        assert any(ch["finish_reason"] for e in sse_events(c["response"])
                   for ch in e.get("choices", [])), c["response"][-300:]
    answer = "".join(ch["delta"].get("content") or "" for e in sse_events(calls[-1]["response"])
                     for ch in e.get("choices", []))
    assert answer.strip(), calls[-1]["response"][-300:]
    assert all(line.strip() in out for line in answer.splitlines()), (answer, out[-3000:])
