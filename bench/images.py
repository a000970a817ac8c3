"""Acceptance and speed of MTP on a prompt with images, against plain
decoding (depth 0) of the same model, in one run.

    python bench/images.py [--model FOLDER] [--image PATH ...] [--rounds 5]

FOLDER: a Qwen3.5/3.6 folder with its vision tower (default: a tiny random
one written here: its head accepts nothing, so only the cost side means
anything; a real checkpoint's acceptance needs its weights). mlx_lm cannot
decode images, so plain decoding here is mlx_mtp's depth 0, which the
tests prove equal to transformers' (tests/test_images.py). Rounds
alternate depth 0 and each depth; it prints per depth the generation
tok/s, the median over rounds of the paired ratio to depth 0 [min-max],
and the acceptance, and the prompt's tokens (its image tokens counted).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--image", action="append", default=None, metavar="PATH")
    p.add_argument("--prompt", default="Describe this image in detail.")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--depths", default="1,2,3,auto")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    import mlx.core as mx

    import mlx_mtp
    from mlx_mtp import vision
    from mlx_mtp.decode import generate_tokens
    from mlx_mtp.stats import MTPStats

    folder = args.model
    if folder is None:
        from mlx_mtp.testing.synthetic import write_checkpoint

        folder = write_checkpoint(Path(tempfile.mkdtemp()) / "vl", vision=True)
        print(f"(a tiny random Qwen3.5 VL checkpoint: {folder})", file=sys.stderr)
    model, tok = mlx_mtp.load(str(folder))
    images = [Path(i).read_bytes() for i in args.image] if args.image else [
        np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8)]
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": args.prompt}]
    ids = tok.apply_chat_template([{"role": "user", "content": content}],
                                  add_generation_prompt=True)
    ids, media = vision.prompt_media(model, ids, images)
    depths = [0] + [d if d == "auto" else int(d) for d in args.depths.split(",")]

    def run(k):
        stats = MTPStats()
        tic, n = None, 0
        for n, _ in enumerate(generate_tokens(mx.array(ids), model, draft_tokens=k,
                                              max_tokens=args.max_tokens, media=media,
                                              stats=stats), start=1):
            if n == 1:
                tic = time.perf_counter()  # (the prompt's prefill and tower before it)
        return (n - 1) / max(time.perf_counter() - tic, 1e-9), stats

    run(depths[-1])  # warm: the tower, the graphs
    rows = {k: [] for k in depths}
    accepted = {k: MTPStats() for k in depths}
    for r in range(args.rounds):
        for k in depths:
            tps, stats = run(k)
            rows[k].append(tps)
            accepted[k].add(stats)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{k}: {rows[k][-1]:.1f}" for k in depths), file=sys.stderr)
    print(f"prompt: {len(ids)} tokens, {len(media.pads)} of them "
          f"image tokens ({len(images)} image(s)); {args.max_tokens} generated; "
          f"{args.rounds} rounds, depth 0 and each depth alternating")
    print(f"{'depth':>6} {'tok/s':>8} {'vs depth 0':>18} {'acceptance':>11}")
    for k in depths:
        ratios = [a / b for a, b in zip(rows[k], rows[0])]
        s = accepted[k]
        acc = f"{s.accepted / s.drafted:.0%}" if s.drafted else "-"
        print(f"{str(k):>6} {statistics.median(rows[k]):8.1f} "
              f"{statistics.median(ratios):6.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] {acc:>11}")


if __name__ == "__main__":
    main()
