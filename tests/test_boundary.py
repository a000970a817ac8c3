"""Bad input at every boundary ends in one clear error, never a crash.

The CLI runs as a real process over a table of mistakes (no death by signal,
no traceback, exit code 2 for arguments and 1 for unusable model folders
and prompt caches, the message's key words); the API is probed with random
ids, shapes and numbers (hypothesis) and a table of wrong types; memory stays
flat over 20 generations with the garbage collector off; Ctrl-C and SIGTERM
keep the text generated so far, which is printed as it is generated.
"""

import gc
import importlib
import io
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
from mlx_mtp.decode import generate_tokens
from mlx_mtp.testing.synthetic import write_checkpoint
from util import SHORT, reference, slow

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


def cli_here(args, capsys, monkeypatch, stdin=None):
    """`python -m mlx_mtp.generate` in this process: `main` is what it
    runs (its exit code, its stdout and stderr); the process itself is tested
    by the tests that start one."""
    from mlx_mtp.cli import main

    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    try:
        rc = main(args)
    except SystemExit as e:  # (argparse)
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


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
    (["--prompt-cache-file", "/no/such/cache.safetensors"], None, 1,
     ["cannot read the prompt cache", "/no/such/cache.safetensors", "no such file"]),
]


@pytest.mark.parametrize("args,stdin,code,words", CLI_CASES,
                         ids=[" ".join(c[0])[:40] for c in CLI_CASES])
def test_cli_mistakes(args, stdin, code, words, capsys, monkeypatch):
    rc, _, err = cli_here(["--max-tokens", "4", *args] if "--max-tokens" not in args else args,
                          capsys, monkeypatch, stdin)
    assert rc == code, err
    assert "Traceback" not in err and "Segmentation" not in err
    message = err.strip().splitlines()[-1]
    for w in words:
        assert w in message, message


@pytest.mark.parametrize("module,cli", [("mlx_mtp.generate", "mlx_mtp.cli"),
                                        ("mlx_mtp.server", "mlx_mtp.server.cli")])
def test_a_cli_error_is_one_line_not_after_the_usage_block(module, cli, capsys):
    """argparse prints its usage block (twenty lines) before the error; here
    the error is the whole of stderr (each CLI's `main`, in this process)."""
    with pytest.raises(SystemExit) as e:
        importlib.import_module(cli).main(["--max-tokens", "ten"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"python -m {module}: error: argument --max-tokens")


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


def test_cli_unusable_model_folders(broken_folders, capsys, monkeypatch):
    for folder, words in broken_folders:
        rc, out, err = cli_here(["--model", str(folder), "--max-tokens", "3"], capsys,
                                monkeypatch)
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


def test_cli_corrupt_prompt_cache(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "cache.safetensors"
    bad.write_bytes(b"not a safetensors file")
    rc, out, err = cli_here(["--max-tokens", "3", "--prompt-cache-file", str(bad)], capsys,
                            monkeypatch)
    assert rc == 1 and "Traceback" not in err, err
    line = err.strip().splitlines()[-1]
    assert "cannot read the prompt cache" in line and str(bad) in line


def test_sigterm_keeps_the_streamed_text():
    """Without --verbose the text is printed as it is generated (a `timeout`
    or a CI job stopping it keeps what was made); SIGTERM is handled as
    Ctrl-C: a newline, one line on stderr, exit 143."""
    proc = subprocess.Popen([sys.executable, "-m", "mlx_mtp.generate", "--max-tokens", "-1",
                             "--prompt", "def f(x):"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        seen, deadline = b"", time.time() + 120
        while len(seen) < 40:  # streamed: text arrives while it still generates
            seen += proc.stdout.read() or b""
            assert proc.poll() is None, "it stopped by itself"
            assert time.time() < deadline, "no text while generating"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143
    err = err.decode()
    assert "Traceback" not in err and "interrupted after" in err.strip().splitlines()[-1]
    text = (seen + out).decode(errors="replace")
    assert text.startswith(seen.decode(errors="replace")) and text.endswith("\n")


# -- the API's arguments: a wrong type or combination is one line ---------------------------
def _api_cases(model, tok):
    ids = tok.encode("def f(x):")
    fn = lambda tokens, logits: logits  # noqa: E731
    gen, stream, step, batch = (mlx_mtp.generate, mlx_mtp.stream_generate,
                                mlx_mtp.generate_step, mlx_mtp.batch_generate)
    first = lambda g: next(iter(g))  # noqa: E731 (generators check when first run)
    return [  # (call, exception, words its message must hold)
        (lambda: gen(model, tok, None), TypeError, ["prompt", "None"]),
        (lambda: gen(model, tok, 5), TypeError, ["prompt", "5"]),
        (lambda: gen(model, tok, b"def f(x):"), TypeError, ["prompt", "bytes"]),
        (lambda: first(step(None, model)), TypeError, ["prompt", "None"]),
        (lambda: first(step("def f(x):", model)), TypeError, ["prompt", "string"]),
        (lambda: batch(model, tok, [ids, None]), TypeError, ["prompts[1]"]),
        (lambda: gen(model, tok, ids, logits_processors=fn), TypeError,
         ["logits_processors", "list"]),
        (lambda: first(step(mx.array(ids), model, logits_processors=fn)), TypeError,
         ["logits_processors", "list"]),
        (lambda: batch(model, tok, [ids], logits_processors=fn), TypeError,
         ["logits_processors", "list"]),
        (lambda: first(stream(model, tok, ids, logits_processors=[5])), TypeError,
         ["logits_processors", "5"]),
        (lambda: gen(model, None, ids), TypeError, ["tokenizer", "None"]),
        (lambda: batch(model, None, [ids]), TypeError, ["tokenizer", "None"]),
        (lambda: first(step(mx.array(ids), model, draft_tokens=2, num_draft_tokens=3)),
         ValueError, ["draft_tokens", "num_draft_tokens", "not both"]),
        (lambda: gen(model, tok, ids, draft_tokens=2, num_draft_tokens=2), ValueError,
         ["draft_tokens", "num_draft_tokens", "not both"]),
    ]


def test_api_argument_mistakes_are_one_line(loaded):
    model, _, tok = loaded("dense")
    for i, (call, kind, words) in enumerate(_api_cases(model, tok)):
        with pytest.raises(kind) as e:
            call()
        message = str(e.value)
        assert "\n" not in message and all(w in message for w in words), (i, message)
    # mlx_lm's name alone still works
    assert mlx_mtp.generate(model, tok, tok.encode("x = "), max_tokens=3,
                            num_draft_tokens=1) == mlx_mtp.generate(
        model, tok, tok.encode("x = "), max_tokens=3, draft_tokens=1)


def test_max_tokens_mistakes_are_worded_alike(loaded):
    model, _, tok = loaded("dense")
    ids = tok.encode("def f(x):")
    messages = {}
    for value in (0, -2):
        with pytest.raises(ValueError) as e:
            mlx_mtp.generate(model, tok, ids, max_tokens=value)
        messages[value] = str(e.value).replace(str(value), "N")
    assert messages[0] == messages[-2] and "max_tokens" in messages[0], messages
    with pytest.raises(ValueError) as e:
        mlx_mtp.batch_generate(model, tok, [ids], max_tokens=0)
    assert str(e.value).replace("0", "N").replace("[N]", "") == messages[0]


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
@pytest.mark.parametrize("mode", ["pipelined", slow("sync"), "abandoned"])
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
