"""Images for Qwen3.5/3.6 and qwen4_exp: the vision tower, image preprocessing and the
M-RoPE position index of a prompt with image spans (docs/design.md, "Images").

The tower is mlx-vlm's Qwen3.5 `VisionModel` with mlx-vlm's weight names and
sanitize; preprocessing is mlx-vlm's NumPy Qwen3-VL image processor (resize,
patches, normalize), fed by our decoder (bytes, PIL images and uint8 arrays
to RGB pixels, transparency composited onto white as transformers does). Both
come with the optional extra `pip install "mlx-mtp[vision]"`; only this
module imports them (at the first image), and the library's text path
(mlx_mtp.load, generate) never imports this module; the server imports it
for `ImageLimits`, the image limits' one home.

Errors a client can cause (undecodable bytes, an unsupported type, too many
pixels, a prompt whose image spans do not fit its images) are one-line
`ValueError`s, for the server's 400.
"""

from __future__ import annotations

import hashlib
import importlib
import io
import itertools
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .checkpoint import read_config_file, safetensors_header, text_config, weight_files

if TYPE_CHECKING:
    from .rows import Media
    import mlx.core as mx
    from PIL import Image as PILImage



@dataclass(frozen=True)
class ImageLimits:
    """The limits on images, with their defaults: one home for the Python
    API (`max_pixels`), the server's reader (server/images.py) and its
    flags' defaults (server/cli.py)."""

    # images one request may carry (--max-images)
    max_images: int = 16
    # pixels one image may have, checked from its header before its pixels
    # are decoded (--max-image-pixels): 6000 x 5600; the processor resizes
    # everything to at most the checkpoint's `longest_edge` pixels anyway
    max_pixels: int = 6000 * 5600
    # encoded bytes one image may have (--max-image-bytes); inline base64
    # is also bounded by the body's limit (--max-body-bytes)
    max_bytes: int = 20 * 1024 * 1024
    # seconds one image URL's fetch may take in all: connect, headers and
    # every byte (--image-timeout)
    timeout: float = 10.0


DEFAULT_LIMITS = ImageLimits()
MAX_INPUT_PIXELS = DEFAULT_LIMITS.max_pixels  # (the Python API's bound on one image)
# images whose features the tower keeps (by pixel digest), for the next turn
FEATURES_KEPT = 16

# The weight names of the tower in the two layouts: Hugging Face's release
# and mlx-vlm's conversion (which keeps the text model as `language_model.*`)
HF_PREFIX, MLX_VLM_PREFIX = "model.visual.", "vision_tower."
_TOWER_PREFIXES = (HF_PREFIX, MLX_VLM_PREFIX, "model.language_model.visual.")

# mlx-vlm's model package per config model_type (same tower, same names)
# (qwen4_exp's is mlx-vlm's Qwen3-VL tower without deepstack, the same names)
_MLX_VLM_MODELS = {"qwen3_5": "mlx_vlm.models.qwen3_5", "qwen3_5_moe": "mlx_vlm.models.qwen3_5_moe",
                   "qwen4_exp": "mlx_vlm.models.qwen4_exp"}

ImageInput = Union[bytes, bytearray, memoryview, np.ndarray, "PILImage.Image"]


def _need(module: str):
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"images need the vision extra: pip install 'mlx-mtp[vision]' ({e})") from None


# ------------------------------------------------------------------ config

