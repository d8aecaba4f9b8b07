"""Linear layers that know their tensor-parallel shard.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` that copies its rank's slice of
a checkpoint tensor, so the loader never needs to know how a layer is split. How they multiply is the
platform's linear method (platforms/): plain F.linear, or a GEMM over weights it packed once after loading.
A layer a LoRA adapter may target gets `lora` (lora/layers.LoRALayerWeights) when the engine enables LoRA: each
row's adapter delta is then added to the base output.
"""

from __future__ import annotations

import torch
from torch import nn

from nanoinfer.distributed import all_reduce, get_tp_rank, get_tp_size
from nanoinfer.platforms import current_platform


def _set_loader(param: nn.Parameter, loader) -> nn.Parameter:
    param.weight_loader = loader
    return param


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split by rows (output features) across ranks; no communication."""

    uses_linear_method = True  # the platform's linear method multiplies (and may pack) this layer's weight
    lora = None  # its LoRA slots (lora/layers.py) when the engine runs adapters

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_sizes = [size // self.tp_size for size in output_sizes]  # per-rank size of each shard
        out = sum(self.output_sizes)
        self.weight = _set_loader(nn.Parameter(torch.empty(out, input_size)), self.weight_loader)
        self.bias = _set_loader(nn.Parameter(torch.empty(out)), self.weight_loader) if bias else None
        self.platform = current_platform()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        rank_slice = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, offset, size).copy_(rank_slice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.platform.linear(self, x, self.bias)
        if self.lora is not None:
            self.lora.apply(x, y)
        return y


class GateUpParallelLinear(ColumnParallelLinear):
    """The MLP's fused gate/up projection (shard ids 0 and 1), with the gated activation that follows it: call
    `act_and_mul(x)`. A linear method may fuse SiLU-and-mul into its GEMM, so that the [rows, 2 x intermediate]
    projection is never written out and read back (the CPU one does: platforms/cpu/linear.py).

    hidden_act: transformers' name of the gate's activation: "silu" (Llama, Qwen, Phi-3, OLMo) or
    "gelu_pytorch_tanh" (Gemma's GeGLU)."""

    def __init__(self, input_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__(input_size, [intermediate_size, intermediate_size], bias=False)
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {hidden_act!r}")
        self.activation = GATED_ACTIVATIONS[hidden_act]
        # what a linear method may fuse into this layer's GEMM
        self.fused_activation = "silu_and_mul" if self.activation == "silu" else None

    def act_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """act(x Wg^T) * (x Wu^T), [..., intermediate / tp]."""
        if self.lora is not None:  # the adapters' deltas join gate and up before the activation
            return self._activate(self(x))
        if self.activation == "silu":
            return self.platform.silu_and_mul_linear(self, x)
        return self._activate(self.platform.linear(self, x, None))

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return self.platform.silu_and_mul(gate_up)
        return self.platform.gelu_tanh_and_mul(gate_up)


# transformers' activation names -> the gated activation nanoinfer runs for them
GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; shard ids "q", "k", "v". KV heads are split across ranks like query heads.

    shards: the projections it holds, in this order. Gemma 4 has layers without some: ("q", "k") where values
    equal keys, ("q",) where a layer reads an earlier layer's keys and values; their parameters carry `shard_ids`
    so the loader expects those alone."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 shards: tuple[str, ...] = ("q", "k", "v")):  # fmt: skip
        sizes = {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim}
        super().__init__(hidden_size, [sizes[s] for s in shards], bias)
        self.shards = shards
        if shards != ("q", "k", "v"):
            for param in (self.weight, self.bias):
                if param is not None:
                    param.shard_ids = shards

    def weight_loader(self, param, loaded, shard_id="q"):
        super().weight_loader(param, loaded, self.shards.index(shard_id))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split by columns (input features); partial sums are all-reduced."""

    uses_linear_method = True
    lora = None  # as ColumnParallelLinear's

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size // self.tp_size
        self.weight = _set_loader(nn.Parameter(torch.empty(output_size, self.input_size)), self.weight_loader)
        self.bias = _set_loader(nn.Parameter(torch.empty(output_size)), self._bias_loader) if bias else None
        self.platform = current_platform()

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.input_size, self.input_size))

    def _bias_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.platform.linear(self, x, None)
        if self.lora is not None:  # this rank's share of x A^T, times B: summed over ranks with the base output
            self.lora.apply(x, y)
        if self.tp_size > 1:
            all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
