"""HTTP: mlx_lm.server's request handler, with requests checked before it
sees them, and the Anthropic Messages route.

Every refusal is one `ApiError`, answered with OpenAI's error object (or
Anthropic's on /v1/messages): unknown paths 404, a known path with another
method 405 with `Allow`, the body's size bounded before it is read
(--max-body-bytes) and its upload by --read-timeout, then its JSON, schema,
model, limits and the prompt's size, all before anything is tokenized or
queued. A request that fails once its answer has begun ends in its own
protocol: an SSE `error` chunk (OpenAI) or `event: error` (Anthropic)."""

from __future__ import annotations

import contextlib
import copy
import hmac
import json
import logging
import sys
import threading
from dataclasses import replace
from http import HTTPStatus
from queue import Queue
from http.server import ThreadingHTTPServer
from typing import Optional
from urllib.parse import unquote, urlsplit

from .. import checks
from ..stats import MTPStats
from ..mlx_lm_compat import (APIHandler, generation_arguments,
                             hand_body_to, validate_depth)
from . import anthropic, responses, structured
from .answer import Answer, openai_call
from .generation import ClientWatch, Refused, Slot
from .lane import SharedPrompt, extras
from .logprobs import entries
from .schemas import (CHAT_SCHEMA, COMPLETION_SCHEMA, ApiError, generation_failed,
                      max_tokens_exceeded, parse_json, utf8, validate)

# routes and their methods (OPTIONS, CORS's preflight, is answered on any path)
OPENAI_ROUTES = {"/v1/completions": COMPLETION_SCHEMA, "/v1/chat/completions": CHAT_SCHEMA,
                 "/chat/completions": CHAT_SCHEMA}
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
RESPONSES_ROUTES = ("/v1/responses", "/responses")
GET_ROUTES = ("/health", "/v1/models")
DRAIN_LIMIT = 64 << 20  # bytes of a refused body read and dropped, so its client sees the 413
DRAIN_CHUNK = 1 << 16


def allowed_methods(path: str) -> Optional[str]:
    """The methods a path answers (its `Allow` header), None if it is unknown."""
    if path in OPENAI_ROUTES or path in ANTHROPIC_ROUTES or path in RESPONSES_ROUTES:
        return "POST, OPTIONS"
    if path in GET_ROUTES or path.startswith("/v1/models/"):
        return "GET, OPTIONS"
    return None


