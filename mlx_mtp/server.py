"""`python -m mlx_mtp.server`: an OpenAI- and Anthropic-compatible server
that decodes with the model's MTP head.

It is mlx_lm's server (`mlx_lm.server`: the standard library's threaded HTTP
server, its request parsing and validation, chat templates, tool-call and
reasoning handling, response and SSE building, the single generation thread)
with three subclasses:

- `MTPModelProvider` loads with `mlx_mtp.load` and serves that one model;
- `MTPResponseGenerator` decodes requests together in batches (loop.py's
  `Batch`: one trunk forward per cycle, each row accepting its own drafts;
  rows join and leave between cycles, each sampling with its own settings;
  a request differing in what a batch shares waits for it to drain),
  with a prefix cache: mlx_lm's `LRUPromptCache`, bounded by entries and
  bytes, with snapshots where a recurrent state can be restored exactly (the end of the
  system prompt, of the last user message, of the prompt, of each answer);
  GDN states cannot be trimmed, so only an exact stored prefix is ever reused;
- `MTPAPIHandler` checks requests before mlx_lm's handler sees them (JSON
  schemas, context length, API key, a bounded queue) and answers errors
  with OpenAI's error object; it adds MTP statistics to `usage` and serves
  `POST /v1/messages` (Anthropic Messages, anthropic.py).

At temperature 0 the text equals mlx_lm.server's for the same request
(tests/test_server.py runs both as processes). See docs/design.md, "Server".

Under `mlx.launch` (a model sharded with `sharded_load`, `--pipeline` as in
mlx_lm.server) rank 0 serves HTTP and every rank runs the generation loop in
lockstep; what only rank 0 knows reaches the others through `_tick`
(docs/distributed.md, "The server over ranks").
"""

from __future__ import annotations

import _thread
import argparse
import contextlib
import copy
import functools
import gc
import itertools
import json
import logging
import os
import select
import signal
import socket
import sys
import threading
import warnings
from http.server import ThreadingHTTPServer
from pathlib import Path
from collections import deque
from queue import Empty as QueueEmpty, Queue
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Optional

import jsonschema
import mlx.core as mx

from . import anthropic, params
from .mlx_lm_compat import (NEUTRAL, APIHandler, CompletionRequest, GenerationContext,
                            LRUPromptCache, ModelProvider, Response, ResponseGenerator,
                            format_top_logprobs, generation_arguments, generation_stream,
                            hand_body_to, logits_processors_for, parse_size, run_http_server,
                            text_segments, validate_depth, xtc_special_tokens)
from .distributed import sharded_load, trunk_length
from .loader import CheckpointError, load
from . import checks
from .checks import depth as parse_depth
from .batch import MTPStats
from .sampling import PENALTY_KINDS, Penalties, RowSampling, make_sampler

MAX_BODY = 64 << 20  # bytes
# sharded, rank 0's news (requests, clients gone) reaches the other ranks every
# this many cycles: each `_tick` is a round of collectives and a host sync
SHARDED_TICK_CYCLES = 4

