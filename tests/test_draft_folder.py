"""MTP heads stored apart from their trunk (`mlx_mtp.load(trunk, draft=FOLDER)`,
`--draft-model FOLDER`), and the Qwen3.5/3.6 head naming and config variants.

The drafter folders are written as mlx-vlm's splitters write them
(mlx_mtp.testing.synthetic.write_mlx_vlm_drafter): `qwen3_5_mtp` (prefix stripped,
norms shifted, experts as switch_mlp, optionally quantized) and, at the end,
`qwen4_exp_mtp` (the same, but norms kept zero-centred)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

import mlx_mtp
from mlx_mtp.draft import DraftError
from mlx_mtp.evaluate import teacher_forced_logits
from mlx_mtp.model import MTPWeightError
from mlx_mtp.testing.synthetic import random_weights, tiny_text_config, write_checkpoint, write_mlx_vlm_drafter

PROMPT = [3, 17, 99, 42, 7, 7, 150, 201, 12, 64, 88]
N = 20


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from mlx_lm.convert import convert as lm_convert

    base = tmp_path_factory.mktemp("draft")
    hf = write_checkpoint(base / "hf", seed=31)
    nohead = write_checkpoint(base / "nohead", seed=31, mtp=False)  # same trunk tensors
    lm_convert(str(hf), str(base / "lm_q4"), quantize=True, q_bits=4)  # mlx_lm drops the head
    return {
        "hf": hf, "nohead": nohead, "lm_q4": base / "lm_q4",
        "vlm": write_mlx_vlm_drafter(hf, base / "vlm"),
        "vlm_q4": write_mlx_vlm_drafter(hf, base / "vlm_q4", bits=4),
    }


def _head_logits(model, tokens=PROMPT):
    return teacher_forced_logits(model, tokens)[1]


def test_mlx_vlm_drafter_gives_the_checkpoints_own_head(folders):
    own, _ = mlx_mtp.load(folders["hf"], quiet=True)
    model, _ = mlx_mtp.load(folders["nohead"], draft=folders["vlm"], quiet=True)
    assert model.has_mtp and model.mtp_layers == 1
    # norms shifted exactly once: the folder's already shifted ones are kept
    assert mx.array_equal(model.mtp.norm.weight, own.mtp.norm.weight)
    assert mx.array_equal(_head_logits(model), _head_logits(own))


def test_hf_head_folder_norms_detected_unshifted(folders, tmp_path):
    """A folder of HF-named mtp.* tensors (an HF release's head shard with its
    config) is recognised as zero-centred and shifted once."""
    d = tmp_path / "hf_head"
    d.mkdir()
    raw = mx.load(str(folders["hf"] / "model.safetensors"))
    mx.save_safetensors(str(d / "model-mtp.safetensors"),
                        {k: v for k, v in raw.items() if k.startswith("mtp.")}, metadata={"format": "pt"})
    shutil.copy(folders["hf"] / "config.json", d / "config.json")
    own, _ = mlx_mtp.load(folders["hf"], quiet=True)
    model, _ = mlx_mtp.load(folders["nohead"], draft=d, quiet=True)
    assert mx.array_equal(_head_logits(model), _head_logits(own))
    # nothing in the folder says which convention: refused, not guessed
    mx.save_safetensors(str(d / "model-mtp.safetensors"),
                        {k: v for k, v in raw.items() if k.startswith("mtp.")})
    with pytest.raises(DraftError, match="zero-centred .HF. or shifted .MLX."):
        mlx_mtp.load(folders["nohead"], draft=d, quiet=True)


def test_quantized_drafter_on_q4_trunk_greedy_parity(folders):
    import mlx.nn as nn
    import mlx_lm
    from util import reference

    from mlx_mtp.testing.drafters import OracleDrafter
    from mlx_mtp.decode import generate_tokens
    from mlx_mtp.stats import MTPStats

    ref_model, _ = mlx_lm.load(str(folders["lm_q4"]))
    want = reference(ref_model, PROMPT, N)
    model, _ = mlx_mtp.load(folders["lm_q4"], draft=folders["vlm_q4"], quiet=True)
    assert isinstance(model.mtp.fc, nn.QuantizedLinear) and model.mtp.fc.bits == 4
    for k in (1, 2, 3):
        for drafter in (None, OracleDrafter(want, accept_rate=0.7, vocab_size=259, seed=k)):
            stats = MTPStats()
            got = [t for t, _, _ in generate_tokens(mx.array(PROMPT), model, max_tokens=N,
                                                     draft_tokens=k, stats=stats, drafter=drafter)]
            assert got == want, f"depth {k}, drafter {drafter}"
    # the quantized head drafts close to the float one (a badly read head would not)
    fp, _ = mlx_mtp.load(folders["lm_q4"], draft=folders["vlm"], quiet=True)
    a, b = _head_logits(model), _head_logits(fp)
    assert float(mx.abs(a - b).max()) < 0.1 * float(mx.abs(b).max())


def test_drafter_checks(folders, tmp_path):
    # a drafter made for another trunk: one line naming the difference
    other = write_checkpoint(tmp_path / "other", seed=31, text_overrides={"hidden_size": 32})
    vlm_other = write_mlx_vlm_drafter(other, tmp_path / "vlm_other")
    with pytest.raises(ValueError, match="trunk mismatch: hidden_size 64 .* vs 32"):
        mlx_mtp.load(folders["nohead"], draft=vlm_other, quiet=True)
    moe = write_checkpoint(tmp_path / "moe", seed=31, moe=True)
    with pytest.raises(ValueError, match="trunk mismatch: model_type 'qwen3_5' .* vs 'qwen3_5_moe'"):
        mlx_mtp.load(folders["nohead"], draft=write_mlx_vlm_drafter(moe, tmp_path / "vlm_moe"), quiet=True)
    # a separate draft model (no MTP head) is refused
    with pytest.raises(DraftError, match="holds no MTP head"):
        mlx_mtp.load(folders["nohead"], draft=folders["nohead"], quiet=True)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mlx_mtp.load(folders["nohead"], draft=tmp_path / "missing", quiet=True)


def test_generate_cli_draft_model(folders, capsys):
    from mlx_mtp.cli import main

    rc = main(["--model", str(folders["nohead"]), "--draft-model", str(folders["vlm"]),
               "--prompt", "def f():", "--max-tokens", "6", "--draft-tokens", "2", "--verbose"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "MTP: draft depth 2" in out.out
    rc = main(["--model", str(folders["nohead"]), "--draft-model", str(folders["nohead"]),
               "--prompt", "x", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and err.startswith("error:") and "holds no MTP head" in err
    assert len(err.strip().splitlines()) == 1


# -- Qwen3.5/3.6 naming and config variants ------------------------------------------------
def _per_expert_head(w: dict) -> dict:
    """The head's fused experts rewritten one tensor per expert (the trunk stays fused)."""
    w = dict(w)
    p = "mtp.layers.0.mlp.experts"
    gate_up, down = w.pop(f"{p}.gate_up_proj"), w.pop(f"{p}.down_proj")
    mid = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        w[f"{p}.{e}.gate_proj.weight"] = gate_up[e, :mid]
        w[f"{p}.{e}.up_proj.weight"] = gate_up[e, mid:]
        w[f"{p}.{e}.down_proj.weight"] = down[e]
    return w


