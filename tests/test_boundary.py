"""Bad input at every boundary ends in one clear error, never a crash.

The CLI runs as a real process over a table of mistakes (no death by signal,
no traceback, exit code 2 for arguments and 1 for unusable model folders,
the message's key words); the API is probed with random ids, shapes and
numbers (hypothesis); memory stays flat over 20 generations with the garbage
collector off; Ctrl-C keeps the text generated so far.
"""

import gc
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generation_stream

import mlx_mtp
from mlx_mtp.loop import generate_tokens
from mlx_mtp.testing.synthetic import write_checkpoint
from util import SHORT, reference

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


def run_cli(args, stdin=None, timeout=120):
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.generate", *args], input=stdin,
                       capture_output=True, timeout=timeout)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


CLI_CASES = [  # (arguments, stdin, exit code, words the message must contain)
    (["--max-tokens", "0"], None, 2, ["max_tokens", "at least 1"]),
    (["--max-tokens", "ten"], None, 2, ["--max-tokens"]),
    (["--logit-bias", '{"999999": 5}'], None, 2, ["logit_bias", "999999", "vocabulary"]),
    (["--logit-bias", "{bad"], None, 2, ["--logit-bias", "not valid JSON"]),
    (["--logit-bias", "[1, 2]"], None, 2, ["--logit-bias", "JSON object"]),
    (["--logit-bias", '{"x": 1}'], None, 2, ["logit_bias", "'x'"]),
    (["--chat-template-config", "{bad"], None, 2, ["--chat-template-config", "JSON"]),
    (["--min-p", "2"], None, 2, ["min_p", "[0, 1]"]),
    (["--top-p", "2"], None, 2, ["top_p", "[0, 1]"]),
    (["--temp", "-1"], None, 2, ["temp", "[0, 100]"]),
    (["--draft-temp", "-1"], None, 2, ["draft_temp"]),
    (["--prefill-step-size", "0"], None, 2, ["prefill_step_size"]),
    (["--draft-tokens", "99"], None, 2, ["draft_tokens", "0..16"]),
    (["--draft-tokens", "-1"], None, 2, ["draft_tokens"]),
    (["--max-draft-tokens", "0"], None, 2, ["max_draft_tokens"]),
    (["--top-k", "-3"], None, 2, ["top_k"]),
    (["--ignore-chat-template", "--prompt", ""], None, 2, ["prompt is empty"]),
    (["--prompt", "-"], b"\xff\xfe\xfd", 2, ["not valid UTF-8"]),
    (["--model", "/no/such/folder"], None, 1, ["does not exist"]),
]


@pytest.mark.parametrize("args,stdin,code,words", CLI_CASES,
                         ids=[" ".join(c[0])[:40] for c in CLI_CASES])
def test_cli_mistakes(args, stdin, code, words):
    rc, out, err = run_cli(["--max-tokens", "4", *args] if "--max-tokens" not in args else args,
                           stdin)
    assert rc == code, err
    assert "Traceback" not in err and "Segmentation" not in err
    message = err.strip().splitlines()[-1]
    for w in words:
        assert w in message, message


@pytest.fixture(scope="module")
def broken_folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("broken")
    src = write_checkpoint(base / "ok", seed=5)

    def variant(name, change):
        d = base / name
        shutil.copytree(src, d)
        change(d)
        return d

    def no_tokenizer(d):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (d / f).unlink()

    return [
        (variant("no_tokenizer", no_tokenizer), ["no tokenizer files"]),
        (variant("index_not_json", lambda d: (d / "model.safetensors.index.json").write_text(
            "{oops")), ["model.safetensors.index.json", "not valid JSON"]),
        (variant("index_no_map", lambda d: (d / "model.safetensors.index.json").write_text("{}")),
         ["weight_map"]),
        (variant("config_list", lambda d: (d / "config.json").write_text("[1, 2]")),
         ["config.json", "JSON object"]),
        (variant("config_bad", lambda d: (d / "config.json").write_text("{bad")),
         ["config.json", "not valid JSON"]),
        (variant("no_weights", lambda d: (d / "model.safetensors").unlink()),
         ["safetensors"]),
        (variant("truncated", lambda d: (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:5000])), ["model.safetensors", "truncated"]),
    ]


def test_cli_unusable_model_folders(broken_folders):
    for folder, words in broken_folders:
        rc, out, err = run_cli(["--model", str(folder), "--max-tokens", "3"])
        assert rc == 1 and "Traceback" not in err, (folder.name, err)
        message = err.strip().splitlines()[-1]
        assert all(w in message for w in words), (folder.name, message)