@dataclass(frozen=True)
class VisionSpec:
    """What the text side needs to know about images, read from config.json:
    the special tokens' ids, the tower's spatial merge, and the text model's
    M-RoPE layout (`mrope_section`: rotary frequencies per axis t, h, w;
    `mrope_interleaved`: frequency j belongs to axis j % 3 while that axis
    has frequencies left, Qwen3.5's layout; see families/mrope.py)."""

    image_token_id: int
    video_token_id: Optional[int]
    vision_start_token_id: Optional[int]
    vision_end_token_id: Optional[int]
    spatial_merge_size: int
    mrope_section: Tuple[int, int, int]
    mrope_interleaved: bool

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "VisionSpec":
        vc = config.get("vision_config")
        if not isinstance(vc, dict) or "image_token_id" not in config:
            raise ValueError("this model takes no images (its config.json has no vision_config "
                             "or no image_token_id)")
        tc = text_config(config)
        rope = tc.get("rope_parameters") or tc.get("rope_scaling") or {}
        section = rope.get("mrope_section")
        if not section or len(section) != 3:
            raise ValueError(f"config.json: the text config's rope parameters name no 3-axis "
                             f"mrope_section (got {section!r})")
        return cls(
            image_token_id=int(config["image_token_id"]),
            video_token_id=_opt_int(config.get("video_token_id")),
            vision_start_token_id=_opt_int(config.get("vision_start_token_id")),
            vision_end_token_id=_opt_int(config.get("vision_end_token_id")),
            spatial_merge_size=int(vc.get("spatial_merge_size", 2)),
            mrope_section=tuple(int(s) for s in section),
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        )


def _opt_int(v) -> Optional[int]:
    return None if v is None else int(v)


# ----------------------------------------------------------- decode images

@dataclass(frozen=True)
class DecodedImage:
    """An image's RGB pixels (H x W x 3, uint8) and their sha256
    (`pixel_digest`): equal for equal pixels however they arrived."""

    pixels: np.ndarray
    digest: str

    @property
    def size(self) -> Tuple[int, int]:
        """(height, width)"""
        return self.pixels.shape[0], self.pixels.shape[1]


def pixel_digest(pixels: np.ndarray) -> str:
    """sha256 (hex) of RGB uint8 pixels and their shape: a key for caching an
    image's features whatever encoding (PNG, JPEG's decoded output, raw)
    delivered it."""
    h = hashlib.sha256(f"rgb8:{pixels.shape[0]}x{pixels.shape[1]}:".encode())
    h.update(np.ascontiguousarray(pixels).tobytes())
    return h.hexdigest()


def decode_image(image: ImageInput, max_pixels: int = MAX_INPUT_PIXELS,
                 source: str = "the image") -> DecodedImage:
    """An image as RGB pixels: encoded bytes (any format Pillow reads; the
    first frame of an animation), a PIL image, or an H x W x 3 uint8 array.
    An EXIF orientation is applied (the image as a viewer shows it, as
    transformers' and mlx-vlm's loaders read it); transparency is
    composited onto white (transformers' `convert_to_rgb`, as the Qwen
    processors do). One-line ValueError, naming `source` (e.g. "image 2
    (bytes)"), for what cannot be an image or has more than `max_pixels`
    pixels."""
    Image = _need("PIL.Image")
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"{source}: an image array must be H x W x 3 uint8 RGB, not "
                             f"{'x'.join(map(str, image.shape))} {image.dtype}")
        _check_pixels(image.shape[0], image.shape[1], max_pixels, source)
        if min(image.shape[:2]) == 0:
            raise ValueError(f"{source} has no pixels")
        pixels = np.ascontiguousarray(image)
        return DecodedImage(pixels, pixel_digest(pixels))
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
        if not data:
            raise ValueError(f"{source} is empty (0 bytes)")
        try:
            pil = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            raise ValueError(f"{source} has more than {max_pixels} pixels") from None
        except Image.UnidentifiedImageError:  # (its message names the BytesIO object)
            raise ValueError(f"could not decode {source}, {len(data)} bytes: Pillow cannot "
                             "identify its format") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise ValueError(f"could not decode {source}, {len(data)} bytes: "
                             f"{_one_line(e) or type(e).__name__}") from None
        _check_pixels(pil.height, pil.width, max_pixels, source)
        try:
            pil.load()
        except Exception as e:  # Pillow's decoders raise OSError, SyntaxError, struct.error ...
            raise ValueError(f"could not decode {source}, {len(data)} bytes of {pil.format}: "
                             f"{_one_line(e) or type(e).__name__}") from None
    elif isinstance(image, Image.Image):
        pil = image
        _check_pixels(pil.height, pil.width, max_pixels, source)
    else:
        raise ValueError(f"{source}: unsupported image type {type(image).__name__}: pass "
                         "encoded bytes, a PIL image or an H x W x 3 uint8 array")
    if pil.width == 0 or pil.height == 0:
        raise ValueError(f"{source} has no pixels")
    try:  # (a photo's camera orientation: stored sideways, shown upright)
        pil = _need("PIL.ImageOps").exif_transpose(pil)
    except Exception as e:  # a malformed EXIF block
        raise ValueError(f"{source}: its EXIF orientation cannot be read: "
                         f"{_one_line(e) or type(e).__name__}") from None
    from transformers.image_transforms import convert_to_rgb

    pixels = np.ascontiguousarray(convert_to_rgb(pil, return_numpy=True), dtype=np.uint8)
    return DecodedImage(pixels, pixel_digest(pixels))


