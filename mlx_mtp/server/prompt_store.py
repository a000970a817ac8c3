"""The server's prefix cache: mlx_lm's `LRUPromptCache` in RAM over a folder
of entries on disk (`--prompt-cache-dir`), so that a long prefix an agent
sends again (its system prompt and tools, a conversation so far) is not
prefilled again after a restart either.

An entry is a prompt cache (mlx_lm's objects: the trunk's attention KV and
GDN conv/recurrent states, the MTP head's KV and last hidden) at a token
position, saved by mlx_lm's `save_prompt_cache` (safetensors; its metadata
holds our format's name, the model's fingerprint, the tokens and a CRC-32 of
the data), so `load_prompt_cache` reads it back. Its name says whose it is:
`<model fingerprint>-<digest of its tokens>.safetensors`.

Safe by construction: a writer thread (never the decode thread) writes a
temporary file, fsyncs it and renames it into place, so a reader (this
process or another sharing the folder) sees a whole entry or none; a file
that does not read back whole (truncated, corrupt, another model's under
this one's name) is skipped with one log line and removed; the folder is
kept under its byte cap, least recently used first (a file's mtime is its
last use); a full disk logs once and the server goes on without writing.
"""

from __future__ import annotations

import base64
import copy
import errno
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import weakref
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlx_lm.models.cache import CacheList, KVCache

from ..mlx_lm_compat import LRUPromptCache, load_prompt_cache, save_prompt_cache

FORMAT = "mlx_mtp.prompt_cache/1"  # the entries' layout; another one never loads
NAME = re.compile(r"([0-9a-f]{16})-([0-9a-f]{32})\.safetensors")
# .<pid>.<name> while it is written (mx.save_safetensors keeps the suffix)
TEMPORARY = re.compile(r"\.(\d+)\.[0-9a-f]{16}-[0-9a-f]{32}\.safetensors")
STALE_TEMPORARY_S = 3600  # a temporary file older than this has no writer left
CRC_PENDING = "????????"  # the CRC's place in the header until the data is written
READ_CHUNK = 8 << 20
MAX_HEADER = 100 << 20  # bytes (safetensors' own limit)
HEADER_SLACK = 64 << 10  # bytes of an entry's header besides its tokens (tensor names, offsets)
PENDING_WRITES = 2  # entries waiting for the writer at most (the oldest dropped)
DEFAULT_DISK_BYTES = 32 << 30  # the default cap, or half the folder's free space if less


