"""The platform interface, with plain torch behind every method: the reference each fast op is tested against
and what runs where no kernel does (any device, the C++ extension disabled or not built).

A platform answers, once per engine, every device question the model, attention and engine would otherwise
ask on each call: which small ops, how linears multiply, which attention backend, how the KV cache is held,
whether a fused decode runner applies, how a process is set up and how the KV cache is sized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.attention import gated_delta


class Platform:
    name = "torch"
    # The MLP runs at most this many bytes of [rows, 2 x intermediate] activations at a time (None: no limit).
    # Rows are independent, so the result is the same.
    mlp_chunk_bytes: int | None = None
    # Does the linear method read a GGUF's Q4_0 / Q4_1 blocks as they are (the loader then keeps them on the layer)?
    reads_q4_blocks = False

    def describe(self) -> dict:
        """Facts about the machine and the kernels in use, for benchmark records."""
        import platform

        return {"cpu": platform.processor() or platform.machine(), "platform_kind": self.name}

    # Process and engine set-up

    def setup_process(self, config, num_threads: int | None = None) -> None:
        """Once per process, before the model loads (threads, allocator)."""

    def build_runner(self, config, block_bytes: int, make_runner, state_slot_bytes: int = 0):
        """(runner, KV-cache plan): size the cache for this device (KV blocks of block_bytes, and a hybrid model's
        state slots of state_slot_bytes) and build `make_runner(config, num_blocks, num_state_slots)`."""
        raise NotImplementedError

    def prepare_model(self, model: nn.Module) -> int:
        """After the weights load: put linear weights in the platform's own layouts (returns how many), compile
        small-op kernels; called once per model."""
        return 0

    # Small ops

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """norm(x), or with a residual (norm(x + residual), x + residual): the fused pre-norm step. Numerics as in
        transformers (normalised in float32, rounded, then scaled). A platform's version may reuse x and
        residual's memory: the decoder layer owns both and reads neither afterwards."""
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * h.to(dtype)
        return out if residual is None else (out, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """GeGLU: gelu(gate, tanh approximation) * up, as transformers' gelu_pytorch_tanh."""
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary_embedding(self, positions, q, k, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, H, D], k [T, H_kv, D] -> rotated (a platform's version may rotate them in place)."""
        cos = cos[positions].unsqueeze(1).to(q.dtype)
        sin = sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, dim=-1) (the first index on a tie)."""
        return torch.argmax(logits, dim=-1)

    # Linear method: how a linear layer (or the LM head) multiplies, given what prepare_model left on it

    def linear(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def silu_and_mul_linear(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """silu(x Wg^T) * (x Wu^T) for the MLP's fused gate/up layer."""
        return self.silu_and_mul(self.linear(layer, x, None))

    # LoRA method: the batched low-rank deltas of many adapters in one step (lora/layers.py holds the weights)

    def add_lora(self, y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 row_slots: torch.Tensor, slice_offsets: tuple[int, ...]) -> None:  # fmt: skip
        """y += each row's own adapter's delta, in place: row t with slot l = row_slots[t] >= 0 gets
        h = x[t] lora_a[l]^T ([S * R]: slice s's rank rows at s * R ...) and, for each output column c of slice s
        (slice_offsets[s] <= c < slice_offsets[s + 1]), y[t, c] += h[s * R : (s + 1) * R] . lora_b[l, :, c]; rows with
        slot -1 are left alone. x [T, K], y [T, N], lora_a [L, S * R, K], lora_b [L, R, N] (B transposed, the
        adapter's scaling folded in), row_slots [T] int32. Sums in float32, h rounded to x's dtype (PEFT's lora_A
        output), y rounded once. The reference: each slot's rows gathered, two matmuls, added back."""
        rank = lora_b.shape[1]
        for slot in torch.unique(row_slots).tolist():
            if slot < 0:
                continue
            rows = (row_slots == slot).nonzero().flatten()
            h = (x[rows].float() @ lora_a[slot].float().T).to(x.dtype).float()
            delta = torch.zeros(len(rows), y.shape[1], dtype=torch.float32, device=y.device)
            for s in range(len(slice_offsets) - 1):
                lo, hi = slice_offsets[s], slice_offsets[s + 1]
                delta[:, lo:hi] = h[:, s * rank : (s + 1) * rank] @ lora_b[slot, :, lo:hi].float()
            y[rows] = (y[rows].float() + delta).to(y.dtype)

    # Expert method: how an MoE layer's experts (models/layers/moe.FusedMoE) multiply

    def fused_moe(self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for every token t: [T, H] (this rank's part).
        The reference: token-expert pairs sorted by expert, each expert's rows through F.linear, as transformers
        runs them (a loop over the experts hit; the kernel platforms run grouped GEMMs)."""
        out = torch.zeros_like(x)
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # pairs by expert, in token order within one
        counts = torch.bincount(flat_ids, minlength=layer.num_experts).tolist()
        tokens = order // topk_ids.shape[1]
        weights = topk_weights.flatten()[order].to(x.dtype).unsqueeze(1)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start : start + count]
            bias13 = None if layer.w13_bias is None else layer.w13_bias[expert]
            bias2 = None if layer.w2_bias is None else layer.w2_bias[expert]
            hidden = expert_activation(layer, F.linear(x[rows], layer.w13_weight[expert], bias13))
            y = F.linear(hidden, layer.w2_weight[expert], bias2) * weights[start : start + count]
            out.index_add_(0, rows, y)
            start += count
        return out

    # Linear attention (Gated DeltaNet layers): each sequence continues from its slot of the state cache
    # (attention/gated_delta.py: the layout, and these reference versions)

    def causal_conv1d(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      metadata) -> torch.Tensor:  # fmt: skip
        """silu of the causal depthwise convolution of each sequence's rows x [T, C] with weight [C, K]."""
        return gated_delta.causal_conv1d(x, weight, conv_state, metadata)

    def gated_delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, ssm_state: torch.Tensor, metadata) -> torch.Tensor:  # fmt: skip
        """The gated delta rule's output [T, H_v, D_v] for each sequence's rows (q and k normalised inside)."""
        return gated_delta.gated_delta_rule(q, k, v, g, beta, ssm_state, metadata)

    def allocate_state_cache(self, shapes: list[tuple[tuple[int, ...], tuple[int, ...]]], conv_dtype: torch.dtype,
                             device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """One (conv_state, ssm_state) pair a linear-attention layer, of the shapes given (the model's dtype and
        float32). Never read before written: a sequence without context starts from zeros, not from its slot."""
        return [(torch.zeros(conv, dtype=conv_dtype, device=device), torch.zeros(ssm, dtype=torch.float32,
                                                                                  device=device))
                for conv, ssm in shapes]  # fmt: skip

    def has_greedy_lm_head(self, lm_head: nn.Module) -> bool:
        """Does greedy_token_ids skip writing the logits (a kernel takes the argmax from the GEMM)?"""
        return False

    def greedy_token_ids(self, lm_head: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Each row's argmax token without the logits, or None: the caller computes the logits."""
        return None

    # Attention and the KV cache

    def attention_backend(self, name: str):
        """The backend for a name attention.backend.select_backend returned."""
        from nanoinfer.attention.torch_backend import TorchBackend

        return TorchBackend()

    def allocate_kv_cache(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device) -> KVCache:
        """One (key, value) pair a layer, of that layer's shape [num_blocks, block_size, H_kv, D]."""
        return KVCache([(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype,
                                                                                     device=device))
                        for shape in shapes])  # fmt: skip

    def decode_runner(self, model: nn.Module, kv_caches, backend):
        """An object whose run(input_ids, positions, metadata) does a pure-decode step's forward pass faster
        than the model's own, or None."""
        return None

    def uses_cuda_graphs(self, config, backend_name: str) -> bool:
        return False


class KVCache:
    """The paged KV cache: one (key, value) pair a layer, each [num_blocks, block_size, H_kv, D] (H_kv and D may
differ between layers, e.g. Gemma 4's global layers). Every backend
    reads only slots it wrote first."""

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        self.layers = layers

    def before_step(self, slot_mapping: torch.Tensor) -> None:
        """Called with each step's slot mapping before the model writes into the cache."""

    def copy_rows(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first `rows` rows of block `source` into block `destination`, in every layer: a prefix shared
        inside a block (after before_step, which may zero a destination it commits)."""
        for source, destination, rows in copies:
            for k_cache, v_cache in self.layers:
                k_cache[destination, :rows] = k_cache[source, :rows]
                v_cache[destination, :rows] = v_cache[source, :rows]


def expert_activation(layer: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """An expert's gated activation of its [rows, 2I] gate/up projection (gate columns first), as transformers'."""
    gate, up = gate_up.chunk(2, dim=-1)
    if layer.activation == "silu":
        return F.silu(gate) * up
    if layer.activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    limit = layer.swiglu_limit  # swigluoai
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * layer.swiglu_alpha))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
