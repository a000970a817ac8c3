"""Command line: python -m mlx_mtp.convert (see --help).

Exit status:
  0    the output was published and is complete (also when SIGINT/SIGTERM
       arrived after publishing: the signal no longer changes anything);
  1    an error, reported in one line (MLX_MTP_DEBUG=1 shows the traceback);
  2    bad command-line arguments (argparse);
  130  SIGINT, 143 SIGTERM (129 SIGHUP) before the output was published: temporary
       files removed, nothing published (an existing output / --graft target unchanged).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from mlx_mtp import params

from . import interrupts

# Errors whose message is meant for the user as it is; anything else is reported
# as unexpected (still one line).
_EXPECTED = (ValueError, OSError, KeyError)


def build_parser() -> argparse.ArgumentParser:
    from .common import MTP_BITS_CHOICES

    p = params.ArgumentParser(
        prog="python -m mlx_mtp.convert",
        description=(
            "Convert a Qwen3.5/3.6, Qwen3-Next or Qwen3.8-Flash-Next (qwen4_exp) checkpoint to "
            "MLX keeping the multi-token-prediction head (mtp.*), or graft the head into an "
            "existing MLX conversion."
        ),
    )
    p.add_argument("--hf-path", "--model", required=True,
                   help="source: Hugging Face repo id or local folder (HF or MLX layout)")
    p.add_argument("--mlx-path", default=None, help="output folder (convert)")
    p.add_argument("--graft", metavar="MLX_DIR", default=None,
                   help="add the source's MTP head to this existing MLX folder instead of converting")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the trunk")
    p.add_argument("--q-bits", type=int, choices=(2, 3, 4, 5, 6, 8), default=None,
                   help="trunk bits (default 4, as mlx_lm)")
    p.add_argument("--q-group-size", type=int, choices=(32, 64, 128), default=None,
                   help="group size (default 64, as mlx_lm)")
    p.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=None,
                   help="dtype of unquantized weights (default: the checkpoint's torch_dtype, as mlx_lm)")
    p.add_argument("--mtp-bits", type=int, choices=MTP_BITS_CHOICES, default=None,
                   help="head precision; 16 = unquantized (default: 8 when the trunk is quantized, else 16)")
    p.add_argument("--force", action="store_true",
                   help="replace --mlx-path if it holds a model (config.json + *.safetensors) (convert), "
                        "or replace an existing head (graft)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    return p


def _convert(args):
    from .common import ConvertError

    if args.graft:
        if args.mlx_path or args.quantize or args.q_bits:
            raise ConvertError("--graft takes --hf-path, --mtp-bits, --q-group-size, --dtype, --force only")
        from .graft import graft, print_summary

        s = graft(args.graft, args.hf_path, mtp_bits=args.mtp_bits, q_group_size=args.q_group_size,
                  dtype=args.dtype, force=args.force, revision=args.revision)
    else:
        if not args.mlx_path:
            raise ConvertError("--mlx-path is required (or --graft MLX_DIR)")
        from .convert import convert, print_summary

        s = convert(args.hf_path, args.mlx_path, quantize=args.quantize, q_bits=args.q_bits,
                    q_group_size=args.q_group_size, dtype=args.dtype, mtp_bits=args.mtp_bits,
                    force=args.force, revision=args.revision)
    return s, print_summary


def _one_line(e: BaseException) -> str:
    from .common import ConvertError

    text = str(e).strip()
    msg = text.splitlines()[0] if text else type(e).__name__
    if isinstance(e, (FileNotFoundError, PermissionError)) and e.filename and str(e.filename) not in msg:
        msg = f"{msg}: {e.filename}"
    if not isinstance(e, (ConvertError,) + _EXPECTED):
        msg = f"unexpected {type(e).__name__}: {msg} (MLX_MTP_DEBUG=1 shows the traceback)"
    return msg


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _run(argv, g) -> int:
    done = None  # (summary, print_summary)
    error = None
    interrupted = None
    try:
        try:
            args = build_parser().parse_args(argv)
            interrupts.pause_point("start")
            done = _convert(args)
        except KeyboardInterrupt as e:  # interrupts.Interrupted included
            interrupted = e
        except SystemExit:  # argparse: --help (0) or bad arguments (2), already reported
            g.close()
            interrupts.remove_all_temps()
            raise
        except Exception as e:
            error = e
        g.close()  # from here on a signal is only recorded
    except KeyboardInterrupt as e:  # a signal between the end of the work and close()
        g.close()
        interrupted = interrupted or e
    all_removed = interrupts.remove_all_temps()
    left = "" if all_removed else f" (could not remove {', '.join(map(str, sorted(g.temps)))})"

    if g.published is not None:
        if done is not None:
            summary, print_summary = done
            try:
                print_summary(summary)
                sys.stdout.flush()
            except (OSError, ValueError):
                pass
        elif error is not None:  # after publishing: the output is complete all the same
            _say(f"mlx_mtp.convert: warning: {g.published} was published and is complete, "
                 f"but then: {_one_line(error)}")
        if g.signum is not None:
            name = signal.Signals(g.signum).name
            _say(f"mlx_mtp.convert: {name} received after {g.published} was published; "
                 "the output is complete (exit 0)")
        return 0
    signum = g.signum if g.signum is not None else (
        getattr(interrupted, "signum", signal.SIGINT) if interrupted is not None else None)
    if signum is not None:
        name = signal.Signals(signum).name
        _say(f"mlx_mtp.convert: interrupted by {name} before the output was published; "
             f"nothing was changed{left or (', temporary files removed' if g.made_temps else '')}")
        return 128 + signum
    if error is not None:
        if params.env_flag("MLX_MTP_DEBUG"):
            raise error
        _say(f"mlx_mtp.convert: error: {_one_line(error)}{left}")
        return 1
    _say("mlx_mtp.convert: error: the run ended without publishing its output")  # not reached
    return 1


def main(argv=None) -> int:
    """The command line; `argv` None: this process is the command (sys.argv)."""
    standalone = argv is None
    with interrupts.guard(standalone=standalone) as g:
        rc = _run(argv, g)
    if standalone and rc > 128:
        # Interrupted and cleaned up: leave now, without waiting for threads a
        # library may still run (a hub download) or running their cleanups.
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
