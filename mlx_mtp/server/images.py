"""A request's images (docs/design.md, "Images"): OpenAI `image_url` parts
and Anthropic `image` blocks read into decoded images on the handler's
thread, each part replaced in place by the model's image placeholder text
(the chat template then renders it as its own image part renders it), so
the generation thread gets the prompt and the pixels and nothing else.

Data URLs and base64 are decoded here; an http(s) URL is fetched within
one deadline (connecting, headers, every byte) and a byte cap, both held
while reading. The limits are vision.ImageLimits (the flags'). Every fault a
client can cause is one ApiError (400) naming the part: a URL that fails, is
too slow, too large or of another scheme, bytes that are no image, too many
pixels or images, a video. The images' token counts (`expanded`) come from
their sizes here too, for the checks made before a request is queued.
"""

from __future__ import annotations

import base64
import binascii
import functools
import http.client
import importlib.util
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import List, Optional, Sequence

from ..vision import ImageLimits
from .schemas import ApiError

VIDEO = ("video_url", "input_video", "video")
FETCH_CHUNK = 1 << 16  # bytes read from an image URL at a time
# whitespace a base64 writer may wrap its lines with (MIME: 76 columns, CRLF)
_BASE64_SPACE = re.compile(r"[ \t\r\n]+")


class ImageReader:
    """Reads a request's images for a model that takes them (`placeholder`:
    the text its template writes for one image; None: the model takes no
    images, and an image is refused with `why`)."""

    def __init__(self, limits: ImageLimits, placeholder: Optional[str], why: str = "",
                 model_path: Optional[Path] = None):
        self.limits, self.placeholder, self.why = limits, placeholder, why
        self.model_path = model_path  # (its image processor sizes the images: `expanded`)
        self._sizes = None
        self._sizing_lock = threading.Lock()

    def openai(self, messages: list, where: str = "messages") -> list:
        """The images of OpenAI chat messages, in order; each image part
        becomes a text part holding the placeholder."""
        images = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else ()):
                at = f"{where}.{i}.content.{j}"
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind in VIDEO:
                    raise ApiError(400, f"{at}: video input is not supported (images are)",
                                   param=at)
                if kind in ("image_url", "input_image"):
                    url = part.get("image_url")
                    url = url.get("url") if isinstance(url, dict) else url
                    if not isinstance(url, str):
                        raise ApiError(400, f"{at}: an image part needs image_url.url, a string",
                                       param=at)
                    images.append(self._image(self._url(url, at), at, len(images)))
                    content[j] = {"type": "text", "text": self.placeholder}
                elif kind != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{at}: only text and image parts are supported, not "
                                        f"{kind!r}", param=at)
        return images

    def anthropic(self, block: dict, at: str, images: list) -> dict:
        """An Anthropic image block (base64 or url source), appended to
        `images`; returns the text block that takes its place."""
        source = block.get("source")
        kind = source.get("type") if isinstance(source, dict) else None
        if kind == "base64":
            data = source.get("data")
            if not isinstance(data, str):
                raise ApiError(400, f"{at}.source: a base64 image needs data, a string", param=at)
            raw = self._base64(data, at)
        elif kind == "url" and isinstance(source.get("url"), str):
            raw = self._url(source["url"], at)
        else:
            raise ApiError(400, f"{at}.source: an image's source is base64 (data) or url (url)",
                           param=at)
        images.append(self._image(raw, at, len(images)))
        return {"type": "text", "text": self.placeholder}

    # -- reading -------------------------------------------------------------------------
    def _image(self, raw: bytes, at: str, before: int):
        """Decoded pixels (vision.decode_image), within the limits."""
        if self.placeholder is None:
            raise ApiError(400, f"{at}: {self.why}", param=at)
        if before >= self.limits.max_images:
            raise ApiError(400, f"{at}: more than {self.limits.max_images} images in one request "
                                "(--max-images)", param=at)
        from ..vision import decode_image

        try:
            return decode_image(raw, self.limits.max_pixels)
        except ValueError as e:
            raise ApiError(400, f"{at}: {e}", param=at) from None

    def _url(self, url: str, at: str) -> bytes:
        if self.placeholder is None:
            raise ApiError(400, f"{at}: {self.why}", param=at)
        if url.startswith("data:"):
            head, sep, data = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise ApiError(400, f"{at}: a data URL image must be base64 "
                                    "(data:image/...;base64,...)", param=at)
            return self._base64(data, at)
        if not url.startswith(("http://", "https://")):
            raise ApiError(400, f"{at}: an image URL is data:, http:// or https://, not "
                                f"{url.split(':', 1)[0]!r}", param=at)
        return self._fetch(url, at)

    def _base64(self, data: str, at: str) -> bytes:
        """Base64 as MIME encoders write it too (lines of 76 characters):
        whitespace is dropped, anything else outside the alphabet refused."""
        data = _BASE64_SPACE.sub("", data)
        if len(data) * 3 // 4 > self.limits.max_bytes + 2:  # (+2: the last quantum's padding)
            raise self._too_large(at)
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{at}: the image's base64 data does not decode",
                           param=at) from None
        if len(raw) > self.limits.max_bytes:
            raise self._too_large(at)
        return raw

    def _fetch(self, url: str, at: str) -> bytes:
        """An http(s) image of at most max_bytes, fetched (connection, TLS,
        headers, redirects and every byte) within one deadline: both limits
        hold while reading, so a URL that trickles or never ends holds the
        handler's thread no longer than --image-timeout. Only http(s) is
        fetched, redirects included. Not bounded: resolving a host name
        (getaddrinfo, the system resolver's own timeouts), before each
        connection."""
        limits = self.limits
        deadline = None
        try:
            request = urllib.request.Request(url, headers={"User-Agent": "mlx_mtp"})
            deadline = _Deadline(limits.timeout)
            with _opener(deadline).open(request, timeout=limits.timeout) as r:
                try:
                    data = self._read(r, at)
                finally:  # (before the response closes its descriptor: see _Deadline)
                    deadline.cancel()
                if deadline.expired:  # (cut off: what came is not the image)
                    raise TimeoutError
        except urllib.error.HTTPError as e:
            raise ApiError(400, f"{at}: fetching the image failed: HTTP {e.code}",
                           param=at) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            if deadline is not None and (deadline.expired or
                                         isinstance(getattr(e, "reason", e), TimeoutError)):
                raise ApiError(400, f"{at}: fetching the image took more than "
                                    f"{limits.timeout:g} s (--image-timeout)", param=at) from None
            why = getattr(e, "reason", None) or e
            raise ApiError(400, f"{at}: fetching the image failed: {why}", param=at) from None
        finally:
            if deadline is not None:
                deadline.cancel()
        return data

    def _read(self, r, at: str) -> bytes:
        """A response's body, refused as soon as it passes max_bytes."""
        length = r.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_bytes:
            raise self._too_large(at)
        data, got = [], 0
        while True:
            chunk = r.read1(FETCH_CHUNK)  # (what one read gives: the deadline's
            if not chunk:  # shutdown ends a read that waits)
                break
            got += len(chunk)
            if got > self.limits.max_bytes:
                raise self._too_large(at)
            data.append(chunk)
        return b"".join(data)

    def _too_large(self, at: str) -> ApiError:
        return ApiError(400, f"{at}: the image is over {self.limits.max_bytes} bytes "
                             "(--max-image-bytes)", param=at)

    # -- the prompt's size ---------------------------------------------------------------
    def expanded(self, tokens: Sequence[int], images: Sequence) -> List[int]:
        """A rendered prompt (one placeholder per image) with each image's
        pads expanded, from the images' sizes alone (vision.expanded_prompt,
        the rule the generation lays the prompt out by): what its `usage`
        counts, known before anything is queued. ValueError when the
        placeholders are not one per image."""
        from ..vision import expanded_prompt

        spec, processor = self._sizing()
        return expanded_prompt(tokens, images, spec, processor)

    def _sizing(self):
        """The model's VisionSpec and image processor (no tower weights),
        read at the first image's request."""
        with self._sizing_lock:
            if self._sizes is None:
                from ..checkpoint import read_config_file
                from ..vision import VisionSpec, image_processor

                config = read_config_file(self.model_path)
                self._sizes = (VisionSpec.from_config(config),
                               image_processor(self.model_path, config["vision_config"]))
            return self._sizes


