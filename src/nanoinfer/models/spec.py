"""ModelSpec: what the engine, memory planning, plan-memory and the roofline read of a model: the attention shape of
every layer and the parameter counts, read off the family's model itself (registry.model_spec builds it on the meta
device, CausalLM.describe reads it). No torch here: memory.py and roofline.py take it as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AttentionLayerSpec:
    """One layer's attention as the KV cache and the roofline see it (all ranks together)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None  # a query sees this many positions, its own included (None: the whole context)
    # The earlier layer whose cache this one reads (Gemma 4's KV sharing): it stores nothing and owns no cache.
    kv_shared_from: int | None = None

    def kv_elements_per_token(self, tensor_parallel_size: int = 1) -> int:
        """K and V elements one token takes in this layer's cache on one rank (0 when it reads another's)."""
        if self.kv_shared_from is not None:
            return 0
        return 2 * (self.num_kv_heads // tensor_parallel_size) * self.head_dim


@dataclass(frozen=True)
class LinearAttentionLayerSpec:
    """One Gated DeltaNet layer as the state cache and the roofline see it (all ranks together): a sequence's state is
    its convolution's last kernel_size - 1 inputs over q, k and v, and a k_head_dim x v_head_dim float32 matrix a
    value head."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel_size: int

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim

    def state_bytes(self, tensor_parallel_size: int, conv_dtype_bytes: int) -> int:
        """One sequence's state in this layer on one rank: the convolution's inputs in the model's dtype and the delta
        rule's matrices in float32."""
        tp = tensor_parallel_size
        conv = self.conv_channels // tp * (self.conv_kernel_size - 1) * conv_dtype_bytes
        return conv + self.num_v_heads // tp * self.k_head_dim * self.v_head_dim * 4


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # the registry's name for the family class, e.g. "Gemma2ForCausalLM"
    hidden_size: int
    vocab_size: int
    layers: tuple[AttentionLayerSpec, ...]  # the layers with attention (all but a hybrid model's linear ones)
    intermediate_size: int  # the widest MLP's (activation estimates)
    embedding_params: int  # the input embedding table(s)
    layer_params: int  # every decoder layer together: projections, biases, norms
    matmul_params: int  # of those, the weights of the matrix multiplies (2 FLOPs each per token)
    final_norm_params: int
    lm_head_params: int  # 0 when tied to the embedding (no memory of its own)
    supports_tensor_parallel: bool = True  # False: the family runs on one rank only
    # Mixture of experts: the layers with experts, one expert's gate, up and down matrices (in one layer), how many
    # experts a layer has and how many a token runs. Experts are part of layer_params, not of matmul_params: a step
    # reads only the experts its tokens were routed to.
    num_moe_layers: int = 0
    params_per_expert: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0  # each expert's width, split over tensor-parallel ranks
    # A hybrid model's linear-attention layers (Qwen3-Next, Qwen3.5): a fixed-size state per sequence, not a KV cache
    linear_attention_layers: tuple[LinearAttentionLayerSpec, ...] = ()
    # What a LoRA adapter may target: module name as in the HF checkpoint (each of q/k/v/o, gate/up/down, and a fused
    # qkv_proj / gate_up_proj whole) -> (in, out) features (lora/layers.py)
    lora_shapes: dict[str, tuple[int, int]] = field(default_factory=dict, compare=False)
    # Every slice an adapter slot holds (a projection, or q/k/v, gate/up of a fused layer): (in, out, row-parallel)
    lora_slices: tuple[tuple[int, int, bool], ...] = ()

    def lora_slot_bytes(self, max_lora_rank: int, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """One adapter slot's A and B in every adapted layer, on one rank (lora/layers.py): max_lora_rank rows of A
        and of B a slice, A sharded by input columns where the layer is row-parallel (o_proj, down_proj), B by
        output rows elsewhere."""
        tp = tensor_parallel_size
        elements = sum(max_lora_rank * (fan_in // tp + fan_out if row_parallel else fan_in + fan_out // tp)
                       for fan_in, fan_out, row_parallel in self.lora_slices)  # fmt: skip
        return elements * dtype_bytes

    @property
    def num_layers(self) -> int:
        return len(self.layers) + len(self.linear_attention_layers)

    @property
    def is_hybrid(self) -> bool:
        """Has linear-attention layers: each running sequence needs a state slot beside its KV blocks."""
        return bool(self.linear_attention_layers)

    def state_bytes_per_sequence(self, tensor_parallel_size: int, conv_dtype_bytes: int) -> int:
        """One state slot on one rank: every linear-attention layer's state of one sequence (0 without any)."""
        return sum(layer.state_bytes(tensor_parallel_size, conv_dtype_bytes) for layer in self.linear_attention_layers)

    @property
    def expert_params(self) -> int:
        """Every expert's matrices, every MoE layer."""
        return self.num_moe_layers * self.num_experts * self.params_per_expert

    @property
    def total_params(self) -> int:
        return self.embedding_params + self.layer_params + self.final_norm_params + self.lm_head_params

    def kv_elements_per_token(self, tensor_parallel_size: int = 1) -> int:
        """K and V elements one token takes in one rank's cache, every layer that owns one (not those reading an
        earlier layer's); each rank holds its share of the KV heads (check_tensor_parallel)."""
        return sum(layer.kv_elements_per_token(tensor_parallel_size) for layer in self.layers)

    def check_tensor_parallel(self, tensor_parallel_size: int) -> bool:
        """Query and KV heads must split evenly over ranks in every layer, as the engine shards them (it does not
        replicate KV heads), so must each expert's width and each linear-attention layer's key and value heads, and
        the family must shard at all."""
        tp = tensor_parallel_size
        if tp > 1 and not self.supports_tensor_parallel:
            return False
        return tp >= 1 and self.expert_intermediate_size % tp == 0 and all(
            layer.num_heads % tp == 0 and layer.num_kv_heads % tp == 0 for layer in self.layers
        ) and all(layer.num_k_heads % tp == 0 and layer.num_v_heads % tp == 0 for layer in self.linear_attention_layers)
