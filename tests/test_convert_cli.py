"""`python -m mlx_mtp.convert`: signals at named points (a real process), bad inputs (its `main`).

The rules (convert/__main__.py, convert/interrupts.py):
- exit 0 exactly when the output was published, and then it is complete; a
  signal that arrives after publishing changes nothing (still 0, one line says so);
- SIGINT -> 130, SIGTERM -> 143 before publishing: no output (an existing
  output / --graft target unchanged), no temporary folder left, one line, no traceback;
- a bad input: exit 1 (bad arguments: argparse's 2), one line, no traceback,
  nothing on disk changed.

The signal tests are deterministic: MLX_MTP_CONVERT_PAUSE=POINT makes the
converter print a marker and wait at POINT; the test sends the signal then.
Each process costs about 2 s of start-up (importing mlx_lm), so the processes
of this module run two at a time, started when the module's first test needs
them; each test waits for its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest

import mlx_mtp
from mlx_mtp.convert.interrupts import PAUSED_MARKER
from mlx_mtp.testing.synthetic import write_checkpoint

REPO = Path(mlx_mtp.__file__).resolve().parents[1]  # the checkout this test imports
INT, TERM, KILL = signal.SIGINT, signal.SIGTERM, signal.SIGKILL
WORKERS = 2


# -- running the converter ------------------------------------------------------------
@dataclass
class Run:
    rc: int
    out: str
    err: str
    reached: Optional[bool]  # the pause point was reached (None: no pause asked)

    def lines(self, prefix="mlx_mtp.convert:") -> List[str]:
        return [ln for ln in self.err.replace("\r", "\n").splitlines() if ln.startswith(prefix)]


def _env(pause: Optional[str]) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("MLX_MTP_DEBUG", "MLX_MTP_CONVERT_PAUSE", "MLX_MTP_CONVERT_PAUSE_TIMEOUT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if pause:
        env["MLX_MTP_CONVERT_PAUSE"] = pause
        env["MLX_MTP_CONVERT_PAUSE_TIMEOUT"] = "30"
    return env


def run_cli(args: List[str], cwd: Path, pause: Optional[str] = None, sig: Optional[int] = None) -> Run:
    """Run the converter; with `pause`, wait for its marker there, then send `sig`."""
    p = subprocess.Popen([sys.executable, "-m", "mlx_mtp.convert", *map(str, args)], cwd=cwd, env=_env(pause),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # a Ctrl-C on the test run does not reach it
    try:
        head, reached = [], None
        if pause:
            reached = False
            for line in p.stderr:  # ends at EOF if the point is never reached
                head.append(line)
                if line.rstrip("\n").endswith(f"{PAUSED_MARKER} {pause}"):  # may follow a progress bar
                    reached = True
                    p.send_signal(sig)
                    break
        err = "".join(head) + p.stderr.read()  # the same buffered stream: nothing lost
        out = p.stdout.read()  # small: it cannot fill the pipe while stderr is read
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return Run(rc, out, err, reached)


def tree(path: Path) -> Dict[str, Tuple]:
    """relative path -> (kind, size, mtime_ns, inode) of everything under `path`, hidden entries too."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(path))] = (p.is_dir(), 0 if p.is_dir() else st.st_size,
                                         0 if p.is_dir() else st.st_mtime_ns, st.st_ino)
    return out


def hidden(path: Path) -> List[str]:
    return sorted(p.name for p in Path(path).iterdir() if p.name.startswith("."))


def complete(folder: Path) -> bool:
    """config.json, the index and every shard it names."""
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors.index.json").is_file():
        return False
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return all((folder / f).is_file() for f in set(index["weight_map"].values()))


def check_common(r: Run, rc: int, sig: Optional[int]):
    """Exit code, no traceback, no death by signal, one clear line about the signal."""
    assert r.reached is not False, f"pause point never reached:\n{r.err}"
    assert r.rc == rc, f"exit {r.rc}, want {rc}:\n{r.err}"
    assert "Traceback" not in r.err, r.err
    if sig is None:
        return
    lines = r.lines()
    assert len(lines) == 1, r.err
    name = signal.Signals(sig).name
    if rc == 0:
        assert f"{name} received after" in lines[0] and "complete" in lines[0]
    else:
        assert f"interrupted by {name}" in lines[0] and "nothing was changed" in lines[0]
        assert "Wrote" not in r.out and "Grafted" not in r.out  # no summary


