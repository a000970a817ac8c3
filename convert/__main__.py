"""Command line: python -m mlx_mtp.convert (see --help)."""

from __future__ import annotations

import argparse
import os
import sys

from .common import MTP_BITS_CHOICES


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mlx_mtp.convert",
        description=(
            "Convert a Qwen3.5/3.6 checkpoint to MLX keeping the multi-token-prediction "
            "head (mtp.*), or graft the head into an existing MLX conversion."
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
                   help="replace a non-empty --mlx-path (convert) or an existing head (graft)")
    p.add_argument("--revision", default=None, help="hub revision (branch, tag or commit)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .common import ConvertError

    try:
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
        print_summary(s)
        return 0
    except KeyboardInterrupt:
        print("mlx_mtp.convert: interrupted; nothing was written", file=sys.stderr)
        return 130
    except (ConvertError, ValueError, OSError, KeyError) as e:
        if os.environ.get("MLX_MTP_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, (FileNotFoundError, PermissionError)) and e.filename and str(e.filename) not in msg:
            msg = f"{msg}: {e.filename}"
        print(f"mlx_mtp.convert: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
