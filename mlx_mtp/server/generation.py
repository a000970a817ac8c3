"""The model provider and the generation thread: mlx_lm.server's
`ModelProvider` and `ResponseGenerator`, subclassed. The batch the requests
decode in is `lane.py`'s."""

from __future__ import annotations

import _thread
import gc
import itertools
import logging
import contextlib
import threading
from collections import deque
from pathlib import Path
from queue import Empty as QueueEmpty, Queue
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx

from ..checks import depth as parse_depth
from ..distributed import sharded_load
from ..loader import load
from ..mlx_lm_compat import ModelProvider, ResponseGenerator, generation_stream
from .lane import _Lane, _Settings
from .schemas import ApiError

# sharded, rank 0's news (requests, clients gone) reaches the other ranks every
# this many cycles: each `_tick` is a round of collectives and a host sync
SHARDED_TICK_CYCLES = 4


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
