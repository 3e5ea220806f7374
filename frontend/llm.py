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
from pagedserve.frontend.engine_args import engine_args
from pagedserve.frontend.engine_client import EngineClient
from pagedserve.frontend.engine_layout import choose_async_scheduling, choose_multiprocess
from pagedserve.frontend.generation_config import load_generation_defaults
from pagedserve.frontend.llm_pooling import PoolingCalls
from pagedserve.frontend.lora_request import LoRARequest
from pagedserve.frontend.model_resolver import resolve_model
from pagedserve.frontend.outputs import (
    RequestOutput,
)
from pagedserve.frontend.pooler_config import (
    PoolerConfig,
    read_pooler_config,
    read_sentence_transformer_config,
)
from pagedserve.frontend.progress import ProgressBar
from pagedserve.frontend.prompts import Message, PromptType, as_prompt_list
from pagedserve.frontend.reasoning import thinking_token_ids
from pagedserve.frontend.request_tracker import EmbeddingTracker, EngineAction, RequestTracker
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
    check_kv_cache_dtype,
    check_quantization_name,
    check_tensor_parallel_size,
    next_token_layer_config,
)
from pagedserve.scheduler.config import SchedulerConfig, check_priority
from pagedserve.scheduler.engine_core import EngineCore
from pagedserve.scheduler.engine_messages import WorkerSpec
from pagedserve.scheduler.pooling_params import (
    PROMPT_ONLY_SAMPLING_PARAMS,
    PoolingParams,
    check_task,
)
from pagedserve.scheduler.request_limits import MAX_PROMPT_CHARS_PER_TOKEN
from pagedserve.scheduler.sampling_params import (
    SamplingParams,
    token_ids_outside_vocabulary,
)
from pagedserve.scheduler.speculative_config import SpeculativeConfig
from pagedserve.scheduler.step_profile import PROFILE
from pagedserve.scheduler.structured_output import (
    GrammarVocabulary,
    StructuredOutput,
    grammar_text,
)

if TYPE_CHECKING:
    from pagedserve.gpu_worker.worker import Worker

logger = logging.getLogger(__name__)

# A request's LoRA adapter: its name, a LoRARequest, or None for the base model.
LoRARef = str | LoRARequest | None


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