def _check_pixels(height: int, width: int, max_pixels: int, source: str = "the image"):
    if height * width > max_pixels:
        raise ValueError(f"{source} of {width}x{height} pixels is over the limit of {max_pixels}")


def _one_line(e: BaseException) -> str:
    """An exception's message on one line, without Python object reprs
    (`<_io.BytesIO object at 0x...>` says nothing to whoever sent it)."""
    return " ".join(_OBJECT_REPR.sub("the data", str(e)).split())


_OBJECT_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


# ------------------------------------------------------------- preprocess

def image_processor(model_path: Union[str, Path], vision_config: Optional[Dict[str, Any]] = None):
    """mlx-vlm's Qwen3-VL image processor (NumPy: PIL bicubic resize to the
    patch grid between `size.shortest_edge` and `size.longest_edge` pixels,
    rescale, normalize, patches duplicated over the temporal patch) with the
    settings of the folder's preprocessor_config.json (and
    processor_config.json's `image_processor`, as mlx-vlm reads them). Its
    patch, temporal patch and merge sizes must be the tower's."""
    model_path = Path(model_path)
    if not (model_path / "preprocessor_config.json").exists():
        raise FileNotFoundError(f"{model_path / 'preprocessor_config.json'} is missing: "
                                f"images need the checkpoint's image processor settings")
    processing = _need("mlx_vlm.models.qwen3_vl.processing_qwen3_vl")
    # mlx-vlm's reader of those two files (it names the released keys); the
    # file is local, so it never goes to the Hub
    processor = processing.Qwen3VLImageProcessor(**processing._qwen_vl_image_kwargs(str(model_path)))
    if vision_config is not None:
        for mine, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                             ("merge_size", "spatial_merge_size")):
            if theirs in vision_config and getattr(processor, mine) != vision_config[theirs]:
                raise ValueError(f"{model_path}: preprocessor_config.json's {mine} "
                                 f"{getattr(processor, mine)} is not the vision tower's "
                                 f"{vision_config[theirs]}")
    return processor


def preprocess(images: Sequence[DecodedImage], processor) -> Tuple[np.ndarray, np.ndarray]:
    """Decoded images -> (pixel_values [sum of patches, C*T*P*P] float32,
    image_grid_thw [n, 3] int64), as the tower takes them."""
    if not images:
        raise ValueError("no images")
    # the processor takes C x H x W uint8 arrays as they are (RGB already)
    out = processor([np.transpose(im.pixels, (2, 0, 1)) for im in images])
    return out["pixel_values"].astype(np.float32), out["image_grid_thw"].astype(np.int64)