# -- inputs ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Sources shared (read only) by every case: an HF checkpoint, an mlx_mtp
    conversion of it and a plain mlx_lm 4-bit one (no head)."""
    from mlx_lm.convert import convert as lm_convert

    from mlx_mtp.convert import convert

    b = tmp_path_factory.mktemp("cli")
    src = write_checkpoint(b / "src", seed=21)
    convert(src, b / "prior")
    lm_convert(str(src), str(b / "mlx_q4"), quantize=True, q_bits=4)
    return b


@dataclass
class Case:
    id: str
    setup: Callable[[Path, Path], List[str]]  # (case folder, base) -> argv; runs in the case folder
    pause: Optional[str] = None
    sig: Optional[int] = None
    cwd: str = "."  # relative to the case folder
    extra: Dict = field(default_factory=dict)


CASES: Dict[str, Case] = {}


def case(id, setup, **kw) -> str:
    assert id not in CASES
    CASES[id] = Case(id, setup, **kw)
    return id


@pytest.fixture(scope="module")
def launched(request, base, tmp_path_factory):
    """Start (two at a time) the processes of the cases this session runs; id -> (future, case folder, tree before)."""
    wanted = []
    for item in request.session.items:
        cs = getattr(item, "callspec", None)
        if cs is not None and item.module is request.module and cs.params.get("cid") in CASES:
            wanted.append(cs.params["cid"])
    # A SIGINT ignored here (pytest run as a background job of a script) would stay
    # ignored in the children, and the converter keeps an inherited SIG_IGN.
    ignored = signal.getsignal(INT) == signal.SIG_IGN
    if ignored:
        signal.signal(INT, signal.default_int_handler)  # reset to the default in each child
    pool = ThreadPoolExecutor(max_workers=WORKERS)
    jobs = {}
    for cid in dict.fromkeys(wanted):
        c = CASES[cid]
        folder = tmp_path_factory.mktemp(cid.replace("/", "_"))
        args = c.setup(folder, base)
        before = tree(folder)
        fut = pool.submit(run_cli, args, folder / c.cwd, c.pause, c.sig)
        jobs[cid] = (fut, folder, before)
    yield jobs
    pool.shutdown(wait=True)
    if ignored:
        signal.signal(INT, signal.SIG_IGN)


def result(launched, cid) -> Tuple[Run, Path, Dict]:
    fut, folder, before = launched[cid]
    return fut.result(timeout=300), folder, before


def default_tier(ids: List[str], *kept: str) -> list:
    """The cases the default tier runs (a signal before publishing, one
    after); the other points are the slow tier's (each process costs ~2 s)."""
    return [i if any(f"/{k}" in i for k in kept) else pytest.param(i, marks=pytest.mark.slow)
            for i in ids]


# -- signals: convert -------------------------------------------------------------------
def _convert_args(folder, base):
    return ["--hf-path", base / "src", "--mlx-path", folder / "out"]


CONVERT_SIGNALS = [
    case(f"convert/{point}/{signal.Signals(sig).name}", _convert_args, pause=point, sig=sig, extra={"rc": rc})
    for point, sig, rc in [
        ("start", INT, 130),  # before anything is read
        ("loaded", TERM, 143),  # model loaded, nothing written
        ("staging", INT, 130),  # staging folder made, empty
        ("mid-write", TERM, 143),  # one shard of two written: the reported leak
        ("mid-write", signal.SIGHUP, 129),  # a closed terminal
        ("before-publish", TERM, 143),  # everything written, not yet renamed
        ("after-publish", INT, 0),  # published: the signal changes nothing (SIGTERM: force/ below)
    ]
]


@pytest.mark.parametrize("cid", default_tier(CONVERT_SIGNALS, "mid-write/SIGTERM", "after-publish"))
def test_convert_signal(launched, cid):
    r, folder, _ = result(launched, cid)
    c = CASES[cid]
    check_common(r, c.extra["rc"], c.sig)
    assert hidden(folder) == [], "temporary folder left behind"
    out = folder / "out"
    if c.extra["rc"] == 0:
        assert complete(out) and r.out.startswith(f"Wrote {out}")
        model, _ = mlx_mtp.load(out, quiet=True)
        assert model.has_mtp
    else:
        assert not out.exists()


# -- signals: --force over an existing model -----------------------------------------------
def _force_args(folder, base):
    shutil.copytree(base / "prior", folder / "out")
    return ["--hf-path", base / "src", "--mlx-path", folder / "out", "-q", "--force"]


