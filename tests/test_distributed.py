"""A model sharded over two local ranks (`mlx.launch --backend ring`), tensor
and pipeline parallel, Qwen3.5 dense and MoE and qwen4_exp: every rank
decodes in lockstep and rank 0's tokens equal one process's (mlx_lm's and
mlx_mtp's), at depths 1-3 and auto, in batches whose rows accept drafts
partially (the other ranks drafting wrong tokens), with the head's own
drafts, seeded sampling and two turns on one prompt cache; also a pipeline
stage that holds no attention layer, and a rank whose share of the weights is
incomplete (it fails alone, with one line). Each launch is bounded by a
timeout, so a hang fails instead of blocking."""

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_mtp
from mlx_mtp.distributed import check_files, check_loaded, sharded_load
from mlx_mtp.loader import CheckpointError
from mlx_mtp.testing.synthetic import write_checkpoint, write_qwen4_exp_checkpoint
from distributed_worker import mixed_turns
from serving import chat_text, free_port, stopped_chat_text
from util import reference, slow

LAUNCH = shutil.which("mlx.launch")
WORKER = Path(__file__).with_name("distributed_worker.py")
DEPTHS = [1, 2, 3, "auto"]
HEAD_DEPTHS = [2, "auto"]
MAX_TOKENS = 12
pytestmark = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")


def ring(n: int = 2) -> list:
    """mlx.launch of `n` ring ranks on this machine, listening on ports of
    their own: every launch listens from --starting-port up (32323 unless
    told), so two at once (two test workers) would connect to each other's
    ranks."""
    while True:
        base = free_port()
        with contextlib.ExitStack() as held:  # the next n - 1 ports free too
            try:
                for port in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return [LAUNCH, "-n", str(n), "--backend", "ring", "--starting-port", str(base)]


