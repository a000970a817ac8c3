"""The server takes images (a real process on a tiny Qwen3.5 VL folder; the
last test on a qwen4_exp one):
OpenAI `image_url` parts (data URLs, and http URLs fetched from a local HTTP
server) and Anthropic `image` blocks (base64 and url), streamed and not,
answer what `generate_tokens` gives the same rendered prompt and images,
with usage counting the image tokens; each bad image is one 400 and the
server keeps serving."""

import base64
import functools
import http.server
import io
import threading

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="images need the [vision] extra")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
requests = pytest.importorskip("requests")

import mlx.core as mx  # noqa: E402
from PIL import Image  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp import vision  # noqa: E402
from mlx_mtp.decode import generate_tokens  # noqa: E402
from mlx_mtp.testing.synthetic import write_checkpoint, write_qwen4_exp_checkpoint  # noqa: E402
from serving import Server, local_http  # noqa: E402

MAX_TOKENS = 12


def _png(seed, h, w) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _flat(h, w) -> bytes:  # (many pixels in few bytes)
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (40, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


PNGS = [_png(0, 64, 96), _png(1, 96, 64)]


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A local HTTP server for the images (and a 404)."""
    root = tmp_path_factory.mktemp("www")
    for i, png in enumerate(PNGS):
        (root / f"{i}.png").write_bytes(png)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    with local_http(handler) as url:
        yield url


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("vl"), vision=True)
    server = Server(["mlx_mtp.server", "--model", str(path), "--max-images", "2",
                     "--max-image-bytes", "60000", "--max-image-pixels", "200000"],
                    tmp_path_factory.mktemp("log") / "server.log")
    try:
        yield path, server
    finally:
        server.close()


@pytest.fixture(scope="module")
def reference(served):
    """What generate_tokens gives a user message of (images..., text)."""
    path, _ = served
    model, tok = mlx_mtp.load(str(path))

    def answer(n_images: int, text: str, images=PNGS) -> str:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                      add_generation_prompt=True)
        ids, media = vision.prompt_media(model, ids, list(images[:n_images]))
        out = generate_tokens(mx.array(ids), model, max_tokens=MAX_TOKENS, media=media)
        return _text(tok, out), len(ids)
    return answer


def _text(tok, out) -> str:
    """An answer's text, as the server writes it: the tokens before the first
    end-of-turn token (generate_tokens decodes past it)."""
    tokens = [t for t, _, _ in out]
    ends = [i for i, t in enumerate(tokens) if t in tok.eos_token_ids]
    return tok.decode(tokens[:ends[0]] if ends else tokens)


def _openai(server, parts, **kw):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": parts}],
                                          max_tokens=MAX_TOKENS, temperature=0, **kw)


def _black(png: bytes) -> np.ndarray:
    """A black image of the png's size."""
    return np.zeros(np.asarray(Image.open(io.BytesIO(png))).shape, np.uint8)


def test_openai_image_parts_answer_as_the_library(served, files, reference):
    """The answer is the library's for the same images, which is not its
    answer for black images of their sizes: the server reads the pixels."""
    _, server = served
    want, prompt_tokens = reference(2, "what are these")
    assert want != reference(2, "what are these", [_black(p) for p in PNGS])[0]
    for urls in ([_data_url(p) for p in PNGS], [f"{files}/0.png", f"{files}/1.png"]):
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [
            {"type": "text", "text": "what are these"}]
        r = _openai(server, parts)
        assert r.choices[0].message.content == want
        assert r.usage.prompt_tokens == prompt_tokens  # the image tokens counted
        stream = _openai(server, parts, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want


def test_anthropic_image_blocks_answer_as_the_library(served, files, reference):
    _, server = served
    want, prompt_tokens = reference(1, "and this one")
    assert want != reference(1, "and this one", [_black(PNGS[0])])[0]
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    for source in ({"type": "base64", "media_type": "image/png",
                    "data": base64.b64encode(PNGS[0]).decode()},
                   {"type": "url", "url": f"{files}/0.png"}):
        m = client.messages.create(model="m", max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [{"type": "image", "source": source},
                                         {"type": "text", "text": "and this one"}]}])
        assert "".join(b.text for b in m.content if b.type == "text") == want
        u = m.usage  # (the image's tokens counted, however Anthropic's usage splits them)
        assert u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens \
            == prompt_tokens
        events = client.messages.create(model="m", max_tokens=MAX_TOKENS, stream=True, messages=[
            {"role": "user", "content": [{"type": "image", "source": source},
                                         {"type": "text", "text": "and this one"}]}])
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta"
                       and e.delta.type == "text_delta") == want


