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

The package, module by module: `schemas.py` (request schemas, validation,
`ApiError`), `anthropic.py` (the Messages API over the chat machinery),
`generation.py` (the model provider and the generation thread), `lane.py`
(the batch requests decode in), `handler.py` (HTTP), `cli.py` (flags and
`main`); `python -m mlx_mtp.server` runs `__main__.py`.
"""

from .cli import build_parser, main, parse_args  # noqa: F401 (the entry points)

__all__ = ["build_parser", "main", "parse_args"]
