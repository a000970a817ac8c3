"""Images on qwen4_exp (docs/qwen4_exp.md, "Images"): what is this family's
own. Decoding image prompts at every depth, beside text rows, against
mlx-vlm's own model, the CLI and bad requests run on it in
tests/test_images.py (its `qwen4_exp` fixture); here: transformers'
Qwen4ExpForConditionalGeneration and its tower (slow tier, PyTorch), and the
prompts this family refuses."""

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="images need the [vision] extra")

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import ArraysCache  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp import vision  # noqa: E402
from mlx_mtp.batch import make_batch  # noqa: E402
from mlx_mtp.decode import generate_tokens  # noqa: E402
from mlx_mtp.families import qwen4_exp  # noqa: E402
from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint  # noqa: E402

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def q4vl(tmp_path_factory):
    path = write_qwen4_exp_checkpoint(tmp_path_factory.mktemp("q4vl"), vision=True)
    model, tok = mlx_mtp.load(str(path))
    return path, model, tok


def _image(seed, h, w):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


IMAGES = [_image(0, 64, 96), _image(1, 96, 64)]


def _prompt(model, tok, n_images, text=" describe them please\n"):
    spec = vision.tower_of(model).spec
    slot = [spec.vision_start_token_id, spec.image_token_id, spec.vision_end_token_id]
    return tok.encode("look:") + sum([slot + tok.encode(" and") for _ in range(n_images)], []) + \
        tok.encode(text)


def _run(model, ids, media, k, **kw):
    out = list(generate_tokens(mx.array(ids), model, draft_tokens=k, max_tokens=MAX_TOKENS,
                               media=media, **kw))
    return [t for t, _, _ in out], np.stack([np.array(lp) for _, lp, _ in out])


def test_a_prompt_needs_text_after_its_last_image(q4vl, tmp_path):
    """A key block completing while decoding is roped at its first token, up
    to `indexer_compress_ratio` - 1 tokens back, which decoding places at
    index + delta: a prompt with fewer tokens after its last image is refused
    in one line (a chat template's end of turn gives them); a folder without
    a tower answers text only."""
    _, model, tok = q4vl
    r = model.text_args.indexer_compress_ratio
    assert model.text_after_images == r == 2
    spec = vision.tower_of(model).spec
    batch = make_batch(model, draft_tokens=2)
    for tail, ok in ((1, False), (r, True)):
        prompt = tok.encode("look:") + [spec.vision_start_token_id, spec.image_token_id] + \
            [spec.vision_end_token_id] + tok.encode("xyz")[:tail - 1]
        ids, media = vision.prompt_media(model, prompt, IMAGES[:1])
        if ok:
            batch.prepare(ids, None, 2, media=media)
        else:
            with pytest.raises(ValueError, match=f"at least {r} tokens after its last image"):
                batch.prepare(ids, None, 2, media=media)
    text_only, _ = mlx_mtp.load(str(write_qwen4_exp_checkpoint(tmp_path / "text")))
    assert text_only.takes_images  # (M-RoPE installed: the config names mrope_section)
    with pytest.raises(ValueError, match="no vision tower"):
        vision.prompt_media(text_only, _prompt(model, tok, 1), IMAGES[:1])


def _states(cache) -> list:
    from mlx.utils import tree_flatten

    return [np.array(x) for _, x in tree_flatten([c.state for c in cache])
            if isinstance(x, mx.array)]


def test_head_and_trunk_states_after_a_prefill_in_pieces(q4vl):
    """An image prompt prefilled in pieces of 5 (blocks begun in an earlier
    piece, an image across pieces) leaves every trunk and head state (QSA
    K/V, raw and pooled indexer keys, GDN and PLE windows) as one piece
    does (1e-5): each block key roped at its first token's M-RoPE ids,
    which an earlier piece held (`Positions.before`), in the head too."""
    _, model, tok = q4vl
    ids, media = vision.prompt_media(model, _prompt(model, tok, 2), IMAGES)
    got = []
    for step in (2048, 5):  # (a prompt cache: trunk, head, last hidden)
        cache = model.make_cache() + model.mtp.make_cache() + [ArraysCache(size=2)]
        list(generate_tokens(mx.array(ids), model, draft_tokens=2, max_tokens=1, media=media,
                             prompt_cache=cache, prefill_step_size=step))
        got.append(_states(cache))
        assert cache[len(model.layers)][0].offset > len(ids) // 2  # the head's K/V written
    worst = max(np.abs(a.astype(np.float64) - b).max() for a, b in zip(*got) if a.size)
    assert worst < 1e-5, worst


