"""Tensor parallelism across Ray nodes (``distributed_executor_backend="ray"``): a Ray
cluster of two nodes on this machine (``helpers.ray_cluster``), one rank an actor on each,
the rank on the scheduler's node reading plans from the ring and the other over TCP. The
same greedy tokens as one rank; a rank killed on the other node ends every request with an
error naming it, and nothing is left behind.

Slow (a Ray cluster and an actor a rank): ``make test-quick`` leaves it out.
"""

from __future__ import annotations

import re

import pytest

from helpers.engine_processes import assert_engine_gone, kill_mid_generation
from helpers.parity import EMBEDDED_PROMPTS, random_prompts
from helpers.processes import is_live, wait_until
from helpers.ray_cluster import RayCluster
from helpers.tiny_family import token_ids
from pagedserve.frontend import LLM, SamplingParams
from pagedserve.frontend.engine_client import EngineDeadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = RayCluster(tmp_path_factory.mktemp("ray_cluster"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def make_llm(cluster):
    """LLMs on the cluster, shut down when the test ends, whatever happens."""
    made: list[LLM] = []

    def make(model_dir, tensor_parallel_size: int = 2, **kwargs) -> LLM:
        llm = LLM(
            model_dir,
            tensor_parallel_size=tensor_parallel_size,
            distributed_executor_backend="ray",
            ray_address=cluster.address,
            **kwargs,
        )
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def _nodes(description: str) -> list[str]:
    """The node ids of the ranks, in rank order, from the engine's workers description."""
    return re.findall(r"on node [\d.]+ \((\w+)", description)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_one_rank_on_each_node_gives_the_same_greedy_tokens_as_one(
    tiny_model_dirs, make_llm, family
):
    prompts = random_prompts(seed=5, vocab_size=512)
    expected = token_ids(LLM(tiny_model_dirs[family], num_blocks=128).generate(prompts, GREEDY))
    llm = make_llm(tiny_model_dirs[family], num_blocks=128)
    description = llm.engine.workers_description
    nodes = _nodes(description)
    assert len(nodes) == 2 and nodes[0] != nodes[1], description
    # Rank 0 shares the scheduler's node (the ring); rank 1 takes its plans over TCP.
    assert description.count("plans over TCP") == 1 and "rank 1" in description.split("TCP")[0]
    assert token_ids(llm.generate(prompts, GREEDY)) == expected


def test_the_embedded_model_split_over_three_ranks_on_two_nodes(embedded_model_dir, make_llm):
    # Its 9 query and 3 KV heads split three ways: two ranks on the head, one on node_b.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = token_ids(LLM(embedded_model_dir, num_blocks=64).generate(EMBEDDED_PROMPTS, params))
    llm = make_llm(embedded_model_dir, tensor_parallel_size=3, num_blocks=64)
    assert len(set(_nodes(llm.engine.workers_description))) == 2
    assert token_ids(llm.generate(EMBEDDED_PROMPTS, params)) == expected


def test_the_remote_rank_killed_ends_every_request_naming_node_and_rank(tiny_model_dirs, make_llm):
    llm = make_llm(tiny_model_dirs["llama"], num_blocks=256)
    engine = llm.engine
    scheduler_pid, worker_pids = engine.scheduler_pid, engine.worker_pids
    ring = engine._process.ring_name
    error = kill_mid_generation(llm, worker_pids[1])  # rank 1: the actor on the other node
    assert isinstance(error, EngineDeadError), error
    assert re.search(
        rf"worker rank 1 \(pid {worker_pids[1]}\) on node [\d.]+ \(\w+, plans over TCP\) "
        r"died with its Ray actor's end",
        str(error),
    ), error
    # The scheduler ended, and with it the actors it owned (rank 0's too, on the head).
    assert_engine_gone(llm, scheduler_pid, [], ring)
    assert wait_until(lambda: not any(is_live(pid) for pid in worker_pids), 10.0)
