"""Mixture-of-experts layers: the router (which experts each token uses, with what weights) and the experts, whose
projections run through the platform's expert method as grouped GEMMs over every expert at once.

    SparseMoeBlock   gate (TopKRouter) -> experts (FusedMoE)                   Qwen3-MoE, Mixtral, gpt-oss
    SharedExpertMoeBlock  the same plus a shared expert every token runs      Qwen3-Next, Qwen3.5-MoE
    FusedMoE         w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I], optional biases

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension (I / tp): the gate/up
rows and the down columns of its shard, like a dense MLP's; the weighted sum over experts is all-reduced once.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.distributed import all_reduce, get_tp_rank, get_tp_size
from nanoinfer.models.layers.linear import GATED_ACTIVATIONS
from nanoinfer.platforms import current_platform

# The experts' gated activations: GATED_ACTIVATIONS' two, and gpt-oss's clamped SwiGLU (vLLM's name)
EXPERT_ACTIVATIONS = ("silu", "gelu_tanh", "swigluoai")


class TopKRouter(nn.Module):
    """The router's logits, x R^T (+ b), by F.linear on the weight as loaded: it is small beside the experts, and
    the same call as transformers' gives the same logits, so experts whose scores tie are chosen as it chooses.

    scoring: "softmax" (Qwen3-MoE, Mixtral, Gemma 4: softmax over all experts in float32, then the top k, renormalized
    when `renormalize`) or "topk_softmax" (gpt-oss: the top k logits, then a softmax over those k)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, scoring: str = "softmax",
                 renormalize: bool = True, bias: bool = False):  # fmt: skip
        super().__init__()
        if scoring not in ("softmax", "topk_softmax"):
            raise ValueError(f"unsupported router scoring {scoring!r}")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.top_k, self.scoring, self.renormalize = top_k, scoring, renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] float32, topk_ids [T, k] int64) of each token, best expert first."""
        return select_experts(F.linear(x, self.weight, self.bias), self.top_k, self.scoring, self.renormalize)


def select_experts(router_logits: torch.Tensor, top_k: int, scoring: str = "softmax",
                   renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each token's top_k experts and their weights, computed as transformers does (torch.topk's order, ties
    included), weights rounded to the logits' dtype where transformers rounds them, returned as float32."""
    if scoring == "topk_softmax":
        values, ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1).float(), ids
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype).float(), ids


class FusedMoE(nn.Module):
    """The experts of one MoE layer, multiplied by the platform's expert method (`Platform.fused_moe`): route,
    sort token-expert pairs by expert, a grouped GEMM per projection, the weighted sum back into each token.

    activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU) or "swigluoai" (gpt-oss: gate clamped above at
    `swiglu_limit`, up clamped to +-limit, (up + 1) * gate * sigmoid(alpha * gate)).
    Weights load per expert (shard ids (e, "w1" | "w3" | "w2"): gate, up, down) or all experts at once from
    transformers' fused tensors (shard ids "w13", "w2": [E, 2I, H] gate rows then up rows, and [E, H, I])."""

    uses_expert_method = True  # the platform's expert method multiplies (and may pack) these weights

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0):  # fmt: skip
        super().__init__()
        activation = GATED_ACTIVATIONS.get(activation, activation)
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"unsupported expert activation {activation!r}")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size // self.tp_size  # this rank's share of each expert
        size = self.intermediate_size
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        self.w13_weight = self._param(num_experts, 2 * size, hidden_size, kinds=("w1", "w3"))
        self.w2_weight = self._param(num_experts, hidden_size, size, kinds=("w2",))
        self.w13_bias = self._param(num_experts, 2 * size, kinds=("w1", "w3")) if bias else None
        self.w2_bias = self._param(num_experts, hidden_size, kinds=("w2",)) if bias else None
        self.platform = current_platform()

    def _param(self, *shape: int, kinds: tuple[str, ...]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape))
        param.weight_loader = self.weight_loader
        param.shard_ids = [(e, kind) for e in range(self.num_experts) for kind in kinds]  # the loader's checklist
        return param

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """One expert's gate / up / down tensor (shard id (e, kind)), or every expert's (kind "w13" or "w2");
        this rank's slice of the intermediate dimension of each. Down biases are added once, after the ranks'
        sum: rank 0 holds them, the others zeros."""
        size, start = self.intermediate_size, self.tp_rank * self.intermediate_size
        if shard_id in ("w13", "w2"):  # every expert at once: [E, ...] in the per-expert layouts
            for e in range(self.num_experts):
                if shard_id == "w13":
                    whole = loaded.shape[1] // 2
                    self.weight_loader(param, loaded[e, :whole], (e, "w1"))
                    self.weight_loader(param, loaded[e, whole:], (e, "w3"))
                else:
                    self.weight_loader(param, loaded[e], (e, "w2"))
            return
        expert, kind = shard_id
        if kind == "w2":
            if param is self.w2_bias:
                param.data[expert].copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            else:
                param.data[expert].copy_(loaded.narrow(1, start, size))
            return
        offset = 0 if kind == "w1" else size
        param.data[expert].narrow(0, offset, size).copy_(loaded.narrow(0, start, size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = self.platform.fused_moe(self, x, topk_weights, topk_ids)
        if self.tp_size > 1:
            all_reduce(out)
        return out


class SparseMoeBlock(nn.Module):
    """The router and the experts: each token's output is the weighted sum of its top-k experts' outputs."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE):
        super().__init__()
        self.gate = gate
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        return self.experts(x, topk_weights, topk_ids)


class SharedExpertMoeBlock(SparseMoeBlock):
    """SparseMoeBlock plus a dense expert every token runs, scaled by sigmoid(x g^T) with g one row of weights
    (`shared_expert_gate`, replicated on every rank)."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE, shared_expert: nn.Module, hidden_size: int):
        super().__init__(gate, experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


# Checkpoint names of expert weights -> (FusedMoE parameter, shard id): one expert's projection (HF's per-expert
# modules: gate_proj / up_proj / down_proj, Mixtral's w1 / w3 / w2), or transformers' fused tensors of all experts
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|bias)$")
_FUSED = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
_KINDS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def expert_target(name: str) -> tuple[str, object] | None:
    """(parameter name, shard id) for a checkpoint tensor of an expert, or None for any other name."""
    match = _PER_EXPERT.match(name)
    if match:
        prefix, expert, proj, what = match.groups()
        kind = _KINDS[proj]
        return f"{prefix}.{'w2' if kind == 'w2' else 'w13'}_{what}", (int(expert), kind)
    match = _FUSED.match(name)
    if match:
        prefix, proj, bias = match.groups()
        kind = "w13" if proj == "gate_up_proj" else "w2"
        return f"{prefix}.{kind}_{'bias' if bias else 'weight'}", kind
    return None
