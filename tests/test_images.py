"""Images in, MTP out (docs/design.md, "Images"; docs/qwen4_exp.md,
"Images"): a Qwen3.5/3.6 or qwen4_exp prompt with images decodes at every
depth exactly as plain decoding (depth 0) of the same model, alone and as a
batch row beside text rows; plain decoding is mlx-vlm's own model reading the
same folder (default tier) and transformers' Qwen3_5ForConditionalGeneration's
/ Qwen4ExpForConditionalGeneration's (slow tier, PyTorch).
Tiny synthetic VL checkpoints (HF layout, a real tower), Qwen3.5 dense and
MoE and qwen4_exp, whose answers depend on the image (the fixture checks it:
else a test comparing tokens could not tell whether the image was read)."""

import dataclasses

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="images need the [vision] extra")

import mlx.core as mx  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp import vision  # noqa: E402
from mlx_mtp.batch import make_batch  # noqa: E402
from mlx_mtp.decode import decode_rows, generate_tokens  # noqa: E402
from mlx_mtp.testing.synthetic import write_checkpoint, write_qwen4_exp_checkpoint  # noqa: E402

MAX_TOKENS = 24


def _vl(kind, tmp_path_factory):
    moe = kind == "moe"
    folder = tmp_path_factory.mktemp(f"vl_{kind}")
    path = (write_qwen4_exp_checkpoint(folder, vision=True) if kind == "qwen4_exp" else
            write_checkpoint(folder, moe=moe, seed=3 if moe else 0, vision=True))
    model, tok = mlx_mtp.load(str(path))
    # the answer depends on the image: another image of the same size (the
    # same pads and positions: only the features differ), other greedy tokens
    # within the tests' lengths and other first log-probs
    one, other = (_run(model, *vision.prompt_media(model, _prompt(model, tok, 1), [image]), 0)
                  for image in (IMAGES[0], SAME_SIZE))
    assert one[0] != other[0] and np.abs(one[1][0] - other[1][0]).max() > 1e-3
    return path, model, tok


@pytest.fixture(scope="module", params=["dense", "moe", "qwen4_exp"])
def vl(request, tmp_path_factory):
    """Dense, MoE and qwen4_exp: the exactness claims run on each."""
    return _vl(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=["dense", pytest.param("moe", marks=pytest.mark.slow),
                                        "qwen4_exp"])
def vl_once(request, tmp_path_factory):
    """Dense in the default tier (the claim is not the family's), MoE slow;
    qwen4_exp (its own M-RoPE: attention and the indexer's block keys)."""
    return _vl(request.param, tmp_path_factory)


def _image(seed, h, w):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


IMAGES = [_image(0, 64, 96), _image(1, 96, 64)]
SAME_SIZE = _image(2, 64, 96)


def _prompt(model, tok, n_images: int, text=" describe them please\n"):
    spec = vision.tower_of(model).spec
    slot = [spec.vision_start_token_id, spec.image_token_id, spec.vision_end_token_id]
    toks = tok.encode("look:") + slot + (tok.encode(" and") + slot if n_images > 1 else [])
    return toks + tok.encode(text)


def _run(model, ids, media, k, max_tokens=MAX_TOKENS, **kw):
    out = list(generate_tokens(mx.array(ids), model, draft_tokens=k, max_tokens=max_tokens,
                               media=media, **kw))
    return [t for t, _, _ in out], np.stack([np.array(lp) for _, lp, _ in out])