class _Deadline:
    """One fetch's deadline over all its connections (a redirect opens
    another): each connects within what is left, and when the time is up
    every one's socket is shut down, so that a read waiting in the middle of
    a trickle (the headers' or the body's) returns at once."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds
        self.expired = False
        self._done = False
        self._sockets: list = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def watch(self, sock: Optional[socket.socket]):
        with self._lock:
            if not (self.expired or self._done):
                self._sockets.append(sock)
                return
            _shut(sock)

    def _expire(self):
        # (sockets shut under the lock: once cancel() has returned, none is
        # touched, so a descriptor closed and reused after it is safe)
        with self._lock:
            if self._done:
                return
            self.expired = True
            for sock in self._sockets:
                _shut(sock)
            self._sockets = []

    def cancel(self):
        """Done with the fetch (call it before the response is closed): the
        timer, should it fire now, shuts nothing and `expired` stays."""
        with self._lock:
            self._done = True
            self._sockets = []
        self._timer.cancel()


def _shut(sock: Optional[socket.socket]):
    """End a socket's traffic both ways, from any thread: a read waiting on
    it returns. (urllib closes the connection's socket object once the
    response holds it; its descriptor stays open until the response is.)"""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # (already closed)
            pass


class _Watched:
    """An http.client connection under a fetch's `_Deadline`: it connects
    (and shakes hands, for TLS) within what is left, each socket operation
    bounded by it, and is cut when the deadline passes."""

    def __init__(self, *args, deadline: _Deadline, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline = deadline

    def connect(self):
        if self.deadline.expired:
            raise TimeoutError("the image fetch's deadline passed")
        self.timeout = max(self.deadline.left(), 0.001)
        super().connect()
        self.deadline.watch(self.sock)


class _WatchedHTTP(_Watched, http.client.HTTPConnection):
    pass


class _WatchedHTTPS(_Watched, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(functools.partial(_WatchedHTTP, deadline=self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        self.context = ssl.create_default_context()
        super().__init__(context=self.context)
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(functools.partial(_WatchedHTTPS, deadline=self.deadline), req,
                            context=self.context)


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """urllib's opener for http(s) alone, under `deadline`: build_opener's
    would also open ftp:, file: and data: URLs, a redirect's included (an
    ftp: one outside the deadline)."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), urllib.request.UnknownHandler(),
                    _HTTPHandler(deadline), _HTTPSHandler(deadline),
                    urllib.request.HTTPDefaultErrorHandler(), _HTTPRedirects(),
                    urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


