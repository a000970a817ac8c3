"""Serving load bench: mlx_mtp.server against mlx_lm.server, workload by workload.

Both servers are started by the bench (same model, same environment) and
stay up; every round runs each workload on one server, then on the other
(the order flips every round), so the two always meet the machine in the
same state. Each run starts once both servers are idle (no CPU time for
0.3 s): work a server does after its answers (mlx_mtp's prefill of the next
turn, cache writes) never runs inside the other's timed window. Per workload it prints every round's completion tokens per
second of wall time (all completion tokens of the workload / its wall time),
the median of the rounds' ratios mlx_mtp / mlx_lm (the paired ratio), time
to first token p50 / p95 (streamed workloads; `agent` is not streamed, so
its column is the whole request's latency), errors, and whether every
greedy answer was the same text on both servers.

Workloads (every round uses new prompts, so no round is served from the
previous round's prefix cache; within a round both servers get the same ones):
  single   1 client, 4 greedy chats one after another, 96 tokens each
  same4    4 concurrent clients, greedy, 3 chats each, 64 tokens
  mixed4   4 concurrent clients with different settings, 3 chats each, 64
           tokens: greedy; temperature 0.7 + top_p 0.9 + seed; temperature
           1.0 + seed; greedy + logit_bias
  same8    8 concurrent clients, greedy, 2 chats each, 64 tokens
  agent    1 client, a 4-turn conversation (system prompt + ~400 tokens of
           code per turn, the history growing), 64 tokens a turn, not streamed
Workloads whose requests follow each other without waiting for an idle
server, as real clients' do (the idle wait is before the workload only):
  after_agent  agent's conversation (not timed), then at once single's 4 lone
           chats one after another (timed): lone requests right after an agent
  turn_ttft  4 times: an agent's turn ends (a history of ~2K tokens after the
           first), and at that moment another client sends a short streamed
           chat (8 tokens): its time to first token (TTFT column); then the
           same request after a 3 s pause (printed beside it)
  sequence single, same4, mixed4, same8 and agent back to back, as one timed
           stream of mixed traffic
Run only when named (--workloads):
  penalties  1 client, 4 greedy chats with presence_penalty 0.5 (mlx_lm's
             default context of 20 tokens), 96 tokens each
  mixedpen   4 concurrent clients, greedy, 3 chats each, 64 tokens; one with
             frequency_penalty 0.3
  long       1 client, one chat with a ~2K-token prompt (5 pieces of code),
             64 tokens, streamed
  xtc        1 client, 4 chats sampling with XTC (temperature 0.8,
             xtc_probability 0.5, xtc_threshold 0.1, seeded), 96 tokens each
  json1free3 the mixed grammar workload: 1 client asks for JSON (2 chats, up
             to 256 tokens) while 3 free clients chat greedily (3 chats each,
             64 tokens; compared with mlx_lm.server's answers); with same4 in
             the same run it prints the free clients' tok/s per client beside
             same4's, on each server (a constrained row must not slow them)
  json       4 concurrent clients, each with its own JSON schema
             (bench/schemas/*.json) as `response_format`, 2 chats each, up to
             256 tokens, greedy: prints how many answers are complete JSON
             valid under their schema on each server (mlx_lm.server ignores
             response_format: its answers are free text, not compared with
             ours; ours must all be valid, else the bench exits 1)
  jsonlen    json's requests, mlx_lm.server held to each of our answers'
             lengths (mlx_mtp runs first): decode against decode
  json1      1 client, json's weather schema, 4 chats one after another (an
             agent's structured calls: a batch of one row, whose forced runs
             are verified alone)

On Linux CPU use an fp32 model with OpenBLAS preloaded (docs/design.md); the
servers inherit the environment:

    OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
      python bench/serve_bench.py --rounds 7
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))

TASKS = [
    "def fibonacci(n):", "class LRUCache:\n    def __init__(self, capacity):",
    "import os\n\ndef walk_files(root):", "def parse_args(argv=None):",
    "def merge_sorted(a, b):", "class Matrix:\n    def __mul__(self, other):",
    "def read_json(path):", "class Stack:\n    def __init__(self):",
    "import re\n\ndef slugify(text):", "def quicksort(items):",
    "def flatten(nested):", "class Timer:\n    def __enter__(self):",
]
SYSTEM = ("You are a coding agent working in a Python repository. Read the code the user "
          "shows you, then answer with code only, in the style of the repository.")
ASKS = ["Write a helper for the code above.", "Now a test for it.", "Add a docstring.",
        "Make it faster."]
# mixed4's four clients: (name, request fields)
MIXED = [("greedy", {"temperature": 0}),
         ("t0.7 top_p0.9 seed", {"temperature": 0.7, "top_p": 0.9, "seed": 1}),
         ("t1.0 seed", {"temperature": 1.0, "seed": 2}),
         ("greedy logit_bias", {"temperature": 0, "logit_bias": {"10": -5.0, "11": 2.0}})]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, log: Path, env=None, cwd=None):
    """`python -m ARGV` on a free port (`env`: variables besides ours), once
    /health answers: (process, URL). It runs in `cwd` (default: the log's
    folder): `python -m` imports a package from its current folder first."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", *argv, "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})),
                            cwd=cwd or log.resolve().parent)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            break
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{' '.join(argv)} did not start (log: {log})")


def stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc; 0 elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def wait_quiet(procs, window: float = 0.3, limit: float = 60.0) -> float:
    """Wait until no server works in the background (a prefill of a next turn,
    a cache write after the last answer), so that no workload is timed while
    the other server still computes. Returns the seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit:
        before = [cpu_seconds(p.pid) for p in procs]
        time.sleep(window)
        if all(cpu_seconds(p.pid) - b < 0.05 * window for p, b in zip(procs, before)):
            break
    return time.perf_counter() - t0


def peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# -- one request ---------------------------------------------------------------------------------
def chat(url, messages, max_tokens, fields=None, stream=True) -> dict:
    """One chat completion: its text, completion tokens, finish reason, TTFT
    (streamed) or latency, or the error."""
    return _request(url + "/v1/chat/completions", {"messages": messages}, max_tokens, fields,
                    stream, lambda choice: choice.get("delta", {}).get("content"),
                    lambda choice: choice["message"].get("content"))


def complete(url, prompt: str, max_tokens: int, fields=None) -> dict:
    """One streamed text completion (/v1/completions), as `chat` reports it."""
    return _request(url + "/v1/completions", {"prompt": prompt}, max_tokens, fields, True,
                    lambda choice: choice.get("text"), lambda choice: choice.get("text"))


def _request(endpoint: str, body: dict, max_tokens: int, fields, stream: bool, delta_of,
             text_of) -> dict:
    """One request (greedy unless `fields` say otherwise); `delta_of` /
    `text_of`: a streamed chunk's / a whole answer's text from its choice."""
    body = {**body, "max_tokens": max_tokens, "temperature": 0, **(fields or {})}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    first, text, usage, finish = None, "", {}, None
    try:
        with requests.post(endpoint, json=body, stream=stream, timeout=600) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
            if not stream:
                out = r.json()
                text = text_of(out["choices"][0]) or ""
                usage = out.get("usage") or {}
                finish = out["choices"][0].get("finish_reason")
            else:
                for line in r.iter_lines(decode_unicode=True):
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    if chunk.get("choices"):
                        finish = chunk["choices"][0].get("finish_reason") or finish
                        delta = delta_of(chunk["choices"][0])
                        if delta:
                            first = first or time.perf_counter()
                            text += delta
    except requests.RequestException as e:
        return {"error": type(e).__name__}
    end = time.perf_counter()
    if finish is None:  # a server that fails after the headers ends the stream early
        return {"error": "the answer ended without a finish_reason"}
    return {"text": text, "tokens": usage.get("completion_tokens", 0), "finish": finish,
            "start": t0, "end": end,
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
            "prompt_tokens": usage.get("prompt_tokens", 0), "mtp": usage.get("mtp"),
            "ttft": (first or end) - t0 if stream else end - t0}


# -- workloads: each returns the list of request results -------------------------------------------
def _task(rnd: int, i: int) -> str:
    # a new first line per round and request: no round reuses another's prefix
    return f"# task {rnd}.{i}\n{TASKS[(rnd * 5 + i) % len(TASKS)]}"


def clients(url, n_clients: int, per_client: int, max_tokens: int, rnd: int, fields=None):
    def client(c):
        out = []
        for j in range(per_client):
            f = fields[c] if fields else {}
            r = chat(url, [{"role": "user", "content": _task(rnd, c * per_client + j)}],
                     max_tokens, f)
            r["greedy"] = not f.get("temperature")
            out.append(r)
        return out

    with ThreadPoolExecutor(n_clients) as pool:
        return [r for rs in pool.map(client, range(n_clients)) for r in rs]


def code_chunks(rnd: int, n: int, chars: int = 1150) -> list:
    """n pieces of real Python (~400 demo tokens each), different every round."""
    files = sorted(Path(inspect.getfile(json)).parent.parent.glob("*.py"))
    out, k = [], rnd * n
    while len(out) < n:
        text = files[k % len(files)].read_text(errors="replace")
        start = (k * 977) % max(1, len(text) - chars)
        out.append(text[start:start + chars])
        k += 1
    return out


def agent(url, max_tokens: int, rnd: int, turns: int = 4, after_turn=None):
    """An agent's conversation; `after_turn(i)` runs the moment turn i's
    answer arrived (turn_ttft's other client)."""
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for i, chunk in enumerate(code_chunks(rnd, turns)):
        messages.append({"role": "user", "content": f"```python\n{chunk}\n```\n{ASKS[i]}"})
        r = chat(url, messages, max_tokens, stream=False)
        r["greedy"] = True
        out.append(r)
        messages.append({"role": "assistant", "content": r.get("text", "")})
        if after_turn is not None:
            after_turn(i)
    return out


SEARCH = "<<<<<<< SEARCH"


def edit_prompts(rnd: int, n: int, window_lines: int = 40) -> list:
    """n edit prompts, different every round: a window of a stdlib file, then
    the start of an aider SEARCH block that re-types one of its lines (what
    an agent copies: the model goes on re-typing the window, or should;
    train/copy_model.py's `search_prompt` layout)."""
    files = sorted(Path(inspect.getfile(json)).parent.parent.glob("*.py"))
    out, k = [], rnd * n + 7
    while len(out) < n:
        f = files[(k * 31) % len(files)]
        k += 1
        lines = f.read_text(errors="replace").split("\n")
        if len(lines) < window_lines + 20:
            continue
        start = (k * 131) % (len(lines) - window_lines)
        window = lines[start:start + window_lines]
        cands = [i for i in range(5, window_lines - 12) if window[i].strip()]
        if not cands:
            continue
        i = cands[(k * 17) % len(cands)]
        rel = f.name
        out.append(f"{rel}\n```python\n" + "\n".join(window) + "\n```\n\n"
                   + f"{rel}\n```python\n{SEARCH}\n" + window[i])
    return out


def edits(url, rnd: int, fields=None, per_client: int = 4, max_tokens: int = 128):
    """One client's edit requests in turn (text completions)."""
    out = []
    for j, prompt in enumerate(edit_prompts(rnd, per_client)):
        f = dict(fields or {})
        if f.get("temperature"):
            f["seed"] = rnd * 100 + j
        r = complete(url, prompt, max_tokens, f)
        r["greedy"] = not f.get("temperature")
        out.append(r)
    return out


def after_agent(url, rnd: int):
    """agent's conversation, then at once 4 lone chats: only those are timed."""
    untimed = [dict(r, timed=False) for r in agent(url, 64, rnd + 100)]
    return untimed + clients(url, 1, 4, 96, rnd)


PAUSE_S = 3.0  # turn_ttft: the pause before its request's second send (the idle case)


def turn_ttft(url, rnd: int):
    """A short streamed chat sent the moment each of an agent's turns ends
    (its TTFT is what is measured: `ttft`), and again after a pause
    (`ttft_idle`)."""
    out = []

    def other(i):
        ask = [{"role": "user", "content": _task(rnd + 200, i)}]
        r = chat(url, ask, 8)
        time.sleep(PAUSE_S)
        idle = chat(url, [{"role": "user", "content": _task(rnd + 300, i)}], 8)
        out.append(dict(r, greedy=True, ttft_idle=idle.get("ttft")))

    untimed = [dict(r, timed=False) for r in agent(url, 64, rnd + 400, after_turn=other)]
    return untimed + out


def sequence(url, rnd: int):
    """The default workloads back to back, no idle wait between them."""
    return [r for w in ("single", "same4", "mixed4", "same8", "agent")
            for r in WORKLOADS[w](url, rnd + 500)]


def long_prompt(url, rnd: int):
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "\n".join(code_chunks(rnd + 50, 5)) + "\nExplain."}]
    r = chat(url, messages, 64)
    r["greedy"] = True
    return [r]


