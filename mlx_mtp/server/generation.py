"""The model provider and the generation thread: mlx_lm.server's
`ModelProvider` and `ResponseGenerator`, subclassed. The batch the requests
decode in is `lane.py`'s."""

from __future__ import annotations

import _thread
import contextlib
import copy
import gc
import itertools
import logging
import select
import socket
import threading
import time
from collections import deque
from pathlib import Path
from queue import Empty as QueueEmpty, Queue
from types import SimpleNamespace
from typing import Any, Callable, Optional

import mlx.core as mx

from ..cache import cache_length, check_model_cache
from ..checks import depth as parse_depth
from ..distributed import sharded_load
from ..loader import load
from ..mlx_lm_compat import CompletionRequest, ModelProvider, ResponseGenerator, generation_stream
from ..vision import ImageLimits
from . import prompt_points
from .images import reader_for
from .lane import _Lane, _Settings, extras
from .logprobs import TokenText
from .roles import late_system_role, place_system
from .schemas import (ApiError, context_exceeded, generation_failed, most_chars, prompt_chars,
                      shutdown_error)

# sharded, rank 0's news (requests, clients gone) reaches the other ranks every
# this many cycles: each `_tick` is a round of collectives and a host sync
SHARDED_TICK_CYCLES = 4
MAX_BODY = 64 << 20  # bytes: the most --max-body-bytes 'auto' allows
BODY_SLACK = 1 << 20  # bytes of a body besides its prompt (fields, tools' schemas)
# bytes of JSON per token of context the body may take: real text takes 4 to
# 12 (escaped CJK, emoji); 128 leaves room for long whitespace tokens and more
JSON_BYTES_PER_TOKEN = 128
HANDLERS_GRACE_S = 5  # after the generation thread stops: handlers write their last events
# sharded, seconds a rank waits for the others beyond --shutdown-grace: a rank
# killed inside a pipeline send/recv leaves its peer's evaluation waiting for good
RANK_GRACE_S = 30


class Refused(BaseException):
    """A request the generation thread answered with an error before it
    started (its settings, a shutdown). A BaseException so that it passes
    mlx_lm's `handle_completion`, which would answer any Exception from
    `generate` as a 404 with a bare string; our handler answers `error`."""

    def __init__(self, error: ApiError):
        super().__init__(str(error))
        self.error = error


# -- model -----------------------------------------------------------------------------------
class MTPModelProvider(ModelProvider):
    """Loads with mlx_mtp.load (the MTP head attached) and serves that model only."""

    def __init__(self, cli_args, served_id: str):
        super().__init__(cli_args)
        self.served_id = served_id

    def serves(self, name: Optional[str]) -> bool:
        """Whether a request naming this model is served: any name (a client's
        own model id, e.g. Claude Code's "claude-sonnet-4-5"), or with
        --strict-model only this model's names."""
        if not getattr(self.cli_args, "strict_model", False):
            return True
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
                                            tokenizer_config=self._tokenizer_config,
                                            ngram_tables=self.cli_args.ngram_tables)
        else:
            model, tokenizer = load(model_path, tokenizer_config=self._tokenizer_config,
                                    draft=self.cli_args.draft_model,
                                    ngram_tables=self.cli_args.ngram_tables)
        if self.cli_args.use_default_chat_template and tokenizer.chat_template is None:
            tokenizer.chat_template = tokenizer.default_chat_template
        self.model_key = (model_path, None, None)
        self.model, self.tokenizer = model, tokenizer
        self.processor, self.draft_model, self.is_batchable = None, None, False
        # the longest token's text (special tokens included: a prompt's text
        # may spell them), bounding a prompt's tokens from below by its length
        self.max_token_chars = max(1, max(map(len, tokenizer.get_vocab())))
        self.token_text = TokenText(tokenizer)  # logprobs' token texts and bytes
        # the tokenizer's added tokens (a chat template's markers): text never
        # merges across them, so a rendered prefix ending in one is final
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.marker_ids = frozenset(added)
        self.marker_texts = tuple(sorted({str(getattr(t, "content", t)) for t in added.values()}))
        # where a system message after the conversation began goes (roles.py)
        self.late_system = late_system_role(tokenizer)
        # a request's images, read on the handler's thread (images.py)
        a = self.cli_args
        self.images = reader_for(model, tokenizer, ImageLimits(
            max_images=a.max_images, max_pixels=a.max_image_pixels, max_bytes=a.max_image_bytes,
            timeout=a.image_timeout))
        # structured output's tokenizer (llguidance walks the vocabulary: seconds at
        # 248K tokens), built in the background rather than on the first request
        threading.Thread(target=_warm_structured, args=(tokenizer, model.vocab_size),
                         daemon=True, name="mlx_mtp-llguidance").start()

    def check_cache(self, prompt_cache: list, length: int):
        """Raises unless a prompt cache (read from disk) is of this model's
        kinds and its trunk holds `length` tokens (on a rank whose layers
        are all GDN, which count no tokens, only its kinds are checked)."""
        model = self.model
        check_model_cache(prompt_cache, model)
        held = cache_length(prompt_cache, model.is_linear)
        if held != length and not all(model.is_linear):
            raise ValueError(f"it holds {held} tokens, not {length}")

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.text_args, "max_position_embeddings", 0) or 1 << 30)

    @property
    def body_limit(self) -> int:
        """The largest request body taken (--max-body-bytes; 'auto': 128
        bytes of JSON per token of the model's context plus 1 MiB, at most
        64 MiB). A larger one is refused from its Content-Length, before a
        byte of it is kept: reading and parsing a body costs about twice its
        size."""
        given = getattr(self.cli_args, "max_body_bytes", None)
        if given is not None:
            return given
        return min(MAX_BODY, BODY_SLACK + JSON_BYTES_PER_TOKEN * self.context_length)