# -- request schemas: the fields mlx_lm.server reads, and OpenAI fields a client
# may send that do not change the output here; anything else is refused. The
# numeric ones (ranges, 'auto', null) are made from the table in params.py.
_NUMBER = {"type": "number"}
_COMMON = {
    **params.schema("openai"),
    "model": {"type": "string"},
    "stream": {"type": "boolean"},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"}}},
    "stop": {"type": ["string", "array", "null"], "items": {"type": "string"}},
    "logit_bias": {"type": ["object", "null"], "additionalProperties": _NUMBER},
    "logprobs": {"type": "boolean"},
    "n": {"const": 1},
    "user": {"type": "string"},
    "metadata": {}, "store": {}, "service_tier": {},
}
_MESSAGE = {
    "type": "object", "required": ["role"],
    "properties": {"role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                   "content": {"type": ["string", "array", "null"]},
                   "name": {"type": "string"}, "tool_calls": {"type": "array"},
                   "tool_call_id": {"type": "string"}, "reasoning_content": {},
                   "reasoning": {}, "refusal": {}},
    "additionalProperties": False,
}
CHAT_SCHEMA = {
    "type": "object", "required": ["messages"],
    "properties": dict(_COMMON, messages={"type": "array", "minItems": 1, "items": _MESSAGE},
                       tools={"type": ["array", "null"], "items": {"type": "object"}},
                       tool_choice={}, parallel_tool_calls={}, response_format={},
                       reasoning_effort={}, chat_template_kwargs={"type": ["object", "null"]},
                       role_mapping={"type": ["object", "null"]}),
    "additionalProperties": False,
}
COMPLETION_SCHEMA = {
    "type": "object", "required": ["prompt"],
    "properties": dict(_COMMON, prompt={"type": "string", "minLength": 1}, echo={"const": False},
                       suffix={"type": "null"}, best_of={"const": 1}),
    "additionalProperties": False,
}


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


class ApiError(Exception):
    """A request answered with an error: HTTP status, OpenAI error type, message."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def openai(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}

    def anthropic(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 503: "overloaded_error"}.get(self.status, "api_error")
        return anthropic.error_body(kind, str(self))


def _schema_error(e: jsonschema.ValidationError) -> ApiError:
    where = ".".join(str(p) for p in e.absolute_path) or None
    if e.validator == "additionalProperties":
        extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
        where = ".".join([*(str(p) for p in e.absolute_path), extra[0]]) if extra else where
        return ApiError(400, f"unknown field {where!r}", param=where)
    message = e.message if where is None else f"{where}: {e.message}"
    return ApiError(400, message, param=where)


def validate(body: dict, schema: dict, surface: str):
    """The request body against its JSON schema (jsonschema); a field of the
    parameter table (params.py) is refused in the table's words (name, value,
    what is allowed). surface: "openai" or "anthropic"."""
    error = jsonschema.exceptions.best_match(params.Validator(schema).iter_errors(body))
    if error is None:
        return params.coerce(surface, body)
    path = list(error.absolute_path)
    if path and isinstance(path[0], str):
        message = params.refusal(surface, path[0], body.get(path[0]))
        if message is not None:
            raise ApiError(400, message, param=path[0])
    raise _schema_error(error)


# -- model -----------------------------------------------------------------------------------
class MTPModelProvider(ModelProvider):
    """Loads with mlx_mtp.load (the MTP head attached) and serves that model only."""

    def __init__(self, cli_args, served_id: str):
        super().__init__(cli_args)
        self.served_id = served_id

    def serves(self, name: Optional[str]) -> bool:
        return name in (None, "default_model", self.served_id, self.cli_args.model,
                        Path(self.cli_args.model).name)

    def load(self, model_path, adapter_path=None, draft_model_path=None):
        if not self.serves(model_path):
            raise ApiError(404, f"the model {model_path!r} is not served here (serving "
                                f"{self.served_id!r})", code="model_not_found")
        return super().load("default_model", None, None)

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        self.reset()
        mx.clear_cache()
        if self.is_distributed:  # under mlx.launch: this rank's share (mlx_lm's groups)
            if self.cli_args.draft_model is not None:
                raise ValueError("--draft-model is not supported on a sharded model")
            model, tokenizer = sharded_load(model_path, self.pipeline_group, self.tensor_group,
                                            tokenizer_config=self._tokenizer_config)
        else:
            model, tokenizer = load(model_path, tokenizer_config=self._tokenizer_config,
                                    draft=self.cli_args.draft_model)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer = model, tokenizer
        self.processor, self.draft_model, self.is_batchable = None, None, False

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.text_args, "max_position_embeddings", 0) or 1 << 30)


# -- generation ---------------------------------------------------------------------------------
class MTPGenerationContext(GenerationContext):
    stats: Optional[MTPStats] = None  # filled as the generation runs


def _sampler(args, tokenizer):
    """mlx_lm.server's sampler settings, as an MTPSampler (Leviathan–Chen acceptance)."""
    s = args.sampling
    return make_sampler(s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k,
                        xtc_probability=s.xtc_probability, xtc_threshold=s.xtc_threshold,
                        xtc_special_tokens=xtc_special_tokens(tokenizer))