class MTPAPIHandler(APIHandler):
    """mlx_lm's request handler, with requests checked before it sees them."""

    stats: Optional[MTPStats] = None  # the request's, filled by the generation thread
    seen: Optional[list] = None  # the choice's Responses so far (their logprobs)
    wanted: Optional[structured.Wanted] = None  # what its output must be (structured output)
    images: tuple = ()  # its images (images.py), read in _check
    logprobs_sent = 0  # of `seen`, those whose logprobs went out in a streamed chunk
    _answered = False  # the status line of an answer was sent (`send_response`)

    def __init__(self, response_generator, *args, **kwargs):
        # socketserver applies it to the connection: an upload (or a request
        # line) that stalls this long ends with 408 and frees its thread
        self.timeout = getattr(response_generator.cli_args, "read_timeout", None)
        self._write_lock = threading.Lock()
        super().__init__(response_generator, *args, **kwargs)

    def log_message(self, format, *args):
        logging.info("%s - %s", self.address_string(), format % args)

    # -- answers ------------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers=()):
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        for h in headers:
            self.send_header(*h)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def send_api_error(self, e: ApiError, style: str = "openai"):
        logging.info("%s %s: %d %s", self.command, self.path, e.status, e)
        headers = [("WWW-Authenticate", "Bearer")] if e.status == 401 else []
        if e.status == 405:
            headers.append(("Allow", allowed_methods(urlsplit(self.path).path)))
        self._send_json(e.status, e.openai() if style == "openai" else e.anthropic(), headers)

    def send_error(self, code, message=None, explain=None):
        """http.server's own errors (a malformed request line, an unknown
        method, a header too long) as JSON, not its HTML page."""
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "error"
        if code == 501 and getattr(self, "command", None):
            message = f"the method {self.command} is not supported"
        error = ApiError(code, message or explain or phrase,
                         kind="server_error" if code >= 500 else "invalid_request_error")
        logging.info("%s: %d %s", getattr(self, "requestline", ""), code, error)
        body = json.dumps(error.openai()).encode()
        self.send_response(code, phrase)
        self.send_header("Content-Type", "application/json")
        self.send_header("Connection", "close")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if getattr(self, "command", None) != "HEAD" and code >= 200 and code not in (204, 304):
            self.wfile.write(body)

    def _end_in_protocol(self, e: BaseException, style: str = "openai"):
        """A request failed after its answer began (a shutdown past
        --shutdown-grace, the generation failing): a streamed one ends with
        its protocol's error event, a non-streamed one is answered with the
        error instead of its 200. Never a silently cut answer."""
        error = e if isinstance(e, ApiError) else generation_failed(e)
        logging.info("%s %s: ended with %d %s", self.command, self.path, error.status, error)
        self.close_connection = True
        if style == "anthropic":
            return self._write_event("error", error.anthropic())
        # OpenAI's SDK raises APIError on a data chunk holding "error"; [DONE]
        # then closes the stream for clients that wait for it
        self.wfile.write(f"data: {json.dumps(error.openai())}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()

    # -- checks -------------------------------------------------------------------------------
    def _authorize(self):
        key = self.response_generator.cli_args.api_key
        if key is None:
            return
        # RFC 7235: the scheme is case-insensitive ("bearer KEY" too)
        scheme, _, token = self.headers.get("Authorization", "").strip().partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else self.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")

    def _read_json(self) -> dict:
        """The body, bounded before it is read: a body larger than the server
        takes is dropped as it arrives (its client then sees the 413), one
        that stalls for --read-timeout gets 408; then `parse_json`."""
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise ApiError(411, "Content-Length header is required")
        try:
            length = int(length)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise ApiError(400, "invalid Content-Length header") from None
        limit = self.response_generator.model_provider.body_limit
        if length > limit:
            self.close_connection = True
            self._drop(length)
            raise ApiError(413, f"the request body has {length} bytes, more than this server "
                                f"takes ({limit} bytes, --max-body-bytes)",
                           code="request_too_large")
        try:
            raw = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise ApiError(408, f"the request body did not arrive: nothing came for "
                                f"{self.timeout:g} s (--read-timeout)",
                           code="request_timeout") from None
        if len(raw) < length:
            self.close_connection = True
            raise ApiError(400, f"the request body ended after {len(raw)} of the {length} bytes "
                                "its Content-Length announced")
        text = utf8(raw)
        del raw  # (at most two copies of the body at once)
        return parse_json(text)

    def _drop(self, length: int):
        """Read and drop up to DRAIN_LIMIT bytes of a refused body, a chunk
        at a time (closing with unread data would reset the connection before
        the client reads the answer)."""
        left = min(length, DRAIN_LIMIT)
        with contextlib.suppress(OSError):
            while left > 0:
                chunk = self.rfile.read(min(left, DRAIN_CHUNK))
                if not chunk:
                    break
                left -= len(chunk)

    def _check(self, body: dict, schema: dict):
        validate(body, schema, "openai")
        mp = self.response_generator.model_provider
        width = max(1, self.response_generator.cli_args.decode_concurrency)
        if (body.get("n") or 1) > width:
            raise ApiError(400, f"n must be in 1..{width} (--decode-concurrency: the choices "
                                f"decode together), not {body['n']}", param="n")
        self._check_model(body.get("model"))
        body["model"] = mp.served_id  # the answer names the model that answered
        self._check_limits(body, ("max_tokens", "max_completion_tokens"))
        try:
            checks.logit_bias(body.get("logit_bias"), mp.model.vocab_size)
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param="logit_bias") from None
        # response_format and a forcing tool_choice (compiled here: a bad schema is a 400)
        wanted = structured.openai(body, mp.tokenizer, mp.model.vocab_size)
        cli = self.response_generator.cli_args
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or cli.max_tokens
        kwargs, self.wanted = structured.thinking_for_grammar(
            wanted, body.get("chat_template_kwargs") or {}, cli.chat_template_args,
            mp.tokenizer.has_thinking, max_tokens)
        if kwargs:
            body["chat_template_kwargs"] = kwargs
        # images read here, each part then the model's placeholder text (images.py)
        self.images = tuple(mp.images.openai(body.get("messages") or []))
        # (before mlx_lm's handler parses the body again: see preflight)
        self.response_generator.check_prompt_size(body.get("prompt"), body.get("messages", ()),
                                                  max_tokens)
        for i, m in enumerate(body.get("messages", ())):
            if m["role"] == "developer":  # OpenAI's newer name for the system role
                m["role"] = "system"

    def _check_model(self, name):
        mp = self.response_generator.model_provider
        if not mp.serves(name):
            raise ApiError(404, f"the model {name!r} is not served here (serving "
                                f"{mp.served_id!r}; --strict-model)", code="model_not_found")

    def _check_limits(self, body: dict, token_fields):
        """What the table cannot know: max_tokens against --max-tokens-limit,
        top_k against the model's vocabulary."""
        rg = self.response_generator
        limit = rg.cli_args.max_tokens_limit
        for name in token_fields:
            if (body.get(name) or 0) > limit:
                raise max_tokens_exceeded(name, body[name], limit, rg.model_provider.served_id)
        if body.get("top_k") is not None:
            try:
                checks.top_k(body["top_k"], rg.model_provider.model.vocab_size)
            except ValueError as e:
                raise ApiError(400, str(e), param="top_k") from None

    # -- routes -------------------------------------------------------------------------------
    def _route(self, method: str) -> str:
        """The request's path without its query (Claude Code posts to
        /v1/messages?beta=true); 404 for an unknown path, 405 for a known
        one asked with another method."""
        path = urlsplit(self.path).path
        allowed = allowed_methods(path)
        if allowed is None:
            raise ApiError(404, f"no endpoint {path}", code="not_found")
        if method not in allowed.split(", "):
            raise ApiError(405, f"{path} takes {allowed.split(',')[0]}, not {method}",
                           code="method_not_allowed")
        return path

    def do_POST(self):
        style = "anthropic" if self.path.startswith("/v1/messages") else "openai"
        rg = self.response_generator
        try:
            path = self._route("POST")
            self._authorize()
            with rg.serving():  # (503 once a shutdown began)
                body = self._read_json()
                if path in ANTHROPIC_ROUTES:
                    with rg.slot() as slot:
                        return self.handle_messages(body, slot,
                                                    count_only=path.endswith("count_tokens"))
                if path in RESPONSES_ROUTES:
                    with rg.slot() as slot:
                        return responses.handle_responses(self, body, slot)
                self._check(body, OPENAI_ROUTES[path])
                hand_body_to(self, body)  # mlx_lm's handler parses it again from here on
                del body
                self.path = path
                super().do_POST()
        except ApiError as e:
            self.send_api_error(e, style)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            logging.info("%s %s: the client disconnected", self.command, self.path)
        except Exception as e:  # a bug of ours: the client hears of it, the server serves on
            logging.exception("%s %s: %s", self.command, self.path, e)
            if self._answered:  # (its answer began: it cannot be answered again)
                self.close_connection = True
            else:
                self.send_api_error(ApiError(500, f"internal error: {type(e).__name__}: {e}",
                                             kind="server_error"), style)

    def send_response(self, code, message=None):
        self._answered = True
        super().send_response(code, message)

    def do_GET(self):
        try:
            path = self._route("GET")
            if path != "/health":  # open, for supervisors and load balancers
                self._authorize()
        except ApiError as e:
            return self.send_api_error(e)
        self.path = path
        super().do_GET()  # /health, /v1/models (handle_models_request)

    def _other_method(self):
        """PUT, DELETE, PATCH, HEAD: 405 on a known path, 404 elsewhere."""
        try:
            self._route(self.command)
        except ApiError as e:
            self.send_api_error(e, "anthropic" if self.path.startswith("/v1/messages")
                                else "openai")

    do_PUT = do_DELETE = do_PATCH = do_HEAD = _other_method

    def validate_model_parameters(self):
        # mlx_lm's check wants an int; "auto" and None (the server's default) are ours
        validate_depth(self, super().validate_model_parameters)

    def handle_completion(self, request, stop_words):
        rg = self.response_generator
        n = self.body.get("n") or 1
        with contextlib.ExitStack() as held:
            try:
                slot = held.enter_context(rg.slot(n))
                extras(request).images = self.images
                rg.preflight(request, self.chat_template_kwargs, self.max_tokens)
                structured.attach_grammar(request, self.wanted, rg.model_provider)
            except ApiError as e:
                return self.send_api_error(e)
            # the generation thread counts into it (`_prepare`, every choice); `usage` reports it
            self.stats = MTPStats()
            requests = [request] + [fork(request, self.wanted, rg.model_provider)
                                    for _ in range(n - 1)]
            watch = None
            if not self.stream:  # (a streamed one finds out when a write fails)
                watch = ClientWatch(self.connection, *requests)
                held.callback(watch.close)
            try:
                self._complete(requests, stop_words, slot)
            except Refused as r:  # before the answer began
                self.send_api_error(r.error)
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                raise
            except Exception as e:  # after: the 200 (headers) is out, or buffered
                if not self.stream:
                    self._headers_buffer = []  # http.server's: the unsent 200 is dropped
                    return self.send_api_error(e if isinstance(e, ApiError) else
                                               generation_failed(e))
                self._end_in_protocol(e)

    def _complete(self, requests: list, stop_words, slot: Slot):
        """Generate and answer in OpenAI's shape, streamed or not: mlx_lm's
        `handle_completion` with the answer read by `answer.Answer` (a tool
        call the parser cannot read stays text, the finish reason is what
        happened) and the generation's text taken as it comes (EOS and stop
        strings already left out: lane.py). One choice per request (`n`):
        choice i is row i of the batch, seeded `seed + i`, so it is what a
        lone request with that seed answers."""
        rg = self.response_generator
        args = generation_arguments(
            model=self.requested_model, draft=self.requested_draft_model, adapter=self.adapter,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold,
            logit_bias=self.logit_bias, repetition_penalty=self.repetition_penalty,
            repetition_context_size=self.repetition_context_size,
            presence_penalty=self.presence_penalty,
            presence_context_size=self.presence_context_size,
            frequency_penalty=self.frequency_penalty,
            frequency_context_size=self.frequency_context_size, stop_words=stop_words,
            max_tokens=self.max_tokens, num_draft_tokens=self.num_draft_tokens,
            logprobs=self.logprobs, top_logprobs=self.top_logprobs, seed=self.seed,
            chat_template_kwargs=self.chat_template_kwargs)

        def keepalive(done, total):  # (a long prompt's prefill: the connection stays open)
            logging.info("Prompt processing progress: %d/%d", done, total)
            if self.stream:
                self._write(f": keepalive {done}/{total}\n\n")

        choices = []
        try:
            for i, request in enumerate(requests):
                extras(request).stats = self.stats
                seed = None if self.seed is None else (self.seed + i) % (1 << 64)
                ctx, responses = rg.generate(request, replace(args, seed=seed),
                                             progress_callback=keepalive)
                choices.append(Choice(i, ctx, responses, Answer(
                    ctx, request.tools, rg.model_provider.tokenizer), self.stream))
            if self.stream:
                self._set_stream_headers(200)
                self.end_headers()
            else:
                self._set_completion_headers(200)
            for choice, gen in interleaved(choices) if self.stream else \
                    ((c, g) for c in choices for g in c.responses):
                choice.feed(gen)
                if self.stream and choice.has_delta() and gen.finish_reason is None:
                    self._write_chunk(self._choice_response(choice, None))
            slot.release()  # (the generation ended: what is left is writing)
            prompt = len(choices[0].ctx.prompt)
            tokens = sum(c.said.tokens for c in choices)
            cached = choices[0].ctx.prompt_cache_count
            if self.stream:
                for choice in choices:
                    self._write_chunk(self._choice_response(choice, choice.said.finish().openai))
                if self.stream_options is not None and self.stream_options.get("include_usage"):
                    self._write_chunk(self.completion_usage_response(prompt, tokens, cached))
                self._write("data: [DONE]\n\n")
            else:
                answers = [self._choice_response(c, c.said.finish().openai, prompt, tokens,
                                                 cached) for c in choices]
                body = answers[0]
                body["choices"] = [a["choices"][0] for a in answers]
                data = json.dumps(body).encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()
        finally:
            for choice in choices:
                choice.ctx.stop()

    def _choice_response(self, choice: "Choice", reason, *usage) -> dict:
        """mlx_lm's `generate_response` for one choice: its text, reasoning
        and calls since the last chunk, its logprobs, its index."""
        text, reasoning, calls = choice.take()
        self.seen, self.logprobs_sent = choice.seen, choice.logprobs_sent
        response = self.generate_response(text, reason, *usage, tool_calls=calls,
                                          reasoning_text=reasoning)
        choice.logprobs_sent = self.logprobs_sent
        response["choices"][0]["index"] = choice.index
        return response

    def _write_chunk(self, chunk: dict):
        self._write(f"data: {json.dumps(chunk)}\n\n")

    def _write(self, text: str):
        """One whole SSE event or comment (several choices' threads write keepalives)."""
        with self._write_lock:
            self.wfile.write(text.encode())
            self.wfile.flush()

    def handle_models_request(self):
        """`GET /v1/models`: the list; `GET /v1/models/{id}`: one model
        object for any name served (every name, or with --strict-model this
        model's own), a 404 otherwise."""
        mp = self.response_generator.model_provider
        name = unquote(self.path[len("/v1/models/"):]) if self.path.startswith("/v1/models/") \
            else None
        if name is None:
            return self._send_json(200, {"object": "list", "data": [self._model(mp.served_id)]})
        try:
            self._check_model(name)
        except ApiError as e:
            return self.send_api_error(e)
        self._send_json(200, self._model(name))

    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "mlx_mtp"}

    # -- responses: usage with MTP statistics, logprobs in OpenAI's shape ---------------------
    def _mtp_usage(self, response: dict) -> dict:
        if self.stats is not None and "usage" in response:
            response["usage"]["mtp"] = self.stats.usage()
        return response

    def generate_response(self, *args, **kwargs):
        # mlx_lm's logprobs (see logprobs.py) are not built: ours instead
        kwargs.update(token_logprobs=None, top_tokens=None)
        response = super().generate_response(*args, **kwargs)
        choice = response["choices"][0]
        if self.logprobs or self.top_logprobs > 0:
            seen = self.seen or []
            new = seen[self.logprobs_sent:] if self.stream else seen
            self.logprobs_sent = len(seen)
            choice["logprobs"] = {"content": entries(
                self.response_generator.model_provider.token_text, new)}
        return self._mtp_usage(response)

    def completion_usage_response(self, *args, **kwargs):
        response = super().completion_usage_response(*args, **kwargs)
        response["object"] = self.object_type  # a chunk of the stream (mlx_lm: chat.completion)
        return self._mtp_usage(response)

    # -- Anthropic Messages -------------------------------------------------------------------
    def _write_event(self, kind: str, data: dict):
        self.wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def handle_messages(self, body: dict, slot: Slot, count_only: bool = False):
        return anthropic.handle_messages(self, body, slot, count_only)