class LLM(PoolingCalls):
    """An engine on one machine: tokenizer, scheduler and worker as plain objects, or
    (``multiprocess``) the scheduler and workers in processes of their own. Its options are
    ``EngineArgs``'s: docs/engine_options.md lists each, its default and what it does.
    Call ``shutdown()`` when done (it also runs at interpreter exit)."""

    def __init__(self, model: str | os.PathLike[str] | None = None, **options: Any) -> None:
        """An engine of ``model`` (None: the embedded SmolLM2-135M-Instruct; a local HF
        directory or a ``.gguf`` file) with ``options`` (``EngineArgs``'s fields)."""
        args = engine_args(model, options)
        check_quantization_name(args.quantization, args.device)
        self.quantization = args.quantization
        check_kv_cache_dtype(args.kv_cache_dtype, args.device)
        self.kv_cache_dtype = args.kv_cache_dtype
        if args.reasoning_parser is not None:
            thinking_token_ids(args.reasoning_parser, None)  # the name, before anything loads
        # The reservation baselines of the paper share nothing, cached prefixes included.
        enable_prefix_caching = args.enable_prefix_caching and args.allocation_policy == "paged"
        enable_chunked_prefill = args.enable_chunked_prefill
        multiprocess = choose_multiprocess(
            args.multiprocess, args.tensor_parallel_size, args.distributed_executor_backend
        )
        max_model_len = args.max_model_len
        # Graphs for every batch the scheduler may form, over block tables of max_model_len
        # (0: the model's window).
        graph_max_batch = args.max_num_seqs if args.cuda_graphs else 0
        graph_max_len = max_model_len or 0
        resolved = resolve_model(args.model, cache_dir=args.cache_dir, progress=_print_progress)
        self.model_path: Path = resolved.path
        speculative = (
            None
            if args.speculative_config is None
            else SpeculativeConfig.from_dict(args.speculative_config)
        )
        # Speculative decoding with a draft model: its directory (a GGUF file converted once).
        draft_path: Path | None = None
        draft_config: ModelConfig | None = None
        if speculative is not None and speculative.method == "draft_model":
            ranks = speculative.draft_tensor_parallel_size
            if ranks is not None and ranks != args.tensor_parallel_size:
                raise ValueError(
                    f"speculative_config.draft_tensor_parallel_size={ranks} with "
                    f"tensor_parallel_size={args.tensor_parallel_size}: this engine splits the "
                    f"draft model over the target's ranks; set it to {args.tensor_parallel_size} "
                    "or leave it out"
                )
            draft_path = resolve_model(
                speculative.model, cache_dir=args.cache_dir, progress=_print_progress
            ).path
            draft_config = ModelConfig.from_dir(draft_path)
            check_draft_model(
                ModelConfig.from_dir(resolved.path), draft_config, args.tensor_parallel_size
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
            self.model_path, args.generation_config, args.override_generation_config
        )
        self.worker: Worker | None = None  # in-process only
        # LoRA adapter name -> id (1, 2, ...: the workers load them in this order).
        self.lora_ids: dict[str, int] = {}
        self.lora_paths: dict[str, str] = {}
        adapters = _check_lora_modules(
            args.lora_modules,
            resolved.path,
            args.tensor_parallel_size,
            graph_max_batch,
            args.enable_lora,
        )
        for lora_id, (name, path) in enumerate(adapters, start=1):
            self.lora_ids[name] = lora_id
            self.lora_paths[name] = path
        # Adapters loaded at run time take ids after these; an id is never reused, so no
        # cached prefix of an unloaded adapter can serve a new one.
        self.enable_lora = args.enable_lora or bool(adapters)
        self._next_lora_id = len(adapters) + 1
        # The ids requests gave adapters they loaded (LoRARequest.lora_int_id), by name.
        self._lora_int_ids: dict[str, int] = {}
        if multiprocess:
            model_config = ModelConfig.from_dir(resolved.path)
            # Here, before any process starts, so a bad size fails at once.
            check_tensor_parallel_size(model_config, args.tensor_parallel_size)
            if graph_max_batch:
                check_cuda_graph_support(model_config)
        else:
            # Here, not at the top: a multi-process frontend (the gRPC server) never
            # imports torch; its workers do.
            from pagedserve.gpu_worker.memory import default_kv_cache_bytes
            from pagedserve.gpu_worker.worker import Worker

            self.worker = Worker(
                resolved.path,
                args.dtype,
                args.block_size,
                args.num_blocks,
                args.kv_cache_bytes,
                args.device,
                swap_space_bytes=args.swap_space_bytes,
                kv_cache_bytes_from_free_memory=default_kv_cache_bytes,
                cuda_graph_max_batch=graph_max_batch,
                cuda_graph_max_len=graph_max_len,
                lora_modules=adapters,
                enable_lora=self.enable_lora,
                quantization=args.quantization,
                kv_cache_dtype=args.kv_cache_dtype,
                speculative_model=draft_path,
                num_speculative_tokens=num_draft_tokens,
                speculative_method=worker_method,
            )
            model_config = self.worker.model_config
        self.model_config = model_config
        # An embedding model's pooling (its sentence-transformers files, or pooler_config);
        # a classifier's head always reads the last token.
        self.pooler_config = (
            read_pooler_config(resolved.path, args.pooler_config)
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
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens
            or (2048 if enable_chunked_prefill else max(2048, max_model_len)),
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
            allocation_policy=args.allocation_policy,
            scheduling_policy=args.scheduling_policy,
            max_loras=args.max_loras or 0,
            sliding_window=model_config.attention_window,
            model_task=model_config.task,
            long_rope_switch=model_config.long_rope_switch,
            async_scheduling=choose_async_scheduling(
                args.async_scheduling, multiprocess, args.device
            ),
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
                    args.dtype,
                    args.block_size,
                    args.num_blocks,
                    args.kv_cache_bytes,
                    args.device,
                    args.swap_space_bytes,
                    graph_max_batch,
                    graph_max_len,
                    [list(adapter) for adapter in adapters],
                    self.enable_lora,
                    args.quantization,
                    args.kv_cache_dtype,
                    None if draft_path is None else str(draft_path),
                    num_draft_tokens,
                    worker_method,
                ),
                seed=args.seed,
                enable_prefix_caching=enable_prefix_caching,
                world_size=args.tensor_parallel_size,
                executor_backend=args.distributed_executor_backend,
                ray_address=args.ray_address,
                startup_timeout_s=args.startup_timeout_s,
            )
            try:
                self._load_tokenizer(resolved.path, args.chat_template, args.reasoning_parser)
                self.engine.finish_start(
                    self.grammar_vocabulary, args.structured_outputs_disable_any_whitespace
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
            self._load_tokenizer(resolved.path, args.chat_template, args.reasoning_parser)
            self.engine = EngineCore(
                scheduler_config,
                self.worker.num_blocks,
                args.block_size,
                self.worker,
                seed=args.seed,
                num_host_blocks=self.worker.num_host_blocks,
                enable_prefix_caching=enable_prefix_caching,
                structured_output=StructuredOutput(
                    self.grammar_vocabulary, args.structured_outputs_disable_any_whitespace
                ),
            )
            cache_sizes = (
                self.worker.num_blocks,
                self.worker.bytes_per_block,
                self.worker.num_host_blocks,
            )
        self.eos_token_ids = model_config.eos_token_ids
        # The most logprobs a request may ask for (-1: as many as the vocabulary has).
        self.max_logprobs = (
            model_config.vocab_size if args.max_logprobs == -1 else args.max_logprobs
        )
        self.dtype = args.dtype
        self.block_size = args.block_size
        # Whether full blocks of each prompt stay cached for later requests' hits.
        self.enable_prefix_caching = enable_prefix_caching
        self.scheduler_config = scheduler_config
        self._request_counter = itertools.count()
        # Bytes per block are one rank's: each tensor-parallel rank holds its own heads.
        self.num_blocks, self.bytes_per_block, self.num_host_blocks = cache_sizes
        self.tensor_parallel_size = args.tensor_parallel_size
        logger.info(
            "KV cache: %d blocks of %d tokens, %d bytes per block and rank (%d ranks), "
            "%d tokens at most (%s); host swap pool: %d blocks",
            self.num_blocks,
            args.block_size,
            self.bytes_per_block,
            args.tensor_parallel_size,
            self.num_blocks * args.block_size,
            args.dtype if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
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
        prompt_list = as_prompt_list(prompts)
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

    def check_task(self, pooling_params: PoolingParams | None) -> None:
        """``ValueError`` for a request of a task this model does not serve
        (``pooling_params.check_task``): None for a generation request."""
        try:
            check_task(self.model_config.task, pooling_params)
        except ValueError as error:
            raise ValueError(f"model {self.model_config.declared_architecture}: {error}") from None

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
                deltas = self.engine.step()
                started_ns = PROFILE.now()
                for delta in deltas:
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
                PROFILE.lap("outputs_process", started_ns)
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