class MTPResponseGenerator(ResponseGenerator):
    """mlx_lm's generation thread, decoding requests in MTP batches (`_Lane`)."""

    def __init__(self, model_provider, prompt_cache):
        a = model_provider.cli_args
        self._slots = threading.Semaphore(max(1, a.decode_concurrency) + a.max_queued_requests)
        self._row_ids = itertools.count()  # the same ids on every rank (rows join in lockstep)
        self._halted = False  # the generation loop ends: rank 0's word (see `_tick`)
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    @contextlib.contextmanager
    def slot(self):
        """One of the requests being answered or waiting; 503 past the bound."""
        if not self._slots.acquire(blocking=False):
            raise ApiError(503, "the server is busy: too many requests are waiting; retry "
                                "later", kind="server_error", code="overloaded")
        try:
            yield
        finally:
            self._slots.release()

    def preflight(self, request, chat_template_kwargs, max_tokens: int) -> list:
        """Checks made in the request's own thread before it is queued: the
        server can take it, the prompt renders and fits the context."""
        if not self.generation_available():
            raise ApiError(503, "the generation thread stopped; restart the server",
                           kind="server_error")
        mp = self.model_provider
        try:
            # kept on the request: the generation thread then does not render it again
            request.mtp_tokenized = self._tokenize(mp.tokenizer, request, SimpleNamespace(
                chat_template_kwargs=chat_template_kwargs))
            request.mtp_kwargs = chat_template_kwargs
            prompt = request.mtp_tokenized[0]
        except ApiError:
            raise
        except Exception as e:  # the chat template refused the messages
            raise ApiError(400, f"the chat template cannot render these messages: {e}") from None
        if not prompt:
            raise ApiError(400, "the prompt is empty")
        if len(prompt) + max_tokens > mp.context_length:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens and max_tokens is "
                                f"{max_tokens}: more than the model's context of "
                                f"{mp.context_length} tokens", code="context_length_exceeded")
        return prompt

    def _depth(self, args):
        return self.cli_args.draft_tokens if args.num_draft_tokens is None else \
            parse_depth(args.num_draft_tokens)

    # -- the generation thread ------------------------------------------------------------
    def _generate(self):
        """mlx_lm's generation thread, batching with MTP: every request joins one
        `Batch` (rows sample each with its own settings; those with logits
        processors run them on the host); requests arriving together are
        prefilled together. Only a request that cannot share the batch (another
        draft depth, sampled rows' top_k) waits until it drains."""
        self.model_provider.load_default()
        if self._is_distributed:  # rows without a seed draw the same keys on every rank
            mx.random.seed(mx.distributed.all_sum(mx.random.state[0]).view(mx.uint64).item())
        lane: Optional[_Lane] = None
        waiting: deque = deque()  # (request, row settings), in arrival order
        width = max(1, self.cli_args.decode_concurrency)
        prompts = max(1, self.cli_args.prompt_concurrency)
        while not self._halted:
            busy = lane is not None and bool(lane.rows)
            if not (busy and self._is_distributed and lane.cycles % SHARDED_TICK_CYCLES):
                while True:  # take every request that is waiting before the next cycle
                    request = self._tick(None if busy or waiting else 0.1, lane)
                    if request is None:
                        break
                    try:
                        waiting.append((request, _Settings.of(self, request[2])))
                    except Exception as e:
                        _Lane._fail(request[0], e)
                    if self._is_distributed:  # one request per tick on every rank
                        break
            joining = []
            while waiting and len(joining) < prompts:
                request, settings = waiting[0]
                if not busy and not joining and (lane is None or not lane.accepts(
                        settings, len(joining), width)):
                    try:
                        lane = _Lane(self, settings)
                    except Exception as e:  # e.g. settings the sampler refuses
                        waiting.popleft()
                        _Lane._fail(request[0], e)
                        continue
                if lane is None or not lane.accepts(settings, len(joining), width):
                    break  # in order: it waits for the batch to drain (or for room)
                joining.append(waiting.popleft())
            if joining:
                lane.join(joining)
                continue
            if busy:
                lane.step()
                if lane.batch is None:
                    lane = None
        self.model_provider.reset()
        del self.prompt_cache
        gc.collect()

    def _tick(self, timeout, lane: Optional[_Lane]):
        """mlx_lm's `_next_request`, with what only rank 0 knows riding along:
        the rows whose client left (they finish) and a shutdown. Sharded, every
        rank acts on rank 0's word at the same point of the loop, so rows
        leave every rank's batch in the same cycle (docs/distributed.md)."""
        rows = list(lane.rows.values()) if lane is not None else []
        request, news = None, None
        if self._rank == 0:
            try:
                request = (self.requests.get_nowait() if timeout is None
                           else self.requests.get(timeout=timeout))
            except QueueEmpty:
                pass
            left = [row.rid for row in rows if row.ctx._should_stop]
            if request is not None or left or self._stop:
                news = (None if request is None else request[1:], left, self._stop)
        news = self._share_object(news)  # (one process: as it is)
        if news is None:
            return None
        shared, left, self._halted = news
        for row in rows:
            row.left = row.left or row.rid in left
        if shared is None:
            return None
        if self._halted:  # not started: it would hold up the shutdown by a prefill
            if request is not None:
                _Lane._fail(request[0], ApiError(503, "the server is shutting down",
                                                 kind="server_error"))
            return None
        return (request[0] if request is not None else Queue(), *shared)

    def _fetch(self, key, tokens: list):
        """The longest stored prefix of `tokens`: a copy of its cache (or
        None) and its length. Sharded, each rank keeps its own store (each
        bounded on its own share), so the ranks settle on a prefix all of
        them hold, shortening until they agree (0 at worst)."""
        n = len(tokens)
        while True:
            cache, rest = (self.prompt_cache.fetch_nearest_cache(key, tokens[:n]) if n
                           else (None, []))
            got = n - len(rest)
            if not self._is_distributed:
                return cache, got
            high, low = mx.distributed.all_max(mx.array([got, -got])).tolist()
            if high == -low:
                return cache, got
            n = -low

    def _run_generate(self):
        if not self._is_distributed:
            return super()._run_generate()
        try:
            with mx.stream(generation_stream):  # collectives on one stream: one order on all ranks
                self._generate()
        except Exception as e:  # a peer left (its own line says why), or this rank failed
            self._generation_failed = True
            logging.error("generation stopped: %s: %s", type(e).__name__, e)
            if self._rank == 0 and not self._stop:  # a sharded model cannot serve
                _thread.interrupt_main()  # without all its ranks