def image_token_count(grid_thw: Sequence[int], spatial_merge_size: int) -> int:
    """The image-pad tokens an image of this patch grid takes in the prompt:
    one per merged (spatial_merge_size x spatial_merge_size) group of
    patches."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // spatial_merge_size ** 2


def image_grid(processor, image: DecodedImage) -> Tuple[int, int, int]:
    """An image's patch grid (t, h, w), from its size alone: the processor's
    resize rule (the tower is not needed, nor its pixels processed)."""
    h, w = processor._resolved_size(*image.size)
    return (1, h // processor.patch_size, w // processor.patch_size)


def expanded_prompt(tokens: Sequence[int], images: Sequence[DecodedImage], spec: VisionSpec,
                    processor) -> List[int]:
    """A prompt with one image-pad placeholder per image, each expanded to
    its image's pads as `prompt_layout` lays it out (from the images' sizes
    alone): the prompt the model reads, and the tokens `usage` counts.
    ValueError when the placeholders are not one per image."""
    counts = [image_token_count(image_grid(processor, im), spec.spatial_merge_size)
              for im in images]
    return expand_image_pads(list(tokens), counts, spec)


# ------------------------------------------------------------------ tower

@dataclass(frozen=True)
class EncodedImage:
    """One image through the tower: `features` [tokens, text hidden] (what
    the prompt's image-pad tokens take in place of their embeddings), the
    patch grid, the pixel digest and the token count."""

    features: "mx.array"
    grid_thw: Tuple[int, int, int]
    digest: str
    tokens: int


def vision_tensor_names(model_path: Path) -> Dict[str, List[str]]:
    """The tower's tensor names per weight file, from the headers alone."""
    found = {}
    for f in weight_files(model_path):
        names = [k for k in safetensors_header(f) if k.startswith(_TOWER_PREFIXES)]
        if names:
            found[str(f)] = names
    return found


def load_tower_weights(model_path: Path) -> Tuple[Dict[str, "mx.array"], str]:
    """The tower's tensors under mlx-vlm's `VisionModel` names (the
    `vision_tower.` prefix dropped, by mlx-vlm's Qwen3.5 `sanitize_key`), and
    the layout they came in: "hf" (`model.visual.*`) or "mlx-vlm"
    (`vision_tower.*`). Only the files holding tower tensors are opened."""
    import mlx.core as mx

    sanitize_key = _need("mlx_vlm.models.qwen3_5.qwen3_5").sanitize_key
    per_file = vision_tensor_names(model_path)
    if not per_file:
        raise ValueError(f"{model_path} has no vision tower tensors (model.visual.* or vision_tower.*)")
    names = [n for ns in per_file.values() for n in ns]
    layouts = {"mlx-vlm" if n.startswith(MLX_VLM_PREFIX) else "hf" for n in names}
    if len(layouts) > 1:
        raise ValueError(f"{model_path} holds the vision tower twice (model.visual.* and vision_tower.*)")
    weights = {}
    for f, ns in per_file.items():
        arrays = mx.load(f)  # lazy: only the tensors taken below are read
        for n in ns:
            weights[sanitize_key(n)[len(MLX_VLM_PREFIX):]] = arrays[n]
    return weights, layouts.pop()


class VisionTower:
    """A checkpoint's vision tower and image processor (`load_tower`)."""

    def __init__(self, model, processor, spec: VisionSpec, layout: str,
                 max_input_pixels: int = MAX_INPUT_PIXELS):
        self.model = model          # mlx-vlm's VisionModel
        self.processor = processor  # mlx-vlm's Qwen3VLImageProcessor
        self.spec = spec
        self.layout = layout
        self.max_input_pixels = max_input_pixels
        self._kept: "OrderedDict[str, object]" = OrderedDict()  # digest -> features

    @property
    def dtype(self):
        return self.model.patch_embed.proj.weight.dtype

    def decode(self, images: Iterable[ImageInput]) -> List[DecodedImage]:
        return [decode_image(im, self.max_input_pixels) for im in images]

    def token_count(self, image: Union[ImageInput, DecodedImage]) -> int:
        """The image-pad tokens an image takes, from its size alone (the
        processor's resize rule; no pixels processed)."""
        if not isinstance(image, DecodedImage):
            image = decode_image(image, self.max_input_pixels)
        return int(self.processor.num_image_tokens(*image.size))

    def encode(self, images: Iterable[Union[ImageInput, DecodedImage]]) -> Tuple["mx.array", np.ndarray]:
        """Images -> (features [sum of tokens, text hidden], grid_thw [n, 3]):
        image i's features are the next `image_token_count(grid_thw[i])`
        rows, in order."""
        import mlx.core as mx

        decoded = [im if isinstance(im, DecodedImage) else decode_image(im, self.max_input_pixels)
                   for im in images]
        pixel_values, grid = preprocess(decoded, self.processor)
        features, _ = self.model(mx.array(pixel_values).astype(self.dtype), mx.array(grid))
        return features, grid

    def grid(self, image: "DecodedImage") -> Tuple[int, int, int]:
        """An image's patch grid (t, h, w), from its size alone (`image_grid`)."""
        return image_grid(self.processor, image)

    def features(self, images: Sequence["DecodedImage"]) -> List["mx.array"]:
        """Each image's features, the tower run once for those not among the
        last FEATURES_KEPT images' (by pixel digest): a second turn about an
        image does not encode it again."""
        todo = [im for im in images if im.digest not in self._kept]
        if todo:
            for im, enc in zip(todo, self.encode_images(todo)):
                self._kept[im.digest] = enc.features
                while len(self._kept) > FEATURES_KEPT:
                    self._kept.popitem(last=False)
        for im in images:
            self._kept.move_to_end(im.digest)
        return [self._kept[im.digest] for im in images]

    def encode_images(self, images: Iterable[Union[ImageInput, DecodedImage]]) -> List[EncodedImage]:
        """`encode`, one EncodedImage per image (with its pixel digest)."""
        import mlx.core as mx

        decoded = [im if isinstance(im, DecodedImage) else decode_image(im, self.max_input_pixels)
                   for im in images]
        features, grid = self.encode(decoded)
        counts = [image_token_count(g, self.spec.spatial_merge_size) for g in grid]
        parts = mx.split(features, list(itertools.accumulate(counts))[:-1]) if len(counts) > 1 else [features]
        return [EncodedImage(f, tuple(int(x) for x in g), d.digest, n)
                for f, g, d, n in zip(parts, grid, decoded, counts)]


def load_tower(model_path: Union[str, Path], max_input_pixels: int = MAX_INPUT_PIXELS) -> VisionTower:
    """The vision tower of a Qwen3.5/3.6 or qwen4_exp folder, in the released HF layout
    (`model.visual.*`, Conv3d patch embedding in torch's layout) or mlx-vlm's
    converted one (`vision_tower.*`, quantized or not): mlx-vlm's
    `VisionModel` for the config's `vision_config`, its `sanitize` (the
    patch embedding moved to MLX's channels-last layout), strict loading
    (every tensor present, every shape right), and the image processor."""
    import mlx.core as mx
    import mlx.nn as nn

    model_path = Path(model_path)
    config = read_config_file(model_path)
    spec = VisionSpec.from_config(config)
    model_type = config.get("model_type")
    if model_type not in _MLX_VLM_MODELS:
        raise ValueError(f"{model_path}: no vision tower for model_type {model_type!r} "
                         f"(supported: {', '.join(_MLX_VLM_MODELS)})")
    vlm = _need(_MLX_VLM_MODELS[model_type])
    vc = dict(config["vision_config"])
    vc.setdefault("model_type", model_type)
    model = vlm.VisionModel(vlm.VisionConfig.from_dict(vc))
    weights, layout = load_tower_weights(model_path)
    weights = model.sanitize(weights)
    quantization = config.get("quantization")
    if any(k.endswith(".scales") for k in weights):
        if not quantization:
            raise ValueError(f"{model_path}: the vision tower is quantized but config.json names no quantization")

        def quantized(path, module):  # mlx-vlm's rule: a layer is quantized where its scales are
            if f"{path}.scales" not in weights:
                return False
            own = quantization.get(f"{MLX_VLM_PREFIX}{path}")
            return own if isinstance(own, dict) else True

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    mode=quantization.get("mode", "affine"), class_predicate=quantized)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    processor = image_processor(model_path, config["vision_config"])
    return VisionTower(model, processor, spec, layout, max_input_pixels)