SCHEMAS = {p.stem: json.loads(p.read_text())
           for p in sorted((Path(__file__).parent / "schemas").glob("*.json"))}
ASK_JSON = {"weather": "Give the weather forecast for a city as JSON.",
            "person": "Describe a programmer as JSON.",
            "review": "Review the code above as JSON.",
            "todo": "Write a to-do item for the code above as JSON."}


def valid_json(text: str, schema: dict) -> bool:
    """The answer is one JSON document valid under `schema` (jsonschema)."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def json_clients(url, rnd: int, per_client: int = 2, max_tokens: int = 256, names=None,
                 lengths=None):
    """4 concurrent clients (or one per name), each asking for its own schema's
    JSON. `lengths`: a dict (client, chat) -> answer length, filled when empty,
    and else each request's max_tokens (jsonlen)."""
    names = names or list(SCHEMAS)[:4]
    record = lengths is not None and not lengths

    def client(c):
        out = []
        for j in range(per_client):
            name = names[c]
            fmt = {"type": "json_schema", "json_schema": {"name": name, "strict": True,
                                                          "schema": SCHEMAS[name]}}
            limit = max_tokens if lengths is None or record else max(lengths.get((c, j), 1), 1)
            r = chat(url, [{"role": "user", "content": f"{_task(rnd, c * per_client + j)}\n"
                                                       f"{ASK_JSON.get(name, 'Answer as JSON.')}"}],
                     limit, {"response_format": fmt})
            r["greedy"] = False  # (mlx_lm.server's answers are free text: not compared)
            if "error" not in r:
                r["valid"] = r["finish"] == "stop" and valid_json(r["text"], SCHEMAS[name])
                if record:
                    lengths[(c, j)] = r["tokens"]
            out.append(r)
        return out

    with ThreadPoolExecutor(len(names)) as pool:
        return [r for rs in pool.map(client, range(len(names))) for r in rs]