@dataclass(frozen=True)
class _Settings:
    """How a request decodes: what its batch must share (the depth), and its
    own row settings (mlx_lm's sampler, XTC included, as in-graph arrays)."""

    depth: object
    sampling: RowSampling
    processors: tuple  # mlx_lm's processors, on the host: what is not in-graph

    @classmethod
    def of(cls, gen: "MTPResponseGenerator", args) -> "_Settings":
        lg = args.logits
        depth = gen._depth(args)
        sampler = _sampler(args, gen.model_provider.tokenizer)
        penalties = Penalties.of(**{f"{kind}_{part}": getattr(lg, f"{kind}_{part}")
                                    for kind in PENALTY_KINDS
                                    for part in ("penalty", "context_size")})
        sampling = RowSampling.of(sampler, lg.logit_bias, penalties)  # (an MTPSampler: never None)
        # the logit bias (and penalties) are applied in-graph
        in_graph = {f"{kind}_penalty": 0.0 for kind in PENALTY_KINDS} if penalties else {}
        args = replace(args, logits=replace(lg, logit_bias=None, **in_graph))
        processors = tuple(logits_processors_for(args))
        return cls(depth, sampling, processors)


@dataclass
class _RowState:
    """A request's side of a batch row: its queue, context and text state."""

    rid: int
    rqueue: object
    ctx: MTPGenerationContext
    args: object
    cache: list
    key_tokens: list
    matcher: object
    detokenizer: object
    n: int = 0
    left: bool = False  # its client went away (rank 0's word, `_tick`)


