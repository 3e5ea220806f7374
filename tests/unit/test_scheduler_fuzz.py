"""The scheduler under seeded random workloads: arrivals, priorities, parallel samples,
embeddings, shared prefixes, aborts, samples stopped one by one, speculation and tight
caches, under each scheduling policy and preemption mode, with and without a sliding
window (blocks behind it freed), with a fake worker that samples
random tokens (EOS now and then) and accepts a random share of the drafts.

After every step: the block accounting holds (device and host), every live sequence is in
exactly one queue, the batch respects max_num_seqs (and under the priority policy is in
rank order), and under a window a single sequence holds no more blocks than one step and
the window before it span. At the end: every request got exactly one final delta, its outputs within
max_tokens, and every block is free."""

from __future__ import annotations

import random

import pytest

from pagedserve.scheduler.block_manager import BlockManager, blocks_spanned
from pagedserve.scheduler.config import SchedulerConfig
from pagedserve.scheduler.messages import StepResult
from pagedserve.scheduler.pooling_params import PoolingParams
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.scheduler.sampling_params import SamplingParams
from pagedserve.scheduler.scheduler import Scheduler

EOS = 2
VOCAB = 64
MAX_STEPS = 3000


def fake_worker(scheduler: Scheduler, plan, rng: random.Random) -> StepResult:
    """One token per sampling sequence (a group's first sample: one per sequence); a
    speculating one accepts a random number of its drafts, then samples one more; under a
    draft model, a sequence that may speculate also guesses a few tokens."""
    request_ids, tokens, embeddings, guesses = [], [], {}, {}
    config = scheduler.config
    draft_model = config.num_speculative_tokens and config.speculative_method == "draft_model"

    def sample() -> int:
        # Mostly a few tokens: outputs repeat, so prompt lookup finds drafts.
        if rng.random() < 0.03:
            return EOS
        return rng.randrange(3, 11) if rng.random() < 0.8 else rng.randrange(3, VOCAB)

    for item in (*plan.new_requests, *plan.cached_requests):
        request = scheduler.requests[item.request_id]
        drafts = plan.spec_token_ids.get(item.request_id, [])
        end = item.num_computed_tokens + item.num_scheduled_tokens - len(drafts)
        if end != request.num_tokens:
            continue  # a prefill chunk short of the end samples nothing
        if request.pooling_params is not None:  # an embedding: its vector, no token
            embeddings[item.request_id] = rng.randbytes(16)
            continue
        if draft_model and request.group is None:
            count = rng.randrange(config.num_speculative_tokens + 1)
            guesses[item.request_id] = [sample() for _ in range(count)]
        if drafts:
            accepted = drafts[: rng.randrange(len(drafts) + 1)]
            emitted = [*accepted, sample()]
            request_ids.extend([item.request_id] * len(emitted))
            tokens.extend(emitted)
            continue
        forks = request.group is not None and request.num_output_tokens == 0
        rows = request.sampling_params.num_sequences if forks else 1
        for _ in range(rows):
            request_ids.append(item.request_id)
            tokens.append(sample())
    return StepResult(
        plan.step_id, request_ids, tokens, embeddings=embeddings, draft_token_ids=guesses
    )