def model_fingerprint(model) -> str:
    """What identifies a loaded model's decode state: its configuration,
    cache layout and every parameter's name, shape and dtype (quantized
    ones: packed weights, scales, biases; the MTP head's too) with samples
    of its values (first, middle and last elements), so that a fine-tune or
    another quantization of the same architecture differs. sha256, hex."""
    h = hashlib.sha256(FORMAT.encode())
    h.update(repr(model.args).encode())
    h.update(repr([type(c).__name__ for c in model.make_cache()]).encode())
    samples = []
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        flat = p.reshape(-1)
        n = flat.size
        idx = sorted({*range(min(n, 16)), *range(max(0, n - 16), n),
                      *range(n // 2, min(n, n // 2 + 16))})
        samples.append(flat[mx.array(idx)].view(mx.uint8) if p.dtype.size > 1 else flat[
            mx.array(idx)])
    mx.eval(samples)
    for s in samples:
        h.update(np.asarray(s).tobytes())
    return h.hexdigest()


def tokens_blob(tokens) -> bytes:
    return np.asarray(tokens, dtype="<i4").tobytes()


@dataclass(frozen=True)
class Entry:
    """A file in the folder: whose (its model's fingerprint), which tokens
    (int32 bytes: prefixes compare as bytes), its size."""

    path: Path
    model: str
    tokens: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.tokens) // 4


def _header(f) -> dict:
    """A safetensors file's header (its `__metadata__` and tensors' offsets)."""
    raw = f.read(8)
    if len(raw) < 8:
        raise ValueError("shorter than a safetensors header")
    (size,) = struct.unpack("<Q", raw)
    if size > MAX_HEADER:
        raise ValueError(f"a header of {size} bytes")
    text = f.read(size)
    if len(text) < size:
        raise ValueError("the header is cut off")
    return json.loads(text)


def _metadata(header: dict) -> Dict[str, str]:
    """Our fields of the header (save_prompt_cache flattens its metadata
    dict as '0.<key>')."""
    meta = header.get("__metadata__") or {}
    return {k[2:]: v for k, v in meta.items() if k.startswith("0.")}


def _check_size(header: dict, data_start: int, nbytes: int):
    """The file is as long as its header says (the tensors' last byte ends it)."""
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
              default=0)
    if data_start + end != nbytes:
        raise ValueError(f"{nbytes} bytes where its header says {data_start + end} (truncated)")


def _data_crc(f, start: int) -> int:
    """CRC-32 of a file's bytes from `start` to its end (the tensors' data)."""
    f.seek(start)
    crc = 0
    while chunk := f.read(READ_CHUNK):
        crc = zlib.crc32(chunk, crc)
    return crc


def handed_over(prompt_cache: list) -> list:
    """What the generation thread gives the writer thread: the cache's
    arrays evaluated (a no-op for a stored cache; an unevaluated array
    cannot be evaluated on another thread) in new cache objects of their
    own. No data is copied: an MLX array is a value, so an update of the
    caller's cache afterwards (a KV cache's slice assignment rebinds its
    array, and a buffer another array shares is never written in place;
    a GDN state is replaced) does not reach them."""
    mx.eval([c.state for c in prompt_cache])
    return copy.deepcopy(prompt_cache)


def frozen(prompt_cache: list) -> list:
    """A copy of a prompt cache whose arrays are evaluated, compact (a KV
    buffer's spare room past its offset left out) and its own: what the
    writer thread saves, made there (the generation thread only hands the
    arrays over: `handed_over`)."""
    out = [_compact(c) for c in prompt_cache]
    mx.eval([c.state for c in out])
    return out


def _compact(c):
    if isinstance(c, CacheList):
        return CacheList(*[_compact(x) for x in c.caches])
    if isinstance(c, KVCache):
        if c.keys is None:
            return KVCache()
        n = c.offset
        return KVCache.from_state((mx.contiguous(c.keys[..., :n, :]),
                                   mx.contiguous(c.values[..., :n, :]), n))
    return type(c).from_state(tree_map(
        lambda x: mx.contiguous(x) if isinstance(x, mx.array) else x, c.state))


class DiskTier:
    """The folder of entries: the longest stored prefix of a prompt (`find`),
    an entry read back whole or not at all (`load`), entries written by a
    thread of its own (`put`), the folder kept under `max_bytes`.

    `check(cache, n)`: raises if a loaded cache does not fit the model or
    does not hold n tokens (the server's check of a cache it decodes on)."""

    def __init__(self, folder, max_bytes: int, model_id: str,
                 check: Callable[[list, int], None] = lambda cache, n: None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        probe = self.folder / f".probe.{os.getpid()}.tmp"  # writable: said now, in one line
        probe.write_bytes(b"")
        probe.unlink()
        self.max_bytes, self.model_id, self.check = max_bytes, model_id, check
        self._entries: Dict[str, Entry] = {}  # file name -> Entry (every model's)
        self._lock = threading.Lock()
        self._seen_mtime = None  # the folder's mtime when last scanned
        self._pending: deque = deque()  # (name, tokens, cache handed over), oldest first
        self._writing: Optional[str] = None
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._full_logged = False
        self._scan()
        self._evict()
        self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                        name="mlx_mtp-prompt-cache-writer")
        self._writer.start()

    # -- names and the index ---------------------------------------------------------------
    def name_of(self, tokens) -> str:
        digest = hashlib.sha256(tokens_blob(tokens)).hexdigest()[:32]
        return f"{self.model_id[:16]}-{digest}.safetensors"

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return sum(e.model == self.model_id for e in self._entries.values())

    def _scan(self):
        """Index the folder's entries as they are now (others' writes and
        evictions included): a new file's header is read, a gone one's
        entry dropped; stale temporary files (a writer killed) removed."""
        try:
            mtime = os.stat(self.folder).st_mtime_ns
            names = {d.name: d for d in os.scandir(self.folder)}
        except OSError as e:
            logging.warning("prompt cache: cannot read %s: %s", self.folder, e)
            return
        self._seen_mtime = mtime
        with self._lock:
            for name in set(self._entries) - set(names):
                del self._entries[name]
            known = set(self._entries)
        for name, d in names.items():
            if name in known:
                continue
            m = TEMPORARY.fullmatch(name)
            if m is not None:
                self._drop_stale_temporary(d, int(m.group(1)))
                continue
            m = NAME.fullmatch(name)
            if m is None:
                continue
            entry = self._read_entry(Path(d.path), m.group(1), m.group(2))
            if entry is not None:
                with self._lock:
                    self._entries[name] = entry

    def _drop_stale_temporary(self, d, pid: int):
        try:
            age = time.time() - d.stat().st_mtime
            if pid == os.getpid() or (age < STALE_TEMPORARY_S and _alive(pid)):
                return  # being written (by this process or a live one)
            os.unlink(d.path)
        except OSError:
            pass

    def _read_entry(self, path: Path, model_prefix: str, digest: str) -> Optional[Entry]:
        """An entry from its file's header; another model's is indexed by its
        size only (it counts against the cap, it is never read)."""
        try:
            nbytes = path.stat().st_size
            if model_prefix != self.model_id[:16]:
                return Entry(path, model_prefix, b"", nbytes)
            with open(path, "rb") as f:
                header = _header(f)
                _check_size(header, f.tell(), nbytes)
                meta = _metadata(header)
            if meta.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} entry")
            if meta.get("model") != self.model_id:
                raise ValueError("another model's entry under this model's name")
            tokens = base64.b64decode(meta["tokens"], validate=True)
            if hashlib.sha256(tokens).hexdigest()[:32] != digest:
                raise ValueError("its tokens are not those its name says")
            return Entry(path, self.model_id, tokens, nbytes)
        except FileNotFoundError:
            return None
        except Exception as e:
            self._discard(path, e)
            return None

    def _discard(self, path: Path, why):
        logging.warning("prompt cache: %s is skipped and removed: %s", path.name, why)
        with self._lock:
            self._entries.pop(path.name, None)
        try:
            path.unlink()
        except OSError:
            pass

    # -- reading ------------------------------------------------------------------------
    def find(self, tokens) -> Optional[Entry]:
        """This model's longest stored entry whose tokens begin `tokens`."""
        try:
            if os.stat(self.folder).st_mtime_ns != self._seen_mtime:
                self._scan()
        except OSError:
            return None
        query = tokens_blob(tokens)
        with self._lock:
            found = [e for e in self._entries.values()
                     if e.model == self.model_id and e.tokens and query.startswith(e.tokens)]
        return max(found, key=lambda e: e.length, default=None)

    def load(self, entry: Entry) -> Optional[list]:
        """The entry's prompt cache, verified (format, model, tokens, the
        data's CRC, the model's cache layout and length), evaluated; None
        (one log line, the file removed) for one that does not read back
        whole; None, quietly, for one evicted meanwhile."""
        try:
            with open(entry.path, "rb") as f:
                header = _header(f)
                meta = _metadata(header)
                if (meta.get("format"), meta.get("model")) != (FORMAT, self.model_id):
                    raise ValueError("not this model's entry")
                if base64.b64decode(meta["tokens"]) != entry.tokens:
                    raise ValueError("its tokens changed")
                crc = _data_crc(f, f.tell())
                if f"{crc:08x}" != meta.get("crc32"):
                    raise ValueError("its data does not match its CRC-32 (corrupt)")
                cache = load_prompt_cache(str(entry.path))
            mx.eval([c.state for c in cache])
            self.check(cache, entry.length)
        except FileNotFoundError:
            with self._lock:
                self._entries.pop(entry.path.name, None)
            return None
        except Exception as e:
            self._discard(entry.path, f"{type(e).__name__}: {e}")
            return None
        _touch(entry.path)
        return cache

    # -- writing ------------------------------------------------------------------------
    def put(self, tokens, prompt_cache: list):
        """Queue an entry for the writer (its arrays, `handed_over`: the
        compact copy is the writer's work, off the caller's thread, the
        generation thread); the oldest waiting one is dropped past
        PENDING_WRITES (bounded memory: a newer entry usually extends it)."""
        name = self.name_of(tokens)
        with self._lock:
            if self._closed or name == self._writing or any(p[0] == name for p in self._pending):
                return
            stored = self._entries.get(name)
        if stored is not None:  # the same tokens again: only its last use changes
            _touch(stored.path)
            return
        given = handed_over(prompt_cache)
        if _nbytes(given) + HEADER_SLACK > self.max_bytes:  # (its compact size)
            return
        with self._lock:
            if len(self._pending) >= PENDING_WRITES:
                dropped = self._pending.popleft()
                logging.info("prompt cache: %s was not written (the writer is behind)",
                             dropped[0])
            self._pending.append((name, list(tokens), given))
            self._wake.notify_all()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Wait until every queued entry is written; False if it timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending or self._writing is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._wake.wait(left)
        return True

    def close(self, timeout: float = 0.0):
        """Write what is queued (up to `timeout` seconds), then stop the writer."""
        self.flush(timeout)
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._wake.notify_all()

    def _write_loop(self):
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                name, tokens, cache = self._pending.popleft()
                self._writing = name
            try:
                self._write(name, tokens, cache)
            except Exception as e:  # (never the generation's problem: logged, skipped)
                logging.warning("prompt cache: %s was not written: %s: %s", name,
                                type(e).__name__, e)
            finally:
                del cache
                with self._lock:
                    self._writing = None
                    self._wake.notify_all()

    def _write(self, name: str, tokens: list, cache: list):
        """compact copy, temporary file, CRC, fsync, rename, fsync the
        folder; then evict."""
        cache = frozen(cache)
        path = self.folder / name
        tmp = self.folder / f".{os.getpid()}.{name}"
        blob = tokens_blob(tokens)
        meta = {"format": FORMAT, "model": self.model_id, "crc32": CRC_PENDING,
                "tokens": base64.b64encode(blob).decode()}
        # room first: the folder holds at most max_bytes even while this one is written
        self._evict(room=_nbytes(cache) + len(meta["tokens"]) + HEADER_SLACK)
        try:
            save_prompt_cache(str(tmp), cache, meta)
            with open(tmp, "r+b") as f:
                _header(f)
                data = f.tell()
                crc = _data_crc(f, data)
                f.seek(0)
                head = f.read(data)
                at = head.find(f'"{CRC_PENDING}"'.encode())
                f.seek(at + 1)
                f.write(f"{crc:08x}".encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(self.folder)
        except OSError as e:
            _unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                if not self._full_logged:
                    logging.warning("prompt cache: the disk of %s is full: entries are not "
                                    "written until there is room (serving goes on)",
                                    self.folder)
                    self._full_logged = True
                return
            raise
        except BaseException:
            _unlink(tmp)
            raise
        self._full_logged = False
        with self._lock:
            self._entries[name] = Entry(path, self.model_id, blob, path.stat().st_size)
        self._evict()

    def _evict(self, room: int = 0):
        """Remove the least recently used entries (any model's: the cap is the
        folder's) until the folder holds at most max_bytes - room."""
        with self._lock:
            entries = list(self._entries.values())
        total, limit = sum(e.nbytes for e in entries), self.max_bytes - room
        if total <= limit:
            return
        for e in sorted(entries, key=_last_use):
            if total <= limit:
                break
            _unlink(e.path)
            with self._lock:
                self._entries.pop(e.path.name, None)
            total -= e.nbytes


def _nbytes(prompt_cache: list) -> int:
    return sum(x.nbytes for _, x in tree_flatten([c.state for c in prompt_cache])
               if isinstance(x, mx.array))


def _last_use(e: Entry) -> int:
    try:
        return e.path.stat().st_mtime_ns
    except OSError:
        return 0


def _touch(path: Path):
    try:
        os.utime(path)
    except OSError:
        pass


def _unlink(path: Path):
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(folder: Path):
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def default_disk_bytes(folder) -> int:
    """DEFAULT_DISK_BYTES, or half the free space of the folder's disk if less."""
    folder = Path(folder)
    probe = folder if folder.exists() else next(
        (p for p in folder.parents if p.exists()), Path("."))
    st = os.statvfs(probe)
    return min(DEFAULT_DISK_BYTES, st.f_bavail * st.f_frsize // 2)


def cache_bytes(prompt_cache: list) -> int:
    """A prompt cache's bytes as mlx_lm's LRU counts them (its buffers whole)."""
    return sum(c.nbytes for c in prompt_cache)


class _Entry(list):
    """A prompt cache as the LRU holds it: a list a weak reference can
    follow, so the server can tell whether a cache it holds is still an
    entry (`TieredPromptCache.holds`)."""

    __slots__ = ("__weakref__",)


class TieredPromptCache(LRUPromptCache):
    """mlx_lm's prefix cache (RAM, least recently used entries dropped) with
    a disk tier under it (`disk`, or None: RAM only). A lookup takes the
    longest stored prefix, RAM first, then disk (a disk entry longer than
    RAM's hit is read and kept in RAM too); `insert_cache(persist=True)`
    also writes the entry to disk (off this thread). Caches the server
    holds beside its entries (a next turn's prefix being prefilled) count
    against its byte cap (`reserve`)."""

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63,
                 disk: Optional[DiskTier] = None):
        super().__init__(max_size, max_bytes)
        self.disk = disk
        self.reserved = 0  # bytes held beside the entries, within max_bytes (`reserve`)
        # id(a cache as given to insert_cache) -> its entry, while the LRU keeps it
        self._entries = weakref.WeakValueDictionary()

    def reserve(self, nbytes: int):
        """`nbytes` held beside the entries count against the byte cap: the
        least recently used entries leave until they fit beside them."""
        self.reserved = nbytes
        self._trim()

    def _trim(self):
        if self.reserved:
            self.trim_to(n_bytes=self.max_bytes - self.reserved)

    def holds(self, prompt_cache: list) -> bool:
        """Whether this cache (as given to `insert_cache`) is an entry still."""
        entry = self._entries.get(id(prompt_cache))
        return entry is not None and len(entry) == len(prompt_cache) and all(
            a is b for a, b in zip(entry, prompt_cache))

    def to_disk(self, tokens: List[int], prompt_cache: list):
        """The cache to disk only (one RAM has let go), if there is a disk tier."""
        if self.disk is not None and tokens:
            try:
                self.disk.put(tokens, prompt_cache)
            except Exception as e:
                logging.warning("prompt cache: an entry was not queued for disk: %s: %s",
                                type(e).__name__, e)

    def fetch_nearest_cache(self, model, tokens: List[int]):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        if self.disk is None or not rest:
            return cache, rest
        entry = self.disk.find(tokens)
        if entry is None or entry.length <= len(tokens) - len(rest):
            return cache, rest
        t0 = time.perf_counter()
        loaded = self.disk.load(entry)
        if loaded is None:
            return cache, rest
        seconds = time.perf_counter() - t0
        logging.info("prompt cache: %d tokens restored from %s (%.1f MB in %.3f s, %.2f GB/s)",
                     entry.length, entry.path.name, entry.nbytes / 1e6, seconds,
                     entry.nbytes / 1e9 / max(seconds, 1e-9))
        n = entry.length
        super().insert_cache(model, list(tokens[:n]), loaded)
        self._trim()
        return copy.deepcopy(loaded), tokens[n:]

    def insert_cache(self, model, tokens: List[int], prompt_cache: List, *,
                     cache_type: str = "assistant", persist: bool = False):
        entry = _Entry(prompt_cache)  # (the same cache objects)
        super().insert_cache(model, tokens, entry, cache_type=cache_type)
        self._entries[id(prompt_cache)] = entry
        self._trim()
        if persist:  # (the RAM entry stands whatever the disk does)
            self.to_disk(tokens, prompt_cache)