class _Lane:
    """The batch requests decode in (see `_generate`); a new one starts when a
    request cannot share the present one and it has drained."""

    def __init__(self, gen: MTPResponseGenerator, settings: _Settings):
        from .batch import make_batch

        self.gen, self.depth = gen, settings.depth
        self.batch = make_batch(gen.model_provider.model, draft_tokens=settings.depth,
                                max_draft_tokens=gen.cli_args.max_draft_tokens)
        self.batch.limit_prefill(gen.cli_args.prompt_concurrency)
        self.rows: dict = {}  # Row -> _RowState
        self.cycles = 0

    def accepts(self, settings: _Settings, joining: int, width: int) -> bool:
        """A request with these settings can join now (`joining` already will)."""
        return (self.batch is not None and settings.depth == self.depth
                and self.batch.accepts(settings.sampling)
                and len(self.rows) + joining < width)

    def join(self, requests: list):
        """Prefill the requests' new tokens together (each from its nearest
        stored prefix, snapshots stored at its message boundaries) and add them
        as rows; their first tokens come with the next cycle."""
        gen = self.gen
        collectives = gen._is_distributed
        joined = []
        for (rqueue, request, args), settings in requests:
            rid = next(gen._row_ids)
            try:
                joined.append(self._prepare(rid, rqueue, request, args, settings))
            except Exception as e:
                self._fail(rqueue, e)
                if collectives:  # this rank may have left the others inside a collective
                    raise
        if not joined:
            return
        try:
            with mx.stream(generation_stream):
                rows = self.batch.add([r for r, _ in joined], gen.cli_args.prefill_step_size)
        except Exception as e:
            for _, state in joined:
                self._fail(state.rqueue, e)
            if collectives:
                raise
            return
        for row, (_, state) in zip(rows, joined):
            if row is None:  # (max_tokens is at least 1 here)
                continue
            self.rows[row] = state

    def _prepare(self, rid, rqueue, request, args, settings: _Settings):
        """One request's Request (for Batch.add) and its row state."""
        gen, mp = self.gen, self.gen.model_provider
        model, tokenizer, key = mp.model, mp.tokenizer, mp.model_key
        tokenized = getattr(request, "mtp_tokenized", None)
        if tokenized is None or args.chat_template_kwargs != getattr(request, "mtp_kwargs", None):
            tokenized = gen._tokenize(tokenizer, request, args)
        prompt, segments, kinds, initial_state, _ = tokenized
        stop_sequences, text_sm = gen._make_state_machine(key, tokenizer, args.stop_words)
        # an exact stored prefix (GDN states cannot be cut back), leaving at
        # least the last prompt token to run
        cache, n = gen._fetch(key, prompt[:-1])
        ctx = MTPGenerationContext(
            has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser, text_sm=text_sm,
            initial_state=initial_state, prompt=prompt, prompt_cache_count=n)
        stats = getattr(request, "mtp_stats", None)  # the handler's (`handle_completion`)
        ctx.stats = MTPStats() if stats is None else stats
        request.mtp_ctx = ctx  # (a non-streamed request's client may leave: _ClientWatch)
        rqueue.put(ctx)
        if cache is None:
            cache = model.make_cache()
        stops, kinds_at = _snapshot_points(prompt, segments, kinds, n,
                                           gen.cli_args.prompt_snapshots)

        def snapshot(done):
            gen.prompt_cache.insert_cache(key, prompt[:n + done], copy.deepcopy(cache),
                                          cache_type=kinds_at[done])

        r = self.batch.prepare(
            prompt[n:], cache, args.max_tokens, args.seed, gen.cli_args.prefill_step_size,
            sampler=settings.sampling, logits_processors=settings.processors, stats=ctx.stats,
            progress=lambda done, total: rqueue.put((n + done, n + total)),
            cached_tokens=prompt[:n],  # penalties count the cached prefix, as mlx_lm.server's
            stop_tokens=tokenizer.eos_token_ids,
            feed_tail=False)  # the cache as it stands when the row leaves: no forward then
        r.stops, r.snapshot = stops, snapshot
        state = _RowState(rid, rqueue, ctx, args, cache, prompt[:],
                          stop_sequences.matcher(), tokenizer.detokenizer)
        return r, state

    def step(self):
        """One cycle for every row; each row's tokens go to its request."""
        self.cycles += 1
        try:
            with mx.stream(generation_stream):
                for event in self.batch.step():
                    state = self.rows.get(event.row)
                    if state is not None:
                        self._emit(event, state)
        except Exception as e:  # every row of the batch is lost: tell each request
            for state in self.rows.values():
                self._fail(state.rqueue, e)
            self.rows.clear()
            self.batch = None  # the generation thread starts a new lane
            if self.gen._is_distributed:  # (sharded: this rank may be out of step)
                raise

    def _emit(self, event, state: _RowState):
        """Send one token (as mlx_lm.server's responses are built). The batch
        ends a row at EOS or max_tokens; a stop sequence or a client that left
        ends it here."""
        tokenizer = self.gen.model_provider.tokenizer
        token, finish = event.token, event.finish
        if finish != "stop":  # EOS is not text
            state.detokenizer.add_token(token)
        if state.matcher.advance(token):
            finish = "stop"
        if finish is not None:
            state.detokenizer.finalize()
        top = state.args.top_logprobs
        state.rqueue.put(Response(
            state.detokenizer.last_segment, token, event.logprob, finish,
            format_top_logprobs(event.logprobs, top, tokenizer) if top > 0 else ()))
        state.key_tokens.append(token)
        if finish is None and not state.left:
            return
        del self.rows[event.row]
        state.rqueue.put(None)
        if not event.row.done:
            with mx.stream(generation_stream):
                self.batch.finish(event.row)
        model = self.gen.model_provider.model
        held = trunk_length(state.cache, model)
        self.gen.prompt_cache.insert_cache(self.gen.model_provider.model_key,
                                           state.key_tokens[:held], state.cache)

    @staticmethod
    def _fail(rqueue, e: Exception):
        if not isinstance(e, ApiError):
            logging.error("generation failed: %s: %s", type(e).__name__, e)
        rqueue.put(e)


