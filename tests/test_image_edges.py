"""Images at their edges, without a server (issue 62): photos read upright
(EXIF orientation), a fetch's total deadline and byte cap against a local
slow HTTP server, base64 in MIME lines, one-line errors that name the image
(never a Python object's address), `images` as a list, and a generator left
open at interpreter exit that prints nothing."""

import base64
import http.server
import io
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="images need the [vision] extra")

import mlx.core as mx  # noqa: E402
from PIL import Image  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp import vision  # noqa: E402
from mlx_mtp.server.images import ImageReader, reader_for  # noqa: E402
from mlx_mtp.server.schemas import ApiError  # noqa: E402
from mlx_mtp.testing.synthetic import write_checkpoint  # noqa: E402
from mlx_mtp.vision import ImageLimits  # noqa: E402
from serving import local_http  # noqa: E402
from util import slow  # noqa: E402

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def _upright(h=48, w=80) -> np.ndarray:
    return np.random.default_rng(3).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png(pixels: np.ndarray, orientation=None) -> bytes:
    image = Image.fromarray(pixels)
    buf = io.BytesIO()
    if orientation is None:
        image.save(buf, format="PNG")
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation  # Orientation
        image.save(buf, format="PNG", exif=exif)
    return buf.getvalue()


def _sideways(upright: np.ndarray) -> bytes:
    """A camera's file of `upright`: stored turned 90 degrees, with EXIF
    orientation 6 (shown: turned 90 degrees clockwise, i.e. upright)."""
    stored = np.ascontiguousarray(np.rot90(upright, k=1))  # (counter-clockwise)
    return _png(stored, orientation=6)


# ------------------------------------------------------------------ EXIF

def test_an_exif_rotated_photo_is_read_upright():
    """decode_image applies the EXIF orientation (bytes and PIL images alike,
    as transformers' and mlx-vlm's loaders do): the same pixels and digest as
    the upright file; the stored pixels are not those."""
    upright = _upright()
    sideways = _sideways(upright)
    want = vision.decode_image(_png(upright))
    got = vision.decode_image(sideways)
    assert got.size == (48, 80) and np.array_equal(got.pixels, want.pixels)
    assert got.digest == want.digest
    assert np.array_equal(vision.decode_image(Image.open(io.BytesIO(sideways))).pixels,
                          want.pixels)
    stored = np.asarray(Image.open(io.BytesIO(sideways)).convert("RGB"))
    assert stored.shape == (80, 48, 3)  # (what was read before: sideways)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("vl"), vision=True)
    model, tok = mlx_mtp.load(str(path))
    return path, model, tok


def _first_logprobs(model, tok, images) -> np.ndarray:
    ids = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is it"}]}], add_generation_prompt=True)
    _, logprobs = next(mlx_mtp.generate_step(mx.array(ids), model, images=images,
                                             draft_tokens=0))
    return np.array(logprobs.astype(mx.float32))


def test_a_photo_file_with_exif_orientation_gives_the_upright_files_logprobs(vl, tmp_path):
    """A file path through the Python API: the rotated-with-EXIF photo's
    first-token log-probs are the upright photo's, and measurably not those
    of its stored (sideways) pixels: the model reads the pixels."""
    _, model, tok = vl
    upright = _upright(64, 96)
    (tmp_path / "upright.png").write_bytes(_png(upright))
    (tmp_path / "phone.png").write_bytes(_sideways(upright))
    want = _first_logprobs(model, tok, [str(tmp_path / "upright.png")])
    got = _first_logprobs(model, tok, [str(tmp_path / "phone.png")])
    np.testing.assert_array_equal(got, want)
    stored = np.ascontiguousarray(np.rot90(upright, k=1))
    as_stored = _first_logprobs(model, tok, [stored])
    assert np.abs(as_stored - want).max() > 1e-3  # (the check above could fail)


# ------------------------------------------------------------- wordings

def test_images_given_as_a_string_is_one_clear_type_error(vl):
    _, model, tok = vl
    ids = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}],
                                  add_generation_prompt=True)
    with pytest.raises(TypeError) as e:
        mlx_mtp.generate(model, tok, ids, max_tokens=1, images="a.png")
    assert str(e.value) == ("images must be a list of images, one per image placeholder in the "
                            "prompt (e.g. images=['photo.png']), not a str")
    with pytest.raises(TypeError, match="one list of images per prompt"):
        mlx_mtp.batch_generate(model, tok, [ids], max_tokens=1, images="a.png")
    with pytest.raises(TypeError, match=r"images\[0\] must be a list of images"):
        mlx_mtp.batch_generate(model, tok, [ids], max_tokens=1, images=["a.png"])


