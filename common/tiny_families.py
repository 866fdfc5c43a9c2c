"""The model families the tiny-model builder knows: what each mlx-lm class needs in its config.

Each family turns the builder's common ``config.json`` keys (hidden size, layers, heads,
...) into the config its mlx-lm model class reads, with the family's defining features
shrunk to test size: windows of 16 tokens, four experts, a few recurrent heads.  Layer
layouts are chosen so every layer kind of the family occurs, and a kind that the real
models repeat (Gemma's local layers, Qwen3.5's linear layers) occurs more than once in a
row.  ``min_layers`` raises the preset's layer count where the layout needs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SLIDING_WINDOW = 16  # tests need prompts several windows long; 16 keeps them cheap
N_EXPERTS = 4
EXPERTS_PER_TOKEN = 2
SSM_STATE_SIZE = 16
CONV_KERNEL = 4

Config = dict[str, Any]


@dataclass(frozen=True)
class Family:
    """How to build one ``--arch``: its HF class name and its config on top of the common keys."""

    architecture: str
    model_type: str
    extend: Callable[[Config], Config] = field(default=lambda c: c)
    min_layers: int = 1
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by 1 + weight


def _sliding_window(config: Config) -> Config:
    """Mistral-style window via the layer types mlx-lm's llama reads.

    mlx-lm's llama module needs at least one full-attention layer (it takes that layer's
    mask), so every layer but the last is windowed.
    """
    layers = config["num_hidden_layers"]
    return {
        **config,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention"] * (layers - 1) + ["full_attention"],
    }


def _gemma3(config: Config) -> Config:
    """Gemma 3 text: layer i is global when (i + 1) % pattern == 0, so 4 layers are L L G L."""
    return {
        **config,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 3,
        "query_pre_attn_scalar": config["head_dim"],
        "rope_local_base_freq": 10000.0,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gemma4(config: Config) -> Config:
    """Gemma 4 text: L L L G layers, global layers twice as wide per head, the last two
    layers sharing the K/V of the last earlier layer of their kind, per-layer inputs."""
    head_dim = config["head_dim"]
    return {
        **config,
        "sliding_window": SLIDING_WINDOW,
        "sliding_window_pattern": 4,
        "global_head_dim": 2 * head_dim,
        "num_kv_shared_layers": 3,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": config["vocab_size"],
        "final_logit_softcapping": 30.0,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {
                "partial_rotary_factor": 1.0,
                "rope_theta": 10000.0,
                "rope_type": "default",
            },
        },  # fmt: skip
    }


def _gpt_oss(config: Config) -> Config:
    """gpt-oss: alternating sliding and full layers, attention sinks, a top-2-of-4 MoE."""
    layers = config["num_hidden_layers"]
    return {
        **config,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "num_local_experts": N_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "tie_word_embeddings": False,  # mlx-lm's gpt_oss always has its own lm_head
        # Plain RoPE, said explicitly: transformers' GptOssConfig otherwise assumes YaRN.
        "rope_parameters": {"rope_type": "default", "rope_theta": config["rope_theta"]},
    }


def _deepseek_v3(config: Config) -> Config:
    """Multi-head latent attention: the cache holds a latent (keys) and a RoPE part (values).

    Their widths, ``kv_lora_rank`` and ``qk_rope_head_dim``, differ.  Layer 0 is dense,
    the rest are MoE with one shared expert.
    """
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    return {
        **config,
        "kv_lora_rank": hidden // 2,
        "q_lora_rank": hidden // 2,
        "qk_rope_head_dim": head_dim // 2,
        "qk_nope_head_dim": head_dim,
        "v_head_dim": head_dim,
        "num_key_value_heads": config["num_attention_heads"],
        "n_routed_experts": N_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "n_shared_experts": 1,
        "moe_intermediate_size": config["intermediate_size"] // 2,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,  # mlx-lm's deepseek_v3 always has its own lm_head
    }


def _moe(config: Config) -> Config:
    """Qwen3-MoE keys: every layer sparse, top-2 of 4 experts."""
    return {
        **config,
        "num_experts": N_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": config["intermediate_size"] // 2,
        "norm_topk_prob": True,
    }


def _gated_delta(config: Config) -> Config:
    """Qwen3-Next / Qwen3.5 hybrid keys: gated-delta linear layers, every 4th layer full.

    With fewer than 4 layers the last one is the full-attention layer.
    """
    layers = config["num_hidden_layers"]
    interval = min(4, layers)
    head_dim = config["head_dim"]
    return {
        **config,
        "full_attention_interval": interval,
        "layer_types": [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(layers)
        ],
        "linear_num_key_heads": config["num_key_value_heads"],
        "linear_num_value_heads": config["num_attention_heads"],
        "linear_key_head_dim": head_dim,
        "linear_value_head_dim": head_dim,
        "linear_conv_kernel_dim": CONV_KERNEL,
        "partial_rotary_factor": 0.25,
    }


def _qwen3_next(config: Config) -> Config:
    """Qwen3-Next: the gated-delta hybrid with a MoE (plus a shared expert) in every layer."""
    return {
        **_moe(_gated_delta(config)),
        "shared_expert_intermediate_size": config["intermediate_size"] // 2,
    }


def _qwen3_5(config: Config) -> Config:
    """Qwen3.5 as its HF checkpoints ship it: the language model's keys under ``text_config``."""
    text = _gated_delta(config)
    text["model_type"] = "qwen3_5_text"
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config["rope_theta"],
        "partial_rotary_factor": text.pop("partial_rotary_factor"),
    }
    top = ("architectures", "model_type", "tie_word_embeddings", "torch_dtype")
    top += ("eos_token_id", "bos_token_id")
    return {**{k: config[k] for k in top if k in config}, "text_config": text}