def test_ctrl_c_keeps_the_text():
    """Ctrl-C while generating: the text so far, a newline, one line, exit 130."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_mtp.generate", "--max-tokens", "-1",
                             "--verbose", "--prompt", "def f(x):"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.set_blocking(proc.stdout.fileno(), False)
    seen, deadline = b"", time.time() + 120
    while seen.count(b"=") < 10 or len(seen.split(b"=" * 10, 1)[-1]) < 20:
        chunk = proc.stdout.read() or b""
        seen += chunk
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    err = err.decode()
    assert "Traceback" not in err and "interrupted after" in err.strip().splitlines()[-1]
    assert (seen + out).decode(errors="replace").rstrip().count("\n") >= 1


# -- the API, probed at random ---------------------------------------------------------
@pytest.fixture(scope="module")
def small(loaded):
    model, ref_model, tok = loaded("dense")
    return model, ref_model, model.vocab_size


@settings(max_examples=40, deadline=None, database=None)
@given(ids=st.lists(st.integers(-3, 262), min_size=0, max_size=6),
       max_tokens=st.one_of(st.integers(-2, 4), st.floats(-1, 4), st.booleans(), st.none(),
                            st.text(max_size=2)),
       depth=st.one_of(st.integers(-2, 20), st.just("auto"), st.floats(0, 3), st.text(max_size=3)))
def test_api_rejects_or_matches_mlx_lm(small, ids, max_tokens, depth):
    """Any prompt ids, max_tokens and draft_tokens: a ValueError/TypeError that
    names the argument, or exactly mlx_lm's tokens."""
    model, ref_model, V = small
    try:
        gen = generate_tokens(mx.array(ids, dtype=mx.int32), model, max_tokens=max_tokens,
                              draft_tokens=depth)
        got = [t for t, _, _ in itertools.islice(gen, 5)]  # -1: no limit
        gen.close()
    except (ValueError, TypeError) as e:
        message = str(e)
        assert any(n in message for n in ("prompt", "max_tokens", "draft_tokens")), message
        bad = (not ids or any(not 0 <= t < V for t in ids)
               or not (isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
                       and max_tokens >= -1)
               or not (depth == "auto" or (isinstance(depth, int) and 0 <= depth <= 16)
                       or (isinstance(depth, str) and depth.isdigit() and int(depth) <= 16)))
        assert bad, f"refused valid input: {message}"
        return
    n = min(max_tokens, 5) if max_tokens >= 0 else 5
    assert got == reference(ref_model, ids, n) and len(got) == n


@settings(max_examples=25, deadline=None, database=None)
@given(temp=st.one_of(st.floats(-2, 3), st.just(float("nan"))), top_p=st.floats(-1, 2), min_p=st.floats(-1, 2),
       top_k=st.integers(-3, 5))
def test_sampler_settings_checked(temp, top_p, min_p, top_k):
    ok = temp >= 0 and 0 <= top_p <= 1 and 0 <= min_p <= 1 and top_k >= 0
    try:
        mlx_mtp.make_sampler(temp, top_p=top_p, min_p=min_p, top_k=top_k)
    except (ValueError, TypeError) as e:
        assert not ok and any(n in str(e) for n in ("temp", "top_p", "min_p", "top_k"))
        return
    assert ok


# -- memory over many generations ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["pipelined", "sync", "abandoned"])
def test_memory_flat_over_20_generations(loaded, mode):
    """20 generations with the garbage collector off: active memory does not
    grow (within 1 MiB), with and without a prompt cache kept by the caller
    (its growth is the cache's own size)."""
    model, _, tok = loaded("dense")
    ids = mx.array(tok.encode(SHORT))
    kw = dict(lookahead=mode != "sync", draft_tokens=2)
    list(generate_tokens(ids, model, max_tokens=30, **kw))  # graphs, allocator
    mx.clear_cache()
    gc.collect()
    gc.disable()
    try:
        base = mx.get_active_memory()
        for _ in range(20):
            gen = generate_tokens(ids, model, max_tokens=30, **kw)
            if mode == "abandoned":
                for _ in range(4):
                    next(gen)
            else:
                for _ in gen:
                    pass
            del gen
        mx.synchronize(generation_stream)  # a cycle queued past the end may still run
        grown = mx.get_active_memory() - base
    finally:
        gc.enable()
    assert grown < 1 << 20, f"{grown} bytes more after 20 generations"
