"""Save a trained model in the released Hugging Face layout, check it, ship it.

Released layout (what Qwen3.5 checkpoints on the Hub look like):
  * trunk tensors under `model.language_model.*`, `lm_head.weight` unless tied;
  * MTP head under `mtp.*`;
  * RMSNorm weights zero-centred (stored as w, applied as 1 + w): the trunk's
    input/post-attention layernorms, final norm, q_norm/k_norm and every norm of
    the head. The GDN gated norm (`linear_attn.norm`) is stored as is;
  * GDN conv1d weights as [C, 1, K] (MLX keeps [C, K, 1]);
  * config.json with `text_config` and `mtp_num_hidden_layers`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_mtp.model import HEAD_NORM_SUFFIXES

# Suffixes that mlx_lm (trunk) and mlx_mtp (head) shift by +1 on load.
TRUNK_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)


def hf_tensors(model) -> dict:
    out = {}
    for k, v in tree_flatten(model.parameters()):
        if k.startswith("mtp."):
            name = k
            if v.ndim == 1 and k.endswith(HEAD_NORM_SUFFIXES):  # every head norm
                v = v - 1.0
        elif k.startswith("language_model.model."):
            name = "model.language_model." + k[len("language_model.model."):]
            if v.ndim == 1 and (k.endswith(TRUNK_NORMS) or k == "language_model.model.norm.weight"):
                v = v - 1.0
            if k.endswith("conv1d.weight"):
                v = v.transpose(0, 2, 1)  # [C, K, 1] -> [C, 1, K]
        elif k.startswith("language_model.lm_head."):
            name = k[len("language_model."):]
        else:
            raise KeyError(f"unexpected parameter {k}")
        out[name] = v.astype(mx.float32)
    return out


def export_hf(model, config: dict, tokenizer_dir: Path, path: Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(model)
    mx.eval(tensors)
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / f, path / f)
    return path


def _logits(model, tokens):
    x = mx.array(tokens)[None]
    h = model.trunk_hidden(x, None)
    main = model.logits_from_hidden(h)
    g = model.mtp(h[:, :-1], model.embed(x[:, 1:]))
    return main, model.logits_from_hidden(g)


def verify_reload(model, path: Path, tokens) -> tuple:
    """Max |logit difference| (trunk, head) between `model` and mlx_mtp.load(path).

    The loaded model runs mlx_lm's own GDN recurrence, so this also checks the
    chunked training recurrence against it."""
    import mlx_mtp

    loaded, _ = mlx_mtp.load(str(path))
    a_main, a_head = _logits(model, tokens)
    b_main, b_head = _logits(loaded, tokens)
    e1 = mx.abs(a_main - b_main).max().item()
    e2 = mx.abs(a_head - b_head).max().item()
    if not (e1 < 1e-3 and e2 < 1e-3):
        raise RuntimeError(f"reloaded model differs: trunk {e1}, head {e2}")
    return e1, e2


def ship(hf_path: Path, demo_dir: Path, dtype: str = None):
    """Convert the HF export with the project's converter into demo_dir
    (keeping a README.txt), its weights in `dtype` (None: the export's
    float32); falls back to copying the HF folder when the converter is
    unavailable."""
    demo_dir = Path(demo_dir)
    keep = {}
    for f in ("README.txt",):
        if (demo_dir / f).exists():
            keep[f] = (demo_dir / f).read_text()
    tmp = demo_dir.parent / (demo_dir.name + ".new")
    if tmp.exists():
        shutil.rmtree(tmp)
    r = subprocess.run(
        [sys.executable, "-m", "mlx_mtp.convert", "--hf-path", str(hf_path), "--mlx-path", str(tmp)]
        + (["--dtype", dtype] if dtype else []),
        capture_output=True, text=True,
    )
    if r.returncode != 0:
        print(f"convert failed ({r.stderr.strip()}); shipping the HF layout", file=sys.stderr)
        if tmp.exists():
            shutil.rmtree(tmp)
        shutil.copytree(hf_path, tmp)
    for f in list(demo_dir.glob("*")) if demo_dir.exists() else []:
        if f.is_file() and f.suffix in (".json", ".safetensors", ".jinja", ".txt"):
            f.unlink()
    demo_dir.mkdir(parents=True, exist_ok=True)
    for f in tmp.iterdir():
        shutil.copy(f, demo_dir / f.name)
    shutil.rmtree(tmp)
    for name, text in keep.items():
        (demo_dir / name).write_text(text)
    # the converter records its source folder; do not ship a local path
    cfg_file = demo_dir / "config.json"
    cfg = json.loads(cfg_file.read_text())
    if isinstance(cfg.get("mlx_mtp"), dict) and "source" in cfg["mlx_mtp"]:
        cfg["mlx_mtp"]["source"] = "train/train.py (released-layout export)"
        cfg_file.write_text(json.dumps(cfg, indent=4))
    return r.returncode == 0


def export_run(run: Path, demo_dir: Path, check: bool = True):
    """A training run's final checkpoint (RUN/ckpt.safetensors and its
    config.json) -> RUN/hf -> demo_dir: what `train.py --demo-dir` does after
    training, for a checkpoint trained elsewhere (train/gpu.sh)."""
    import numpy as np

    from .train import build_model

    run = Path(run)
    config = json.loads((run / "config.json").read_text())
    model = build_model(config)
    model.load_weights(str(run / "ckpt.safetensors"))
    model.eval()
    hf = export_hf(model, config, run / "tokenizer", run / "hf")
    if check:
        err = verify_reload(model, hf, np.load(run / "tokens.npz")["held"][:200])
        print(f"export: {hf} reload max |logit diff| trunk {err[0]:.2e} head {err[1]:.2e}")
    ship(hf, demo_dir)
    print(f"shipped to {demo_dir}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Export a training run's checkpoint and ship it "
                                "into a model folder (train/README.md).")
    p.add_argument("run", type=Path, help="a train.py --out folder with ckpt.safetensors")
    p.add_argument("demo_dir", type=Path, help="the model folder to write (e.g. mlx_mtp/demo)")
    p.add_argument("--no-reload-check", action="store_true",
                   help="skip verify_reload (it fails on CUDA: train/README.md)")
    a = p.parse_args()
    export_run(a.run, a.demo_dir, check=not a.no_reload_check)
