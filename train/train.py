"""Train the embedded demo model: a small Qwen3.5-architecture code model
plus its MTP head, on the CPython standard library, with MLX on the CPU.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
        nice -n 10 python -m train.train --out runs/demo

Stages (all seeded; see train/README.md):
 1. corpus: stdlib `*.py` files, ~5% held out by path hash (train/data.py),
    plus chat-formatted function examples from the training files;
 2. byte-level BPE tokenizer (tokenizers), vocab 4096, ChatML specials;
 3. joint training of trunk + MTP head, fp32, AdamW:
        loss = CE(trunk logits[t], tok[t+1]) + lambda * CE(head logits[t], tok[t+2])
    the head sees (trunk post-norm hidden h_t, embed(tok[t+1])) exactly as in
    decoding, with the shared embedding and lm_head (tied);
 4. export in the released Hugging Face layout (train/export.py), reload with
    mlx_mtp.load and check the logits match the training model;
 5. held-out evaluation: trunk / head loss and greedy acceptance (mlx_mtp.evaluate).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import data
from .gdn_chunked import ChunkedGatedDeltaNet

# The shipped configuration (see README for the sizing rationale).
DEFAULT_TEXT_CONFIG = dict(
    model_type="qwen3_5_text",
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=8,  # 6 Gated-DeltaNet + 2 gated attention (interval 4)
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    vocab_size=4096,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    attention_bias=False,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    mtp_num_hidden_layers=1,
)


def full_config(tc: dict, eos_ids) -> dict:
    tc = dict(tc)
    tc["layer_types"] = [
        "full_attention" if (i + 1) % tc["full_attention_interval"] == 0 else "linear_attention"
        for i in range(tc["num_hidden_layers"])
    ]
    tc["eos_token_id"] = eos_ids[0]
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": tc,
        "tie_word_embeddings": tc["tie_word_embeddings"],
        "eos_token_id": list(eos_ids),
        "torch_dtype": "float32",
    }


def build_model(config: dict, chunked: bool = True):
    from mlx_lm.models import qwen3_5

    from mlx_mtp.families.qwen3_5 import Model

    model = Model(qwen3_5.ModelArgs.from_dict(config))
    if chunked:
        # Same parameters; the cache-free full-sequence forward is the chunked form.
        targs = model.language_model.args
        for layer in model.language_model.model.layers:
            if layer.is_linear:
                layer.linear_attn = ChunkedGatedDeltaNet(targs)
    return model


def n_params(model) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def losses(model, x, stop_grad: bool, weights=None):
    """(trunk CE, head CE) on a batch x [B, T]; `weights` [B, T-1] weigh the
    trunk's positions (`copy_weights`), None: all alike."""
    h = model.trunk_hidden(x, None)
    lt = model.logits_from_hidden(h[:, :-1])
    if weights is None:
        l_trunk = nn.losses.cross_entropy(lt, x[:, 1:], reduction="mean")
    else:
        ce = nn.losses.cross_entropy(lt, x[:, 1:], reduction="none")
        l_trunk = (ce * weights).sum() / weights.sum()
    hh = mx.stop_gradient(h[:, :-2]) if stop_grad else h[:, :-2]
    g = model.mtp(hh, model.embed(x[:, 1:-1]))
    l_head = nn.losses.cross_entropy(model.logits_from_hidden(g), x[:, 2:], reduction="mean")
    return l_trunk, l_head


def copy_weights(x: np.ndarray, common: np.ndarray, extra: float) -> np.ndarray:
    """[B, T-1] weights of the next-token targets of windows x [B, T]: 1, or
    1 + `extra` where the target is a rare token (not in `common`) that
    already stood earlier in its window: the positions only copying from the
    context predicts (a name's second use), so the gradient that builds
    in-context copying is not drowned by the rest (train/README.md,
    "Teaching it to copy")."""
    w = np.ones((x.shape[0], x.shape[1] - 1), np.float32)
    for b, row in enumerate(x):
        seen = set()
        for t, tok in enumerate(row[:-1].tolist()):
            seen.add(tok)
            nxt = int(row[t + 1])
            if nxt in seen and not common[nxt]:
                w[b, t] += extra
    return w