# ------------------------------------------------------------------ prompt

def expand_image_pads(tokens: Sequence[int], counts: Sequence[int], spec: VisionSpec) -> List[int]:
    """A prompt as a chat template writes it (one image-pad token per image)
    with image i's pad repeated counts[i] times, as the Qwen processors
    expand it. ValueError when the pads are not one per image."""
    pads = [i for i, t in enumerate(tokens) if t == spec.image_token_id]
    if len(pads) != len(counts):
        raise ValueError(f"the prompt has {len(pads)} image placeholders for {len(counts)} images")
    out: List[int] = []
    images = iter(counts)
    for t in tokens:
        out.extend([t] * int(next(images)) if t == spec.image_token_id else [t])
    return out


@dataclass(frozen=True)
class RopeIndex:
    """M-RoPE positions of a prompt: `positions` [3, T] (t, h, w) and
    `delta`, what decoding adds to a token's index in the sequence for its
    position on all three axes from then on (max position + 1 - T)."""

    positions: np.ndarray
    delta: int


def rope_index(tokens: Sequence[int], grid_thw: Sequence[Sequence[int]], spec: VisionSpec) -> RopeIndex:
    """The M-RoPE position ids of one prompt with image spans, by the rule of
    transformers' `Qwen3_5Model.get_rope_index`: text tokens count up on all
    three axes; each run of image-pad tokens is one image, in order, laid
    out on its merged grid (t, h, w) from the position after the text before
    it; the text after an image starts at that start + max(h, w) of the
    merged grid. Videos are not supported yet. ValueError when the runs do
    not match the images' token counts."""
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if spec.video_token_id is not None and (tokens == spec.video_token_id).any():
        raise ValueError("videos are not supported yet")
    m = spec.spatial_merge_size
    grids = [tuple(int(x) for x in g) for g in grid_thw]
    is_image = tokens == spec.image_token_id
    pieces, pos, k, start = [], 0, 0, 0
    for image, run in itertools.groupby(is_image.tolist()):
        n = len(list(run))
        if not image:
            pieces.append(np.broadcast_to(np.arange(pos, pos + n), (3, n)))
            pos += n
        else:
            if k >= len(grids):
                raise ValueError(f"the prompt has more image spans than its {len(grids)} images")
            t, h, w = grids[k][0], grids[k][1] // m, grids[k][2] // m
            if n != t * h * w:
                raise ValueError(f"image {k}'s span has {n} tokens, its grid {grids[k]} needs {t * h * w}")
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            pieces.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w)
            k += 1
        start += n
    if k != len(grids):
        raise ValueError(f"the prompt has {k} image spans for {len(grids)} images")
    positions = (np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)).astype(np.int64)
    delta = int(positions.max()) + 1 - len(tokens) if len(tokens) else 0
    return RopeIndex(positions, delta)


