"""Plain messages between the engine's processes, other than the step plan and result.

Frontend -> scheduler: ``AddRequest``, ``AbortRequest``, ``StopSample``, ``GetStats``,
``ResetPrefixCache``, ``Shutdown``. Scheduler -> frontend: ``OutputBatch`` (the
``RequestOutputDelta``s of one step), ``EngineStats`` (the answer to ``GetStats``, and the
scheduler's last word before it exits) and, for a request it could not take or an
engine-wide failure, ``EngineError``. Every process announces itself with ``Ready`` once
it can serve. A process starts from one message: the scheduler from ``StartEngine`` (on
its stdin; then ``StartStructuredOutput``, the first on its input socket, sent once the
frontend's tokenizer has loaded), a worker from ``StartWorker`` (its only argument). Like
``messages.py``, only ints, floats, strings, lists, dicts and nested dataclasses of those
live here, so ``serialization.py`` can encode them explicitly, field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import RequestOutputDelta
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.structured_output import GrammarVocabulary


@dataclass
class AddRequest:
    """A new request, already tokenized and validated by the frontend.

    ``arrival_time_s`` is the frontend's ``time.monotonic()`` when the request arrived;
    processes on one host share that clock, so the scheduler can order by it and measure
    queueing time without a second clock reading.

    ``eos_token_ids`` travel with each request, as they do in the in-process call: the
    frontend owns what ends a request (the model's generation config today, a request's
    own choice later), and the scheduler never reads model files.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time_s: float
    eos_token_ids: list[int]
    cache_namespace: str | None = None
    lora_id: int = 0  # the LoRA adapter (WorkerSpec.lora_modules[lora_id - 1]); 0: none
    priority: int = 0  # lower runs first, under SchedulerConfig.scheduling_policy "priority"
    pooling_params: PoolingParams | None = None  # an embedding request (prompt only)


@dataclass
class AbortRequest:
    """Stop a request (client cancelled, deadline passed); the scheduler frees its blocks
    and answers with the request's final ``RequestOutputDelta``."""

    request_id: str


@dataclass
class StopSample:
    """Output ``index`` of a parallel-sampling request has ended in the frontend (a stop
    string, which only the frontend's detokenizer can see); the scheduler ends that sample's
    sequence and frees its blocks while the request's other samples run on. Once every sample
    has ended, the request's final ``RequestOutputDelta`` follows."""

    request_id: str
    index: int


@dataclass
class EngineError:
    """A failure to report to the frontend: about one request (``request_id`` set; that
    request has ended with this error) or about the whole engine (``request_id`` None).
    ``code`` says how a request's error reads (a ``call_errors`` code): ``INVALID_ARGUMENT``
    for a request the scheduler refused, ``INTERNAL`` for one that failed in the engine."""

    request_id: str | None
    message: str
    code: str = "INVALID_ARGUMENT"


@dataclass
class Shutdown:
    """Ask the receiving process to finish what it is doing and exit."""


@dataclass
class Ready:
    """A process's handshake once it can serve: ``component`` names its role
    (``"scheduler"``, ``"worker"``...), ``info`` carries plain facts about it (e.g.
    ``{"rank": 0, "num_blocks": 4096}``): strings, numbers, booleans, None, bytes, and
    lists / string-keyed dicts of those. Tuples inside ``info`` arrive as lists."""

    component: str
    pid: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class OutputBatch:
    """The new tokens of one engine step, all requests together (and the final deltas of
    requests aborted since the previous step): one message per step, not per request."""

    deltas: list[RequestOutputDelta]


@dataclass
class Progress:
    """The scheduler's pulse while it has requests: ``waiting_on`` "" after a step that sent
    no tokens (a step completed); else what it has waited on for ``waiting_s`` seconds
    within a step (a worker that has not returned the step's result). The frontend judges
    liveness by it (``frontend/liveness.py``)."""

    waiting_on: str
    waiting_s: float


@dataclass
class GetStats:
    """Ask the scheduler for its counters and a block-integrity check. The answer,
    ``EngineStats``, travels on the output channel in order with the output batches."""


@dataclass
class EngineStats:
    """The scheduler's counters (``EngineCore.stats()``) and the outcome of its
    block-integrity check: ``None`` when it passed, else the ``AssertionError``'s text."""

    stats: dict[str, int]
    integrity_error: str | None


@dataclass
class ResetPrefixCache:
    """Forget every cached prefix (blocks in use keep their contents)."""


@dataclass
class LoadLoRA:
    """Serve a LoRA adapter from now on as ``lora_id`` (never an id used before); the
    frontend checked its files against the model. The workers load it with the next step,
    before any request that uses it runs."""

    lora_id: int
    name: str
    path: str