def _nemotron_h(config: Config) -> Config:
    """Nemotron-H: Mamba-2 mixer layers, then one attention layer, each followed by an MLP.

    mlx-lm builds one block per pattern character (M mamba, * attention, - MLP), so
    2 layers are the 4 blocks ``M-*-``.
    """
    layers = config["num_hidden_layers"]
    mixers = ["M"] * (layers - 1) + ["*"]
    pattern = "".join(m + "-" for m in mixers)
    hidden = config["hidden_size"]
    return {
        **config,
        "num_hidden_layers": len(pattern),
        "hybrid_override_pattern": pattern,
        "mamba_num_heads": 2 * hidden // config["head_dim"],  # Mamba's expand = 2
        "mamba_head_dim": config["head_dim"],
        "n_groups": 2,
        "ssm_state_size": SSM_STATE_SIZE,
        "conv_kernel": CONV_KERNEL,
        "mamba_proj_bias": False,
        "use_bias": False,
        "use_conv_bias": True,
        "mlp_bias": False,
        "layer_norm_epsilon": config["rms_norm_eps"],
        "time_step_limit": [0.0, float("inf")],
        "tie_word_embeddings": False,
    }


def _granite4(config: Config) -> Config:
    """Granite 4.0 H (mlx-lm's granitemoehybrid): Mamba-2 layers and an attention layer
    without positional encoding, each with a top-2-of-4 MoE and a shared expert, and
    Granite's multipliers on embeddings, attention, residuals and logits."""
    layers = config["num_hidden_layers"]
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    return {
        **config,
        "layer_types": ["mamba"] * (layers - 1) + ["attention"],
        "position_embedding_type": "nope",
        "attention_bias": False,
        "embedding_multiplier": 2.0,
        "attention_multiplier": 1.0 / head_dim,
        "residual_multiplier": 0.5,
        "logits_scaling": 2.0,
        "num_local_experts": N_EXPERTS,
        "num_experts_per_tok": EXPERTS_PER_TOKEN,
        "shared_intermediate_size": config["intermediate_size"] // 2,
        "intermediate_size": config["intermediate_size"] // 2,
        "mamba_n_heads": 2 * hidden // head_dim,  # Mamba's expand = 2
        "mamba_d_head": head_dim,
        "mamba_n_groups": 2,
        "mamba_d_state": SSM_STATE_SIZE,
        "mamba_d_conv": CONV_KERNEL,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "time_step_limit": [0.0, float("inf")],
    }


