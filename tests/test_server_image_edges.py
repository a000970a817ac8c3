"""The server's image edges (issue 62), on a tiny Qwen3.5 VL folder with a
256-token context: image tokens counted before anything is queued (the
context check, count_tokens, usage agree for several image sizes), an image
URL's total deadline and byte cap with the handler free afterwards, photos
read upright on every path, and the server's own request fields
(num_draft_tokens) checked and applied alike on every API."""

import base64
import contextlib
import http.server
import io
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason="images need the [vision] extra")
requests = pytest.importorskip("requests")

from PIL import Image  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp import vision  # noqa: E402
from mlx_mtp.testing.synthetic import write_checkpoint  # noqa: E402
from serving import Server, local_http  # noqa: E402

CONTEXT = 256
TIMEOUT = 1.0  # --image-timeout
MAX_BYTES = 100_000  # --max-image-bytes
# (height, width): the tiny processor resizes each between 32x32 and 128x128
# pixels' worth, 1 to 16 image tokens
SIZES = [(32, 32), (64, 96), (128, 128), (40, 200), (300, 300)]


def _pixels(h, w, seed=0) -> np.ndarray:
    """Random 4x4 blocks (a few KB of PNG at 300x300)."""
    blocks = np.random.default_rng(seed).integers(0, 256, (-(-h // 4), -(-w // 4), 3),
                                                  dtype=np.uint8)
    return np.ascontiguousarray(blocks.repeat(4, 0).repeat(4, 1)[:h, :w])


def _png(pixels: np.ndarray, orientation=None) -> bytes:
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation is not None:
        exif[0x0112] = orientation
    Image.fromarray(pixels).save(buf, format="PNG", exif=exif)
    return buf.getvalue()


def _b64(png: bytes) -> str:
    return base64.b64encode(png).decode()


def _image_url(png: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _b64(png)}}


def _image_block(png: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": _b64(png)}}


class Files(http.server.BaseHTTPRequestHandler):
    """/trickle: a PNG one byte every 0.25 s; /endless: bytes without end;
    other paths: `Files.pngs[path]`."""

    protocol_version = "HTTP/1.0"
    pngs: dict = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        try:
            if self.path in Files.pngs:
                data = Files.pngs[self.path]
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.end_headers()
            png = _png(_pixels(4, 4))
            while True:  # (ends when the fetch gives up and closes)
                if self.path == "/trickle":
                    for b in png:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.25)
                    return
                self.wfile.write(b"\0" * 4096)
        except OSError:
            pass


@pytest.fixture(scope="module")
def files():
    with local_http(Files) as url:
        yield url


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("vl"), vision=True,
                            text_overrides={"max_position_embeddings": CONTEXT})
    server = Server(["mlx_mtp.server", "--model", str(path), "--max-tokens", "8",
                     "--image-timeout", str(TIMEOUT), "--max-image-bytes", str(MAX_BYTES)],
                    tmp_path_factory.mktemp("log") / "server.log")
    try:
        model, tok = mlx_mtp.load(str(path))
        yield SimpleNamespace(path=path, server=server, model=model, tok=tok)
    finally:
        server.close()


def _post(served, route, body):
    return requests.post(served.server.url + route, json=body, timeout=60)


def _library_length(served, pngs, text) -> int:
    """The prompt's tokens as the library lays it out (vision.prompt_media)."""
    content = [{"type": "image"}] * len(pngs) + [{"type": "text", "text": text}]
    ids = served.tok.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True)
    return len(vision.prompt_media(served.model, ids, pngs)[0])


# ------------------------------------------------------- image tokens counted