class Choice:
    """One choice of an OpenAI answer as it is generated: its parts since
    the last chunk (`take`), its Responses (`seen`: their logprobs) and how
    it ended."""

    def __init__(self, index: int, ctx, responses, said: Answer, stream: bool):
        self.index, self.ctx, self.responses, self.said = index, ctx, responses, said
        self.stream = stream
        self.seen: list = []
        self.logprobs_sent = 0  # of `seen`, those whose logprobs went out in a streamed chunk
        self._text, self._reasoning, self._calls = [], [], []

    def feed(self, gen):
        self.seen.append(gen)
        for part in self.said.feed(gen):
            if part.kind == "calls":  # (a stream numbers its calls: `index`)
                first = self.said.calls - len(part.calls)
                self._calls += [openai_call(c, first + i if self.stream else None)
                                for i, c in enumerate(part.calls)]
            else:
                (self._reasoning if part.kind == "reasoning" else self._text).append(part.text)

    def has_delta(self) -> bool:
        return bool(self._text or self._reasoning or self._calls)

    def take(self):
        out = "".join(self._text), "".join(self._reasoning), self._calls
        self._text, self._reasoning, self._calls = [], [], []
        return out


def fork(request, wanted, mp):
    """A copy of a rendered request for another choice (OpenAI's `n`): the
    same prompt (prefilled once for all choices: their `SharedPrompt`), its
    own grammar state and statistics."""
    given = extras(request)
    if given.shared_prompt is None:
        given.shared_prompt = SharedPrompt(waiting=0)
    given.shared_prompt.waiting += 1
    other = copy.copy(request)
    other.mtp = replace(given, constraint=None, reasoning_budget=None, stats=None, ctx=None)
    structured.attach_grammar(other, wanted, mp)
    return other