def _torch():
    return pytest.importorskip("torch", reason="needs torch (the slow tier installs it)")


@pytest.fixture(scope="module")
def transformers_model(q4vl):
    torch = _torch()
    from transformers import Qwen4ExpForConditionalGeneration

    path, _, _ = q4vl
    model, info = Qwen4ExpForConditionalGeneration.from_pretrained(
        str(path), dtype=torch.float32, output_loading_info=True)
    # every tensor of the folder read (the n-gram hash buffers are derived from the config)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(k.endswith(("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"))
               for k in info["missing_keys"]), info["missing_keys"]
    return model.eval()


def _transformers_logprobs(hf, model, ids, images, tokens):
    """transformers' log-probs [len(tokens), V] over the prompt then `tokens`
    (teacher-forced, one forward: its M-RoPE index over the whole sequence,
    the tower's features at the pads, PLE on the token ids)."""
    torch = _torch()
    seq = torch.tensor([list(ids) + list(tokens[:-1])])
    kw = {}
    if images:
        tower = vision.tower_of(model)
        pixels, grid = vision.preprocess(tower.decode(images), tower.processor)
        kw = dict(pixel_values=torch.from_numpy(pixels), image_grid_thw=torch.from_numpy(grid),
                  mm_token_type_ids=(seq == tower.spec.image_token_id).int())
    with torch.no_grad():
        logits = hf(input_ids=seq, **kw).logits[0, len(ids) - 1:]
    return torch.log_softmax(logits.double(), -1).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_decoding_is_transformers_at_every_depth(q4vl, transformers_model, n_images):
    """Greedy tokens and log-probs (1e-4) of transformers'
    Qwen4ExpForConditionalGeneration on the same folder, with no image, one
    and two, at depths 0-3 and auto."""
    _, model, tok = q4vl
    prompt = _prompt(model, tok, n_images)
    ids, media = (vision.prompt_media(model, prompt, IMAGES[:n_images]) if n_images
                  else (prompt, None))
    want, _ = _run(model, ids, media, 0)
    theirs = _transformers_logprobs(transformers_model, model, ids, IMAGES[:n_images], want)
    assert want == theirs.argmax(-1).tolist()
    for k in (0, 1, 2, 3, "auto"):
        got, lp = _run(model, ids, media, k)
        assert got == want, k
        assert np.abs(lp - theirs).max() < 1e-4, (k, np.abs(lp - theirs).max())


@pytest.mark.slow
def test_block_keys_take_their_first_tokens_positions(q4vl, transformers_model, monkeypatch):
    """The indexer's key blocks are roped at their first token's three
    M-RoPE ids (in a prefill over images, and at index + delta after them):
    roping them at their index instead moves the log-probs off transformers'
    (> 1e-4), so the test above would catch it."""
    _, model, tok = q4vl
    ids, media = vision.prompt_media(model, _prompt(model, tok, 2), IMAGES)
    want, _ = _run(model, ids, media, 0)
    theirs = _transformers_logprobs(transformers_model, model, ids, IMAGES, want)
    parent = qwen4_exp.QSAIndexer.rope_blocks
    monkeypatch.setattr(qwen4_exp.PositionedIndexer, "rope_blocks",
                        lambda self, blocks, first, positions: parent(self, blocks, first, None))
    _, lp = _run(model, ids, media, 2)
    assert np.abs(lp - theirs).max() > 1e-4


@pytest.mark.slow
def test_tower_features_are_transformers(q4vl):
    """transformers' Qwen4ExpVisionModel (2-D axial rope, interpolated
    position embeddings, 2x2 merger) on the folder's weights and the same
    pixel values: mlx-vlm's tower gives its features to fp32 rounding."""
    _torch()
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpVisionConfig
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpVisionModel
    from util import assert_tower_is_transformers

    path, model, _ = q4vl
    assert_tower_is_transformers(path, vision.tower_of(model), Qwen4ExpVisionConfig,
                                 Qwen4ExpVisionModel, IMAGES)