def _mlx_vlm_logprobs(path, model, ids, images, tokens):
    """The log-probs [len(tokens), V] of mlx-vlm's own Qwen3.5 model (its
    weight loading, tower, feature placement, M-RoPE index and shift) on the
    same folder: the prompt with the images, then `tokens` one at a time."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    theirs = load_model(path)
    tower = vision.tower_of(model)
    pixels, grid = vision.preprocess(tower.decode(images), tower.processor)
    cache = make_prompt_cache(theirs.language_model)
    rows = [theirs(mx.array([ids]), mx.array(pixels), image_grid_thw=mx.array(grid),
                   cache=cache).logits[0, -1]]
    for t in tokens[:-1]:
        rows.append(theirs.language_model(mx.array([[t]]), cache=cache).logits[0, -1])
    logits = mx.stack(rows)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


@pytest.mark.parametrize("n_images", [1, 2])
def test_image_prompts_decode_as_plain_decoding_at_every_depth(vl, n_images):
    """Greedy tokens at depths 1-3 and auto equal depth 0's, and so do their
    log-probs (a verify at the wrong M-RoPE positions moves them by ~1e-2)."""
    _, model, tok = vl
    ids, media = vision.prompt_media(model, _prompt(model, tok, n_images), IMAGES[:n_images])
    assert media.delta < 0 and len(ids) > len(_prompt(model, tok, n_images))
    want, want_lp = _run(model, ids, media, 0)
    for k in (1, 2, 3, "auto"):
        got, lp = _run(model, ids, media, k)
        assert got == want, k
        assert np.allclose(lp, want_lp, atol=1e-4), (k, np.abs(lp - want_lp).max())
    # a prefill in pieces (an image split across them): the same tokens
    got, lp = _run(model, ids, media, 2, prefill_step_size=7)
    assert got == want and np.allclose(lp, want_lp, atol=1e-4)


def test_image_prompts_decode_as_mlx_vlm_reads_them(vl_once):
    """Plain decoding (depth 0) and MTP (depth 2) of a prompt with one or two
    images give the greedy tokens and log-probs (1e-4) of mlx-vlm's own model
    on the same folder, which places the tower's features and numbers the
    M-RoPE positions its own way; the images swapped answer otherwise."""
    path, model, tok = vl_once
    answers = []
    for images in (IMAGES[:1], IMAGES, IMAGES[::-1]):
        ids, media = vision.prompt_media(model, _prompt(model, tok, len(images)), images)
        want, _ = _run(model, ids, media, 0)
        theirs = _mlx_vlm_logprobs(path, model, ids, images, want)
        assert want == theirs.argmax(-1).tolist(), len(images)
        for k in (0, 2):
            got, lp = _run(model, ids, media, k)
            assert got == want and np.abs(lp - theirs).max() < 1e-4, (k, np.abs(lp - theirs).max())
        answers.append(want)
    assert answers[1] != answers[2]  # (the same prompt: only the images' order differs)


def test_image_rows_and_text_rows_decode_in_one_batch(vl):
    """Rows (image, text, two images: M-RoPE shifts of -3, 0 and -6) in one
    batch, depth 2: each row's tokens and log-probs (1e-4) are what it
    decodes alone, so each row decodes at its own positions."""
    _, model, tok = vl
    prompts = _mixed_rows(model, tok)
    assert len({media.delta if media else 0 for _, media in prompts}) == 3
    alone = [_run(model, ids, media, 2) for ids, media in prompts]
    batch = make_batch(model, draft_tokens=2)
    _assert_rows_alone(batch, [batch.prepare(ids, None, MAX_TOKENS, media=media)
                               for ids, media in prompts], alone)


def _mixed_rows(model, tok) -> list:
    """(ids, media) of an image row, a text row and a two-image row."""
    return [vision.prompt_media(model, _prompt(model, tok, 1), IMAGES[:1]),
            (tok.encode("def f(x): return"), None),
            vision.prompt_media(model, _prompt(model, tok, 2, " again\n"), IMAGES)]


def _assert_rows_alone(batch, requests, alone):
    """The requests decoded in one batch: each row's tokens and log-probs
    (1e-4) are `alone`'s (tokens, log-prob rows)."""
    got = [[] for _ in requests]
    for i, event in decode_rows(batch, requests, len(requests)):
        got[i].append((event.token, np.array(event.logprobs)))
    for i, ((tokens, lp), row) in enumerate(zip(alone, got)):
        assert [t for t, _ in row] == tokens, i
        assert np.abs(np.stack([r for _, r in row]) - lp).max() < 1e-4, i


