"""CUDA graphs of the decode-only forward pass: ``LLM(device="cuda", cuda_graphs=True)``.

A decode step launches a few hundred small kernels, and from Python each launch costs
several microseconds: at small batches the launches take longer than the kernels. A
captured graph replays them all in one launch. There is one graph per padded batch size
(``graph_batch_sizes``), all sharing one memory pool and reading the same static buffers,
which a step fills before the replay:

    input_ids, positions [B]     padded rows: token 0 at position 0
    slot_mapping [B]             padded rows: -1 (reshape_and_cache skips negative slots)
    block_tables [B, W]          W fixed at capture: the longest context in blocks
    seq_lens [B]                 padded rows: 1 (they attend to block 0; their rows are
                                 discarded, and every op treats rows independently)

Steps with a prefill token, more decodes than the largest graph or a wider block table run
eagerly, as without graphs. Capture happens once, when the worker starts. A layer's sliding
window is a constant of its attention, so each graph's kernels carry it (and the split-K plan
it bounds) as captured; where a window starts is read from seq_lens at every replay.
"""

from __future__ import annotations

import math

import torch

from pagedserve.gpu_worker.layers.attention import AttentionMetadata
from pagedserve.gpu_worker.models.base import CausalLM


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_batch`` (and ``max_batch`` itself):
    a step pads to the next size, wasting at most 7 rows past 8."""
    sizes = {size for size in (1, 2, 4, 8) if size <= max_batch}
    sizes.update(range(16, max_batch + 1, 8))
    sizes.add(max_batch)
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode forward passes of ``model`` for batches up to ``max_batch``."""

    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        block_size: int,
        max_window_tokens: int,
        max_batch: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.device = device
        self.max_batch = max_batch
        self.width_blocks = math.ceil(max_window_tokens / block_size)
        self.num_replays = 0
        with torch.device(device):
            self.input_ids = torch.zeros(max_batch, dtype=torch.int64)
            self.positions = torch.zeros(max_batch, dtype=torch.int64)
            self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.int64)
            self.block_tables = torch.zeros(max_batch, self.width_blocks, dtype=torch.int32)
            self.seq_lens = torch.ones(max_batch, dtype=torch.int32)
            self._no_prefill_tables = torch.zeros(0, self.width_blocks, dtype=torch.int32)
            self._no_prefill_loc = torch.zeros(1, dtype=torch.int32)
            self._no_prefill_lens = torch.zeros(0, dtype=torch.int32)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    def _forward(self, batch: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.block_tables[:batch],
            decode_seq_lens=self.seq_lens[:batch],
            prefill_block_tables=self._no_prefill_tables,
            prefill_query_start_loc=self._no_prefill_loc,
            prefill_seq_lens=self._no_prefill_lens,
            prefill_max_query_len=0,
        )
        return self.model(self.input_ids[:batch], self.positions[:batch], metadata)

    def _capture(self) -> None:
        # Warm up on a side stream first (cuBLAS and the caching allocator set themselves up
        # on first use, which a capture must not see). Every slot is -1: nothing is written.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._forward(self.max_batch)
        torch.cuda.current_stream(self.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            # Largest first: the smaller graphs reuse its pool's blocks.
            for batch in reversed(graph_batch_sizes(self.max_batch)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(batch)
                self.graphs[batch] = (graph, hidden)
        torch.cuda.synchronize(self.device)

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """The hidden states of a decode-only step by replaying a graph, or ``None`` when the
        step does not fit one (run it eagerly). The result is a view of the graph's output:
        valid until the next replay."""
        num_tokens = input_ids.shape[0]
        tables = metadata.decode_block_tables
        if (
            num_tokens == 0
            or metadata.num_decode_tokens != num_tokens
            or num_tokens > self.max_batch
            or tables.shape[1] > self.width_blocks
        ):
            return None
        batch = min(size for size in self.graphs if size >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.input_ids[num_tokens:batch].zero_()
        self.positions[:num_tokens].copy_(positions)
        self.positions[num_tokens:batch].zero_()
        self.slot_mapping[:num_tokens].copy_(metadata.slot_mapping)
        self.slot_mapping[num_tokens:batch].fill_(-1)
        self.block_tables[:batch].zero_()
        self.block_tables[:num_tokens, : tables.shape[1]].copy_(tables)
        self.seq_lens[:num_tokens].copy_(metadata.decode_seq_lens)
        self.seq_lens[num_tokens:batch].fill_(1)
        graph, hidden = self.graphs[batch]
        graph.replay()
        self.num_replays += 1
        return hidden[:num_tokens]
