"""Time to first token for an agent's long prefix: cold, from the disk tier
after a restart, and from RAM; and how fast an entry is restored against
the disk's own read speed.

An agent's request: a system prompt holding its instructions, tool
definitions and the files it read (Python standard library sources, the
demo's kind of text) of about N tokens, then a short task. Per prefix size:

  cold   a server with an empty --prompt-cache-dir: the whole prefix prefilled
  ram    the same server, a new task on the same prefix: its system prompt's
         end is in RAM
  disk   the server restarted (the folder's pages dropped from the OS cache
         first, POSIX_FADV_DONTNEED), a third task: the prefix read from disk

TTFT is measured streamed (request sent -> first token's chunk), each case
`--repeats` times on new tasks (the median printed). The restore speed is
the server's own log line (bytes of the entry / seconds to read, verify and
load it); the disk's read speed is a plain sequential read of the same file
after its pages were dropped. Each request waits `--pause` seconds first,
as an agent's tools take time: the server has then written the previous
answer's entries and prefilled its next-turn prefix, as it does between an
agent's turns. The demo's context is 4096 tokens, so the
bench serves a copy of its folder whose config allows 40960 (the weights
are the demo's: symlinks).

    python bench/prompt_cache_bench.py --sizes 8192 32768
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).parent))
from serve_bench import start, stop  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": name, "description": doc,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}
    for name, doc in [("read_file", "Read a file of the repository."),
                      ("write_file", "Write a file of the repository."),
                      ("run_tests", "Run the test suite and return its output.")]]
TASKS = ["def fibonacci(n):", "class LRUCache:", "def parse_args(argv=None):",
         "def merge_sorted(a, b):", "def read_json(path):", "def quicksort(items):",
         "class Stack:", "def flatten(nested):", "def slugify(text):"]
RESTORED = re.compile(r"prompt cache: (\d+) tokens restored from (\S+) \(([\d.]+) MB in "
                      r"([\d.]+) s")


def long_context_demo(folder: Path, context: int) -> Path:
    """The demo model's folder with max_position_embeddings = context."""
    from mlx_mtp.loader import demo_model_path

    demo = demo_model_path()
    folder.mkdir(parents=True, exist_ok=True)
    for f in demo.iterdir():
        if f.name != "config.json" and not (folder / f.name).exists():
            (folder / f.name).symlink_to(f)
    config = json.loads((demo / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = context
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def agent_system_prompt(tokenizer, tokens: int) -> str:
    """Instructions and files the agent read, about `tokens` tokens."""
    import glob

    text = ("You are a coding agent working in a Python repository. Use the tools to read "
            "and write files; answer with code only.\n\nFiles read so far:\n")
    sources = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    have = len(tokenizer.encode(text))
    for path in sources:
        body = f"\n# file: {os.path.basename(path)}\n" + Path(path).read_text(errors="replace")
        n = len(tokenizer.encode(body))
        if have + n > tokens:
            lines, kept = body.splitlines(keepends=True), []
            for line in lines:  # (the last file cut to fit)
                m = len(tokenizer.encode(line))
                if have + m > tokens:
                    break
                kept.append(line)
                have += m
            return text + "".join(kept)
        text += body
        have += n
    raise ValueError(f"the standard library has fewer than {tokens} tokens here")


def ttft(url: str, system: str, task: str) -> tuple:
    """(seconds to the first token, usage) of one streamed request."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": task}],
            "tools": TOOLS, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage = None, None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return first, usage


def drop_pages(folder: Path):
    """The folder's files out of the OS page cache: the next read is the disk's."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_read_gbps(path: Path) -> float:
    drop_pages(path.parent)
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(8 << 20):
            n += len(chunk)
    return n / 1e9 / (time.perf_counter() - t0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768],
                   help="agent prefix sizes in tokens")
    p.add_argument("--repeats", type=int, default=1, help="requests per case (new tasks)")
    p.add_argument("--work", type=str, default=None, help="folder for the model copy and caches")
    p.add_argument("--pause", type=float, default=2.0,
                   help="seconds between a server's requests (what an agent's tools take)")
    a = p.parse_args()
    import mlx_lm

    work = Path(a.work or tempfile.mkdtemp(prefix="prompt_cache_bench."))
    model = long_context_demo(work / "model", 40960)
    tokenizer = mlx_lm.load(str(model))[1]
    rows = []
    for size in a.sizes:
        system = agent_system_prompt(tokenizer, size)
        cache = work / f"cache-{size}"
        cache.mkdir(parents=True, exist_ok=True)
        argv = ["mlx_mtp.server", "--model", str(model), "--prompt-cache-dir", str(cache),
                "--prompt-cache-disk-bytes", "20GB"]
        log = work / f"server-{size}.log"
        tasks = iter(TASKS * (3 * a.repeats))
        times = {"cold": [], "ram": [], "disk": []}
        cached, restores = {}, []

        def timed(case, url):
            time.sleep(a.pause)  # (an agent runs its tools: the server is idle meanwhile)
            seconds, usage = ttft(url, system, next(tasks))
            times[case].append(seconds)
            cached[case] = usage["prompt_tokens_details"]["cached_tokens"]
            return usage["prompt_tokens"]

        proc = None
        for _ in range(a.repeats):  # cold: a new server on an empty folder each time
            if proc is not None:
                stop(proc)
            for f in cache.iterdir():
                f.unlink()
            proc, url = start(argv, log)
            prompt = timed("cold", url)
        for _ in range(a.repeats):  # RAM: the last cold server, a new task
            timed("ram", url)
        stop(proc)  # (a clean stop: the queued entries are written)
        for _ in range(a.repeats):  # disk: restarted, the folder's pages dropped
            drop_pages(cache)
            proc, url = start(argv, log)
            timed("disk", url)
            stop(proc)
            _, name, mb, seconds = RESTORED.findall(log.read_text())[0]
            restores.append((float(seconds), float(mb), cache / name))
        seconds, entry_mb, path = sorted(restores)[len(restores) // 2]
        restore = entry_mb / 1e3 / seconds
        raw = disk_read_gbps(path)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((size, prompt, med, entry_mb, seconds, restore, raw))
        print(f"{size}: prompt {prompt} tokens; TTFT cold {med['cold']:.2f} s, disk "
              f"{med['disk']:.3f} s, RAM {med['ram']:.3f} s; cached tokens {cached}", flush=True)
    print()
    print("| prefix | prompt tokens | TTFT cold | disk hit (restart) | RAM hit | disk / cold | "
          "RAM / cold | entry | its restore | restore speed | the disk's read |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size, prompt, med, entry_mb, seconds, restore, raw in rows:
        print(f"| {size // 1024}K | {prompt} | {med['cold']:.2f} s | {med['disk']:.3f} s | "
              f"{med['ram']:.3f} s | {med['disk'] / med['cold']:.3f}x | "
              f"{med['ram'] / med['cold']:.3f}x | {entry_mb:.0f} MB | {seconds:.3f} s | "
              f"{restore:.2f} GB/s | {raw:.2f} GB/s |")


if __name__ == "__main__":
    main()