def _snapshot_points(prompt: list, segments: list, kinds: list, cached: int, mode: str):
    """Where the prefill stores copies of the cache (counts of the new tokens,
    after the `cached` ones), and each one's kind: the end of every segment
    (system prompt, last user message) and of the prompt but its last token,
    so a later request sharing that prefix (the next turn, a regenerated
    answer) starts from it exactly. mode "end": none (only the answers)."""
    if mode != "segments":
        return (), {}
    points, end = {}, 0
    for segment, kind in zip(segments, kinds):
        end += len(segment)
        at = min(end, len(prompt) - 1) - cached
        if at > 0:
            points[at] = kind
    return tuple(sorted(points)), points


# -- HTTP --------------------------------------------------------------------------------------
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


# -- CLI ----------------------------------------------------------------------------------------
REFUSED = {"adapter_path": "--adapter-path (adapters)", "kv_bits": "--kv-bits (a quantized "
           "KV cache)"}


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's flags (same names and defaults), plus the MTP ones; the
    numeric ones are range-checked by the table in params.py (a bad value:
    one `error:` line, exit 2). See also `parse_args`."""
    flag = functools.partial(params.flag, surface="server")
    p = argparse.ArgumentParser(prog="python -m mlx_mtp.server",
                                description="OpenAI/Anthropic-compatible server with MTP decoding")
    p.add_argument("--model", type=str, default=None,
                   help="model folder or Hugging Face repo (default: the embedded demo model)")
    p.add_argument("--host", type=str, default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=flag("port"), default=8080)
    p.add_argument("--allowed-origins", type=lambda x: x.split(","), default="*",
                   help="comma-separated CORS origins (default: *)")
    p.add_argument("--api-key", type=str, default=None,
                   help="require 'Authorization: Bearer KEY' (or x-api-key) on every request")
    p.add_argument("--draft-tokens", "--num-draft-tokens", dest="draft_tokens",
                   type=flag("draft_tokens"), default="auto",
                   help="MTP draft depth, or 'auto' (default)")
    p.add_argument("--max-draft-tokens", type=flag("max_draft_tokens"), default=4,
                   help="largest depth 'auto' tries")
    p.add_argument("--draft-model", type=str, default=None, metavar="FOLDER",
                   help="a folder holding an MTP head for a trunk without one (mlx-vlm's "
                        "split drafter, or mtp.* files with their config)")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", type=str, default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    p.add_argument("--chat-template", type=str, default="")
    p.add_argument("--use-default-chat-template", action="store_true")
    p.add_argument("--temp", type=flag("temp"), default=0.0, help="default sampling temperature")
    p.add_argument("--top-p", type=flag("top_p"), default=1.0)
    p.add_argument("--top-k", type=flag("top_k"), default=0)
    p.add_argument("--min-p", type=flag("min_p"), default=0.0)
    p.add_argument("--max-tokens", type=flag("max_tokens"), default=512,
                   help="tokens to generate when a request does not say")
    p.add_argument("--max-tokens-limit", type=flag("max_tokens_limit"), default=32768,
                   help="the most tokens a request may ask for")
    p.add_argument("--chat-template-args", type=json.loads, default="{}",
                   help="JSON of chat template arguments, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--prefill-step-size", type=flag("prefill_step_size"), default=2048)
    p.add_argument("--prompt-cache-size", type=flag("prompt_cache_size"), default=10,
                   help="prompt cache entries kept (least recently used dropped first)")
    p.add_argument("--prompt-cache-bytes", type=parse_size, default=None,
                   help="prompt cache size limit, e.g. 8GB")
    p.add_argument("--prompt-snapshots", choices=["segments", "end"], default="segments",
                   help="cache snapshots at message boundaries too (default), or only after "
                        "each answer")
    p.add_argument("--max-queued-requests", type=flag("max_queued_requests"), default=32,
                   help="requests that may wait while a full batch (--decode-concurrency) "
                        "decodes; more get 503")
    p.add_argument("--decode-concurrency", type=flag("decode_concurrency"), default=32,
                   help="requests decoded together at most (one batch)")
    p.add_argument("--prompt-concurrency", type=flag("prompt_concurrency"), default=8,
                   help="prompts prefilled together at most (requests arriving at once)")
    # mlx_lm.server flags without effect here
    p.add_argument("--kv-group-size", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--quantized-kv-start", type=int, default=0, help=argparse.SUPPRESS)
    # mlx_lm.server flags mlx_mtp refuses
    p.add_argument("--adapter-path", type=str, default=None, help=argparse.SUPPRESS)
    p.add_argument("--kv-bits", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers over the ranks (pipeline "
                        "parallel) instead of sharding each layer (tensor parallel)")
    return p


def _interrupt(signum, frame):
    """The first SIGINT/SIGTERM shuts down cleanly (mlx_lm's server loop closes
    HTTP and joins the generation thread, which stops the other ranks); a
    second one exits at once."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: os._exit(128 + signum))
    raise KeyboardInterrupt