class _HTTPRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) URLs only (urllib's also goes to ftp:)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urllib.parse.urlsplit(newurl).scheme.lower()
        if scheme not in ("http", "https"):
            fp.close()
            raise urllib.error.URLError(f"HTTP {code} redirects to a {scheme}: URL (images are "
                                        "fetched over http:// and https:// only)")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def reader_for(model, tokenizer, limits: ImageLimits) -> ImageReader:
    """The server's reader for this model: the placeholder its template
    writes for an image, or None and the reason it takes none (no M-RoPE,
    no tower in its folder, the [vision] extra missing)."""
    from ..vision import VisionSpec

    if not getattr(model, "takes_images", False):
        return ImageReader(limits, None, "this model takes no images (it reads text)")
    try:
        from ..checkpoint import read_config_file
        from ..vision import vision_tensor_names

        path = Path(model.model_path)
        spec = VisionSpec.from_config(read_config_file(path))
        if not vision_tensor_names(path):
            raise ValueError("this model takes no images (its folder has no vision tower)")
        if importlib.util.find_spec("mlx_vlm") is None:  # (loaded with the first image)
            raise ImportError
    except ImportError:
        return ImageReader(limits, None, "images need the [vision] extra on the server: "
                                         "pip install 'mlx-mtp[vision]'")
    except ValueError as e:  # (VisionSpec's words: "this model takes no images (...)")
        return ImageReader(limits, None, str(e))
    except OSError as e:
        return ImageReader(limits, None, f"this model takes no images ({e})")
    placeholder = tokenizer.decode([spec.vision_start_token_id, spec.image_token_id,
                                    spec.vision_end_token_id])
    return ImageReader(limits, placeholder, model_path=path)