def json1free3(url, rnd: int):
    """One client under a JSON schema beside three free greedy ones."""
    with ThreadPoolExecutor(2) as pool:
        constrained = pool.submit(lambda: json_clients(url, rnd, names=["weather"]))
        free = clients(url, 3, 3, 64, rnd)
        return constrained.result() + [dict(r, free=True) for r in free]


WORKLOADS = {
    "single": lambda url, rnd: clients(url, 1, 4, 96, rnd),
    "same4": lambda url, rnd: clients(url, 4, 3, 64, rnd),
    "mixed4": lambda url, rnd: clients(url, 4, 3, 64, rnd, fields=[f for _, f in MIXED]),
    "same8": lambda url, rnd: clients(url, 8, 2, 64, rnd),
    "agent": lambda url, rnd: agent(url, 64, rnd),
}
DEFAULT = list(WORKLOADS)
# workloads whose requests follow each other without waiting for idle
FOLLOWING = {"after_agent": after_agent, "turn_ttft": turn_ttft, "sequence": sequence}
WORKLOADS.update(FOLLOWING)
WORKLOADS.update({
    "penalties": lambda url, rnd: clients(url, 1, 4, 96, rnd,
                                          fields=[{"presence_penalty": 0.5}]),
    "mixedpen": lambda url, rnd: clients(url, 4, 3, 64, rnd,
                                         fields=[{}, {}, {}, {"frequency_penalty": 0.3}]),
    "long": long_prompt,
    "xtc": lambda url, rnd: clients(url, 1, 4, 96, rnd, fields=[{
        "temperature": 0.8, "xtc_probability": 0.5, "xtc_threshold": 0.1, "seed": 4}]),
    "json": json_clients,
    # one client's structured answers in turn (the batch of one row jumps its forced runs)
    "json1": lambda url, rnd: json_clients(url, rnd, per_client=4, names=["weather"]),
    "json1free3": json1free3,
    # an agent re-typing its context (issue 63): greedy, and sampled
    "edit": lambda url, rnd: edits(url, rnd),
    "edit_sampled": lambda url, rnd: edits(url, rnd, {"temperature": 0.7, "top_p": 0.95}),
})
# jsonlen: json's requests, mlx_mtp.server first, then mlx_lm.server with each
# request's max_tokens set to the length of mlx_mtp's answer to it (the same
# number of tokens per request on both, so prompts weigh alike; per round)
_LENGTHS: dict = {}
WORKLOADS["jsonlen"] = lambda url, rnd: json_clients(url, rnd,
                                                     lengths=_LENGTHS.setdefault(rnd, {}))


