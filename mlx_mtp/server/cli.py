"""The server's flags and `main`: load the model, start the generation
thread, serve HTTP until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import signal
import sys
import threading
import warnings

import mlx.core as mx

from .. import checks, params
from ..loader import CheckpointError
from ..mlx_lm_compat import parse_size, run_http_server
from ..ngram_tables import MEMORY_SHARE, MODES
from ..vision import ImageLimits
from .generation import RANK_GRACE_S, MTPModelProvider, MTPResponseGenerator
from .handler import MTPAPIHandler, _HTTPServer
from .prompt_store import DiskTier, TieredPromptCache, default_disk_bytes, model_fingerprint


# mlx_lm.server's flags for what mlx_mtp does not do (params.UNSUPPORTED says why)
REFUSED_FLAGS = ("adapter_path", "kv_bits")


def build_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's flags (same names and defaults), plus the MTP ones; the
    numeric ones are range-checked by the table in params.py (a bad value:
    one `error:` line, exit 2). See also `parse_args`."""
    flag = functools.partial(params.flag, surface="server")
    p = params.ArgumentParser(prog="python -m mlx_mtp.server",
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
                   type=flag("draft_tokens"),
                   default=params.DecodeOptions.draft_tokens,
                   help="MTP draft depth, or 'auto' (default)")
    p.add_argument("--max-draft-tokens", type=flag("max_draft_tokens"),
                   default=params.DecodeOptions.max_draft_tokens,
                   help="largest depth 'auto' tries")
    p.add_argument("--draft-model", type=str, default=None, metavar="FOLDER",
                   help="a folder holding an MTP head for a trunk without one (mlx-vlm's "
                        "split drafter, or mtp.* files with their config)")
    p.add_argument("--ngram-tables", choices=list(MODES), default="auto",
                   help="where a qwen4_exp model's n-gram tables stay: memory, disk "
                        "(memory-mapped, rows read per lookup; decoding runs uncompiled) or "
                        "auto (default: memory while the checkpoint takes at most "
                        f"{MEMORY_SHARE * 100:.0f}%% of this machine's memory)")
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
    p.add_argument("--prefill-step-size", type=flag("prefill_step_size"),
                   default=params.DecodeOptions.prefill_step_size)
    p.add_argument("--prompt-cache-size", type=flag("prompt_cache_size"), default=10,
                   help="prompt cache entries kept (least recently used dropped first)")
    p.add_argument("--prompt-cache-bytes", type=size("--prompt-cache-bytes"), default=None,
                   help="prompt cache size limit, e.g. 8GB (the finished chats' next-turn caches "
                        "count against it too)")
    p.add_argument("--prompt-cache-dir", type=str, default=None, metavar="DIR",
                   help="keep prompt caches on disk too, in this folder: a long prefix (an "
                        "agent's system prompt and tools, a conversation so far) is not "
                        "prefilled again after a restart; servers of any model may share it")
    p.add_argument("--prompt-cache-disk-bytes", type=size("--prompt-cache-disk-bytes", auto=True),
                   default=None, metavar="SIZE",
                   help="the most the --prompt-cache-dir folder holds, least recently used "
                        "entries removed first, e.g. 20GB (default 'auto': 32 GiB, or half the "
                        "disk's free space if less)")
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
    # mlx_mtp's own: what a server left running for agents needs
    p.add_argument("--strict-model", action="store_true",
                   help="answer 404 to a request naming another model than this one (default: "
                        "serve any name a client sends, e.g. Claude Code's or the OpenAI SDK's "
                        "own ids, answering with this model's id)")
    p.add_argument("--shutdown-grace", type=flag("shutdown_grace"), default=5.0,
                   metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long requests in flight may still run; those "
                        "left then end with an error event in their protocol (default: 5)")
    p.add_argument("--idle-chunk-ms", type=flag("idle_chunk_ms"), default=20.0, metavar="MS",
                   help="idle-time work (prefilling a chat's next turn) runs in chunks of "
                        "about this long: a request arriving meanwhile waits for one chunk")
    images = ImageLimits()  # (the defaults' one home: vision.py)
    p.add_argument("--max-images", type=flag("max_images"), default=images.max_images,
                   metavar="N",
                   help="images one request may carry (a Qwen3.5/3.6 or qwen4_exp folder with "
                        "its vision tower; pip install 'mlx-mtp[vision]')")
    p.add_argument("--max-image-pixels", type=flag("max_image_pixels"),
                   default=images.max_pixels, metavar="N",
                   help="pixels one image may have (checked before decoding)")
    p.add_argument("--max-image-bytes", type=size("--max-image-bytes"),
                   default=images.max_bytes, metavar="SIZE",
                   help=f"encoded bytes one image may have (default {images.max_bytes >> 20}MiB); "
                        "an inline (base64) image is also within --max-body-bytes, raise both")
    p.add_argument("--image-timeout", type=flag("image_timeout"), default=images.timeout,
                   metavar="SECONDS",
                   help="time one image URL's fetch may take in all (connecting, every byte)")
    p.add_argument("--read-timeout", type=flag("read_timeout"), default=30.0, metavar="SECONDS",
                   help="a request (line, headers, body) that sends nothing for this long gets "
                        "408 and its connection closed (default: 30)")
    p.add_argument("--max-body-bytes", type=size("--max-body-bytes", auto=True), default=None,
                   metavar="SIZE",
                   help="the largest request body taken, e.g. 16MB (default 'auto': 128 bytes "
                        "per token of the model's context plus 1 MiB, at most 64 MiB)")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers over the ranks (pipeline "
                        "parallel) instead of sharding each layer (tensor parallel)")
    p.add_argument("--context-drafts", action=argparse.BooleanOptionalAction,
                   default=params.DecodeOptions.context_drafts,
                   help="where a row's last tokens occurred before in its conversation or "
                        "answer, draft what followed them there (a copied span at copy "
                        "speed; answers are unchanged)")
    return p