def test_moe_head_variants_load_alike(tmp_path):
    tc = tiny_text_config(moe=True)
    w = random_weights(tc, seed=41)
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in w  # fused, as released
    fused = write_checkpoint(tmp_path / "fused", moe=True, weights=w,
                             text_overrides={"mtp_use_dedicated_embeddings": False})
    mixed = write_checkpoint(tmp_path / "mixed", moe=True, weights=_per_expert_head(w))
    a, tok = mlx_mtp.load(fused, quiet=True)
    b, _ = mlx_mtp.load(mixed, quiet=True)
    assert mx.array_equal(_head_logits(a), _head_logits(b))


def test_unknown_head_variants_name_the_tensor_or_key(tmp_path):
    tc = tiny_text_config()
    w = random_weights(tc, seed=42)
    extra = dict(w, **{"mtp.embed_tokens.weight": w["model.language_model.embed_tokens.weight"]})
    p = write_checkpoint(tmp_path / "own_embed", weights=extra)
    with pytest.raises(MTPWeightError, match="unexpected MTP tensor mtp.embed_tokens.weight"):
        mlx_mtp.load(p, quiet=True)
    renamed = {k.replace("mtp.fc.", "mtp.eh_proj."): v for k, v in w.items()}
    p = write_checkpoint(tmp_path / "renamed", weights=renamed)
    with pytest.raises(MTPWeightError, match="mtp.fc.weight is missing"):
        mlx_mtp.load(p, quiet=True)
    p = write_checkpoint(tmp_path / "dedicated", weights=w,
                         text_overrides={"mtp_use_dedicated_embeddings": True})
    with pytest.raises(MTPWeightError, match="mtp_use_dedicated_embeddings=true"):
        mlx_mtp.load(p, quiet=True)


