"""The prefix cache's disk tier (mlx_mtp/server/prompt_store.py), in process:
an entry reads back bit for bit (and through mlx_lm's own load_prompt_cache),
is found as the longest stored prefix, survives only whole (a writer killed
mid-write, truncated / corrupt / foreign files), the folder stays under its
cap least recently used first, a full disk is said once, and the model's
fingerprint tells models apart."""

import base64
import errno
import logging
import os
import signal
import struct
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache

from mlx_mtp.server import prompt_store
from mlx_mtp.server.prompt_store import DiskTier, TieredPromptCache, model_fingerprint, tokens_blob
from util import LONG, assert_trunk_equal, mtp


def _filled(model, tok, text=LONG, max_tokens=6):
    """A prompt cache after a short generation (trunk, head and last hidden
    filled) and the tokens it holds."""
    cache = model.make_cache()
    prompt = tok.encode(text)
    out = mtp(model, prompt, 2, max_tokens, prompt_cache=cache)
    return cache, prompt + out  # (mlx_lm feeds every token it yields, the last one too)


def _tier(folder, model, max_bytes=1 << 30):
    from mlx_mtp.cache import cache_length, check_model_cache

    def check(cache, n):
        check_model_cache(cache, model)
        assert cache_length(cache, model.is_linear) == n, "length"

    return DiskTier(folder, max_bytes, model_fingerprint(model), check)


def _assert_same(back, cache, model):
    n = len(model.is_linear)
    assert len(back) == len(cache)
    assert_trunk_equal(back[:n], cache[:n])
    assert_trunk_equal(back[n:-1], cache[n:-1])  # the head's KV
    assert mx.array_equal(back[-1][0], cache[-1][0]) and back[-1][1].item() == cache[-1][1].item()


@pytest.mark.parametrize("name", ["dense", "q4"])
def test_an_entry_reads_back_bit_for_bit(loaded, tmp_path, name):
    model, _, tok = loaded(name)
    cache, held = _filled(model, tok)
    tier = _tier(tmp_path, model)
    tier.put(held, cache)
    assert tier.flush(30)
    entry = tier.find(held + [5, 6])
    assert entry is not None and entry.length == len(held)
    back = tier.load(entry)
    _assert_same(back, cache, model)
    # the file is mlx_lm's format: its own loader reads it, metadata included
    again, meta = load_prompt_cache(str(entry.path), return_metadata=True)
    _assert_same(again, cache, model)
    assert meta["model"] == tier.model_id and base64.b64decode(meta["tokens"]) == tokens_blob(held)
    # compact: the KV buffers' spare room is not written
    kv = sum(c.keys.nbytes + c.values.nbytes for c in back if hasattr(c, "keys") and c.keys is not None)
    assert kv < entry.nbytes < kv + (1 << 20)
    # the continuation from the loaded cache is the live one's
    nxt = tok.encode("\nclass Eggs(Spam):\n")
    assert mtp(model, nxt, 3, 12, prompt_cache=back) == mtp(model, nxt, 3, 12, prompt_cache=cache)


def test_the_longest_stored_prefix_is_found(loaded, tmp_path):
    model, _, tok = loaded("dense")
    tier = _tier(tmp_path, model)
    cache, held = _filled(model, tok)
    short = held[:11]
    short_cache = model.make_cache()
    mtp(model, short, 2, 0, prompt_cache=short_cache)  # (max_tokens 0: only prefilled)
    tier.put(held, cache)
    tier.put(short, short_cache)
    assert tier.flush(30)
    assert tier.find(held + [1, 2]).length == len(held)
    assert tier.find(short + [1, 2]).length == len(short)
    assert tier.find(held[:-1]).length == len(short)
    assert tier.find(short[:-1]) is None and tier.find([7] + held) is None
    assert tier.load(tier.find(held[:-1])) is not None  # (its length checked: 11)
    # another process's tier on the folder sees both (it reads the headers),
    # and what this one writes later (the folder changed: read again)
    other = _tier(tmp_path, model)
    assert other.find(held).length == len(held) and len(other) == 2
    tier.put(held + [9], cache)
    assert tier.flush(30)
    assert other.find(held + [9, 9]).length == len(held) + 1


