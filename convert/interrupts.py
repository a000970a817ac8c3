"""SIGINT / SIGTERM (and SIGHUP) handling of `python -m mlx_mtp.convert`.

The command line runs inside `guard()`: these signals raise `Interrupted` (a
KeyboardInterrupt, so library code that cleans up on Ctrl-C does it for
SIGTERM too) at the next Python instruction, except inside `deferred()`
sections (creating a staging folder, removing one, publishing), where the
signal is recorded and raised when the section ends.

The commit point is the rename in `common.publish`: a signal that arrives
before it leaves no output (and an old folder intact); once the output is
published (`mark_published`) signals no longer interrupt anything and the
command exits 0, so a published output is never followed by a nonzero exit.

Temporary folders are registered here (`add_temp`) so that the command line
removes whatever a run left behind, however it ends (short of SIGKILL; a
later run of the same output removes those, see `common.remove_stale_temps`).

Test hook: MLX_MTP_CONVERT_PAUSE=POINT[,POINT...] makes `pause_point(POINT)`
print "MLX_MTP_CONVERT_PAUSED POINT" to stderr and wait (until a signal
arrives, or MLX_MTP_CONVERT_PAUSE_TIMEOUT seconds, default 60).
Points: start, loaded, staging, mid-write, before-publish, after-publish.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional, Set

# SIGHUP too (a closed terminal or ssh session): 129.
SIGNALS = (signal.SIGINT, signal.SIGTERM) + ((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ())
PAUSE_ENV = "MLX_MTP_CONVERT_PAUSE"
PAUSE_TIMEOUT_ENV = "MLX_MTP_CONVERT_PAUSE_TIMEOUT"
PAUSE_POINTS = ("start", "loaded", "staging", "mid-write", "before-publish", "after-publish")
PAUSED_MARKER = "MLX_MTP_CONVERT_PAUSED"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM received; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _Guard:
    def __init__(self):
        self.signum: Optional[int] = None  # first signal received
        self.raised = False  # Interrupted was raised for it
        self.depth = 0  # nesting of deferred() sections
        self.published: Optional[Path] = None
        self.closed = False  # the run is over: signals are only recorded
        self.temps: Set[Path] = set()
        self.made_temps = False  # any temporary folder was made

    def close(self) -> None:
        self.closed = True


_guard: Optional[_Guard] = None


def _handler(signum, frame):
    g = _guard
    if g is None:  # not ours any more (cannot happen while installed): behave as Python does
        raise Interrupted(signum)
    if g.signum is None:
        g.signum = signum
    if g.raised or g.depth or g.closed or g.published is not None:
        return  # raised once already / recorded for the end of the section / too late to matter
    g.raised = True
    raise Interrupted(signum)


@contextmanager
def guard(standalone: bool = False) -> Iterator[_Guard]:
    """Install the handlers for the duration (main thread only; elsewhere a no-op guard).

    `standalone` (the process is the command): on the way out the signals are
    ignored rather than restored, so that nothing can turn the outcome into a
    death by signal between here and the exit."""
    global _guard
    g = _Guard()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {}
    outer = _guard
    _guard = g
    try:
        if main_thread:
            for s in SIGNALS:
                if signal.getsignal(s) == signal.SIG_IGN:
                    continue  # ignored by whoever started us (a background job's SIGINT): stays so
                previous[s] = signal.signal(s, _handler)
        yield g
    finally:
        if main_thread:
            for s, h in previous.items():
                signal.signal(s, signal.SIG_IGN if standalone else h)
        _guard = outer


def active() -> Optional[_Guard]:
    return _guard


@contextmanager
def deferred() -> Iterator[None]:
    """A section that a signal does not cut short: it is raised when the section ends."""
    g = _guard
    if g is None:
        yield
        return
    g.depth += 1
    try:
        yield
    finally:
        g.depth -= 1
    raise_pending()


def raise_pending() -> None:
    """Raise Interrupted now if a signal was recorded and not raised yet (and nothing is published)."""
    g = _guard
    if (g is not None and g.signum is not None and not g.raised and not g.closed and g.depth == 0
            and g.published is None):
        g.raised = True
        raise Interrupted(g.signum)


def check() -> None:
    """Raise Interrupted if a signal has arrived, even inside a deferred section
    (called just before the commit point: a signal before it means no output)."""
    g = _guard
    if g is not None and g.signum is not None and g.published is None:
        g.raised = True
        raise Interrupted(g.signum)


def mark_published(path: Path) -> None:
    if _guard is not None:
        _guard.published = Path(path)


def add_temp(path: Path) -> None:
    if _guard is not None:
        _guard.temps.add(Path(path))
        _guard.made_temps = True


def remove_temp(path: Path) -> None:
    """Remove a temporary folder of this run (signals deferred meanwhile)."""
    with deferred():
        shutil.rmtree(path, ignore_errors=True)
        if _guard is not None and not Path(path).exists():
            _guard.temps.discard(Path(path))


def remove_all_temps() -> bool:
    """Remove every registered temporary folder still there; True if all are gone."""
    g = _guard
    if g is None:
        return True
    g.depth += 1  # never raise from here
    try:
        for p in sorted(g.temps):
            shutil.rmtree(p, ignore_errors=True)
            if not p.exists():
                g.temps.discard(p)
        return not g.temps
    finally:
        g.depth -= 1


def pause_point(name: str) -> None:
    """Test hook (see the module docstring)."""
    want = os.environ.get(PAUSE_ENV)
    if not want or name not in [w.strip() for w in want.split(",")]:
        return
    print(f"{PAUSED_MARKER} {name}", file=sys.stderr, flush=True)
    try:
        timeout = float(os.environ.get(PAUSE_TIMEOUT_ENV, "60"))
    except ValueError:
        timeout = 60.0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        g = _guard
        if g is not None and g.signum is not None:
            break  # recorded, not raised (after publishing, or inside a deferred section)
        time.sleep(0.01)  # a handler that raises interrupts the sleep
