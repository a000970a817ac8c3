"""The batch requests decode in (`_Lane`): rows join and leave between
cycles, each row's tokens go to its request as mlx_lm.server builds its
responses. The generation thread (`generation.py`) drives it; this is the one
place that calls the engine's `Batch` (add, step, finish)."""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import mlx.core as mx

from ..distributed import trunk_length
from ..stats import MTPStats
from ..mlx_lm_compat import (GenerationContext, Response, generation_stream,
                             logits_processors_for, xtc_special_tokens)
from ..sampling import PENALTY_KINDS, Penalties, RowSampling, make_sampler
from .answer import Answer
from .logprobs import top_logprobs
from .prompt_points import SNAPSHOT_KINDS
from .prompt_store import cache_bytes
from .schemas import ApiError
from .stops import StopStrings, answered_tokens


@dataclass
class RequestExtras:
    """What mlx_mtp's server keeps for one request beside mlx_lm's
    CompletionRequest, on its way from the handler's thread to the
    generation thread: one typed attribute, `request.mtp` (`extras`)."""

    tokenized: Optional[tuple] = None  # mlx_lm's `_tokenize` of it, for `template_kwargs`
    # the tools a call may name, for reading calls: the request's `tools` (those
    # shown to the model) and Anthropic's deferred ones (`defer_loading`)
    call_tools: Optional[list] = None
    template_kwargs: Optional[dict] = None
    constraint: Optional[Any] = None  # its grammar (structured output; constraint.Constraint)
    reasoning_budget: Optional[Any] = None  # a forced call's (structured.ReasoningBudget)
    stats: Optional[MTPStats] = None  # the handler's, filled by the generation thread
    ctx: Optional[Any] = None  # its generation context, once a lane decodes it
    images: tuple = ()  # its prompt's images, decoded (images.py), one per placeholder
    # OpenAI's `n`: the choices' one prompt state, shared by all of them (`SharedPrompt`)
    shared_prompt: Optional["SharedPrompt"] = None


@dataclass
class SharedPrompt:
    """The prompt state the choices of one request (OpenAI's `n`) start
    from: the first choice prepared prefills the prompt and leaves its state
    before the last token here (`cache`, `length` tokens); the others
    start from a copy of it, so the prompt is prefilled once, not once per
    choice. Let go once every other choice took it."""

    waiting: int  # choices yet to start from it
    cache: Optional[list] = None
    length: int = 0
    claimed: bool = False  # a choice prefills it (or did)

    def take(self) -> Optional[tuple]:
        """(a copy of the state, its length) for one more choice, or None."""
        if self.cache is None or self.waiting <= 0:
            return None
        self.waiting -= 1
        out = copy.deepcopy(self.cache), self.length
        if self.waiting == 0:
            self.cache = None
        return out


def extras(request) -> RequestExtras:
    """The request's RequestExtras, made on first use."""
    if getattr(request, "mtp", None) is None:
        request.mtp = RequestExtras()
    return request.mtp

# a next turn's prefix is prefilled ahead (`_Lane.idle_step`) only when it
# costs at most the answer's tokens and this many more (the chat template's
# closing tokens; a reasoning block re-rendered): never a whole conversation
# a template renders differently next time
NEXT_TURN_SLACK = 64
# chats whose next turn waits for idle time; older ones send their answer's state to disk
NEXT_TURNS_HELD = 8
# idle-time prefill runs in chunks of about --idle-chunk-ms (a request arriving
# meanwhile waits for one chunk at most, never for the whole), of these many
# tokens at the fewest and the most
IDLE_CHUNK_TOKENS = (8, 2048)
# idle time starts this long after the last row finished: a client that
# sends its next request as soon as it has the answer (a script, a benchmark,
# an agent's quick next call) finds no idle work begun (one process only:
# under mlx.launch every rank must take the same steps, so it starts at once)
IDLE_GRACE_S = 0.05
# tokens at the end of a chat's prompt (its generation prompt: '<|im_start|>
# assistant\n<think>\n') its next turn may render otherwise
GENERATION_TAIL = 16
# the next messages a finished chat is rendered with, one idle piece each: the
# renders' common tokens start its next turn (generation.next_turn_prefix)
NEXT_TURN_TEXTS = ("A", "B")