def run_order(workload: str, order: list) -> list:
    return ["mlx_mtp", "mlx_lm"] if workload == "jsonlen" else order


def run(workload: str, url: str, rnd: int) -> dict:
    """One workload on one server: tok/s (completion tokens of its timed
    requests over their wall time), TTFTs, errors, greedy texts."""
    t0 = time.perf_counter()
    results = WORKLOADS[workload](url, rnd)
    wall = time.perf_counter() - t0
    untimed = [r for r in results if r.get("timed") is False]
    results = [r for r in results if r.get("timed") is not False]
    ok = [r for r in results if "error" not in r]
    if untimed and ok:  # (only the timed requests' span)
        t0 = min(r["start"] for r in ok)
        wall = max(r["end"] for r in ok) - t0
    tokens = sum(r["tokens"] for r in ok)
    # each free client's tok/s (workloads of free greedy chats: all their requests)
    free = [r for r in ok if r.get("free") or (workload != "json1free3" and r["greedy"])]
    per_client = (sum(r["tokens"] for r in free) / (max(r["end"] for r in free) - t0)
                  / (3 if workload == "json1free3" else 4)) if free else float("nan")
    return {"tps": tokens / wall, "wall": wall, "tokens": tokens, "free_client_tps": per_client,
            "errors": [r["error"] for r in results if "error" in r],
            "valid": [r["valid"] for r in ok if "valid" in r],
            "ttft": [r["ttft"] for r in ok],
            "ttft_idle": [r["ttft_idle"] for r in ok if r.get("ttft_idle") is not None],
            "greedy_texts": [r.get("text") if r["greedy"] else None for r in results]}