def check_invariants(scheduler: Scheduler) -> None:
    scheduler.block_manager.check_integrity()
    queues = [*scheduler.waiting, *scheduler.running, *scheduler.swapped]
    assert len(queues) == len({id(r) for r in queues}) == len(scheduler.requests)
    assert {r.request_id for r in queues} == set(scheduler.requests)
    for request in scheduler.waiting:
        assert request.status == RequestStatus.WAITING
    for request in scheduler.running:
        assert request.status == RequestStatus.RUNNING
    for request in scheduler.swapped:
        assert request.status == RequestStatus.SWAPPED
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    if scheduler.config.scheduling_policy == "priority":
        ranks = [r.rank for r in scheduler.running]
        assert ranks == sorted(ranks)
    if scheduler.config.max_loras:
        adapters = {r.lora_id for r in scheduler.running if r.lora_id}
        assert len(adapters) <= scheduler.config.max_loras
    window = scheduler.config.sliding_window
    if window:
        manager = scheduler.block_manager
        most = blocks_spanned(
            window - 1 + scheduler.config.max_num_batched_tokens, manager.block_size
        )
        for request in scheduler.running:
            if request.group is None:
                assert manager.num_held_blocks(request.request_id) <= most, request.request_id


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
@pytest.mark.parametrize("window", [0, 13])
def test_random_workloads_keep_the_invariants(seed, policy, mode, window):
    rng = random.Random(f"{seed}-{policy}-{mode}")
    block_size = rng.choice([8, 16])
    num_blocks = rng.randrange(12, 40)
    max_model_len = block_size * 10
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=rng.choice([2, 4, 8]),
            max_num_batched_tokens=rng.choice([32, 64, 256]),
            max_model_len=max_model_len,
            watermark_fraction=rng.choice([0.0, 0.05]),
            preemption_mode=mode,
            scheduling_policy=policy,
            num_speculative_tokens=rng.choice([0, 0, 3]),
            speculative_method=rng.choice(["ngram", "draft_model"]),
            max_loras=rng.choice([0, 1, 2]),
            sliding_window=window,
        ),
        BlockManager(
            num_blocks,
            block_size,
            watermark_blocks=1 if rng.random() < 0.5 else 0,
            num_host_blocks=rng.choice([0, 8, 64]),
            enable_prefix_caching=rng.random() < 0.5,
            sliding_window=window,
        ),
    )
    shared_prefix = [rng.randrange(3, VOCAB) for _ in range(block_size * 2)]
    num_requests = 40
    arrivals = sorted(rng.randrange(0, 200) for _ in range(num_requests))
    added, finals, outputs = {}, {}, {}
    step = 0
    while step < MAX_STEPS and (arrivals or scheduler.has_unfinished_requests()):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            request_id = f"r{len(added)}"
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, block_size * 4))]
            if rng.random() < 0.3:
                prompt = shared_prefix + prompt
            n = rng.choice([1, 1, 1, 2, 3])
            pooling = PoolingParams() if n == 1 and rng.random() < 0.2 else None
            max_tokens = rng.randrange(1, 40)
            try:
                scheduler.add_request(
                    Request(
                        request_id=request_id,
                        prompt_token_ids=prompt[: max_model_len - 1],
                        sampling_params=SamplingParams(
                            n=n, max_tokens=max_tokens, temperature=1.0 if n > 1 else 0.0, seed=7
                        ),
                        eos_token_ids=frozenset({EOS}),
                        arrival_time_s=float(step),
                        max_model_len=max_model_len,
                        priority=rng.randrange(0, 4) if policy == "priority" else 0,
                        pooling_params=pooling,
                        lora_id=rng.randrange(0, 4),
                    )
                )
            except ValueError:
                continue  # could never fit this cache: refused, as the engine would
            added[request_id] = (n, 0 if pooling else max_tokens)
        if added and rng.random() < 0.02:
            victim = rng.choice(list(added))
            delta = scheduler.abort_request(victim)
            if delta is not None:
                assert victim not in finals
                finals[victim] = "abort"
        if scheduler.groups and rng.random() < 0.03:
            # A stop string found by the frontend ends one sample of a group.
            group = rng.choice(list(scheduler.groups.values()))
            if group.sequences:
                index = rng.choice(group.sequences).sample_index
                delta = scheduler.stop_sample(group.request_id, index)
                if delta is not None:
                    assert group.request_id not in finals
                    finals[group.request_id] = "stop"
        plan = scheduler.schedule()
        if not plan.is_empty:
            result = fake_worker(scheduler, plan, rng)
            for delta in scheduler.update_from_output(plan, result):
                if delta.new_token_ids:
                    outputs.setdefault((delta.request_id, delta.index), []).extend(
                        delta.new_token_ids
                    )
                if delta.finished:
                    assert delta.request_id not in finals, delta
                    finals[delta.request_id] = delta.finish_reason
        else:
            assert not scheduler.running, "an empty plan while requests run"
        check_invariants(scheduler)
        step += 1
    assert not scheduler.has_unfinished_requests(), f"stuck after {step} steps"
    assert set(finals) == set(added)
    for (request_id, _), tokens in outputs.items():
        assert len(tokens) <= added[request_id][1]
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_total_blocks
    assert manager.num_free_host_blocks == manager.num_total_host_blocks
    if scheduler.config.num_speculative_tokens:
        assert scheduler.num_draft_tokens > 0  # the speculation paths ran
