"""Train the demo's MTP head to draft deep: chained drafts at depth 1..K,
trained exactly as they are used in decoding, with the trunk frozen.

    python -m train.head cache --out runs/head            # trunk hiddens -> disk, once
    python -m train.head train --out runs/head [--resume]  # head only, distilled from the trunk
    python -m train.head ship  --out runs/head --demo-dir mlx_mtp/demo

The chain (mlx_mtp/cycle.py `draft`, mlx_mtp/evaluate.py `expected_acceptance`):
the head's cache holds at position p the entry computed from (h_p, embed(tok_{p+1}))
(h = the trunk's post-final-norm hidden). Drafting from the last position t,
step 1 is that entry's output g1_t (draft d1 = argmax lm_head(g1_t), for token
t+2); step j+1 feeds the head its own post-norm output g_j and embed(d_j) at
position t+j, attending to the step-1 entries at positions <= t and to the
chain's own earlier entries. Every step of every base t is trained in
parallel: step j's queries (RoPE position t+j-1) attend to
[step-1 keys at bases <= t] + [step-i keys at base t, i = 2..j], a boolean
mask over the concatenated keys (`chain_forward`; checked against the
sequential decode-time chain by `check_chain`).

Inputs and targets, teacher-forced as `expected_acceptance` scores them: step 1
gets the true token t+1; step j > 1 gets the trunk's greedy choice for token
t+j (the draft that must have been accepted for step j to matter). Step j's
target is the trunk's distribution at position t+j (distillation: a draft is
accepted when the head's argmax equals the trunk's). Only `mtp.*` trains; the
trunk, its tied embedding and lm_head are frozen, so the shipped trunk is
bit-identical and its hiddens are computed once (`cache`).
"""

from __future__ import annotations

import argparse
import json
import math
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
from .train import log

DEMO_DIR = Path(__file__).resolve().parent.parent / "mlx_mtp" / "demo"


# ---------------------------------------------------------------- model


def load_model(demo_dir=DEMO_DIR, chunked: bool = True):
    """The shipped demo (trunk + head) via mlx_mtp.load; with `chunked`, its GDN
    layers use the chunked full-sequence recurrence (same parameters)."""
    import mlx_mtp

    model, tok = mlx_mtp.load(str(demo_dir))
    if chunked:
        targs = model.language_model.args
        for layer in model.language_model.model.layers:
            if layer.is_linear:
                new = ChunkedGatedDeltaNet(targs)
                new.update(layer.linear_attn.parameters())
                layer.linear_attn = new
    model.eval()
    return model, tok


class ChainCache:
    """Stands in for a KVCache in the head's attention layer: `offset` is the
    RoPE offset of the current chain step (j - 1) and update_and_fetch returns
    the keys/values of all steps so far, concatenated along the sequence."""

    def __init__(self):
        self.keys, self.values, self.offset = [], [], 0

    def update_and_fetch(self, k, v):
        self.keys.append(k)
        self.values.append(v)
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)


def chain_mask(L: int, j: int, first: int = 0) -> mx.array:
    """[n, L + (j-1)*n] bool (n = L - first): step j's query at base t
    (first <= t < L) sees the step-1 keys at bases <= t and the step-i keys
    (i = 2..j) at base t."""
    n = L - first
    q = mx.arange(first, L)
    blocks = [mx.arange(L)[None, :] <= q[:, None]]
    blocks += [mx.arange(n)[None, :] == mx.arange(n)[:, None]] * (j - 1)
    return mx.concatenate(blocks, axis=1)


def head_step(head, g, emb, mask, cache):
    x = mx.concatenate([head.pre_fc_norm_embedding(emb), head.pre_fc_norm_hidden(g)], axis=-1)
    x = head.fc(x)
    for layer in head.layers:
        x = layer(x, mask=mask, cache=cache)
    return head.norm(x)