def test_count_tokens_and_usage_count_each_images_tokens(served):
    """For images of several sizes (1 to 16 tokens each), one at a time and
    all together: count_tokens says what the generation's usage says
    (Anthropic and OpenAI), which is the library's laid-out prompt."""
    pngs = [_png(_pixels(h, w, i)) for i, (h, w) in enumerate(SIZES)]
    for group in [[p] for p in pngs] + [pngs]:
        want = _library_length(served, group, "what is it")
        messages = [{"role": "user", "content": [_image_block(p) for p in group] + [
            {"type": "text", "text": "what is it"}]}]
        r = _post(served, "/v1/messages/count_tokens", {"model": "m", "messages": messages})
        assert r.status_code == 200, r.text
        assert r.json()["input_tokens"] == want
        r = _post(served, "/v1/messages", {"model": "m", "max_tokens": 2, "messages": messages})
        assert r.status_code == 200, r.text
        u = r.json()["usage"]
        assert u["input_tokens"] + u["cache_creation_input_tokens"] + \
            u["cache_read_input_tokens"] == want
        r = _post(served, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": [_image_url(p) for p in group] + [
                {"type": "text", "text": "what is it"}]}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == want


def test_images_past_the_context_are_refused_as_text_is(served):
    """A prompt whose text and placeholders fit the context with max_tokens
    but whose images' tokens do not: the 400 text gets (OpenAI's
    context_length_exceeded, Anthropic's two wordings), from the request's
    own thread, counting each image's tokens."""
    big = [_png(_pixels(128, 128, 20 + i)) for i in range(16)]  # 16 tokens each
    text = "what are they"
    for n, max_tokens_left in ((12, True), (16, False)):
        pngs = big[:n]
        placeholders = len(served.tok.apply_chat_template([{"role": "user", "content": [
            {"type": "image"}] * n + [{"type": "text", "text": text}]}],
            add_generation_prompt=True))  # (what the check counted before)
        length = _library_length(served, pngs, text)
        max_tokens = CONTEXT - placeholders if max_tokens_left else 8
        assert placeholders + max_tokens <= CONTEXT < length + max_tokens
        r = _post(served, "/v1/chat/completions", {"max_tokens": max_tokens, "messages": [
            {"role": "user", "content": [_image_url(p) for p in pngs] + [
                {"type": "text", "text": text}]}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert error["message"].startswith(
            f"This model's maximum context length is {CONTEXT} tokens. However, you requested "
            f"{length + max_tokens} tokens ({length} in the messages, {max_tokens} in the "
            "completion)"), error
        messages = [{"role": "user", "content": [_image_block(p) for p in pngs] + [
            {"type": "text", "text": text}]}]
        r = _post(served, "/v1/messages", {"model": "m", "max_tokens": max_tokens,
                                           "messages": messages})
        assert r.status_code == 400, r.text
        words = (f"input length and `max_tokens` exceed context limit: {length} + {max_tokens} "
                 f"> {CONTEXT}" if length < CONTEXT else
                 f"prompt is too long: {length} tokens > {CONTEXT} maximum")
        assert r.json()["error"]["message"].startswith(words), r.text
        r = _post(served, "/v1/messages/count_tokens", {"model": "m", "messages": messages})
        assert r.json() == {"input_tokens": length}
    assert _post(served, "/v1/chat/completions", {"max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}).status_code == 200


# ------------------------------------------------------------------ fetches

def test_a_trickling_or_endless_image_url_is_a_400_and_the_server_serves_on(served, files):
    """--image-timeout is one deadline for the whole fetch (a PNG at a byte
    every 0.25 s would take 15 s), --max-image-bytes holds while reading
    (a URL without end): each a 400 within the deadline + 1 s; the next
    request is answered."""
    for path, words in (("/trickle", f"took more than {TIMEOUT:g} s (--image-timeout)"),
                        ("/endless", f"over {MAX_BYTES} bytes (--max-image-bytes)")):
        t0 = time.monotonic()
        r = _post(served, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {
                "url": files + path}}, {"type": "text", "text": "hi"}]}]})
        took = time.monotonic() - t0
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
        assert took < TIMEOUT + 1, f"{path}: {took:.2f} s"
        r = _post(served, "/v1/chat/completions", {"max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text


# --------------------------------------------------------------------- EXIF

def test_a_photo_with_exif_orientation_reads_upright_on_every_path(served, files):
    """A data URL, a fetched URL and an Anthropic base64 block of a photo
    stored sideways with EXIF orientation 6 answer as the upright photo
    (the same first-token log-probs), not as its stored pixels."""
    upright = _pixels(64, 96, 7)
    stored = np.ascontiguousarray(np.rot90(upright, k=1))
    Files.pngs["/phone.png"] = _png(stored, orientation=6)

    def first(part) -> tuple:
        r = _post(served, "/v1/chat/completions", {
            "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": "it"}]}]})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        top = choice["logprobs"]["content"][0]["top_logprobs"]
        return choice["message"]["content"], [(t["token"], t["logprob"]) for t in top]

    want = first(_image_url(_png(upright)))
    assert first(_image_url(_png(stored, orientation=6))) == want
    assert first({"type": "image_url", "image_url": {"url": files + "/phone.png"}}) == want
    # (the stored pixels are another image: the upright's top token scores
    # more than 1e-3 apart)
    token, logprob = want[1][0]
    sideways = dict(first(_image_url(_png(stored)))[1])
    assert token in sideways and abs(sideways[token] - logprob) > 1e-3, (sideways, want)
    r = _post(served, "/v1/messages", {"model": "m", "max_tokens": 3, "messages": [
        {"role": "user", "content": [_image_block(_png(stored, orientation=6)),
                                     {"type": "text", "text": "it"}]}]})
    assert "".join(b["text"] for b in r.json()["content"] if b["type"] == "text") == want[0]


