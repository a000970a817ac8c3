"""Load benchmark: mlx_mtp.server and mlx_lm.server on the same model, one run.

Starts both servers as processes on local ports (one at a time, so they do
not share the CPU), then N concurrent clients send a fixed list of streaming
chat requests to each. Prints requests/s, time to first token and per-request
decode tok/s (p50 / p90), errors (must be 0), the servers' peak resident
memory, and whether every answer equals mlx_lm.server's (temperature 0).

    python bench/serve_bench.py --clients 4 --requests 16 --max-tokens 64
    python bench/serve_bench.py --turns 5     # a conversation: TTFT per turn, with and
                                              # without the prefix cache
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

PROMPTS = ["def fibonacci(n):", "class LRUCache:\n    def __init__(self, capacity):",
           "import os\n\ndef walk_files(root):", "def parse_args(argv=None):",
           "def merge_sorted(a, b):", "class Matrix:\n    def __mul__(self, other):"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, log):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", *argv, "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.ConnectionError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{argv} did not start (log: {log})")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def one_request(url, prompt, max_tokens):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    text, n = "", 0
    try:
        with requests.post(url + "/v1/chat/completions", json=body, stream=True,
                           timeout=600) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            for line in r.iter_lines(decode_unicode=True):
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if delta:
                    if first is None:
                        first = time.perf_counter()
                    text += delta
                    n += 1
    except requests.RequestException as e:
        return {"error": type(e).__name__}
    end = time.perf_counter()
    return {"text": text, "ttft": (first or end) - t0,
            "tps": (n - 1) / (end - first) if first and n > 1 else float("nan")}


def run_load(url, args):
    reqs = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    one_request(url, "warm up", 8)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        results = list(pool.map(lambda p: one_request(url, p, args.max_tokens), reqs))
    return results, time.perf_counter() - t0


def conversation(url, turns, max_tokens, context):
    """One chat growing turn by turn (a long first message); per turn: prompt
    tokens, cached tokens, time to first token, the answer."""
    messages, out = [], []
    asks = ["Write a helper for the code above.", "Now a test for it.", "Add a docstring.",
            "Make it faster.", "Explain the change."]
    for i in range(turns):
        content = (context + "\n\n" if i == 0 else "") + asks[i % len(asks)]
        messages.append({"role": "user", "content": content})
        t0 = time.perf_counter()
        r = requests.post(url + "/v1/chat/completions", timeout=600, json={
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
        first, text, usage = None, "", {}
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text += chunk["choices"][0]["delta"]["content"]
        out.append({"prompt_tokens": usage.get("prompt_tokens"),
                    "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "ttft": (first or time.perf_counter()) - t0, "text": text})
        messages.append({"role": "assistant", "content": text})
    return out


def pct(xs, q):
    xs = sorted(x for x in xs if x == x)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded demo model")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--turns", type=int, default=0,
                   help="instead: one conversation of this many turns (TTFT per turn)")
    p.add_argument("--json", default="bench/results/serve.json")
    args = p.parse_args(argv)
    from mlx_mtp.load import resolve_model_path

    model = str(resolve_model_path(args.model))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if args.turns:
        return turns_main(args, model)
    rows = {}
    for name, argv in [("mlx_lm.server", ["mlx_lm", "server", "--model", model]),
                       ("mlx_mtp.server", ["mlx_mtp.server", "--model", model])]:
        proc, url = start(argv, Path(args.json).with_suffix(f".{name}.log"))
        try:
            results, wall = run_load(url, args)
            rss = peak_rss_mb(proc.pid)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
        ok = [r for r in results if "error" not in r]
        rows[name] = {
            "requests_per_s": len(ok) / wall, "errors": len(results) - len(ok),
            "ttft_p50": pct([r["ttft"] for r in ok], 0.5), "ttft_p90": pct([r["ttft"] for r in ok], 0.9),
            "tps_p50": pct([r["tps"] for r in ok], 0.5), "tps_p90": pct([r["tps"] for r in ok], 0.9),
            "peak_rss_mb": rss, "texts": [r.get("text") for r in results], "wall_s": wall}
    same = rows["mlx_mtp.server"]["texts"] == rows["mlx_lm.server"]["texts"]
    print(f"model {model}; {args.clients} concurrent clients, {args.requests} streaming chat "
          f"requests of {args.max_tokens} tokens each, temperature 0")
    print(f"{'server':>15} {'req/s':>6} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s p50':>9} "
          f"{'tok/s p90':>9} {'errors':>6} {'peak RSS':>9}")
    for name, r in rows.items():
        print(f"{name:>15} {r['requests_per_s']:>6.2f} {r['ttft_p50']:>8.2f}s {r['ttft_p90']:>8.2f}s "
              f"{r['tps_p50']:>9.1f} {r['tps_p90']:>9.1f} {r['errors']:>6} {r['peak_rss_mb']:>7.0f}MB")
    print(f"answers identical to mlx_lm.server: {'yes' if same else 'NO'}")
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "identical": same,
                                           "command": " ".join([sys.executable] + sys.argv)},
                                          indent=1))
    return 0 if same and all(r["errors"] == 0 for r in rows.values()) else 1


def turns_main(args, model) -> int:
    context = Path(json.__file__).with_name("decoder.py").read_text()[:6000]
    runs = {}
    for name, argv in [("mlx_lm.server", ["mlx_lm", "server", "--model", model]),
                       ("mlx_mtp.server", ["mlx_mtp.server", "--model", model]),
                       ("mlx_mtp.server, no cache", ["mlx_mtp.server", "--model", model,
                                                    "--prompt-cache-size", "0"])]:
        proc, url = start(argv, Path(args.json).with_suffix(".turns.log"))
        try:
            one_request(url, "warm up", 8)
            runs[name] = conversation(url, args.turns, args.max_tokens, context)
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    names = list(runs)
    print(f"model {model}; one conversation of {args.turns} turns (first message: "
          f"{len(context)} characters of code), {args.max_tokens} tokens per answer, "
          "temperature 0; time to first token per turn (cached prompt tokens)")
    print(f"{'turn':>4} {'prompt':>6} " + " ".join(f"{n:>26}" for n in names))
    for i in range(args.turns):
        cells = " ".join(f"{runs[n][i]['ttft']:>17.2f}s ({runs[n][i]['cached'] or 0:>5})"
                         for n in names)
        print(f"{i + 1:>4} {runs[names[0]][i]['prompt_tokens'] or 0:>6} {cells}")
    same = all([t["text"] for t in runs[n]] == [t["text"] for t in runs[names[0]]] for n in names)
    print(f"answers identical across the three: {'yes' if same else 'NO'}")
    Path(args.json).write_text(json.dumps({"args": vars(args), "turns": runs, "identical": same,
                                           "command": " ".join([sys.executable] + sys.argv)},
                                          indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
