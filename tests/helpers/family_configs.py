"""Tiny HF configs of the model families: the parity matrix's (``PARITY_CONFIGS``, one per
registered architecture), and those tests outside a family's own module build
(classifiers, LoRA, GGUF, multi-token prediction, CUDA); each family's module reads its
config from here too."""

from __future__ import annotations

from helpers.tiny_family import TINY_SHAPE
from helpers.tiny_models import TINY_CONFIGS

# Llama 3's scaling over a 128-token original context (the prompts run past it).
APERTUS = dict(
    architectures=["ApertusForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
    },
    pad_token_id=0,
    eos_token_id=2,
)

ARCEE = dict(
    architectures=["ArceeForCausalLM"],
    **TINY_SHAPE,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_COHERE_SHAPE = dict(
    hidden_size=256,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    logit_scale=0.5,
)
COHERE_CONFIGS = {
    "cohere": dict(architectures=["CohereForCausalLM"], num_hidden_layers=2, **_COHERE_SHAPE),
    # Command R+: a LayerNorm over each query and key head, weights of its own per head.
    "cohere_qk_norm": dict(
        architectures=["CohereForCausalLM"], num_hidden_layers=2, use_qk_norm=True, **_COHERE_SHAPE
    ),
    # Command R7B: three sliding layers (16 tokens, RoPE) to one full layer (no RoPE).
    "cohere2": dict(
        architectures=["Cohere2ForCausalLM"],
        num_hidden_layers=4,
        sliding_window=16,
        rope_theta=50_000.0,
        **_COHERE_SHAPE,
    ),
}

_DEEPSEEK_SHAPE = {k: v for k, v in TINY_SHAPE.items() if k != "num_key_value_heads"}
DEEPSEEK_CONFIGS = {
    # DeepSeek-V2-Lite's shape in small: no low-rank query, heads of 64 + 32 (values 64),
    # layer 0 dense, then 8 experts (top 3 by softmax, unnormalised, scaled) and 2 shared.
    "v2": dict(
        architectures=["DeepseekV2ForCausalLM"],
        **_DEEPSEEK_SHAPE,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        topk_method="greedy",
        pad_token_id=0,
        eos_token_id=2,
    ),
    # DeepSeek-V3's shape in small: a low-rank query, heads of 128 + 64 (values 128: the cache
    # head is 192), YaRN with mscale_all_dim, 8 experts in 4 groups (2 kept), sigmoid scores.
    "v3": dict(
        architectures=["DeepseekV3ForCausalLM"],
        **_DEEPSEEK_SHAPE,
        num_key_value_heads=4,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        moe_intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 128,
        },
        pad_token_id=0,
        eos_token_id=2,
    ),
}
DEEPSEEK_CONFIGS["v2"]["num_hidden_layers"] = DEEPSEEK_CONFIGS["v3"]["num_hidden_layers"] = 3
# GLM-4.7-Flash (Glm4MoeLiteForCausalLM) in small: V3's attention with values wider than the
# query-key heads (64 + 32, values 128: keys padded in the cache), experts at the layers
# mlp_layer_types names, 8 in 2 groups (1 kept), sigmoid scores.
DEEPSEEK_CONFIGS["glm4_moe_lite"] = dict(
    architectures=["Glm4MoeLiteForCausalLM"],
    **_DEEPSEEK_SHAPE,
    num_key_value_heads=4,
    q_lora_rank=96,
    kv_lora_rank=64,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=128,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=1.8,
    mlp_layer_types=["dense", "sparse", "dense"],
    pad_token_id=0,
    eos_token_id=2,
)
DEEPSEEK_CONFIGS["glm4_moe_lite"]["num_hidden_layers"] = 3

# dots.llm1's shape in small: 3 layers, the last windowed (32 tokens: the prompts run past
# it), layer 0 dense, 8 experts in 2 groups (1 kept), top 2, renormalised, one shared.
DOTS1 = dict(
    architectures=["Dots1ForCausalLM"],
    **{**TINY_SHAPE, "num_hidden_layers": 3},
    head_dim=64,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    first_k_dense_replace=1,
    sliding_window=32,
    max_window_layers=2,
    attention_bias=True,
    pad_token_id=0,
    eos_token_id=2,
)