@dataclass
class UnloadLoRA:
    """Stop serving adapter ``lora_id``: the frontend sends no more requests for it, and
    the workers drop it once the requests already queued for it have ended."""

    lora_id: int


@dataclass
class WorkerSpec:
    """What every worker needs to build its ``Worker``: the model and the cache sizes.
    With neither ``num_blocks`` nor ``kv_cache_bytes`` the worker sizes its cache from
    the memory left once its weights are loaded."""

    model_path: str
    dtype: str
    block_size: int  # tokens
    num_blocks: int | None
    kv_cache_bytes: int | None
    device: str
    swap_space_bytes: int
    cuda_graph_max_batch: int = 0  # 0: no CUDA graphs
    cuda_graph_max_len: int = 0  # tokens a captured block table covers
    # LoRA adapters as [name, PEFT directory] pairs; adapter id k is the k-th (from 1).
    lora_modules: list[list[str]] = field(default_factory=list)
    # Adapters may load at run time (StepPlan.load_loras), even with none at start-up.
    enable_lora: bool = False
    # Weight-only quantization of the linear layers ("int8"; CPU only), or None.
    quantization: str | None = None
    # What the KV cache stores: "auto" (the model's dtype), "fp8" / "fp8_e4m3" or "fp8_e5m2"
    # (CPU only).
    kv_cache_dtype: str = "auto"
    # Speculative decoding with a draft model: its directory (None: no draft model) and the
    # tokens it guesses per sequence per step.
    speculative_model: str | None = None
    num_speculative_tokens: int = 0
    # "mtp": the model's own multi-token-prediction layer guesses (no speculative_model).
    speculative_method: str = "draft_model"


@dataclass
class StartEngine:
    """Everything the scheduler process starts from, sent once by the frontend.

    ``input_endpoint`` / ``output_endpoint`` are the frontend's bound ZeroMQ sockets
    (ipc:// in ``ipc_dir``, a directory only this engine uses); the scheduler binds its
    own sockets in ``ipc_dir`` too. ``frontend_pid`` lets the scheduler check that its
    parent is still the one that started it. There is no start-up deadline here: the
    frontend owns it, and kills the engine when it passes. What structured output needs
    comes later, in ``StartStructuredOutput``: the workers load meanwhile.
    """

    frontend_pid: int
    input_endpoint: str
    output_endpoint: str
    ipc_dir: str
    scheduler_config: SchedulerConfig
    seed: int
    enable_prefix_caching: bool
    world_size: int
    worker: WorkerSpec
    # Where the workers run (multiproc_executor.EXECUTOR_BACKENDS), and the Ray cluster's
    # address for "ray".
    executor_backend: str = "mp"
    ray_address: str = "auto"


@dataclass
class StartStructuredOutput:
    """The rest of the scheduler's start, the first message on its input socket: sent
    once the frontend has loaded the tokenizer (seconds), which it does while the workers
    load the model rather than before starting them.

    ``grammar_vocabulary`` (None for a model without a tokenizer) is what structured
    output matches grammars over; ``disable_any_whitespace`` makes every request's JSON
    compact (``structured_outputs_disable_any_whitespace``).
    """

    grammar_vocabulary: GrammarVocabulary | None = None
    disable_any_whitespace: bool = False


@dataclass
class StartWorker:
    """Everything one worker process starts from, sent by the scheduler.

    ``broadcast`` holds the fields of the step broadcaster's ``BroadcastHandle`` (plain
    strings and ints); ``result_endpoint`` is where the worker sends ``Ready``, its
    ``StepResult``s (rank 0 only) and, before it exits on a failure, an ``EngineError``.
    The ranks form a tensor-parallel process group that meets at
    ``distributed_init_method`` (a torch.distributed init method, ``file://...`` or
    ``tcp://host:port``; None: one rank, no group). ``scheduler_pid`` > 0: the worker ends
    when that process does (0: something else ends it, Ray for its actors).
    ``remote_reader``: the worker takes plans over the broadcast's TCP endpoint (another
    host), not its ring. ``device``: the rank's own ("cuda:1"; None: the spec's).
    ``ranks_on_host``: the ranks sharing this worker's host, whose cores and memory they
    split.
    """

    rank: int
    world_size: int
    scheduler_pid: int
    broadcast: dict[str, Any]
    result_endpoint: str
    worker: WorkerSpec
    distributed_init_method: str | None = None
    remote_reader: bool = False
    reader_index: int | None = None  # among the local or remote readers; None: the rank
    device: str | None = None
    ranks_on_host: int | None = None  # None: world_size