def interleaved(choices):
    """(choice, Response) of several choices' generations as they come (a
    stream of `n` choices): a thread drains each one's responses."""
    if len(choices) == 1:
        yield from ((choices[0], gen) for gen in choices[0].responses)
        return
    merged: Queue = Queue()

    def drain(choice):
        try:
            for gen in choice.responses:
                merged.put((choice, gen))
        except BaseException as e:
            merged.put((choice, e))
        merged.put((choice, None))

    for choice in choices:
        threading.Thread(target=drain, args=(choice,), daemon=True,
                         name="mlx_mtp-choice").start()
    left = len(choices)
    while left:
        choice, gen = merged.get()
        if gen is None:
            left -= 1
        elif isinstance(gen, BaseException):
            raise gen
        else:
            yield choice, gen


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 makes clients at once wait)

    def shutdown(self):
        """Stop serving and close the listening socket: during the shutdown's
        grace (MTPResponseGenerator.stop_and_join) a new connection is
        refused at once instead of waiting in the backlog for nobody."""
        super().shutdown()
        self.server_close()

    def handle_error(self, request, client_address):
        kind, e = sys.exc_info()[:2]
        if kind in (BrokenPipeError, ConnectionResetError, TimeoutError):
            logging.info("%s: the client disconnected", client_address[0])
        else:
            logging.error("%s: %s: %s", client_address[0], kind.__name__, e)
