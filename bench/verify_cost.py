"""Where a verify's time goes, op by op, against one decode step.

    python bench/verify_cost.py                     # Qwen3.6-27B shapes, 4-bit, on the GPU
    python bench/verify_cost.py --bits 0            # bf16 weights
    MLX_MTP_KERNELS=emu-cuda python bench/verify_cost.py --tiny   # smoke test on a CPU

For a batch of M token rows (M = 1 is a decode step, M = k+1 a verify of k
drafts) it times, on the current device, median of --iters after warm-up:
  - every projection of the 27B trunk (attention q/k/v/o, GDN in/out, MLP,
    lm_head): MLX's `mx.quantized_matmul` (or a bf16 matmul) and, for
    2 <= M <= 8, mlx_mtp's `metal.quantized_matmul` (qmv_rows, each weight
    read once), whose rows are also checked bit for bit against MLX's op row
    by row;
  - the GDN recurrence over M tokens (mlx_lm's `gated_delta_update`, the path
    plain decoding and the verify take on CUDA), conv1d, and attention
    (`scaled_dot_product_attention` at --context cached tokens);
and adds them up per layer count of the model: the matmul share, GDN,
attention and conv of one forward at each M. Prints a table per op and the
per-forward totals with each M's cost over M = 1's. Device time only: the
decode loop's host work and the head are in bench.py's costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx



def shapes_27b() -> list:
    """(name, N, K, layers using it) of each projection of Qwen3.6-27B (bench.py's TEXT_27B)."""
    from bench import TEXT_27B as c

    H, L = c["hidden_size"], c["num_hidden_layers"]
    attn = L // c["full_attention_interval"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    hv = c["linear_num_value_heads"]
    gv, gk = hv * c["linear_value_head_dim"], c["linear_num_key_heads"] * c["linear_key_head_dim"]
    return [("attn q_proj (+gate)", 2 * q, H, attn), ("attn k_proj", kv, H, attn),
            ("attn v_proj", kv, H, attn), ("attn o_proj", H, q, attn),
            ("gdn in_proj_qkv", 2 * gk + gv, H, L - attn), ("gdn in_proj_z", gv, H, L - attn),
            ("gdn in_proj_b", hv, H, L - attn), ("gdn in_proj_a", hv, H, L - attn),
            ("gdn out_proj", H, gv, L - attn),
            ("mlp gate_proj", c["intermediate_size"], H, L), ("mlp up_proj", c["intermediate_size"], H, L),
            ("mlp down_proj", H, c["intermediate_size"], L), ("lm_head", c["vocab_size"], H, 1)]


SHAPES_TINY = [("proj", 256, 512, 8), ("mlp down", 512, 1024, 8), ("lm_head", 1024, 512, 1)]


def median_ms(fn, iters: int) -> float:
    mx.eval(fn())
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def progress(msg: str):
    print(f"[verify_cost {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def matmuls(shapes, bits: int, rows, iters: int, dtype) -> list:
    from mlx_mtp import metal

    out = []
    for name, N, K, count in shapes:
        progress(f"{name} [{N} x {K}], {bits or 'bf16'}-bit")
        w = (mx.random.normal((N, K)) * 0.02).astype(dtype)
        if bits:
            wq, s, b = mx.quantize(w, group_size=64, bits=bits)
            del w
        mx.eval(wq, s, b) if bits else mx.eval(w)
        for M in rows:
            x = mx.random.normal((1, M, K)).astype(dtype)
            r = {"op": name, "N": N, "K": K, "layers": count, "M": M}
            if bits:
                r["mlx_ms"] = median_ms(lambda: mx.quantized_matmul(
                    x, wq, s, b, transpose=True, group_size=64, bits=bits), iters)
                if 2 <= M <= 8 and metal.backend() != "ref":
                    ours = lambda: metal.quantized_matmul(x, wq, s, b, group_size=64, bits=bits)
                    r["ours_ms"] = median_ms(ours, iters)
                    r["path"] = metal.selfcheck.paths()["qmv_rows"]
                    # MLX's op row by row on a GPU (the emulator: its model of that op)
                    one_row = metal.qmv_row_reference(metal.backend())(x[0], wq, s, b, 64, bits, True)
                    r["bitwise"] = bool(mx.array_equal(ours()[0], one_row).item())
            else:
                r["mlx_ms"] = median_ms(lambda: x @ w.T, iters)
            out.append(r)
    return out


def recurrent(rows, iters: int, dtype, tiny: bool, context: int) -> list:
    from mlx_lm.models.gated_delta import gated_delta_update

    from bench import TEXT_27B as c

    attn = c["num_hidden_layers"] // c["full_attention_interval"]
    g = dict(Hk=2, Hv=4, Dk=64, Dv=64, layers=8) if tiny else dict(
        Hk=c["linear_num_key_heads"], Hv=c["linear_num_value_heads"], Dk=c["linear_key_head_dim"],
        Dv=c["linear_value_head_dim"], layers=c["num_hidden_layers"] - attn)
    a = dict(H=4, Hkv=2, D=64, layers=2) if tiny else dict(
        H=c["num_attention_heads"], Hkv=c["num_key_value_heads"], D=c["head_dim"], layers=attn)
    out = []
    C = 2 * g["Hk"] * g["Dk"] + g["Hv"] * g["Dv"]
    state = mx.zeros((1, g["Hv"], g["Dv"], g["Dk"]), mx.float32)
    conv_w = (mx.random.normal((C, 4, 1)) * 0.1).astype(dtype)
    keys = (mx.random.normal((1, a["Hkv"], context, a["D"])) * 0.1).astype(dtype)
    vals = (mx.random.normal((1, a["Hkv"], context, a["D"])) * 0.1).astype(dtype)
    for M in rows:
        progress(f"GDN, conv, attention at {M} tokens")
        q = mx.random.normal((1, M, g["Hk"], g["Dk"])).astype(dtype)
        k = mx.random.normal((1, M, g["Hk"], g["Dk"])).astype(dtype)
        v = mx.random.normal((1, M, g["Hv"], g["Dv"])).astype(dtype)
        ga = mx.random.normal((1, M, g["Hv"])).astype(dtype)
        gb = mx.random.normal((1, M, g["Hv"])).astype(dtype)
        A_log = mx.zeros((g["Hv"],))
        dtb = mx.zeros((g["Hv"],)).astype(dtype)
        ms = median_ms(lambda: gated_delta_update(q, k, v, ga, gb, A_log, dtb, state), iters)
        out.append({"op": "gdn recurrence", "layers": g["layers"], "M": M, "mlx_ms": ms})
        xc = mx.random.normal((1, 3 + M, C)).astype(dtype)
        ms = median_ms(lambda: mx.conv1d(xc, conv_w, groups=C), iters)
        out.append({"op": "gdn conv1d", "layers": g["layers"], "M": M, "mlx_ms": ms})
        qa = mx.random.normal((1, a["H"], M, a["D"])).astype(dtype)
        kk = mx.concatenate([keys, (mx.random.normal((1, a["Hkv"], M, a["D"])) * 0.1).astype(dtype)], 2)
        vv = mx.concatenate([vals, (mx.random.normal((1, a["Hkv"], M, a["D"])) * 0.1).astype(dtype)], 2)
        mx.eval(kk, vv)
        mask = "causal" if M > 1 else None
        ms = median_ms(lambda: mx.fast.scaled_dot_product_attention(
            qa, kk, vv, scale=a["D"] ** -0.5, mask=mask), iters)
        out.append({"op": f"attention ({context} cached)", "layers": a["layers"], "M": M,
                    "mlx_ms": ms})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, default=4, help="4 or 8, 0 for bf16 weights")
    p.add_argument("--rows", default="1,2,3,4,5,6,7,8")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--context", type=int, default=512, help="cached tokens for attention")
    p.add_argument("--tiny", action="store_true", help="small shapes (a smoke test on a CPU)")
    p.add_argument("--json", default=None, help="write the rows here too")
    a = p.parse_args(argv)
    rows = [int(r) for r in a.rows.split(",")]
    dtype = mx.bfloat16
    mx.random.seed(0)
    from mlx_mtp import metal

    progress(f"device {mx.default_device()}, kernel backend {metal.backend()}, MLX {mx.__version__}")
    res = matmuls(SHAPES_TINY if a.tiny else shapes_27b(), a.bits, rows, a.iters, dtype)
    res += recurrent(rows, a.iters, dtype, a.tiny, a.context)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"bits": a.bits, "device": str(mx.default_device()), "rows": res}, f, indent=1)
    report(res, rows, a.bits)