def test_an_unreadable_image_is_named_without_an_object_address(vl, tmp_path):
    """The API names the image (its path, or its place and kind); no
    `<_io.BytesIO object at 0x...>` (Pillow's own message)."""
    _, model, tok = vl
    ids = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "image"}]}], add_generation_prompt=True)
    good = _png(_upright())
    (tmp_path / "notes.png").write_text("not a picture")
    for images, words in (([good, b"hello"], "could not decode image 2 (bytes), 5 bytes: "
                                             "Pillow cannot identify its format"),
                          ([good, str(tmp_path / "notes.png")],
                           f"could not decode image 2 ({tmp_path / 'notes.png'}), 13 bytes"),
                          ([str(tmp_path / "missing.png"), good],
                           f"cannot read image 1 ({tmp_path / 'missing.png'}): No such file")):
        with pytest.raises(ValueError) as e:
            mlx_mtp.generate(model, tok, ids, max_tokens=1, images=images)
        message = str(e.value)
        assert message.startswith(words), message
        assert " at 0x" not in message and "\n" not in message


def test_a_text_only_model_says_it_takes_no_images_once(tmp_path):
    model, tok = mlx_mtp.load(str(write_checkpoint(tmp_path / "text", seed=4)))
    reader = reader_for(model, tok, ImageLimits())
    with pytest.raises(ApiError) as e:
        reader.openai([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched"}}]}])
    message = str(e.value)
    assert message.count("takes no images") == 1 and "\n" not in message, message
    assert message.startswith("messages.0.content.0: this model takes no images (")


def test_base64_in_mime_lines_is_read_and_other_junk_refused():
    """Base64 wrapped in 76-column CRLF lines (what MIME encoders write) is
    the same image; a character outside the alphabet is still refused."""
    reader = ImageReader(ImageLimits(), PLACEHOLDER)
    png = _png(_upright())
    wrapped = base64.encodebytes(png).decode().replace("\n", "\r\n")  # (76 columns)
    assert "\r\n" in wrapped.strip()
    for url in ("data:image/png;base64," + wrapped, "data:image/png;base64,  " + wrapped):
        content = [{"type": "image_url", "image_url": {"url": url}}]
        [image] = reader.openai([{"role": "user", "content": content}])
        assert image.digest == vision.decode_image(png).digest
        assert content[0] == {"type": "text", "text": PLACEHOLDER}
    blocks = []
    reader.anthropic({"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                  "data": wrapped}}, "messages.0.content.0",
                     blocks)
    assert blocks[0].digest == vision.decode_image(png).digest
    bad = "data:image/png;base64," + base64.b64encode(png).decode()[:40] + "*" + "AAAA"
    with pytest.raises(ApiError, match="does not decode"):
        reader.openai([{"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": bad}}]}])


# ---------------------------------------------------------- fetch limits

PNG_152 = _png(np.zeros((4, 4, 3), np.uint8))


class SlowImages(http.server.BaseHTTPRequestHandler):
    """/trickle: a small PNG one byte every 0.25 s; /endless: bytes without
    end, fast; /drip: a byte every 0.05 s without end; /silent: no answer at
    all; /png: the PNG at once; /moved: a 302 to /png; /to-ftp: a 302 to an
    ftp: URL on this machine's port 1 (nothing listens). Each handler notes
    when it ended (its client gone)."""

    protocol_version = "HTTP/1.0"
    ended: dict = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        try:
            if self.path == "/silent":
                time.sleep(30)
                return
            if self.path in ("/moved", "/to-ftp"):
                self.send_response(302)
                self.send_header("Location", "/png" if self.path == "/moved"
                                 else "ftp://127.0.0.1:1/x")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if self.path == "/png":
                self.send_response(200)
                self.send_header("Content-Length", str(len(PNG_152)))
                self.end_headers()
                self.wfile.write(PNG_152)
                return
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            if self.path == "/trickle":
                self.send_header("Content-Length", str(len(PNG_152)))
            self.end_headers()
            self.wfile.flush()
            if self.path == "/trickle":
                for b in PNG_152:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.25)
            while self.path in ("/endless", "/drip"):
                self.wfile.write(b"\0" * (4096 if self.path == "/endless" else 1))
                self.wfile.flush()
                if self.path == "/drip":
                    time.sleep(0.05)
        except OSError:  # the fetch gave up: its connection is closed
            pass
        finally:
            SlowImages.ended[self.path] = time.monotonic()


@pytest.fixture(scope="module")
def slow_server():
    with local_http(SlowImages) as url:
        yield url


@pytest.mark.parametrize("path,words", [("/trickle", "took more than 1 s (--image-timeout)"),
                                        ("/drip", "took more than 1 s (--image-timeout)"),
                                        ("/silent", "took more than 1 s (--image-timeout)"),
                                        ("/endless", "over 100000 bytes (--max-image-bytes)")])
