"""What the engine needs to know about a model, read from its HF ``config.json``.

What differs between architectures is declared in each one's module under
``models/architectures/`` (``models/registry.py`` finds it); this file reads any of them
through those hooks and names none.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.gpu_worker.layers.rope_config import (
    DYNAMIC_WINDOW_REASON,
    long_rope_switch,
)
from pagedserve.gpu_worker.models import registry
from pagedserve.gpu_worker.models.architectures.vision_language import (
    VISION_LANGUAGE_MODELS,
    text_config,
)

if TYPE_CHECKING:
    from pagedserve.gpu_worker.models.architecture import Architecture


@dataclass(frozen=True)
class GroupedRouting:
    """DeepSeek's routers and GLM-4.5's: the experts fall in ``num_groups`` equal groups; each
    token keeps its ``top_k_groups`` best groups and picks its top-k experts among them; their
    weights are scaled by ``routed_scaling_factor``. All in float32, over a router weight kept
    in float32 (HF's ``_keep_in_fp32_modules_strict``).

    ``sigmoid`` (DeepSeek-V3's "noaux_tc", GLM-4.5): an expert's score is the sigmoid of its
    logit; a group ranks by the sum of its two best. Otherwise (DeepSeek-V2's "greedy", one
    group, and "group_limited_greedy"; ERNIE 4.5) the scores are the logits' softmax and a group
    ranks by its best. ``correction_bias`` (V3, GLM-4.5, ERNIE 4.5, MiniMax-M2): a learned bias
    per expert (``gate.e_score_correction_bias``) joins the scores that choose, not the weights.
    ``router_in_float32`` off (MiniMax-M2, one group): the router weight, its logits and the
    bias are in the model's dtype, the scores from them in float32, as HF's Mixtral-based
    router has them."""

    sigmoid: bool
    num_groups: int
    top_k_groups: int
    routed_scaling_factor: float
    correction_bias: bool = False
    router_in_float32: bool = True


@dataclass(frozen=True)
class ExpertsSpec:
    """A mixture-of-experts layer: a router scores ``num_experts`` gated MLPs for each
    token and sums the ``top_k`` best, weighted by their softmax probabilities (DeepSeek's,
    GLM-4.5's, ERNIE 4.5's and Hunyuan's routers: ``grouped``), plus a shared MLP where
    ``shared_intermediate_size`` says."""

    num_experts: int
    top_k: int
    # Each expert's intermediate features (and the config field that gives them).
    intermediate_size: int
    intermediate_field: str
    # Whether the top-k probabilities are rescaled to sum to 1 (Mixtral always; Qwen's
    # ``norm_topk_prob``).
    renormalize: bool
    # Mixtral weighs expert outputs in float32; Qwen rounds the weights to the model's
    # dtype first (the same numbers in float32, not in bfloat16).
    weights_in_float32: bool
    # Qwen2-MoE's shared expert, added to every token behind a sigmoid gate; 0: none.
    shared_intermediate_size: int = 0
    # Granite MoE weighs the top k by the softmax of their logits alone (the same numbers
    # as the others' renormalised top-k probabilities, not the same float32 bits).
    softmax_over_top_k: bool = False
    # gpt-oss: a router with a bias, experts with biases, and its clamped SwiGLU
    # ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, g = ``min(gate, limit)``
    # (None: the plain gated MLP of ``hidden_act``).
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    # DeepSeek's and GLM-4.5's router (None: the ones above).
    grouped: GroupedRouting | None = None
    # Qwen2-MoE gates its shared expert by a sigmoid; DeepSeek's and GLM-4.5's shared experts
    # (``mlp.shared_experts``, ``n_shared_experts`` experts' rows as one MLP) are added as is.
    shared_expert_gated: bool = True
    # ERNIE 4.5's shared experts have biases when ``use_bias`` says (its experts never do).
    shared_expert_bias: bool = False
    # Llama 4: the top-k logits' sigmoids (in the model's dtype) weigh each expert's input,
    # not its output.
    sigmoid_scales_input: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and special tokens of a model; ``hf_config`` keeps the raw fields that
    only one architecture reads (biases, RoPE scaling, OPT's projections), with the HF config
    class's defaults filled in where they matter (``Architecture.config_defaults``)."""

    path: Path
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    # Each layer's sliding window in tokens, 0 for full attention.
    layer_sliding_windows: tuple[int, ...]
    # Each layer's experts; None for a dense MLP.
    layer_experts: tuple[ExpertsSpec | None, ...]
    # Each layer's attention chunk in tokens, 0 where it attends to the whole context.
    layer_attention_chunks: tuple[int, ...]
    hf_config: dict[str, Any] = field(repr=False, compare=False)
    # A sequence classification model's labels, in the order of its head's logits (its
    # ``id2label``); empty for a causal LM.
    labels: tuple[str, ...] = ()
    # The architecture config.json names (LlamaForSequenceClassification for a classifier
    # read as LlamaForCausalLM; the same as ``architecture`` for a causal LM).
    declared_architecture: str = ""

    @property
    def spec(self) -> Architecture:
        """What is special about the model's architecture (``models/architectures/``)."""
        return registry.architecture(self.architecture)

    @property
    def vision_language(self) -> bool:
        """Whether the checkpoint is a vision-language model's (its language model served)."""
        return self.declared_architecture in VISION_LANGUAGE_MODELS

    @property
    def task(self) -> str:
        """``"classify"`` for a sequence classification model, else ``"generate"`` (a causal
        LM: generation and embeddings), as ``SchedulerConfig.model_task`` takes it."""
        return "classify" if self.labels else "generate"

    @property
    def context_window_reason(self) -> str:
        """Why ``max_position_embeddings`` is where the window stops though the RoPE scaling
        reaches further (a dynamic-NTK model's configured one); "" when it is not."""
        parameters = self.spec.rope_switch_parameters(self.hf_config)
        if parameters is not None and parameters["rope_type"] == "dynamic":
            return DYNAMIC_WINDOW_REASON
        return ""

    @property
    def long_rope_switch(self) -> int:
        """A LongRoPE model's original context, past which its long factors rotate (the
        rule: ``rope_config.long_rope_switch``); 0 for other models."""
        parameters = self.spec.rope_switch_parameters(self.hf_config)
        return 0 if parameters is None else long_rope_switch(parameters)

    @property
    def has_experts(self) -> bool:
        return any(spec is not None for spec in self.layer_experts)

    @property
    def attention_window(self) -> int:
        """Tokens of context that every layer attends to at most, back from each query
        token (the largest layer window), or 0 when some layer attends to all of it: what
        the scheduler may free blocks behind (``SchedulerConfig.sliding_window``)."""
        windows = self.layer_sliding_windows
        return max(windows) if windows and min(windows) > 0 else 0

    @property
    def latent_attention(self) -> bool:
        """Whether the cache holds latents (DeepSeek's multi-head latent attention,
        ``layers/latent_attention.py``), which each step's ``latent_plans`` read."""
        return self.spec.latent_attention

    @property
    def attention_chunk_size(self) -> int:
        """Tokens per chunk of the layers of chunked attention (Llama 4's: each token
        attends only within its chunk; the others to the whole context), or 0 when no layer
        is chunked. What the step's ``AttentionMetadata.chunked`` view cuts at."""
        return max(self.layer_attention_chunks, default=0)

    @property
    def embedding_size(self) -> int:
        """Values in the model's output hidden state, what an embedding pools: the hidden
        size, or OPT's ``word_embed_proj_dim`` when it projects out."""
        return self.hf_config.get("word_embed_proj_dim") or self.hidden_size

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ValueError(f"model: {str(path)!r} has no config.json")
        hf_config = json.loads(config_file.read_text())
        architectures = hf_config.get("architectures") or []
        vlm = next((a for a in architectures if a in VISION_LANGUAGE_MODELS), None)
        if vlm is not None:
            hf_config, architectures = text_config(vlm, hf_config), [vlm]
        classifiers = registry.classifier_architectures()
        known = {
            **{name: name for name in registry.SUPPORTED_ARCHITECTURES},
            **classifiers,
            **({vlm: hf_config["architectures"][0]} if vlm else {}),
        }
        declared = next((a for a in architectures if a in known), None)
        if declared is None:
            raise ValueError(
                f"model: architecture {architectures or hf_config.get('model_type')!r} in "
                f"{str(config_file)!r} is not supported; supported: "
                f"{', '.join(dict.fromkeys([*known, *VISION_LANGUAGE_MODELS]))}"
            )
        architecture = known[declared]
        labels = _labels(hf_config) if declared in classifiers else ()
        spec = registry.architecture(architecture)
        for alias, field_name in spec.field_aliases.items():
            if alias in hf_config:  # as the HF config class's attribute_map reads it
                hf_config.setdefault(field_name, hf_config[alias])
        hf_config = spec.prepare({**spec.config_defaults, **hf_config})
        _check_supported_fields(spec, hf_config)
        num_heads = hf_config["num_attention_heads"]
        hidden_size = hf_config["hidden_size"]
        head_size = hf_config.get("head_dim") or hidden_size // num_heads
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        head_size, num_kv_heads = spec.cache_head(hf_config) or (head_size, num_kv_heads)
        return cls(
            path=path,
            architecture=architecture,
            vocab_size=hf_config["vocab_size"],
            hidden_size=hidden_size,
            num_layers=hf_config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            max_position_embeddings=spec.max_positions(hf_config),
            eos_token_ids=_eos_token_ids(path, hf_config),
            layer_sliding_windows=spec.layer_sliding_windows(hf_config),
            layer_experts=spec.layer_experts(hf_config),
            layer_attention_chunks=spec.layer_attention_chunks(hf_config),
            hf_config=hf_config,
            labels=labels,
            declared_architecture=declared,
        )


def _check_supported_fields(spec: Architecture, hf_config: dict[str, Any]) -> None:
    """Refuse config values the HF model honours but this engine's ops cannot, before any
    weight loads: a bad window or RoPE layer list, a checkpoint quantized ahead of time in a
    form the engine does not widen, and the architecture's own (``check_fields``)."""
    window = hf_config.get("sliding_window") or 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"model: sliding_window must be a non-negative integer, got {window!r}")
    spec.rope_layers(hf_config)
    _check_checkpoint_quantization(spec, hf_config)
    spec.check_fields(hf_config)


def _check_checkpoint_quantization(spec: Architecture, hf_config: dict[str, Any]) -> None:
    """A checkpoint quantized ahead of time (``quantization_config``) loads only in a form
    the engine widens on loading (``Architecture.checkpoint_quantizations``: gpt-oss's MXFP4
    experts). Others (AWQ, GPTQ, FP8, ...) are refused here, naming the method, rather than
    failing on their packed tensors' names."""
    quantization = hf_config.get("quantization_config")
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method in spec.checkpoint_quantizations:
        return
    widened = [
        f"{method} ({name})"
        for name in registry.architectures_with("checkpoint_quantizations")
        for method in registry.architecture(name).checkpoint_quantizations
    ]
    raise ValueError(
        f"model: quantization_config quant_method {method!r} is not supported for "
        f"{spec.name}; supported: {', '.join(widened)}, widened on loading. An "
        "unquantized checkpoint can be quantized as it loads (quantization='int8', CPU)"
    )


def _labels(hf_config: dict[str, Any]) -> tuple[str, ...]:
    """A classifier's labels as HF's ``PretrainedConfig`` reads them: ``id2label`` (keys 0 to
    n - 1), else ``num_labels`` (default 2) labels named ``LABEL_<i>``."""
    id2label = hf_config.get("id2label")
    if id2label:
        if not isinstance(id2label, dict) or sorted(map(str, id2label)) != sorted(
            str(i) for i in range(len(id2label))
        ):
            raise ValueError(
                f"model: id2label must map the label ids 0 to n - 1 to names, got {id2label!r:.200}"
            )
        return tuple(str(id2label[str(i)]) for i in range(len(id2label)))
    num_labels = hf_config.get("num_labels", 2)
    if isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1:
        raise ValueError(f"model: num_labels must be an integer >= 1, got {num_labels!r}")
    return tuple(f"LABEL_{i}" for i in range(num_labels))


def _eos_token_ids(path: Path, hf_config: dict[str, Any]) -> frozenset[int]:
    """EOS ids from generation_config.json (what HF generate stops on), else config.json."""
    eos: Any = None
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        eos = json.loads(generation_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, list) else [eos])


def check_tensor_parallel_size(config: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming the field, its value and the limit if the model cannot
    be split over ``size`` ranks: query heads and the MLP's intermediate rows must divide
    evenly; KV heads must divide evenly, or divide ``size`` (then they are replicated).
    The vocabulary needs nothing: its last shard is padded."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
    _check_divisible("num_attention_heads", config.num_heads, size)
    if config.num_kv_heads >= size:
        _check_divisible("num_key_value_heads", config.num_kv_heads, size)
    elif size % config.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={size}: the model's num_key_value_heads="
            f"{config.num_kv_heads} is below it, so each KV head is replicated on "
            f"tensor_parallel_size / num_key_value_heads ranks, which must be a whole "
            f"number; use a multiple of {config.num_kv_heads} or a size at most it"
        )
    # Each rank holds 1/size of every MLP's intermediate rows, every expert's included.
    if None in config.layer_experts:
        dense = config.spec.dense_width_field
        _check_divisible(dense, config.hf_config[dense], size)
    for spec in set(config.layer_experts) - {None}:
        _check_divisible(spec.intermediate_field, spec.intermediate_size, size)
        if spec.shared_intermediate_size:
            _check_divisible("shared_expert_intermediate_size", spec.shared_intermediate_size, size)


def check_cuda_graph_support(config: ModelConfig) -> None:
    """Raise ``ValueError`` for a model whose decode step cannot be captured as a CUDA
    graph: a mixture-of-experts layer reads its experts' row counts on the host, and the
    captured decode has no chunked view of the step (``AttentionMetadata.chunked``)."""
    if config.has_experts:
        raise ValueError(
            f"cuda_graphs: {config.architecture} routes tokens to experts by data, which a "
            "captured graph cannot replay; drop cuda_graphs for this model"
        )
    if config.attention_chunk_size or config.latent_attention:
        kind = "chunked attention" if config.attention_chunk_size else "latent attention"
        raise ValueError(
            f"cuda_graphs: {config.architecture}'s {kind} layers are not captured yet; drop "
            "cuda_graphs for this model"
        )


def next_token_layer_config(config: ModelConfig) -> ModelConfig:
    """The model's first multi-token-prediction layer (the one after its
    ``num_hidden_layers`` decoder layers) as a one-layer model: its experts as a decoder
    layer at that index would have them, full attention, the target's cache head. Raises
    ``ValueError`` naming why for a model without such a layer."""
    if not config.spec.next_token_layers:
        raise ValueError(
            f"speculative_config.method 'mtp' drafts with a model's multi-token-prediction "
            f"layers, which {config.architecture} has none of; models with them: "
            f"{', '.join(registry.architectures_with('next_token_layers'))}"
        )
    count = config.hf_config.get("num_nextn_predict_layers")
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"speculative_config.method 'mtp': {str(config.path / 'config.json')!r} has "
            f"num_nextn_predict_layers={count!r}, so its checkpoint has no "
            "multi-token-prediction layer (it must be an integer >= 1)"
        )
    index = config.num_layers
    extended = {**config.hf_config, "num_hidden_layers": index + 1}
    extended = config.spec.next_token_layer_fields(extended)
    experts = config.spec.layer_experts(extended)[index]
    return dataclasses.replace(
        config,
        num_layers=1,
        layer_sliding_windows=(0,),
        layer_experts=(experts,),
        layer_attention_chunks=(0,),
    )


