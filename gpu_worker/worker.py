"""One worker: the model's weights, the KV cache tensors and the model runner, on the CPU or
on one CUDA GPU."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pagedserve.gpu_worker import cuda_ops, ops
from pagedserve.gpu_worker.cuda_graphs import DecodeGraphs
from pagedserve.gpu_worker.draft_model import DraftModel
from pagedserve.gpu_worker.kv_cache import KVCacheSpec, kv_cache_torch_dtype
from pagedserve.gpu_worker.lora import (
    LoRABatch,
    check_lora_support,
    load_adapter,
    load_adapters,
    unload_adapter,
)
from pagedserve.gpu_worker.memory import default_gpu_kv_cache_bytes
from pagedserve.gpu_worker.model_config import (
    ModelConfig,
    check_attention_chunk_size,
    check_cuda_graph_support,
    check_dtype_name,
    check_kv_cache_dtype,
    check_quantization_name,
    next_token_layer_config,
)
from pagedserve.gpu_worker.model_runner import ModelRunner
from pagedserve.gpu_worker.models.multi_token_predictor import MultiTokenPredictor, layer_prefix
from pagedserve.gpu_worker.models.registry import build_model
from pagedserve.gpu_worker.next_token_drafter import NextTokenDrafter
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel, check_tensor_parallel_size
from pagedserve.gpu_worker.runner_state import LaunchedStep
from pagedserve.gpu_worker.standin_device import StandinModel, standin_forward_ms
from pagedserve.gpu_worker.weights import iterate_weights, language_model_weights
from pagedserve.scheduler.messages import StepPlan, StepResult

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(dtype: str) -> torch.dtype:
    check_dtype_name(dtype)
    return DTYPES[dtype]


class Worker:
    """Loads the model and owns the KV cache pools; executes step plans.

    The device pool holds ``num_blocks`` blocks, or as many as fit in ``kv_cache_bytes``;
    the host pool, which receives swapped-out requests, as many as fit in
    ``swap_space_bytes``. With tensor parallelism (``parallel``) it is one rank: it holds
    its share of the weights, and its pools hold its KV heads only, so both byte sizes
    are this rank's.

    ``device="cuda"`` (or ``"cuda:N"``) puts the weights, the device pool and the step's
    inputs on that GPU; the host pool is then pinned memory, and swaps run on a stream of
    their own that the forward pass waits for (an event), so they overlap the host's work
    on the step's inputs. Without a size, the device pool takes a share of the GPU memory
    free after the weights.

    ``cuda_graph_max_batch`` > 0 (CUDA only) captures the decode forward pass as CUDA graphs
    for batches up to that many sequences whose block tables fit ``cuda_graph_max_len``
    tokens (see cuda_graphs.py).

    ``speculative_model`` (a directory): a draft model of the same vocabulary, with a pool of
    its own of as many blocks, that guesses up to ``num_speculative_tokens`` tokens per
    decoding sequence after each step (draft_model.py). A block then costs both models'
    bytes (``bytes_per_block``), and copies and swaps move it in both pools.
    ``speculative_method="mtp"`` (no ``speculative_model``): the model's own
    multi-token-prediction layer guesses instead, from its checkpoint, with a one-layer pool
    beside the target's (next_token_drafter.py).
    """

    def __init__(
        self,
        model_path: Path,
        dtype: str,
        block_size: int,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        device: str = "cpu",
        swap_space_bytes: int = 0,
        kv_cache_bytes_from_free_memory: Callable[[], int] | None = None,
        parallel: TensorParallel = SINGLE,
        cuda_graph_max_batch: int = 0,
        cuda_graph_max_len: int = 0,
        lora_modules: list[tuple[str, str]] | None = None,
        enable_lora: bool = False,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        speculative_model: Path | None = None,
        num_speculative_tokens: int = 0,
        speculative_method: str = "draft_model",
    ) -> None:
        """``lora_modules``: (name, PEFT LoRA adapter directory) pairs, adapter ids 1, 2,
        ... in order; ``enable_lora``: adapters may also load at run time (the plans'
        ``load_loras``), even with none at start-up; ``quantization`` ("int8", CPU only):
        the linear layers' weights quantized as they are packed; ``kv_cache_dtype``
        ("auto": the model's dtype; "fp8" = "fp8_e4m3", or "fp8_e5m2"; CPU only): what the
        KV cache stores."""
        self.device = _parse_device(device)
        check_quantization_name(quantization, self.device.type)
        check_kv_cache_dtype(kv_cache_dtype, self.device.type)
        if cuda_graph_max_batch and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs need device='cuda', got device={device!r}")
        self.model_config = ModelConfig.from_dir(model_path)
        check_tensor_parallel_size(self.model_config, parallel.size)
        check_attention_chunk_size(self.model_config, block_size)
        self.draft_config = None
        if speculative_method == "mtp":
            self.draft_config = next_token_layer_config(self.model_config)
        elif speculative_method != "draft_model":
            raise ValueError(
                f"speculative_method must be 'draft_model' or 'mtp', got {speculative_method!r}"
            )
        elif speculative_model is not None:
            self.draft_config = ModelConfig.from_dir(speculative_model)
            check_tensor_parallel_size(self.draft_config, parallel.size)
            check_attention_chunk_size(self.draft_config, block_size)
        if cuda_graph_max_batch:
            check_cuda_graph_support(self.model_config)
        torch_dtype = parse_dtype(dtype)
        started = time.monotonic()
        # Parameters and tables are created where the model runs; checkpoint tensors are
        # copied in from the host.
        with torch.device(self.device):
            self.model = build_model(self.model_config, torch_dtype, parallel)
        self.model.load_weights(checkpoint_weights(self.model_config))
        lora_batch = None
        if lora_modules or enable_lora:
            check_lora_support(self.model_config.architecture, parallel.size, cuda_graph_max_batch)
            lora_batch = load_adapters(self.model, list(lora_modules or []))
        self._lora_batch: LoRABatch | None = lora_batch
        self.model.eval()
        num_packed = self.model.pack_weights(quantization)
        logger.info(
            "loaded %s in %.1f s (%d matrices packed for the CPU%s)",
            self.model_config.architecture,
            time.monotonic() - started,
            num_packed,
            "" if quantization is None else f", linear layers quantized to {quantization}",
        )
        cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, torch_dtype)
        self.kv_cache_spec = KVCacheSpec.for_model(
            self.model_config, parallel, block_size, cache_dtype
        )
        self.draft_model = None
        self.draft_kv_cache_spec = None
        self.next_token_predictor: MultiTokenPredictor | None = None
        if speculative_method == "mtp":
            assert self.draft_config is not None
            started = time.monotonic()
            with torch.device(self.device):
                self.next_token_predictor = MultiTokenPredictor(
                    self.model, self.draft_config, torch_dtype, parallel
                )
            prefix = layer_prefix(self.model_config)
            self.next_token_predictor.load_weights(
                checkpoint_weights(self.model_config, lambda name: name.startswith(prefix)),
                prefix,
            )
            self.next_token_predictor.eval()
            self.next_token_predictor.pack_weights(None)
            self.draft_kv_cache_spec = KVCacheSpec.for_model(
                self.draft_config, parallel, block_size, cache_dtype
            )
            logger.info(
                "loaded the multi-token-prediction layer (%s%s) in %.1f s",
                prefix,
                "" if self.next_token_predictor.head is None else ", its own head",
                time.monotonic() - started,
            )
        elif self.draft_config is not None:
            # Loaded before the pools are sized: its weights take memory too.
            started = time.monotonic()
            with torch.device(self.device):
                self.draft_model = build_model(self.draft_config, torch_dtype, parallel)
            self.draft_model.load_weights(checkpoint_weights(self.draft_config))
            self.draft_model.eval()
            self.draft_model.pack_weights(None)
            self.draft_kv_cache_spec = KVCacheSpec.for_model(
                self.draft_config, parallel, block_size, cache_dtype
            )
            logger.info(
                "loaded the draft model (%s) in %.1f s",
                self.draft_config.architecture,
                time.monotonic() - started,
            )
        if num_blocks is None:
            if kv_cache_bytes is None:
                if self.device.type == "cuda":
                    kv_cache_bytes = default_gpu_kv_cache_bytes(self.device)
                elif kv_cache_bytes_from_free_memory is None:
                    raise ValueError("either num_blocks or kv_cache_bytes must be given")
                else:
                    # Measured only now, so the memory the weights took is already gone.
                    kv_cache_bytes = kv_cache_bytes_from_free_memory()
            num_blocks = kv_cache_bytes // self.bytes_per_block
            if num_blocks < 1:
                raise ValueError(
                    f"kv_cache_bytes={kv_cache_bytes} holds no block: one block of "
                    f"{block_size} tokens takes {self.bytes_per_block} bytes"
                )
        self.num_blocks = num_blocks
        self.num_host_blocks = swap_space_bytes // self.bytes_per_block
        on_gpu = self.device.type == "cuda"
        # One device pool and one host pool (pinned on a GPU machine: only page-locked memory
        # copies asynchronously) per model: the target's first, then the draft model's.
        self.kv_caches = []
        self.host_kv_caches = []
        for spec in (self.kv_cache_spec, self.draft_kv_cache_spec):
            if spec is None:
                continue
            self.kv_caches.append(spec.allocate(num_blocks, self.device))
            if self.num_host_blocks:
                self.host_kv_caches.append(
                    spec.allocate(self.num_host_blocks, "cpu", pin_memory=on_gpu)
                )
        self.kv_cache = self.kv_caches[0]
        self.swap_stream = torch.cuda.Stream(self.device) if on_gpu else None
        self.model.bind_kv_cache(self.kv_cache)
        self.runner = ModelRunner(
            self.model,
            block_size,
            self.device,
            lora_batch,
            self.model_config.attention_chunk_size,
            self.model_config.latent_attention,
            self.model_config.long_rope_switch,
            self.model_config.max_position_embeddings,  # the rotary table's long rows
        )
        forward_ms = standin_forward_ms()
        if forward_ms is not None:
            standin = StandinModel(
                self.model, forward_ms, self.model_config.hidden_size, self.model_config.vocab_size
            )
            self.runner.model = standin
            self.runner.step_event = standin.step_event
        if self.next_token_predictor is not None:
            assert self.draft_config is not None
            self.next_token_predictor.bind_kv_cache(self.kv_caches[1])
            self.runner.draft_model = NextTokenDrafter(
                self.next_token_predictor,
                num_speculative_tokens,
                self.model_config.vocab_size,
                self.model_config.max_position_embeddings,
                block_size,
                self.device,
                self.runner.gathered_prefill,
                self.model_config.latent_attention,
            )
        if self.draft_model is not None:
            self.draft_model.bind_kv_cache(self.kv_caches[1])
            self.runner.draft_model = DraftModel(
                self.draft_model,
                num_speculative_tokens,
                self.model_config.vocab_size,
                self.draft_config.max_position_embeddings,
                block_size,
                self.device,
                self.runner.gathered_prefill,
                self.draft_config.attention_chunk_size,
                self.draft_config.latent_attention,
            )
        if cuda_graph_max_batch:
            started = time.monotonic()
            self.runner.decode_graphs = DecodeGraphs(
                self.model,
                self.device,
                block_size,
                cuda_graph_max_len or self.model_config.max_position_embeddings,
                cuda_graph_max_batch,
            )
            logger.info(
                "captured %d decode CUDA graphs (batches up to %d) in %.1f s",
                len(self.runner.decode_graphs.graphs),
                cuda_graph_max_batch,
                time.monotonic() - started,
            )

    @property
    def bytes_per_block(self) -> int:
        """What one block takes in the device pools (the draft model's too)."""
        draft = self.draft_kv_cache_spec
        return self.kv_cache_spec.bytes_per_block + (draft.bytes_per_block if draft else 0)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan, in_flight: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the plan's step on the device; ``in_flight``: the step launched before it,
        not finished yet (the plan must ``follow`` it)."""
        if plan.load_loras or plan.unload_lora_ids:
            self._update_loras(plan)
        if plan.swap_out or plan.swap_in:
            self._swap(plan)
        # Copy-on-write after the swaps (a swapped-in block may be the source of a copy),
        # on the compute stream, before the forward pass writes the copies.
        if plan.copy_blocks:
            pairs = _pairs(plan.copy_blocks)
            for kv_cache in self.kv_caches:
                ops.copy_blocks(kv_cache, pairs)
        return self.runner.launch(plan, in_flight)

    def follows(self, plan: StepPlan, in_flight: LaunchedStep) -> bool:
        """Whether the plan can be launched before ``in_flight``'s tokens are read
        (ModelRunner.follows)."""
        return self.runner.follows(plan, in_flight)

    def finish(self, step: LaunchedStep) -> StepResult:
        """A launched step's result, once the device is done with it; in launch order."""
        return self.runner.finish(step)

    def _update_loras(self, plan: StepPlan) -> None:
        """Adapters loaded or dropped at run time, before the step that may use them (the
        frontend checked each adapter's files against the model before it was sent)."""
        if self._lora_batch is None:
            raise RuntimeError("a LoRA update reached a worker started without enable_lora")
        for adapter_id, name, path in plan.load_loras:
            started = time.monotonic()
            load_adapter(self.model, self._lora_batch, adapter_id, name, path)
            logger.info(
                "loaded LoRA adapter %r (id %d) in %.2f s", name, adapter_id,
                time.monotonic() - started,
            )  # fmt: skip
        for adapter_id in plan.unload_lora_ids:
            unload_adapter(self.model, adapter_id)
            logger.info("unloaded LoRA adapter id %d", adapter_id)

    def _swap(self, plan: StepPlan) -> None:
        """Swap-outs first: their device blocks may be refilled by swap-ins or written by this
        very step. On a GPU both run in order on the swap stream, after the work already queued
        on the compute stream (earlier steps wrote those blocks), and the compute stream waits
        for them before this step's forward pass reads or rewrites any block."""
        if self.swap_stream is None:
            self._copy_swaps(plan)
            return
        compute_stream = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(compute_stream)
        with torch.cuda.stream(self.swap_stream):
            self._copy_swaps(plan)
        compute_stream.wait_stream(self.swap_stream)

    def _copy_swaps(self, plan: StepPlan) -> None:
        for kv_cache, host_kv_cache in zip(self.kv_caches, self.host_kv_caches):
            if plan.swap_out:
                ops.swap_blocks(kv_cache, host_kv_cache, _pairs(plan.swap_out))
            if plan.swap_in:
                ops.swap_blocks(host_kv_cache, kv_cache, _pairs(plan.swap_in))


def _parse_device(device: str) -> torch.device:
    """``"cpu"``, or ``"cuda"`` / ``"cuda:N"`` where a GPU and the CUDA kernels exist."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from error
    if parsed.type == "cpu":
        return parsed
    if parsed.type != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r}: torch sees no CUDA GPU here (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda})"
        )
    if not cuda_ops.is_built():
        raise ValueError(
            f"device={device!r}: this build of pagedserve has no CUDA kernels "
            "(pagedserve._C_cuda); reinstall where nvcc is found"
        )
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return torch.device("cuda", index)


def checkpoint_weights(
    config: ModelConfig, names: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's checkpoint tensors: a vision-language checkpoint's language model's
    alone (``ModelConfig.vision_language``); with ``names``, only those it accepts are
    read."""
    weights = iterate_weights(config.path, names)
    if config.vision_language:
        return language_model_weights(weights)
    return weights


def _pairs(pairs: list[tuple[int, int]]) -> torch.Tensor:
    return torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2)