# ---------------------------------------------- the server's own request fields

def test_num_draft_tokens_is_checked_alike_on_every_api(served):
    """num_draft_tokens (the server's own field): 99 is the same 400 on chat,
    completions, messages and responses; 2 and 'auto' are served."""
    bodies = {"/v1/chat/completions": {"max_tokens": 2, "messages": [
                  {"role": "user", "content": "hi"}]},
              "/v1/completions": {"max_tokens": 2, "prompt": "hi"},
              "/v1/messages": {"model": "m", "max_tokens": 2, "messages": [
                  {"role": "user", "content": "hi"}]},
              "/v1/responses": {"max_output_tokens": 2, "input": "hi"}}
    for route, body in bodies.items():
        r = _post(served, route, dict(body, num_draft_tokens=99))
        assert r.status_code == 400, (route, r.text)
        assert r.json()["error"]["message"] == \
            "num_draft_tokens must be in 0..16 or 'auto', not 99", (route, r.text)
        for depth in (2, "auto"):
            r = _post(served, route, dict(body, num_draft_tokens=depth))
            assert r.status_code == 200, (route, r.text)


def test_num_draft_tokens_reaches_the_generation_on_messages_and_responses(served,
                                                                         monkeypatch):
    """The value a body sets is what the generation gets (chat and
    completions: mlx_lm's handler reads it), as `extension_args` passes it."""
    from mlx_mtp.server import anthropic, cli, responses
    from mlx_mtp.server.images import ImageReader
    from mlx_mtp.vision import ImageLimits

    seen = []

    class Caught(Exception):
        pass

    @contextlib.contextmanager
    def generate_for(handler, request, args, stream, progress=None):
        seen.append(args.num_draft_tokens)
        raise Caught
        yield

    monkeypatch.setattr(anthropic, "generate_for", generate_for)
    monkeypatch.setattr(responses, "generate_for", generate_for)
    mp = SimpleNamespace(tokenizer=served.tok, model=served.model, served_id="m",
                         images=ImageReader(ImageLimits(), None, "no images"),
                         context_length=CONTEXT)
    rg = SimpleNamespace(model_provider=mp, cli_args=cli.parse_args([]),
                         preflight=lambda *args, **kwargs: [1, 2, 3])
    handler = SimpleNamespace(response_generator=rg, headers={},
                              _check_model=lambda name: None,
                              _check_limits=lambda body, fields: None)
    for depth in (2, 0, None):
        extra = {} if depth is None else {"num_draft_tokens": depth}
        with pytest.raises(Caught):
            anthropic.handle_messages(handler, {"model": "m", "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}], **extra}, slot=None)
        with pytest.raises(Caught):
            responses.handle_responses(handler, {"input": "hi", "max_output_tokens": 2,
                                                 **extra}, slot=None)
    assert seen == [2, 2, 0, 0, None, None]
