"""The roofline: what each engine step must move and compute, set against the device's ceilings.

Counts a step's bytes (weights read once, KV cache read and written, a hybrid model's recurrent state read and
written, logits written) and FLOPs (the matrix multiplies, attention and the delta rule) from the model's shape
and the step's StepStats; the ceilings (memory bandwidth, dense matrix rate) come from memory.GPU_TABLE, from
flags, or on CPU from a short probe. A step's floor is the longer of bytes / bandwidth and FLOPs / peak.
`nanoinfer bench` sums steps by class; nothing here runs the model.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

from nanoinfer import memory
from nanoinfer.errors import NanoInferError
from nanoinfer.models.spec import ModelSpec

PROBE_BYTES = 256 * memory.MiB  # larger than any last-level cache we run on, small enough to read in ~30 ms
PROBE_MATMUL = 1024  # n of the n x n x n product of the FMA probe: ~2.1 GFLOP


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs of a model, summed over tensor-parallel ranks.

    weights_bytes: every parameter a step reads once: the decoder layers, the final norm and the LM head
    (the embedding table only as the LM head, when tied: a step looks up just its own rows, left out).
    """

    attention_width: int  # query heads x head size, summed over layers: 4 FLOPs each per (query, key) pair
    vocab_size: int
    hidden_size: int
    matmul_params: int  # weights of the decoder layers' matrix multiplies (all layers); 2 FLOPs each per token
    weights_bytes: int
    kv_bytes_per_token: int  # K and V of every layer (and every rank)
    logits_bytes_per_row: int  # vocab_size values in the model's dtype
    # Mixture of experts: weights_bytes leaves the experts out; a step reads the experts its tokens chose
    # (expected_experts_read), each of bytes_per_expert, and multiplies by experts_per_token of them a token.
    num_moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    bytes_per_expert: int = 0  # one expert of one layer, as stored
    params_per_expert: int = 0
    # A hybrid model's linear-attention layers: one sequence's state (every such layer and rank), read and written
    # once a step it runs in; the delta rule's FLOPs a token (three matrix-vector products with each value head's
    # k_head_dim x v_head_dim state: S^T k, the rank-one update, S^T q).
    state_bytes_per_sequence: int = 0
    delta_rule_flops_per_token: int = 0

    def expected_experts_read(self, num_tokens: int) -> float:
        """Distinct experts a step of num_tokens reads, summed over MoE layers, with tokens routed uniformly and
        independently: E (1 - (1 - k / E)^T) a layer. (nanoinfer bench also reports the count it measured.)"""
        if not self.num_moe_layers or not num_tokens:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return self.num_moe_layers * e * (1 - (1 - k / e) ** num_tokens)

    @classmethod
    def from_spec(cls, spec: ModelSpec, dtype: str, kv_cache_dtype: str, tensor_parallel_size: int = 1,
                  weights_bytes: int | None = None, expert_bytes: int | None = None) -> ModelShape:  # fmt: skip
        """The shape of a model from its ModelSpec; weights_bytes and expert_bytes (e.g. measured: the weights but
        the experts, and every expert) replace the counts in dtype.

        A sliding-window layer is counted as if it read the whole context: exact while contexts fit in the window
        (bench's do), an overestimate of the floor's bytes beyond it."""
        if weights_bytes is None:
            read = spec.layer_params - spec.expert_params + spec.final_norm_params + spec.vocab_size * spec.hidden_size
            weights_bytes = read * memory.dtype_bytes(dtype)
        if expert_bytes is None:
            expert_bytes = spec.expert_params * memory.dtype_bytes(dtype)
        experts = max(1, spec.num_moe_layers * spec.num_experts)
        kv_bytes = tensor_parallel_size * memory.kv_block_bytes(spec, 1, tensor_parallel_size, kv_cache_dtype)
        return cls(
            attention_width=sum(layer.num_heads * layer.head_dim for layer in spec.layers),
            vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, matmul_params=spec.matmul_params,
            weights_bytes=weights_bytes, kv_bytes_per_token=kv_bytes,
            logits_bytes_per_row=spec.vocab_size * memory.dtype_bytes(dtype),
            num_moe_layers=spec.num_moe_layers, num_experts=spec.num_experts,
            experts_per_token=spec.experts_per_token, bytes_per_expert=expert_bytes // experts,
            params_per_expert=spec.params_per_expert,
            state_bytes_per_sequence=spec.state_bytes_per_sequence(1, memory.dtype_bytes(dtype)),
            delta_rule_flops_per_token=sum(6 * layer.num_v_heads * layer.k_head_dim * layer.v_head_dim
                                           for layer in spec.linear_attention_layers),
        )  # fmt: skip