@pytest.mark.parametrize("part,words", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
     "cannot"),  # bytes that are no image
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "data:, http"),
    ({"type": "image_url", "image_url": {"url": "{files}/missing.png"}}, "HTTP 404"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}, "fetching"),
    ({"type": "image_url", "image_url": {"url": _data_url(_png(2, 600, 600))}}, "bytes"),
    ({"type": "image_url", "image_url": {"url": _data_url(_flat(400, 600))}}, "pixels"),
    ({"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}, "video"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "only text and image"),
])
def test_each_bad_image_is_one_400_and_the_server_keeps_serving(served, files, part, words):
    _, server = served
    part = {k: ({"url": v["url"].replace("{files}", files)} if isinstance(v, dict) and "url" in v
                else v) for k, v in part.items()}
    r = requests.post(server.url + "/v1/chat/completions", json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            part, {"type": "text", "text": "hi"}]}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["param"] == "messages.0.content.0", error
    too_many = [{"type": "image_url", "image_url": {"url": _data_url(PNGS[0])}}] * 3
    r = requests.post(server.url + "/v1/chat/completions", json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": too_many}]})
    assert r.status_code == 400 and "--max-images" in r.json()["error"]["message"]
    assert _openai(server, "hello").choices[0].finish_reason in ("stop", "length")


def test_a_model_without_a_tower_refuses_images_in_one_line(tmp_path):
    """The reader of a text-only folder (and of a model without M-RoPE)
    refuses an image part with why, before anything is fetched."""
    from mlx_mtp.server.images import ImageLimits, reader_for
    from mlx_mtp.server.schemas import ApiError

    model, tok = mlx_mtp.load(str(write_checkpoint(tmp_path / "text", seed=4)))
    reader = reader_for(model, tok, ImageLimits())
    with pytest.raises(ApiError, match="takes no images") as e:
        reader.openai([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/never-fetched"}}]}])
    assert e.value.status == 400 and e.value.param == "messages.0.content.0"


def test_a_second_turn_about_an_image_is_served_from_the_cache(served, reference):
    """The next turn of a conversation about an image reads the first turn
    from the prefix cache (its image span included) and answers what a cold
    prefill answers; the same words with another image of the same size
    read only what comes before the image."""
    _, server = served
    first = [{"type": "image_url", "image_url": {"url": _data_url(PNGS[0])}},
             {"type": "text", "text": "what is it"}]
    r1 = _openai(server, first)
    convo = [{"role": "user", "content": first},
             {"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": "tell me more"}]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r2 = client.chat.completions.create(model="m", messages=convo, max_tokens=MAX_TOKENS,
                                        temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens - 1, (cached, r1.usage)
    # cold: the same conversation through the library
    path, _ = served
    model, tok = mlx_mtp.load(str(path))
    convo_ref = [{"role": "user", "content": [{"type": "image"},
                                              {"type": "text", "text": "what is it"}]},
                 convo[1], convo[2]]
    ids = tok.apply_chat_template(convo_ref, add_generation_prompt=True)
    ids, media = vision.prompt_media(model, ids, PNGS[:1])
    out = generate_tokens(mx.array(ids), model, max_tokens=MAX_TOKENS, media=media)
    assert r2.choices[0].message.content == _text(tok, out)
    assert r2.usage.prompt_tokens == len(ids)
    other = [{"type": "image_url", "image_url": {"url": _data_url(_png(7, 64, 96))}},
             {"type": "text", "text": "what is it"}]
    r3 = _openai(server, other)
    spec = vision.tower_of(model).spec
    before_image = ids.index(spec.image_token_id)
    assert r3.usage.prompt_tokens_details.cached_tokens <= before_image


def test_four_image_requests_at_once_each_answer_as_alone(served):
    """Four image requests sent together decode together (each prefilled on
    its own, then rows of one batch, each with its own M-RoPE shift): each
    answers what it answers alone."""
    _, server = served
    asks = [[{"type": "image_url", "image_url": {"url": _data_url(_png(10 + i, 64, 64 + 32 * i))}},
             {"type": "text", "text": f"picture {i}"}] for i in range(4)]
    alone = [_openai(server, a).choices[0].message.content for a in asks]
    together = [None] * 4

    def ask(i):
        together[i] = _openai(server, asks[i]).choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


@pytest.mark.slow
def test_fifty_image_requests_good_and_bad_leave_memory_bounded(served, files):
    """50 requests of images (new ones each time, of several sizes, mixed
    with undecodable bytes, too many pixels, bad base64 and failing URLs):
    every good one answered, every bad one a 400, and the server's resident
    memory after them within 64 MiB of where it was after 10 (the features
    kept by digest and the prefix cache are bounded)."""
    from serving import rss

    _, server = served
    rng = np.random.default_rng(5)

    def one(i):
        kind = i % 5
        url = (_data_url(_png(100 + i, 32 + 16 * (i % 4), 48 + 16 * (i % 3))) if kind < 2 else
               "data:image/png;base64,aGVsbG8=" if kind == 2 else
               _data_url(_flat(400, 600)) if kind == 3 else f"{files}/missing-{i}.png")
        r = requests.post(server.url + "/v1/chat/completions", json={
            "model": "m", "max_tokens": int(rng.integers(1, 8)), "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": f"n{i}"}]}]})
        assert r.status_code == (200 if kind < 2 else 400), (i, r.text)

    for i in range(10):
        one(i)
    before = rss(server.proc.pid)
    for i in range(10, 60):
        one(i)
    grew = rss(server.proc.pid) - before
    assert grew < 64 << 20, f"the server grew by {grew / 2**20:.0f} MiB"


