"""The offline API: ``LLM(...).generate(prompts, params)`` in one process."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import numbers
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jinja2 import TemplateSyntaxError

from pagedserve.frontend.chat_template import DEFAULT_CHAT_OPTIONS, ChatTemplateOptions
from pagedserve.frontend.engine_client import DEFAULT_STARTUP_TIMEOUT_S, EngineClient
from pagedserve.frontend.generation_config import load_generation_defaults
from pagedserve.frontend.lora_request import LoRARequest
from pagedserve.frontend.model_resolver import resolve_model
from pagedserve.frontend.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    most_probable_label,
)
from pagedserve.frontend.pooler_config import (
    PoolerConfig,
    read_pooler_config,
    read_sentence_transformer_config,
)
from pagedserve.frontend.progress import ProgressBar
from pagedserve.frontend.reasoning import thinking_token_ids
from pagedserve.frontend.request_tracker import EmbeddingTracker, EngineAction, RequestTracker
from pagedserve.frontend.scores import (
    ScoringOutput,
    ScoringRequestOutput,
    check_cross_encoder,
    cosine_similarity,
    pair_indices,
)
from pagedserve.frontend.tokenizer import Tokenizer
from pagedserve.gpu_worker.lora import (
    check_adapter_files,
    check_adapter_weights,
    check_lora_support,
)
from pagedserve.gpu_worker.model_config import (
    ModelConfig,
    check_cuda_graph_support,
    check_draft_model,
    check_dtype_name,
    check_kv_cache_dtype,
    check_quantization_name,
    check_tensor_parallel_size,
    next_token_layer_config,
)
from pagedserve.scheduler.config import ALLOCATION_POLICIES, SchedulerConfig, check_priority
from pagedserve.scheduler.engine_core import EngineCore
from pagedserve.scheduler.engine_messages import WorkerSpec
from pagedserve.scheduler.pooling_params import (
    POOLING_TASKS,
    PROMPT_ONLY_SAMPLING_PARAMS,
    PoolingParams,
    check_task,
    split_rows,
)
from pagedserve.scheduler.request_limits import MAX_PROMPT_CHARS_PER_TOKEN
from pagedserve.scheduler.sampling_params import (
    DEFAULT_MAX_LOGPROBS,
    SamplingParams,
    token_ids_outside_vocabulary,
)
from pagedserve.scheduler.speculative_config import SpeculativeConfig
from pagedserve.scheduler.structured_output import (
    GrammarVocabulary,
    StructuredOutput,
    grammar_text,
)

if TYPE_CHECKING:
    from pagedserve.gpu_worker.worker import Worker

logger = logging.getLogger(__name__)

PromptType = str | Sequence[int]
Message = dict[str, Any]
# A request's LoRA adapter: its name, a LoRARequest, or None for the base model.
LoRARef = str | LoRARequest | None

DEFAULT_SWAP_SPACE_BYTES = 1 << 30


def _check_lora_modules(
    lora_modules: dict[str, str | os.PathLike[str]] | None,
    model_path: Path,
    tensor_parallel_size: int,
    cuda_graph_max_batch: int,
    enable_lora: bool,
) -> list[tuple[str, str]]:
    """``lora_modules`` as (name, directory) pairs, checked before any process starts:
    names, files, configs and the weights' shapes, and that this model and engine can
    serve adapters (also with none at start-up when ``enable_lora``)."""
    if not isinstance(enable_lora, bool):
        raise TypeError(f"enable_lora must be a bool, got {enable_lora!r}")
    if not lora_modules and not enable_lora:
        return []
    if lora_modules is not None and not isinstance(lora_modules, dict):
        raise TypeError(
            f"lora_modules must be a dict of name -> adapter directory, got {lora_modules!r}"
        )
    model_config = ModelConfig.from_dir(model_path)
    check_lora_support(model_config.architecture, tensor_parallel_size, cuda_graph_max_batch)
    adapters = []
    for name, path in (lora_modules or {}).items():
        _check_lora_name(name, "lora_modules")
        adapters.append(
            (name, _checked_adapter_path(f"lora_modules[{name!r}]", path, model_config))
        )
    return adapters


def _check_lora_name(name: object, field: str) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"{field}: adapter names must be non-empty strings, got {name!r}")


def _checked_adapter_path(field: str, path: str | os.PathLike[str], config: ModelConfig) -> str:
    """The adapter's directory, resolved, once its files (inside it) fit the model; errors
    name ``field``, the option that gave the path."""
    check_adapter_files(field, path)
    check_adapter_weights(field, path, config)
    return str(Path(path).resolve())


def _speculative_fields(config: SpeculativeConfig | None) -> dict[str, Any]:
    """``SchedulerConfig``'s speculation fields from vLLM's ``speculative_config``."""
    if config is None:
        return {}
    return {
        "num_speculative_tokens": config.num_speculative_tokens,
        "prompt_lookup_max": config.prompt_lookup_max,
        "prompt_lookup_min": config.prompt_lookup_min,
        "speculative_method": config.method,
        "speculative_disable_by_batch_size": config.disable_by_batch_size or 0,
    }


def _print_progress(event: object) -> None:
    print(f"pagedserve: converting model: {event}", file=sys.stderr, flush=True)


class LLM:
    """An engine on one machine: tokenizer, scheduler and worker as plain objects.

    ``model=None`` is the embedded SmolLM2-135M-Instruct; a path is a local HF directory
    (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 3 text, OPT) or a ``.gguf`` file. The KV
    cache holds ``num_blocks`` blocks of ``block_size`` tokens, or as many as fit in
    ``kv_cache_bytes``.

    ``multiprocess=True`` runs the scheduler and the worker in processes of their own
    (``engine_client.py``); the tokenizer stays here. Start-up then fails with
    ``EngineStartupError`` after ``startup_timeout_s``, and a component that dies makes
    ``generate`` raise ``EngineDeadError``. Call ``shutdown()`` when done (it also runs
    at interpreter exit).

    ``tensor_parallel_size=N`` splits the model over N worker processes (query and KV
    heads, MLP rows and the vocabulary; each rank's KV cache holds its own heads, so
    ``kv_cache_bytes`` is per rank). It needs the multi-process engine: with
    ``multiprocess`` left unset that is chosen for you, as vLLM does; with
    ``multiprocess=False`` it is an error.

    ``device="cuda"`` runs the worker on a GPU; ``cuda_graphs=True`` there replays decode
    steps of up to ``max_num_seqs`` sequences from CUDA graphs captured at start-up
    (``gpu_worker/cuda_graphs.py``). Prefill attention on a GPU is one torch SDPA call over
    K/V gathered from the blocks unless ``PAGEDSERVE_PREFILL_ATTENTION=kernel``.

    ``chat_template``: a Jinja chat template used instead of the model's own (one that
    shows tools to the model, say).

    A ``*ForSequenceClassification`` directory is a classification model: it serves
    ``classify`` (and ``score`` as a cross-encoder when it has one label), nothing else.
    ``pooler_config={"pooling_type": "MEAN", "normalize": False}`` (vLLM's) sets how an
    embedding model pools instead of its sentence-transformers files
    (``pooler_config.py``); MEAN and CLS pooling turn chunked prefill and prefix caching off.

    ``speculative_config`` (vLLM's form: ``{"method": "ngram", "num_speculative_tokens": 4,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}``) turns on speculative decoding by
    prompt lookup: a decoding sequence whose last tokens occurred before proposes what
    followed them, and one forward pass checks those drafts; the output is what decoding
    a token at a time gives, the same tokens for the same seed
    (``scheduler/ngram_proposer.py``); under structured output the tokens the grammar
    forces come first. Sequences of n > 1, best_of or beam search decode a token at a time.
    ``{"model": "/path/to/draft", "num_speculative_tokens": 4}`` drafts with a small model of
    the same tokenizer instead (``gpu_worker/draft_model.py``): the workers run it beside the
    target, with a KV pool of its own sharing the target's block tables.
    ``{"method": "mtp", "num_speculative_tokens": 1}`` drafts with the model's own
    multi-token-prediction layer (DeepSeek-V3, GLM-4.5, GLM-4.7-Flash:
    ``gpu_worker/next_token_drafter.py``),
    from the target's hidden states, likewise with a pool of its own.

    ``structured_outputs_disable_any_whitespace=True`` sets
    ``StructuredOutputsParams.disable_any_whitespace`` for every request: JSON constraints
    then allow no whitespace between JSON tokens (vLLM's option of that name).

    ``scheduling_policy="priority"`` runs requests by the ``priority`` given to
    ``generate`` / ``chat`` (lower first, then arrival) instead of first come, first served;
    a request that does not fit preempts running ones of a strictly lower priority
    (``scheduler/scheduler.py``). Under ``"fcfs"`` a priority other than 0 is refused.

    ``reasoning_parser="qwen3" | "deepseek_r1" | "glm45" | ...`` (a reasoning model, whose
    output thinks between ``<think>`` and ``</think>`` before it answers): a request's
    structured output then constrains the answer only, from the token after ``</think>`` on,
    as vLLM does (the markers must be single tokens of the vocabulary; under ``"openai_gptoss"`` the
    thinking ends once the output has written the header ``<|channel|>final<|message|>``).
    The output stays one text; the HTTP server's ``--reasoning-parser`` splits it.

    ``lora_modules={"name": "/path/to/adapter"}`` serves PEFT LoRA adapters beside the base
    model (Llama family, one rank, no CUDA graphs), loaded at start-up; a request picks one
    with ``generate(..., lora_request="name")`` (or a ``LoRARequest``), and requests of
    different adapters share a batch (``gpu_worker/lora.py``) but never cached prefixes.
    ``enable_lora=True`` (implied by ``lora_modules``) lets adapters come and go while the
    engine runs: ``load_lora(name, path)`` and ``unload_lora(name)``. ``max_loras=N`` caps
    the distinct adapters of one batch (vLLM's ``max_loras``; default: no cap): a request
    whose adapter would pass it waits, and the requests behind it that fit go first.

    ``quantization="int8"`` (CPU only) quantizes the linear layers' weights as the model
    loads: int8 values, one float32 scale per output feature (max |w| / 127), the
    activations, LM head, embeddings and KV cache staying in ``dtype``. A decode step reads
    every weight once, so at small batches it runs up to about as many times faster as
    the weights shrink; the output is close to, not equal to, the unquantized model's.

    ``kv_cache_dtype="fp8"`` (or ``"fp8_e4m3"``; CPU only; vLLM's names) stores the KV cache
    as float8 e4m3: each key and value rounded to 3 mantissa bits as it is written (saturating
    at +-448, no scales), read back exactly; ``"fp8_e5m2"`` rounds to 2 mantissa bits with
    float16's range. A block takes half the bytes of a 16-bit cache (a quarter of float32's),
    so the same ``kv_cache_bytes`` holds twice (four times) the tokens; the output is close
    to, not equal to, the model's with ``"auto"`` (the cache in ``dtype``).

    ``generation_config`` / ``override_generation_config`` (vLLM's) set what a request
    samples with where it sets nothing (``default_sampling_params``, and the server's
    defaults for unset fields): ``"auto"``, the model's generation_config.json (greedy
    unless it sets ``do_sample``; its temperature, top_k, top_p, min_p,
    repetition_penalty), ``"vllm"`` (none of it), or a directory holding such a file; then
    ``override_generation_config={"temperature": 0.5, ...}`` on top. Their
    ``max_new_tokens`` is the default ``max_tokens`` here and the server's limit on it.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        dtype: str = "float32",
        block_size: int = 16,
        kv_cache_bytes: int | None = None,
        num_blocks: int | None = None,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES,
        preemption_mode: str | None = None,
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        allocation_policy: str = "paged",
        seed: int = 0,
        cache_dir: str | None = None,
        device: str = "cpu",
        cuda_graphs: bool = False,
        multiprocess: bool | None = None,
        tensor_parallel_size: int = 1,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        chat_template: str | None = None,
        speculative_config: dict[str, Any] | None = None,
        lora_modules: dict[str, str | os.PathLike[str]] | None = None,
        structured_outputs_disable_any_whitespace: bool = False,
        reasoning_parser: str | None = None,
        enable_lora: bool = False,
        max_loras: int | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        max_logprobs: int = DEFAULT_MAX_LOGPROBS,
        pooler_config: dict[str, Any] | None = None,
    ) -> None:
        check_dtype_name(dtype)
        valid = isinstance(max_logprobs, int) and not isinstance(max_logprobs, bool)
        if not valid or max_logprobs < -1:
            raise ValueError(
                f"max_logprobs must be an integer >= 0, or -1 for the whole vocabulary; got "
                f"{max_logprobs!r}"
            )
        check_quantization_name(quantization, device)
        self.quantization = quantization
        check_kv_cache_dtype(kv_cache_dtype, device)
        self.kv_cache_dtype = kv_cache_dtype
        _check_optional_positive("max_loras", max_loras)
        if reasoning_parser is not None:
            thinking_token_ids(reasoning_parser, None)  # the name, before anything loads
        if allocation_policy not in ALLOCATION_POLICIES:
            raise ValueError(
                f"allocation_policy must be one of {', '.join(ALLOCATION_POLICIES)}, "
                f"got {allocation_policy!r}"
            )
        # The reservation baselines of the paper share nothing, cached prefixes included.
        enable_prefix_caching = enable_prefix_caching and allocation_policy == "paged"
        multiprocess = _choose_multiprocess(multiprocess, tensor_parallel_size)
        if block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be one of 8, 16, 32 (tokens), got {block_size!r}")
        _check_optional_positive("kv_cache_bytes", kv_cache_bytes)
        _check_optional_positive("num_blocks", num_blocks)
        _check_optional_positive("max_model_len", max_model_len)
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        if not isinstance(structured_outputs_disable_any_whitespace, bool):
            raise TypeError(
                "structured_outputs_disable_any_whitespace must be a bool, got "
                f"{structured_outputs_disable_any_whitespace!r}"
            )
        if cuda_graphs and not str(device).startswith("cuda"):
            raise ValueError(f"cuda_graphs=True needs device='cuda' (or 'cuda:N'), got {device!r}")
        # Graphs for every batch the scheduler may form, over block tables of max_model_len
        # (0: the model's window).
        graph_max_batch = max_num_seqs if cuda_graphs else 0
        graph_max_len = max_model_len or 0
        resolved = resolve_model(model, cache_dir=cache_dir, progress=_print_progress)
        self.model_path: Path = resolved.path
        speculative = (
            None if speculative_config is None else SpeculativeConfig.from_dict(speculative_config)
        )
        # Speculative decoding with a draft model: its directory (a GGUF file converted once).
        draft_path: Path | None = None
        draft_config: ModelConfig | None = None
        if speculative is not None and speculative.method == "draft_model":
            ranks = speculative.draft_tensor_parallel_size
            if ranks is not None and ranks != tensor_parallel_size:
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size={ranks} with "
                    f"tensor_parallel_size={tensor_parallel_size}: this engine splits the draft "
                    f"model over the target's ranks; set it to {tensor_parallel_size} or leave "
                    "it out"
                )
            draft_path = resolve_model(
                speculative.model, cache_dir=cache_dir, progress=_print_progress
            ).path
            draft_config = ModelConfig.from_dir(draft_path)
            check_draft_model(
                ModelConfig.from_dir(resolved.path), draft_config, tensor_parallel_size
            )
        # Speculative decoding with the model's own multi-token-prediction layer: checked
        # here, before any process starts.
        mtp = speculative is not None and speculative.method == "mtp"
        if mtp:
            next_token_layer_config(ModelConfig.from_dir(resolved.path))
        worker_method = "mtp" if mtp else "draft_model"
        num_draft_tokens = (
            speculative.num_speculative_tokens if draft_path is not None or mtp else 0
        )
        self.generation_defaults = load_generation_defaults(
            self.model_path, generation_config, override_generation_config
        )
        if isinstance(swap_space_bytes, bool) or not isinstance(swap_space_bytes, int):
            raise TypeError(f"swap_space_bytes must be an integer, got {swap_space_bytes!r}")
        if swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {swap_space_bytes}")
        self.worker: Worker | None = None  # in-process only
        # LoRA adapter name -> id (1, 2, ...: the workers load them in this order).
        self.lora_ids: dict[str, int] = {}
        self.lora_paths: dict[str, str] = {}
        adapters = _check_lora_modules(
            lora_modules, resolved.path, tensor_parallel_size, graph_max_batch, enable_lora
        )
        for lora_id, (name, path) in enumerate(adapters, start=1):
            self.lora_ids[name] = lora_id
            self.lora_paths[name] = path
        # Adapters loaded at run time take ids after these; an id is never reused, so no
        # cached prefix of an unloaded adapter can serve a new one.
        self.enable_lora = enable_lora or bool(adapters)
        self._next_lora_id = len(adapters) + 1
        # The ids requests gave adapters they loaded (LoRARequest.lora_int_id), by name.
        self._lora_int_ids: dict[str, int] = {}
        if multiprocess:
            model_config = ModelConfig.from_dir(resolved.path)
            # Here, before any process starts, so a bad size fails at once.
            check_tensor_parallel_size(model_config, tensor_parallel_size)
            if graph_max_batch:
                check_cuda_graph_support(model_config)
        else:
            # Here, not at the top: a multi-process frontend (the gRPC server) never
            # imports torch; its workers do.
            from pagedserve.gpu_worker.memory import default_kv_cache_bytes
            from pagedserve.gpu_worker.worker import Worker

            self.worker = Worker(
                resolved.path,
                dtype,
                block_size,
                num_blocks,
                kv_cache_bytes,
                device,
                swap_space_bytes=swap_space_bytes,
                kv_cache_bytes_from_free_memory=default_kv_cache_bytes,
                cuda_graph_max_batch=graph_max_batch,
                cuda_graph_max_len=graph_max_len,
                lora_modules=adapters,
                enable_lora=self.enable_lora,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                speculative_model=draft_path,
                num_speculative_tokens=num_draft_tokens,
                speculative_method=worker_method,
            )
            model_config = self.worker.model_config
        self.model_config = model_config
        # An embedding model's pooling (its sentence-transformers files, or pooler_config);
        # a classifier's head always reads the last token.
        self.pooler_config = (
            read_pooler_config(resolved.path, pooler_config)
            if model_config.task == "generate"
            else PoolerConfig(source="classifier")
        )
        if self.pooler_config.needs_whole_prompt:
            # Its vectors read every prompt token's state: one step computes each prompt.
            logger.info(
                "%s pooling (%s): chunked prefill and prefix caching are off",
                self.pooler_config.pooling_type,
                self.pooler_config.source,
            )
            enable_chunked_prefill = enable_prefix_caching = False
        # A sentence-transformers model's own window and casing (vLLM reads them too).
        self.sentence_config = read_sentence_transformer_config(resolved.path)
        model_limit = model_config.max_position_embeddings
        reason = model_config.context_window_reason
        limit_source = f" ({reason})" if reason else ""
        if reason:
            logger.info("context window %d tokens: %s", model_limit, reason)
        sentence_limit = self.sentence_config.max_seq_length
        if sentence_limit is not None and sentence_limit < model_limit:
            model_limit = sentence_limit
            limit_source = f" (max_seq_length in {self.sentence_config.source})"
        if max_model_len is not None and max_model_len > model_limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's context window "
                f"{model_limit}{limit_source}"
            )
        max_model_len = max_model_len or model_limit
        if draft_config is not None:
            draft_window = draft_config.max_position_embeddings
            if draft_window < max_model_len:
                logger.info(
                    "the draft model's context window (%d tokens) is shorter than "
                    "max_model_len (%d): past it a sequence decodes without guesses",
                    draft_window,
                    max_model_len,
                )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens
            or (2048 if enable_chunked_prefill else max(2048, max_model_len)),
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=preemption_mode,
            allocation_policy=allocation_policy,
            scheduling_policy=scheduling_policy,
            max_loras=max_loras or 0,
            sliding_window=model_config.attention_window,
            model_task=model_config.task,
            long_rope_switch=model_config.long_rope_switch,
            **_speculative_fields(speculative),
        )
        self.engine: EngineCore | EngineClient
        if multiprocess:
            # Started before the tokenizer loads (seconds: transformers' imports), which
            # it then does while the workers load the model.
            self.engine = EngineClient(
                scheduler_config,
                WorkerSpec(
                    str(resolved.path),
                    dtype,
                    block_size,
                    num_blocks,
                    kv_cache_bytes,
                    device,
                    swap_space_bytes,
                    graph_max_batch,
                    graph_max_len,
                    [list(adapter) for adapter in adapters],
                    self.enable_lora,
                    quantization,
                    kv_cache_dtype,
                    None if draft_path is None else str(draft_path),
                    num_draft_tokens,
                    worker_method,
                ),
                seed=seed,
                enable_prefix_caching=enable_prefix_caching,
                world_size=tensor_parallel_size,
                startup_timeout_s=startup_timeout_s,
            )
            try:
                self._load_tokenizer(resolved.path, chat_template, reasoning_parser)
                self.engine.finish_start(
                    self.grammar_vocabulary, structured_outputs_disable_any_whitespace
                )
            except BaseException:
                self.engine.shutdown()
                raise
            cache_sizes = (
                self.engine.num_blocks,
                self.engine.bytes_per_block,
                self.engine.num_host_blocks,
            )
        else:
            self._load_tokenizer(resolved.path, chat_template, reasoning_parser)
            self.engine = EngineCore(
                scheduler_config,
                self.worker.num_blocks,
                block_size,
                self.worker,
                seed=seed,
                num_host_blocks=self.worker.num_host_blocks,
                enable_prefix_caching=enable_prefix_caching,
                structured_output=StructuredOutput(
                    self.grammar_vocabulary, structured_outputs_disable_any_whitespace
                ),
            )
            cache_sizes = (
                self.worker.num_blocks,
                self.worker.bytes_per_block,
                self.worker.num_host_blocks,
            )
        self.eos_token_ids = model_config.eos_token_ids
        # The most logprobs a request may ask for (-1: as many as the vocabulary has).
        self.max_logprobs = model_config.vocab_size if max_logprobs == -1 else max_logprobs
        self.dtype = dtype
        self.block_size = block_size
        self.scheduler_config = scheduler_config
        self._request_counter = itertools.count()
        # Bytes per block are one rank's: each tensor-parallel rank holds its own heads.
        self.num_blocks, self.bytes_per_block, self.num_host_blocks = cache_sizes
        self.tensor_parallel_size = tensor_parallel_size
        logger.info(
            "KV cache: %d blocks of %d tokens, %d bytes per block and rank (%d ranks), "
            "%d tokens at most (%s); host swap pool: %d blocks",
            self.num_blocks,
            block_size,
            self.bytes_per_block,
            tensor_parallel_size,
            self.num_blocks * block_size,
            dtype if kv_cache_dtype == "auto" else kv_cache_dtype,
            self.num_host_blocks,
        )
        logger.info("sampling defaults: %s", self.generation_defaults.describe())
        if speculative is not None:
            logger.info(
                "speculative decoding: %s, %d draft tokens a step%s%s",
                {
                    "ngram": "prompt lookup",
                    "draft_model": f"draft model {draft_path}",
                    "mtp": "the model's multi-token-prediction layer",
                }[speculative.method],
                speculative.num_speculative_tokens,
                " (the drafter's K/V share each block)" if draft_path is not None or mtp else "",
                f", none from {speculative.disable_by_batch_size} running sequences on"
                if speculative.disable_by_batch_size
                else "",
            )

    # ------------------------------------------------------------------ public API

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_namespace: str | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) as one continuously batched run;
        returns one ``RequestOutput`` per prompt, in order. Requests share cached prompt
        prefixes only within one ``cache_namespace``. ``lora_request``: the LoRA adapter
        (a name or a ``LoRARequest``; None: the base model), or one per prompt.
        ``priority``: one per prompt (or one for all), lower first; needs
        ``scheduling_policy="priority"`` unless every one is 0. ``use_tqdm``: vLLM's
        progress bar of finished prompts and token speeds, on stderr when it is a terminal."""
        self.check_task(None)
        prompt_list = _as_prompt_list(prompts)
        params_list = self._as_params_list(sampling_params, len(prompt_list))
        lora_ids = self.lora_ids_of(lora_request, len(prompt_list))
        priorities = self.priorities_of(priority, len(prompt_list))
        encoded = [
            self.encode_prompt(prompt, f"prompts[{index}]")
            for index, prompt in enumerate(prompt_list)
        ]
        # One SamplingParams is often every prompt's: its bad_words are tokenized once.
        distinct = {id(p): p for p in params_list}
        resolved = {
            key: self.resolve_bad_words(p, "sampling_params") for key, p in distinct.items()
        }
        params_list = [resolved[id(p)] for p in params_list]
        for index, params in enumerate(params_list):
            encoded[index] = self.truncate_prompt(encoded[index], params, "sampling_params")
        for index, (token_ids, params) in enumerate(zip(encoded, params_list)):
            try:
                self.engine.check_request_fits(
                    len(token_ids), params.max_tokens, params.num_sequences
                )
            except ValueError as error:
                raise ValueError(f"prompts[{index}]: {error}") from None
            if params.stop and self.tokenizer is None:
                raise ValueError(
                    f"sampling_params.stop={params.stop!r}: stop strings need a tokenizer, "
                    f"and {str(self.model_path)!r} has none; use stop_token_ids instead"
                )
            self.check_token_ids(params, "sampling_params")
            self.check_logprobs(params, "sampling_params")
            self.check_structured_outputs(params, "sampling_params")
        return self._run(
            prompt_list, encoded, params_list, cache_namespace, lora_ids, priorities, use_tqdm
        )

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, str]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of ``{"role", "content"}``
        dicts) or several, then generate the assistant's turn. ``tools`` (OpenAI's
        function tools) go to the template; the output stays text (the HTTP server reads
        tool calls out of it). As in vLLM, ``continue_final_message=True`` (with
        ``add_generation_prompt=False``) leaves the last message open and the output goes
        on with it (an assistant message started for the model);
        ``chat_template_kwargs`` are more variables for the template (a Qwen3-style
        ``{"enable_thinking": False}``), ``chat_template`` a template for this call
        instead of the model's, ``documents`` a RAG template's sources (all vLLM's)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        tokenizer = self._require_tokenizer("messages")
        options = ChatTemplateOptions(
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            documents=documents,
            chat_template=chat_template,
        )
        texts = [
            self.render_chat(conversation, tools=tools, options=options)
            for conversation in conversations
        ]
        # The template already wrote the special tokens it wants.
        prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
        outputs = self.generate(
            prompts,
            sampling_params,
            lora_request=lora_request,
            priority=priority,
            use_tqdm=use_tqdm,
        )
        for output, text in zip(outputs, texts):
            output.prompt = text
        return outputs

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (text or token ids) as one continuously batched run, as
        vLLM's embed task does: each request computes its prompt only (chunked, with
        cached prefixes, beside generation requests) and returns the final-norm hidden
        state of its last token (or the mean over its tokens, or its first, as the model's
        pooler config says: ``pooler_config.py``), L2-normalized unless
        ``PoolingParams(normalize=False)``
        (``dimensions``: the first that many values, then normalized). One
        ``EmbeddingRequestOutput`` per prompt, in order: ``.outputs.embedding``."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = self.embedding_params()
        params_list = self._model_pooling(
            self._as_pooling_params_list(pooling_params, len(prompt_list))
        )
        return self._pool("embed", prompt_list, params_list, lora_request, priority, use_tqdm)

    def _model_pooling(self, params_list: list[PoolingParams]) -> list[PoolingParams]:
        """Each request's ``dimensions`` checked against the model, and an embedding's
        pooling type made the model's, whatever the caller's says."""
        checked = []
        for params in params_list:
            params.check_dimensions(self.model_config.embedding_size, "pooling_params.dimensions")
            if params.task == "embed":
                params = dataclasses.replace(params, pooling_type=self.pooler_config.pooling_type)
            checked.append(params)
        return checked

    def embedding_params(
        self, normalize: bool | None = None, dimensions: int | None = None
    ) -> PoolingParams:
        """An embedding request's ``PoolingParams`` on this model: its pooling type, and
        ``normalize`` unless given as its pooler config says (sentence-transformers'
        Normalize module; normalized without one)."""
        return PoolingParams(
            normalize=self.pooler_config.normalize if normalize is None else normalize,
            dimensions=dimensions,
            pooling_type=self.pooler_config.pooling_type,
        )

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
    ) -> list[ClassificationRequestOutput]:
        """Classify every prompt (text or token ids) with a sequence classification model
        (HF's ``*ForSequenceClassification``), as vLLM's classify task does: each request
        computes its prompt only and its last token's final hidden state goes through the
        classifier head, then a softmax over the labels (a sigmoid for a one-label model;
        ``PoolingParams(task="classify", use_activation=False)``: the raw logits). One
        ``ClassificationRequestOutput`` per prompt, in order: ``.outputs.probs`` (the
        model's label order) and ``.label`` (the most probable)."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(task="classify")
        params_list = self._as_pooling_params_list(pooling_params, len(prompt_list))
        pooled = self._pool("classify", prompt_list, params_list, lora_request, priority, use_tqdm)
        return [self._classification(output) for output in pooled]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARef | Sequence[LoRARef] = None,
        priority: int | Sequence[int] | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's ``encode``: any pooling task of the model, ``pooling_task`` one of
        "embed" and "token_embed" (a causal LM), "classify" and "token_classify" (a
        sequence classification model); None: ``pooling_params.task``, else the model's
        one-vector task. "embed" and "classify" give ``embed``'s and ``classify``'s vectors;
        the token tasks give a row per prompt token (each normalized, or through the
        classifier head and its activation), from every chunk of the prompt, without
        prefix-cache hits. One ``PoolingRequestOutput`` per prompt, in order:
        ``.outputs.data``."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_task is None:
            if isinstance(pooling_params, PoolingParams):
                pooling_task = pooling_params.task
            else:
                pooling_task = "classify" if self.model_config.task == "classify" else "embed"
        if pooling_task not in POOLING_TASKS:
            raise ValueError(
                f"pooling_task must be one of {', '.join(map(repr, POOLING_TASKS))}, got "
                f"{pooling_task!r}"
            )
        if pooling_params is None:
            if pooling_task.removeprefix("token_") == "embed":
                pooling_params = self.embedding_params()
            else:
                pooling_params = PoolingParams(task="classify")
            pooling_params = dataclasses.replace(pooling_params, task=pooling_task)
        params_list = self._as_pooling_params_list(pooling_params, len(prompt_list))
        for params in params_list:
            if params.task != pooling_task:
                raise ValueError(
                    f"pooling_params.task={params.task!r} with pooling_task={pooling_task!r}: "
                    "give one task"
                )
        params_list = self._model_pooling(params_list)
        pooled = self._pool(
            pooling_task, prompt_list, params_list, lora_request, priority, use_tqdm
        )
        return [_pooling_output(output, pooling_task) for output in pooled]

    def _classification(self, output: EmbeddingRequestOutput) -> ClassificationRequestOutput:
        probs = output.outputs.embedding
        return ClassificationRequestOutput(
            request_id=output.request_id,
            prompt=output.prompt,
            prompt_token_ids=output.prompt_token_ids,
            outputs=ClassificationOutput(probs),
            label=most_probable_label(self.model_config.labels, probs),
            num_cached_tokens=output.num_cached_tokens,
        )

    def _pool(
        self,
        task: str,
        prompt_list: list[PromptType],
        params_list: list[PoolingParams],
        lora_request: LoRARef | Sequence[LoRARef],
        priority: int | Sequence[int] | None,
        use_tqdm: bool,
    ) -> list[EmbeddingRequestOutput]:
        """Run one pooling request of ``task`` per prompt (``embed``'s, ``classify``'s and
        ``encode``'s); the pooled vectors in order."""
        for params in params_list:
            if params.task != task:
                raise ValueError(
                    f"pooling_params.task={params.task!r}: {task}() takes "
                    f"PoolingParams(task={task!r})"
                )
            self.check_task(params)
        lora_ids = self.lora_ids_of(lora_request, len(prompt_list))
        priorities = self.priorities_of(priority, len(prompt_list))
        encoded = [
            self.encode_prompt(prompt, f"prompts[{index}]")
            for index, prompt in enumerate(prompt_list)
        ]
        for index, token_ids in enumerate(encoded):
            try:
                self.engine.check_request_fits(len(token_ids), 0)
            except ValueError as error:
                raise ValueError(f"prompts[{index}]: {error}") from None
        return self._run(prompt_list, encoded, params_list, None, lora_ids, priorities, use_tqdm)

    def check_task(self, pooling_params: PoolingParams | None) -> None:
        """``ValueError`` for a request of a task this model does not serve
        (``pooling_params.check_task``): None for a generation request."""
        try:
            check_task(self.model_config.task, pooling_params)
        except ValueError as error:
            raise ValueError(f"model {self.model_config.declared_architecture}: {error}") from None

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        lora_request: LoRARef = None,
        priority: int = 0,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's score. An embedding model: the cosine similarity of each pair's
        embeddings (``embed``'s), each distinct prompt embedded once. A cross-encoder (a
        classification model with one label): each pair's texts joined as the tokenizer
        joins a pair, classified, its sigmoid the score. One ``data_1`` is scored against
        every ``data_2``, or as many of each pairwise. ``truncate_prompt_tokens``: keep
        each prompt's last k tokens (a cross-encoder's pair: k tokens, cut from the longer
        text first); -1: the context window. One ``ScoringRequestOutput`` per pair, in
        order: ``.outputs.score``."""
        prompts_1 = _as_prompt_list(data_1)
        prompts_2 = _as_prompt_list(data_2)
        pairs = pair_indices(len(prompts_1), len(prompts_2), ("data_1", "data_2"))
        keep = None
        if truncate_prompt_tokens is not None:
            max_model_len = self.scheduler_config.max_model_len
            keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
            valid = isinstance(keep, int) and not isinstance(keep, bool)
            if not valid or not 1 <= keep <= max_model_len:
                raise ValueError(
                    f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the "
                    f"model's context window), got {truncate_prompt_tokens!r}"
                )
        if self.model_config.task == "classify":
            return self._cross_encoder_scores(
                prompts_1, prompts_2, pairs, keep, lora_request, priority, use_tqdm
            )
        prompts: list[PromptType] = [*prompts_1, *prompts_2]
        if keep is not None:
            prompts = [
                self.encode_prompt(prompt, f"data_{1 if i < len(prompts_1) else 2}")[-keep:]
                for i, prompt in enumerate(prompts)
            ]
        embeddings = self.embed(
            prompts,
            PoolingParams(normalize=True),
            lora_request=lora_request,
            priority=priority,
            use_tqdm=use_tqdm,
        )
        offset = len(prompts_1)
        outputs = []
        for i, j in pairs:
            first, second = embeddings[i], embeddings[offset + j]
            outputs.append(
                ScoringRequestOutput(
                    request_id=f"{first.request_id}+{second.request_id}",
                    outputs=ScoringOutput(
                        cosine_similarity(first.outputs.embedding, second.outputs.embedding)
                    ),
                    prompt_token_ids=first.prompt_token_ids + second.prompt_token_ids,
                )
            )
        return outputs

    def _cross_encoder_scores(
        self,
        prompts_1: list[PromptType],
        prompts_2: list[PromptType],
        pairs: list[tuple[int, int]],
        keep: int | None,
        lora_request: LoRARef,
        priority: int,
        use_tqdm: bool,
    ) -> list[ScoringRequestOutput]:
        """``score`` on a cross-encoder: one classification per pair of texts."""
        check_cross_encoder(self.model_config, "model")
        tokenizer = self._require_tokenizer("data_1")
        for name, prompt_list in (("data_1", prompts_1), ("data_2", prompts_2)):
            for index, prompt in enumerate(prompt_list):
                if not isinstance(prompt, str):
                    raise ValueError(
                        f"{name}[{index}]: a cross-encoder scores texts (the tokenizer joins "
                        f"each pair), got {type(prompt).__name__}"
                    )
        encoded = [tokenizer.encode_pair(prompts_1[i], prompts_2[j], keep) for i, j in pairs]
        classified = self.classify(
            encoded, lora_request=lora_request, priority=priority, use_tqdm=use_tqdm
        )
        return [
            ScoringRequestOutput(
                request_id=output.request_id,
                outputs=ScoringOutput(output.outputs.probs[0]),
                prompt_token_ids=output.prompt_token_ids,
            )
            for output in classified
        ]

    def load_lora(self, name: str, path: str | os.PathLike[str]) -> int:
        """Serve the PEFT LoRA adapter in directory ``path`` as ``name`` from now on (an
        engine started with ``enable_lora=True`` or ``lora_modules``); returns its id.
        Its files are checked against the model first (``ValueError`` naming what does not
        fit); the workers load it with the next step."""
        lora_id = self.register_lora(name, path)
        self.engine.load_lora(lora_id, name, self.lora_paths[name])
        return lora_id

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``: requests may no longer name it; those already
        queued run to their end, then the workers drop it."""
        self.engine.unload_lora(self.deregister_lora(name))

    def register_lora(self, name: str, path: str | os.PathLike[str]) -> int:
        """``load_lora``'s checks and bookkeeping, without telling the engine (the server
        tells it from its engine thread); returns the adapter's new id."""
        if not self.enable_lora:
            raise ValueError(
                f"lora_name {name!r}: this engine serves no LoRA adapters; start it with "
                "enable_lora=True (--enable-lora) to load them at run time"
            )
        _check_lora_name(name, "lora_name")
        if name in self.lora_ids:
            raise ValueError(
                f"lora_name: an adapter named {name!r} is already loaded (from "
                f"{self.lora_paths[name]}); unload it first"
            )
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"lora_path: expected an adapter directory, got {path!r}")
        resolved = _checked_adapter_path(f"lora_path of {name!r}", path, self.model_config)
        lora_id = self._next_lora_id
        self._next_lora_id += 1
        self.lora_ids[name] = lora_id
        self.lora_paths[name] = resolved
        logger.info("serving LoRA adapter %r (id %d) from %s", name, lora_id, resolved)
        return lora_id

    def deregister_lora(self, name: str) -> int:
        """``unload_lora``'s checks and bookkeeping; returns the adapter's id."""
        lora_id = self.lora_ids.pop(name, None) if isinstance(name, str) else None
        if lora_id is None:
            served = ", ".join(map(repr, self.lora_ids)) or "none"
            raise ValueError(f"lora_name: no LoRA adapter named {name!r} here; adapters: {served}")
        del self.lora_paths[name]
        self._lora_int_ids.pop(name, None)
        logger.info("unloading LoRA adapter %r (id %d)", name, lora_id)
        return lora_id

    def stats(self) -> dict[str, int | float]:
        """Scheduler counters (requests, preemptions, sampled tokens, blocks, prefix-cache
        queries and hits in tokens) and the KV memory accounting of finished sequences:
        fractions of slot-steps holding token states (``kv_utilization``), reserved for
        later tokens, lost to internal and external fragmentation, and saved by sharing."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self.engine.reset_prefix_cache()

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if the block accounting is inconsistent."""
        self.engine.check_integrity()

    def shutdown(self) -> None:
        """Stop the engine's processes and free what they hold (multi-process mode;
        in-process there is nothing to stop). Idempotent; runs at interpreter exit too.
        ``stats()`` and ``check_integrity()`` then report the engine's final state."""
        if isinstance(self.engine, EngineClient):
            self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """``with LLM(...) as llm:`` shuts the engine down at the block's end."""
        self.shutdown()

    # ------------------------------------------------------------------ internals

    def _run(
        self,
        prompts: list[PromptType],
        encoded: list[list[int]],
        params_list: Sequence[SamplingParams | PoolingParams],
        cache_namespace: str | None = None,
        lora_ids: list[int] | None = None,
        priorities: list[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[Any]:
        """Run one request per prompt to its end: a generation request for
        ``SamplingParams``, an embedding request for ``PoolingParams``; ``use_tqdm``: a
        progress bar (``ProgressBar``)."""
        request_ids = [f"offline-{next(self._request_counter)}" for _ in prompts]
        lora_ids = lora_ids or [0] * len(prompts)
        priorities = priorities or [0] * len(prompts)
        trackers: dict[str, RequestTracker | EmbeddingTracker] = {}
        progress = ProgressBar(len(prompts), enabled=use_tqdm)
        try:
            for request_id, prompt, token_ids, params, lora_id, priority in zip(
                request_ids, prompts, encoded, params_list, lora_ids, priorities
            ):
                text = prompt if isinstance(prompt, str) else None
                pooling_params = params if isinstance(params, PoolingParams) else None
                if pooling_params is not None:
                    trackers[request_id] = EmbeddingTracker(request_id, text, token_ids)
                    params = PROMPT_ONLY_SAMPLING_PARAMS
                else:
                    trackers[request_id] = RequestTracker(
                        request_id, text, token_ids, params, self.tokenizer, self.eos_token_ids
                    )
                self.engine.add_request(
                    request_id,
                    token_ids,
                    params,
                    self.eos_token_ids,
                    cache_namespace=cache_namespace,
                    lora_id=lora_id,
                    priority=priority,
                    pooling_params=pooling_params,
                )
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    tracker = trackers[delta.request_id]
                    was_finished = tracker.finished
                    action = tracker.apply(delta)
                    # A stop string ended an output; the engine would go on: end the
                    # request, or this sample of it, there and free the blocks.
                    if action is EngineAction.ABORT_REQUEST:
                        self.engine.abort_request(delta.request_id)
                    elif action is EngineAction.STOP_SAMPLE and (
                        self.engine.stop_sample(delta.request_id, delta.index) is not None
                    ):
                        tracker.output.finished = True  # the others had just ended
                    if tracker.finished and not was_finished:
                        progress.finished(tracker.output)
        finally:
            progress.close()
            # An interrupted run (Ctrl-C, an error) must not leave requests holding blocks.
            for request_id in request_ids:
                self.engine.abort_request(request_id)
        return [trackers[request_id].output for request_id in request_ids]

    def truncate_prompt(
        self, token_ids: list[int], params: SamplingParams, field: str
    ) -> list[int]:
        """The prompt's last ``params.truncate_prompt_tokens`` tokens (-1: the context
        window's worth), as vLLM cuts it. ``ValueError`` naming
        ``<field>.truncate_prompt_tokens`` when it is more than the window."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return token_ids
        max_model_len = self.scheduler_config.max_model_len
        if keep > max_model_len:
            name = f"{field}.truncate_prompt_tokens" if field else "truncate_prompt_tokens"
            raise ValueError(
                f"{name} must be -1 or in [1, {max_model_len}] (the model's context window), "
                f"got {keep}"
            )
        return token_ids[-(max_model_len if keep == -1 else keep) :]

    def resolve_bad_words(self, params: SamplingParams, field: str) -> SamplingParams:
        """``params`` with its ``bad_words`` tokenized into ``bad_words_token_ids`` (each word
        as it stands and after a space, as vLLM does: the same word starts a text or follows
        one). ``ValueError`` naming ``<field>.bad_words`` when the model has no tokenizer."""
        if not params.bad_words or params.bad_words_token_ids is not None:
            return params
        name = f"{field}.bad_words" if field else "bad_words"
        tokenizer = self._require_tokenizer(name)
        sequences: list[list[int]] = []
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                token_ids = tokenizer.encode(text, add_special_tokens=False)
                if token_ids and token_ids not in sequences:
                    sequences.append(token_ids)
        return dataclasses.replace(params, bad_words_token_ids=sequences)

    def check_token_ids(self, params: SamplingParams, field: str) -> None:
        """``ValueError`` naming the field (under ``field``, the parameters' own name; ""
        for none) when ``logit_bias`` or ``allowed_token_ids`` names a token id the model
        does not have."""
        error = token_ids_outside_vocabulary(params, self.model_config.vocab_size)
        if error is not None:
            raise ValueError(f"{field}.{error}" if field else error)

    def check_logprobs(self, params: SamplingParams, field: str) -> None:
        """``ValueError`` naming the field when ``params`` asks for more logprobs (or
        prompt logprobs) than this engine's ``max_logprobs``."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{f'{field}.' if field else ''}{name} must be <= {self.max_logprobs} "
                    f"(the engine's max_logprobs), got {value}"
                )

    def check_structured_outputs(self, params: SamplingParams, field: str) -> None:
        """``ValueError`` naming the field when ``params`` asks for structured output this
        engine cannot give: a constraint that does not compile, or a model without a
        tokenizer. Checked here so the request never reaches the scheduler."""
        structured = params.structured_outputs
        if structured is None:
            return
        if self.grammar_vocabulary is None:
            name = f"{field}.structured_outputs" if field else "structured_outputs"
            raise ValueError(
                f"{name}: grammars are matched over the model's tokenizer, and "
                f"{str(self.model_path)!r} has none (or only a slow one)"
            )
        try:
            grammar_text(structured)
        except ValueError as error:
            raise ValueError(f"{field}.{error}" if field else str(error)) from None

    def check_prompt_size(self, prompt: PromptType, field: str) -> None:
        """``ValueError`` for a prompt that could never fit the context window, found
        without tokenizing it: more token ids than the window, or a text of more than
        ``MAX_PROMPT_CHARS_PER_TOKEN`` characters per token of it. The servers check this
        first, unless the request truncates its prompt (then it may be longer)."""
        max_model_len = self.scheduler_config.max_model_len
        if isinstance(prompt, str):
            max_chars = max_model_len * MAX_PROMPT_CHARS_PER_TOKEN
            if len(prompt) > max_chars:
                raise ValueError(
                    f"{field}: {len(prompt)} characters cannot fit the model's context window "
                    f"of {max_model_len} tokens (at most {max_chars} characters; "
                    "truncate_prompt_tokens keeps a longer prompt's end)"
                )
        elif isinstance(prompt, (list, tuple)) and len(prompt) > max_model_len:
            raise ValueError(
                f"{field}: {len(prompt)} prompt tokens exceed the model's context window of "
                f"{max_model_len} tokens"
            )

    def encode_prompt(self, prompt: PromptType, field: str) -> list[int]:
        """A prompt's token ids: text tokenized, ids checked against the vocabulary.
        Errors name ``field`` (``prompts[0]``, or a request's field in the server)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{field}: prompt is empty; it needs at least 1 token")
            return self._require_tokenizer(field).encode(prompt)
        try:
            token_ids = list(prompt)
        except TypeError:
            raise TypeError(
                f"{field}: a prompt is a string or a list of token ids, got {prompt!r:.100}"
            ) from None
        if not token_ids:
            raise ValueError(f"{field}: prompt is empty; it needs at least 1 token")
        vocab_size = self.model_config.vocab_size
        for position, token_id in enumerate(token_ids):
            if type(token_id) is not int:
                # Another library's integer (numpy's int64) becomes Python's: only those
                # cross to the scheduler.
                if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral):
                    raise TypeError(
                        f"{field}[{position}]: token ids must be integers, got {token_id!r}"
                    )
                token_id = token_ids[position] = int(token_id)
            if not 0 <= token_id < vocab_size:
                raise ValueError(
                    f"{field}[{position}]: token id {token_id} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
        return token_ids

    def render_chat(
        self,
        conversation: list[Message],
        field: str = "messages",
        tools: list[dict[str, Any]] | None = None,
        options: ChatTemplateOptions = DEFAULT_CHAT_OPTIONS,
    ) -> str:
        """The prompt text of a conversation: the chat template (the model's, or the
        options' own), ending as ``options`` say (the assistant's turn to speak, by
        default); encode it with ``add_special_tokens=False``. ``tools`` (OpenAI's function
        tools) go to the template. ``ValueError`` starting ``continue_final_message`` when the
        template hides the last message (no end of it to go on from), ``chat_template`` for
        the options' template when it is not a Jinja template."""
        tokenizer = self._require_tokenizer(field)
        try:
            return tokenizer.apply_chat_template(list(conversation), tools, options)
        except TemplateSyntaxError as error:
            if options.chat_template is None:
                raise  # the model's own template: the model directory's problem
            raise ValueError(
                f"chat_template: not a Jinja template: {error.message} (line {error.lineno})"
            ) from None
        except ValueError as error:
            if not str(error).startswith("continue_final_message"):  # HF's own words
                raise
            raise ValueError(
                "continue_final_message: the chat template does not write the last message's "
                "content as it is, so there is no end of it to go on from"
            ) from None

    def _as_params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.default_sampling_params()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        params = list(params)
        if len(params) != count:
            raise ValueError(
                f"sampling_params: got {len(params)} for {count} prompts; pass one or one each"
            )
        return params

    def _as_pooling_params_list(
        self, params: PoolingParams | Sequence[PoolingParams] | None, count: int
    ) -> list[PoolingParams]:
        if params is None:
            return [PoolingParams()] * count
        if isinstance(params, PoolingParams):
            return [params] * count
        params = list(params)
        if len(params) != count or not all(isinstance(p, PoolingParams) for p in params):
            raise ValueError(
                f"pooling_params: got {params!r} for {count} prompts; pass one PoolingParams "
                "or one each"
            )
        return params

    def lora_id(self, lora_request: LoRARef, field: str = "lora_request") -> int:
        """The id of the adapter ``lora_request`` names (0: the base model); ``ValueError``
        naming ``field`` for one this engine does not serve."""
        if lora_request is None:
            return 0
        if isinstance(lora_request, LoRARequest):
            name = lora_request.lora_name
        elif isinstance(lora_request, str):
            name = lora_request
        else:
            raise TypeError(
                f"{field} must be an adapter name or a LoRARequest, got {lora_request!r}"
            )
        lora_id = self.lora_ids.get(name)
        if (
            lora_id is None
            and isinstance(lora_request, LoRARequest)
            and lora_request.lora_path is not None
            and self.enable_lora
        ):
            # vLLM's offline use: the request brings its adapter.
            lora_id = self.load_lora(name, lora_request.lora_path)
            if lora_request.lora_int_id is not None:
                self._lora_int_ids[name] = lora_request.lora_int_id
        if lora_id is None:
            served = ", ".join(self.lora_ids) or "none (start with lora_modules or enable_lora)"
            raise ValueError(f"{field}: no LoRA adapter named {name!r} here; adapters: {served}")
        if isinstance(lora_request, LoRARequest):
            path = lora_request.lora_path
            if path is not None and Path(path).resolve() != Path(self.lora_paths[name]).resolve():
                raise ValueError(
                    f"{field}: adapter {name!r} was loaded from {self.lora_paths[name]}, not "
                    f"{path}; load another directory under another name (load_lora)"
                )
            int_id = self._lora_int_ids.get(name, lora_id)
            if lora_request.lora_int_id not in (None, int_id):
                raise ValueError(
                    f"{field}: adapter {name!r} has id {int_id} here, not "
                    f"{lora_request.lora_int_id}"
                )
        return lora_id

    def priorities_of(self, priority: int | Sequence[int] | None, count: int) -> list[int]:
        """One checked priority per prompt from ``generate``'s ``priority`` argument."""
        if priority is None:
            return [0] * count
        if isinstance(priority, (list, tuple)):
            if len(priority) != count:
                raise ValueError(
                    f"priority has {len(priority)} entries for {count} prompts; give one "
                    "per prompt or a single integer"
                )
            for index, value in enumerate(priority):
                self.check_priority(value, f"priority[{index}]")
            return list(priority)
        self.check_priority(priority, "priority")
        return [priority] * count

    def check_priority(self, priority: object, field: str = "priority") -> None:
        """``ValueError`` naming the field for a priority this engine cannot honour."""
        check_priority(priority, self.scheduler_config.scheduling_policy, field)

    def lora_ids_of(self, lora_request: LoRARef | Sequence[LoRARef], count: int) -> list[int]:
        """One adapter id per prompt: the same for all, or one each from a list."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != count:
                raise ValueError(
                    f"lora_request: got {len(lora_request)} for {count} prompts; pass one or "
                    "one each"
                )
            return [
                self.lora_id(item, f"lora_request[{index}]")
                for index, item in enumerate(lora_request)
            ]
        return [self.lora_id(lora_request)] * count

    def default_sampling_params(self) -> SamplingParams:
        """What a request that sets nothing samples with: the model's generation_config.json
        (greedy unless it sets ``do_sample``; its top_k, top_p, min_p, repetition_penalty),
        as ``generation_config`` and ``override_generation_config`` say (generation_config.py)."""
        return self.generation_defaults.sampling_params()

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's name for ``default_sampling_params``."""
        return self.default_sampling_params()

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer, as vLLM's ``LLM.get_tokenizer`` returns it
        (``apply_chat_template``, ``decode`` ...); ``ValueError`` for a model without one."""
        return self._require_tokenizer("get_tokenizer").hf_tokenizer

    def _load_tokenizer(
        self, path: Path, chat_template: str | None, reasoning_parser: str | None
    ) -> None:
        """``tokenizer`` (None for a model without one), and from it ``grammar_vocabulary``:
        what structured output matches grammars over (None: no tokenizer, no grammars)."""
        self.tokenizer = Tokenizer(path, chat_template) if Tokenizer.exists_in(path) else None
        if self.tokenizer is not None:
            self.tokenizer.lower_case = self.sentence_config.do_lower_case
        think_token_ids: tuple[int | None, list[int] | None, list[int] | None] = (None, None, None)
        if reasoning_parser is not None:
            think_token_ids = thinking_token_ids(reasoning_parser, self.tokenizer)
        tokenizer_json = self.tokenizer.backend_json() if self.tokenizer is not None else None
        self.grammar_vocabulary = (
            None
            if tokenizer_json is None
            else GrammarVocabulary(
                tokenizer_json,
                self.model_config.vocab_size,
                sorted(self.model_config.eos_token_ids),
                *think_token_ids,
            )
        )

    def _require_tokenizer(self, field: str) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError(
                f"{field}: text needs a tokenizer, and {str(self.model_path)!r} has none; "
                "pass token ids instead"
            )
        return self.tokenizer


def _pooling_output(output: EmbeddingRequestOutput, task: str) -> PoolingRequestOutput:
    """An ``encode`` result: a per-token task's values cut into a row per prompt token."""
    values = output.outputs.embedding if output.outputs is not None else []
    data: list[float] | list[list[float]] = values
    if task.startswith("token_"):
        data = split_rows(values, len(output.prompt_token_ids))
    return PoolingRequestOutput(
        request_id=output.request_id,
        prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids,
        outputs=PoolingOutput(data),
        task=task,
        num_cached_tokens=output.num_cached_tokens,
    )


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, Sequence):
        # A numpy array or a torch tensor of token ids (one prompt, or one per row).
        prompts = prompts.tolist()
        prompts = [prompts] if isinstance(prompts, int) else prompts
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(
            f"prompts must be a string, a list of token ids, or a list of those; got "
            f"{type(prompts).__name__}"
        )
    if len(prompts) == 0:
        raise ValueError("prompts is empty; pass at least one prompt")
    if all(isinstance(item, numbers.Integral) and not isinstance(item, bool) for item in prompts):
        return [list(prompts)]
    return list(prompts)


def _choose_multiprocess(multiprocess: bool | None, tensor_parallel_size: int) -> bool:
    """Tensor parallelism runs one worker process per rank: unset, ``multiprocess``
    follows from the size (as vLLM picks its multi-process executor); ``False`` with
    more than one rank is an error."""
    _check_optional_positive("tensor_parallel_size", tensor_parallel_size)
    if multiprocess is None:
        return tensor_parallel_size > 1
    if not multiprocess and tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} runs one worker process per rank "
            "and needs multiprocess=True; leave multiprocess unset to have it chosen"
        )
    return bool(multiprocess)


def _check_optional_positive(name: str, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