def _falcon_h1(config: Config) -> Config:
    """Falcon-H1: every layer runs a Mamba-2 mixer and attention side by side (mlx-lm
    caches each layer as a CacheList of the two), with Falcon's muP multipliers."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    heads = 2 * hidden // head_dim  # Mamba's expand = 2
    return {
        **config,
        "mamba_d_ssm": heads * head_dim,
        "mamba_n_heads": heads,
        "mamba_d_head": head_dim,
        "mamba_n_groups": 1,
        "mamba_d_state": SSM_STATE_SIZE,
        "mamba_d_conv": CONV_KERNEL,
        "mamba_expand": 2,
        "mamba_chunk_size": 16,
        "mamba_rms_norm": True,
        "embedding_multiplier": 2.0,
        "lm_head_multiplier": 0.5,
    }


def _local_swa(config: Config) -> Config:
    """Every layer windowed, none global: mlx-lm's Step-3.5 class, dense.

    It is the one class here that builds without a global layer (llama, ministral3,
    gemma3, cohere2 and gpt_oss all take a global layer's mask or cache).  Its layers are
    llama's with q/k RMSNorms and a per-head sigmoid gate on the attention output;
    ``moe_layers_enum`` names only the layer past the last, so no layer is sparse.
    """
    layers = config["num_hidden_layers"]
    return {
        **config,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["sliding_attention"] * layers,
        "num_attention_groups": config["num_key_value_heads"],
        "moe_layers_enum": str(layers),
        "tie_word_embeddings": False,  # mlx-lm's step3p5 always has its own lm_head
    }


FAMILIES: dict[str, Family] = {
    "qwen3": Family("Qwen3ForCausalLM", "qwen3"),
    "llama": Family("LlamaForCausalLM", "llama"),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2"),
    "mistral": Family("MistralForCausalLM", "mistral"),
    "mistral_swa": Family("MistralForCausalLM", "mistral", _sliding_window, min_layers=3),
    "local_swa": Family("Step3p5ForCausalLM", "step3p5", _local_swa, min_layers=2),
    "gemma3": Family("Gemma3ForCausalLM", "gemma3_text", _gemma3, min_layers=4, norm_offset=1.0),
    "gemma4": Family("Gemma4ForCausalLM", "gemma4_text", _gemma4, min_layers=8),
    "gpt_oss": Family("GptOssForCausalLM", "gpt_oss", _gpt_oss, min_layers=2),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "deepseek_v3", _deepseek_v3, min_layers=2),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "qwen3_moe", _moe),
    "qwen3_5": Family("Qwen3_5ForConditionalGeneration", "qwen3_5", _qwen3_5, min_layers=4),
    "qwen3_next": Family("Qwen3NextForCausalLM", "qwen3_next", _qwen3_next, min_layers=2),
    "falcon_h1": Family("FalconH1ForCausalLM", "falcon_h1", _falcon_h1),
    "granite4": Family("GraniteMoeHybridForCausalLM", "granitemoehybrid", _granite4),
    "nemotron_h": Family("NemotronHForCausalLM", "nemotron_h", _nemotron_h, min_layers=2),
}


def family_config(arch: str, common: Config) -> Config:
    """The ``config.json`` for ``arch``, from the builder's common keys."""
    family = FAMILIES[arch]
    base = {**common, "architectures": [family.architecture], "model_type": family.model_type}
    return family.extend(base)