@dataclass
class StepCost:
    """Bytes and FLOPs one step (or a sum of steps) must move and do."""

    weights_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    logits_bytes: int = 0
    flops: int = 0
    state_read_bytes: int = 0  # a hybrid model's recurrent state (linear-attention layers)
    state_write_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.kv_read_bytes + self.kv_write_bytes + self.logits_bytes
                + self.state_read_bytes + self.state_write_bytes)  # fmt: skip

    def add(self, other: StepCost) -> None:
        self.weights_bytes += other.weights_bytes
        self.kv_read_bytes += other.kv_read_bytes
        self.kv_write_bytes += other.kv_write_bytes
        self.logits_bytes += other.logits_bytes
        self.flops += other.flops
        self.state_read_bytes += other.state_read_bytes
        self.state_write_bytes += other.state_write_bytes


def step_cost(shape: ModelShape, num_tokens: int, num_context_tokens: int, num_attention_pairs: int,
              num_logits_rows: int, num_seqs: int = 0, num_seqs_with_context: int = 0) -> StepCost:  # fmt: skip
    """The floor's bytes and FLOPs of one step.

    Bytes: the weights once; each sequence's context read from the KV cache once (attention reads the
    whole context, this step's tokens included, after storing them); this step's tokens' K and V written; one
    row of logits per sampled row; a hybrid model's state written once for each of the step's num_seqs sequences
    and read once for those continuing from it (num_seqs_with_context: a new one starts from zeros). FLOPs: 2 per
    matmul weight per token (decoder layers), 2 per LM-head weight per sampled row, attention's 4 x head_dim per
    query head, layer and (query, key) pair (QK^T and PV), and the delta rule's per token.
    Activations between kernels, norms and the embedding lookup are left out: a floor, not a model of our
    kernels."""
    kv = shape.kv_bytes_per_token
    experts = shape.expected_experts_read(num_tokens)
    expert_flops = 2 * shape.params_per_expert * shape.experts_per_token * shape.num_moe_layers * num_tokens
    return StepCost(
        weights_bytes=(shape.weights_bytes + round(experts * shape.bytes_per_expert)) if num_tokens else 0,
        kv_read_bytes=num_context_tokens * kv,
        kv_write_bytes=num_tokens * kv,
        logits_bytes=num_logits_rows * shape.logits_bytes_per_row,
        flops=2 * shape.matmul_params * num_tokens + 2 * shape.vocab_size * shape.hidden_size * num_logits_rows
        + 4 * shape.attention_width * num_attention_pairs + expert_flops
        + shape.delta_rule_flops_per_token * num_tokens,
        state_read_bytes=num_seqs_with_context * shape.state_bytes_per_sequence,
        state_write_bytes=num_seqs * shape.state_bytes_per_sequence,
    )


def stats_cost(shape: ModelShape, stats) -> StepCost:
    """step_cost of an engine StepStats."""
    return step_cost(shape, stats.num_prefill_tokens + stats.num_decode_tokens, stats.num_context_tokens,
                     stats.num_attention_pairs, stats.num_logits_rows, stats.num_seqs,
                     stats.num_seqs_with_context)  # fmt: skip


# ---- ceilings -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ceilings:
    """The device's memory bandwidth (bytes/s) and dense matrix rate (FLOP/s), and where each came from."""

    device: str
    bandwidth: float
    flops: float
    bandwidth_source: str
    flops_source: str

    def floor_seconds(self, cost: StepCost) -> tuple[float, float]:
        """(memory floor, compute floor) of a cost, in seconds."""
        return cost.total_bytes / self.bandwidth, cost.flops / self.flops

    def to_dict(self) -> dict:
        return {"device": self.device, "bandwidth_gbs": self.bandwidth / 1e9, "tflops": self.flops / 1e12,
                "bandwidth_source": self.bandwidth_source, "flops_source": self.flops_source}  # fmt: skip


