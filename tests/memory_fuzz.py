"""Hostile samplers, logits processors, drafters and ids against the decoder,
run by tests/test_memory_safety.py in a child process: a read past a buffer
would kill the process (MLX's take and slice_update check no bounds), which
a test in the same process could not report.

    python tests/memory_fuzz.py CHECKPOINT CASES SEED

Each case decodes a few tokens; it must end normally or raise ValueError /
TypeError. Prints one JSON line: outcome counts per kind of hostility.
"""

import json
import random
import sys
from collections import Counter

import mlx.core as mx

import mlx_mtp
from mlx_mtp import decode
from mlx_mtp.testing.drafters import DistributionDrafter, OracleDrafter


def hostile_sampler(rng: random.Random, vocab: int):
    """(kind, sampler, whether it must raise)."""
    kind = rng.choice(["offset", "negative", "late", "float", "shape", "list", "nan", "raises"])
    calls = [0]
    if kind == "offset":
        off = rng.choice([vocab, vocab + 1, 10**6, 2**31 - 1 - vocab])
        return kind, lambda lp: mx.argmax(lp, axis=-1) + off, True
    if kind == "negative":
        off = rng.choice([-1, -vocab, -(2**31) + 1])
        return kind, lambda lp: mx.zeros(lp.shape[:-1], mx.int32) + off, True
    if kind == "late":  # valid for a few calls, then past the vocabulary
        n = rng.randrange(1, 5)

        def late(lp):
            calls[0] += 1
            return mx.argmax(lp, axis=-1) + (10**7 if calls[0] > n else 0)
        return kind, late, None  # raises unless the generation ends first
    if kind == "float":
        return kind, lambda lp: mx.argmax(lp, axis=-1).astype(mx.float32) * 1e9, True
    if kind == "shape":
        return kind, lambda lp: mx.zeros((lp.shape[0] + 1,), mx.int32), True
    if kind == "list":
        return kind, lambda lp: [0] * lp.shape[0], True
    if kind == "nan":
        return kind, lambda lp: (lp * float("nan")).sum(axis=-1).astype(mx.int32), None

    def raises(lp):
        raise ValueError("sampler failed on purpose")
    return kind, raises, True


def hostile_processor(rng: random.Random, vocab: int):
    kind = rng.choice(["wider", "narrower", "none", "nan", "neg_inf", "raises"])
    if kind == "wider":
        return kind, lambda toks, lg: mx.concatenate([lg, mx.full((lg.shape[0], 7), 1e9)], -1), True
    if kind == "narrower":
        return kind, lambda toks, lg: lg[:, : vocab // 2], True
    if kind == "none":
        return kind, lambda toks, lg: None, True
    if kind == "nan":
        return kind, lambda toks, lg: lg * float("nan"), None
    if kind == "neg_inf":
        return kind, lambda toks, lg: mx.full(lg.shape, -float("inf")), None

    def raises(toks, lg):
        raise ValueError("processor failed on purpose")
    return kind, raises, True


def main(path: str, cases: int, seed: int) -> int:
    model, tok = mlx_mtp.load(path, quiet=True)
    V = model.vocab_size
    rng = random.Random(seed)
    prompt = tok.encode("hello world")
    outcomes = Counter()
    for case in range(cases):
        depth = rng.choice([0, 1, 2, 3, "auto"])
        opts = dict(draft_tokens=depth, lookahead=rng.random() < 0.5, compiled=rng.random() < 0.5,
                    max_tokens=rng.randrange(2, 9))
        target = rng.choice(["sampler"] * 3 + ["processor"] * 2 + ["drafter"] * 2 + ["prompt", "bias"])
        must_raise = True
        try:
            if target == "sampler":
                kind, sampler, must_raise = hostile_sampler(rng, V)
                run = lambda: list(decode.generate_tokens(mx.array(prompt), model, sampler=sampler,
                                                        **opts))
            elif target == "processor":
                kind, proc, must_raise = hostile_processor(rng, V)
                run = lambda: list(decode.generate_tokens(mx.array(prompt), model,
                                                        logits_processors=[proc], **opts))
            elif target == "drafter":
                kind = rng.choice(["device", "host"])
                bad = rng.choice([V, V + 3, 10**6, -1, -(10**6)])
                opts["draft_tokens"] = rng.choice([1, 2, 3])
                if kind == "device":  # every draft from its table is outside the vocabulary
                    drafter = OracleDrafter([bad] * 16, vocab_size=V, margin=0)
                    sampler = None
                else:
                    drafter = DistributionDrafter(lambda prefix: [1.0] * V, V, seed=case)
                    drafter.rng = _BadRng(bad)
                    sampler = mlx_mtp.make_sampler(temp=1.0)
                run = lambda: list(decode.generate_tokens(mx.array(prompt), model, drafter=drafter,
                                                        sampler=sampler, seed=case, **opts))
            elif target == "prompt":
                kind = "prompt"
                bad = rng.choice([V, -1, 10**9])
                run = lambda: list(mlx_mtp.stream_generate(model, tok, prompt + [bad], **opts))
            else:
                kind = "bias"
                bad = rng.choice([V, -1, 10**9])
                run = lambda: list(mlx_mtp.stream_generate(
                    model, tok, prompt, logits_processors=mlx_mtp.make_logits_processors(
                        logit_bias={bad: 5.0}), **opts))
            run()
            outcome = "completed"
        except (ValueError, TypeError) as e:
            outcome = "refused"
            if not str(e).strip():
                outcome = "refused without a message"
        if must_raise is True and outcome != "refused":
            outcome = f"{outcome} (should have been refused)"
        outcomes[f"{target}:{kind}:{outcome}"] += 1
    print(json.dumps(outcomes, sort_keys=True))
    return 0


class _BadRng:
    """A host drafter's draws, all `bad` (outside the vocabulary)."""

    def __init__(self, bad: int):
        self.bad = bad

    def choice(self, n, p=None):
        return self.bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