def _warm_structured(tokenizer, vocab_size: int):
    try:
        from ..constraint import warm_up

        warm_up(tokenizer, vocab_size)
    except Exception as e:  # (a slow tokenizer: requests asking for structure get the error)
        logging.info("structured output's tokenizer was not built: %s", e)


class _OncePerProcess(logging.Filter):
    """Lets each of mlx_lm.server's warnings that it repeats on every
    request through once per process: "Received tools but model does not
    support tool calling" is logged by each render of a request with tools
    (a client sends its tools with every turn) on a template without tool
    calling; the tools still go to the template. A filter on the root
    logger, which mlx_lm logs to (`logging.warning`)."""

    REPEATED = ("Received tools but model does not support tool calling",)

    def __init__(self):
        super().__init__()
        self._lock = threading.Lock()
        self._seen: set = set()
        self._installed = False

    def install(self):
        if not self._installed:
            with self._lock:
                if not self._installed:
                    logging.getLogger().addFilter(self)
                    self._installed = True

    def filter(self, record: logging.LogRecord) -> bool:
        if not isinstance(record.msg, str):
            return True
        said = next((m for m in self.REPEATED if record.msg.startswith(m)), None)
        if said is None:
            return True
        with self._lock:
            first = said not in self._seen
            self._seen.add(said)
        return first


ONCE_PER_PROCESS = _OncePerProcess()


# -- generation ---------------------------------------------------------------------------------
class Slot:
    """A request's places among those generated or waiting (one per choice,
    OpenAI's `n`): given back once its generation ended (`release`, once),
    before its answer is written, so a client that sends its next request
    as soon as it reads the answer (an agent) finds the place free."""

    def __init__(self, slots: threading.Semaphore, count: int = 1):
        self._slots, self._held = slots, count

    def release(self):
        if self._held:
            self._slots.release(self._held)
            self._held = 0


