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


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    """The clients, installed: (claude, codex, aider) executables."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed (Node.js): the npm clients cannot be installed")
    root = tmp_path_factory.mktemp("clients")
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(root),
                    CLAUDE_CODE, CODEX], check=True, capture_output=True, timeout=600)
    venv = root / "aider"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIDER], check=True,
                   capture_output=True, timeout=900)
    bin_ = root / "node_modules" / ".bin"
    return bin_ / "claude", bin_ / "codex", venv / "bin" / "aider"


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
    cache (system prompt, tools, the reminder blocks before the user's text:
    snapshots inside a message; what follows the user's text, `-p`'s
    environment as a system message rendered in its place, cannot be a
    shared prefix); count_tokens takes its request's body as sent."""
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


def test_codex(tools, served, tmp_path):
    """`codex exec` through /v1/responses: exit 0, each stream ends with
    response.completed."""
    server, url, log = served
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        'model = "qwen-demo"\nmodel_provider = "local"\n\n[model_providers.local]\n'
        f'name = "mlx_mtp"\nbase_url = "{url}/v1"\nwire_api = "responses"\n')
    start = len(read_log(log)) if log.exists() else 0
    out = run([tools[1], "exec", "--skip-git-repo-check", "Say hi"],
              {"CODEX_HOME": str(home), "OPENAI_API_KEY": "anything"}, tmp_path)
    assert out.strip()
    calls = calls_since(log, start, "/v1/responses")
    assert calls and all(c["status"] == 200 for c in calls), [c["status"] for c in calls]
    for c in calls:
        kinds = [e["type"] for e in sse_events(c["response"])]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds


def test_aider(tools, served, tmp_path):
    """aider with one message through /v1/chat/completions (streamed)."""
    server, url, log = served
    start = len(read_log(log)) if log.exists() else 0
    run([tools[2], "--model", "openai/qwen-demo", "--openai-api-base", f"{url}/v1",
         "--openai-api-key", "anything", "--message", "def add(a, b):", "--no-git",
         "--yes-always", "--no-show-model-warnings", "--no-check-update",
         "--analytics-disable", "--no-pretty", "--map-tokens", "0"],
        {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, tmp_path)
    calls = calls_since(log, start, "/v1/chat/completions")
    assert calls and all(c["status"] == 200 for c in calls)
    assert calls[-1]["response"].rstrip().endswith("data: [DONE]")