def test_a_ram_miss_is_served_from_disk_and_kept_in_ram(loaded, tmp_path):
    model, _, tok = loaded("dense")
    cache, held = _filled(model, tok)
    ram = TieredPromptCache(10, disk=_tier(tmp_path, model))
    ram.insert_cache("m", held, cache, persist=True)
    assert ram.disk.flush(30)
    restarted = TieredPromptCache(10, disk=_tier(tmp_path, model))
    got, rest = restarted.fetch_nearest_cache("m", held + [3])
    assert rest == [3]
    _assert_same(got, cache, model)
    assert len(restarted) == 1  # kept in RAM: the next lookup reads no file
    os.unlink(restarted.disk.find(held).path)
    assert restarted.fetch_nearest_cache("m", held + [3])[1] == [3]
    # not persisted: RAM only
    ram.insert_cache("m", held[:5], cache)
    assert ram.disk.flush(30) and ram.disk.find(held[:5]) is None


def test_bad_files_are_skipped_once_and_removed(loaded, tmp_path, caplog):
    """Truncated, corrupt (a flipped data byte), another model's under this
    model's name, not safetensors at all: each one log line, removed, never
    loaded; another model's own entries are left alone."""
    model, _, tok = loaded("dense")
    tier = _tier(tmp_path, model)
    for i in range(3):
        cache, held = _filled(model, tok, LONG + "\n" * (i + 1), 3)
        tier.put(held, cache)
    assert tier.flush(30)
    truncated, flipped, foreign = [e.path for e in sorted(tier._entries.values(),
                                                           key=lambda e: e.length)]
    data = truncated.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    data = bytearray(flipped.read_bytes())
    data[-100] ^= 0x40
    flipped.write_bytes(bytes(data))
    data = foreign.read_bytes()
    foreign.write_bytes(data.replace(tier.model_id.encode(), b"f" * 64, 1))
    garbage = tmp_path / f"{tier.model_id[:16]}-{'0' * 32}.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    theirs = tmp_path / f"{'a' * 16}-{'1' * 32}.safetensors"
    theirs.write_bytes(b"another model's entry: never opened")
    with caplog.at_level(logging.WARNING):
        again = _tier(tmp_path, model)  # the scan reads the header of each of this model's
    lines = [r.getMessage() for r in caplog.records]
    assert sorted(line.split()[2] for line in lines) == sorted(
        p.name for p in (truncated, foreign, garbage)), lines
    assert not truncated.exists() and not foreign.exists() and not garbage.exists()
    assert theirs.exists() and flipped.exists()
    # the flipped byte is in the data: found when the entry is loaded
    entry = next(e for e in again._entries.values() if e.path == flipped)
    tokens = list(struct.unpack(f"<{entry.length}i", entry.tokens))
    assert again.find(tokens) == entry
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert again.load(entry) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"prompt cache: {flipped.name} is skipped and removed: ValueError: its data does not "
        "match its CRC-32 (corrupt)"]
    assert not flipped.exists() and again.find(tokens) is None


def test_the_folder_stays_under_its_cap_least_recently_used_first(loaded, tmp_path):
    model, _, tok = loaded("dense")
    cache, held = _filled(model, tok)
    # (one cache under several keys: this tier does not check lengths)
    tier = DiskTier(tmp_path, 1 << 30, model_fingerprint(model))
    keys = [held[:-i] for i in range(1, 8)]
    tier.put(keys[0], cache)
    assert tier.flush(30)
    size = next(tmp_path.iterdir()).stat().st_size
    # room for 3: an entry is written once the folder holds at most cap - (its size, tokens
    # and header slack)
    room = prompt_store._nbytes(prompt_store.frozen(cache)) + len(keys[0]) * 4 * 4 // 3 + 4 + prompt_store.HEADER_SLACK
    tier.max_bytes = 2 * size + room + size // 2
    names = lambda: {p.name for p in tmp_path.iterdir()}  # noqa: E731
    for i, k in enumerate(keys):
        if i:
            tier.put(k, cache)
            assert tier.flush(30)
        if i == 2:  # keys[0] used since: keys[1] is the least recently used
            time.sleep(0.02)
            assert tier.load(tier.find(keys[0])) is not None
        if i == 3:
            assert names() == {tier.name_of(keys[j]) for j in (0, 2, 3)}
        time.sleep(0.02)
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= tier.max_bytes
    assert names() == {tier.name_of(k) for k in keys[-3:]}


