"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, Granite MoE, gpt-oss, DeepSeek-V2
/ V3, GLM-4.5, MiniMax-M2, Llama 4): a router picks each token's top-k experts (DeepSeek's and
GLM-4.5's within its best groups of experts), and each expert, a gated MLP (gpt-oss's: a
clamped SwiGLU with biases), runs on the tokens routed to it, its output weighted (Llama 4's:
its input).

Dispatch: the (token, expert) pairs are sorted by expert and their rows gathered once, so
each expert runs one GEMM over a slice of them; the weighted outputs go back to token
order and each token's k are summed in ascending expert order, as HF transformers adds them
(the same sums, bit for bit, in float32 and bfloat16). Three ops per expert: on a small CPU
each op's fixed cost, not its arithmetic, is what a decode step of a small model pays.

Tensor parallelism: every rank holds ``1/N`` of each expert's intermediate rows (not whole
experts): the work stays even whatever the routing, and the experts' partial outputs are
summed over the ranks once per layer, after the last expert. The router is replicated.

NOTE: which experts run, and on how many rows, depends on the data: the per-expert loop
reads the counts on the host once per layer, so MoE models run without CUDA graphs.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.gpu_worker.layers.basic import Linear
from pagedserve.gpu_worker.layers.mlp import ClampedSwiGLUMLP, GatedMLP
from pagedserve.gpu_worker.model_config import ExpertsSpec
from pagedserve.gpu_worker.parallel import SINGLE, TensorParallel