class MTPResponseGenerator(ResponseGenerator):
    """mlx_lm's generation thread, decoding requests in MTP batches (`_Lane`)."""

    def __init__(self, model_provider, prompt_cache):
        a = model_provider.cli_args
        self._slots = threading.Semaphore(max(1, a.decode_concurrency) + a.max_queued_requests)
        self._row_ids = itertools.count()  # the same ids on every rank (rows join in lockstep)
        self._halted = False  # the generation loop ends: rank 0's word (see `_tick`)
        self.grace = getattr(a, "shutdown_grace", 0.0)
        self._deadline = None  # set by stop_and_join: in-flight requests may run until then
        self._inflight = 0  # requests being answered (`serving`)
        self._inflight_changed = threading.Condition()
        self.draining = False  # SIGTERM/SIGINT: no new requests; those in flight finish
        self.lane: Optional[_Lane] = None  # the latest (it sets it)
        super().__init__(model_provider, prompt_cache)  # starts the generation thread

    @contextlib.contextmanager
    def serving(self):
        """A request being answered, counted so that a shutdown waits for it;
        503 once the shutdown began."""
        with self._inflight_changed:
            if self.draining:
                raise ApiError(503, "the server is shutting down", kind="server_error",
                               code="server_shutdown")
            self._inflight += 1
        try:
            yield
        finally:
            with self._inflight_changed:
                self._inflight -= 1
                self._inflight_changed.notify_all()

    def stop_and_join(self):
        """The shutdown (mlx_lm's server loop calls it on SIGINT/SIGTERM, once
        HTTP stopped accepting): requests in flight get --shutdown-grace
        seconds to finish; then each one still running is ended with an error
        its client's protocol reads (`_end`), and the handlers get a moment to
        write it."""
        with self._inflight_changed:
            self.draining = True
            n = self._inflight
        if n:
            logging.info("shutting down: %d requests in flight get up to %g s to finish", n,
                         self.grace)
        self._deadline = time.monotonic() + self.grace
        self._stop = True
        self._generation_thread.join(self.grace + RANK_GRACE_S if self._is_distributed else None)
        if self._generation_thread.is_alive():  # (its evaluation waits on a rank that is gone)
            self._generation_failed = True
            logging.error("generation stopped: the other ranks did not answer within %g s of "
                          "the shutdown (a rank was lost)", self.grace + RANK_GRACE_S)
            return
        with self._inflight_changed:
            self._inflight_changed.wait_for(lambda: self._inflight == 0, HANDLERS_GRACE_S)

    def generate(self, request, generation_args, progress_callback=None):
        """mlx_lm's `generate`: (context, responses). An error before the
        generation starts is `Refused`."""
        try:
            return super().generate(request, generation_args, progress_callback)
        except ApiError as e:
            raise Refused(e) from None
        except (TypeError, ValueError) as e:  # a setting the sampler or the batch refused
            raise Refused(ApiError(400, str(e))) from None
        except Exception as e:  # (the generation thread stopped)
            raise Refused(generation_failed(e, 500 if self.generation_available() else 503)
                          ) from None

    @contextlib.contextmanager
    def slot(self, count: int = 1):
        """`count` places among the requests being generated or waiting (a
        `Slot`); 503 past the bound."""
        taken = 0
        while taken < count and self._slots.acquire(blocking=False):
            taken += 1
        if taken < count:
            if taken:
                self._slots.release(taken)
            raise ApiError(503, "the server is busy: too many requests are waiting; retry "
                                "later", kind="server_error", code="overloaded")
        held = Slot(self._slots, count)
        try:
            yield held
        finally:
            held.release()

    def preflight(self, request, chat_template_kwargs, max_tokens: int,
                  check_context: bool = True, count_only: bool = False) -> list:
        """Checks made in the request's own thread before it is queued: the
        server can take it, the prompt renders and (`check_context`) fits
        the context with max_tokens, its images' tokens counted. Returns the
        prompt as the model reads it (each image's pads expanded).
        `count_only`: the prompt is only counted (no snapshot points)."""
        if not self.generation_available():
            raise ApiError(503, "the generation thread stopped; restart the server",
                           kind="server_error")
        mp = self.model_provider
        self.check_prompt_size(request.prompt if request.request_type == "text" else None,
                               request.messages or (), max_tokens)
        if request.request_type == "chat":
            request.messages = place_system(request.messages, mp.late_system)
        try:
            # kept on the request: the generation thread then does not render it again
            given = extras(request)
            given.tokenized = self._tokenize(mp.tokenizer, request, SimpleNamespace(
                chat_template_kwargs=chat_template_kwargs), points=not count_only)
            given.template_kwargs = chat_template_kwargs
            prompt = given.tokenized[0]
        except ApiError:
            raise
        except Exception as e:  # the chat template refused the messages
            raise ApiError(400, f"the chat template cannot render these messages: {e}") from None
        if not prompt:
            raise ApiError(400, "the prompt is empty")
        if given.images:  # each image's tokens, from its size (what `usage` counts)
            try:
                prompt = mp.images.expanded(prompt, given.images)
            except ValueError as e:
                raise ApiError(400, str(e)) from None
        if check_context and len(prompt) + max_tokens > mp.context_length:
            raise context_exceeded(len(prompt), max_tokens, mp.context_length,
                                   "messages" if request.request_type == "chat" else "prompt")
        return prompt

    def _tokenize(self, tokenizer, request, args, points: bool = True):
        """mlx_lm's `_tokenize` (`_segments`), its segments also split at a
        chat's branch point and shared head (prompt_points.py; `points`:
        False for a prompt only counted, as they cost a render or two)."""
        messages = request.messages if request.request_type == "chat" else None
        head = prompt_points.opening_head(messages)  # (before mlx_lm joins its blocks)
        out = self._segments(tokenizer, request, args)
        prompt, segments, kinds, initial_state, vision = out
        if (not points or not messages or vision is not None or not tokenizer.has_chat_template
                or extras(request).images):  # (with images, the lane keeps the prompt whole)
            return out
        kwargs = dict(self.model_provider.cli_args.chat_template_args,
                      **(args.chat_template_kwargs or {}))

        def render(messages, generation_prompt):
            return tokenizer.apply_chat_template(
                messages, tools=request.tools, tokenize=False,
                add_generation_prompt=generation_prompt, **kwargs)

        try:
            points = prompt_points.extra_points(
                lambda text: tokenizer.encode(text, add_special_tokens=False), render,
                self.model_provider.marker_texts, request.messages, prompt, head)
        except Exception as e:  # (a template or tokenizer that does not render the probes)
            logging.debug("no branch point or shared head: %s: %s", type(e).__name__, e)
            return out
        return (prompt, *prompt_points.split(segments, kinds, points), initial_state, vision)

    def _segments(self, tokenizer, request, args):
        """mlx_lm's `_tokenize`, also splitting off the system prompt of a
        chat that ends in another message than a user's (mlx_lm splits only
        those): Claude Code's requests end in a system message where the
        template keeps it in place (roles.py), and the system prompt's end
        is what a new session of the same agent shares."""
        ONCE_PER_PROCESS.install()  # (mlx_lm warns of tools on every render)
        out = super()._tokenize(tokenizer, request, args)
        prompt, segments, _, initial_state, vision = out
        messages = request.messages if request.request_type == "chat" else None
        if (not messages or len(segments) > 1 or vision is not None
                or not tokenizer.has_chat_template or messages[-1]["role"] == "user"
                or messages[0]["role"] != "system"):
            return out
        leading = next((i for i, m in enumerate(messages) if m["role"] != "system"),
                       len(messages))
        kwargs = dict(self.model_provider.cli_args.chat_template_args,
                      **(args.chat_template_kwargs or {}))
        try:
            head = tokenizer.apply_chat_template(
                messages[:leading] + [{"role": "user", "content": ""}], tools=request.tools,
                tokenize=True, add_generation_prompt=False, **kwargs)
        except Exception:  # (a template that wants more than a system prompt: no split)
            return out
        end = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), 0)
        if not 0 < end < len(prompt):
            return out
        return (prompt, [prompt[:end], prompt[end:]], ["system", "user"], initial_state,
                vision)

    def check_prompt_size(self, text: Optional[str], messages, max_tokens: int):
        """The text a prompt holds verbatim bounds its tokens from below (a
        token holds at most the longest token's characters): a prompt whose
        text cannot fit the model's context is refused before anything is
        tokenized (a 50 MB message would take minutes and gigabytes to
        tokenize first). One that might fit is tokenized and counted
        (`preflight`), so the error names its exact count."""
        mp = self.model_provider
        chars = prompt_chars(text, messages)
        if chars > most_chars(mp.context_length, mp.max_token_chars):
            fewest = -(-chars // most_chars(1, mp.max_token_chars))
            raise context_exceeded(fewest, max_tokens, mp.context_length,
                                   "prompt" if text else "messages", chars=chars)

    # -- what a lane asks of the generator (lane.py reads nothing private) -------------------
    @property
    def sharded(self) -> bool:
        """Whether this process is one rank of several (mlx.launch)."""
        return self._is_distributed

    @property
    def stopping(self) -> bool:
        """Whether the generation loop is ending (sharded: rank 0's word)."""
        return self._halted if self._is_distributed else self._stop

    @property
    def failed(self) -> bool:
        """Whether the generation thread stopped on an error."""
        return self._generation_failed

    def from_rank0(self, make: Callable[[], Any]) -> Any:
        """`make()`, made on rank 0 and shared with the other ranks (sharded:
        every rank then acts on the same value), made here otherwise."""
        if not self._is_distributed:
            return make()
        return self._share_object(make() if self._rank == 0 else None)

    def next_row_id(self) -> int:
        """A row's id, the same on every rank (rows join in lockstep)."""
        return next(self._row_ids)

    def depth(self, args):
        """A request's draft depth: its own, else the server's."""
        return self.cli_args.draft_tokens if args.num_draft_tokens is None else \
            parse_depth(args.num_draft_tokens)

    def render(self, request, args) -> tuple:
        """mlx_lm's `_tokenize` of a request (ours: `_tokenize`)."""
        return self._tokenize(self.model_provider.tokenizer, request, args)

    def text_state_machine(self):
        """mlx_lm's text state machine for a request (no stop words: ours end the text)."""
        mp = self.model_provider
        return self._make_state_machine(mp.model_key, mp.tokenizer, ())[1]

    def held_bytes(self) -> int:
        """Bytes of prompt caches held in RAM, what --prompt-cache-bytes
        bounds: the prefix cache's entries and the caches the next turns
        hold beside them (read between the generation thread's steps)."""
        lane = self.lane
        return self.prompt_cache.nbytes + (lane.held_bytes() if lane is not None else 0)

    def store(self, tokens: list, cache: list, persist: bool = False,
              kind: str = "assistant"):
        """A prefix's cache into the prompt cache (RAM; `persist`: and disk),
        `kind` its entry's type in mlx_lm's LRU."""
        self.prompt_cache.insert_cache(self.model_provider.model_key, tokens, cache,
                                       cache_type=kind, persist=persist)

    def next_turn_render(self, request, args, answer: dict, text: str) -> list:
        """A chat's messages, its answer (`answer`, the assistant message its
        client sends back) and a next message holding `text` (a tool's
        result after calls, else the user's), rendered as a request is
        (`_segments`, without the snapshot points): one of the two renders `next_turn_prefix` compares."""
        calls = answer.get("tool_calls")
        following = [{"role": "tool", "name": c["function"]["name"], "tool_call_id": str(i),
                      "content": text} for i, c in enumerate(calls)] if calls else \
            [{"role": "user", "content": text}]
        messages = copy.deepcopy(request.messages) + [answer] + following
        return self._segments(self.model_provider.tokenizer, CompletionRequest(
            "chat", "", messages, request.tools, request.role_mapping), args)[0]

    def next_turn_prefix(self, a: list, b: list) -> Optional[list]:
        """The tokens every next turn of a chat starts with, from two renders
        of it with different next messages (`next_turn_render` with
        lane.NEXT_TURN_TEXTS): their common tokens, up to the last of the chat
        template's markers (what follows may merge with the next message's
        text). None without one."""
        common = 0
        for x, y in zip(a, b):
            if x != y:
                break
            common += 1
        markers = self.model_provider.marker_ids
        end = next((i + 1 for i in range(common - 1, -1, -1) if a[i] in markers), 0)
        return a[:end] if end else None

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
            idle_work = not busy and lane is not None and lane.idle_work
            if not (busy and self._is_distributed and lane.cycles % SHARDED_TICK_CYCLES):
                # (idle work waits IDLE_GRACE_S for a client's next request first)
                wait = None if busy or waiting else ((lane.idle_in() or None) if idle_work else 0.1)
                while True:  # take every request that is waiting before the next cycle
                    request = self._tick(wait, lane, waiting)
                    wait = None
                    if request is None:
                        break
                    try:
                        waiting.append((request, _Settings.of(self, request[1], request[2])))
                    except Exception as e:
                        _Lane._fail(request[0], e)
                    if self._is_distributed:  # one request per tick on every rank
                        break
            joining = []
            while waiting and len(joining) < prompts:
                request, settings = waiting[0]
                if not busy and not joining and (lane is None or not lane.accepts(
                        settings, [], width)):
                    try:  # (the finished chats' next turns wait for the new batch to idle)
                        lane = _Lane(self, settings, lane.next_turns if lane is not None else ())
                    except Exception as e:  # e.g. settings the sampler refuses
                        waiting.popleft()
                        _Lane._fail(request[0], e)
                        continue
                if lane is None or not lane.accepts(settings, [s for _, s in joining], width):
                    break  # in order: it waits for the batch to drain (or for room)
                joining.append(waiting.popleft())
            if joining:
                lane.join(joining)
                continue
            if busy:
                lane.step()
                if lane.batch is None:  # (it failed: its finished chats' answers go to disk)
                    lane.persist_all()
                    lane = None
            elif idle_work and not waiting and not lane.idle_in():  # one chunk of the next
                lane.idle_step()  # turns' prefixes, then a look for requests (never between
                # a busy batch's cycles)
        self._end(lane, waiting)
        self.model_provider.reset()
        del self.prompt_cache
        gc.collect()

    def _tick(self, timeout, lane: Optional[_Lane], waiting=()):
        """mlx_lm's `_next_request`, with what only rank 0 knows riding along:
        the rows whose client left (they finish) and the end of the loop (a
        shutdown, once nothing runs or waits or --shutdown-grace is over).
        Sharded, every rank acts on rank 0's word at the same point of the
        loop, so rows leave every rank's batch in the same cycle
        (docs/distributed.md)."""
        rows = list(lane.rows.values()) if lane is not None else []
        request, news = None, None
        if self._rank == 0:
            try:
                request = (self.requests.get_nowait() if timeout is None
                           else self.requests.get(timeout=timeout))
            except QueueEmpty:
                pass
            left = [row.rid for row in rows if row.ctx._should_stop]
            halt = self._stop and (
                (request is None and not rows and not waiting)
                or self._deadline is None or time.monotonic() >= self._deadline)
            if request is not None or left or halt:
                news = (None if request is None else request[1:], left, halt)
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
                _Lane._fail(request[0], shutdown_error(self.grace))
            return None
        return (request[0] if request is not None else Queue(), *shared)

    def _end(self, lane: Optional[_Lane], waiting):
        """The loop ended (a shutdown): every request still decoding or
        waiting gets an error it tells its client in the client's protocol
        (handler.py), never a silently cut answer."""
        queues = [state.rqueue for state in lane.rows.values()] if lane is not None else []
        queues += [request[0] for request, _ in waiting]
        if lane is not None:  # (its next turns, not prefilled: to disk)
            lane.persist_all()
        while self._rank == 0:
            try:
                queues.append(self.requests.get_nowait()[0])
            except QueueEmpty:
                break
        if queues and self._rank == 0:
            logging.warning("%d requests did not finish within --shutdown-grace (%g s): each "
                            "ends with an error", len(queues), self.grace)
        for rqueue in queues:
            _Lane._fail(rqueue, shutdown_error(self.grace))

    def fetch(self, tokens: list):
        """The longest stored prefix of `tokens`: a copy of its cache (or
        None) and its length. Sharded, each rank keeps its own store (each
        bounded on its own share), so the ranks settle on a prefix all of
        them hold, shortening until they agree (0 at worst)."""
        n = len(tokens)
        while True:
            cache, rest = (self.prompt_cache.fetch_nearest_cache(
                self.model_provider.model_key, tokens[:n]) if n
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


@contextlib.contextmanager
def generate_for(handler, request, args, stream: bool, progress=None):
    """A request's generation for an HTTP handler: (context, responses). A
    non-streamed request's client is watched while it runs (`ClientWatch`);
    an error before it started is raised as the ApiError it was refused
    with; its row stops when the block ends."""
    watch = None if stream else ClientWatch(handler.connection, request)
    try:
        try:
            ctx, responses = handler.response_generator.generate(request, args,
                                                                 progress_callback=progress)
        except Refused as r:
            raise r.error from None
        try:
            yield ctx, responses
        finally:
            ctx.stop()
    finally:
        if watch is not None:
            watch.close()


class ClientWatch(threading.Thread):
    """Stops a non-streamed generation whose client closed its connection
    (an agent that timed out, say): otherwise it would decode to max_tokens
    for nobody, beside the rows still wanted. Polls the socket for the end
    of the stream; the rows (one per choice) leave as a streamed one does
    when a write fails."""

    POLL = 0.25  # seconds

    def __init__(self, sock, *requests):
        super().__init__(daemon=True, name="mlx_mtp-client-watch")
        self.sock, self.requests, self.done = sock, list(requests), threading.Event()
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
        stopped = set()
        while not self.done.is_set():  # gone: stop each generation once it has one
            for i, request in enumerate(list(self.requests)):
                ctx = extras(request).ctx
                if ctx is not None and i not in stopped:
                    logging.info("the client of a non-streamed request left: its row finishes")
                    ctx.stop()
                    stopped.add(i)
            if len(stopped) == len(self.requests):
                return
            self.done.wait(self.POLL)

    def close(self):
        self.done.set()