def test_unsupported_model_type_is_one_line(tmp_path, dense_ckpt):
    d = tmp_path / "ck"
    shutil.copytree(dense_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "deepseek_v3"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        mlx_mtp.load(d)
    msg = str(e.value)
    assert "\n" not in msg and "'deepseek_v3'" in msg
    assert "supported: qwen3_5, qwen3_5_moe, qwen3_next, qwen4_exp" in msg


# -- qwen4_exp: mlx-vlm's qwen4_exp_mtp drafter folders ------------------------------------
# written as mlx-vlm 0.7.10's qwen4_exp_mtp splitter writes them (prefix stripped,
# experts as switch_mlp, norms kept zero-centred, optionally quantized); hidden_size
# 64 so that a group of 64 fits (4-bit)
Q4X_PROMPT = [3, 17, 99, 42, 7, 7, 150, 258, 12, 64, 88, 5, 9, 200, 31, 1]


def _q4_trunk(src, out):
    """A 4-bit MLX checkpoint of the trunk `src` (mlx_lm's quantize_model with
    the family's quant_predicate, saved by mlx_lm: what a conversion writes)."""
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, _ = mlx_mtp.load(src, quiet=True)
    model, config = quantize_model(model, json.loads((src / "config.json").read_text()),
                                   group_size=64, bits=4)
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="module")
def q4x(tmp_path_factory):
    from mlx_mtp.testing.synthetic import write_qwen4_exp_checkpoint

    base = tmp_path_factory.mktemp("q4x_draft")
    wide = {"hidden_size": 64}
    hf = write_qwen4_exp_checkpoint(base / "hf", seed=51, text_overrides=wide)
    # the same trunk tensors without the head (the head's are drawn last)
    nohead = write_qwen4_exp_checkpoint(base / "nohead", seed=51, mtp=False, text_overrides=wide)
    return {
        "hf": hf, "nohead": nohead, "q4": _q4_trunk(nohead, base / "q4"),
        "vlm": write_mlx_vlm_drafter(hf, base / "vlm"),
        "vlm_q4": write_mlx_vlm_drafter(hf, base / "vlm_q4", bits=4),
    }


def _q4x_head_logits(model, tokens=Q4X_PROMPT):
    """The head's logits teacher-forced over the prompt's pairs (streams_p, tok_{p+1})."""
    seq = mx.array([tokens])
    h = model.trunk_hidden(seq, None)
    return model.logits_from_hidden(model.mtp(h[:, :-1], model.embed(seq[:, 1:])))


def test_qwen4_exp_drafter_gives_the_checkpoints_own_head(q4x, tmp_path):
    """mlx-vlm's qwen4_exp_mtp folder, and a folder of the release's mtp.*
    tensors with its config, attach the head the checkpoint itself holds:
    same weights (norms shifted exactly once), same head logits."""
    own, _ = mlx_mtp.load(q4x["hf"], quiet=True)
    model, _ = mlx_mtp.load(q4x["nohead"], draft=q4x["vlm"], quiet=True)
    assert model.has_mtp and model.mtp_layers == 1
    raw = mx.load(str(q4x["hf"] / "model.safetensors"))
    folder = mx.load(str(q4x["vlm"] / "model.safetensors"))
    # mlx-vlm keeps the head's norms zero-centred; attached, they are shifted once
    assert mx.array_equal(folder["pre_fc_norm_hidden.weight"], raw["mtp.pre_fc_norm_hidden.weight"])
    for a, b in [(model.mtp.pre_fc_norm_hidden, own.mtp.pre_fc_norm_hidden),
                 (model.mtp.layers[0].self_attn.indexer.k_layernorm,
                  own.mtp.layers[0].self_attn.indexer.k_layernorm),
                 (model.mtp.hyper_connection_mixer.hc_norm, own.mtp.hyper_connection_mixer.hc_norm)]:
        assert mx.array_equal(a.weight, b.weight)
    want = _q4x_head_logits(own)
    assert mx.array_equal(_q4x_head_logits(model), want)

    d = tmp_path / "hf_head"  # the release's head shard beside its config.json
    d.mkdir()
    mx.save_safetensors(str(d / "model-mtp.safetensors"),
                        {k: v for k, v in raw.items() if k.startswith("mtp.")}, metadata={"format": "pt"})
    shutil.copy(q4x["hf"] / "config.json", d / "config.json")
    model, _ = mlx_mtp.load(q4x["nohead"], draft=d, quiet=True)
    assert mx.array_equal(_q4x_head_logits(model), want)