FORCE_SIGNALS = [
    case(f"force/{point}/{signal.Signals(sig).name}", _force_args, pause=point, sig=sig, extra={"rc": rc})
    for point, sig, rc in [("mid-write", TERM, 143), ("before-publish", INT, 130), ("after-publish", TERM, 0)]
]


@pytest.mark.parametrize("cid", default_tier(FORCE_SIGNALS, "before-publish", "after-publish"))
def test_force_replace_signal(launched, cid):
    r, folder, before = result(launched, cid)
    c = CASES[cid]
    check_common(r, c.extra["rc"], c.sig)
    assert hidden(folder) == []
    out = folder / "out"
    if c.extra["rc"] == 0:  # replaced: the new (quantized) folder, complete
        assert complete(out) and "quantization" in json.loads((out / "config.json").read_text())
        model, _ = mlx_mtp.load(out, quiet=True)
        assert model.has_mtp
    else:  # the old folder exactly as it was (same files, same inodes)
        assert tree(folder) == before


# -- signals: --graft -----------------------------------------------------------------------
def _graft_args(folder, base):
    shutil.copytree(base / "mlx_q4", folder / "target")
    return ["--graft", folder / "target", "--hf-path", base / "src"]


GRAFT_SIGNALS = [
    case(f"graft/{point}/{signal.Signals(sig).name}", _graft_args, pause=point, sig=sig, extra={"rc": rc})
    for point, sig, rc in [("staging", TERM, 143), ("mid-write", INT, 130), ("before-publish", TERM, 143),
                           ("after-publish", INT, 0)]
]


@pytest.mark.parametrize("cid", default_tier(GRAFT_SIGNALS, "mid-write", "after-publish"))
def test_graft_signal(launched, cid):
    r, folder, before = result(launched, cid)
    c = CASES[cid]
    check_common(r, c.extra["rc"], c.sig)
    assert hidden(folder) == []
    target = folder / "target"
    if c.extra["rc"] == 0:
        assert (target / "model-mtp.safetensors").is_file() and r.out.startswith("Grafted")
        assert tree(folder)["target/model.safetensors"] == before["target/model.safetensors"]  # trunk untouched
        model, _ = mlx_mtp.load(target, quiet=True)
        assert model.has_mtp
    else:
        assert tree(folder) == before


# -- a run killed outright (SIGKILL) leaves its staging folder: the next run removes it ----------
STALE = case("stale/mid-write/SIGKILL", _convert_args, pause="mid-write", sig=KILL)


@pytest.mark.parametrize("cid", [STALE])
def test_next_run_removes_a_killed_runs_temporaries(launched, cid, base, capsys):
    from mlx_mtp.convert.__main__ import main as cli

    r, folder, _ = result(launched, cid)
    assert r.reached and r.rc == -KILL
    left = hidden(folder)
    assert len(left) == 1 and left[0].startswith(".out.tmp-")
    assert any(p.suffix == ".safetensors" for p in (folder / left[0]).iterdir())  # the partial output
    # beside it: one of a run still going (pid 1 is alive), and folders that are not ours
    for name in (".out.tmp-1-abcdefgh", ".out.tmp-notours", ".other.tmp-123-abcdefgh", ".out.tmp-1-abcdefgh.bak"):
        (folder / name).mkdir()
        (folder / name / "keep").write_text("x")
    assert cli(["--hf-path", str(base / "src"), "--mlx-path", str(folder / "out")]) == 0
    err = capsys.readouterr().err
    notices = [ln for ln in err.splitlines() if "removed leftover temporary folder" in ln]
    assert len(notices) == 1 and left[0] in notices[0] and ".out.tmp-1-" not in notices[0]
    assert "left alone: .out.tmp-1-abcdefgh" in err
    assert hidden(folder) == sorted([".out.tmp-1-abcdefgh", ".out.tmp-notours", ".other.tmp-123-abcdefgh",
                                     ".out.tmp-1-abcdefgh.bak"])
    assert all((folder / n / "keep").exists() for n in hidden(folder))
    assert complete(folder / "out")


# -- bad inputs ---------------------------------------------------------------------------------
def _src_copy(folder, base, name="src"):
    return shutil.copytree(base / "src", folder / name)


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _bad_src(mutate):
    def setup(folder, base):
        s = _src_copy(folder, base)
        mutate(s)
        return ["--hf-path", s, "--mlx-path", folder / "out"]

    return setup


def _set_model_type(s: Path, t: str):
    c = json.loads((s / "config.json").read_text())
    c["model_type"] = t
    (s / "config.json").write_text(json.dumps(c))


