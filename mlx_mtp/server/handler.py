"""HTTP: mlx_lm.server's request handler, with requests checked before it
sees them, and the Anthropic Messages route."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import sys
import threading
from http.server import ThreadingHTTPServer
from typing import Optional

from .. import checks
from ..loop import MTPStats
from ..mlx_lm_compat import (NEUTRAL, APIHandler, CompletionRequest, generation_arguments,
                             hand_body_to, text_segments, validate_depth)
from . import anthropic
from .schemas import CHAT_SCHEMA, COMPLETION_SCHEMA, ApiError, validate

MAX_BODY = 64 << 20  # bytes


class _ClientWatch(threading.Thread):
    """Stops a non-streamed generation whose client closed its connection
    (an agent that timed out, say): otherwise it would decode to max_tokens
    for nobody, beside the rows still wanted. Polls the socket for the end
    of the stream; the row leaves as a streamed one does when a write fails."""

    POLL = 0.25  # seconds

    def __init__(self, sock, request):
        super().__init__(daemon=True, name="mlx_mtp-client-watch")
        self.sock, self.request, self.done = sock, request, threading.Event()
        self.start()

    def run(self):
        while not self.done.wait(self.POLL):
            try:
                if not select.select([self.sock], [], [], 0)[0]:
                    continue
                if self.sock.recv(1, socket.MSG_PEEK):
                    return  # the client sent more (a pipelined request): it is there
            except (OSError, ValueError):
                pass  # reset: gone too
            break
        while not self.done.is_set():  # gone: stop its generation once it has one
            ctx = getattr(self.request, "mtp_ctx", None)
            if ctx is not None:
                logging.info("the client of a non-streamed request left: its row finishes")
                ctx.stop()
                return
            self.done.wait(self.POLL)

    def close(self):
        self.done.set()


class MTPAPIHandler(APIHandler):
    """mlx_lm's request handler, with requests checked before it sees them."""

    stats: Optional[MTPStats] = None  # the request's, filled by the generation thread
    routes = {"/v1/completions": COMPLETION_SCHEMA, "/v1/chat/completions": CHAT_SCHEMA,
              "/chat/completions": CHAT_SCHEMA}

    def log_message(self, format, *args):
        logging.info("%s - %s", self.address_string(), format % args)

    # -- answers ------------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers=()):
        data = json.dumps(body).encode()
        self._set_completion_headers(status)
        for h in headers:
            self.send_header(*h)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def send_api_error(self, e: ApiError, style: str = "openai"):
        logging.info("%s %s: %d %s", self.command, self.path, e.status, e)
        headers = [("WWW-Authenticate", "Bearer")] if e.status == 401 else []
        self._send_json(e.status, e.openai() if style == "openai" else e.anthropic(), headers)

    # -- checks -------------------------------------------------------------------------------
    def _authorize(self):
        key = self.response_generator.cli_args.api_key
        if key is None:
            return
        bearer = self.headers.get("Authorization", "")
        given = bearer[7:] if bearer.startswith("Bearer ") else self.headers.get("x-api-key")
        if given != key:
            raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "Content-Length header is required")
        try:
            length = int(length)
        except ValueError:
            raise ApiError(400, "invalid Content-Length header") from None
        if length < 0 or length > MAX_BODY:
            raise ApiError(413, f"the request body is larger than {MAX_BODY} bytes")
        self.raw_body = self.rfile.read(length)
        try:
            body = json.loads(self.raw_body.decode(), parse_constant=_not_json)
        except (ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
            raise ApiError(400, f"invalid JSON in the request body: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _check(self, body: dict, schema: dict):
        validate(body, schema, "openai")
        rg = self.response_generator
        if not rg.model_provider.serves(body.get("model")):
            raise ApiError(404, f"the model {body.get('model')!r} is not served here (serving "
                                f"{rg.model_provider.served_id!r})", code="model_not_found")
        self._check_limits(body, ("max_tokens", "max_completion_tokens"))
        try:
            checks.logit_bias(body.get("logit_bias"), rg.model_provider.model.vocab_size)
        except (TypeError, ValueError) as e:
            raise ApiError(400, str(e), param="logit_bias") from None
        for i, m in enumerate(body.get("messages", ())):
            if m["role"] == "developer":  # OpenAI's newer name for the system role
                m["role"] = "system"
            # text only, refused here: mlx_lm.server would first fetch an image's URL
            content = m.get("content")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text" or not isinstance(part.get("text"), str):
                    where = f"messages.{i}.content.{j}"
                    raise ApiError(400, f"{where}: only text parts ({{'type': 'text', 'text': "
                                        f"...}}) are supported, not {kind!r}", param=where)

    def _check_limits(self, body: dict, token_fields):
        """What the table cannot know: max_tokens against --max-tokens-limit,
        top_k against the model's vocabulary."""
        rg = self.response_generator
        limit = rg.cli_args.max_tokens_limit
        for name in token_fields:
            if body.get(name, 0) > limit:
                raise ApiError(400, f"{name} must be in 1..{limit} (--max-tokens-limit), not "
                                    f"{body[name]}", param=name)
        if body.get("top_k") is not None:
            try:
                checks.top_k(body["top_k"], rg.model_provider.model.vocab_size)
            except ValueError as e:
                raise ApiError(400, str(e), param="top_k") from None

    # -- routes -------------------------------------------------------------------------------
    def do_POST(self):
        try:
            style = "anthropic" if self.path.startswith("/v1/messages") else "openai"
            self._authorize()
            if self.path in ("/v1/messages", "/v1/messages/count_tokens"):
                body = self._read_json()
                with self.response_generator.slot():
                    return self.handle_messages(body,
                                                count_only=self.path.endswith("count_tokens"))
            if self.path not in self.routes:
                raise ApiError(404, f"no endpoint {self.path}", code="not_found")
            body = self._read_json()
            self._check(body, self.routes[self.path])
            hand_body_to(self, body)  # mlx_lm's handler parses it again from here on
            super().do_POST()
        except ApiError as e:
            self.send_api_error(e, style)
        except (BrokenPipeError, ConnectionResetError):
            logging.info("%s %s: the client disconnected", self.command, self.path)

    def do_GET(self):
        if self.path == "/health":  # open, for supervisors and load balancers
            return super().do_GET()
        try:
            self._authorize()
        except ApiError as e:
            return self.send_api_error(e)
        if self.path.startswith("/v1/models"):
            return super().do_GET()
        self.send_api_error(ApiError(404, f"no endpoint {self.path}", code="not_found"))

    def validate_model_parameters(self):
        # mlx_lm's check wants an int; "auto" and None (the server's default) are ours
        validate_depth(self, super().validate_model_parameters)

    def handle_completion(self, request, stop_words):
        rg = self.response_generator
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(rg.slot())
                rg.preflight(request, self.chat_template_kwargs, self.max_tokens)
            except ApiError as e:
                return self.send_api_error(e)
            # the generation thread counts into these (`_prepare`); `usage` reports them
            self.stats = request.mtp_stats = MTPStats()
            if not self.stream:  # (a streamed one finds out when a write fails)
                held.callback(_ClientWatch(self.connection, request).close)
            super().handle_completion(request, stop_words)  # answers its own errors

    def handle_models_request(self):
        mp = self.response_generator.model_provider
        self._send_json(200, {"object": "list", "data": [
            {"id": mp.served_id, "object": "model", "created": self.created,
             "owned_by": "mlx_mtp"}]})

    # -- usage with MTP statistics ------------------------------------------------------------
    def _mtp_usage(self, response: dict) -> dict:
        stats = self.stats
        if stats is not None and "usage" in response:
            response["usage"]["mtp"] = {
                "drafted": stats.drafted, "accepted": stats.accepted,
                "acceptance": [round(a, 4) for a in stats.acceptance],
                "tokens_per_cycle": round(stats.tokens_per_cycle, 4), "cycles": stats.cycles}
        return response

    def generate_response(self, *args, **kwargs):
        return self._mtp_usage(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args, **kwargs):
        return self._mtp_usage(super().completion_usage_response(*args, **kwargs))

    # -- Anthropic Messages -------------------------------------------------------------------
    def _write_event(self, kind: str, data: dict):
        self.wfile.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def handle_messages(self, body: dict, count_only: bool = False):
        rg = self.response_generator
        cli = rg.cli_args
        schema = anthropic.REQUEST_SCHEMA
        if count_only:  # count_tokens: no max_tokens
            schema = dict(schema, required=["model", "messages"])
        validate(body, schema, "anthropic")
        if not rg.model_provider.serves(body["model"]):
            raise ApiError(404, f"the model {body['model']!r} is not served here",
                           code="model_not_found")
        self._check_limits(body, ("max_tokens",))
        try:
            messages, tools, stop_words, template_args = anthropic.to_chat(body)
        except anthropic.RequestError as e:
            raise ApiError(400, str(e)) from None
        request = CompletionRequest("chat", "", messages, tools, None)
        max_tokens = body.get("max_tokens", 1)
        prompt = rg.preflight(request, template_args, max_tokens)
        if count_only:
            return self._send_json(200, {"input_tokens": len(prompt)})
        # the fields the Messages API does not have take mlx_lm.server's defaults
        args = generation_arguments(
            **NEUTRAL, model="default_model", draft="default_model",
            temperature=body.get("temperature", cli.temp), top_p=body.get("top_p", cli.top_p),
            top_k=body.get("top_k", cli.top_k), min_p=cli.min_p, stop_words=stop_words,
            max_tokens=max_tokens, chat_template_kwargs=template_args)
        stream = body.get("stream", False)

        def keepalive(done, total):
            if stream:
                self._write_event("ping", {"type": "ping"})

        watch = None if stream else _ClientWatch(self.connection, request)
        try:
            ctx, response = rg.generate(request, args, progress_callback=keepalive)
        except BaseException:
            if watch is not None:
                watch.close()
            raise
        tokenizer = rg.model_provider.tokenizer
        msg = anthropic.Message(body["model"], len(ctx.prompt), max(ctx.prompt_cache_count, 0),
                                ctx.tool_parser if ctx.has_tool_calling else None, tools)
        if stream:
            self._set_stream_headers(200)
            self.end_headers()
            self._write_event(*msg.start_event())
        state = ctx.text_sm.make_state(ctx.initial_state)
        tokens, finish = [], "stop"
        try:
            for gen in response:
                state, segments = text_segments(state, gen.text, gen.finish_reason)
                for kind, text in segments:
                    msg.feed(kind, text)
                tokens.append(gen.token)
                if gen.finish_reason is not None:
                    finish = gen.finish_reason
                if stream:
                    for event in msg.events():
                        self._write_event(*event)
        finally:
            ctx.stop()
            if watch is not None:
                watch.close()
        stop_sequence = None
        if finish == "stop" and tokens and tokens[-1] not in tokenizer.eos_token_ids:
            tail = tokenizer.decode(tokens)
            stop_sequence = max((s for s in stop_words if tail.endswith(s)), key=len,
                                default=None)
        msg.finish(finish, stop_sequence, len(tokens))
        if stream:
            for event in msg.events():
                self._write_event(*event)
        else:
            self._send_json(200, msg.response())


def _not_json(name: str):
    """json.loads' parse_constant: NaN and Infinity are not JSON (RFC 8259)."""
    raise ValueError(f"{name} is not a JSON number")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        kind, e = sys.exc_info()[:2]
        if kind in (BrokenPipeError, ConnectionResetError):
            logging.info("%s: the client disconnected", client_address[0])
        else:
            logging.error("%s: %s: %s", client_address[0], kind.__name__, e)