def measure(servers: dict, workloads: list, rounds: int, out: Path, said=None, cwd=None):
    """Start the servers ({name: (argv, env)}), warm each workload up on
    each, then run `rounds` rounds: every workload on every server in turn,
    the order rotating round by round, each run started once all servers
    are idle (`wait_quiet`: no server's background work runs inside
    another's timed window; a FOLLOWING workload waits only before it
    starts). `said(round, workload, {name: run()})` after each workload;
    `cwd`: the servers' folder (`start`).
    Returns ({workload: [{name: run()} per round]}, {name: peak RSS MB})."""
    procs, urls = {}, {}
    results = {w: [] for w in workloads}
    try:
        for name, (argv, env) in servers.items():
            procs[name], urls[name] = start(argv, out.with_suffix(f".{name}.log"), env, cwd)
        for w in workloads:  # warm up: graphs traced, first allocations
            for name in run_order(w, list(servers)):
                run(w, urls[name], -1)
        names = list(servers)
        for rnd in range(rounds):
            shift = rnd % len(names)
            order = names[shift:] + names[:shift]
            for w in workloads:
                runs = {}
                for name in run_order(w, order):
                    wait_quiet(procs.values())
                    runs[name] = run(w, urls[name], rnd)
                results[w].append(runs)
                if said is not None:
                    said(rnd, w, runs)
        rss = {name: peak_rss_mb(proc.pid) for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            stop(proc)
    return results, rss


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded demo model")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--workloads", default=",".join(DEFAULT),
                   help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--mtp-args", default="", help="extra flags for mlx_mtp.server")
    p.add_argument("--json", default="bench/results/serve_bench.json")
    args = p.parse_args(argv)
    workloads = args.workloads.split(",")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOADS)}")
    from bench import blas_in_use, machine_info
    from mlx_mtp.loader import resolve_model_path

    model = str(Path(resolve_model_path(args.model)).resolve())
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    servers = {"mlx_lm": ["mlx_lm", "server", "--model", model],
               "mlx_mtp": ["mlx_mtp.server", "--model", model, *args.mtp_args.split()]}
    print(f"model {model}; BLAS {blas_in_use()}; {args.rounds} rounds; workloads "
          f"{', '.join(workloads)}", flush=True)
    def said(rnd, w, pair):
        lm, mtp = pair["mlx_lm"], pair["mlx_mtp"]
        print(f"round {rnd + 1} {w:>6}: mlx_lm {lm['tps']:6.1f} tok/s, mlx_mtp "
              f"{mtp['tps']:6.1f} tok/s, ratio {mtp['tps'] / lm['tps']:.2f}x"
              + (f", errors {lm['errors'] + mtp['errors']}"
                 if lm["errors"] or mtp["errors"] else "")
              + (f", valid JSON mlx_lm {sum(lm['valid'])}/{len(lm['valid'])} mlx_mtp "
                 f"{sum(mtp['valid'])}/{len(mtp['valid'])}" if mtp["valid"] else ""),
              flush=True)

    rounds, rss = measure({name: (argv, None) for name, argv in servers.items()}, workloads,
                          args.rounds, out, said)

    summary = {}
    for w in workloads:
        rs = rounds[w]
        ratios = [r["mlx_mtp"]["tps"] / r["mlx_lm"]["tps"] for r in rs]
        # greedy answers that differ: (round, request, mlx_lm's text, mlx_mtp's)
        diffs = [(i, j, a, b) for i, r in enumerate(rs) for j, (a, b) in enumerate(
            zip(r["mlx_lm"]["greedy_texts"], r["mlx_mtp"]["greedy_texts"])) if a != b]
        compared = sum(a is not None for r in rs for a in r["mlx_lm"]["greedy_texts"])
        row = {"ratio": statistics.median(ratios), "ratios": ratios, "equal": not diffs,
               "compared": compared,
               "differ": [{"round": i + 1, "request": j, "mlx_lm": a, "mlx_mtp": b}
                          for i, j, a, b in diffs]}
        for name in servers:
            ttft = [t for r in rs for t in r[name]["ttft"]]
            checked = [v for r in rs for v in r[name]["valid"]]
            row[name] = {"tps": [r[name]["tps"] for r in rs],
                         "ttft_p50": pct(ttft, 0.5), "ttft_p95": pct(ttft, 0.95),
                         "errors": sum(len(r[name]["errors"]) for r in rs),
                         "valid": sum(checked), "checked": len(checked)}
        summary[w] = row
    print(f"\n{args.rounds} rounds, servers alternated; tok/s = completion tokens / wall time "
          "of the workload; ratio = median over rounds of mlx_mtp / mlx_lm")
    print("| workload | mlx_lm tok/s (median) | mlx_mtp tok/s (median) | mlx_mtp / mlx_lm "
          "(median of pairs) [min-max] | TTFT p50 / p95, mlx_lm | TTFT p50 / p95, mlx_mtp "
          "| errors | greedy answers equal |")
    print("|---|---|---|---|---|---|---|---|")
    for w, row in summary.items():
        lm, mtp = row["mlx_lm"], row["mlx_mtp"]
        note = " (latency)" if w == "agent" else ""
        print(f"| {w} | {statistics.median(lm['tps']):.1f} | {statistics.median(mtp['tps']):.1f} "
              f"| {row['ratio']:.2f}x [{min(row['ratios']):.2f}-{max(row['ratios']):.2f}] "
              f"| {lm['ttft_p50']:.2f} / {lm['ttft_p95']:.2f} s{note} "
              f"| {mtp['ttft_p50']:.2f} / {mtp['ttft_p95']:.2f} s{note} "
              f"| {lm['errors'] + mtp['errors']} "
              f"| {('yes' if row['equal'] else 'NO') if row['compared'] else 'n/a'} |")
    if "json1free3" in rounds and "same4" in rounds:
        for name in servers:
            mixed = [r[name]["free_client_tps"] for r in rounds["json1free3"]]
            alone = [r[name]["free_client_tps"] for r in rounds["same4"]]
            print(f"{name}: a free client's tok/s beside one JSON client / among four free ones "
                  f"(same4), median over rounds: {statistics.median(mixed):.1f} / "
                  f"{statistics.median(alone):.1f} = "
                  f"{statistics.median(m / a for m, a in zip(mixed, alone)):.2f}x")
    for w, row in summary.items():
        if row["mlx_mtp"]["checked"]:
            print(f"{w}: complete JSON valid under the request's schema: " + ", ".join(
                f"{n} {row[n]['valid']}/{row[n]['checked']} "
                f"({row[n]['valid'] / max(row[n]['checked'], 1):.0%})" for n in servers)
                + " (mlx_lm.server ignores response_format)")
    for w, row in summary.items():
        for d in row["differ"]:
            at = next((i for i, (x, y) in enumerate(zip(d["mlx_lm"] or "", d["mlx_mtp"] or ""))
                       if x != y), min(len(d["mlx_lm"] or ""), len(d["mlx_mtp"] or "")))
            print(f"{w}: round {d['round']} request {d['request']}: greedy answers differ "
                  f"from character {at} (both texts in the JSON)")
    if "turn_ttft" in rounds:
        for name in servers:
            after = [t for r in rounds["turn_ttft"] for t in r[name]["ttft"]]
            idle = [t for r in rounds["turn_ttft"] for t in r[name]["ttft_idle"]]
            print(f"turn_ttft {name}: TTFT as a turn ends p50 {pct(after, 0.5) * 1000:.0f} ms, "
                  f"after a {PAUSE_S:g} s pause p50 {pct(idle, 0.5) * 1000:.0f} ms")
    print("peak RSS: " + ", ".join(f"{n} {v:.0f} MB" for n, v in rss.items()))
    out.write_text(json.dumps({"machine": machine_info(), "args": vars(args),
                               "command": " ".join([sys.executable] + sys.argv),
                               "summary": summary, "peak_rss_mb": rss,
                               "rounds": {w: [{n: {k: v for k, v in r[n].items()
                                                   if k != "greedy_texts"} for n in r}
                                              for r in rs] for w, rs in rounds.items()}},
                              indent=1))
    ok = all(r["equal"] and not r["mlx_lm"]["errors"] and not r["mlx_mtp"]["errors"]
             and r["mlx_mtp"]["valid"] == r["mlx_mtp"]["checked"] for r in summary.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