def tower_of(model) -> VisionTower:
    """The vision tower of the folder `model` was loaded from (mlx_mtp.load),
    loaded at the first image and kept with the model. ValueError when the
    model takes no images or its folder has no tower."""
    if not getattr(model, "takes_images", False):
        raise ValueError("this model takes no images (only Qwen3.5/3.6 and qwen4_exp folders "
                         "with a vision tower do)")
    if model.runtime.vision is None:
        path = Path(getattr(model, "model_path", ""))
        if not vision_tensor_names(path):
            raise ValueError(f"{path}: this folder has no vision tower (model.visual.* or "
                             "vision_tower.*): it answers text only")
        model.runtime.vision = load_tower(path)
    return model.runtime.vision


@dataclass(frozen=True)
class PromptLayout:
    """Where a prompt's images go, from their sizes alone (no tower run):
    the prompt with each placeholder expanded to its image's pads, its
    prefix-cache key (each pad a surrogate of its image's pixel digest, so
    the same tokens with another image never match), each image's span
    [start, end), grid and digest, and the M-RoPE positions and delta."""

    tokens: List[int]
    key: List[int]
    spans: List[Tuple[int, int]]
    grids: List[Tuple[int, int, int]]
    digests: List[str]
    rope: RopeIndex

    def restorable(self, n: int) -> int:
        """The longest prefix of at most n tokens that ends outside every
        image span (a restore never ends inside one)."""
        for start, end in self.spans:
            if start < n < end:
                return start
        return n


