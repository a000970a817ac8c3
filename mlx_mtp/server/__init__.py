"""`python -m mlx_mtp.server`: an OpenAI- and Anthropic-compatible server
that decodes with the model's MTP head.

It is mlx_lm's server (`mlx_lm.server`: the standard library's threaded HTTP
server, its request parsing and validation, chat templates, tool-call and
reasoning handling, response and SSE building, the single generation thread)
with three subclasses:

- `MTPModelProvider` loads with `mlx_mtp.load` and serves that one model,
  under any name a client sends (`--strict-model`: its own names only);
- `MTPResponseGenerator` decodes requests together in batches (batch.py's
  `Batch`: one trunk forward per cycle, each row accepting its own drafts;
  rows join and leave between cycles, each sampling with its own settings;
  a request differing in what a batch shares waits for it to drain),
  with a prefix cache: mlx_lm's `LRUPromptCache`, bounded by entries and
  bytes, over a folder on disk (`--prompt-cache-dir`, prompt_store.py),
  with snapshots where a recurrent state can be restored exactly (the end
  of the system prompt, of the last user message, of the prompt, of each
  answer, and a chat's next-turn prefix, prefilled after its answer);
  GDN states cannot be trimmed, so only an exact stored prefix is ever reused;
- `MTPAPIHandler` checks requests before mlx_lm's handler sees them (route
  and method, API key, the body's size before it is read and its upload's
  pace, JSON, schemas, what cannot be honoured, the prompt's size before it
  is tokenized, context length, a bounded queue) and answers errors with
  OpenAI's error object; it adds MTP statistics to `usage`, writes logprobs
  in OpenAI's shape, decodes `n` choices as batch rows, and serves
  `POST /v1/messages` (Anthropic Messages, anthropic.py) and
  `POST /v1/responses` (responses.py). A request that fails once its answer began ends with its
  protocol's error event; SIGTERM lets requests in flight finish within
  `--shutdown-grace` first.

At temperature 0 the text equals mlx_lm.server's for the same request, up
to where a stop string ends it (tests/test_server.py runs both as processes;
docs/server.md's table of differences). See docs/design.md, "Server".

Under `mlx.launch` (a model sharded with `sharded_load`, `--pipeline` as in
mlx_lm.server) rank 0 serves HTTP and every rank runs the generation loop in
lockstep; what only rank 0 knows reaches the others through `_tick`
(docs/distributed.md, "The server over ranks").

The package, module by module: `schemas.py` (request schemas, validation,
`ApiError`, errors in each API's words), `anthropic.py` (the Messages API
over the chat machinery), `responses.py` (OpenAI's Responses API over it),
`roles.py` (where system messages go, for every API),
`generation.py` (the model provider, the generation thread, the shutdown),
`lane.py` (the batch requests decode in), `stops.py` (stop strings on the
text), `answer.py` (what an answer says and how it ended, for both APIs),
`structured.py` (grammars, forced calls), `handler.py` (HTTP), `logprobs.py`
(OpenAI's logprobs shape), `prompt_store.py` (the prefix cache's disk tier),
`cli.py` (flags and `main`); `python -m
mlx_mtp.server` runs `__main__.py`.
"""

from .cli import build_parser, main, parse_args  # noqa: F401 (the entry points)

__all__ = ["build_parser", "main", "parse_args"]