def size(name: str, auto: bool = False):
    """argparse `type=` of a size flag: mlx_lm.server's sizes ("8GB", "500M",
    a number of bytes), or 'auto' (None) where `auto`; a bad one is one
    `error:` line (mlx_lm's parser raises a KeyError on "12XB")."""
    def convert(text: str):
        if auto and text == "auto":
            return None
        try:
            value = parse_size(text)
            if value <= 0:
                raise ValueError
        except Exception:
            raise argparse.ArgumentTypeError(
                f"{name} must be a size such as 8GB, 500MB or 1000000 (units M, MB, G, GB; "
                f"none: bytes){' or auto' if auto else ''}, not {text!r}") from None
        return value

    convert.__name__ = name
    return convert


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


DISK_FLUSH_S = 30  # at a shutdown, seconds the prompt cache's queued entries get to be written


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
    for name in REFUSED_FLAGS:
        if getattr(args, name):
            print(f"error: mlx_mtp.server does not support --{name.replace('_', '-')} "
                  f"({params.UNSUPPORTED[name]})", file=sys.stderr)
            return 2
    if args.pipeline and rank is None:
        logging.warning("--pipeline splits a model over mlx.launch ranks; in one process it "
                        "has no effect")
    # mlx_lm.server's request handler reads this one
    args.num_draft_tokens = None
    served_id = args.model or "mlx-mtp-demo"
    if args.model is None:
        from ..loader import demo_model_path

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
    disk = None
    if args.prompt_cache_dir is not None:
        try:
            disk = DiskTier(args.prompt_cache_dir, args.prompt_cache_disk_bytes or
                            default_disk_bytes(args.prompt_cache_dir),
                            model_fingerprint(provider.model), provider.check_cache)
        except OSError as e:
            print(f"error: {where}--prompt-cache-dir {args.prompt_cache_dir}: "
                  f"{e.strerror or e}", file=sys.stderr)
            return _exit(2)
    cache = TieredPromptCache(args.prompt_cache_size, args.prompt_cache_bytes or 1 << 62, disk)
    # (SIGINT is ignored in background jobs: set it, like SIGTERM, before the
    # generation thread starts, so no signal finds the process unprepared)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _follow if rank else _interrupt)
    generator = MTPResponseGenerator(provider, cache)
    if rank:  # the other ranks follow rank 0's generation loop, which tells them to stop
        generator.join()  # (or fails them with one line when rank 0 is gone)
        return _exit(1 if generator.failed else 0)
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
    if disk is not None:  # entries still queued are written (a killed server loses them, whole)
        disk.close(timeout=DISK_FLUSH_S)
    logging.info("stopped")
    if rank is not None and generator.failed:  # sharded: a rank was lost
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
