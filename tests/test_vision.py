"""The vision stage (mlx_mtp/vision.py; docs/design.md, "Images"): the tower
loads from the released HF layout and from mlx-vlm's conversion alike and
computes transformers' features; images decode to the same pixels (and
digest) however they arrive; bad input is one ValueError; the M-RoPE index is
transformers' `get_rope_index`. Needs the vision extra (mlx-vlm, Pillow); the
comparisons with transformers' torch models are in the slow tier."""

import io
import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="needs the vision extra: pip install -e '.[vision]'")
Image = pytest.importorskip("PIL.Image", reason="needs the vision extra: pip install -e '.[vision]'")

import mlx.core as mx  # noqa: E402

from mlx_mtp import vision  # noqa: E402
from mlx_mtp.families.mrope import frequency_axes  # noqa: E402
from mlx_mtp.testing.synthetic import (TINY_PREPROCESSOR, VISION_TOKEN_KEYS,  # noqa: E402
                                       tiny_vision_config, vision_weights, write_checkpoint)


@pytest.fixture(scope="module")
def hf_dense(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vl_dense"), vision=True)


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("vl_moe"), moe=True, seed=2, vision=True,
                            tools="xml", thinking=True)


@pytest.fixture(scope="module")
def tower(hf_dense):
    return vision.load_tower(hf_dense)


def _image(seed, h, w):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png(pixels, mode=None):
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


IMAGES = [_image(0, 50, 70), _image(1, 300, 100), _image(2, 33, 47)]


# ------------------------------------------------------------------ fixture

def test_fixture_names_are_the_released_towers():
    """At the released depth the fixture's tower has the release's 333
    tensors (the released names: test_features_match_transformers loads them
    into transformers' model with none missing or left over)."""
    assert len(vision_weights(tiny_vision_config(64, depth=27))) == 333