def _truncate(f: Path, n: int = 100):
    data = f.read_bytes()
    f.write_bytes(data[:-n])


def _out_with(*names):
    def setup(folder, base):
        out = folder / "out"
        out.mkdir()
        for n in names:
            if n.endswith("/"):
                (out / n).mkdir()
            else:
                (out / n).write_text("mine")
        return ["--hf-path", base / "src", "--mlx-path", out, "--force"]

    return setup


def _graft_onto(make):
    def setup(folder, base):
        t = make(folder, base)
        return ["--graft", t, "--hf-path", base / "src"]

    return setup


def _notes_folder(folder, base):
    t = folder / "notes"
    t.mkdir()
    (t / "todo.txt").write_text("mine")
    return t


def _cwd_model(folder, base):
    shutil.copytree(base / "prior", folder / "out")
    return ["--hf-path", base / "src", "--mlx-path", ".", "--force"]


# (id, setup, exit code, words of the one line). Also checked in-process elsewhere, so
# not here: a non-empty output without --force, the --force rules one by one
# (test_convert.py), a --graft source without head (test_convert_graft.py).
BAD = [
    ("missing-source", lambda f, b: ["--hf-path", f / "nope", "--mlx-path", f / "out"], 1, ["does not exist"]),
    ("source-without-config", _bad_src(lambda s: (s / "config.json").unlink()), 1, ["no config.json"]),
    ("config-not-an-object", _bad_src(lambda s: _write(s / "config.json", "[1, 2, 3]")), 1,
     ["config.json", "not a JSON object"]),
    ("config-unsupported-model", _bad_src(lambda s: _set_model_type(s, "llama")), 1, ["'llama'", "not supported"]),
    ("index-not-json", _bad_src(lambda s: _write(s / "model.safetensors.index.json", "{")), 1,
     ["model.safetensors.index.json", "not valid JSON"]),
    ("index-without-weight-map", _bad_src(lambda s: _write(s / "model.safetensors.index.json", '{"metadata": {}}')),
     1, ["model.safetensors.index.json", "no weight_map"]),
    ("index-names-missing-shard", _bad_src(lambda s: _write(
        s / "model.safetensors.index.json", '{"weight_map": {"lm_head.weight": "model-00009.safetensors"}}')), 1,
     ["model-00009.safetensors", "missing"]),
    ("truncated-shard", _bad_src(lambda s: _truncate(s / "model.safetensors")), 1,
     ["model.safetensors", "truncated"]),
    ("output-inside-source", lambda f, b: ["--hf-path", _src_copy(f, b), "--mlx-path", f / "src" / "out"], 1,
     ["overlaps the source"]),
    ("force-on-non-model-folder", _out_with("notes.txt", "photos/"), 1,
     ["refusing to replace", "/out", "no config.json"]),
    ("force-on-current-folder", _cwd_model, 1, ["refusing to replace", "current working folder"]),
    ("graft-onto-hf-layout", _graft_onto(lambda f, b: _src_copy(f, b, "hf")), 1, ["Hugging Face layout"]),
    ("graft-onto-non-model-folder", _graft_onto(_notes_folder), 1, ["no config.json"]),
    ("bad-argument", lambda f, b: ["--hf-path", b / "src", "--mlx-path", f / "out", "--q-bits", "7"], 2,
     ["invalid choice"]),
]
@pytest.mark.parametrize("name,setup,rc,words", BAD, ids=[f"bad/{b[0]}" for b in BAD])
def test_bad_input(base, tmp_path, monkeypatch, capsys, name, setup, rc, words):
    """One line on stderr, nothing on stdout, nothing on disk changed. In this
    process: `main` is what `python -m mlx_mtp.convert` runs (the signal cases
    above start the process itself)."""
    from mlx_mtp.convert.__main__ import main as cli

    folder = tmp_path / "case"
    folder.mkdir()
    args = [str(a) for a in setup(folder, base)]
    before = tree(folder)
    if name == "force-on-current-folder":
        monkeypatch.chdir(folder / "out")
    try:
        code = cli(args)
    except SystemExit as e:  # (argparse)
        code = e.code
    out, err = capsys.readouterr()
    assert code == rc, err
    assert out == ""  # no summary (and nothing else on stdout)
    if rc == 1:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[mlx_mtp.convert]")]
        assert len(lines) == 1 and lines[0].startswith("mlx_mtp.convert: error: "), err
    else:
        lines = [err.strip().splitlines()[-1]]
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert tree(folder) == before, "something on disk changed"