def surrogate(digest: str) -> int:
    """An image's pads in a prefix-cache key: a negative id from its pixel
    digest (no token has one; int32, as the disk tier stores keys)."""
    return -1 - int(digest[:8], 16) % (2 ** 31 - 2)


def prompt_layout(model, tokens: Sequence[int], images: Sequence["DecodedImage"]
                  ) -> PromptLayout:
    """A prompt with one image-pad placeholder per image, where each image
    goes (as a chat template with image parts writes it), and its decoded
    images: their layout (`PromptLayout`)."""
    tower = tower_of(model)
    spec = tower.spec
    if not any(t == spec.image_token_id for t in tokens):
        raise ValueError("the prompt has no image placeholder: put <|vision_start|><|image_pad|>"
                         "<|vision_end|> where each image goes (a chat template with image "
                         "parts writes it)")
    grids = [tower.grid(im) for im in images]
    expanded = expanded_prompt(tokens, images, spec, tower.processor)
    spans, pos = [], 0  # (a run of pads is one image, as rope_index reads them)
    for pad, run in itertools.groupby(expanded, key=lambda t: t == spec.image_token_id):
        n = len(list(run))
        if pad:
            spans.append((pos, pos + n))
        pos += n
    key = list(expanded)
    for (start, end), im in zip(spans, images):
        key[start:end] = [surrogate(im.digest)] * (end - start)
    return PromptLayout(expanded, key, spans, grids, [im.digest for im in images],
                        rope_index(expanded, grids, spec))


def prompt_media(model, tokens: Sequence[int], images: Sequence[ImageInput], start: int = 0
                 ) -> Tuple[List[int], "Media"]:
    """A prompt with one image-pad placeholder per image and its images:
    the prompt with the placeholders expanded, and what the text model takes
    for them (rows.Media) from token `start` on (what a prompt cache holding
    the first `start` tokens leaves to prefill; `start` must not fall inside
    an image: `PromptLayout.restorable`)."""
    tower = tower_of(model)
    decoded = [im if isinstance(im, DecodedImage) else decode_image(im, tower.max_input_pixels)
               for im in images]
    layout = prompt_layout(model, tokens, decoded)
    return layout.tokens, layout_media(model, layout, decoded, start)


def layout_media(model, layout: PromptLayout, images: Sequence["DecodedImage"], start: int = 0
                 ) -> "Media":
    """rows.Media of a laid-out prompt from token `start` on: the features of
    the images after it (the tower runs on those not in its cache)."""
    import mlx.core as mx

    from .rows import Media

    if layout.restorable(start) != start:
        raise ValueError(f"token {start} is inside an image: a prefix ends before or after one")
    tower = tower_of(model)
    later = [i for i, (s, _) in enumerate(layout.spans) if s >= start]
    features = tower.features([images[i] for i in later])
    pads = np.concatenate([np.arange(*layout.spans[i]) for i in later]) if later else \
        np.zeros(0, np.int64)
    hidden = model.text_args.hidden_size
    return Media(mx.concatenate(features, axis=0) if features else mx.zeros((0, hidden)),
                 pads, layout.rope.positions, layout.rope.delta, start)