def test_text_path_never_imports_the_vision_stage(hf_moe):
    """mlx_mtp.load on a checkpoint with a real tower drops it and never
    imports the vision stage or mlx-vlm."""
    code = ("import sys, mlx_mtp; m, t = mlx_mtp.load(sys.argv[1]); "
            "print(sorted(k for k in ('mlx_vlm', 'mlx_mtp.vision') if k in sys.modules)); "
            "print(t.convert_tokens_to_ids(['<|vision_start|>', '<|vision_end|>', '<|image_pad|>', "
            "'<|video_pad|>']))")
    out = subprocess.run([sys.executable, "-c", code, str(hf_moe)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    imported, ids = out.stdout.strip().splitlines()[-2:]
    assert imported == "[]"
    config = json.loads((hf_moe / "config.json").read_text())
    assert json.loads(ids) == [config[k] for k in VISION_TOKEN_KEYS]


# -------------------------------------------------------------------- tower

@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_tower_loads_from_both_layouts_alike(moe, hf_dense, hf_moe, tmp_path):
    """The HF folder and mlx-vlm's own conversion of it (vision_tower.*,
    language_model.*, channels-last patch embedding) give the same features,
    bit for bit."""
    from mlx_vlm.convert import convert

    hf = hf_moe if moe else hf_dense
    converted = tmp_path / "mlx-vlm"
    convert(hf_path=str(hf), mlx_path=str(converted))
    names = [k for k in mx.load(str(converted / "model.safetensors")) if "patch_embed" in k]
    assert names and all(k.startswith("vision_tower.") for k in names)
    a, b = vision.load_tower(hf), vision.load_tower(converted)
    assert (a.layout, b.layout) == ("hf", "mlx-vlm")
    fa, ga = a.encode(IMAGES)
    fb, gb = b.encode(IMAGES)
    config = json.loads((hf / "config.json").read_text())
    assert fa.shape == (sum(vision.image_token_count(g, 2) for g in ga),
                        config["text_config"]["hidden_size"])
    assert np.array_equal(ga, gb) and np.array_equal(np.array(fa), np.array(fb))
    assert np.isfinite(np.array(fa)).all() and float(mx.abs(fa).max()) > 0.1


def test_quantized_tower_loads(hf_dense, tmp_path):
    """An mlx-vlm folder whose tower is quantized (scales beside the layers
    that have them, `quantization` in config.json) loads quantized and
    computes what the tower quantized in memory computes."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    tower = vision.load_tower(hf_dense)
    nn.quantize(tower.model, group_size=32, bits=8,
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
    out = tmp_path / "q"
    out.mkdir()
    weights = {f"vision_tower.{k}": v for k, v in tree_flatten(tower.model.parameters())}
    assert any(k.endswith(".scales") for k in weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    config = json.loads((hf_dense / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (out / "config.json").write_text(json.dumps(config))
    (out / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR))
    q = vision.load_tower(out)
    assert isinstance(q.model.blocks[0].attn.qkv, nn.QuantizedLinear)
    assert np.array_equal(np.array(q.encode(IMAGES)[0]), np.array(tower.encode(IMAGES)[0]))


def test_encode_images_splits_per_image(tower):
    feats, grid = tower.encode(IMAGES)
    each = tower.encode_images(IMAGES)
    assert [e.grid_thw for e in each] == [tuple(g) for g in grid.tolist()]
    assert [e.tokens for e in each] == [tower.token_count(im) for im in IMAGES]
    assert [e.features.shape[0] for e in each] == [e.tokens for e in each]
    assert np.array_equal(np.concatenate([np.array(e.features) for e in each]), np.array(feats))
    # one image alone: the same rows (each image attends only to itself)
    alone = tower.encode_images(IMAGES[1:2])[0]
    assert np.allclose(np.array(alone.features), np.array(each[1].features), atol=1e-5)


def test_preprocessing_is_transformers(tower):
    """mlx-vlm's NumPy processor gives transformers' (PIL backend) pixel
    values and grids for the same preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kw = {k: v for k, v in TINY_PREPROCESSOR.items() if k not in ("processor_class", "image_processor_type")}
    ref = Qwen2VLImageProcessorPil(**kw)([Image.fromarray(i) for i in IMAGES], return_tensors="np")
    pv, grid = vision.preprocess(tower.decode(IMAGES), tower.processor)
    assert np.array_equal(grid, ref["image_grid_thw"])
    assert np.allclose(pv, ref["pixel_values"], atol=1e-6)


# ------------------------------------------------------------- the digest

def test_digest_is_the_pixels(tower):
    """The same pixels as PNG bytes, a PIL image and an array: one digest,
    the same features; other pixels, or the same bytes in another shape:
    another digest. Transparency is composited onto white first."""
    px = IMAGES[0]
    forms = [_png(px), Image.fromarray(px), px, bytearray(_png(px))]
    decoded = tower.decode(forms)
    assert len({d.digest for d in decoded}) == 1
    assert all(np.array_equal(d.pixels, px) for d in decoded)
    feats = [np.array(e.features) for e in tower.encode_images(forms)]
    assert all(np.array_equal(f, feats[0]) for f in feats)
    other = px.copy()
    other[-1, -1, -1] ^= 1  # the last byte
    assert vision.decode_image(other).digest != decoded[0].digest
    reshaped = px.reshape(70, 50, 3)
    assert vision.decode_image(reshaped).digest != decoded[0].digest
    rgba = np.dstack([px, np.full(px.shape[:2], 0, np.uint8)])
    white = vision.decode_image(_png(rgba, "RGBA"))
    assert (white.pixels == 255).all()


# ------------------------------------------------------------- bad input

@pytest.mark.parametrize("bad, words", [
    (b"", "empty"),
    (b"not an image at all", "could not decode"),
    (_png(_image(3, 40, 40))[:60], "could not decode"),
    ("https://example.com/cat.png", "unsupported image type str"),
    ([1, 2, 3], "unsupported image type list"),
    (np.zeros((4, 4, 3), np.float32), "uint8"),
    (np.zeros((4, 4), np.uint8), "H x W x 3"),
    (np.zeros((0, 4, 3), np.uint8), "no pixels"),
])
def test_bad_images_are_one_clear_value_error(bad, words):
    with pytest.raises(ValueError) as e:
        vision.decode_image(bad)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_pixel_cap_is_checked_before_decoding(tower, monkeypatch):
    big = _png(np.zeros((200, 300, 3), np.uint8))
    with pytest.raises(ValueError, match="300x200 pixels is over the limit of 50000"):
        vision.decode_image(big, max_pixels=50_000)
    monkeypatch.setattr(tower, "max_input_pixels", 50_000)
    with pytest.raises(ValueError, match="over the limit"):
        tower.encode([big])
    # an image the processor cannot resize: still one line
    with pytest.raises(ValueError, match="aspect ratio"):
        tower.encode([np.zeros((1, 300, 3), np.uint8)])


def test_config_errors(hf_dense, tmp_path):
    with pytest.raises(ValueError, match="takes no images"):
        vision.VisionSpec.from_config({"text_config": {}})
    text_only = write_checkpoint(tmp_path / "text")  # the default: a dummy tensor, no image ids
    with pytest.raises(ValueError, match="takes no images"):
        vision.load_tower(text_only)


# ------------------------------------------------------------ rope index

def _spec(**kw):
    base = dict(image_token_id=9, video_token_id=8, vision_start_token_id=5, vision_end_token_id=6,
                spatial_merge_size=2, mrope_section=(11, 11, 10), mrope_interleaved=True)
    return vision.VisionSpec(**{**base, **kw})


def _prompt(spec, grids, text=(3, 2, 4)):
    """text[0] tokens, then per image: start, its pads, end, text[i+1] tokens."""
    ids = list(range(100, 100 + text[0]))
    for i, g in enumerate(grids):
        ids += [spec.vision_start_token_id, spec.image_token_id, spec.vision_end_token_id]
        ids += list(range(200, 200 + text[i + 1]))
    counts = [vision.image_token_count(g, spec.spatial_merge_size) for g in grids]
    return vision.expand_image_pads(ids, counts, spec)


CASES = {"one": [(1, 4, 6)], "two": [(1, 4, 6), (1, 8, 4)]}


def test_rope_index_by_hand():
    spec = _spec()
    ids = _prompt(spec, [(1, 4, 6)], text=(2, 1))  # t t S [2x3 grid] E t
    r = vision.rope_index(ids, [(1, 4, 6)], spec)
    # text 0 1, start 2, image from 3: t=3, h=3..4, w=3..5; then 3+max(2,3)=6: end 6, text 7
    assert r.positions.tolist() == [[0, 1, 2] + [3] * 6 + [6, 7],
                                    [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
                                    [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7]]
    assert r.delta == 8 - len(ids)
    plain = vision.rope_index([1, 2, 3], [], spec)
    assert plain.positions.tolist() == [[0, 1, 2]] * 3 and plain.delta == 0


@pytest.mark.parametrize("case", sorted(CASES))
def test_rope_index_matches_mlx_vlm(case):
    """The same positions and delta as mlx-vlm's Qwen3.5 `get_rope_index`
    (the slow tier checks transformers')."""
    from mlx_vlm.models.qwen3_5.language import LanguageModel

    spec, grids = _spec(), CASES[case]
    ids = _prompt(spec, grids)
    mine = vision.rope_index(ids, grids, spec)
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=9,
                             video_token_id=8, vision_start_token_id=5)
    pos, delta = LanguageModel.get_rope_index(SimpleNamespace(config=config), mx.array([ids]),
                                              mx.array(grids))
    assert np.array_equal(np.array(pos)[:, 0], mine.positions)
    assert int(np.array(delta).reshape(-1)[0]) == mine.delta


def test_rope_index_errors():
    spec = _spec()
    ids = _prompt(spec, [(1, 4, 6)])
    with pytest.raises(ValueError, match="1 image spans for 2 images"):
        vision.rope_index(ids, [(1, 4, 6), (1, 4, 4)], spec)
    with pytest.raises(ValueError, match="span has 6 tokens"):
        vision.rope_index(ids, [(1, 4, 4)], spec)
    with pytest.raises(ValueError, match="more image spans"):
        vision.rope_index(ids, [], spec)
    with pytest.raises(ValueError, match="videos"):
        vision.rope_index([1, 8, 2], [], spec)
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        vision.expand_image_pads([9, 1, 9], [4], spec)


def test_spec_reads_the_config(hf_dense):
    config = json.loads((hf_dense / "config.json").read_text())
    spec = vision.VisionSpec.from_config(config)
    assert [getattr(spec, k) for k in VISION_TOKEN_KEYS] == [config[k] for k in VISION_TOKEN_KEYS]
    assert spec.mrope_section == tuple(config["text_config"]["rope_parameters"]["mrope_section"])
    assert spec.mrope_interleaved and spec.spatial_merge_size == 2
    # mlx-vlm's conversions name it rope_scaling in some text configs
    tc = dict(config["text_config"])
    tc["rope_scaling"] = tc.pop("rope_parameters")
    assert vision.VisionSpec.from_config({**config, "text_config": tc}) == spec


# ------------------------------------------------- against transformers (torch)

def _torch():
    return pytest.importorskip("torch", reason="needs torch (the slow tier installs it)")


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_features_match_transformers(moe, hf_dense, hf_moe):
    """transformers' Qwen3_5VisionModel on the same weights and pixel values:
    the same features to fp32 rounding."""
    _torch()
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from util import assert_tower_is_transformers

    path = hf_moe if moe else hf_dense
    assert_tower_is_transformers(path, vision.load_tower(path), Qwen3_5VisionConfig,
                                 Qwen3_5VisionModel, IMAGES)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES) + ["first", "last"])