def test_qwen4_exp_drafter_greedy_equals_plain(q4x):
    """Greedy MTP with the attached head == plain greedy decoding, depths 1-3,
    with the head's own drafts and with oracle drafts right 70% of the time."""
    from util import mtp, reference

    from mlx_mtp.testing.drafters import OracleDrafter
    from mlx_mtp.stats import MTPStats

    model, _ = mlx_mtp.load(q4x["nohead"], draft=q4x["vlm"], quiet=True)
    want = reference(model, Q4X_PROMPT, N)
    for k in (1, 2, 3):
        assert mtp(model, Q4X_PROMPT, k, N) == want, f"depth {k}"
        stats = MTPStats()
        drafter = OracleDrafter(want, 0.7, model.vocab_size, seed=k)
        assert mtp(model, Q4X_PROMPT, k, N, drafter=drafter, stats=stats) == want, f"depth {k}"
        assert 0 < stats.accepted < stats.drafted


def test_qwen4_exp_quantized_drafter_on_q4_trunk(q4x):
    """A 4-bit qwen4_exp_mtp folder: its head equals the checkpoint's own head
    quantized the way the splitter does (every 2-D weight a group fits but the
    router), and on a 4-bit trunk greedy MTP == plain decoding, depths 1-3."""
    import mlx.nn as nn
    from util import mtp, reference

    from mlx_mtp.testing.drafters import OracleDrafter
    from mlx_mtp.stats import MTPStats

    own, _ = mlx_mtp.load(q4x["hf"], quiet=True)
    nn.quantize(own.mtp, group_size=64, bits=4, class_predicate=lambda p, m: (
        hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0 and not p.endswith("mlp.gate")))
    fp_trunk, _ = mlx_mtp.load(q4x["nohead"], draft=q4x["vlm_q4"], quiet=True)
    head = fp_trunk.mtp
    assert head.fc_hidden.bits == 4 and head.layers[0].mlp.shared_expert_gate.bits == 4
    assert not isinstance(head.layers[0].mlp.gate, nn.QuantizedLinear)
    assert mx.array_equal(_q4x_head_logits(fp_trunk), _q4x_head_logits(own))

    model, _ = mlx_mtp.load(q4x["q4"], draft=q4x["vlm_q4"], quiet=True)
    assert model.layers[1].self_attn.indexer.index_qk_proj.bits == 4
    want = reference(model, Q4X_PROMPT, N)
    for k in (1, 2, 3):
        stats = MTPStats()
        drafter = OracleDrafter(want, 0.7, model.vocab_size, seed=k)
        assert mtp(model, Q4X_PROMPT, k, N, drafter=drafter, stats=stats) == want, f"depth {k}"
        assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("key,value", [("hidden_size", 32), ("vocab_size", 300), ("hc_count", 4),
                                       ("indexer_budget", 8), ("indexer_compress_ratio", 4)])
def test_qwen4_exp_drafter_for_another_trunk_is_refused(q4x, tmp_path, key, value):
    """A qwen4_exp_mtp folder whose source config differs from the trunk's in a
    key the head depends on: refused in one line naming the key (before any
    tensor is read: these tensors would load)."""
    d = shutil.copytree(q4x["vlm"], tmp_path / "other")
    config = json.loads((d / "config.json").read_text())
    config["text_config"][key] = value
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        mlx_mtp.load(q4x["nohead"], draft=d, quiet=True)
    assert str(e.value).startswith(f"trunk mismatch: {key} ") and "\n" not in str(e.value)


def test_qwen4_exp_and_qwen3_5_drafters_do_not_mix(q4x, folders):
    with pytest.raises(ValueError, match="trunk mismatch: model_type 'qwen4_exp' .* vs 'qwen3_5'"):
        mlx_mtp.load(q4x["nohead"], draft=folders["vlm"], quiet=True)
    with pytest.raises(ValueError, match="trunk mismatch: model_type 'qwen3_5' .* vs 'qwen4_exp'"):
        mlx_mtp.load(folders["nohead"], draft=q4x["vlm"], quiet=True)
