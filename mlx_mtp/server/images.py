"""A request's images (docs/design.md, "Images"): OpenAI `image_url` parts
and Anthropic `image` blocks read into decoded images on the handler's
thread, each part replaced in place by the model's image placeholder text
(the chat template then renders it as its own image part renders it), so
the generation thread gets the prompt and the pixels and nothing else.

Data URLs and base64 are decoded here; an http(s) URL is fetched with a
size cap and a time limit. Every fault a client can cause is one ApiError
(400) naming the part: a URL that fails, is too large or of another scheme,
bytes that are no image, too many pixels or images, a video.
"""

from __future__ import annotations

import base64
import binascii
import importlib.util
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .schemas import ApiError

VIDEO = ("video_url", "input_video", "video")


@dataclass(frozen=True)
class ImageLimits:
    """The server's limits on a request's images (its flags)."""

    max_images: int = 16  # --max-images
    max_pixels: int = 6000 * 5600  # --max-image-pixels (one image)
    max_bytes: int = 20 * 1024 * 1024  # --max-image-bytes (one image, encoded)
    timeout: float = 10.0  # --image-timeout (one URL's fetch, seconds)


class ImageReader:
    """Reads a request's images for a model that takes them (`placeholder`:
    the text its template writes for one image; None: the model takes no
    images, and an image is refused with `why`)."""

    def __init__(self, limits: ImageLimits, placeholder: Optional[str], why: str = ""):
        self.limits, self.placeholder, self.why = limits, placeholder, why

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
        if len(data) * 3 // 4 > self.limits.max_bytes:
            raise self._too_large(at)
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{at}: the image's base64 data does not decode",
                           param=at) from None

    def _fetch(self, url: str, at: str) -> bytes:
        """An http(s) image, at most max_bytes, within the time limit."""
        request = urllib.request.Request(url, headers={"User-Agent": "mlx_mtp"})
        try:
            with urllib.request.urlopen(request, timeout=self.limits.timeout) as r:
                data = r.read(self.limits.max_bytes + 1)
        except urllib.error.HTTPError as e:
            raise ApiError(400, f"{at}: fetching the image failed: HTTP {e.code}",
                           param=at) from None
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = getattr(e, "reason", None) or e
            raise ApiError(400, f"{at}: fetching the image failed: {why}", param=at) from None
        if len(data) > self.limits.max_bytes:
            raise self._too_large(at)
        return data

    def _too_large(self, at: str) -> ApiError:
        return ApiError(400, f"{at}: the image is over {self.limits.max_bytes} bytes "
                             "(--max-image-bytes)", param=at)


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
            raise ValueError("its folder has no vision tower")
        if importlib.util.find_spec("mlx_vlm") is None:  # (loaded with the first image)
            raise ImportError
    except ImportError:
        return ImageReader(limits, None, "images need the [vision] extra on the server: "
                                         "pip install 'mlx-mtp[vision]'")
    except (ValueError, OSError) as e:
        return ImageReader(limits, None, f"this model takes no images ({e})")
    placeholder = tokenizer.decode([spec.vision_start_token_id, spec.image_token_id,
                                    spec.vision_end_token_id])
    return ImageReader(limits, placeholder)