def check_attention_chunk_size(config: ModelConfig, block_size: int) -> None:
    """Raise ``ValueError`` when the model's attention chunks do not start on block
    boundaries: the chunked view of a step starts each chunk's block table at a block."""
    chunk = config.attention_chunk_size
    if chunk % block_size:
        raise ValueError(
            f"block_size={block_size} must divide {config.architecture}'s "
            f"attention_chunk_size={chunk} (its chunked layers' chunks start on block "
            "boundaries)"
        )


def check_draft_model(target: ModelConfig, draft: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` naming what does not fit if ``draft`` cannot guess tokens for
    ``target`` (speculative decoding with a draft model, ``draft_model.py``): both must be
    causal LMs, the draft must split over the same ranks, and where the target frees
    blocks behind its window the draft must attend no further back than that. (It must
    also share the target's tokenizer, which only the acceptance rate shows: a guess is
    any token id, checked by the target.)"""
    where = f"speculative_config.model ({draft.architecture})"
    if target.task != "generate" or draft.task != "generate":
        model = "the draft model" if draft.task != "generate" else f"the {target.architecture}"
        raise ValueError(
            f"{where}: speculative decoding needs causal LMs, but {model} is a classification model"
        )
    try:
        check_tensor_parallel_size(draft, tensor_parallel_size)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    window = target.attention_window
    if window and not 0 < draft.attention_window <= window:
        draft_reach = (
            f"a {draft.attention_window}-token window" if draft.attention_window else "every token"
        )
        raise ValueError(
            f"{where}: every layer of {target.architecture} attends {window} tokens back, so "
            f"the engine frees the blocks behind that window, but the draft model attends to "
            f"{draft_reach}; use a draft model whose layers all have a window of at most "
            f"{window} tokens"
        )


def _check_divisible(field: str, value: int, size: int) -> None:
    if value % size:
        divisors = [d for d in range(1, value + 1) if value % d == 0]
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's {field}={value} "
            f"(each rank holds {field} / tensor_parallel_size of them); "
            f"sizes that do: {', '.join(map(str, divisors))}"
        )


# The weight and KV cache dtypes a worker runs (gpu_worker/worker.py maps them to torch's).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


# Weight-only quantizations of the linear layers, done on CPU as the model loads
# (layers/packed_weights.py, ``Int8PanelWeight``): int8 values, one scale per output feature.
QUANTIZATION_NAMES = ("int8",)


def check_quantization_name(quantization: str | None, device: str = "cpu") -> None:
    """Raise ``ValueError`` naming the value and the choices for an unknown quantization,
    or one asked for on a device it does not run on."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_NAMES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_NAMES)} or None, "
            f"got {quantization!r}"
        )
    if not str(device).startswith("cpu"):
        raise ValueError(f"quantization={quantization!r} runs on CPU only, got device={device!r}")


# vLLM's kv_cache_dtype values that this engine runs: "auto" keeps the cache in the model's
# dtype; "fp8" (as in vLLM, the same as "fp8_e4m3") stores float8 e4m3, saturating at +-448
# with no scales; "fp8_e5m2" stores float8 e5m2 (both CPU only; csrc/ops.h).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def check_kv_cache_dtype(kv_cache_dtype: str, device: str = "cpu") -> None:
    """Raise ``ValueError`` naming the value and the choices for a cache dtype this engine
    does not run, or one asked for on a device it does not run on."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype != "auto" and not str(device).startswith("cpu"):
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} runs on CPU only (the CUDA kernels keep the "
            f"cache in the model's dtype), got device={device!r}"
        )


def check_dtype_name(dtype: str) -> None:
    """Raise ``ValueError`` naming the value and the choices for an unknown dtype."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