def launch(args, timeout=240):
    """mlx.launch two ring ranks on this machine; the whole process group is
    killed on a timeout. Returns (exit code, output)."""
    cmd = [*ring(), "--python", sys.executable, *args]
    env = dict(os.environ, PYTHONPATH=str(WORKER.parent) + os.pathsep + os.environ.get(
        "PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish in {timeout} s (a hang?):\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """8 layers (each pipeline stage gets an attention layer), a vocabulary
    two ranks can split, weights in three files. qwen4_exp: 2 layers (few
    collectives), attention then GDN with PLE: pipeline rank 0 holds the PLE
    layer (it reads the token ids the first stage sends) and no attention
    layer."""
    root = tmp_path_factory.mktemp("dist")
    kw = dict(shards=3, text_overrides=dict(num_hidden_layers=8, vocab_size=260))
    qwen4_exp = dict(num_hidden_layers=2, vocab_size=260, ple_layer_ids=[2],
                     layer_types=["full_attention", "linear_attention"])
    return {"dense": write_checkpoint(root / "dense", **kw),
            "moe": write_checkpoint(root / "moe", moe=True, seed=1, **kw),
            "qwen4_exp": write_qwen4_exp_checkpoint(root / "qwen4_exp", shards=3,
                                                    text_overrides=qwen4_exp)}


PROMPTS = [[1, 5, 9, 200, 3], [7, 7, 42], list(range(30, 60))]


@functools.lru_cache(maxsize=None)
def one_process(path):
    """One process's tokens (mlx_lm greedy, seeded sampling, two turns)."""
    model, _ = mlx_mtp.load(path)
    ref_model, _ = mlx_mtp.load(path)  # decoded by mlx_lm alone
    greedy = [reference(ref_model, p, MAX_TOKENS) for p in PROMPTS]
    sampler = mlx_mtp.make_sampler(1.0, top_p=0.95)
    sampled = [[int(t) for t, _ in mlx_mtp.generate_step(
        mx.array(p), model, max_tokens=MAX_TOKENS, draft_tokens=2, sampler=sampler, seed=7)]
        for p in PROMPTS]
    cache, turns = model.make_cache(), []
    for p in PROMPTS[:2]:
        turns.append([int(t) for t, _ in mlx_mtp.generate_step(
            mx.array(p), model, max_tokens=MAX_TOKENS, draft_tokens=2, prompt_cache=cache)])
    return greedy, sampled, turns


@pytest.mark.parametrize("kind,mode", [
    ("qwen4_exp", "pipeline"), slow("qwen4_exp", "tensor"), slow("dense", "tensor"),
    slow("dense", "pipeline"), slow("moe", "tensor"), slow("moe", "pipeline")])
def test_sharded_equals_one_process(request, checkpoints, tmp_path, kind, mode):
    # (the default tier's one proof that a sharded model decodes as one
    # process: depth 3 (partial acceptance) and auto, greedy, sampled and two
    # turns; the slow cases every depth)
    every = request.node.get_closest_marker("slow") is not None
    _sharded_equals_one_process(checkpoints[kind], tmp_path, mode, every)


@pytest.mark.slow
def test_sharded_tables_on_disk(checkpoints, tmp_path):
    """qwen4_exp tensor parallel with its n-gram tables on disk (each rank
    reads its block of rows from the files, the others as zeros): rank 0's
    tokens equal one process's with the tables in memory, as in the test
    above. (A pipeline refuses them: the stages hung at depth 'auto', a
    stage's host read waiting on a send the lookahead left unsent.)"""
    _sharded_equals_one_process(checkpoints["qwen4_exp"], tmp_path, "tensor", False, "disk")


def _sharded_equals_one_process(path, tmp_path, mode, every, ngram_tables="auto"):
    depths, head_depths = (DEPTHS, HEAD_DEPTHS) if every else ([3, "auto"], ["auto"])
    greedy, sampled, turns = one_process(path)
    # drafts right where a prompt's own continuation says (partial acceptance
    # in every row: the table maps each token to one successor); the ranks
    # whose drafts are not verified draft wrong ones (ranks may compute
    # unequal floats): only the verified rank's may reach any layer
    plan = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "depths": depths,
            "head_depths": head_depths, "drafts_differ": True, "ngram_tables": ngram_tables,
            "continuations": [p[-1:] + g for p, g in zip(PROMPTS, greedy)]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code, out = launch([str(WORKER), str(path), mode, str(tmp_path / "plan.json"),
                        str(tmp_path / "out.json")])
    assert code == 0, out[-3000:]
    assert out.count("done") == 2, out[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["mlx_lm"] == greedy  # mlx_lm's sharded decoding = one process
    for depth in depths:
        assert got[f"bigram_{depth}"] == greedy, depth
    for depth in head_depths:
        assert got[f"head_{depth}"] == greedy, depth
    assert got["bigram_3_accepted"] > 0  # the rollback after partial acceptance ran
    assert got["sampled"] == sampled
    assert got["turns"] == turns
    assert got["host_lookups"] == (ngram_tables == "disk")


@pytest.mark.slow
def test_pipeline_stage_without_attention(tmp_path):
    """Layers 0-2 GDN, layer 3 attention, over two pipeline stages: rank 1
    runs layers 0-1 and holds no attention layer, so no KV offset to count
    the tokens by. It decodes as mlx_lm's pipeline does and as one process
    does, with drafts rolled back on its GDN layers, and a second turn on one
    prompt cache (the trunk length the loop starts from, agreed by the ranks),
    also after an mlx_lm turn on that cache."""
    path = write_checkpoint(tmp_path / "gdn_stage")
    config = json.loads((path / "config.json").read_text())["text_config"]
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    greedy, sampled, turns = one_process(path)
    model, _ = mlx_mtp.load(path)
    assert [[int(t) for t, _ in mlx_mtp.generate_step(
        mx.array(p), model, max_tokens=MAX_TOKENS, draft_tokens=3)] for p in PROMPTS] == greedy
    plan = {"prompts": PROMPTS, "max_tokens": MAX_TOKENS, "depths": [3], "head_depths": [2],
            "continuations": [p[-1:] + g for p, g in zip(PROMPTS, greedy)],
            "mixed_turns": True}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code, out = launch([str(WORKER), str(path), "pipeline", str(tmp_path / "plan.json"),
                        str(tmp_path / "out.json")])
    assert code == 0, out[-3000:]
    assert out.count("done") == 2, out[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["mlx_lm"] == greedy  # mlx_lm's own pipeline decodes this split
    assert got["bigram_3"] == greedy
    assert got["bigram_3_accepted"] > 0  # partial acceptance: GDN rollback on both stages
    assert got["head_2"] == greedy
    assert got["sampled"] == sampled
    assert got["turns"] == turns
    # after an mlx_lm turn the stage without attention drops the head's kept
    # hidden too (the stages agree): every rank's head is one process's
    tokens, head_length = mixed_turns(model, PROMPTS, MAX_TOKENS)
    assert got["mixed_turns"] == tokens
    assert got["mixed_head_lengths"] == [head_length] * 2


def _one_stage_file(path: Path, layers: range) -> tuple:
    """A weight file of a checkpoint that holds only tensors of `layers`
    (no other stage reads it), and its first tensor."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    for file in sorted(set(weight_map.values())):
        names = sorted(n for n, f in weight_map.items() if f == file)
        found = [re.search(r"(?:^|\.)layers\.(\d+)\.", n) for n in names]
        if all(m and int(m.group(1)) in layers for m in found):
            return path / file, names[0]
    raise AssertionError(f"no weight file of {path} holds only layers {layers}")


class _Stage:
    """What mlx_lm's pipeline() reads of a group: this rank of two."""

    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank

    def size(self):
        return 2


def test_a_rank_checks_its_share(tmp_path):
    """The sharded load is lenient (a pipeline stage has only its own files),
    so a rank checks what its share reads: a missing or truncated file, a
    tensor missing from the checkpoint or of the wrong shape fails it with one
    line naming the file and the tensor, instead of leaving random weights.
    In one process here (the ranks' own lines: test_cli_and_a_failing_rank)."""
    six = write_checkpoint(tmp_path / "six", shards=6,
                           text_overrides=dict(num_hidden_layers=8, vocab_size=260))
    file, tensor = _one_stage_file(six, range(0, 4))
    data = file.read_bytes()
    file.unlink()
    with pytest.raises(FileNotFoundError, match=re.escape(
            f"{file} (listed in model.safetensors.index.json) is missing: this rank's "
            f"tensor-parallel share needs its tensor {tensor}")):
        sharded_load(six)
    check_files(six, 4, 8, "pipeline stage")  # the other stage does not read it
    # the lenient load leaves the file's weights at random; only the stage
    # keeping them refuses
    for rank, fails in ((0, False), (1, True)):
        model, _ = mlx_mtp.load(six, lazy=True, strict=False)
        assert model.unset_weights
        model.text_model.pipeline(_Stage(rank))
        if fails:
            with pytest.raises(CheckpointError, match=r"weight \S+layers\.[12]\.\S+ is missing "
                                                      r"from the checkpoint \(this rank's x"):
                check_loaded(model, six, "x")
        else:
            check_loaded(model, six, "x")
    file.write_bytes(data[:-5000])
    with pytest.raises(CheckpointError, match=re.escape(f"{file}: tensor ") + r"\S+ is truncated"):
        sharded_load(six)
    # one file, no index: a tensor missing, or of the wrong shape
    one = write_checkpoint(tmp_path / "one")
    weights = mx.load(str(one / "model.safetensors"))
    name = "model.language_model.layers.1.linear_attn.dt_bias"
    shape = tuple(weights[name].shape)
    for broken, why in (({k: v for k, v in weights.items() if k != name},
                         "is missing from the checkpoint"),
                        ({**weights, name: weights[name][:-1]},
                         f"has shape {(shape[0] - 1,)}, expected {shape}")):
        mx.save_safetensors(str(one / "model.safetensors"), broken)
        with pytest.raises(CheckpointError, match=re.escape(
                f"{one / 'model.safetensors'}: weight language_model.model.layers.1."
                f"linear_attn.dt_bias {why} (this rank's tensor-parallel share needs it)")):
            sharded_load(one)
    model, _ = mlx_mtp.load(write_checkpoint(tmp_path / "whole"))
    assert model.unset_weights is None  # a strict load checks all itself
    # one layer cannot make two pipeline stages: mlx_lm's pipeline() refuses
    # before anything loads
    small = write_checkpoint(tmp_path / "small", text_overrides=dict(
        num_hidden_layers=1, full_attention_interval=1))
    with pytest.raises(ValueError, match=re.escape("split [1, 0] must be positive and sum to 1")):
        sharded_load(small, pipeline_group=_Stage(1))


@pytest.mark.slow
def test_cli_and_a_failing_rank(checkpoints, tmp_path):
    """`mlx.launch ... -m mlx_mtp.generate --model M` prints rank 0's text once;
    a rank that cannot load its share (a weight file only its pipeline stage
    reads is missing) stops the launch (generate or server) with its one line
    naming the file and a tensor, while the other rank waits at the load
    barrier: no hang, no traceback, no port left bound."""
    path = checkpoints["dense"]
    model, tok = mlx_mtp.load(path)
    want = mlx_mtp.generate(model, tok, "hello", max_tokens=10, draft_tokens=2)
    for mode in ([], ["--pipeline"]):
        code, out = launch(["-m", "mlx_mtp.generate", "--model", str(path), "--prompt", "hello",
                            "--ignore-chat-template", "--max-tokens", "10",
                            "--draft-tokens", "2", *mode], timeout=180)
        assert code == 0, out[-3000:]
        assert out.count(want) == 1, (want, out[-2000:])
    # 8 layers in six files: rank 1's stage runs layers 0-3 (mlx_lm gives the
    # first layers to the last rank), and one file holds only some of those
    six = write_checkpoint(tmp_path / "six", shards=6,
                           text_overrides=dict(num_hidden_layers=8, vocab_size=260))
    file, tensor = _one_stage_file(six, range(0, 4))
    file.unlink()
    line = (f"error: rank 1: {file} (listed in model.safetensors.index.json) is missing: "
            f"this rank's pipeline stage (layers 0-3) needs its tensor {tensor}\n")
    code, out = launch(["-m", "mlx_mtp.generate", "--model", str(six), "--pipeline",
                        "--max-tokens", "4"], timeout=120)
    # (mlx.launch itself exits 0 and reports each rank's exit code: the failing
    # rank 1, or rank 0 losing its peer, exits 1 first and the other is stopped)
    assert "exited with code 1" in out and "exited with code 0" not in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert line in out, out[-2000:]
    assert "error: rank 0: " + str(file) not in out, out[-2000:]  # rank 0 does not read it
    # the server: the same line, and the port free again
    port = free_port()
    code, out = launch(["-m", "mlx_mtp.server", "--model", str(six), "--pipeline",
                        "--port", str(port)], timeout=120)
    assert "exited with code 1" in out and "exited with code 0" not in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert line in out, out[-2000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# -- the server over two ranks -------------------------------------------------------------
SERVER_CHATS = [
    dict(messages=[{"role": "user", "content": "hello"}], max_tokens=10),
    dict(messages=[{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "def f(x):"}], max_tokens=8),
    dict(messages=[{"role": "user", "content": "import os"},
                   {"role": "assistant", "content": "import sys"},
                   {"role": "user", "content": "x = 1"}], max_tokens=12),
    dict(messages=[{"role": "user", "content": "abc"}], max_tokens=6, stop=["\n"]),
]


def _sampled(server, seed):
    r = server.openai(timeout=120).chat.completions.create(
        model="default_model", messages=SERVER_CHATS[0]["messages"], max_tokens=8,
        temperature=1.0, top_p=0.95, seed=seed, extra_body={"num_draft_tokens": 2})
    return r.choices[0].message.content


def _two_turns(server):
    client = server.openai(timeout=120)
    messages = [{"role": "user", "content": "def read(path):"}]
    first = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=8, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "def write(path):"}]
    second = client.chat.completions.create(model="default_model", messages=messages,
                                            max_tokens=8, temperature=0)
    return (first.choices[0].message.content, second.choices[0].message.content,
            second.usage.prompt_tokens_details.cached_tokens)


@pytest.fixture(scope="module")
def one_process_servers(checkpoints, tmp_path_factory):
    """mlx_lm.server and mlx_mtp.server, each one process, on the dense checkpoint."""
    from serving import Server

    logs, path = tmp_path_factory.mktemp("servers"), str(checkpoints["dense"])
    started = []
    try:
        started.append(Server(["mlx_lm", "server", "--model", path], logs / "mlx_lm.log"))
        started.append(Server(["mlx_mtp.server", "--model", path], logs / "mtp.log"))
        lm, one = started
        yield {"greedy": [stopped_chat_text(lm, c) for c in SERVER_CHATS],
               "sampled": _sampled(one, 3), "turns": _two_turns(one)}
    finally:
        for s in started:
            s.close()


@pytest.mark.parametrize("mode", [slow("tensor"), slow("pipeline")])  # sharding: the test above
def test_server_over_two_ranks(checkpoints, one_process_servers, tmp_path, mode):
    """`mlx.launch ... -m mlx_mtp.server --model M [--pipeline]`: rank 0 serves
    HTTP, rank 1 follows. Concurrent requests (rows joining and leaving the
    batch on both ranks together) get mlx_lm.server's text; seeded sampling
    and a second turn from the prefix cache equal one process; a client that
    leaves mid-stream stops its row on both ranks; bad input gets a 400.
    Tensor: a Ctrl-C (SIGINT to the launch's process group) stops every rank
    cleanly. Pipeline: rank 1 killed while a row decodes stops rank 0 with one line,
    no hang."""
    import requests
    from serving import Server

    want = one_process_servers
    s = Server(["mlx_mtp.server", "--model", str(checkpoints["dense"]),
                *(["--pipeline"] if mode == "pipeline" else [])], tmp_path / "server.log",
               launch=ring(), timeout=180)
    try:
        jobs = [lambda c=c, i=i: chat_text(s, c, stream=i % 2 == 1)
                for i, c in enumerate(SERVER_CHATS)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            assert list(pool.map(lambda job: job(), jobs)) == want["greedy"]
        assert _sampled(s, 3) == want["sampled"]
        first, second, cached = _two_turns(s)
        assert (first, second) == want["turns"][:2] and cached == want["turns"][2] > 0
        # a client leaving: its row (decoding alone: logit_bias, no EOS) stops
        # on both ranks; a row that went on would hold the next request for minutes
        body = json.dumps(dict(messages=SERVER_CHATS[0]["messages"], max_tokens=3000,
                               stream=True, logit_bias={"258": -100}))
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                          f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
                          ).encode())
            seen = b""
            while seen.count(b"data: ") < 3:
                seen += sock.recv(4096)
        t0 = time.time()
        assert chat_text(s, SERVER_CHATS[1]) == want["greedy"][1]
        assert time.time() - t0 < 90
        r = requests.post(s.url + "/v1/chat/completions", json={"messages": []})
        assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
        assert requests.get(s.url + "/health").json() == {"status": "ok"}
        if mode == "pipeline":  # rank 1 killed while a row decodes: rank 0's evaluation
            # may wait on it for good (a pipeline recv), or raise (a collective)
            with socket.create_connection(("127.0.0.1", s.port)) as sock:
                sock.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-"
                              f"Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                              f"{body}").encode())
                seen = b""
                while seen.count(b"data: ") < 3:
                    seen += sock.recv(4096)
                os.kill(_rank_pid(s.proc.pid, 1), signal.SIGKILL)
                s.proc.wait(timeout=90)  # mlx.launch returns once rank 0 has stopped
    finally:
        clean = s.close()
    log = s.text()
    assert clean, log[-3000:]
    if mode == "pipeline":
        assert "rank 1 exited with code -9" in log and "rank 0 exited with code 1" in log, \
            log[-3000:]
        assert "rank 0: ERROR - generation stopped: " in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    else:
        assert "exited with code" not in log and "was killed" not in log, log[-3000:]


@pytest.mark.slow
def test_a_rank_lost_inside_a_prefill(checkpoints, tmp_path):
    """Rank 1 killed while a pipelined prefill runs: rank 0's evaluation waits
    on its recv for good (MLX raises only in collectives), so rank 0 stops
    --shutdown-grace plus RANK_GRACE_S after mlx.launch's SIGTERM, with one
    line, instead of hanging."""
    import requests
    from serving import Server

    s = Server(["mlx_mtp.server", "--model", str(checkpoints["dense"]), "--pipeline",
                "--prefill-step-size", "32", "--shutdown-grace", "0"], tmp_path / "server.log",
               launch=ring(), timeout=180)
    text = " ".join(f"w{i}" for i in range(700))  # ~2000 tokens: 60 pipelined chunks

    def ask():
        with contextlib.suppress(requests.RequestException):  # (rank 0 exits mid-request)
            requests.post(s.url + "/v1/chat/completions", json=dict(
                messages=[{"role": "user", "content": text}], max_tokens=5))

    client = threading.Thread(target=ask, daemon=True)
    try:
        client.start()
        deadline = time.time() + 60
        while "Prompt processing progress" not in s.text() and time.time() < deadline:
            time.sleep(0.05)
        os.kill(_rank_pid(s.proc.pid, 1), signal.SIGKILL)
        t0 = time.time()
        s.proc.wait(timeout=90)
        stopped_after = time.time() - t0
    finally:
        clean = s.close()
    log = s.text()
    assert clean and stopped_after < 60, log[-3000:]
    assert "rank 0 exited with code 1" in log, log[-3000:]
    assert re.search(r"rank 0: ERROR - generation stopped: .*(lost|did not answer)", log), \
        log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def _rank_pid(group: int, rank: int) -> int:
    """The pid of the process in this process group that runs `rank`."""
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or os.getpgid(int(proc.name)) != group:
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
            cmd = (proc / "cmdline").read_bytes()
        except (OSError, ProcessLookupError):
            continue
        if f"MLX_RANK={rank}".encode() in env and b"mlx_mtp.server" in cmd:
            return int(proc.name)
    raise AssertionError(f"no process of rank {rank} in group {group}")
