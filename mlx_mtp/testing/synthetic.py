"""Random-weight checkpoints in the released Hugging Face layout.

Used by the tests and benchmarks (no real weights can be fetched here).
Qwen3.5/3.6 (`family="qwen3_5"`): `model.language_model.*`, `lm_head.*`,
`mtp.*`, a vision tensor to ignore, nested `text_config`, fused 3-D experts
(or one tensor per expert); with `vision=True` a tiny but real vision tower
(`model.visual.*`, random weights), its config keys and
preprocessor_config.json instead of that one tensor. Qwen3-Next (`family="qwen3_next"`, as
transformers' Qwen3NextForCausalLM names it): flat config, `model.*`,
`lm_head.*`, `mtp.*`, fused GDN projections `in_proj_qkvz` / `in_proj_ba`,
one tensor per expert, in the head too. Both: zero-centred norms, HF conv1d
layout [C, 1, K], a byte-level tokenizer and a chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Optional

import numpy as np

from ..checkpoint import text_config

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# a vision checkpoint's: content as text or a list of parts, an image part as
# Qwen3.5's template writes it (one pad between vision-start and vision-end)
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen3.5 / 3.6's rules in a few lines (the server's `--chat-template`): one
# system message, first ("System message must be at the beginning"), its
# text then the tools in the system turn, tool results as user turns.
FIRST_SYSTEM_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "{% endfor %}"
    "{% if messages[0]['role'] == 'system' or tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{% if tools %}{{ '\n\n# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' }}"
    "{{ tool | tojson }}{% endfor %}{{ '\n</tools>' }}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% elif message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Chat templates with tool calling (and thinking), in the two formats of the
# supported families: Qwen3-Next's JSON calls (mlx_lm's `json_tools` parser)
# and Qwen3.5/3.6's XML calls (`qwen3_coder`). mlx_lm infers the parser from
# the template's text; `<think>` / `</think>` in the vocabulary turn its
# thinking on. Written for the tests, in the released templates' shape.
# (HF renders templates with trim_blocks: every newline here is in a {{ '...' }})
_TOOLS_PREAMBLE = (
    "{% if tools %}{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\n<tools>' }}{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\n</tools>\nCALLS<|im_end|>\n' }}{% endif %}"
)
_TOOLS_TURNS = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% if message['content'] %}{{ message['content'] + '\n' }}{% endif %}"
    "{% for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}CALL{% endfor %}{{ '<|im_end|>\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + "
    "'\n</tool_response><|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ 'THINK_OFF' }}"
    "{% else %}{{ 'THINK_ON' }}{% endif %}{% endif %}"
)
_JSON_CALL = ("{{ '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
              "{% if tool_call.arguments is string %}{{ tool_call.arguments }}"
              "{% else %}{{ tool_call.arguments | tojson }}{% endif %}{{ '}\n</tool_call>' }}")
_XML_CALL = ("{{ '<tool_call>\n<function=' + tool_call.name + '>\n' }}"
             "{% for name, value in tool_call.arguments | items %}"
             "{{ '<parameter=' + name + '>\n' }}"
             "{% if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}"
             "{{ '\n</parameter>\n' }}{% endfor %}{{ '</function>\n</tool_call>' }}")
TOOL_FORMATS = {
    "json": ("For each call: <tool_call>\\n{\"name\": <function-name>, \"arguments\": "
             "<args-json-object>}\\n</tool_call>", _JSON_CALL),
    # (mlx_lm recognizes the format by this line's "<tool_call>\n<function=")
    "xml": ("For each call: <tool_call>\\n<function=NAME>\\n<parameter=NAME>\\nvalue\\n"
            "</parameter>\\n</function>\\n</tool_call>", _XML_CALL),
}
THINK_TOKENS = ("<think>", "</think>")
TOOL_TOKENS = ("<tool_call>", "</tool_call>")


def tool_chat_template(fmt: str, thinking: bool = False) -> str:
    """A chat template that calls tools in `fmt` ("json" or "xml"); with
    `thinking`, the generation prompt opens a think block, as Qwen's
    templates do, unless `enable_thinking` is false (then, unlike Qwen's, it
    writes no empty block: a next turn's prompt then extends this one's
    prompt and answer exactly, as a template without thinking does)."""
    calls, call = TOOL_FORMATS[fmt]
    on, off = ("<think>\\n" if thinking else "", "")
    return (_TOOLS_PREAMBLE.replace("CALLS", calls)
            + _TOOLS_TURNS.replace("CALL", call).replace("THINK_ON", on)
            .replace("THINK_OFF", off))


# The geometry both tiny families share (Qwen3.5's and Qwen3-Next's configs
# name these fields alike), and their MoE fields
_TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    full_attention_interval=4,
    rms_norm_eps=1e-6,
    vocab_size=259,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    attention_bias=False,
)
_TINY_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    decoder_sparse_step=1,
    norm_topk_prob=True,
)


def tiny_text_config(moe: bool = False, **overrides) -> Dict:
    cfg = dict(
        model_type="qwen3_5_moe_text" if moe else "qwen3_5_text",
        **_TINY,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
        mtp_num_hidden_layers=1,
        eos_token_id=258,
    )
    if moe:
        cfg.update(_TINY_MOE)
    cfg.update(overrides)
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % cfg["full_attention_interval"] == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    return cfg


def tiny_next_config(**overrides) -> Dict:
    """A tiny Qwen3-Next config (flat, as the released config.json; it names
    no MTP layer count, as the released one does not)."""
    cfg = dict(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        **_TINY,
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        rope_scaling=None,
        **_TINY_MOE,
        mlp_only_layers=[],
        hidden_act="silu",
        eos_token_id=258,
        # no torch_dtype (released: bfloat16): conversions then stay float32,
        # since MLX CPU's gather_mm (MoE experts) runs only in float32
    )
    cfg.update(overrides)
    return cfg


def _next_layer_is_moe(tc: Dict, index: int) -> bool:
    """Qwen3-Next's MLP rule for layer `index` (trunk and head alike)."""
    return (index not in tc.get("mlp_only_layers", [])
            and tc.get("num_experts", 0) > 0
            and (index + 1) % tc.get("decoder_sparse_step", 1) == 0)