def test_image_rows_with_context_runs_decode_as_alone(vl_once, monkeypatch):
    """Context drafts beside images: rows with one and two images and a text
    row, each re-typing what its context holds (its index starts from the
    prompt, its answer, the prompt: `cached_tokens`), in one batch with runs
    up to 16 wide (every width costing the same to the policy here): each
    row's tokens and log-probs (1e-4) are plain decoding's alone, and the
    image rows drafted runs."""
    from mlx_mtp.schedule import ContextPolicy
    from mlx_mtp.stats import MTPStats

    monkeypatch.setattr(ContextPolicy, "_rate", lambda self, w, head, rows:
                        self.expected_tokens(w))
    _, model, tok = vl_once
    prompts = _mixed_rows(model, tok)
    alone = [_run(model, ids, media, 0) for ids, media in prompts]
    batch = make_batch(model, draft_tokens=2, context_drafts=True)
    stats = [MTPStats() for _ in prompts]
    _assert_rows_alone(batch, [batch.prepare(ids, None, MAX_TOKENS, media=media, stats=s,
                                             cached_tokens=ids + want + ids)
                               for (ids, media), (want, _), s in zip(prompts, alone, stats)],
                       alone)
    assert stats[0].context_accepted > 0 and stats[2].context_accepted > 0


def test_bad_image_requests_are_one_clear_error(vl_once, tmp_path):
    """A model without M-RoPE, a prompt cache, a prompt without a placeholder
    or ending inside an image: one ValueError each, nothing decoded."""
    _, model, tok = vl_once
    ids, media = vision.prompt_media(model, _prompt(model, tok, 1), IMAGES[:1])
    batch = make_batch(model, draft_tokens=2)
    cache = model.make_cache()
    list(generate_tokens(mx.array(tok.encode("hello")), model, max_tokens=1, prompt_cache=cache))
    with pytest.raises(ValueError, match="prompt cache holds"):  # (not the images' prefix)
        batch.prepare(ids, cache, 4, media=media)
    with pytest.raises(ValueError, match="with a prompt cache"):  # the API: not yet
        list(mlx_mtp.generate_step(mx.array(_prompt(model, tok, 1)), model, images=IMAGES[:1],
                                   prompt_cache=model.make_cache()))
    with pytest.raises(ValueError, match="no image placeholder"):
        vision.prompt_media(model, tok.encode("no image here"), IMAGES[:1])
    cut, cut_media = vision.prompt_media(model, _prompt(model, tok, 1)[:-len(tok.encode(
        " describe them please\n")) - 1], IMAGES[:1])  # (ends at the last pad)
    with pytest.raises(ValueError, match="ends inside an image"):
        batch.prepare(cut, None, 4, media=cut_media)
    text_only = write_checkpoint(tmp_path / "text", seed=5)
    plain, _ = mlx_mtp.load(str(text_only))
    with pytest.raises(ValueError, match="takes no images"):
        vision.tower_of(plain)
    next_model, _ = mlx_mtp.load(str(write_checkpoint(tmp_path / "next", family="qwen3_next")))
    with pytest.raises(ValueError, match="takes no images"):
        make_batch(next_model).prepare(tok.encode("hi"), None, 4, media=media)


@pytest.mark.slow
def test_plain_decoding_of_an_image_prompt_is_transformers(vl):
    """Depth 0 (and so every depth) gives transformers' greedy tokens and
    log-probs on the same folder, images and prompt (fp32): its M-RoPE
    positions, the features at the pads, the shift after."""
    torch = pytest.importorskip("torch")
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    path, model, tok = vl
    if "qwen4_exp" in path.name:
        pytest.skip("qwen4_exp: tests/test_qwen4_exp_images.py compares it with transformers")
    tower = vision.tower_of(model)
    ids, media = vision.prompt_media(model, _prompt(model, tok, 2), IMAGES)
    want_tokens, want_lp = _run(model, ids, media, 0, 8)
    cls = (Qwen3_5MoeForConditionalGeneration if "moe" in path.name
           else Qwen3_5ForConditionalGeneration)
    hf = cls.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    pixels, grid = vision.preprocess(tower.decode(IMAGES), tower.processor)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=x, pixel_values=torch.tensor(pixels),
                          image_grid_thw=torch.tensor(grid),
                          mm_token_type_ids=(x == tower.spec.image_token_id).int(),
                          attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    theirs = np.stack([torch.log_softmax(lg[0], -1).numpy() for lg in out.logits])
    assert out.sequences[0, len(ids):].tolist() == want_tokens
    assert np.abs(theirs - want_lp).max() < 1e-4
    # (the positions matter here: text positions throughout miss by far more)
    flat = dataclasses.replace(media, delta=0, positions=np.broadcast_to(
        np.arange(len(ids)), (3, len(ids))).copy())
    assert np.abs(_run(model, ids, flat, 0, 8)[1] - theirs).max() > 1e-3