def test_an_image_in_a_tool_result_is_read(served):
    """An agent's tool result holding an image (Claude Code reading a
    screenshot or an image file) is read like a user's: the answer is the
    library's for the same conversation, the image's tokens counted."""
    from mlx_mtp.server import anthropic as am

    path, server = served
    model, tok = mlx_mtp.load(str(path))
    spec = vision.tower_of(model).spec
    placeholder = tok.decode([spec.vision_start_token_id, spec.image_token_id,
                              spec.vision_end_token_id])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNGS[1]).decode()}}
    body = {"model": "m", "max_tokens": MAX_TOKENS, "messages": [
        {"role": "user", "content": "look at shot.png"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [image, {"type": "text", "text": "(png)"}]}]}]}
    r = requests.post(server.url + "/v1/messages", json=body)
    assert r.status_code == 200, r.text
    messages = am.to_chat(body, lambda block, at: {"type": "text", "text": placeholder})[0]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids, media = vision.prompt_media(model, ids, PNGS[1:2])
    out = generate_tokens(mx.array(ids), model, max_tokens=MAX_TOKENS, media=media)
    answer = r.json()
    assert "".join(b["text"] for b in answer["content"] if b["type"] == "text") == \
        _text(tok, out)
    u = answer["usage"]
    assert u["input_tokens"] + u["cache_creation_input_tokens"] + \
        u["cache_read_input_tokens"] == len(ids)


def test_n_choices_with_an_image_each_answer_as_the_library(served, reference):
    """OpenAI's `n` with an image: the choices start from one prefill of the
    prompt, its image included (lane.SharedPrompt), and each answers as alone."""
    _, server = served
    want, prompt_tokens = reference(1, "what is this")
    parts = [{"type": "image_url", "image_url": {"url": _data_url(PNGS[0])}},
             {"type": "text", "text": "what is this"}]
    r = _openai(server, parts, n=3)
    assert [c.message.content for c in r.choices] == [want] * 3
    assert r.usage.prompt_tokens == prompt_tokens


@pytest.fixture(scope="module")
def served_qwen4_exp(tmp_path_factory):
    path = write_qwen4_exp_checkpoint(tmp_path_factory.mktemp("q4vl"), vision=True)
    server = Server(["mlx_mtp.server", "--model", str(path), "--draft-tokens", "2"],
                    tmp_path_factory.mktemp("log") / "server.log")
    try:
        yield path, server
    finally:
        server.close()


def test_qwen4_exp_image_parts_answer_as_the_library(served_qwen4_exp):
    """qwen4_exp behind the server: two image parts answer what the library
    gives (not what black images of their sizes give), a bad image is one
    400 and the server keeps serving, and a second turn read from the prefix
    cache (its image span included: the M-RoPE ids before the new tokens)
    answers what a cold prefill does."""
    path, server = served_qwen4_exp
    model, tok = mlx_mtp.load(str(path))

    def library(messages, images):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids, media = vision.prompt_media(model, ids, images)
        out = generate_tokens(mx.array(ids), model, max_tokens=MAX_TOKENS, media=media)
        return _text(tok, out), len(ids)

    asked = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                          {"type": "text", "text": "what are these"}]}]
    want, prompt_tokens = library(asked, PNGS)
    assert want != library(asked, [_black(p) for p in PNGS])[0]
    parts = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in PNGS] + [
        {"type": "text", "text": "what are these"}]
    r1 = _openai(server, parts)
    assert r1.choices[0].message.content == want and r1.usage.prompt_tokens == prompt_tokens
    r = requests.post(server.url + "/v1/chat/completions", json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]})
    assert r.status_code == 400 and "cannot" in r.json()["error"]["message"], r.text
    convo = [{"role": "user", "content": parts},
             {"role": "assistant", "content": want},
             {"role": "user", "content": "tell me more"}]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r2 = client.chat.completions.create(model="m", messages=convo, max_tokens=MAX_TOKENS,
                                        temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= prompt_tokens - 1
    cold, n = library([asked[0], convo[1], convo[2]], PNGS)
    assert r2.choices[0].message.content == cold and r2.usage.prompt_tokens == n
