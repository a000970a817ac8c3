"""Every private or undocumented mlx_lm name mlx_mtp relies on, in one place.

mlx_lm documents its command lines, `load` / `generate` / `stream_generate`,
the sampler and prompt-cache helpers, and the server's HTTP API. mlx_mtp also
builds on mlx_lm's Python internals: the server's classes (subclassed by
server/), helpers whose names start with `_`, and attributes of its cache
objects. They are imported here and nowhere else, each with what we rely on;
methods we override or call on mlx_lm's objects, which cannot be re-exported,
are listed in `RELIED_ON`. `problems()` checks all of it against the installed
mlx_lm and tests/test_mlx_lm_compat.py fails, naming the symbol, when a
release changes one (pyproject pins `mlx-lm>=0.32.2,<0.33`). docs/design.md,
"mlx_lm's internals", says why and how to move to a new release.

Where mlx_lm offers no clean override, server/ works around it, and says so
below (`hand_body_to`, `validate_depth`, `text_segments`). Not reused, for the
same reason: mlx_lm.server's `_make_sampler` (it calls mlx_lm's make_sampler;
server/lane.py's `_sampler` makes the same call with mlx_mtp's, which also tells
the decoder its settings).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
from typing import Callable, List, NamedTuple, Optional, Tuple

# -- mlx_lm.server: its Python side is undocumented (only the HTTP API is) ---------------
from mlx_lm import server as _server
from mlx_lm.server import (  # noqa: F401  (re-exported)
    APIHandler,  # subclassed: do_POST, do_GET, validate_model_parameters, handle_completion,
    #   generate_response, completion_usage_response, handle_models_request (RELIED_ON)
    CompletionRequest,  # built positionally: (request_type, prompt, messages, tools, role_mapping)
    GenerationArguments,  # built by `generation_arguments` (fields: model, sampling, logits, ...)
    GenerationContext,  # subclassed; we fill its fields and read `_should_stop` (set by stop())
    LogitsProcessorArguments,  # a field of GenerationArguments
    ModelDescription,  # a field of GenerationArguments
    ModelProvider,  # subclassed: _load; reads _tokenizer_config, pipeline_group, tensor_group,
    #   is_distributed; sets model_key, model, tokenizer, processor, draft_model, is_batchable
    Response,  # built positionally: (text, token, logprob, finish_reason, top_tokens)
    ResponseGenerator,  # subclassed: its generation thread and request queue (RELIED_ON)
    SamplingArguments,  # a field of GenerationArguments
)

# -- elsewhere in mlx_lm --------------------------------------------------------------------
# TextStateMachine(transitions): make_state(initial) and the static split /
# flush on its runtime state (see `text_segments`); a transition to None ends
# the text (split's last segment is then (None, "")): server/stops.py
from mlx_lm.generate import TextStateMachine  # noqa: F401 (re-exported)
# the stream mlx_lm generates on (its generate_step, batch generation, wired_limit)
from mlx_lm.generate import generation_stream  # noqa: F401
# wired_limit(model, streams): a context that wires the model's memory (Metal)
from mlx_lm.generate import wired_limit  # noqa: F401
# create_attention_mask(h, cache): the causal mask (or "causal") a layer's cache calls for
from mlx_lm.models.base import create_attention_mask  # noqa: F401
# gather_last_axis(x, group): a vocabulary-sharded lm_head's logits, gathered
from mlx_lm.models.base import gather_last_axis  # noqa: F401
# _BaseCache: the base of mlx_lm's caches (state, meta_state, nbytes, ...)
from mlx_lm.models.cache import _BaseCache as BaseCache  # noqa: F401
# LRUPromptCache(max_size, max_bytes): fetch_nearest_cache(key, tokens) ->
# (cache copy or None, tokens left); insert_cache(key, tokens, cache, cache_type=)
# (the entry holds the list given; evicted: let go); trim_to(n_bytes=) drops
# the least recently used entries down to n_bytes; nbytes: the entries' bytes;
# max_bytes: the byte cap it was made with (read, as the cap reserve() counts against)
from mlx_lm.models.cache import LRUPromptCache  # noqa: F401
# save_prompt_cache(file, cache, metadata) / load_prompt_cache(file): a prompt
# cache as safetensors, each object rebuilt from its class name and `state`
# (KVCache's: keys, values, offset); the metadata dict is stored flattened
# under "0.<key>" (server/prompt_store.py reads it from the header)
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache  # noqa: F401
# PipelineMixin: pipeline(group) sets start_idx / end_idx over `layers`
from mlx_lm.models.pipeline import PipelineMixin  # noqa: F401
# the sampler's steps, for the MTP sampler to run them in mlx_lm's order
from mlx_lm.sample_utils import (apply_min_p, apply_top_k, apply_top_p,  # noqa: F401
                                 greedy_sampler)
# infer_quant_config(path, module, weights): a weight's quantization settings
from mlx_lm.utils import infer_quant_config  # noqa: F401
# load_model(model_path, lazy, strict, model_config, get_model_classes) -> (model, config);
# load_tokenizer(model_path, tokenizer_config_extra, eos_token_ids)
from mlx_lm.utils import load_model, load_tokenizer  # noqa: F401
# _parse_size("8GB") -> 8 * 10**9: mlx_lm.server's --prompt-cache-bytes type
from mlx_lm.utils import _parse_size as parse_size  # noqa: F401

# `_make_logits_processors(args)`: mlx_lm.server's processors for a
# GenerationArguments (logit bias, repetition/presence/frequency penalties)
logits_processors_for = _server._make_logits_processors
# `_run_http_server(host, port, response_generator, server_class=, handler_class=)`:
# serves until Ctrl-C, then shuts HTTP down and calls stop_and_join()
run_http_server = _server._run_http_server


def xtc_special_tokens(tokenizer) -> list:
    """The tokens XTC never removes, as mlx_lm's generate and server pass them
    (inline there: "\\n" and the EOS tokens)."""
    return tokenizer.encode("\n") + list(tokenizer.eos_token_ids)


def tool_call_format(tokenizer) -> Optional[str]:
    """The name of the module of mlx_lm's tool parser the tokenizer wrapper
    chose (`mlx_lm.tool_parsers.<name>`: "json_tools", "qwen3_coder", ...),
    or None without tool calling. mlx_lm keeps the choice only as the
    parser function (`tool_parser`); its module names the format of the
    calls the chat template writes (server/structured.py constrains them)."""
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", None) or ""
    prefix = "mlx_lm.tool_parsers."
    return module[len(prefix):] if module.startswith(prefix) else None


# -- where mlx_lm has no clean override ------------------------------------------------------
def hand_body_to(handler, body: dict):
    """Give mlx_lm's `APIHandler.do_POST` the (checked) request body.

    No clean override: do_POST reads `self.rfile` by `Content-Length` and
    parses it in one piece with the request's attribute extraction, with no
    method taking a parsed body. server/handler.py has read the body already (to
    check it first), so it hands it back this way, re-encoded (the checks
    coerce some fields)."""
    data = json.dumps(body).encode()
    handler.headers.replace_header("Content-Length", str(len(data)))
    handler.rfile = io.BytesIO(data)


def validate_depth(handler, validate: Callable[[], None]):
    """Run mlx_lm's `validate_model_parameters` (`validate`) on a handler
    whose `num_draft_tokens` may be "auto" or None (ours: the server's
    default), which mlx_lm's check refuses (an int >= 0).

    No clean override: validate_model_parameters checks every field in one
    method (its per-field `_validate` is private), and handle_completion then
    copies `self.num_draft_tokens` into GenerationArguments, so the value is
    shown as 0 for the check and put back."""
    depth = handler.num_draft_tokens
    if depth is not None and depth != "auto":
        return validate()
    handler.num_draft_tokens = 0
    try:
        validate()
    finally:
        handler.num_draft_tokens = depth


def text_segments(state, text: str, finish_reason: Optional[str]) -> Tuple[tuple, list]:
    """One generated piece through the text state machine, as mlx_lm.server's
    `APIHandler.handle_completion` does it: (new state, [(kind, text)]) with
    kind "reasoning", "tool" or "normal". mlx_lm keeps this step inline, with
    no function to call. Unlike it, the text held back at the end is let out
    whatever the finish_reason (mlx_lm drops it on "stop"): the generation
    thread (server/lane.py) hands over the answer's text exactly, EOS and
    stop strings left out, so what is held is text the model wrote (a partial
    marker)."""
    state, segments = TextStateMachine.split(state, text)
    if finish_reason is not None:
        state, flushed, current = TextStateMachine.flush(state)
        segments.append((current, flushed))
    return state, segments


# -- building mlx_lm.server's arguments -------------------------------------------------------
def generation_arguments(**values) -> GenerationArguments:
    """mlx_lm.server's GenerationArguments from flat values: each field,
    nested dataclasses' too (model, draft, adapter; temperature, top_p, ...;
    logit_bias, repetition_penalty, ...), taken by its name from `values`.
    A field mlx_lm adds or renames is a TypeError naming it."""
    return _build(GenerationArguments, dict(values))


def _build(cls, values: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            kwargs[f.name] = _build(f.type, values)
        elif isinstance(f.type, str) and f.type in _NESTED:
            kwargs[f.name] = _build(_NESTED[f.type], values)
        elif f.name in values:
            kwargs[f.name] = values[f.name]
        else:
            raise TypeError(f"mlx_lm.server.{cls.__name__} has a field {f.name!r} mlx_mtp "
                            f"does not fill (mlx_lm_compat.generation_arguments)")
    return cls(**kwargs)


# (mlx_lm.server's annotations may be strings: `from __future__ import annotations`)
_NESTED = {c.__name__: c for c in (ModelDescription, SamplingArguments, LogitsProcessorArguments)}

# mlx_lm.server's values for the request fields a route does not offer (its
# do_POST's defaults: no penalties, no XTC, no logprobs)
NEUTRAL = dict(adapter=None, logit_bias=None, repetition_penalty=0.0, repetition_context_size=20,
               presence_penalty=0.0, presence_context_size=20, frequency_penalty=0.0,
               frequency_context_size=20, xtc_probability=0.0, xtc_threshold=0.1,
               logprobs=False, top_logprobs=-1, seed=None, num_draft_tokens=None)


# -- what we rely on, checked ------------------------------------------------------------------
class Need(NamedTuple):
    """One mlx_lm name and the shape we rely on: `params`, the leading
    parameter names we pass (None: not checked); `fields`, dataclass fields
    we fill or read, the leading ones in this order when `positional`;
    `sets`, instance attributes its source assigns (`self.name = ...`) that
    the server reads."""

    path: str  # "module:qualified.name"
    params: Optional[Tuple[str, ...]] = None
    fields: Optional[Tuple[str, ...]] = None
    why: str = ""
    positional: bool = False
    sets: Optional[Tuple[str, ...]] = None


RELIED_ON: List[Need] = [
    # re-exported above
    Need("mlx_lm.server:_make_logits_processors", ("args",)),
    Need("mlx_lm.server:_run_http_server",
         ("host", "port", "response_generator", "server_class", "handler_class")),
    Need("mlx_lm.utils:_parse_size", ("x",)),
    Need("mlx_lm.generate:generation_stream"),
    Need("mlx_lm.generate:wired_limit", ("model", "streams")),
    Need("mlx_lm.generate:TextStateMachine.__init__", ("self", "transitions")),
    Need("mlx_lm.generate:TextStateMachine.make_state", ("self", "initial")),
    Need("mlx_lm.generate:TextStateMachine.split", ("state", "text")),
    Need("mlx_lm.generate:TextStateMachine.flush", ("state",)),
    Need("mlx_lm.models.base:create_attention_mask", ("h", "cache")),
    Need("mlx_lm.models.base:gather_last_axis", ("x", "group")),
    Need("mlx_lm.models.cache:_BaseCache"),
    Need("mlx_lm.models.cache:LRUPromptCache", ("max_size", "max_bytes"), sets=("max_bytes",),
         why="server/prompt_store.py's `reserve` and lane.py's `_bound` read the byte cap"),
    Need("mlx_lm.models.cache:LRUPromptCache.fetch_nearest_cache", ("self", "model", "tokens")),
    Need("mlx_lm.models.cache:LRUPromptCache.insert_cache",
         ("self", "model", "tokens", "prompt_cache", "cache_type")),
    Need("mlx_lm.models.cache:LRUPromptCache.trim_to", ("self", "n_sequences", "n_bytes"),
         why="server/prompt_store.py: bytes reserved for the next turns (`reserve`)"),
    Need("mlx_lm.models.cache:LRUPromptCache.nbytes"),
    Need("mlx_lm.models.cache:save_prompt_cache", ("file_name", "cache", "metadata")),
    Need("mlx_lm.models.cache:load_prompt_cache", ("file_name", "return_metadata")),
    Need("mlx_lm.models.cache:KVCache.state", why="(keys, values, offset): prompt_store.py "
         "saves keys and values cut to the offset"),
    Need("mlx_lm.models.pipeline:PipelineMixin.pipeline", ("self", "group")),
    # imported where they are used: by the kernels' references (metal/) and
    # launcher, the training's chunked GDN, and models/qwen4_exp.py, an mlx_lm
    # model file that imports mlx_lm directly, as an upstream one would
    Need("mlx_lm.models.gated_delta:gated_delta_update",
         ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask", "use_kernel"),
         why="metal/__init__.py (references): plain decoding's GDN step, which the verify reproduces"),
    Need("mlx_lm.models.gated_delta:normalize_qk", ("q", "k", "inv_scale", "eps"),
         why="metal/: the verify normalizes q, k as plain decoding does"),
    Need("mlx_lm.models.gated_delta:compute_g", ("A_log", "a", "dt_bias"),
         why="metal/launch.py: the decay the GDN kernel's gates use"),
    Need("mlx_lm.models.base:create_ssm_mask", ("h", "cache"),
         why="models/qwen4_exp.py: the GDN layers' padding mask"),
    Need("mlx_lm.models.pipeline:PipelineMixin", why="models/qwen4_exp.py: pipeline stages"),
    # the server's instance attributes: set by mlx_lm's handler and generator,
    # read by server/ (its handler's response building, its generation thread)
    Need("mlx_lm.server:APIHandler",
         sets=("chat_template_kwargs", "created", "logprobs", "max_tokens", "object_type",
               "response_generator", "stream", "top_logprobs", "stream_options",
               "requested_model", "requested_draft_model", "adapter", "num_draft_tokens",
               "temperature", "top_p", "top_k", "min_p", "xtc_probability", "xtc_threshold",
               "logit_bias", "repetition_penalty", "repetition_context_size",
               "presence_penalty", "presence_context_size", "frequency_penalty",
               "frequency_context_size", "seed"),
         why="server/handler.py reads what mlx_lm's do_POST sets (its request's fields)"),
    Need("mlx_lm.server:ResponseGenerator.__init__",
         sets=("model_provider", "prompt_cache", "requests", "_is_distributed", "_rank", "_stop",
               "_generation_thread", "_generation_failed"),
         why="server/generation.py replaces the generation loop on these"),
    Need("mlx_lm.sample_utils:apply_top_p", ("logprobs", "top_p")),
    Need("mlx_lm.sample_utils:apply_min_p", ("logprobs", "min_p", "min_tokens_to_keep")),
    Need("mlx_lm.sample_utils:apply_top_k", ("logprobs", "top_k")),
    Need("mlx_lm.sample_utils:greedy_sampler", ("logprobs",)),
    Need("mlx_lm.utils:infer_quant_config", ("path", "module", "weights")),
    Need("mlx_lm.utils:load_model",
         ("model_path", "lazy", "strict", "model_config", "get_model_classes")),
    Need("mlx_lm.utils:load_tokenizer", ("model_path", "tokenizer_config_extra")),
    # the tool-call formats server/structured.py writes (`tool_call_format`):
    # each module's parse_tool_call(text, tools) and its start / end markers
    Need("mlx_lm.tool_parsers.json_tools:parse_tool_call", ("text", "tools")),
    Need("mlx_lm.tool_parsers.json_tools:tool_call_start"),
    Need("mlx_lm.tool_parsers.json_tools:tool_call_end"),
    Need("mlx_lm.tool_parsers.qwen3_coder:parse_tool_call", ("model_output", "tools")),
    Need("mlx_lm.tool_parsers.qwen3_coder:tool_call_start"),
    Need("mlx_lm.tool_parsers.qwen3_coder:tool_call_end"),
    # mlx_lm.server's dataclasses, built or read by server/
    Need("mlx_lm.server:CompletionRequest",
         fields=("request_type", "prompt", "messages", "tools", "role_mapping"),
         why="built positionally in this order", positional=True),
    Need("mlx_lm.server:Response",
         fields=("text", "token", "logprob", "finish_reason", "top_tokens"),
         why="built positionally in this order", positional=True),
    Need("mlx_lm.server:GenerationContext",
         fields=("has_tool_calling", "has_thinking", "tool_parser", "text_sm", "initial_state",
                 "prompt", "prompt_cache_count", "_should_stop"),
         why="filled by name; _should_stop read (a client that left)"),
    Need("mlx_lm.server:GenerationContext.stop", ("self",)),
    # GenerationArguments: built by name (`generation_arguments`), read by name
    Need("mlx_lm.server:GenerationArguments",
         fields=("model", "sampling", "logits", "stop_words", "max_tokens", "num_draft_tokens",
                 "top_logprobs", "seed", "chat_template_kwargs")),
    Need("mlx_lm.server:ModelDescription", fields=("model", "draft", "adapter")),
    Need("mlx_lm.server:SamplingArguments",
         fields=("temperature", "top_p", "top_k", "min_p", "xtc_probability", "xtc_threshold")),
    Need("mlx_lm.server:LogitsProcessorArguments",
         fields=("logit_bias", "repetition_penalty", "repetition_context_size",
                 "presence_penalty", "presence_context_size", "frequency_penalty",
                 "frequency_context_size")),
    # mlx_lm.server.ResponseGenerator: overridden or called by MTPResponseGenerator
    Need("mlx_lm.server:ResponseGenerator", ("model_provider", "prompt_cache")),
    Need("mlx_lm.server:ResponseGenerator._run_generate", ("self",),
         why="the generation thread's target; overridden (sharded: on generation_stream)"),
    Need("mlx_lm.server:ResponseGenerator._generate", ("self",),
         why="the generation loop; overridden (MTP batches)"),
    Need("mlx_lm.server:ResponseGenerator._tokenize", ("self", "tokenizer", "request", "args"),
         why="returns (prompt, segments, segment_types, initial_state, vision); of args "
             "reads only chat_template_kwargs (the handler's preflight passes just that)"),
    Need("mlx_lm.server:ResponseGenerator._make_state_machine",
         ("self", "model_key", "tokenizer", "stop_words"),
         why="returns (StopSequences, TextStateMachine)"),
    Need("mlx_lm.server:ResponseGenerator._share_object", ("self", "obj"),
         why="rank 0's object to every rank (rank 0 and one process: the object itself)"),
    Need("mlx_lm.server:ResponseGenerator.generate",
         ("self", "request", "generation_args", "progress_callback"),
         why="queues (response queue, request, args); the queue answers the context, "
             "(done, total) progress, Responses, then None, or an exception"),
    Need("mlx_lm.server:ResponseGenerator.generation_available", ("self",)),
    Need("mlx_lm.server:ResponseGenerator.stop_and_join", ("self",),
         why="overridden (the shutdown's grace); sets _stop, joins _generation_thread"),
    Need("mlx_lm.server:ResponseGenerator.join", ("self",)),
    # mlx_lm.server.ModelProvider: MTPModelProvider
    Need("mlx_lm.server:ModelProvider._load",
         ("self", "model_path", "adapter_path", "draft_model_path"), why="overridden"),
    Need("mlx_lm.server:ModelProvider.load",
         ("self", "model_path", "adapter_path", "draft_model_path")),
    Need("mlx_lm.server:ModelProvider.load_default", ("self",)),
    Need("mlx_lm.server:ModelProvider.reset", ("self",)),
    # mlx_lm.server.APIHandler: MTPAPIHandler
    Need("mlx_lm.server:APIHandler.do_POST", ("self",),
         why="reads the body from rfile by Content-Length (`hand_body_to`)"),
    Need("mlx_lm.server:APIHandler.do_GET", ("self",)),
    Need("mlx_lm.server:APIHandler.validate_model_parameters", ("self",),
         why="checks num_draft_tokens as an int (`validate_depth`)"),
    Need("mlx_lm.server:APIHandler.handle_completion", ("self", "request", "stop_words"),
         why="overridden (do_POST calls it); its loop is server/handler.py's `_complete`"),
    Need("mlx_lm.server:APIHandler.handle_models_request", ("self",)),
    Need("mlx_lm.server:APIHandler.generate_response",
         ("self", "text", "finish_reason", "prompt_token_count", "completion_token_count",
          "prompt_cache_count", "token_logprobs", "top_tokens", "tokens", "tool_calls",
          "reasoning_text"),
         why="overridden: token_logprobs and top_tokens passed as None by name (our logprobs "
             "replace its); reads the handler's stream, logprobs, top_logprobs, object_type"),
    Need("mlx_lm.server:APIHandler.completion_usage_response",
         ("self", "prompt_token_count", "completion_token_count", "prompt_cache_count")),
    Need("mlx_lm.server:APIHandler._set_completion_headers", ("self", "status_code")),
    Need("mlx_lm.server:APIHandler._set_stream_headers", ("self", "status_code")),
    # cache methods cycle.py calls on mlx_lm's caches (batched prefill)
    Need("mlx_lm.models.cache:KVCache.merge", ("caches",), why="a batch cache over rows' KVCaches"),
    Need("mlx_lm.models.cache:ArraysCache.merge", ("caches",)),
    Need("mlx_lm.models.cache:BatchKVCache.prepare",
         ("self", "left_padding", "lengths", "right_padding")),
    Need("mlx_lm.models.cache:BatchKVCache.finalize", ("self",)),
    Need("mlx_lm.models.cache:BatchKVCache.extract", ("self", "idx")),
    Need("mlx_lm.models.cache:BatchKVCache.empty", ("self",)),
    Need("mlx_lm.models.cache:ArraysCache.prepare", ("self", "lengths")),
    Need("mlx_lm.models.cache:ArraysCache.finalize", ("self",)),
    Need("mlx_lm.models.cache:ArraysCache.extract", ("self", "idx")),
    Need("mlx_lm.models.cache:ArraysCache.empty", ("self",)),
    Need("mlx_lm.models.cache:CacheList.merge", ("caches",),
         why="qwen4_exp's QSA layer: a BatchKVCache per KVCache of the list"),
    Need("mlx_lm.models.cache:CacheList.prepare", ("self",)),
    Need("mlx_lm.models.cache:CacheList.finalize", ("self",)),
    Need("mlx_lm.models.cache:CacheList.extract", ("self", "idx")),
    # the model classes families/ subclasses or builds (families/*.py import the
    # model modules themselves: a family file is where a model's internals are read)
    Need("mlx_lm.models.qwen3_5:Model", ("args",)),
    Need("mlx_lm.models.qwen3_5:ModelArgs"),
    Need("mlx_lm.models.qwen3_5:TextModelArgs"),
    Need("mlx_lm.models.qwen3_5:DecoderLayer", ("args", "layer_idx")),
    Need("mlx_lm.models.qwen3_5:GatedDeltaNet.__call__", ("self", "inputs", "mask", "cache")),
    Need("mlx_lm.models.qwen3_5_moe:Model", ("args",)),
    Need("mlx_lm.models.qwen3_5_moe:ModelArgs"),
    Need("mlx_lm.models.qwen3_next:Model", ("args",)),
    Need("mlx_lm.models.qwen3_next:ModelArgs.from_dict", ("params",)),
    Need("mlx_lm.models.qwen3_next:Qwen3NextDecoderLayer", ("args", "layer_idx")),
    Need("mlx_lm.models.qwen3_next:Qwen3NextGatedDeltaNet.__call__",
         ("self", "inputs", "mask", "cache")),
    # what families/qwen4_exp.py builds its trunk and head from (docs/qwen4_exp.md),
    # and the cache kind its attention layers use (`.caches` read by cache.py)
    Need("mlx_lm.models.qwen3_5:GatedDeltaNet", ("config",)),
    Need("mlx_lm.models.qwen3_next:Qwen3NextAttention", ("args",)),
    Need("mlx_lm.models.qwen3_next:Qwen3NextAttention.__call__", ("self", "x", "mask", "cache")),
    Need("mlx_lm.models.qwen3_next:Qwen3NextSparseMoeBlock", ("args",)),
    Need("mlx_lm.models.qwen3_next:Qwen3NextRMSNormGated", ("hidden_size", "eps")),
    Need("mlx_lm.models.qwen3_next:Qwen3NextRMSNormGated.__call__",
         ("self", "hidden_states", "gate")),
    Need("mlx_lm.models.cache:CacheList", ("caches",)),
    # a batched prefill as qwen4_exp's layers read it: a BatchKVCache's rows
    # start after `.left_padding` (the indexer counts blocks from there), and
    # ArraysCache.make_mask(N) is each row's one run of valid positions (the PLE)
    Need("mlx_lm.models.cache:BatchKVCache", ("left_padding",)),
    Need("mlx_lm.models.cache:ArraysCache.make_mask", ("self", "N")),
]


def _resolve(path: str, import_module=importlib.import_module):
    module, _, qualified = path.partition(":")
    obj = import_module(module)
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return obj


def _name(path: str) -> str:
    return path.replace(":", ".")


def problems(needs=None, import_module=importlib.import_module) -> List[str]:
    """What no longer holds in the installed mlx_lm, one line per change,
    each naming the symbol; [] when everything in `needs` (RELIED_ON) does."""
    out = []
    for need in RELIED_ON if needs is None else needs:
        name = _name(need.path)
        try:
            obj = _resolve(need.path, import_module)
        except (ImportError, AttributeError) as e:
            out.append(f"{name}: not found in mlx_lm ({e}){_because(need)}")
            continue
        if need.params is not None:
            try:
                have = tuple(inspect.signature(obj).parameters)
            except (TypeError, ValueError) as e:
                out.append(f"{name}: no signature to check ({e})")
            else:
                if have[:len(need.params)] != need.params:
                    out.append(f"{name}: parameters are now ({', '.join(have)}); mlx_mtp "
                               f"passes ({', '.join(need.params)}){_because(need)}")
        if need.sets is not None:
            import re

            assigned = set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(obj)))
            gone = [a for a in need.sets if a not in assigned]
            if gone:
                out.append(f"{name}: no longer sets {', '.join(gone)}, which mlx_mtp reads"
                           f"{_because(need)}")
        if need.fields is not None:
            have = tuple(f.name for f in dataclasses.fields(obj)) \
                if dataclasses.is_dataclass(obj) else None
            if have is None:
                out.append(f"{name}: no longer a dataclass{_because(need)}")
            elif (have[:len(need.fields)] != need.fields if need.positional
                  else not set(need.fields) <= set(have)):
                out.append(f"{name}: fields are now ({', '.join(have)}); mlx_mtp relies on "
                           f"({', '.join(need.fields)}){_because(need)}")
    return out


def _because(need: Need) -> str:
    return f" [{need.why}]" if need.why else ""
