"""Measure MTP acceptance per draft position with the head at several precisions.

    python -m mlx_mtp.convert.measure_head --hf-path SRC [--q-bits 4] [--bits 16 8 4]

Converts SRC once per head precision (same trunk every time: unquantized, or
--q-bits), decodes greedily with `mlx_mtp` at --depth on the prompts and
reports the acceptance at each draft position, plus the teacher-forced
estimate of `mlx_mtp.evaluate` on the generated text. This is how the default
of --mtp-bits was chosen (convert/README.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

DEFAULT_PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works.",
    "def fibonacci(n):",
    "List five facts about the Moon.",
]


def measure(src, bits_list=(16, 8, 4), q_bits: Optional[int] = None, dtype: Optional[str] = None,
            depth: int = 3, max_tokens: int = 128, prompts: Optional[List[str]] = None,
            workdir: Optional[Path] = None, text: Optional[str] = None,
            text_tokens: int = 2048) -> Dict[int, dict]:
    import contextlib
    import io

    import mlx.core as mx

    import mlx_mtp
    from mlx_mtp.decode import generate_tokens
    from mlx_mtp.stats import MTPStats
    from mlx_mtp.evaluate import expected_acceptance

    from .convert import convert

    prompts = prompts or DEFAULT_PROMPTS
    results: Dict[int, dict] = {}
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for bits in bits_list:
            out = Path(tmp) / f"head{bits}"
            with contextlib.redirect_stdout(io.StringIO()):
                convert(src, out, quantize=q_bits is not None, q_bits=q_bits, dtype=dtype, mtp_bits=bits)
            model, tok = mlx_mtp.load(out, quiet=True)
            stats = MTPStats()
            generated = []
            for p in prompts:
                if tok.has_chat_template:
                    ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                else:
                    ids = tok.encode(p)
                toks = [t for t, _, _ in generate_tokens(mx.array(ids), model, max_tokens=max_tokens,
                                                           draft_tokens=depth, stats=stats)]
                generated.append(list(ids) + toks)
            if text is not None:  # teacher-forced on the given text instead of the generations
                generated = [tok.encode(text[: text_tokens * 16])[:text_tokens]]
            tf = [expected_acceptance(model, g, depth) for g in generated if len(g) > depth + 2]
            tf_acc = [sum(r["acceptance"][i] * r["starts"] for r in tf) / max(1, sum(r["starts"] for r in tf))
                      for i in range(depth)]
            results[bits] = {
                "decode_acceptance": stats.acceptance,
                "tokens_per_cycle": stats.tokens_per_cycle,
                "teacher_forced_acceptance": tf_acc,
                "cycles": stats.cycles,
                "head_bytes": sum(f.stat().st_size for f in out.glob("model*.safetensors")
                                  if any(k.startswith("mtp.") for k in mx.load(str(f)))),
            }
            del model
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_mtp.convert.measure_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-path", required=True)
    p.add_argument("--q-bits", type=int, default=None, help="trunk bits (default: unquantized)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--bits", type=int, nargs="+", default=[16, 8, 4])
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts-file", default=None, help="one prompt per line")
    p.add_argument("--text-file", default=None,
                   help="teacher-forced acceptance on this text (default: on the generations)")
    p.add_argument("--text-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    prompts = Path(a.prompts_file).read_text().splitlines() if a.prompts_file else None
    text = Path(a.text_file).read_text() if a.text_file else None
    res = measure(a.hf_path, a.bits, a.q_bits, a.dtype, a.depth, a.max_tokens, prompts,
                  text=text, text_tokens=a.text_tokens)
    if a.json:
        print(json.dumps(res, indent=1))
        return 0
    trunk = f"{a.q_bits}-bit" if a.q_bits else (a.dtype or "source dtype")
    print(f"trunk {trunk}, depth {a.depth}, {a.max_tokens} tokens x {len(prompts or DEFAULT_PROMPTS)} prompts")
    print("head  | decode acceptance per position | tokens/cycle | teacher-forced per position | head size")
    for bits, r in res.items():
        dec = " ".join(f"{x:5.1%}" for x in r["decode_acceptance"])
        tf = " ".join(f"{x:5.1%}" for x in r["teacher_forced_acceptance"])
        print(f"{bits:>4}b | {dec:<30} | {r['tokens_per_cycle']:12.2f} | {tf:<27} | {r['head_bytes'] / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