def lr_at(step, progress, peak, warmup, floor=0.1):
    """Linear warmup over `warmup` steps, then cosine to floor*peak as
    `progress` (fraction of the run done) goes from 0 to 1."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_at(stream: np.ndarray, B: int, T: int, key) -> np.ndarray:
    """B windows of T tokens at offsets drawn from `key` alone."""
    idx = np.random.default_rng(list(key)).integers(0, len(stream) - T - 1, size=B)
    return np.stack([stream[i : i + T] for i in idx])


def _read_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def initial_weights(path: str) -> dict:
    """Training-model parameters from a ckpt.safetensors, or from a model
    folder (read by mlx_mtp.load: the same classes, so the same names)."""
    if Path(path).is_dir():
        import mlx_mtp

        loaded, _ = mlx_mtp.load(path)
        return dict(tree_flatten(loaded.parameters()))
    return mx.load(path)


def evaluate_loss(model, stream: np.ndarray, T: int, B: int = 8, max_windows: int = 64):
    """Mean trunk / head CE over non-overlapping held-out windows."""
    starts = list(range(0, len(stream) - T, T))[:max_windows]
    lt = lh = 0.0
    n = 0
    for i in range(0, len(starts), B):
        x = mx.array(np.stack([stream[s : s + T] for s in starts[i : i + B]]))
        a, b = losses(model, x, False)
        k = x.shape[0]
        lt += a.item() * k
        lh += b.item() * k
        n += k
    return lt / n, lh / n


def head_agreement(model, stream: np.ndarray, T: int, max_windows: int = 16):
    """Teacher-forced: head argmax at t vs the trunk's own argmax at t+1."""
    agree = tot = 0
    for s in list(range(0, len(stream) - T, T))[:max_windows]:
        x = mx.array(stream[s : s + T])[None]
        h = model.trunk_hidden(x, None)
        greedy = mx.argmax(model.logits_from_hidden(h), axis=-1)[0]
        g = model.mtp(h[:, :-1], model.embed(x[:, 1:]))
        d = mx.argmax(model.logits_from_hidden(g), axis=-1)[0]
        agree += (d == greedy[1:]).sum().item()
        tot += T - 1
    return agree / tot


def write_provenance(demo_dir: Path, summary: dict, args):
    tc = summary["config"]["text_config"]
    acc = ", ".join(f"{a:.1%}" for a in summary["acceptance"])
    (demo_dir / "README.txt").write_text(f"""mlx_mtp demo model: a small Qwen3.5-architecture (qwen3_5) Python code model
with a trained MTP head, trained by train/train.py on the CPython {sys.version.split()[0]}
standard library (see train/README.md). Base model: it continues code; the
chat template wraps a function signature and the model answers with a function.

architecture: hidden {tc['hidden_size']}, {tc['num_hidden_layers']} layers (3 Gated-DeltaNet : 1 gated attention),
FFN {tc['intermediate_size']}, vocab {tc['vocab_size']} (byte-level BPE), tied embeddings, 1 MTP layer;
{summary['params'] / 1e6:.2f}M parameters, float32.
training: {summary['steps']} steps x {args.batch} x {args.seq} tokens, {summary['train_minutes']} min on a 2-core CPU
held-out (5% of files): trunk CE {summary['heldout_loss_trunk']:.3f}, head (t+2) CE {summary['heldout_loss_head']:.3f}
greedy acceptance per draft position 1-4 (teacher-forced, held-out): {acc}

reproduce:
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
    python -m train.train --out runs/demo --steps {summary['steps']} --warmup {args.warmup} --demo-dir mlx_mtp/demo
""")