def test_a_full_disk_is_said_once_and_writing_resumes(loaded, tmp_path, caplog, monkeypatch):
    model, _, tok = loaded("dense")
    cache, held = _filled(model, tok)
    tier = _tier(tmp_path, model)
    real = prompt_store.save_prompt_cache

    def full(path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(prompt_store, "save_prompt_cache", full)
    with caplog.at_level(logging.INFO):
        for i in range(4):
            tier.put(held[:-i - 1], cache)
            assert tier.flush(30)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "is full" in lines[0], lines
    assert list(tmp_path.iterdir()) == []  # the partial temporary files are gone
    monkeypatch.setattr(prompt_store, "save_prompt_cache", real)
    tier.put(held, cache)
    assert tier.flush(30) and tier.find(held) is not None


WRITER = """
import sys, mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_mtp.server.prompt_store import DiskTier
kv = KVCache()
kv.update_and_fetch(mx.ones((1, 8, 1 << 16, 128)), mx.ones((1, 8, 1 << 16, 128)))
tier = DiskTier(sys.argv[1], 1 << 40, "ab" * 32)
tier.put(list(range(1 << 16)), [kv])
print("queued", flush=True)
tier.flush()
print("written", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_no_entry(tmp_path):
    """SIGKILL while the writer writes (a 512 MiB entry): no entry file, only a
    temporary one, which the next tier on the folder removes; nothing loads."""
    p = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "queued"
        deadline = time.time() + 60
        while time.time() < deadline:  # the temporary file is being written
            tmp = [f for f in tmp_path.iterdir() if f.name.startswith(".")]
            if tmp and tmp[0].stat().st_size > 1 << 20:
                break
            time.sleep(0.005)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    names = [f.name for f in tmp_path.iterdir()]
    assert len(names) == 1 and prompt_store.TEMPORARY.fullmatch(names[0]), names
    tier = DiskTier(tmp_path, 1 << 40, "ab" * 32)
    assert list(tmp_path.iterdir()) == [] and tier.find(list(range(1 << 16))) is None


def test_the_fingerprint_tells_models_apart(loaded, tmp_path):
    """Weights (another seed), dtype, quantization: each another fingerprint;
    the same folder loaded twice: the same one."""
    import mlx_mtp
    from mlx_mtp.testing.synthetic import write_checkpoint

    prints = {name: model_fingerprint(loaded(name)[0]) for name in ("dense", "dense_bf16", "q4")}
    assert len(set(prints.values())) == 3
    a = write_checkpoint(tmp_path / "a", seed=5)
    b = write_checkpoint(tmp_path / "b", seed=6)
    fa = model_fingerprint(mlx_mtp.load(a, quiet=True)[0])
    assert fa == model_fingerprint(mlx_mtp.load(a, quiet=True)[0])
    assert fa != model_fingerprint(mlx_mtp.load(b, quiet=True)[0])


def test_the_writer_thread_makes_the_copy_of_what_was_handed_over(loaded, tmp_path,
                                                                   monkeypatch):
    """`put` (called on the generation thread) only hands the cache's arrays
    over: the compact copy is made on the writer thread. What is written is
    the cache as handed over, though the caller's cache changes in place
    before the writer reads it (a KV slice assignment, a GDN state replaced,
    a token appended), as a decoding row's cache does."""
    import threading

    from mlx_lm.models.cache import ArraysCache, KVCache

    model, _, tok = loaded("dense")
    cache, held = _filled(model, tok)
    before = prompt_store.frozen(cache)  # (what the entry must hold)
    copied_on, go = [], threading.Event()
    real = prompt_store.frozen

    def frozen(c):
        copied_on.append(threading.current_thread())
        assert go.wait(30)
        return real(c)

    monkeypatch.setattr(prompt_store, "frozen", frozen)
    tier = _tier(tmp_path, model)
    tier.put(held, cache)
    kinds = set()
    for c in cache:  # (the writer waits: the caller's cache moves on meanwhile)
        if isinstance(c, KVCache) and c.keys is not None:
            c.keys[..., :2, :] = 7.0
            c.values[..., :2, :] = 7.0
            c.update_and_fetch(mx.ones_like(c.keys[..., :1, :]), mx.ones_like(c.values[..., :1, :]))
            kinds.add("kv")
        elif isinstance(c, ArraysCache) and c[1] is not None:
            c[1] = c[1] + 1.0
            kinds.add("gdn")
    mx.eval([c.state for c in cache])
    assert kinds == {"kv", "gdn"}
    go.set()
    assert tier.flush(30)
    assert copied_on and all(t is tier._writer for t in copied_on), copied_on
    _assert_same(tier.load(tier.find(held)), before, model)