def chain_forward(model, h, tokens, greedy, depth, first: int = 0):
    """Head hiddens of chain steps 1..depth at bases t = first..T-2.

    h: [B, T, H] trunk post-norm hiddens; tokens: [B, T] the text; greedy:
    [B, T] the trunk's argmax at each position (its choice for the next token).
    Step 1 at base t: (h_t, embed(tokens[t+1])), run at every base (its
    entries are the history the chains attend to; before `first` without
    gradient); step j > 1: (g_{j-1, t},
    embed(greedy[t+j-1])), run at bases >= `first` only. Returns a list of
    `depth` arrays [B, T-1-first, H]; step j at base t drafts token t+j+1
    (compare with greedy[t+j])."""
    assert len(model.mtp.layers) == 1, "one head layer"
    B, T, _ = h.shape
    L = T - 1
    n = L - first
    greedy_p = mx.concatenate([greedy, mx.zeros((B, depth), dtype=greedy.dtype)], axis=1)
    cache = ChainCache()
    emb = model.embed(tokens[:, 1:])
    if first > 0:
        # the history: step-1 entries before `first`, keys/values only matter,
        # and no gradient flows into them (a training-time saving)
        head_step(model.mtp, h[:, :first], emb[:, :first], chain_mask(first, 1), cache)
        cache.keys = [mx.stop_gradient(k) for k in cache.keys]
        cache.values = [mx.stop_gradient(v) for v in cache.values]
        cache.offset = first
    g = head_step(model.mtp, h[:, first:L], emb[:, first:], chain_mask(L, 1, first), cache)
    outs = [g]
    for j in range(2, depth + 1):
        emb = model.embed(greedy_p[:, first + j - 1 : first + j - 1 + n])
        cache.offset = first + j - 1
        g = head_step(model.mtp, g, emb, chain_mask(L, j, first), cache)
        outs.append(g)
    return outs