def random_weights(tc: Dict, seed: int = 0, *, mtp: bool = True,
                   per_expert: bool = False, scale: float = 0.02,
                   mtp_layers: Optional[int] = None) -> Dict[str, np.ndarray]:
    """HF-named float32 numpy tensors with random values; the layout follows
    tc["model_type"] (Qwen3.5/3.6 or Qwen3-Next). `mtp_layers` defaults to
    the config's count (1 when it names none)."""
    rng = np.random.default_rng(seed)
    next_layout = tc["model_type"] == "qwen3_next"
    per_expert = per_expert or next_layout  # Qwen3-Next ships one tensor per expert
    if mtp_layers is None:
        mtp_layers = tc.get("mtp_num_hidden_layers", tc.get("num_nextn_predict_layers", 1))
    H, V = tc["hidden_size"], tc["vocab_size"]

    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def zc_norm(n):  # zero-centred RMSNorm weight (applied as 1 + w)
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    K = tc["linear_conv_kernel_dim"]
    conv_dim = 2 * hk * dk + hv * dv
    moe = tc.get("num_experts", 0) > 0

    def attn(p):
        return {
            f"{p}.q_proj.weight": w(2 * nh * hd, H),
            f"{p}.k_proj.weight": w(nkv * hd, H),
            f"{p}.v_proj.weight": w(nkv * hd, H),
            f"{p}.o_proj.weight": w(H, nh * hd),
            f"{p}.q_norm.weight": zc_norm(hd),
            f"{p}.k_norm.weight": zc_norm(hd),
        }

    def mlp(p, index):
        if not (_next_layer_is_moe(tc, index) if next_layout else moe):
            I = tc["intermediate_size"]
            return {
                f"{p}.gate_proj.weight": w(I, H),
                f"{p}.up_proj.weight": w(I, H),
                f"{p}.down_proj.weight": w(H, I),
            }
        E, I, S = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]
        out = {
            f"{p}.gate.weight": w(E, H, s=0.2),
            f"{p}.shared_expert.gate_proj.weight": w(S, H),
            f"{p}.shared_expert.up_proj.weight": w(S, H),
            f"{p}.shared_expert.down_proj.weight": w(H, S),
            f"{p}.shared_expert_gate.weight": w(1, H),
        }
        gate_up, down = w(E, 2 * I, H), w(E, H, I)
        if per_expert:
            for e in range(E):
                out[f"{p}.experts.{e}.gate_proj.weight"] = gate_up[e, :I]
                out[f"{p}.experts.{e}.up_proj.weight"] = gate_up[e, I:]
                out[f"{p}.experts.{e}.down_proj.weight"] = down[e]
        else:
            out[f"{p}.experts.gate_up_proj"] = gate_up
            out[f"{p}.experts.down_proj"] = down
        return out

    t: Dict[str, np.ndarray] = {}
    lm = "model" if next_layout else "model.language_model"
    t[f"{lm}.embed_tokens.weight"] = w(V, H, s=1.0)
    for i in range(tc["num_hidden_layers"]):
        p = f"{lm}.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = zc_norm(H)
        t[f"{p}.post_attention_layernorm.weight"] = zc_norm(H)
        if (i + 1) % tc["full_attention_interval"] == 0:
            t.update(attn(f"{p}.self_attn"))
        else:
            la = f"{p}.linear_attn"
            if next_layout:  # fused, grouped per key head: [q k v z] and [b a]
                t[f"{la}.in_proj_qkvz.weight"] = w(conv_dim + hv * dv, H, s=0.1)
                t[f"{la}.in_proj_ba.weight"] = w(2 * hv, H, s=0.1)
            else:
                t[f"{la}.in_proj_qkv.weight"] = w(conv_dim, H, s=0.1)
                t[f"{la}.in_proj_z.weight"] = w(hv * dv, H, s=0.1)
                t[f"{la}.in_proj_b.weight"] = w(hv, H, s=0.1)
                t[f"{la}.in_proj_a.weight"] = w(hv, H, s=0.1)
            t[f"{la}.conv1d.weight"] = w(conv_dim, 1, K, s=0.3)
            t[f"{la}.dt_bias"] = np.ones(hv, np.float32)
            t[f"{la}.A_log"] = np.log(rng.uniform(1, 16, hv)).astype(np.float32)
            t[f"{la}.norm.weight"] = (1.0 + rng.standard_normal(dv) * 0.1).astype(np.float32)
            t[f"{la}.out_proj.weight"] = w(H, hv * dv, s=0.1)
        t.update(mlp(f"{p}.mlp", i))
    t[f"{lm}.norm.weight"] = zc_norm(H)
    if not tc.get("tie_word_embeddings", False):
        t["lm_head.weight"] = w(V, H, s=0.5)
    if mtp and mtp_layers:
        for i in range(mtp_layers):
            p = f"mtp.layers.{i}"
            t[f"{p}.input_layernorm.weight"] = zc_norm(H)
            t[f"{p}.post_attention_layernorm.weight"] = zc_norm(H)
            t.update(attn(f"{p}.self_attn"))
            t.update(mlp(f"{p}.mlp", i))
        t["mtp.fc.weight"] = w(H, 2 * H, s=0.1)
        t["mtp.pre_fc_norm_embedding.weight"] = zc_norm(H)
        t["mtp.pre_fc_norm_hidden.weight"] = zc_norm(H)
        t["mtp.norm.weight"] = zc_norm(H)
    if not next_layout:
        # Vision tower tensors ship in the released checkpoints; loaders ignore them.
        t["model.visual.patch_embed.proj.weight"] = w(8, 3, 2, 2)
    return t