def test_an_image_fetch_has_one_deadline_and_a_byte_cap(slow_server, path, words):
    """A URL that trickles (38 s for 152 bytes at 0.25 s a byte), never ends
    (slowly or fast) or never answers: one 400 within the deadline + 1 s,
    its connection closed (the serving side sees its client go)."""
    reader = ImageReader(ImageLimits(timeout=1.0, max_bytes=100_000), PLACEHOLDER)
    content = [{"type": "image_url", "image_url": {"url": slow_server + path}}]
    t0 = time.monotonic()
    with pytest.raises(ApiError) as e:
        reader.openai([{"role": "user", "content": content}])
    took = time.monotonic() - t0
    assert e.value.status == 400 and words in str(e.value), str(e.value)
    assert took < 1.0 + 1.0, f"{took:.2f} s"
    if path != "/silent":  # (its handler sleeps on: it sends nothing to find the close by)
        deadline = time.monotonic() + 2
        while path not in SlowImages.ended and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path in SlowImages.ended, "the fetch's connection was left open"


def test_a_fetch_within_its_limits_is_read_whole(slow_server, tmp_path):
    """The same reader reads a small image served at once (the deadline
    and the cap do not cut it)."""
    import functools

    (tmp_path / "a.png").write_bytes(PNG_152)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with local_http(handler) as url:
        reader = ImageReader(ImageLimits(timeout=1.0, max_bytes=len(PNG_152)), PLACEHOLDER)
        [image] = reader.openai([{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": url + "/a.png"}}]}])
        assert image.digest == vision.decode_image(PNG_152).digest


def _fetch_one(reader, url):
    return reader.openai([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}])


def _live_timers() -> list:
    return [t for t in threading.enumerate()
            if isinstance(t, threading.Timer) and not t.finished.is_set()]


@pytest.mark.parametrize("url", ["http://[::1/a.png", "https://[zz]/a.png", "http://[::1"])
def test_a_malformed_image_url_is_a_400_naming_its_part(url):
    """A URL urllib cannot parse (an IPv6 host unclosed or not an address):
    the usual one-line 400 naming the part, and no deadline timer left
    running."""
    reader = ImageReader(ImageLimits(timeout=60.0), PLACEHOLDER)
    before = _live_timers()
    with pytest.raises(ApiError) as e:
        _fetch_one(reader, url)
    assert e.value.status == 400, str(e.value)
    assert str(e.value).startswith("messages.0.content.0: fetching the image failed: ")
    assert "\n" not in str(e.value)
    assert _live_timers() == before


def test_a_redirect_is_followed_to_http_only(slow_server):
    """A 302 to another http URL is followed (the image is read); one to an
    ftp: URL (which urllib's default opener follows, outside the deadline)
    is refused in one line without connecting anywhere else."""
    reader = ImageReader(ImageLimits(timeout=5.0), PLACEHOLDER)
    [image] = _fetch_one(reader, slow_server + "/moved")
    assert image.digest == vision.decode_image(PNG_152).digest
    with pytest.raises(ApiError) as e:
        _fetch_one(reader, slow_server + "/to-ftp")
    assert e.value.status == 400
    assert str(e.value) == ("messages.0.content.0: fetching the image failed: HTTP 302 "
                            "redirects to a ftp: URL (images are fetched over http:// and "
                            "https:// only)"), str(e.value)


def test_the_deadline_is_done_before_the_response_closes(slow_server, monkeypatch):
    """The fetch's deadline is cancelled before its response (and so its
    socket's descriptor) is closed, and a timer firing after cancel() shuts
    nothing: a descriptor closed and reused meanwhile is never shut down."""
    import http.client
    import socket

    from mlx_mtp.server import images

    events = []
    cancel, close = images._Deadline.cancel, http.client.HTTPResponse.close
    monkeypatch.setattr(images._Deadline, "cancel",
                        lambda self: (events.append("cancel"), cancel(self))[1])
    monkeypatch.setattr(http.client.HTTPResponse, "close",
                        lambda self: (events.append("close"), close(self))[1])
    _fetch_one(ImageReader(ImageLimits(timeout=5.0), PLACEHOLDER), slow_server + "/png")
    assert "close" in events and events.index("cancel") < events.index("close"), events
    monkeypatch.undo()

    deadline = images._Deadline(60.0)
    a, b = socket.socketpair()
    with a, b:
        deadline.watch(a)
        deadline.cancel()
        deadline._expire()  # (the timer, had it fired just then)
        a.sendall(b"x")
        assert b.recv(1) == b"x" and not deadline.expired


# ------------------------------------------------- a generator left open

LEFT_OPEN = """
import os, sys
import mlx_mtp
from mlx_mtp.loader import demo_model_path
model, tok = mlx_mtp.load(str(demo_model_path()))
gen = mlx_mtp.stream_generate(model, tok, "def f(x):", max_tokens=50,
                              prompt_cache=model.make_cache() if sys.argv[1] == "cache" else None)
next(gen)
# held where only the interpreter's teardown lets it go, after mlx_mtp's
# modules are torn down (as a traceback kept by a long-lived module holds it)
os.kept = gen
"""


@pytest.mark.parametrize("cache", ["cache", slow("none")])
def test_a_generator_left_open_at_exit_prints_nothing(cache):
    out = subprocess.run([sys.executable, "-c", LEFT_OPEN, cache], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr[-3000:]
