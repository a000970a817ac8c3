"""Each kernel checks itself against its reference once, on first use in a
process, before it runs for a user (metal/selfcheck.py). Here the kernels run
in the emulator (MLX_MTP_KERNELS=emu-metal) and faults are injected into
their sources: one that does not compile and one that computes wrong values
each give one warning line naming the kernel, and the reference runs from
then on, with the right result. --verbose says which path each kernel took."""

import logging
import os
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_mtp.metal as K
from mlx_mtp.metal import launch, selfcheck

from kernel_checks import gdn_inputs


@pytest.fixture(autouse=True)
def emulated(monkeypatch):
    monkeypatch.setenv("MLX_MTP_KERNELS", "emu-metal")
    monkeypatch.delenv("MLX_MTP_FAST_KERNELS", raising=False)
    selfcheck.reset()
    yield
    selfcheck.reset()


def _commit_args(dtype=mx.float32):
    ks = mx.random.split(mx.random.key(11), 4)
    states = [mx.random.normal((1, 3, 1, 4, 8), key=ks[i]) for i in range(2)]
    convs = [mx.random.normal((1, 6, 16), key=ks[2 + i]).astype(dtype) for i in range(2)]
    return states, convs, mx.array(2, dtype=mx.int32), 4


def _equal(got, want):
    return all(mx.array_equal(g, w).item() for g, w in zip(got, want))


def _spy(monkeypatch, name):
    calls = []
    real = getattr(launch, name)
    monkeypatch.setattr(launch, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "self-check" in r.getMessage()]


def test_kernels_that_pass_their_check_run(caplog, monkeypatch):
    calls = _spy(monkeypatch, "commit")
    args = _commit_args()
    for _ in range(2):
        got = K.commit(*args)
        assert _equal([t for layer in got for t in layer],
                      [t for layer in K.commit_ref(*args) for t in layer])
    assert len(calls) == 3  # the check once, then each call
    h = mx.random.normal((2, 64), key=mx.random.key(5))
    w = mx.random.normal((128, 64), key=mx.random.key(6))
    vals, ids = K.draft_project(h, w, top_k=4)
    assert mx.array_equal(ids, K.draft_project_ref(h, w, top_k=4)[1]).item()
    assert not _warnings(caplog)
    paths = selfcheck.paths()
    assert paths["commit"] == paths["draft_project"] == "emu-metal kernel (self-checked)"
    assert paths["gdn_verify"] == "not used"


def test_a_kernel_that_does_not_compile_warns_once_and_the_reference_runs(caplog,
                                                                          monkeypatch):
    calls = _spy(monkeypatch, "commit")
    args = _commit_args()
    want = [t for layer in K.commit_ref(*args) for t in layer]
    with launch.override_source("commit", "metal", "this is not a kernel ;"):
        for _ in range(3):
            assert _equal([t for layer in K.commit(*args) for t in layer], want)
    assert len(calls) == 1  # the check; the calls ran the reference
    lines = _warnings(caplog)
    assert len(lines) == 1 and "commit" in lines[0] and "\n" not in lines[0], lines
    assert "compile" in lines[0]
    assert selfcheck.paths()["commit"].startswith("reference (the emu-metal kernel failed")


@pytest.mark.parametrize("kernel", ["conv_verify", "gdn_verify"])
def test_a_kernel_that_computes_wrong_values_warns_once_and_the_reference_runs(
        caplog, monkeypatch, kernel):
    if kernel == "conv_verify":  # (a kernel only in fused mode)
        monkeypatch.setenv("MLX_MTP_FAST_KERNELS", "1")
        source, old, new = "conv_verify", "acc += xv *", "acc -= xv *"
        args = (mx.random.normal((1, 3, 64)), mx.random.normal((1, 2, 64)),
                mx.random.normal((64, 4, 1)))
        want = K.conv_verify_ref(*args)
    else:  # the exact path (Dk % 32 == 0): the recurrence's delta update flipped
        source = "gdn_verify"
        old, new = "st[i] = st[i] + kv[i] * delta;", "st[i] = st[i] - kv[i] * delta;"
        args = gdn_inputs(1, 2, 1, 1, 32, 32, mx.float32)
        want = K.gdn_verify_ref(*args)
    text = launch.load_source(source, "metal")
    assert old in text
    calls = _spy(monkeypatch, kernel)
    with launch.override_source(source, "metal", text.replace(old, new, 1)):
        for _ in range(2):
            got = getattr(K, kernel)(*args)
            assert all(mx.allclose(g, w, rtol=1e-5, atol=1e-5).item()
                       for g, w in zip(got, want))
    assert len(calls) == 1
    lines = _warnings(caplog)
    assert len(lines) == 1 and kernel in lines[0] and "off by" in lines[0], lines
    assert selfcheck.paths()[kernel].startswith("reference")


@pytest.mark.parametrize("backend", ["ref", "emu-metal"])
def test_verbose_cli_says_which_path_each_kernel_took(backend):
    env = dict(os.environ, MLX_MTP_KERNELS=backend)
    r = subprocess.run([sys.executable, "-m", "mlx_mtp.generate", "--verbose", "--max-tokens",
                        "4"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("Kernels"))
    paths = dict(part.split(": ", 1) for part in line.split(": ", 1)[1].split("; "))
    assert set(paths) == set(selfcheck.KERNELS), line
    assert paths["qmv_rows"] == "not used"  # the demo is not quantized
    del paths["qmv_rows"]
    if backend == "ref":
        assert set(paths.values()) == {"reference (the CPU runs the ops references)"}
    else:  # the default (exact) policy: conv_verify runs plain decoding's ops
        assert paths["conv_verify"].startswith("reference (exact mode")
        for kernel in ("gdn_verify", "commit", "draft_project"):
            assert paths[kernel] == "emu-metal kernel (self-checked)", line