class MTPGenerationContext(GenerationContext):
    stats: Optional[MTPStats] = None  # filled as the generation runs
    stop_sequence: Optional[str] = None  # the stop string that ended it (set before its end)
    # prompt tokens it adds to the prefix cache, past the `prompt_cache_count`
    # read from it: all but the last, which its answer's entry holds
    prompt_cache_created: int = 0


def _sampler(args, tokenizer):
    """mlx_lm.server's sampler settings, as an MTPSampler (Leviathan–Chen acceptance)."""
    s = args.sampling
    return make_sampler(s.temperature, top_p=s.top_p, min_p=s.min_p, top_k=s.top_k,
                        xtc_probability=s.xtc_probability, xtc_threshold=s.xtc_threshold,
                        xtc_special_tokens=xtc_special_tokens(tokenizer))


@dataclass(frozen=True)
class _Settings:
    """How a request decodes: what its batch must share (the depth), and its
    own row settings (mlx_lm's sampler, XTC included, as in-graph arrays)."""

    depth: object
    sampling: RowSampling
    processors: tuple  # mlx_lm's processors, on the host: what is not in-graph (a
    # forced call's ReasoningBudget among them); its grammar is the row's (Batch.prepare)
    constraint: Optional[Any] = None

    @classmethod
    def of(cls, gen, request, args) -> "_Settings":
        lg = args.logits
        depth = gen.depth(args)
        sampler = _sampler(args, gen.model_provider.tokenizer)
        penalties = Penalties.of(**{f"{kind}_{part}": getattr(lg, f"{kind}_{part}")
                                    for kind in PENALTY_KINDS
                                    for part in ("penalty", "context_size")})
        sampling = RowSampling.of(sampler, lg.logit_bias, penalties)  # (an MTPSampler: never None)
        # the logit bias (and penalties) are applied in-graph
        in_graph = {f"{kind}_penalty": 0.0 for kind in PENALTY_KINDS} if penalties else {}
        args = replace(args, logits=replace(lg, logit_bias=None, **in_graph))
        processors = tuple(logits_processors_for(args))
        given = extras(request)  # (structured.attach_grammar)
        if given.reasoning_budget is not None:
            processors = (*processors, given.reasoning_budget)
        return cls(depth, sampling, processors, given.constraint)


@dataclass
class _RowState:
    """A request's side of a batch row: its queue, context and text state."""

    rid: int
    rqueue: object
    ctx: MTPGenerationContext
    args: object
    cache: list
    key_tokens: list
    stops: StopStrings  # its stop strings, on its text
    detokenizer: object
    request: object  # mlx_lm's CompletionRequest (its messages and tools)
    answer: Optional[Answer]  # what it said, read as its client reads it (chat requests)
    left: bool = False  # its client went away (rank 0's word, `_tick`)


@dataclass
class _NextTurn:
    """A chat that finished, whose next turn's prefix is prefilled in idle time."""

    state: _RowState
    answered: int  # tokens of its answer (up to a stop string)
    stored: int  # the length of its answer's entry in the prefix cache (0: none)
    tokens: Optional[list] = None  # its next turn's prefix, once rendered
    renders: list = field(default_factory=list)  # its renders so far (NEXT_TURN_TEXTS)
    cache: Optional[list] = None  # the cache being fed (None: from the store)
    done: int = 0  # tokens of `tokens` that cache holds