class SparseMoE(nn.Module):
    """Parameters under HF's names: ``gate`` (the router, [num_experts, hidden]; DeepSeek-V3's
    and GLM-4.5's with ``gate.e_score_correction_bias``), ``experts.{e}`` (gated MLPs), Qwen2-MoE's
    ``shared_expert`` and ``shared_expert_gate``, DeepSeek's and GLM-4.5's ``shared_experts``
    (Llama 4's ungated ``shared_expert`` too, renamed on loading)."""

    def __init__(
        self,
        hidden_size: int,
        spec: ExpertsSpec,
        act_name: str,
        dtype: torch.dtype,
        parallel: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.parallel = parallel
        self.gate = Linear(hidden_size, spec.num_experts, spec.router_bias, dtype)
        self.gate.quantizable = False  # routing is sensitive, and the router is small
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, spec.intermediate_size, False, act_name, dtype, parallel, False)
            if spec.swiglu_limit is None or spec.swiglu_alpha is None
            else ClampedSwiGLUMLP(
                hidden_size,
                spec.intermediate_size,
                spec.swiglu_alpha,
                spec.swiglu_limit,
                dtype,
                parallel,
            )
            for _ in range(spec.num_experts)
        )
        if spec.grouped is not None:
            # DeepSeek's and GLM-4.5's routers score in float32 over a float32 weight;
            # MiniMax-M2's router and bias are in the model's dtype.
            router_dtype = torch.float32 if spec.grouped.router_in_float32 else dtype
            self.gate = Linear(hidden_size, spec.num_experts, False, router_dtype)
            self.gate.quantizable = False
            if spec.grouped.correction_bias:
                self.gate.e_score_correction_bias = nn.Parameter(
                    torch.zeros(spec.num_experts, dtype=router_dtype), requires_grad=False
                )
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        self.shared_experts: GatedMLP | None = None
        if spec.shared_intermediate_size:
            shared = GatedMLP(
                hidden_size,
                spec.shared_intermediate_size,
                spec.shared_expert_bias,
                act_name,
                dtype,
                parallel,
                False,
            )
            if spec.shared_expert_gated:
                self.shared_expert = shared
                self.shared_expert_gate = Linear(hidden_size, 1, False, dtype)
                self.shared_expert_gate.quantizable = False
            else:
                self.shared_experts = shared

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens, hidden] -> (each token's top-k experts int64 [num_tokens, top_k],
        their weights [num_tokens, top_k]: float32 or the model's dtype, per ``spec``)."""
        if self.spec.grouped is not None:
            return self._route_in_groups(hidden)
        logits = self.gate(hidden)
        if self.spec.sigmoid_scales_input:  # Llama 4: the top k logits' sigmoids
            top_logits, experts = torch.topk(logits, self.spec.top_k, dim=-1)
            return experts, torch.sigmoid(top_logits.float()).to(hidden.dtype)
        if self.spec.softmax_over_top_k:  # Granite MoE, gpt-oss: the top k logits' softmax
            top_logits, experts = torch.topk(logits.float(), self.spec.top_k, dim=-1)
            return experts, torch.softmax(top_logits, dim=-1).to(hidden.dtype)
        probabilities = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probabilities, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if not self.spec.weights_in_float32:
            weights = weights.to(hidden.dtype)
        return experts, weights

    def _route_in_groups(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``GroupedRouting``, HF's arithmetic: float32 weights, each token's experts chosen
        within its best groups."""
        grouped = self.spec.grouped
        assert grouped is not None
        if grouped.router_in_float32:
            logits = self.gate(hidden.float())
        else:
            logits = self.gate(hidden).float()
        num_groups = grouped.num_groups
        if grouped.sigmoid:
            scores = logits.sigmoid()
        else:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        choice = scores
        if grouped.correction_bias:
            choice = scores + self.gate.e_score_correction_bias.float()
        grouped_choice = choice.view(-1, num_groups, self.spec.num_experts // num_groups)
        if grouped.sigmoid:
            group_scores = grouped_choice.topk(2, dim=-1)[0].sum(dim=-1)
            masked = float("-inf")
        else:
            group_scores = grouped_choice.max(dim=-1).values
            masked = 0.0
        if grouped.top_k_groups < num_groups:
            best_groups = torch.topk(group_scores, k=grouped.top_k_groups, dim=-1)[1]
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, best_groups, True)
            choice = choice.masked_fill(
                ~kept.repeat_interleave(grouped_choice.shape[-1], 1), masked
            )
        experts = torch.topk(choice, k=self.spec.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.spec.renormalize:
            # DeepSeek adds 1e-20 to the sum, ERNIE clamps it at 1e-12: top-k probabilities
            # sum to far more, so both divide by the sum itself.
            weights /= weights.sum(dim=-1, keepdim=True) + 1e-20
        weights = weights * grouped.routed_scaling_factor
        if not self.spec.weights_in_float32:  # ERNIE rounds them to the model's dtype
            weights = weights.to(hidden.dtype)
        return experts, weights

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(hidden)
        # Each token's experts in ascending order: the order HF adds their outputs in.
        experts, permutation = experts.sort(dim=-1)
        weights = weights.gather(-1, permutation)
        pair_experts = experts.flatten()  # pair p: token p // top_k
        # Pairs grouped by expert; stable, so each expert's tokens stay in order.
        order = torch.argsort(pair_experts, stable=True)
        # One gather of every pair's row: each expert then reads a slice of it, a view.
        pair_hidden = hidden[order // self.spec.top_k]
        scales_input = self.spec.sigmoid_scales_input
        if scales_input:  # Llama 4 weighs what goes into each expert, in the model's dtype
            pair_hidden = pair_hidden * weights.flatten()[order][:, None]
        # One host read per layer: the loop needs each expert's row count.
        counts = torch.bincount(pair_experts, minlength=self.spec.num_experts).tolist()
        expert_outputs = []
        start = 0
        for expert, count in zip(self.experts, counts, strict=True):
            if count:
                expert_outputs.append(expert(pair_hidden[start : start + count]))
                start += count
        by_expert = torch.cat(expert_outputs) if expert_outputs else pair_hidden
        # Back to token order, [num_tokens, top_k, hidden], each weighted as HF weighs it.
        pairs = torch.empty_like(by_expert)
        pairs[order] = by_expert
        pairs = pairs.view(-1, self.spec.top_k, hidden.shape[-1])
        if not scales_input:
            pairs = (pairs * weights[..., None]).to(hidden.dtype)
        # Added one expert at a time, rounding after each add in the model's dtype, as HF's
        # per-expert index_add_ does (one add of all k would round once in bfloat16).
        output = pairs[:, 0].clone()
        for rank in range(1, self.spec.top_k):
            output += pairs[:, rank]
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # sigmoid(g) scales each rank's partial sum alike, so one sum over ranks holds.
            gate = torch.sigmoid(self.shared_expert_gate(hidden))
            output += gate * self.shared_expert(hidden)
        if self.shared_experts is not None:
            output += self.shared_experts(hidden)
        return self.parallel.all_reduce(output)