def log(msg, f=None):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if f is not None:
        f.write(line + "\n")
        f.flush()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo", help="work folder (tokenizer, checkpoints, hf/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=1400)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--mtp-weight", type=float, default=0.5, help="lambda of the head's t+2 loss")
    p.add_argument("--stop-grad", action="store_true",
                   help="do not back-propagate the head loss into the trunk")
    p.add_argument("--chat-fraction", type=float, default=0.15,
                   help="share of training characters in chat-formatted function examples")
    p.add_argument("--corpus", default="stdlib", choices=sorted(data.CORPORA),
                   help="which stdlib files to train on (train/data.py CORPORA)")
    p.add_argument("--chat-max-chars", type=int, default=1200, help="longest chat example")
    p.add_argument("--chat-min-lines", type=int, default=1, help="shortest chat example, in lines")
    p.add_argument("--chat-classes", action="store_true",
                   help="also chat examples of class openings (user: `class Name:`)")
    p.add_argument("--chat-renames", type=int, default=0,
                   help="each chat example this many more times under a random new name")
    p.add_argument("--chat-identifier-renames", type=int, default=0,
                   help="each chat example this many more times with all its names renamed")
    p.add_argument("--copy-weight", type=float, default=0.0,
                   help="extra weight of the trunk's loss where the target repeats a rare "
                        "token of its window (copy_weights); 0: the plain objective")
    p.add_argument("--tokenizer", default=None,
                   help="use this folder's tokenizer.json (e.g. mlx_mtp/demo) instead of training one")
    p.add_argument("--config", default=None, help="JSON overrides of the text config")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--time-limit", type=float, default=None,
                   help="training budget in minutes: the run ends at --steps or when the budget "
                        "is spent, whichever comes first, and the LR schedule follows whichever "
                        "fraction (steps or time) is further along. Without it the run is a "
                        "pure function of the seed and --steps.")
    p.add_argument("--init", default=None,
                   help="start from these weights (a ckpt.safetensors of an earlier run, or a model "
                        "folder mlx_mtp.load reads, e.g. mlx_mtp/demo; fresh optimizer): a continuation stage")
    p.add_argument("--stretch", type=float, default=None,
                   help="minutes: stop after this long, saving weights, optimizer and step to --out; "
                        "`--resume` continues the same run (schedule and batches follow the step)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    p.add_argument("--smoke", action="store_true", help="timing only: a few steps, no export")
    p.add_argument("--demo-dir", default=None,
                   help="also convert the HF export into this folder (e.g. mlx_mtp/demo)")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train.log", "a")
    log(f"args: {vars(args)}", logf)
    random.seed(args.seed)
    np.random.seed(args.seed)
    mx.random.seed(args.seed)

    # 1-2. corpus and tokenizer
    t0 = time.time()
    train_docs, held_docs = data.split_corpus(corpus=args.corpus)
    docs, n_chat = data.build_documents(
        train_docs, args.seed, args.chat_fraction, max_chars=args.chat_max_chars,
        min_lines=args.chat_min_lines, classes=args.chat_classes, renames=args.chat_renames,
        identifier_renames=args.chat_identifier_renames)
    log(f"corpus: {len(train_docs)} train files, {len(held_docs)} held-out files, "
        f"{n_chat} chat examples, {sum(map(len, docs)) / 1e6:.1f}M train chars", logf)
    tok_dir = out / "tokenizer"
    if args.tokenizer and not (tok_dir / "tokenizer.json").exists():
        data.save_tokenizer(_read_tokenizer(Path(args.tokenizer) / "tokenizer.json"), tok_dir)
    if (tok_dir / "tokenizer.json").exists():
        tok = _read_tokenizer(tok_dir / "tokenizer.json")
    else:
        tok = data.train_tokenizer(docs, args.vocab)
        data.save_tokenizer(tok, tok_dir)
    eot = tok.token_to_id("<|endoftext|>")
    im_end = tok.token_to_id("<|im_end|>")

    cache = out / "tokens.npz"
    if cache.exists():
        z = np.load(cache)
        train_stream, held_stream = z["train"], z["held"]
    else:
        train_stream = data.encode_stream(tok, docs)
        held_stream = data.encode_stream(tok, [t for _, t in held_docs])
        np.savez(cache, train=train_stream, held=held_stream)
    (out / "heldout.txt").write_text("\n".join(t for _, t in held_docs))
    (out / "heldout_files.txt").write_text("\n".join(r for r, _ in held_docs) + "\n")
    log(f"tokens: train {len(train_stream) / 1e6:.2f}M, held-out {len(held_stream) / 1e6:.3f}M "
        f"({sum(map(len, docs)) / len(train_stream):.2f} chars/token), {time.time() - t0:.0f}s", logf)

    # 3. model
    tc = dict(DEFAULT_TEXT_CONFIG, vocab_size=tok.get_vocab_size())
    if args.config:
        tc.update(json.loads(args.config))
    config = full_config(tc, [eot, im_end])
    model = build_model(config)
    if args.init and not args.resume:
        model.load_weights(list(initial_weights(args.init).items()))
        log(f"initialized from {args.init}", logf)
    model.train()
    npar = n_params(model)
    log(f"model: {npar / 1e6:.2f}M params ({npar * 4 / 2**20:.1f} MiB fp32)", logf)

    opt = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=args.weight_decay)

    def loss_fn(model, x, w):
        a, b = losses(model, x, args.stop_grad, w)
        return a + args.mtp_weight * b, (a, b)

    vg = nn.value_and_grad(model, loss_fn)
    if args.copy_weight:
        # the most frequent ids (keywords, punctuation, indentation): repeats
        # of these need no copying
        common = np.zeros(config["text_config"]["vocab_size"], bool)
        common[np.argsort(np.bincount(train_stream, minlength=common.size))[-256:]] = True

    def step(x, w):
        (loss, (a, b)), grads = vg(model, x, w)
        grads, gnorm = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return a, b, gnorm

    # Batch i depends only on (seed, stage, i): a resumed run draws what it
    # would have drawn; a continuation stage draws different batches.
    stage = 1 if args.init else 0
    steps = 6 if args.smoke else args.steps
    state_f = out / "state.json"
    step0, elapsed0 = 0, 0.0
    if args.resume and state_f.exists():
        st = json.loads(state_f.read_text())
        model.load_weights(str(out / "ckpt.safetensors"))
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(mx.load(str(out / "opt.safetensors")).items()))
        step0, elapsed0 = st["step"], st["elapsed"]
        log(f"resumed at step {step0} ({elapsed0 / 60:.1f} min trained)", logf)

    def save(step_done, elapsed):
        mx.save_safetensors(str(out / "ckpt.safetensors"), dict(tree_flatten(model.parameters())))
        mx.save_safetensors(str(out / "opt.safetensors"), dict(tree_flatten(opt.state)))
        state_f.write_text(json.dumps({"step": step_done, "elapsed": elapsed}))

    t_start = time.time() - elapsed0
    t_stretch = time.time()
    ema = None
    s, progress, stopped = step0, 0.0, False
    for s in range(step0, steps):
        progress = s / steps
        if args.time_limit:
            progress = max(progress, (time.time() - t_start) / 60 / args.time_limit)
            if progress >= 1.0:
                log(f"time budget spent after {s} steps", logf)
                break
        if args.stretch and (time.time() - t_stretch) / 60 >= args.stretch:
            save(s, time.time() - t_start)
            log(f"stretch over at step {s}; saved, continue with --resume", logf)
            stopped = True
            break
        opt.learning_rate = lr_at(s, progress, args.lr, args.warmup)
        batch = batch_at(train_stream, args.batch, args.seq, (args.seed, stage, s))
        w = mx.array(copy_weights(batch, common, args.copy_weight)) if args.copy_weight else None
        ts = time.time()
        a, b, gn = step(mx.array(batch), w)
        mx.eval(model.parameters(), opt.state, a, b)
        dt = time.time() - ts
        a, b = a.item(), b.item()
        ema = (a, b) if ema is None else (0.95 * ema[0] + 0.05 * a, 0.95 * ema[1] + 0.05 * b)
        if s % 20 == 0 or args.smoke:
            tps = args.batch * args.seq / dt
            log(f"step {s} trunk {a:.3f} head {b:.3f} (ema {ema[0]:.3f}/{ema[1]:.3f}) "
                f"gnorm {gn.item():.2f} lr {opt.learning_rate.item():.2e} {dt:.2f}s/step {tps:.0f} tok/s "
                f"elapsed {(time.time() - t_start) / 60:.1f}m", logf)
        if (s + 1) % args.eval_every == 0 and s + 1 < steps:
            model.eval()
            lt, lh = evaluate_loss(model, held_stream, args.seq, max_windows=32)
            log(f"eval step {s + 1}: held-out trunk {lt:.3f} head {lh:.3f}", logf)
            model.train()
            save(s + 1, time.time() - t_start)
    if stopped:
        return 0
    train_min = (time.time() - t_start) / 60
    n_steps = s + 1 if progress < 1.0 else s
    log(f"training: {n_steps} steps, {train_min:.1f} min", logf)
    if args.smoke:
        return 0
    model.eval()
    mx.save_safetensors(str(out / "ckpt.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=1))

    # 4. export + reload check
    from .export import export_hf, verify_reload

    hf = out / "hf"
    export_hf(model, config, tok_dir, hf)
    err = verify_reload(model, hf, held_stream[:200])
    log(f"export: {hf} reload max |logit diff| trunk {err[0]:.2e} head {err[1]:.2e}", logf)

    # 5. held-out evaluation
    lt, lh = evaluate_loss(model, held_stream, args.seq, max_windows=128)
    agree = head_agreement(model, held_stream, args.seq)
    from mlx_mtp.evaluate import expected_acceptance

    acc = expected_acceptance(model, mx.array(held_stream[:2048]), depth=4, max_starts=256)
    summary = {
        "params": npar,
        "steps": n_steps,
        "train_minutes": round(train_min, 1),
        "heldout_loss_trunk": round(lt, 4),
        "heldout_loss_head": round(lh, 4),
        "head_top1_agreement_with_trunk": round(agree, 4),
        "acceptance": [round(a, 4) for a in acc["acceptance"]],
        "tokens_per_cycle": acc["tokens_per_cycle"],
        "config": config,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    log(f"held-out: trunk {lt:.3f} head {lh:.3f}; head/trunk top-1 agreement {agree:.3f}; "
        f"acceptance {summary['acceptance']}", logf)

    if args.demo_dir:
        from .export import ship

        ship(hf, Path(args.demo_dir))
        write_provenance(Path(args.demo_dir), summary, args)
        log(f"shipped to {args.demo_dir}", logf)
    return 0


if __name__ == "__main__":
    sys.exit(main())
