"""What fits on a Mac: `qwen4_exp` models at 4 and 8 bits, the bytes resident
with the n-gram tables in memory and on disk (`--ngram-tables`), and the Mac
memory each needs. Prints README's table ("Qwen4 on a Mac: what fits").

- Flash-Next: transformers' `Qwen4ExpTextConfig()` defaults (hidden 2048,
  40 layers, 512 experts, n-gram base 20M, 8 heads per n-gram, rows of
  ple_embed_dim / 16), with what the defaults leave empty assumed: one PLE
  layer (`ple_layer_ids=[1]`; the defaults have none) and a QSA indexer of
  32 heads of 128 (a few MB). The model is built lazily from that config
  (this project's `qwen4_exp` classes, MTP head included), converted as
  `convert -q` does (bfloat16, then mlx_lm's quantize_model with the family's
  predicate, group 64), and its parameters' bytes counted: nothing is
  evaluated or allocated.
- Qwen4-35B-A3B: the reported figures only (35B parameters of which a ~20B
  n-gram table and a 2B MTP head; no config was available here), at
  bits + 0.5 per parameter (group-64 affine: a bfloat16 scale and bias per 64).

Mac memory needed: resident bytes x 1.1 (caches and activations at a few
thousand tokens), over 0.75 (the share of memory macOS lets the GPU wire by
default), rounded up to a Mac's memory size.

    python bench/fits.py
"""

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from mlx_mtp.families.qwen4_exp import Qwen4ExpMTPModel
from mlx_mtp.models.qwen4_exp import ModelArgs

MAC_SIZES_GB = [8, 16, 18, 24, 32, 36, 48, 64, 96, 128, 192, 256, 512]
OVERHEAD, GPU_SHARE = 1.1, 0.75


def flash_next_config() -> dict:
    from transformers import Qwen4ExpTextConfig

    tc = Qwen4ExpTextConfig().to_dict()
    tc.update(ple_layer_ids=[1], indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=128,
              indexer_budget=2048, indexer_compress_ratio=4, eos_token_id=0, mtp_num_hidden_layers=1)
    return {"model_type": "qwen4_exp", "text_config": tc}


def flash_next_bytes(bits: int) -> dict:
    """Bytes of trunk (tables apart), tables and head, converted at `bits`."""
    model = Qwen4ExpMTPModel(ModelArgs.from_dict(flash_next_config()))
    model.set_dtype(mx.bfloat16)
    quantize_model(model, {}, group_size=64, bits=bits)
    out = {"trunk": 0, "tables": 0, "head": 0}
    for name, p in tree_flatten(model.parameters()):
        part = "tables" if ".ngram_embedding." in name else "head" if name.startswith("mtp.") else "trunk"
        out[part] += p.nbytes
    return out


def reported_bytes(bits: int) -> dict:
    per = (bits + 0.5) / 8
    return {"trunk": 13e9 * per, "tables": 20e9 * per, "head": 2e9 * per}


def mac_gb(resident: float) -> str:
    need = resident * OVERHEAD / GPU_SHARE / 1e9
    fit = next((s for s in MAC_SIZES_GB if s >= need), None)
    return f"{fit} GB" if fit else f"> {MAC_SIZES_GB[-1]} GB"


def main():
    rows = ["| model | bits | on disk | resident, tables in memory | Mac | "
            "resident, tables on disk | Mac |", "|---|---|---|---|---|---|---|"]
    for name, sizes in (("Qwen4-35B-A3B (reported figures)", reported_bytes),
                        ("Qwen3.8-Flash-Next (config defaults, 1 PLE layer)", flash_next_bytes)):
        for bits in (4, 8):
            b = sizes(bits)
            total, light = b["trunk"] + b["tables"] + b["head"], b["trunk"] + b["head"]
            rows.append(f"| {name} | {bits} | {total / 1e9:.1f} GB | {total / 1e9:.1f} GB | "
                        f"{mac_gb(total)} | {light / 1e9:.1f} GB | {mac_gb(light)} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