def write_agent_demo(path, context: int = 262144, end_scale: float = 3.0) -> Path:
    """The demo model with a long context and short answers, for tests that
    point real agents at the server: their prompts (Claude Code's system
    prompt and tools) need more than the demo's 4096 positions (its partial
    RoPE and GDN layers take any length), and an agent waits for answers
    that end, which the demo writes only for code openings. Its output layer
    is the embedding (the demo ties them) with the end-of-turn row scaled by
    `end_scale`: greedy answers then end within tens of tokens."""
    import shutil

    import mlx.core as mx

    from .. import demo

    src, path = Path(demo.__file__).parent, Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    for f in src.glob("tokenizer*.json"):
        shutil.copy(f, path / f.name)
    head = mx.array(weights["language_model.model.embed_tokens.weight"])
    config = json.loads((src / "config.json").read_text())
    end = config["eos_token_id"][-1]  # <|im_end|>
    head[end] = head[end] * end_scale
    weights["language_model.lm_head.weight"] = head
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = False
    config["text_config"]["max_position_embeddings"] = context
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def write_tokenizer(path: Path, eos_token_id: int = 258, chat_template: str = CHAT_TEMPLATE,
                    added=(), specials=()):
    """A byte-level tokenizer (256 byte tokens, no merges) with Qwen's three
    special tokens (ids 256-258), `added` plain added tokens after them
    (e.g. `<think>`, as Qwen's tokenizers add them: not special), then
    `specials`, special added tokens (the vision tokens: `VISION_TOKENS`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    if specials:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": chat_template,
    }, indent=1))


def save_safetensors_shards(path: Path, tensors: Dict[str, np.ndarray], dtype: str = "float32",
                            shards: int = 1):
    """Write model-0000i-of-0000n.safetensors (+ index when sharded), HF style."""
    import mlx.core as mx

    names = sorted(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    mx_dtype = getattr(mx, dtype)
    for s in range(shards):
        part = names[s * per:(s + 1) * per]
        fname = "model.safetensors" if shards == 1 else f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        arrays = {}
        for n in part:
            a = mx.array(tensors[n])
            # A_log stays fp32 in released checkpoints' spirit; others take dtype.
            arrays[n] = a if n.endswith("A_log") else a.astype(mx_dtype)
            weight_map[n] = fname
        mx.save_safetensors(str(path / fname), arrays, metadata={"format": "pt"})
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))


def write_checkpoint(path, *, moe: bool = False, seed: int = 0, mtp: bool = True,
                     per_expert: bool = False, dtype: str = "float32", shards: int = 1,
                     text_overrides: Optional[Dict] = None,
                     weights: Optional[Dict[str, np.ndarray]] = None,
                     family: str = "qwen3_5", tools: Optional[str] = None,
                     thinking: bool = False, vision: bool = False) -> Path:
    """Write a random checkpoint folder in the released HF layout: Qwen3.5
    (Qwen3.5-MoE with moe=True), or Qwen3-Next with family="qwen3_next".
    tools="json" or "xml": a chat template that calls tools in that format
    (`tool_chat_template`), `<tool_call>` / `</tool_call>` added tokens;
    thinking: `<think>` / `</think>` too, and the template opens a think
    block (as Qwen3.5's). vision (Qwen3.5 only): a tiny real vision tower
    (`tiny_vision_config`, `vision_weights`) in place of the one dummy
    tensor, the four vision tokens as special tokens after the others (their
    ids in config.json), and preprocessor_config.json
    (`TINY_PREPROCESSOR`); the text weights are those without it but the
    trunk's attention, made louder (`louder_attention`) so that the answers
    depend on the image."""
    added = (THINK_TOKENS if thinking else ()) + (TOOL_TOKENS if tools else ())
    specials = VISION_TOKENS if vision else ()
    template = (tool_chat_template(tools, thinking) if tools
                else VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE)
    if thinking and not tools:
        raise ValueError("thinking=True needs tools= (the template with thinking calls tools)")
    if vision and family != "qwen3_5":
        raise ValueError("vision=True is for family='qwen3_5' (Qwen3.5/3.6 dense or MoE)")
    if added or specials:
        text_overrides = dict(text_overrides or {})
        text_overrides.setdefault("vocab_size", _TINY["vocab_size"] + len(added) + len(specials))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if family == "qwen3_next":
        config = tiny_next_config(**(text_overrides or {}))
        if weights is None:
            weights = random_weights(config, seed, mtp=mtp)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        save_safetensors_shards(path, weights, dtype, shards)
        write_tokenizer(path, config["eos_token_id"], template, added)
        return path
    if family != "qwen3_5":
        raise ValueError(f"unknown family {family!r}")
    tc = tiny_text_config(moe=moe, **(text_overrides or {}))
    generated = weights is None
    if generated:
        weights = random_weights(tc, seed, mtp=mtp, per_expert=per_expert)
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "text_config": tc,
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": tc.get("tie_word_embeddings", False),
        "eos_token_id": tc["eos_token_id"],
    }
    if vision:
        vc = tiny_vision_config(tc["hidden_size"], moe=moe)
        weights = {k: v for k, v in weights.items() if not k.startswith("model.visual.")}
        if generated:
            weights = louder_attention(weights)
        weights.update(vision_weights(vc, seed))
        config["vision_config"] = vc
        first = _TINY["vocab_size"] + len(added)  # the specials' ids follow the added tokens'
        config.update({key: first + i for i, key in enumerate(VISION_TOKEN_KEYS)})
        (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_safetensors_shards(path, weights, dtype, shards)
    write_tokenizer(path, tc["eos_token_id"], template, added, specials)
    return path


# How much louder a vision checkpoint's trunk attention reads the earlier
# tokens (its value and output projections, scaled): at the text scale a
# random model's answer is nearly a function of the last token (another image
# moved its log-probs by ~1e-2 and its greedy tokens not at all), so a test
# could not tell whether the image, or its M-RoPE positions, were used.
VISION_ATTENTION_GAIN = 10.0


def louder_attention(weights: Dict[str, np.ndarray], gain: float = VISION_ATTENTION_GAIN
                     ) -> Dict[str, np.ndarray]:
    """`weights` with the trunk's full-attention value and output
    projections scaled by `gain` (the head's left as they are)."""
    lm = "model.language_model.layers."
    return {k: v * np.float32(gain) if k.startswith(lm) and k.endswith(
        (".self_attn.v_proj.weight", ".self_attn.o_proj.weight")) else v
        for k, v in weights.items()}


# Qwen3.5/3.6's vision tokens (as the released tokenizer names them) and the
# config.json keys that give their ids, in the same order
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
VISION_TOKEN_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")

# The released preprocessor_config.json's keys, with small pixel bounds: an
# image is resized to between 32x32 and 128x128 pixels' worth (released:
# 256x256 and 4096x4096), so at most 64 patches, 16 image tokens.
TINY_PREPROCESSOR = {
    "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}


def tiny_vision_config(out_hidden_size: int, moe: bool = False, **overrides) -> Dict:
    """A tiny Qwen3.5/3.6 `vision_config` (the released keys; released: depth
    27, hidden 1152, 16 heads, 2304 position embeddings); `out_hidden_size`
    is the text model's hidden size, as released."""
    cfg = dict(
        model_type="qwen3_5_moe" if moe else "qwen3_5",
        deepstack_visual_indexes=[],
        depth=2,
        hidden_size=32,
        hidden_act="gelu_pytorch_tanh",
        intermediate_size=64,
        num_heads=2,
        in_channels=3,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=out_hidden_size,
        num_position_embeddings=16,  # a 4x4 grid, interpolated to each image's
        initializer_range=0.02,
    )
    cfg.update(overrides)
    return cfg


def vision_weights(vc: Dict, seed: int = 0, scale: float = 0.1) -> Dict[str, np.ndarray]:
    """The vision tower's HF-named float32 tensors (`model.visual.*`, torch
    layouts: Conv3d patch embedding [D, C, T, P, P]) with random values; the
    released tower's names, 12 per block (333 at depth 27)."""
    rng = np.random.default_rng(seed + 1000)
    D, I, C = vc["hidden_size"], vc["intermediate_size"], vc["in_channels"]
    M = D * vc["spatial_merge_size"] ** 2
    T, P = vc["temporal_patch_size"], vc["patch_size"]

    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def layer_norm(p, n):
        return {f"{p}.weight": (1.0 + w(n)).astype(np.float32), f"{p}.bias": w(n)}

    def linear(p, o, i, s=scale):
        return {f"{p}.weight": w(o, i, s=s), f"{p}.bias": w(o)}

    v = "model.visual"
    t = {f"{v}.patch_embed.proj.weight": w(D, C, T, P, P, s=0.05), f"{v}.patch_embed.proj.bias": w(D),
         f"{v}.pos_embed.weight": w(vc["num_position_embeddings"], D, s=0.5)}
    for i in range(vc["depth"]):
        b = f"{v}.blocks.{i}"
        t.update(layer_norm(f"{b}.norm1", D))
        t.update(layer_norm(f"{b}.norm2", D))
        t.update(linear(f"{b}.attn.qkv", 3 * D, D, s=0.3))
        t.update(linear(f"{b}.attn.proj", D, D))
        t.update(linear(f"{b}.mlp.linear_fc1", I, D))
        t.update(linear(f"{b}.mlp.linear_fc2", D, I))
    t.update(layer_norm(f"{v}.merger.norm", D))
    t.update(linear(f"{v}.merger.linear_fc1", M, M))
    t.update(linear(f"{v}.merger.linear_fc2", vc["out_hidden_size"], M))
    return t


# Norms mlx-vlm's qwen3_5_mtp splitter shifts (+1) when it reads an HF source.
_MLX_VLM_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                  ".k_norm.weight", "norm.weight", "pre_fc_norm_embedding.weight",
                  "pre_fc_norm_hidden.weight")
# mlx-vlm 0.7.10's splitters (mlx_vlm/speculative/drafters/mtp_split.py's
# MTP_SPLITTERS), by the source's model_type: the drafter's model_type, the norms
# it shifts, block_size = depth + extra, the tie_word_embeddings default
_MLX_VLM_SPLITTERS = {
    "qwen3_5": ("qwen3_5_mtp", _MLX_VLM_NORMS, 2, True),
    "qwen3_5_moe": ("qwen3_5_mtp", _MLX_VLM_NORMS, 2, True),
    # qwen4_exp_mtp/split.py: no norm shift (mlx-vlm's Qwen4ExpRMSNorm applies 1 + w)
    "qwen4_exp": ("qwen4_exp_mtp", (), 1, False),
}


def write_mlx_vlm_drafter(source, out, *, bits: Optional[int] = None, group_size: int = 64) -> Path:
    """The split drafter folder mlx-vlm's splitter writes from an HF checkpoint
    (mlx_vlm/speculative/drafters/mtp_split.py and the family's
    `<drafter>/split.py`, read, not copied): `qwen3_5_mtp` from Qwen3.5/3.6,
    `qwen4_exp_mtp` from qwen4_exp. config.json with the drafter's
    `model_type`, the source's `text_config`, `block_size`,
    `tie_word_embeddings` (+ `quantization`); `model.safetensors` (format
    mlx) with the head's tensors without the `mtp.` prefix, experts as
    `switch_mlp`, norms shifted by qwen3_5_mtp and kept zero-centred by
    qwen4_exp_mtp; the tokenizer files. With `bits`, every 2-D+ `.weight`
    whose last axis the group divides is affine-quantized, but the router
    gate (`mlp.gate.weight`), as the splitters do."""
    import mlx.core as mx

    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    tc = text_config(config)
    drafter, shifted_norms, block_extra, tie_default = _MLX_VLM_SPLITTERS[config["model_type"]]
    heads = {}
    for f in sorted(source.glob("*.safetensors")):
        heads.update({k[len("mtp."):]: v for k, v in mx.load(str(f)).items() if k.startswith("mtp.")})
    tensors, per_expert = {}, {}
    for k, v in heads.items():
        parts = k.split(".")
        if ".experts." in k and parts[-3].isdigit():  # layers.i.mlp.experts.e.proj.weight
            mlp = ".".join(parts[:-4])
            per_expert.setdefault((mlp, parts[-2]), {})[int(parts[-3])] = v
        elif k.endswith(".experts.gate_up_proj"):
            mlp = k[: -len(".experts.gate_up_proj")]
            gate, up = mx.split(v, 2, axis=-2)
            tensors[f"{mlp}.switch_mlp.gate_proj.weight"] = gate
            tensors[f"{mlp}.switch_mlp.up_proj.weight"] = up
        elif k.endswith(".experts.down_proj"):
            tensors[f"{k[: -len('.experts.down_proj')]}.switch_mlp.down_proj.weight"] = v
        elif shifted_norms and k.endswith(shifted_norms) and v.ndim == 1:
            tensors[k] = v + 1.0
        else:
            tensors[k] = v
    for (mlp, proj), experts in per_expert.items():
        tensors[f"{mlp}.switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in sorted(experts)])
    draft_config = {
        "model_type": drafter,
        "text_config": tc,
        "block_size": int(tc.get("mtp_num_hidden_layers", 1)) + block_extra,
        "tie_word_embeddings": bool(tc.get("tie_word_embeddings", tie_default)),
    }
    if bits:
        for k in [k for k in tensors if k.endswith(".weight") and not k.endswith("mlp.gate.weight")]:
            v = tensors[k]
            if v.ndim >= 2 and v.shape[-1] % group_size == 0:
                base = k[: -len(".weight")]
                tensors[k], tensors[f"{base}.scales"], tensors[f"{base}.biases"] = mx.quantize(
                    v, group_size=group_size, bits=bits)
        draft_config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
        draft_config["quantization_config"] = draft_config["quantization"]
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(dict(sorted(draft_config.items())), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json"):
        if (source / name).exists():
            (out / name).write_bytes((source / name).read_bytes())
    return out


# --------------------------------------------------------------- qwen4_exp

def tiny_qwen4_exp_config(**overrides) -> Dict:
    """A tiny Qwen3.8-Flash-Next text config, keys as transformers'
    `Qwen4ExpTextConfig` reads them. Small enough for QSA to pick among key
    blocks on a 16-token prompt (2-token blocks, 2 kept), with PLE on the
    two GDN layers. See docs/qwen4_exp.md."""
    cfg = dict(
        model_type="qwen4_exp_text",
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        vocab_size=259,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        norm_topk_prob=True,
        hc_count=3,
        hc_lowrank=8,
        ple_layer_ids=[1, 3],
        ple_embed_dim=16,
        ple_conv_kernel_size=3,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=8,
        seed=1234,
        split_ngram_parts=3,
        indexer_n_heads=4,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=4,
        indexer_compress_ratio=2,
        output_gate_type="sigmoid",
        mtp_num_hidden_layers=1,
        eos_token_id=258,
    )
    cfg.update(overrides)
    if "layer_types" not in overrides:
        cfg["layer_types"] = ["full_attention" if (i + 1) % 2 == 0 else "linear_attention"
                              for i in range(cfg["num_hidden_layers"])]
    return cfg


def qwen4_exp_random_weights(tc: Dict, seed: int = 0, *, mtp: bool = True,
                             scale: float = 0.1) -> Dict[str, np.ndarray]:
    """HF-named tensors for `tiny_qwen4_exp_config`-style configs, in the
    released layout: `model.language_model.*`, `lm_head`, fused experts
    (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]),
    zero-centred RMSNorms, torch conv layout [C, 1, K], n-gram tables in
    `split_ngram_parts` row chunks (`ngram_embedding.shard_{i}.weight`, as
    torch.chunk cuts them) plus the derived int64 buffers transformers saves.
    With `mtp`, the head as mlx-vlm's `qwen4_exp_mtp` drafter reads it
    (`mtp.pre_fc_norm_{embedding,hidden}`, `mtp.fc_{embedding,hidden}`,
    `mtp.layers.0.*` an indexed-attention layer, `mtp.hyper_connection_mixer`)."""
    from ..models.qwen4_exp import TextModelArgs, ngram_head_sizes, ngram_multipliers

    rng = np.random.default_rng(seed)
    args = TextModelArgs.from_dict(tc)
    H, V, hc = tc["hidden_size"], tc["vocab_size"], tc["hc_count"]
    W = hc * H

    def w(*shape, s=scale):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def zc(n):  # zero-centred RMSNorm weight (applied as 1 + w)
        return (rng.standard_normal(n) * 0.1).astype(np.float32)

    def hyper(p, combine=True):
        t = {f"{p}.hc_norm.weight": zc(W), f"{p}.input_mix_weight_down.weight": w(tc["hc_lowrank"], W, s=0.3),
             f"{p}.input_mix_weight_up.weight": w(W, tc["hc_lowrank"], s=0.3)}
        if combine:
            t[f"{p}.block_inject_weight.weight"] = w(hc, W, s=0.3)
        return t

    nh, nkv, hd = tc["num_attention_heads"], tc["num_key_value_heads"], tc["head_dim"]
    E, I, S = tc["num_experts"], tc["moe_intermediate_size"], tc["shared_expert_intermediate_size"]

    def attention_layer(p):
        nih, idh = tc["indexer_n_heads"], tc["indexer_head_dim"]
        return {f"{p}.self_attn.q_proj.weight": w(nh * hd * 2, H), f"{p}.self_attn.k_proj.weight": w(nkv * hd, H),
                f"{p}.self_attn.v_proj.weight": w(nkv * hd, H), f"{p}.self_attn.o_proj.weight": w(H, nh * hd),
                f"{p}.self_attn.q_norm.weight": zc(hd), f"{p}.self_attn.k_norm.weight": zc(hd),
                f"{p}.self_attn.indexer.index_qk_proj.weight": w((nih + 1) * idh, H, s=0.5),
                f"{p}.self_attn.indexer.q_layernorm.weight": zc(idh),
                f"{p}.self_attn.indexer.k_layernorm.weight": zc(idh)}

    def moe(p):
        return {f"{p}.mlp.gate.weight": w(E, H, s=0.5), f"{p}.mlp.experts.gate_up_proj": w(E, 2 * I, H),
                f"{p}.mlp.experts.down_proj": w(E, H, I), f"{p}.mlp.shared_expert.gate_proj.weight": w(S, H),
                f"{p}.mlp.shared_expert.up_proj.weight": w(S, H),
                f"{p}.mlp.shared_expert.down_proj.weight": w(H, S),
                f"{p}.mlp.shared_expert_gate.weight": w(1, H)}

    t = {"model.language_model.embed_tokens.weight": w(V, H, s=1.0), "lm_head.weight": w(V, H, s=0.3)}
    t.update(hyper("model.language_model.hyper_connection_mixer", combine=False))
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv, K = tc["linear_key_head_dim"], tc["linear_value_head_dim"], tc["linear_conv_kernel_dim"]
    for i, kind in enumerate(args.layer_types):
        p = f"model.language_model.layers.{i}"
        if kind == "linear_attention":
            C = 2 * hk * dk + hv * dv
            t.update({f"{p}.linear_attn.in_proj_qkv.weight": w(C, H), f"{p}.linear_attn.in_proj_z.weight": w(hv * dv, H),
                      f"{p}.linear_attn.in_proj_b.weight": w(hv, H), f"{p}.linear_attn.in_proj_a.weight": w(hv, H),
                      f"{p}.linear_attn.conv1d.weight": w(C, 1, K, s=0.5),
                      f"{p}.linear_attn.dt_bias": (1 + w(hv)).astype(np.float32),
                      f"{p}.linear_attn.A_log": np.log(rng.uniform(1, 16, hv)).astype(np.float32),
                      f"{p}.linear_attn.norm.weight": (1 + w(dv)).astype(np.float32),
                      f"{p}.linear_attn.out_proj.weight": w(H, hv * dv)})
        else:
            t.update(attention_layer(p))
        t.update(moe(p))
        t.update(hyper(f"{p}.attn_hyper_connection"))
        t.update(hyper(f"{p}.mlp_hyper_connection"))
        if i + 1 in args.ple_layer_ids:
            j = args.ple_layer_ids.index(i + 1)
            sizes = ngram_head_sizes(args, j)
            div = tc["make_ngram_vocab_size_divisible_by"]
            rows = -(-sum(sizes) // div) * div
            heads = (tc["ngram_size"] - 1) * tc["heads_per_ngram"]
            table = w(rows, tc["ple_embed_dim"] // heads, s=1.0)
            q = p + ".ple.ple_embedding"
            step = -(-rows // tc["split_ngram_parts"])  # torch.chunk: equal chunks, the last shorter
            for s_i, lo in enumerate(range(0, rows, step)):
                t[f"{q}.ngram_embedding.shard_{s_i}.weight"] = table[lo:lo + step]
            t[f"{q}.layer_multipliers"] = np.array(
                ngram_multipliers(V, tc["ngram_size"], j, tc["seed"]), dtype=np.int64)
            t[f"{q}.ngram_heads_vocab_sizes"] = np.array(sizes, dtype=np.int64)
            t[f"{q}.ngram_heads_offsets"] = np.cumsum([0] + sizes[:-1]).astype(np.int64)
            E_ = tc["ple_embed_dim"]
            t.update({f"{p}.ple.key_proj.weight": w(W, E_, s=0.5), f"{p}.ple.value_proj.weight": w(H, E_, s=0.5),
                      f"{p}.ple.norm_key.weight": zc(W), f"{p}.ple.norm_query.weight": zc(W),
                      f"{p}.ple.norm_conv.weight": zc(W),
                      f"{p}.ple.conv1d.weight": w(W, 1, tc["ple_conv_kernel_size"], s=0.5)})
    if mtp:
        t.update({"mtp.pre_fc_norm_embedding.weight": zc(H), "mtp.pre_fc_norm_hidden.weight": zc(W),
                  "mtp.fc_embedding.weight": w(H, H), "mtp.fc_hidden.weight": w(H, H)})
        t.update(attention_layer("mtp.layers.0"))
        t.update(moe("mtp.layers.0"))
        t.update(hyper("mtp.layers.0.attn_hyper_connection"))
        t.update(hyper("mtp.layers.0.mlp_hyper_connection"))
        t.update(hyper("mtp.hyper_connection_mixer", combine=False))
    return t


def write_qwen4_exp_checkpoint(path, *, seed: int = 0, mtp: bool = True, dtype: str = "float32",
                               shards: int = 1, text_overrides: Optional[Dict] = None,
                               vision: bool = False) -> Path:
    """A random Qwen3.8-Flash-Next (`qwen4_exp`) checkpoint folder in the
    released HF layout (config.json with `text_config`, safetensors, tokenizer).
    Int64 buffers keep their dtype. vision: as `write_checkpoint`'s (a tiny
    real tower, `tiny_vision_config` under transformers' `qwen4_exp_vision`
    model_type, the four vision tokens, preprocessor_config.json, the trunk's
    attention louder), so transformers' `Qwen4ExpForConditionalGeneration`
    loads every tensor. See docs/qwen4_exp.md."""
    import mlx.core as mx

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text_overrides = dict(text_overrides or {})
    if vision:
        text_overrides.setdefault("vocab_size", _TINY["vocab_size"] + len(VISION_TOKENS))
    tc = tiny_qwen4_exp_config(**text_overrides)
    weights = qwen4_exp_random_weights(tc, seed, mtp=mtp)
    config = {
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "model_type": "qwen4_exp",
        "text_config": tc,
        "vision_config": {"depth": 1, "hidden_size": 8},
        "tie_word_embeddings": False,
    }
    if vision:
        vc = tiny_vision_config(tc["hidden_size"], model_type="qwen4_exp_vision")
        del vc["deepstack_visual_indexes"]  # (not a key of transformers' strict config)
        weights = louder_attention(weights)
        weights.update(vision_weights(vc, seed))
        config["vision_config"] = vc
        config.update({key: _TINY["vocab_size"] + i for i, key in enumerate(VISION_TOKEN_KEYS)})
        (path / "preprocessor_config.json").write_text(json.dumps(TINY_PREPROCESSOR, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    floats = {k: v for k, v in weights.items() if v.dtype != np.int64}
    save_safetensors_shards(path, floats, dtype, shards)
    ints = {k: mx.array(v) for k, v in weights.items() if v.dtype == np.int64}
    if ints:  # the derived buffers, in their own file, indexed when sharded
        mx.save_safetensors(str(path / "model-buffers.safetensors"), ints, metadata={"format": "pt"})
        index = path / "model.safetensors.index.json"
        data = (json.loads(index.read_text()) if index.exists()
                else {"metadata": {}, "weight_map": {k: "model.safetensors" for k in floats}})
        data["weight_map"].update({k: "model-buffers.safetensors" for k in ints})
        index.write_text(json.dumps(data, indent=1))
    write_tokenizer(path, tc["eos_token_id"], VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE,
                    (), VISION_TOKENS if vision else ())
    return path