ERNIE = dict(
    architectures=["Ernie4_5ForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    use_bias=True,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    pad_token_id=0,
    eos_token_id=2,
)

# EXAONE-4.0-32B's layout in small: 4 layers, every second global (no RoPE), the others
# windowed to 32 tokens (the prompts run past it).
# ERNIE-4.5-21B-A3B's shape in small: 4 layers, experts at layers 1 and 3 (start 1, interval
# 2), 8 experts of 64, top 3, two shared; biases everywhere.
ERNIE_MOE = dict(
    architectures=["Ernie4_5_MoeForCausalLM"],
    **{**TINY_SHAPE, "num_hidden_layers": 4},
    head_dim=64,
    use_bias=True,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    moe_num_experts=8,
    moe_k=3,
    moe_intermediate_size=64,
    moe_num_shared_experts=2,
    moe_layer_start_index=1,
    moe_layer_interval=2,
    pad_token_id=0,
    eos_token_id=2,
)

EXAONE = dict(
    architectures=["ExaoneForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    pad_token_id=0,
    eos_token_id=2,
)

EXAONE4 = dict(
    architectures=["Exaone4ForCausalLM"],
    **{**TINY_SHAPE, "num_hidden_layers": 4},
    head_dim=64,
    sliding_window=32,
    sliding_window_pattern=2,
    pad_token_id=0,
    eos_token_id=2,
)

GEMMA_CONFIGS = {
    # Tied LM head and no sliding window; attention_bias adds q/k/v and o_proj biases.
    "gemma": dict(
        architectures=["GemmaForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        attention_bias=True,
    ),
    # Sliding (16 tokens), global, sliding layers; the global layers' RoPE has its own base
    # and a linear scaling, the sliding layers' none; an attention scale of 48 ** -0.5, not
    # head_dim's; untied LM head; logits soft-capped at 5 (a cap of its real 30 would barely
    # bend these logits).
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        query_pre_attn_scalar=48,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=5.0,
        tie_word_embeddings=False,
    ),
    # Gemma 2's layer kinds as its config derives them (no layer_types: sliding, global,
    # sliding, global), a 16-token window the longer prompts pass, and its real caps: 50 on
    # the attention logits, 30 on the final ones. The attention scale of 2 ** -0.5 makes
    # logits of tens, which a cap of 50 bends enough to change HF's tokens (checked below).
    "gemma2": dict(
        architectures=["Gemma2ForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
        query_pre_attn_scalar=2,
        sliding_window=16,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
}

GLM4 = dict(
    architectures=["Glm4ForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    rope_theta=10000.0,
    pad_token_id=0,
    eos_token_id=2,
)

# GLM-4.5's shape in small: 3 layers (layer 0 dense), 8 experts of 64 in 4 groups, each token
# keeping 2 groups and 3 experts; one shared expert; q/k norms; scaled weights.
GLM4_MOE = dict(
    architectures=["Glm4MoeForCausalLM"],
    **{**TINY_SHAPE, "num_hidden_layers": 3},
    head_dim=64,
    moe_intermediate_size=64,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    attention_bias=True,
    use_qk_norm=True,
    pad_token_id=0,
    eos_token_id=2,
)

# gpt-oss's shape in small: 4 experts (top 2), a 32-token window on layer 0 (the prompts run
# past it), YaRN over a 128-token original context, and a clamp of 1.0 that the gate and up
# projections of these random weights cross (gpt-oss's own 7.0 they never reach).
GPT_OSS = dict(
    architectures=["GptOssForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=32,
    swiglu_limit=1.0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
    pad_token_id=0,
    eos_token_id=2,
)

# As Granite 3.x configures them (tied embeddings, GQA), with scalars that each move these
# random weights' greedy tokens (Granite 3's own, embedding x12 and residual x0.22, drown a
# tiny random model's layers in its tied embedding: it repeats its input) and an attention
# scale of 0.05, not head_dim's 1/8.
GRANITE_SCALARS = dict(
    embedding_multiplier=1.5,
    residual_multiplier=0.7,
    attention_multiplier=0.05,
    logits_scaling=4.0,
)
GRANITE = dict(
    architectures=["GraniteForCausalLM"],
    **TINY_SHAPE,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    **GRANITE_SCALARS,
)
# Granite MoE (granite-3.x-*-a*m): Granite's scalars and 4 experts of 192, top 2, weighted
# by the softmax of the top two logits.
GRANITE_MOE = dict(
    GRANITE,
    architectures=["GraniteMoeForCausalLM"],
    intermediate_size=192,
    num_local_experts=4,
    num_experts_per_tok=2,
)

# Granite MoE Shared (granite-4.0-tiny-preview's MoE layer): Granite MoE with a gated MLP of
# shared_intermediate_size beside the experts, added to their sum.
GRANITE_MOE_SHARED = dict(
    GRANITE_MOE, architectures=["GraniteMoeSharedForCausalLM"], shared_intermediate_size=128
)

# Helium: RoPE on interleaved pairs; q/k/v biases on (and none on the output projection).
HELIUM = dict(
    architectures=["HeliumForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    attention_bias=True,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Hunyuan-7B's RoPE in small: "dynamic" with alpha 1000 (its own value).
HUNYUAN = dict(
    architectures=["HunYuanDenseV1ForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 1000.0, "factor": 1.0},
    pad_token_id=0,
    eos_token_id=2,
)

# Hunyuan-A13B's MoE layer in small: 4 experts of 384 (the dense MLP's size), top 2, beside a
# shared MLP of the same size.
HUNYUAN_MOE = dict(HUNYUAN, architectures=["HunYuanMoEV1ForCausalLM"], num_experts=4, moe_topk=2)

# As InternLM3-8B's config writes it: qkv_bias / bias, heads of 128, dynamic NTK (factor 6).
INTERNLM3 = dict(
    architectures=["InternLM3ForCausalLM"],
    **{**TINY_SHAPE, "max_position_embeddings": 256},
    head_dim=128,
    qkv_bias=True,
    bias=True,
    rope_theta=50_000_000.0,
    rope_scaling={"rope_type": "dynamic", "factor": 6.0},
    pad_token_id=0,
    eos_token_id=2,
)

LLAMA4 = dict(
    architectures=["Llama4ForCausalLM"],
    **{**TINY_SHAPE, "num_hidden_layers": 4},
    head_dim=64,
    intermediate_size_mlp=384,
    no_rope_layer_interval=2,
    moe_layers=[0, 1],
    num_local_experts=4,
    num_experts_per_tok=1,
    attention_chunk_size=32,
    floor_scale=16,
    attn_scale=0.5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
LLAMA4["intermediate_size"] = 96  # each expert's and the shared expert's

# MiniMax-M2's shape in small: heads of 64 rotated over their first 32 values, 8 experts of
# 96, top 3.
MINIMAX_M2 = dict(
    architectures=["MiniMaxM2ForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    rotary_dim=32,
    num_local_experts=8,
    num_experts_per_tok=3,
    rope_theta=10000.0,
)
MINIMAX_M2["intermediate_size"] = 96

# An original context of 32 tokens, so most prompt and output positions are scaled (by up
# to 1 + 0.5 log 6 at position 160).
MINISTRAL3_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "llama_4_scaling_beta": 0.5,
}
MINISTRAL3 = dict(
    architectures=["Ministral3ForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    rope_parameters=MINISTRAL3_ROPE,
)

MOE_CONFIGS = {
    # Every layer sparse: 4 experts, top 2, renormalised; GQA.
    "mixtral": dict(
        architectures=["MixtralForCausalLM"],
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    # Layers 0 and 2 sparse (6 experts, top 2, not renormalised, plus the gated shared
    # expert), layer 1 dense (mlp_only_layers); q/k/v biases.
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=96,
        shared_expert_intermediate_size=160,
        num_experts=6,
        num_experts_per_tok=2,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
    ),
    # decoder_sparse_step 2: layer 0 dense, layer 1 sparse (8 experts, top 3,
    # renormalised); per-head q/k norms.
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=512,
        max_position_embeddings=512,
    ),
}

NEMOTRON = dict(
    architectures=["NemotronForCausalLM"],
    **TINY_SHAPE,
    head_dim=64,
    pad_token_id=0,
    eos_token_id=2,
)

OLMO2 = dict(
    architectures=["Olmo2ForCausalLM"],
    **TINY_SHAPE,
    rope_theta=10000.0,
    pad_token_id=1,
    eos_token_id=2,
)
# OLMo 3: four layers, three sliding (a 16-token window the longer prompts pass) and a full
# one, whose RoPE is YaRN's over an original context of 128 (the sliding ones plain), as
# the Hub's long-context configs write it (transformers 4's rope_scaling and rope_theta).
OLMO3 = dict(
    OLMO2,
    architectures=["Olmo3ForCausalLM"],
    num_hidden_layers=4,
    sliding_window=16,
)

# OLMoE-1B-7B's shape in small: 8 experts of 128, top 3, not renormalised; a clamp of 0.5
# that these random projections cross.
OLMOE = dict(
    architectures=["OlmoeForCausalLM"],
    **{**TINY_SHAPE, "intermediate_size": 128},
    num_experts=8,
    num_experts_per_tok=3,
    clip_qkv=0.5,
    pad_token_id=0,
    eos_token_id=2,
)

# GQA (Phi-3-medium's and Phi-4's), an untied LM head, and a 32-token window (Phi-3-mini-4k's
# is 2047) that the longer prompts run past.
PHI3 = dict(
    architectures=["Phi3ForCausalLM"],
    **TINY_SHAPE,
    original_max_position_embeddings=512,
    rope_theta=10000.0,
    sliding_window=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

# Heads of 128 (SeedOssConfig's), not hidden / heads (64); biases on q/k/v and on o.
SEED_OSS = dict(
    architectures=["SeedOssForCausalLM"],
    **TINY_SHAPE,
    head_dim=128,
    attention_out_bias=True,
    rope_theta=10000.0,
    pad_token_id=0,
    eos_token_id=2,
)

# Four layers: the fourth without RoPE (SmolLM3Config's default interval); GQA; tied.
SMOLLM3 = dict(
    architectures=["SmolLM3ForCausalLM"],
    hidden_size=256,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

STARCODER2 = dict(
    architectures=["Starcoder2ForCausalLM"],
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
    rope_theta=100_000.0,
    sliding_window=32,
    bos_token_id=1,
    eos_token_id=2,
)


def _by_architecture(*configs: dict) -> dict[str, dict]:
    table: dict[str, dict] = {}
    for config in configs:
        architecture = config["architectures"][0]
        assert architecture not in table, f"two parity configs for {architecture}"
        table[architecture] = config
    return table


# The HF parity matrix (tests/engine/test_architecture_parity.py): one tiny config for each
# architecture of the registry, the one its family's module tests its quirks on (they share
# the model and HF's tokens).
PARITY_CONFIGS = _by_architecture(
    *(TINY_CONFIGS[name] for name in ["llama", "mistral", "opt", "qwen2", "qwen3"]),
    APERTUS,
    ARCEE,
    COHERE_CONFIGS["cohere"],
    COHERE_CONFIGS["cohere2"],
    *DEEPSEEK_CONFIGS.values(),
    DOTS1,
    ERNIE,
    ERNIE_MOE,
    EXAONE,
    EXAONE4,
    *GEMMA_CONFIGS.values(),
    GLM4,
    GLM4_MOE,
    GPT_OSS,
    GRANITE,
    GRANITE_MOE,
    GRANITE_MOE_SHARED,
    HELIUM,
    HUNYUAN,
    HUNYUAN_MOE,
    INTERNLM3,
    LLAMA4,
    MINIMAX_M2,
    MINISTRAL3,
    *MOE_CONFIGS.values(),
    NEMOTRON,
    OLMO2,
    OLMO3,
    OLMOE,
    PHI3,
    SEED_OSS,
    SMOLLM3,
    STARCODER2,
)