def check_chain(model, tokens, depth: int = 4, first: int = 0, starts=None) -> float:
    """Max |logit diff| between `chain_forward` and the sequential decode-time
    chain (mlx_mtp.evaluate's: head KV cache up to t, then one step at a time)
    fed the same tokens."""
    from mlx_mtp.evaluate import _head_cache_upto

    x = mx.array(tokens)[None]
    h = model.trunk_hidden(x, None)
    greedy = mx.argmax(model.logits_from_hidden(h), axis=-1)
    par = chain_forward(model, h, x, greedy, depth, first)
    full = model.mtp.make_cache()
    g_all = model.mtp(h[:, :-1], model.embed(x[:, 1:]), full)
    T = x.shape[1]
    starts = starts if starts is not None else range(first, T - depth - 1, max(1, (T - depth - first) // 7))
    err = 0.0
    for t in starts:
        cache = _head_cache_upto(full, t + 1)
        g = g_all[:, t : t + 1]
        for j in range(1, depth + 1):
            if j > 1:
                g = model.mtp(g, model.embed(greedy[:, t + j - 1 : t + j]), cache)
            a = model.logits_from_hidden(g[:, 0])
            b = model.logits_from_hidden(par[j - 1][:, t - first])
            err = max(err, mx.abs(a - b).max().item())
    return err


# ---------------------------------------------------------------- cache


def token_streams(tokenizer_file: Path, seed: int = 0, chat_fraction: float = 0.15):
    """The demo's training and held-out token streams (as train/train.py builds them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    train_docs, held_docs = data.split_corpus()
    docs, _ = data.build_documents(train_docs, seed, chat_fraction)
    return data.encode_stream(tok, docs), data.encode_stream(tok, [t for _, t in held_docs])


def greedy_continue(model, prompts: np.ndarray, n: int) -> np.ndarray:
    """Greedy continuations [B, n] of prompts [B, P] (the trunk, batched, with its cache)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model.language_model)
    logits = model.language_model(mx.array(prompts), cache=cache)
    y = mx.argmax(logits[:, -1], axis=-1)
    out = [y]
    for _ in range(n - 1):
        logits = model.language_model(y[:, None], cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)
        out.append(y)
        if len(out) % 32 == 0:
            mx.eval(out)
    mx.eval(out)
    return np.stack([np.array(o) for o in out], axis=1).astype(np.int32)


def trunk_pass(model, chunks: np.ndarray, batch: int = 4):
    """(h fp16 [N, C, H], greedy int16 [N, C]) for token chunks [N, C]."""
    hs, gs = [], []
    for i in range(0, len(chunks), batch):
        x = mx.array(chunks[i : i + batch])
        h = model.trunk_hidden(x, None)
        g = mx.argmax(model.logits_from_hidden(h), axis=-1)
        mx.eval(h, g)
        hs.append(np.array(h.astype(mx.float16)))
        gs.append(np.array(g.astype(mx.int16)))
    return np.concatenate(hs), np.concatenate(gs)


def cmd_cache(args):
    """Trunk hiddens and greedy choices over (a) seeded random chunks of the
    training stream, (b) greedy continuations of training-stream prompts,
    (c) the held-out stream; written part by part (resumable)."""
    out = Path(args.out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    logf = open(out / "head.log", "a")
    log(f"cache args: {vars(args)}", logf)
    model, _ = load_model(args.demo_dir)
    streams = out / "tokens.npz"
    if streams.exists():
        z = np.load(streams)
        train_s, held_s = z["train"], z["held"]
    else:
        train_s, held_s = token_streams(Path(args.demo_dir) / "tokenizer.json")
        np.savez(streams, train=train_s, held=held_s)
    if not (out / "heldout.txt").exists():  # for `check` and mlx_mtp.evaluate --text-file
        (out / "heldout.txt").write_text("\n".join(t for _, t in data.split_corpus()[1]))
    log(f"streams: train {len(train_s)} held-out {len(held_s)} tokens", logf)
    rng = np.random.default_rng(args.seed)
    C = args.chunk
    n_chunks = len(train_s) // C
    pick = np.sort(rng.choice(n_chunks, size=min(n_chunks, args.train_tokens // C), replace=False))
    train_chunks = np.stack([train_s[i * C : (i + 1) * C] for i in pick])
    n_gen = args.greedy_tokens // args.greedy_len
    gen_starts = rng.integers(0, len(train_s) - args.greedy_prompt, size=n_gen)
    held_chunks = np.stack([held_s[i * C : (i + 1) * C] for i in range(min(args.held_chunks, len(held_s) // C))])

    jobs = []  # (part name, kind, payload)
    per = args.part_chunks
    for k in range(0, len(train_chunks), per):
        jobs.append((f"train_{k // per:04d}", "text", train_chunks[k : k + per]))
    gb = args.greedy_batch
    for k in range(0, n_gen, gb):
        jobs.append((f"greedy_{k // gb:04d}", "greedy", gen_starts[k : k + gb]))
    jobs.append(("held_0000", "text", held_chunks))
    t0 = time.time()
    for name, kind, payload in jobs:
        f = out / "parts" / f"{name}.npz"
        if f.exists():
            continue
        ts = time.time()
        if kind == "text":
            toks = payload
        else:
            prompts = np.stack([train_s[s : s + args.greedy_prompt] for s in payload])
            cont = greedy_continue(model, prompts, args.greedy_len)
            toks = np.concatenate([prompts, cont], axis=1)
        h, g = trunk_pass(model, toks)
        if kind == "greedy":  # the continuation is the trunk's own choice
            P = args.greedy_prompt
            assert (g[:, P - 1 : -1] == toks[:, P:]).mean() > 0.99
        np.savez(f, tokens=toks.astype(np.int16), h=h, greedy=g)
        log(f"cache {name}: {toks.shape} in {time.time() - ts:.0f}s (total {time.time() - t0:.0f}s)", logf)
    log("cache done", logf)


def load_parts(out: Path, prefix: str):
    files = sorted((out / "parts").glob(f"{prefix}_*.npz"))
    parts = [np.load(f) for f in files]
    return [(p["tokens"].astype(np.int32), p["h"], p["greedy"].astype(np.int32)) for p in parts]


# ---------------------------------------------------------------- train


def chain_losses(model, h, tokens, greedy, depth, valid_from=None, first: int = 0):
    """Per step j, at bases t = first..T-2: (distillation loss: soft CE to the
    trunk's distribution at t+j, mean over valid bases; argmax match with the
    trunk's greedy at t+j [B, n] bool; valid [B, n] bool). A base is valid for
    step j when t+j < T (and t+j >= valid_from, when given)."""
    B, T, _ = h.shape
    L = T - 1
    n = L - first
    outs = chain_forward(model, h, tokens, greedy, depth, first)
    losses, matches, valids = [], [], []
    base = mx.arange(first, L)
    for j, g in enumerate(outs, 1):
        m_ = T - j - first  # bases first..T-1-j have a target at t+j
        lg = model.logits_from_hidden(g[:, :m_])
        tl = mx.stop_gradient(model.logits_from_hidden(h[:, first + j : first + j + m_]))
        lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        pt = mx.softmax(tl, axis=-1)
        ce = -(pt * lp).sum(-1)  # [B, m_]
        valid = mx.ones((B, m_), dtype=mx.bool_)
        if valid_from is not None:  # only targets inside the scored span
            valid = (base[None, :m_] + j) >= valid_from[:, None]
        vf = valid.astype(mx.float32)
        losses.append((ce * vf).sum() / mx.maximum(vf.sum(), 1.0))
        m = mx.argmax(lg, axis=-1) == greedy[:, first + j : first + j + m_]
        matches.append(mx.pad(m, [(0, 0), (0, n - m_)]))
        valids.append(mx.pad(valid, [(0, 0), (0, n - m_)]))
    return losses, matches, valids


def chain_acceptance(model, parts, depth, T=256, max_windows=64):
    """Teacher-forced chained acceptance per draft position on cached parts
    (non-overlapping windows of T tokens; bases with all `depth` targets)."""
    acc = np.zeros(depth)
    n = 0
    ce = np.zeros(depth)
    nw = 0
    for toks, h, gr in parts:
        for c in range(toks.shape[0]):
            for s in range(0, toks.shape[1] - T + 1, T):
                if nw >= max_windows:
                    break
                ls, ms, _ = chain_losses(model, mx.array(h[c:c + 1, s:s + T]).astype(mx.float32),
                                         mx.array(toks[c:c + 1, s:s + T]), mx.array(gr[c:c + 1, s:s + T]), depth)
                nb = T - depth
                cum = np.ones((nb,), dtype=bool)
                for j in range(depth):
                    cum &= np.array(ms[j][0, :nb])
                    acc[j] += cum.sum()
                    ce[j] += ls[j].item()
                n += nb
                nw += 1
    return (acc / max(n, 1)).tolist(), (ce / max(nw, 1)).tolist()


def lr_at(step, progress, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def sample_batch(pools, weights, B, T, rng):
    """B windows of T tokens: pool chosen by weight, then chunk and offset.
    For greedy pools, windows start at or after `min_start` so most targets
    are the trunk's own continuation. Returns tokens, h, greedy, valid_from."""
    ks = rng.choice(len(pools), size=B, p=weights)
    tk, hh, gg, vf = [], [], [], []
    for k in ks:
        toks, h, gr, min_start, score_from = pools[k]
        c = rng.integers(0, toks.shape[0])
        s = rng.integers(min_start, toks.shape[1] - T + 1)
        tk.append(toks[c, s:s + T])
        hh.append(h[c, s:s + T])
        gg.append(gr[c, s:s + T])
        vf.append(max(0, score_from - s))
    return (mx.array(np.stack(tk)), mx.array(np.stack(hh)).astype(mx.float32),
            mx.array(np.stack(gg)), mx.array(np.array(vf, dtype=np.int32)))


def head_params(model) -> dict:
    return {k: v for k, v in tree_flatten(model.mtp.parameters())}


def cmd_train(args):
    out = Path(args.out)
    logf = open(out / "head.log", "a")
    log(f"train args: {vars(args)}", logf)
    mx.random.seed(args.seed)
    model, _ = load_model(args.demo_dir, chunked=False)  # the trunk is not run here
    model.freeze()
    model.mtp.unfreeze()
    if args.reinit:
        fresh = model.make_head(model.text_args, len(model.mtp.layers))
        model.mtp.update(fresh.parameters())
    ntrain = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    log(f"trainable: {ntrain / 1e6:.2f}M (mtp.* only)", logf)

    first = args.seq - 1 - args.score  # scored bases per window: the last `score`

    def concat(ps):
        return tuple(np.concatenate([p[i] for p in ps]) for i in range(3))

    text = concat(load_parts(out, "train"))
    pools, weights = [(*text, 0, 0)], [1.0 - args.greedy_weight]
    gparts = load_parts(out, "greedy")
    if gparts and args.greedy_weight > 0:
        g = concat(gparts)
        P = g[0].shape[1] - args.greedy_len
        # scored bases inside the continuation; only targets in it count
        pools.append((*g, max(0, P - 1 - first), P))
        weights.append(args.greedy_weight)
    weights = np.array(weights) / sum(weights)
    held = load_parts(out, "held")
    log(f"pools: text {text[0].shape}, greedy {pools[1][0].shape if len(pools) > 1 else None}, "
        f"weights {weights.tolist()}", logf)

    opt = optim.AdamW(learning_rate=args.lr, betas=[0.9, 0.95], weight_decay=args.weight_decay)
    w = [float(x) for x in args.step_weights.split(",")][: args.depth]
    assert len(w) == args.depth

    def loss_fn(model, h, toks, gr, vf):
        ls, _, _ = chain_losses(model, h, toks, gr, args.depth, vf, first)
        return sum(wj * l for wj, l in zip(w, ls)) / sum(w), ls

    vg = nn.value_and_grad(model, loss_fn)
    ckpt = out / "head_ckpt.safetensors"
    state_f = out / "head_state.json"
    step0, elapsed0 = 0, 0.0
    if args.resume and ckpt.exists():
        st = json.loads(state_f.read_text())
        model.mtp.load_weights(str(ckpt))
        opt_f = out / "head_opt.safetensors"
        flat = mx.load(str(opt_f))
        opt.init(model.trainable_parameters())
        opt.state = tree_unflatten(list(flat.items()))
        step0, elapsed0 = st["step"], st["elapsed"]
        log(f"resumed at step {step0} ({elapsed0 / 60:.1f} min trained)", logf)
    else:
        acc, ce = chain_acceptance(model, held, args.depth, args.seq, args.eval_windows)
        log(f"eval step 0: held-out chained acceptance {[round(a, 3) for a in acc]} "
            f"soft-CE {[round(c, 3) for c in ce]}", logf)

    def save(step, elapsed):
        mx.save_safetensors(str(ckpt), head_params(model))
        mx.save_safetensors(str(out / "head_opt.safetensors"), dict(tree_flatten(opt.state)))
        state_f.write_text(json.dumps({"step": step, "elapsed": elapsed, "args": vars(args)}))

    t_start = time.time() - elapsed0
    step = step0
    for step in range(step0, args.steps):
        elapsed = time.time() - t_start
        progress = step / args.steps
        if args.time_limit:
            progress = max(progress, elapsed / 60 / args.time_limit)
            if progress >= 1.0:
                log(f"time budget spent at step {step}", logf)
                break
        opt.learning_rate = lr_at(step, progress, args.lr, args.warmup)
        rng = np.random.default_rng([args.seed, step])  # batches depend only on (seed, step)
        toks, h, gr, vf = sample_batch(pools, weights, args.batch, args.seq, rng)
        ts = time.time()
        (loss, ls), grads = vg(model, h, toks, gr, vf)
        grads, gn = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        mx.eval(model.trainable_parameters(), opt.state, loss, ls)
        if step % 10 == 0:
            log(f"step {step} loss {loss.item():.3f} per-step {[round(l.item(), 3) for l in ls]} "
                f"gnorm {gn.item():.2f} lr {opt.learning_rate.item():.2e} {time.time() - ts:.2f}s/step "
                f"elapsed {(time.time() - t_start) / 60:.1f}m", logf)
        if (step + 1) % args.ckpt_every == 0:
            save(step + 1, time.time() - t_start)
        if (step + 1) % args.eval_every == 0:
            acc, ce = chain_acceptance(model, held, args.depth, args.seq, args.eval_windows)
            log(f"eval step {step + 1}: held-out chained acceptance {[round(a, 3) for a in acc]} "
                f"soft-CE {[round(c, 3) for c in ce]}", logf)
    else:
        step = args.steps
    save(step, time.time() - t_start)
    acc, ce = chain_acceptance(model, held, args.depth, args.seq, args.eval_windows)
    log(f"final step {step}: held-out chained acceptance {[round(a, 3) for a in acc]} "
        f"soft-CE {[round(c, 3) for c in ce]}; {(time.time() - t_start) / 60:.1f} min", logf)


# ---------------------------------------------------------------- ship


def write_head(demo_dir: Path, params: dict):
    """Replace the `mtp.*` tensors in the demo's safetensors shards (same
    names, dtypes, shards and metadata); every other tensor is untouched."""
    demo_dir = Path(demo_dir)
    left = dict(params)
    for f in sorted(demo_dir.glob("*.safetensors")):
        w, meta = mx.load(str(f), return_metadata=True)
        hit = [k for k in w if k.startswith("mtp.")]
        if not hit:
            continue
        for k in hit:
            new = left.pop(k[len("mtp."):])
            assert new.shape == w[k].shape, k
            w[k] = new.astype(w[k].dtype)
        mx.save_safetensors(str(f), w, metadata=meta)
    if left:
        raise KeyError(f"head tensors not in the demo: {sorted(left)}")


def cmd_ship(args):
    import mlx_mtp

    out = Path(args.out)
    params = dict(mx.load(str(out / "head_ckpt.safetensors")))
    before = {k: v for k, v in tree_flatten(mlx_mtp.load(str(args.demo_dir))[0].parameters())
              if not k.startswith("mtp.")}
    write_head(Path(args.demo_dir), params)
    model, _ = mlx_mtp.load(str(args.demo_dir))
    after = dict(tree_flatten(model.parameters()))
    for k, v in params.items():
        assert mx.array_equal(after["mtp." + k], v), k
    for k, v in before.items():
        assert mx.array_equal(after[k], v), k
    log(f"shipped {len(params)} head tensors into {args.demo_dir}; trunk unchanged")


def cmd_check(args):
    model, tok = load_model(args.demo_dir, chunked=False)
    text = (Path(args.out) / "heldout.txt").read_text() if (Path(args.out) / "heldout.txt").exists() \
        else "\n".join(t for _, t in data.split_corpus()[1][:2])
    ids = tok.encode(text)[:200]
    err = check_chain(model, ids, 4)
    print(f"parallel chain vs sequential decode-time chain: max |logit diff| {err:.2e}")
    return 0 if err < 1e-3 else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("cmd", choices=["cache", "train", "ship", "check"])
    p.add_argument("--out", default="runs/head")
    p.add_argument("--demo-dir", default=str(DEMO_DIR))
    p.add_argument("--seed", type=int, default=0)
    # cache
    p.add_argument("--chunk", type=int, default=1024, help="trunk context per cached chunk")
    p.add_argument("--train-tokens", type=int, default=524_288)
    p.add_argument("--greedy-tokens", type=int, default=65_536, help="greedy continuation tokens")
    p.add_argument("--greedy-prompt", type=int, default=256)
    p.add_argument("--greedy-len", type=int, default=256)
    p.add_argument("--greedy-batch", type=int, default=32)
    p.add_argument("--held-chunks", type=int, default=16)
    p.add_argument("--part-chunks", type=int, default=64)
    # train
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--step-weights", default="1,1,1,1")
    p.add_argument("--greedy-weight", type=float, default=0.25, help="share of windows from greedy continuations")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--score", type=int, default=64,
                   help="bases per window whose chains are run and scored (the window's last ones; "
                        "step 1 runs over the whole window as their history)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=None, help="minutes (LR schedule follows time too)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--reinit", action="store_true", help="start from a fresh head instead of the shipped one")
    args = p.parse_args(argv)
    return {"cache": cmd_cache, "train": cmd_train, "ship": cmd_ship, "check": cmd_check}[args.cmd](args) or 0


if __name__ == "__main__":
    sys.exit(main())