def device_ceilings(device: str, dtype: str, *, bandwidth_gbs: float | None = None, tflops: float | None = None,
                    tensor_parallel_size: int = 1) -> Ceilings:  # fmt: skip
    """The ceilings of the device the engine runs on, flags (bandwidth_gbs, tflops) first.

    CUDA: the card's row of memory.GPU_TABLE (bfloat16/float16 tensor-core rate, or float32's for a float32
    model), times tensor_parallel_size (one card per rank); a card not in the table is probed. CPU: a short
    probe of this process's threads (ranks share the machine, so no multiple)."""
    for flag, value in (("--peak-bandwidth-gbs", bandwidth_gbs), ("--peak-tflops", tflops)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise NanoInferError(f"{flag} must be a positive number, got {value}.")
    name, table_bandwidth, table_flops, source = device, None, None, "probe"
    if device == "cuda":
        import torch

        props = torch.cuda.get_device_properties(0)
        name = props.name
        match = memory.gpu_spec_for_device(props.name, props.total_memory)
        if match is not None:
            table_name, spec = match
            per_card = spec.fp32_tflops if dtype == "float32" else spec.bf16_tflops
            if spec.bandwidth_gbs is not None:
                table_bandwidth = spec.bandwidth_gbs * 1e9 * tensor_parallel_size
            if per_card is not None:
                table_flops = per_card * 1e12 * tensor_parallel_size
            source = f"{table_name} datasheet"
            if tensor_parallel_size > 1:
                source += f" x {tensor_parallel_size} cards"
    else:
        name = _cpu_name()
    probed = None
    if (bandwidth_gbs is None and table_bandwidth is None) or (tflops is None and table_flops is None):
        probed = probe(device, dtype)

    def pick(flag_value, scale, table_value, probe_index, flag):
        if flag_value is not None:
            return flag_value * scale, flag
        if table_value is not None:
            return table_value, source
        return probed[probe_index], "measured (probe)"

    bandwidth, bandwidth_source = pick(bandwidth_gbs, 1e9, table_bandwidth, 0, "--peak-bandwidth-gbs")
    flops, flops_source = pick(tflops, 1e12, table_flops, 1, "--peak-tflops")
    return Ceilings(name, bandwidth, flops, bandwidth_source, flops_source)


def probe(device: str, dtype: str) -> tuple[float, float]:
    """(read bandwidth in bytes/s, matrix-multiply rate in FLOP/s) of this device, measured in well under a
    second with the current torch threads: the best of a few sums over PROBE_BYTES, and of a few float32 (or,
    on hardware that multiplies bfloat16 natively, bfloat16) PROBE_MATMUL^3 products. Best of several, since a
    shared machine only ever makes a run slower."""
    import torch

    def timed(fn, repeats: int) -> float:
        fn()  # first touch: page faults, kernel selection
        best = math.inf
        for _ in range(repeats):
            _sync(device)
            start = time.perf_counter()
            fn()
            _sync(device)
            best = min(best, time.perf_counter() - start)
        return max(best, 1e-9)

    data = torch.ones(PROBE_BYTES // 4, dtype=torch.float32, device=device)
    bandwidth = PROBE_BYTES / timed(data.sum, 3)
    data = None  # freed before the matmul's operands
    matmul_dtype = torch.float32
    if dtype in ("bfloat16", "float16") and (device == "cuda" or _cpu_multiplies_bfloat16()):
        matmul_dtype = torch.float16 if dtype == "float16" else torch.bfloat16
    n = PROBE_MATMUL if device == "cpu" else 8 * PROBE_MATMUL
    a = torch.ones(n, n, dtype=matmul_dtype, device=device)
    flops = 2 * n**3 / timed(lambda: torch.mm(a, a), 3)
    if device == "cpu":
        # The same product through the platform's linear method (nanoinfer's packed GEMM where it is built): on
        # some CPUs (an AMD Zen 5 EPYC) it runs twice as fast as torch.mm, whose rate would then put the floor
        # above what the model's own steps achieve.
        flops = max(flops, 2 * n**3 / timed(_platform_linear(a), 3))
    return bandwidth, flops


def _platform_linear(weight):
    """x -> x weight^T through the current platform's linear method, with the weight packed as a model's is."""
    from torch import nn

    from nanoinfer.platforms import current_platform

    class ProbeLinear(nn.Module):
        uses_linear_method = True  # packed like a model's linear (platforms/cpu/linear.py)
        tp_size = 1

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(weight.clone(), requires_grad=False)

    layer, platform = ProbeLinear(), current_platform()
    platform.prepare_model(layer)
    x = weight.clone()
    return lambda: platform.linear(layer, x, None)


def _cpu_multiplies_bfloat16() -> bool:
    from nanoinfer.platforms.cpu.linear import has_native_bfloat16_matmul

    return has_native_bfloat16_matmul()


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


# ---- step classes and the report ------------------------------------------------------------------------
def step_class(stats) -> str:
    """"prefill" for any step with prompt tokens (mixed steps too), else "decode a-b" by sequences in the step
    (powers of two: 1, 2, 3-4, 5-8, ...)."""
    if stats.num_prefill_tokens:
        return "prefill"
    num_seqs = max(stats.num_seqs, 1)
    high = 1 << (num_seqs - 1).bit_length()
    low = high // 2 + 1
    return f"decode {high}" if low >= high else f"decode {low}-{high}"


def _class_order(name: str) -> tuple[int, int]:
    if name == "prefill":
        return (0, 0)
    return (1, int(name.split()[-1].split("-")[-1]))


@dataclass
class ClassTotals:
    """The steps of one class: count, measured seconds, and the floor's parts summed step by step."""

    steps: int = 0
    seconds: float = 0.0
    floor_seconds: float = 0.0  # sum over steps of max(memory floor, compute floor)
    memory_seconds: float = 0.0
    compute_seconds: float = 0.0
    tokens: int = 0
    cost: StepCost = field(default_factory=StepCost)

    def add(self, seconds: float, tokens: int, cost: StepCost, ceilings: Ceilings) -> None:
        memory_s, compute_s = ceilings.floor_seconds(cost)
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens
        self.memory_seconds += memory_s
        self.compute_seconds += compute_s
        self.floor_seconds += max(memory_s, compute_s)
        self.cost.add(cost)

    @property
    def of_floor(self) -> float | None:
        """floor / measured time: 1.0 would be a step at the ceiling."""
        return self.floor_seconds / self.seconds if self.seconds > 0 else None

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"

    def to_dict(self) -> dict:
        return {"steps": self.steps, "seconds": self.seconds, "floor_seconds": self.floor_seconds,
                "of_floor": self.of_floor, "bound": self.bound, "memory_floor_seconds": self.memory_seconds,
                "compute_floor_seconds": self.compute_seconds, "tokens": self.tokens, **asdict(self.cost),
                "bytes": self.cost.total_bytes}  # fmt: skip


class Roofline:
    """Steps summed by class (step_class) against one set of ceilings."""

    def __init__(self, shape: ModelShape, ceilings: Ceilings):
        self.shape, self.ceilings = shape, ceilings
        self.classes: dict[str, ClassTotals] = {}
        self.all_steps = ClassTotals()

    def add(self, stats) -> None:
        cost = stats_cost(self.shape, stats)
        tokens = stats.num_prefill_tokens + stats.num_decode_tokens
        self.classes.setdefault(step_class(stats), ClassTotals()).add(stats.seconds, tokens, cost, self.ceilings)
        self.all_steps.add(stats.seconds, tokens, cost, self.ceilings)

    def ordered_classes(self) -> list[tuple[str, ClassTotals]]:
        return sorted(self.classes.items(), key=lambda item: _class_order(item[0]))

    def to_dict(self, wall_seconds: float | None = None) -> dict:
        """The JSON form: ceilings, shape, each class, all steps, and the run's wall time against the floor."""
        report = {
            "ceilings": self.ceilings.to_dict(),
            "shape": asdict(self.shape),
            "classes": {name: totals.to_dict() for name, totals in self.ordered_classes()},
            "all_steps": self.all_steps.to_dict(),
        }
        if wall_seconds:
            report["run"] = {"seconds": wall_seconds, "floor_seconds": self.all_steps.floor_seconds,
                             "of_floor": self.all_steps.floor_seconds / wall_seconds}  # fmt: skip
        return report


def expert_bytes(model) -> int:
    """Bytes of every expert's weights, as this model holds them (a platform's packed copy, `packed_experts`,
    where it made one)."""
    total = 0
    for module in model.modules():
        if getattr(module, "uses_expert_method", False):
            packed = getattr(module, "packed_experts", None)
            tensors = packed.tensors() if packed is not None else list(module.parameters(recurse=False))
            total += sum(t.numel() * t.element_size() for t in tensors)
    return total


def weights_read_bytes(model) -> int:
    """Bytes of the weights one step reads but the experts (expert_bytes), as this model holds them: each matrix in
    its smallest stored form (a CPU-packed weight's 4-bit blocks where it has them), other parameters as they are;
    the embedding table only as a tied LM head."""
    counted: set[int] = set()
    total = 0
    for module in model.modules():
        if getattr(module, "uses_expert_method", False):
            continue
        embedding = getattr(module, "is_embedding", False)  # looked up, not read (the LM head is not one)
        packed = getattr(module, "packed_weight", None)
        for name, param in module.named_parameters(recurse=False):
            if embedding or id(param) in counted:
                continue  # a tied LM head still counts it, as the module that multiplies by it
            counted.add(id(param))
            if name == "weight" and packed is not None:
                forms = (packed.data, packed.compact, packed.compact_amx)
                total += min(t.numel() * t.element_size() for t in forms if t is not None and t.numel())
            else:
                total += param.numel() * param.element_size()
    return total
