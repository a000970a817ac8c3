"""Fixtures: tiny random checkpoints written in the released HF layout."""

import os
import signal

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# every read cycle compares the host's counters with the device's (rows.Ledger);
# child processes (servers, ranks) inherit it
os.environ.setdefault("MLX_MTP_CHECK_COUNTS", "1")
# A shell that starts the suite in the background (`cmd &` without job control)
# hands it SIGINT ignored, and every process it starts inherits that: the
# Ctrl-C tests would then test nothing. Take SIGINT back (children get the default).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# `nohup` does the same with SIGHUP (the converter's hang-up test)
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)

import mlx_mtp.params  # noqa: E402
from mlx_mtp.testing.synthetic import write_checkpoint  # noqa: E402

# The tests in this process compile every graph at its first use, as a GPU
# does (their short generations would otherwise run eagerly: params.CPU_EAGER_RUNS);
# servers and CLIs they start keep the CPU default. test_compiled checks both.
mlx_mtp.params.CPU_EAGER_RUNS = 0


def _ckpt(factory, name, **kw):
    return write_checkpoint(factory.mktemp(name), **kw)


@pytest.fixture(scope="session")
def dense_ckpt(tmp_path_factory):
    # 8 layers: two attention layers and six GDN layers roll back each cycle
    return _ckpt(tmp_path_factory, "dense", text_overrides={"num_hidden_layers": 8})


@pytest.fixture(scope="session")
def dense_bf16_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "dense_bf16", dtype="bfloat16", seed=1,
                 text_overrides={"num_hidden_layers": 8})


@pytest.fixture(scope="session")
def moe_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "moe", moe=True, seed=2)


@pytest.fixture(scope="session")
def moe_per_expert_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "moe_pe", moe=True, seed=2, per_expert=True)


@pytest.fixture(scope="session")
def no_mtp_ckpt(tmp_path_factory):
    return _ckpt(tmp_path_factory, "nomtp", mtp=False, seed=3)


@pytest.fixture(scope="session")
def q4_ckpt(tmp_path_factory, dense_ckpt):
    """The dense checkpoint converted by mlx_mtp.convert: trunk 4-bit, head 8-bit."""
    from mlx_mtp.convert import convert

    out = tmp_path_factory.mktemp("q4") / "q4"
    return convert(dense_ckpt, out, quantize=True, q_bits=4)["output"]


@pytest.fixture(scope="session")
def loaded(dense_ckpt, dense_bf16_ckpt, moe_ckpt, q4_ckpt):
    """name -> (mlx_mtp model, mlx_lm model, tokenizer), loaded once."""
    import mlx_lm

    import mlx_mtp

    cache = {}

    def get(name):
        if name not in cache:
            path = {"dense": dense_ckpt, "dense_bf16": dense_bf16_ckpt, "moe": moe_ckpt,
                    "q4": q4_ckpt}[name]
            model, tok = mlx_mtp.load(path, quiet=True)
            ref, _ = mlx_lm.load(str(path))
            cache[name] = (model, ref, tok)
        return cache[name]

    return get


@pytest.fixture
def count_host_syncs(monkeypatch):
    """Start counting mx.eval / mx.async_eval calls made by any mlx_mtp module
    (batch, decode, cycle, cache, sampling, families, kernels, ...); returns the list
    of their names, one per call."""
    import sys

    import mlx.core as mx

    import mlx_mtp.decode  # noqa: F401  (the decode path's modules are imported)

    def start():
        calls = []

        class CountingMX:
            def __getattr__(self, name):
                return getattr(mx, name)

            def eval(self, *a, **k):
                calls.append("eval")
                return mx.eval(*a, **k)

            def async_eval(self, *a, **k):
                calls.append("async_eval")
                return mx.async_eval(*a, **k)

        counting = CountingMX()
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "mlx_mtp" and getattr(module, "mx", None) is mx:
                monkeypatch.setattr(module, "mx", counting)
        return calls

    return start