def test_rope_index_matches_transformers(case, hf_dense):
    """transformers' Qwen3_5Model.get_rope_index (a tiny model from the
    fixture's config; image spans marked by mm_token_type_ids, as its
    processor marks them): one image, two with text between, an image first
    and one last."""
    torch = _torch()
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

    config = json.loads((hf_dense / "config.json").read_text())
    spec = vision.VisionSpec.from_config(config)
    grids = CASES.get(case, [(1, 6, 4)])
    text = {"first": (0, 3), "last": (3, 0)}.get(case, (3, 2, 4))
    ids = _prompt(spec, grids, text)
    if case == "first":
        ids = ids[1:]  # the image's pads open the prompt
    mine = vision.rope_index(ids, grids, spec)
    model = Qwen3_5Model(Qwen3_5Config(**config))
    input_ids = torch.tensor([ids])
    pos, delta = model.get_rope_index(input_ids, (input_ids == spec.image_token_id).int(),
                                      image_grid_thw=torch.tensor(grids))
    assert np.array_equal(pos[:, 0].numpy(), mine.positions)
    assert int(delta.reshape(-1)[0]) == mine.delta


@pytest.mark.slow
def test_mrope_axes_match_transformers(hf_dense):
    """`families.mrope.frequency_axes` gives transformers' Qwen3.5 text rotary angles: the angle
    of frequency j at token i is positions[axes[j], i] * inv_freq[j]."""
    torch = _torch()
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    config = json.loads((hf_dense / "config.json").read_text())
    for section in ([1, 1, 0], [11, 11, 10], [2, 1, 1]):
        tc = dict(config["text_config"], head_dim=64)
        tc["rope_parameters"] = dict(tc["rope_parameters"], mrope_section=section, partial_rotary_factor=1.0)
        rot = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(**tc))
        spec = vision.VisionSpec.from_config({**config, "text_config": tc})
        grids = CASES["two"]
        r = vision.rope_index(_prompt(spec, grids), grids, spec)
        cos, _ = rot(torch.zeros(1, 1, dtype=torch.float32), torch.from_numpy(r.positions)[:, None])
        inv = rot.inv_freq.numpy()
        axes = frequency_axes(len(inv), spec.mrope_section, spec.mrope_interleaved)
        angles = r.positions[axes, :].T * inv[None, :]
        assert np.allclose(cos[0].numpy(), np.cos(np.concatenate([angles, angles], -1)), atol=1e-5), section