def test_converted_and_grafted_folders_keep_the_tower(vl_once, tmp_path):
    """`mlx_mtp.convert` keeps the tower as released (and its image
    processor's config) beside the head; `--graft` adds the head to
    mlx-vlm's own conversion (`vision_tower.*`, `language_model.*`, no head).
    Both load the source's tower weights, and decode an image prompt with
    MTP as the source folder does (tokens and log-probs, 1e-4)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.convert import convert as mlx_vlm_convert

    from mlx_mtp.convert import convert, graft

    path, model, tok = vl_once
    ids, media = vision.prompt_media(model, _prompt(model, tok, 1), IMAGES[:1])
    want, want_lp = _run(model, ids, media, 0)
    source_tower = dict(tree_flatten(vision.tower_of(model).model.parameters()))
    ours = tmp_path / "converted"
    summary = convert(path, ours)
    assert summary["vision"].startswith("33 tensors")
    folders = [ours]
    # (mlx-vlm's qwen4_exp conversion names the n-gram row shards its own way,
    # `ngram_embedding.shards.{i}`, which mlx_mtp does not read yet)
    if "qwen4_exp" not in path.name:
        mlx_vlm_convert(hf_path=str(path), mlx_path=str(tmp_path / "mlx-vlm"))
        graft(tmp_path / "mlx-vlm", path)
        folders.append(tmp_path / "mlx-vlm")
    for folder in folders:
        m, t = mlx_mtp.load(str(folder))
        assert m.has_mtp
        tower = dict(tree_flatten(vision.tower_of(m).model.parameters()))
        assert tower.keys() == source_tower.keys(), folder
        assert all(mx.array_equal(tower[k], source_tower[k]) for k in tower), folder
        ids2, media2 = vision.prompt_media(m, _prompt(m, t, 1), IMAGES[:1])
        got, lp = _run(m, ids2, media2, 2)
        assert ids2 == ids and got == want, folder
        assert np.abs(lp - want_lp).max() < 1e-4, (folder, np.abs(lp - want_lp).max())


def test_the_cli_takes_images(vl_once, tmp_path, capsys):
    """`python -m mlx_mtp.generate --image PATH` (repeatable; its `main`, in
    this process): the chat template's image parts, the text the API gives
    for the same message; a missing file is one error line, exit 2."""
    from PIL import Image

    from mlx_mtp.cli import main

    path, model, tok = vl_once
    files = []
    for i, pixels in enumerate(IMAGES):
        files.append(tmp_path / f"{i}.png")
        Image.fromarray(pixels).save(files[-1])
    content = [{"type": "image"}] * 2 + [{"type": "text", "text": "compare"}]
    ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                  add_generation_prompt=True)
    want = mlx_mtp.generate(model, tok, ids, max_tokens=10, images=[str(f) for f in files])
    capsys.readouterr()
    assert main(["--model", str(path), "--image", str(files[0]), "--image", str(files[1]),
                 "--prompt", "compare", "-m", "10", "--draft-tokens", "2"]) in (0, None)
    assert capsys.readouterr().out.rstrip("\n") == want
    assert main(["--model", str(path), "--image", str(tmp_path / "missing.png")]) == 2
    # (the loader's own notes aside: qwen4_exp's says where its n-gram tables are)
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("[mlx_mtp] ")]
    assert len(err) == 1 and err[0].startswith("error: cannot read image"), err