class _Lane:
    """The batch requests decode in (see `_generate`); a new one starts when a
    request cannot share the present one and it has drained."""

    def __init__(self, gen, settings: _Settings, next_turns=()):
        """next_turns: an earlier lane's (`next_turns`), taken over."""
        from ..batch import make_batch
        from ..params import DecodeOptions

        self.gen, self.depth = gen, settings.depth
        self.batch = make_batch(gen.model_provider.model, draft_tokens=settings.depth,
                                max_draft_tokens=gen.cli_args.max_draft_tokens,
                                prefill_step_size=gen.cli_args.prefill_step_size,
                                context_drafts=getattr(gen.cli_args, "context_drafts",
                                                       DecodeOptions.context_drafts))
        self.batch.limit_prefill(gen.cli_args.prompt_concurrency)
        self.rows: dict = {}  # Row -> _RowState
        self.cycles = 0
        self.next_turns = list(next_turns)  # chats that finished (`idle_step`), oldest first
        self.chunk = IDLE_CHUNK_TOKENS[0]  # tokens in the next idle chunk (`_chunk`)
        self.quiet_since = time.perf_counter()  # when the last row finished (`idle_in`)
        gen.lane = self  # (the generator's `held_bytes` reads its next turns)

    def accepts(self, settings: _Settings, joining: list, width: int) -> bool:
        """A request with these settings can join now (the `joining` settings
        already will). A row that runs host logits processors turns its whole
        batch eager (no compiled graph, no lookahead): such rows decode in a
        batch of their own, and the others wait for it to drain, as for
        another depth (docs/design.md, "Structured output")."""
        if self.batch is None or settings.depth != self.depth:
            return False
        host = self.batch.host_row(settings.processors, settings.constraint)
        peers = [bool(r.processors) for r in self.rows] + [
            self.batch.host_row(s.processors, s.constraint) for s in joining]
        return (self.batch.accepts(settings.sampling) and all(p == host for p in peers)
                and len(self.rows) + len(joining) < width)

    def join(self, requests: list):
        """Prefill the requests' new tokens together (each from its nearest
        stored prefix, snapshots stored at its message boundaries) and add them
        as rows; their first tokens come with the next cycle."""
        prompts = []
        for (rqueue, request, args), _ in requests:
            try:
                prompts.append(self._tokenized(request, args)[0])
            except Exception:  # (`_prepare` tells the request)
                pass
        self._continued(prompts)
        if self.next_turns and self.next_turns[0].cache is not None:  # (it waits, kept as is)
            turn = self.next_turns[0]
            logging.debug("next turn: waits at %d of %d tokens for a request", turn.done,
                          len(turn.tokens))
        # a request's other choices (`n`) joining with its first: once it is prefilled
        now, later, seen = [], [], set()
        for r in requests:
            shared = self._shared(r[0][1])
            first = shared is None or not (id(shared) in seen or shared.claimed)
            (now if first else later).append(r)
            seen.add(id(shared))
        for part in (now, later):
            if part:
                self._add(part)
        self._bound()

    def _shared(self, request) -> Optional[SharedPrompt]:
        """The prompt state a request's choices share; none sharded (each rank
        has its own copy of each choice's request: they could not agree)."""
        return None if self.gen.sharded else extras(request).shared_prompt

    def _add(self, requests: list):
        """Prepare the requests and add them to the batch as rows (their
        prompts prefilled together)."""
        gen = self.gen
        collectives = gen.sharded
        joined = []
        for (rqueue, request, args), settings in requests:
            rid = gen.next_row_id()
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
                rows = self.batch.add([r for r, _ in joined])
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

    def _tokenized(self, request, args) -> tuple:
        """mlx_lm's `_tokenize` of a request, rendered once (the handler's
        preflight usually did it)."""
        given = extras(request)
        if given.tokenized is None or args.chat_template_kwargs != given.template_kwargs:
            given.tokenized = self.gen.render(request, args)
            given.template_kwargs = args.chat_template_kwargs
        return given.tokenized

    def _prepare(self, rid, rqueue, request, args, settings: _Settings):
        """One request's Request (for Batch.add) and its row state."""
        gen, mp = self.gen, self.gen.model_provider
        model, tokenizer = mp.model, mp.tokenizer
        given = extras(request)
        prompt, segments, kinds, initial_state, _ = self._tokenized(request, args)
        # no stop words in mlx_lm's machines: they match ids and strip text; ours end the text
        text_sm = gen.text_state_machine()
        # an exact stored prefix (GDN states cannot be cut back), leaving at
        # least the last prompt token to run; with images, found by the key
        # whose pads are their pixel digests', never ending inside an image
        media, key, layout = None, prompt, None
        if given.images:
            from ..vision import layout_media, prompt_layout

            with mx.stream(generation_stream):  # (the tower loads on this thread)
                layout = prompt_layout(model, prompt, given.images)
            prompt, key = layout.tokens, layout.key
        shared = self._shared(request)
        start = shared.take() if shared is not None else None
        cache, n = start if start is not None else gen.fetch(key[:-1])
        while layout is not None and layout.restorable(n) != n:
            cache, n = gen.fetch(key[:layout.restorable(n)])
        if layout is not None:
            with mx.stream(generation_stream):  # (the tower runs for the images after n)
                media = layout_media(model, layout, given.images, n)
        ctx = MTPGenerationContext(
            has_thinking=tokenizer.has_thinking, has_tool_calling=tokenizer.has_tool_calling,
            tool_parser=tokenizer.tool_parser, text_sm=text_sm,
            initial_state=initial_state, prompt=prompt, prompt_cache_count=n)
        ctx.prompt_cache_created = max(0, len(prompt) - 1 - n)
        ctx.stats = MTPStats() if given.stats is None else given.stats
        given.ctx = ctx  # (a non-streamed request's client may leave: generation.ClientWatch)
        rqueue.put(ctx)
        if cache is None:
            cache = model.make_cache()
        if layout is not None:  # (the segments count the prompt before its pads were expanded)
            segments, kinds = [prompt], ["user"]
        stops, kinds_at = _snapshot_points(prompt, segments, kinds, n,
                                           gen.cli_args.prompt_snapshots)
        shared_at = None  # (the first choice of several: its state for the others, there)
        if shared is not None and not shared.claimed:
            shared.claimed, shared.length = True, len(prompt) - 1
            shared_at = len(prompt) - 1 - n
            if shared_at > 0:
                stops = tuple(sorted({*stops, shared_at}))
            else:  # (nothing to prefill before the last token: the state is the fetched one)
                shared.cache = copy.deepcopy(cache)

        def snapshot(done):  # (prompt_points.py: which kinds go to disk too)
            if done in kinds_at:
                kind, persist = SNAPSHOT_KINDS[kinds_at[done]]
                gen.store(key[:n + done], copy.deepcopy(cache), kind=kind, persist=persist)
            if done == shared_at:
                shared.cache = copy.deepcopy(cache)

        r = self.batch.prepare(
            prompt[n:], cache, args.max_tokens, args.seed,
            sampler=settings.sampling, logits_processors=settings.processors, stats=ctx.stats,
            progress=lambda done, total: rqueue.put((n + done, n + total)),
            cached_tokens=prompt[:n],  # penalties count the cached prefix, as mlx_lm.server's
            stop_tokens=tokenizer.eos_token_ids,
            feed_tail=False,  # the cache as it stands when the row leaves: no forward then
            # structured output: the row's grammar (structured.attach_grammar)
            constraint=settings.constraint, tokenizer=tokenizer, media=media)
        r.stops, r.snapshot = stops, snapshot
        chat = request.request_type == "chat" and tokenizer.has_chat_template
        state = _RowState(rid, rqueue, ctx, args, cache, key[:],
                          StopStrings(args.stop_words), tokenizer.detokenizer, request,
                          Answer(ctx, given.call_tools or request.tools, tokenizer)
                          if chat else None)
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
            if self.gen.sharded:  # (sharded: this rank may be out of step)
                raise

    def _emit(self, event, state: _RowState):
        """Send one token (as mlx_lm.server's responses are built), its text
        exactly the answer's: the batch ends a row at EOS or max_tokens; a
        stop string (its text and what follows left out, `ctx.stop_sequence`
        naming it) or a client that left ends it here. Text that may begin a
        stop string waits for the next token (`StopStrings`)."""
        token, finish = event.token, event.finish
        if finish != "stop":  # EOS is not text
            state.detokenizer.add_token(token)
        if finish is not None:
            state.detokenizer.finalize()
        text = state.stops.feed(state.detokenizer.last_segment)
        if state.stops.found is not None:
            finish, state.ctx.stop_sequence = "stop", state.stops.found
        elif finish is not None or state.left:
            text += state.stops.flush()
        top = state.args.top_logprobs
        response = Response(text, token, event.logprob, finish,
                            top_logprobs(event.logprobs, top) if top > 0 else ())
        state.rqueue.put(response)  # (handler.py formats the logprobs)
        if state.answer is not None:
            state.answer.feed(response)
        state.key_tokens.append(token)
        if finish is None and not state.left:
            return
        del self.rows[event.row]
        self.quiet_since = time.perf_counter()
        try:  # (the request ends once its answer is stored: a next turn finds it)
            if not event.row.done:
                with mx.stream(generation_stream):
                    self.batch.finish(event.row)
            mp = self.gen.model_provider
            held = trunk_length(state.cache, mp.model)
            # the cache keeps what was answered: a stop string's tokens are not
            # the answer, and a state past them cannot be cut back (GDN)
            prompt = len(state.ctx.prompt)
            answered = len(state.key_tokens) if state.stops.found is None else \
                prompt + answered_tokens(state.key_tokens[prompt:], state.stops.found,
                                         mp.tokenizer.decode)
            # a chat's next turn starts from its prefix (`idle_step`, which
            # also writes it to disk), rendered once this request has ended
            # (not with images: a next turn's render has their placeholders, not their keys)
            ahead = state.answer is not None and not state.left and not extras(
                state.request).images
            stored = held <= answered
            if stored:
                self.gen.store(state.key_tokens[:held], state.cache, persist=not ahead)
            if ahead:
                self.next_turns.append(_NextTurn(state, answered - prompt, held if stored else 0))
                if len(self.next_turns) > NEXT_TURNS_HELD:
                    self._done(self.next_turns[0], persist=True)
            self._bound()
        finally:
            state.rqueue.put(None)

    @property
    def idle_work(self) -> bool:
        """Whether idle time has work here (next turns to prefill)."""
        return bool(self.next_turns) and self.batch is not None

    def idle_in(self) -> float:
        """Seconds until idle time begins (IDLE_GRACE_S after the last row
        finished; at once under mlx.launch), 0 once it has."""
        if self.gen.sharded:
            return 0.0
        return max(0.0, self.quiet_since + IDLE_GRACE_S - time.perf_counter())

    def idle_step(self):
        """One piece of the idle-time work, each at most one chunk of
        prefill (--idle-chunk-ms) or one chat-template render (a next turn
        is rendered twice): the generation loop looks for requests
        between pieces, and one that arrives is served first (the work waits,
        its cache kept on the turn, and goes on once the batch is idle
        again). The work: the
        prefix every next turn of a finished chat starts with
        (`next_turn_prefix`). The chat template re-tokenizes an answer's text
        its own way (the demo generates '\\n   ' where it writes '\\n', '   '),
        so the answer's stored state does not start the next turn; this
        prefix does, prefilled from the longest stored prefix (the answer's
        state where the tokens agree) when that costs at most the answer's
        tokens and NEXT_TURN_SLACK, and stored (RAM and disk). Where there
        is no such prefix, the answer's own state goes to disk instead."""
        gen = self.gen
        if self.idle_work and not gen.stopping:
            self._advance(self.next_turns[0], self._chunk())
            self._bound()

    def _continued(self, prompts: list):
        """The next turns the joining prompts continue are no longer work
        for idle time: their requests prefill what is left themselves, in
        the same forward as their new messages (a separate forward for the
        rest of a prefix would cost a whole pass over the weights). What
        idle time prefilled is stored, and they start there. A next turn is
        longer than its chat's prompt and starts with its history (the
        prompt's generation tail aside: the next turn may render it
        otherwise, a think block), or with the prefix rendered for it."""
        for turn in list(self.next_turns):
            prompt = turn.state.ctx.prompt
            head = turn.tokens[:max(turn.done, 1)] if turn.tokens is not None else \
                prompt[:max(1, len(prompt) - GENERATION_TAIL)]
            if any(len(p) > len(prompt) and p[:len(head)] == head for p in prompts):
                self._store_partial(turn)
                self._done(turn)

    def _advance(self, turn: _NextTurn, limit: int):
        """One step of a next turn's prefix: render it, or prefill up to
        `limit` more of its tokens, storing it once whole."""
        gen, mp = self.gen, self.gen.model_provider
        collectives = gen.sharded
        try:
            if turn.tokens is None:  # rendered on rank 0 and shared: every rank prefills
                # the same tokens (a template reading the clock could render otherwise);
                # one render a piece (a long chat's takes a while: a request may come)
                text = NEXT_TURN_TEXTS[len(turn.renders)]
                rendered = gen.from_rank0(lambda: self._next_turn_render(turn, text))
                if rendered is not None:
                    turn.renders.append(rendered)
                    if len(turn.renders) < len(NEXT_TURN_TEXTS):
                        return
                    turn.tokens = gen.next_turn_prefix(*turn.renders)
                turn.renders = []
                if turn.tokens is None or len(turn.tokens) >= mp.context_length:
                    self._done(turn, persist=True)
                return
            if turn.cache is None:  # (begun)
                cache, turn.done = gen.fetch(turn.tokens)
                left = len(turn.tokens) - turn.done
                if left == 0:
                    return self._done(turn)  # (stored already: by its next turn, say)
                if left > turn.answered + NEXT_TURN_SLACK:
                    return self._done(turn, persist=True)  # no prefix worth it
                turn.cache = cache if cache is not None else mp.model.make_cache()
                logging.debug("next turn: prefilling %d of %d tokens", left, len(turn.tokens))
            end = min(len(turn.tokens), turn.done + limit)
            piece = turn.tokens[turn.done:end]
            t0 = time.perf_counter()
            if end < len(turn.tokens):  # (one forward: the next piece starts with its last)
                self.batch.feed_prefix(turn.cache, turn.tokens[turn.done:end + 1])
            else:
                with mx.stream(generation_stream):
                    self.batch.add([self.batch.prepare(piece, turn.cache, 0)])
            took = time.perf_counter() - t0
            logging.debug("next turn: %d tokens prefilled in %.1f ms", len(piece), took * 1000)
            self._measured(len(piece), took)
            turn.done += len(piece)
            if turn.done == len(turn.tokens):
                gen.store(turn.tokens, self._unreserved(turn), persist=True)
                logging.info("a chat's next turn: its prefix of %d tokens is prefilled and stored",
                             turn.done)
                self._done(turn)
        except Exception as e:  # (its next turn then prefills it itself)
            if collectives:  # this rank may have left the others inside a collective
                raise
            logging.warning("a next turn's prefix was not prefilled: %s: %s",
                            type(e).__name__, e)
            turn.cache = None
            self._done(turn, persist=True)

    def _store_partial(self, turn: _NextTurn):
        """A next turn's prefix, as far as idle time prefilled it, goes to
        the prefix cache (RAM) for the request that continues it (the turn
        is then dropped: its cache is not touched again)."""
        if turn.cache is None:
            return
        logging.debug("next turn: paused at %d of %d tokens for its request", turn.done,
                      len(turn.tokens))
        cache = self._unreserved(turn)
        if turn.done:
            self.gen.store(turn.tokens[:turn.done], cache)

    def _unreserved(self, turn: _NextTurn) -> list:
        """The turn's prefix cache, taken off it and no longer reserved in
        the prefix cache, so that an entry made of it is counted once (not
        also as bytes beside the entries, which would evict one more)."""
        cache, turn.cache = turn.cache, None
        self._bound()
        return cache

    def _chunk(self) -> int:
        """Tokens in the next idle chunk: about --idle-chunk-ms of prefill at
        the speed last measured (rank 0's measure, sharded)."""
        return self.gen.from_rank0(lambda: self.chunk)

    def _measured(self, tokens: int, seconds: float):
        lo, hi = IDLE_CHUNK_TOKENS
        budget = self.gen.cli_args.idle_chunk_ms / 1000
        self.chunk = max(lo, min(hi, self.gen.cli_args.prefill_step_size,
                                 int(tokens / max(seconds, 1e-6) * budget)))

    def _done(self, turn: _NextTurn, persist: bool = False):
        """The turn leaves the idle work (once: a second call does nothing),
        its answer's state sent to disk if `persist`."""
        if turn not in self.next_turns:
            return
        self.next_turns.remove(turn)
        if persist:
            try:
                self._persist(turn)
            except Exception as e:  # (the disk tier logs its own faults; never the loop's)
                logging.warning("an answer's state was not sent to disk: %s: %s",
                                type(e).__name__, e)

    def persist_all(self):
        """Every next turn leaves, its answer's state sent to disk (the lane
        failed, or the server stops); a disk fault costs a log line each."""
        for turn in list(self.next_turns):
            self._done(turn, persist=True)

    def _bound(self):
        """The caches next turns hold count against the prefix cache's byte
        cap (--prompt-cache-bytes) with its entries, after every step of the
        lane: a prefix being prefilled is reserved there (the least recently
        used entries leave for it; one larger than the whole cap is not
        prefilled), and an answer's state held for its chat is held only
        while it is an entry too (counted once): one the cache let go goes
        to disk (if there is one) and is let go here too. After it, what
        `held_bytes` counts is what the cache reserves."""
        store = self.gen.prompt_cache
        self._let_go_answers()
        while (outside := self.held_bytes()) > store.max_bytes and not self.gen.sharded:
            # (sharded: the ranks' bytes differ, and their idle work must not: each only reserves)
            turn = next(t for t in self.next_turns if t.cache is not None)
            logging.info("a chat's next turn is not prefilled: its prefix takes more than "
                         "--prompt-cache-bytes")
            turn.cache = None
            self._done(turn, persist=True)
        store.reserve(outside)
        self._let_go_answers()  # (the entries the reservation evicted)

    def _let_go_answers(self):
        """The answers' states the prefix cache no longer holds go to disk
        (if there is one), and their chats let go of them."""
        for turn in self.next_turns:
            state = turn.state
            if state.cache is None or self._is_entry(turn):
                continue
            if turn.stored:
                self.gen.prompt_cache.to_disk(state.key_tokens[:turn.stored], state.cache)
            state.cache, turn.stored = None, 0

    def _is_entry(self, turn: _NextTurn) -> bool:
        """Whether the turn's answer state is an entry of the prefix cache still."""
        return bool(turn.stored) and self.gen.prompt_cache.holds(turn.state.cache)

    def held_bytes(self) -> int:
        """Bytes the next turns hold beside the prefix cache's entries (what
        counts against its cap with them, `_bound`): each prefix being
        prefilled, and each answer's state that is not an entry."""
        held = 0
        for turn in list(self.next_turns):  # (list: read off the generation thread too)
            if turn.cache is not None:
                held += cache_bytes(turn.cache)
            answer = turn.state.cache
            if answer is not None and not self._is_entry(turn):
                held += cache_bytes(answer)
        return held

    def _persist(self, turn: _NextTurn):
        """A next turn not prefilled ahead: its answer's own state goes to disk."""
        if turn.stored:
            self.gen.store(turn.state.key_tokens[:turn.stored], turn.state.cache, persist=True)

    def _next_turn_render(self, turn: _NextTurn, text: str) -> Optional[list]:
        state = turn.state
        try:
            return self.gen.next_turn_render(state.request, state.args, state.answer.message(),
                                             text)
        except Exception as e:  # (a template that refuses the history: no prefix then)
            logging.info("no next-turn prefix: the chat template refused the answer: %s: %s",
                         type(e).__name__, e)
            return None

    @staticmethod
    def _fail(rqueue, e: Exception):
        if not isinstance(e, ApiError):
            logging.error("generation failed: %s: %s", type(e).__name__, e)
        rqueue.put(e)


def _snapshot_points(prompt: list, segments: list, kinds: list, cached: int, mode: str):
    """Where the prefill stores copies of the cache (counts of the new tokens,
    after the `cached` ones), and each one's kind: the end of every segment
    (system prompt, a new session's shared head, the branch point, last user
    message: prompt_points.py) and of the prompt but its last token, so a
    later request sharing that prefix (the next turn, a regenerated answer,
    another session) starts from it exactly. mode "end": none (only the
    answers)."""
    if mode != "segments":
        return (), {}
    points, end = {}, 0
    for segment, kind in zip(segments, kinds):
        end += len(segment)
        at = min(end, len(prompt) - 1) - cached
        if at > 0:
            points[at] = kind
    return tuple(sorted(points)), points