def _follow(signum, frame):
    """Ranks other than 0 stop when rank 0 says so (a Ctrl-C reaches rank 0
    too); if rank 0 cannot say it within a grace period, they exit anyway."""
    timer = threading.Timer(RANK_GRACE_S, lambda: os._exit(128 + signum))
    timer.daemon = True
    timer.start()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


RANK_GRACE_S = 30


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, each in its range (build_parser), and --max-tokens within
    --max-tokens-limit: a mistake is one `error:` line and exit 2."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_tokens > args.max_tokens_limit:
        p.error(f"--max-tokens ({args.max_tokens}) must be at most --max-tokens-limit "
                f"({args.max_tokens_limit})")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    group = mx.distributed.init()
    rank = group.rank() if group.size() > 1 else None  # under mlx.launch
    where = "" if rank is None else f"rank {rank}: "
    logging.basicConfig(level=getattr(logging, args.log_level) if not rank else logging.WARNING,
                        format=f"%(asctime)s - {where}%(levelname)s - %(message)s")
    for name, what in REFUSED.items():
        if getattr(args, name):
            print(f"error: mlx_mtp.server does not support {what}", file=sys.stderr)
            return 2
    if args.pipeline and rank is None:
        logging.warning("--pipeline splits a model over mlx.launch ranks; in one process it "
                        "has no effect")
    # mlx_lm.server's request handler reads this one
    args.num_draft_tokens = None
    served_id = args.model or "mlx-mtp-demo"
    if args.model is None:
        from .loader import demo_model_path

        args.model = str(demo_model_path())
    provider = MTPModelProvider(args, served_id)
    try:
        provider.load_default()  # here, so a bad model fails now with one line
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return _exit(1)
    except RuntimeError as e:  # under mlx.launch: another rank stopped (its line says why)
        if rank is None:
            raise
        print(f"error: {where}{e}", file=sys.stderr)
        return _exit(1)
    try:  # the default top_k, against the vocabulary (requests' are checked as they come)
        checks.top_k(args.top_k, provider.model.vocab_size, "--top-k")
    except ValueError as e:
        print(f"error: {where}{e}", file=sys.stderr)
        return _exit(2)
    cache = LRUPromptCache(args.prompt_cache_size, args.prompt_cache_bytes or 1 << 62)
    # (SIGINT is ignored in background jobs: set it, like SIGTERM, before the
    # generation thread starts, so no signal finds the process unprepared)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _follow if rank else _interrupt)
    generator = MTPResponseGenerator(provider, cache)
    if rank:  # the other ranks follow rank 0's generation loop, which tells them to stop
        generator.join()  # (or fails them with one line when rank 0 is gone)
        return _exit(1 if generator._generation_failed else 0)
    code = 0
    try:
        warnings.filterwarnings("ignore", message="mlx_lm.server is not recommended")
        if args.host not in ("127.0.0.1", "localhost", "::1") and args.api_key is None:
            logging.warning("serving on %s without --api-key: anyone who can reach the port "
                            "can use the model", args.host)
        run_http_server(args.host, args.port, generator, server_class=_HTTPServer,
                        handler_class=MTPAPIHandler)
    except OSError as e:  # the port is taken, the address is not this machine's
        print(f"error: cannot serve on {args.host}:{args.port}: {e.strerror or e}",
              file=sys.stderr)
        code = 1
        generator.stop_and_join()
    except KeyboardInterrupt:  # before serving began
        generator.stop_and_join()
    logging.info("stopped")
    if rank is not None and generator._generation_failed:  # sharded: a rank was lost
        code = 1
    return _exit(code)


def _exit(code: int):
    """HTTP is closed and the generation thread joined. Skip the interpreter's
    teardown: MLX's stream threads abort in it ("terminate called without an
    active exception", mlx_lm.server too)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # (mlx.launch, stopped by a Ctrl-C, closed them)
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