def report(res, rows, bits):
    q = "bf16" if not bits else f"{bits}-bit"
    print(f"\nper op, ms per call ({q} weights; 'ours' = qmv_rows, each weight read once):")
    print(f"{'op':<26} {'M':>2} {'mlx':>8} {'ours':>8} {'mlx/M=1':>8} {'ours/M=1':>8}  bitwise")
    base = {}
    for r in res:
        if r["M"] == 1:
            base[r["op"]] = r["mlx_ms"]
        b = base.get(r["op"], r["mlx_ms"])
        ours = r.get("ours_ms")
        print(f"{r['op']:<26} {r['M']:>2} {r['mlx_ms']:8.3f} "
              f"{ours if ours is not None else float('nan'):8.3f} {r['mlx_ms'] / b:8.2f} "
              f"{(ours / b) if ours else float('nan'):8.2f}  "
              f"{'' if 'bitwise' not in r else ('yes' if r['bitwise'] else 'NO')}")
    print("\none forward, summed over the model's layers (ms): matmuls with MLX's op / with "
          "qmv_rows where it runs, then the recurrent parts")
    print(f"{'M':>2} {'matmul mlx':>11} {'matmul ours':>12} {'gdn':>8} {'conv':>8} {'attn':>8} "
          f"{'total mlx':>10} {'total ours':>11} {'mlx/M=1':>8} {'ours/M=1':>9}")
    first = None
    for M in rows:
        at = [r for r in res if r["M"] == M]
        mm = sum(r["mlx_ms"] * r["layers"] for r in at if "N" in r)
        mo = sum(r.get("ours_ms", r["mlx_ms"]) * r["layers"] for r in at if "N" in r)
        part = {key: sum(r["mlx_ms"] * r["layers"] for r in at if r["op"].startswith(key))
                for key in ("gdn recurrence", "gdn conv1d", "attention")}
        rest = sum(part.values())
        tm, to = mm + rest, mo + rest
        first = first or tm
        print(f"{M:>2} {mm:11.2f} {mo:12.2f} {part['gdn recurrence']:8.2f} {part['gdn conv1d']:8.2f} "
              f"{part['attention']:8.2f} {tm:10.2f} {to:11.2f} {tm / first:8.2f} {to / first:9.2f}")
    bad = [r for r in res if r.get("bitwise") is False]
    print(f"\nqmv_rows rows bit for bit MLX's one-row op: {'all' if not bad else 'NOT ' + str(len(bad))}"
          f" of {sum('bitwise' in r for r in res)} measured")


if __name__ == "__main__":
    main()
