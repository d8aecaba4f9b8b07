"""The KV-cache planner: the one place that turns memory into a number of KV blocks.

The engine calls it with measured inputs (weights loaded, activation peak of a warm-up pass, memory used
by others); `plan-memory` calls it with estimates from config.json and safetensors headers. Both get the
same `KVCachePlan`, so the plan is what the engine allocates. Nothing here loads weights or needs a GPU.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from nanoinfer.errors import ModelLoadError, NanoInferError, OutOfMemoryError

if TYPE_CHECKING:
    import torch

    from nanoinfer.models.spec import ModelSpec  # read by attribute only: memory sits below the models

GiB = 1 << 30
MiB = 1 << 20
GB = 10**9


@dataclass(frozen=True)
class GpuSpec:
    """A card's vendor figures: memory (decimal GB read literally), HBM/GDDR bandwidth and dense matrix rates.

    bf16_tflops is the dense (no sparsity) tensor-core rate for bfloat16 with float32 accumulation (float16's
    on cards without bfloat16); fp32_tflops is plain float32 (not TF32), what float32 models run at. None
    where we have no vendor figure: the roofline then asks for --peak-bandwidth-gbs / --peak-tflops.
    """

    memory_bytes: int
    bandwidth_gbs: float | None = None
    bf16_tflops: float | None = None
    fp32_tflops: float | None = None


# Vendor-advertised device memory, read literally as decimal gigabytes (10**9 bytes). Real cards report
# a little more (an "80 GB" A100 has 80 GiB = 85.9e9 bytes), so plans from this table err on the safe side.
# For your card's exact figure pass --gpu-memory with nvidia-smi's total (e.g. 143771MiB) or run on it.
# Bandwidth and matrix rates are the datasheets' (SXM forms where a card comes in several, H100 PCIe apart);
# `nanoinfer bench` sets each step against them.
GPU_TABLE: dict[str, GpuSpec] = {
    "H200": GpuSpec(141 * GB, 4800, 989, 67),
    "H100-NVL": GpuSpec(94 * GB, 3900, 835, 60),
    "H100": GpuSpec(80 * GB, 3350, 989, 67),
    "H100-PCIe": GpuSpec(80 * GB, 2000, 756, 51),
    "A100-80GB": GpuSpec(80 * GB, 2039, 312, 19.5),
    "A100-40GB": GpuSpec(40 * GB, 1555, 312, 19.5),
    "A6000": GpuSpec(48 * GB, 768, 155, 38.7),
    "L40S": GpuSpec(48 * GB, 864, 362, 91.6),
    "L40": GpuSpec(48 * GB, 864, 181, 90.5),
    "A10": GpuSpec(24 * GB, 600, 125, 31.2),
    "A10G": GpuSpec(24 * GB),
    "L4": GpuSpec(24 * GB, 300, 121, 30.3),
    "RTX-4090": GpuSpec(24 * GB, 1008, 165, 82.6),
    "RTX-3090": GpuSpec(24 * GB, 936, 35.6, 35.6),
    "V100-32GB": GpuSpec(32 * GB, 900, 125, 15.7),
    "V100-16GB": GpuSpec(16 * GB, 900, 125, 15.7),
    "T4": GpuSpec(16 * GB, 320, 65, 8.1),
    "RTX-4080": GpuSpec(16 * GB),
    "RTX-4070-Laptop": GpuSpec(8 * GB),
}

_DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2,
    "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


def _normalize_gpu_name(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).lower().removeprefix("nvidia").removeprefix("geforce")


def lookup_gpu(name: str) -> tuple[str, int]:
    """(table name, bytes) of a card; ignores case, spaces, '-', '_' and an NVIDIA/GeForce prefix."""
    names = {_normalize_gpu_name(k): k for k in GPU_TABLE}
    key = _normalize_gpu_name(name)
    if key in names:
        return names[key], GPU_TABLE[names[key]].memory_bytes
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(names[c] for c in close)}?" if close else ""
    raise NanoInferError(
        f"unknown GPU {name!r}.{hint} Known cards: {', '.join(GPU_TABLE)}. "
        "For another card pass its memory instead, e.g. --gpu-memory 48GiB."
    )


def gpu_memory_bytes(name: str) -> int:
    """Memory of a card from GPU_TABLE (see lookup_gpu)."""
    return lookup_gpu(name)[1]


def gpu_spec_for_device(device_name: str, total_bytes: int | None = None) -> tuple[str, GpuSpec] | None:
    """The GPU_TABLE entry of a CUDA device name as torch reports it ("NVIDIA H100 80GB HBM3",
    "NVIDIA A100-SXM4-40GB"), or None for a card not in the table.

    An entry matches when every word of its name is a word of the device's ("H100-PCIe" needs both); of
    several, the one naming most words wins, then the one whose memory is closest to total_bytes."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    candidates = []
    for name, spec in GPU_TABLE.items():
        key_words = name.lower().split("-")
        if all(word in words for word in key_words):
            memory_gap = abs(spec.memory_bytes - total_bytes) if total_bytes else 0
            candidates.append((-len(key_words), memory_gap, name))
    if not candidates:
        return None
    name = min(candidates)[2]
    return name, GPU_TABLE[name]


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "ki": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": MiB, "mi": MiB, "mib": MiB, "mb": 10**6,
    "g": GiB, "gi": GiB, "gib": GiB, "gb": GB,
    "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as "80GiB", "80GB", "80 G", "141e9" or "512MiB".

    GiB/MiB/KiB/TiB (and the bare letters G, M, K, T) are binary; GB/MB/KB/TB are decimal;
    a plain number is bytes.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise NanoInferError(
            f"cannot read memory size {text!r}. Write a number and a unit, e.g. 80GiB, 80GB, 512MiB or "
            "141e9 (bytes). GiB/MiB (and bare G/M) are powers of 1024, GB/MB powers of 1000."
        )
    size = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise NanoInferError(f"memory size {text!r} must be at least one byte.")
    return int(size)


def format_bytes(num_bytes: float) -> str:
    """Human-readable binary size: 1.2 GiB, 512.0 MiB."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


def dtype_bytes(dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype or its name ("bfloat16", "bf16", "torch.float16", ...)."""
    if not isinstance(dtype, str):
        return dtype.itemsize
    name = dtype.lower().removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise NanoInferError(f"unknown dtype {dtype!r}. Use float32, bfloat16 or float16.")
    return _DTYPE_BYTES[name]


def check_tensor_parallel_size(spec: ModelSpec, tensor_parallel_size: int) -> None:
    """A NanoInferError naming the sizes that work when tensor_parallel_size does not split every layer's heads."""
    if tensor_parallel_size > 1 and not spec.supports_tensor_parallel:
        raise NanoInferError(f"tensor_parallel_size {tensor_parallel_size}: nanoinfer runs {spec.architecture} on one "
                             "rank only (its layers are not sharded). Use tensor_parallel_size 1.")
    if not spec.check_tensor_parallel(tensor_parallel_size):
        heads = sorted({(layer.num_heads, layer.num_kv_heads) for layer in spec.layers})
        described = ", ".join(f"{h} attention heads and {kv} KV heads" for h, kv in heads)
        raise NanoInferError(
            f"tensor_parallel_size {tensor_parallel_size} does not split this model: it has {described}. "
            f"Use one of {valid_tensor_parallel_sizes(spec)}."
        )


def valid_tensor_parallel_sizes(spec: ModelSpec, candidates=(1, 2, 4, 8)) -> list[int]:
    return [tp for tp in candidates if spec.check_tensor_parallel(tp)]


def state_slot_bytes(spec: ModelSpec, tensor_parallel_size: int, dtype: torch.dtype | str) -> int:
    """One sequence's linear-attention state on one rank (0 for a model without linear attention): every such
    layer's convolution inputs in the model's dtype and delta-rule matrices in float32."""
    return spec.state_bytes_per_sequence(tensor_parallel_size, dtype_bytes(dtype))


def kv_block_bytes(spec: ModelSpec, block_size: int, tensor_parallel_size: int, dtype: torch.dtype | str) -> int:
    """Bytes of one KV block on one rank: K and V for every layer (each of its own KV heads and head size),
    block_size tokens, this rank's share of the KV heads."""
    check_tensor_parallel_size(spec, tensor_parallel_size)
    return block_size * spec.kv_elements_per_token(tensor_parallel_size) * dtype_bytes(dtype)


@dataclass(frozen=True)
class KVCachePlan:
    """How many KV blocks to allocate and where the memory went. All byte counts are per rank.

    budget_bytes = total_bytes x utilization - weights - activations - CUDA graphs - other; num_blocks x
    block_bytes fits in it. `max_model_len` is the sequence length the plan was made for.
    """

    num_blocks: int
    block_bytes: int
    block_size: int
    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    other_bytes: int
    total_bytes: int
    max_model_len: int = 0
    graph_bytes: int = 0  # the CUDA graphs' memory pool (0 on CPU or with enforce_eager)
    # A hybrid model's state cache (linear-attention layers): one slot a running sequence, out of the same budget
    num_state_slots: int = 0
    state_slot_bytes: int = 0

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_slot_bytes

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def blocks_per_sequence(self, max_model_len: int | None = None) -> int:
        return math.ceil((max_model_len or self.max_model_len) / self.block_size)

    def max_concurrency(self, max_model_len: int | None = None) -> float:
        """Sequences of max_model_len tokens the cache holds at once, in whole blocks (vLLM's figure); a hybrid
        model's also each need a state slot."""
        concurrency = self.num_blocks / self.blocks_per_sequence(max_model_len)
        return min(concurrency, self.num_state_slots) if self.num_state_slots else concurrency

    def max_num_seqs_that_fit(self, max_model_len: int | None = None) -> int:
        """Whole sequences of max_model_len tokens that fit side by side (each with a state slot, if hybrid)."""
        return math.floor(self.max_concurrency(max_model_len))

    @property
    def fits_one_sequence(self) -> bool:
        return self.blocks_per_sequence() <= self.num_blocks

    def max_model_len_that_fits(self, model_max_len: int | None = None) -> int:
        """Largest length L with ceil(L / block_size) <= num_blocks, capped at the model's maximum."""
        if model_max_len is None:
            return self.num_tokens
        return min(self.num_tokens, model_max_len)

    def summary_line(self) -> str:
        line = (
            f"KV cache: {self.num_blocks:,} blocks x {self.block_size} tokens = {self.num_tokens:,} tokens, "
            f"max concurrency {self.max_concurrency():.1f} at max_model_len {self.max_model_len}, "
            f"{format_bytes(self.kv_bytes)}"
        )
        if self.num_state_slots:
            line += (f"; state cache: {self.num_state_slots:,} sequence slots x "
                     f"{format_bytes(self.state_slot_bytes)} = {format_bytes(self.state_bytes)}")  # fmt: skip
        return line


# A hybrid model's state slots take at most this share of the cache budget, the KV blocks the rest.
STATE_SHARE = 0.5


def plan_state_slots(budget: int, slot_bytes: int, max_num_seqs: int, block_bytes: int,
                     num_kvcache_blocks: int = -1) -> int:  # fmt: skip
    """State slots for a hybrid model (0 for others): one per sequence up to max_num_seqs, within STATE_SHARE of the
    budget, or within what a user-set num_kvcache_blocks leaves. The scheduler admits a sequence only with a free
    slot, so fewer slots than max_num_seqs lower the concurrency and nothing else. Raises OutOfMemoryError when not
    one slot fits."""
    if slot_bytes == 0:
        return 0
    room = budget - num_kvcache_blocks * block_bytes if num_kvcache_blocks > 0 else math.floor(budget * STATE_SHARE)
    slots = min(max_num_seqs, max(room, 0) // slot_bytes)
    if slots == 0:
        if num_kvcache_blocks > 0:
            blocks_bytes = format_bytes(num_kvcache_blocks * block_bytes)
            taken = f", of which num_kvcache_blocks = {num_kvcache_blocks} take {blocks_bytes}"
        else:
            taken = f" and state slots may take {STATE_SHARE:.0%} of it"
        raise OutOfMemoryError(
            f"No room for one sequence's linear-attention state ({format_bytes(slot_bytes)}): the cache budget is "
            f"{format_bytes(budget)}{taken}. Raise the budget (gpu_memory_utilization, or cpu_kvcache_space_gib on "
            "CPU) or lower num_kvcache_blocks."
        )
    return slots


def kv_budget_bytes(*, total_bytes, utilization, weights_bytes, activation_bytes, other_bytes, graph_bytes=0) -> int:
    """Memory left for the KV cache: total x utilization minus everything else (may be negative)."""
    return math.floor(total_bytes * utilization) - weights_bytes - activation_bytes - graph_bytes - other_bytes


def plan_kv_cache(
    *,
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_bytes: int,
    other_bytes: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    num_kvcache_blocks: int = -1,
    graph_bytes: int = 0,
    spec: ModelSpec | None = None,
    state_slot_bytes: int = 0,
    max_num_seqs: int = 1,
) -> KVCachePlan:
    """Size the KV cache of one device (per rank under tensor parallelism).

    Args:
        total_bytes: device memory in all.
        utilization: fraction of total_bytes the engine may use (gpu_memory_utilization).
        weights_bytes, activation_bytes: this rank's weights and forward-pass peak.
        other_bytes: memory already used by other processes (and the CUDA context).
        block_bytes: from kv_block_bytes(); block_size: tokens per block.
        max_model_len: the sequence length the plan is for (see check_fits).
        num_kvcache_blocks: -1 sizes the cache from the budget; a positive value is used as is,
            after checking that it fits in the budget.
        graph_bytes: memory held by the captured CUDA graphs (measured by the engine).
        spec: the model's, to say in an error how much of the weights are experts.
        state_slot_bytes: one sequence's linear-attention state (a hybrid model's; 0 for others), and
            max_num_seqs: the most slots wanted (plan_state_slots); the slots come out of the budget first.

    Returns:
        The plan. Raises OutOfMemoryError when nothing (or not the requested blocks) fits.
    """
    budget = kv_budget_bytes(
        total_bytes=total_bytes, utilization=utilization, weights_bytes=weights_bytes,
        activation_bytes=activation_bytes, other_bytes=other_bytes, graph_bytes=graph_bytes,
    )  # fmt: skip
    usable = math.floor(total_bytes * utilization)
    breakdown = (
        f"gpu_memory_utilization {utilization} x {format_bytes(total_bytes)} = {format_bytes(usable)}, "
        f"minus weights {describe_weights(spec, weights_bytes) if spec else format_bytes(weights_bytes)}, "
        f"activation peak {format_bytes(activation_bytes)}, "
        + (f"CUDA graphs {format_bytes(graph_bytes)}, " if graph_bytes else "")
        + "and memory used by others "
        f"{format_bytes(other_bytes)} leaves {format_bytes(budget)} for the KV cache"
    )
    if budget <= 0:
        raise OutOfMemoryError(
            f"Not enough memory for the KV cache: {breakdown}. Raise `gpu_memory_utilization`, use a card "
            "with more memory or a larger `tensor_parallel_size`, lower `max_num_batched_tokens` / "
            "`max_num_seqs` (smaller activation peak), or use a 2-byte dtype."
        )
    num_slots = plan_state_slots(budget, state_slot_bytes, max_num_seqs, block_bytes, num_kvcache_blocks)
    state_bytes = num_slots * state_slot_bytes
    if state_bytes:
        breakdown += f", {format_bytes(state_bytes)} of it for {num_slots} state slots"
    if num_kvcache_blocks > 0:
        if num_kvcache_blocks * block_bytes > budget - state_bytes:
            raise OutOfMemoryError(
                f"num_kvcache_blocks = {num_kvcache_blocks} needs "
                f"{format_bytes(num_kvcache_blocks * block_bytes)} ({num_kvcache_blocks} x {block_bytes:,} "
                f"bytes) but {breakdown}: at most "
                f"{(budget - state_bytes) // block_bytes} blocks. Lower num_kvcache_blocks, or set it to -1 to size "
                "the cache from memory."
            )
        num_blocks = num_kvcache_blocks
    elif num_kvcache_blocks == 0:
        raise OutOfMemoryError(
            "num_kvcache_blocks = 0 leaves no KV cache. Set it to -1 to size the cache from memory."
        )
    else:
        num_blocks = (budget - state_bytes) // block_bytes
        if num_blocks == 0:
            raise OutOfMemoryError(
                f"No room for a single KV block ({format_bytes(block_bytes)}): {breakdown}. Raise "
                "`gpu_memory_utilization`, lower `kvcache_block_size`, or free memory as above."
            )
    return KVCachePlan(
        num_blocks=num_blocks, block_bytes=block_bytes, block_size=block_size, budget_bytes=budget,
        weights_bytes=weights_bytes, activation_bytes=activation_bytes, other_bytes=other_bytes,
        total_bytes=total_bytes, max_model_len=max_model_len, graph_bytes=graph_bytes, num_state_slots=num_slots,
        state_slot_bytes=state_slot_bytes,
    )  # fmt: skip


def available_ram_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    return _meminfo("MemAvailable:", "SC_AVPHYS_PAGES")


def total_ram_bytes() -> int | None:
    """MemTotal from /proc/meminfo (None where there is no such file)."""
    return _meminfo("MemTotal:", "SC_PHYS_PAGES")


def _meminfo(key: str, sysconf_pages: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf(sysconf_pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def expert_share(spec: ModelSpec, weights_bytes: int) -> int:
    """The experts' part of `weights_bytes` (all of a model's weights, in one dtype), by their share of the
    parameters."""
    return round(weights_bytes * spec.expert_params / max(1, spec.total_params))


def describe_weights(spec: ModelSpec, weights_bytes: int) -> str:
    """"X" or, for a mixture of experts, "X, of which the experts Y (L layers x E experts)": where the bytes go."""
    if not spec.num_moe_layers:
        return format_bytes(weights_bytes)
    return (f"{format_bytes(weights_bytes)}, of which the experts {format_bytes(expert_share(spec, weights_bytes))} "
            f"({spec.num_moe_layers} layers x {spec.num_experts} experts)")


def plan_cpu_kv_cache(config, block_bytes: int, state_slot_bytes: int = 0) -> KVCachePlan:
    """Size the KV cache on CPU: the budget is config.cpu_kvcache_space_gib, checked against free RAM; a hybrid
    model's state slots (state_slot_bytes each) come out of it first (plan_state_slots).

    Call it after the weights are loaded, so that MemAvailable no longer counts them.
    """
    space = config.cpu_kvcache_space_gib
    budget = math.floor(space * GiB)
    available = available_ram_bytes()
    if available is not None and budget > 0.9 * available:
        raise OutOfMemoryError(
            f"cpu_kvcache_space_gib = {space} asks for {format_bytes(budget)} of KV cache but only "
            f"{format_bytes(available)} of RAM is available (MemAvailable) and nanoinfer uses at most 90% "
            f"of it ({format_bytes(0.9 * available)}). Lower cpu_kvcache_space_gib to "
            f"{math.floor(0.9 * available / GiB * 10) / 10} or less, or free memory."
        )
    block_size = config.kvcache_block_size
    user_blocks = config.num_kvcache_blocks
    num_slots = 0
    if state_slot_bytes:
        num_slots = plan_state_slots(budget, state_slot_bytes, config.max_num_seqs, block_bytes, user_blocks)
    kv_budget = budget - num_slots * state_slot_bytes
    if user_blocks > 0 and user_blocks * block_bytes > kv_budget:
        raise OutOfMemoryError(
            f"num_kvcache_blocks = {user_blocks} needs {format_bytes(user_blocks * block_bytes)} "
            f"({user_blocks} x {block_bytes:,} bytes) but cpu_kvcache_space_gib = {space} "
            f"allows {kv_budget // block_bytes} blocks. Raise cpu_kvcache_space_gib or lower num_kvcache_blocks."
        )
    num_blocks = user_blocks if user_blocks > 0 else kv_budget // block_bytes
    if num_blocks <= 0:
        raise OutOfMemoryError(
            f"cpu_kvcache_space_gib = {space} ({format_bytes(budget)}) is smaller than one KV block "
            f"({format_bytes(block_bytes)}). Raise cpu_kvcache_space_gib or lower kvcache_block_size."
        )
    return KVCachePlan(
        num_blocks=num_blocks, block_bytes=block_bytes, block_size=block_size, budget_bytes=budget,
        weights_bytes=0, activation_bytes=0, other_bytes=0, total_bytes=available or budget,
        max_model_len=config.max_model_len, num_state_slots=num_slots, state_slot_bytes=state_slot_bytes,
    )  # fmt: skip


def check_fits(plan: KVCachePlan, max_model_len: int) -> None:
    """Raise OutOfMemoryError (vLLM's wording) when one max_model_len sequence does not fit the cache."""
    if plan.blocks_per_sequence(max_model_len) <= plan.num_blocks:
        return
    raise OutOfMemoryError(
        f"The model's max seq len ({max_model_len}) is larger than the maximum number of tokens that can be "
        f"stored in KV cache ({plan.num_tokens}). Try increasing `gpu_memory_utilization` (or "
        "`cpu_kvcache_space_gib` on CPU) or decreasing `max_model_len` when initializing the engine. "
        "Based on the available memory, the estimated maximum model length is "
        f"{plan.max_model_len_that_fits()}."
    )


def weights_bytes_from_checkpoint(model_dir, dtype: torch.dtype | str, spec: ModelSpec) -> int:
    """Bytes the weights take once loaded in `dtype`, read from safetensors headers (no tensor data); MXFP4
    expert blocks count as the values they hold (dequantized at load).

    A folder without *.safetensors (only config.json) gets the count of its ModelSpec instead.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return estimate_weights_bytes(spec, dtype)
    tied = spec.lm_head_params == 0
    num_elements = 0
    for path in files:
        for name, info in _read_safetensors_header(path).items():
            if name == "__metadata__" or (tied and name.endswith("lm_head.weight")) or name.endswith("_scales"):
                continue  # a tied head shares the embedding's memory; MXFP4 scales go into the values they scale
            # MXFP4 experts (gpt-oss): two 4-bit values a byte of *_blocks, dequantized at load
            num_elements += math.prod(info["shape"]) * (2 if name.endswith("_blocks") else 1)
    return num_elements * dtype_bytes(dtype)


def _read_safetensors_header(path: Path) -> dict:
    # Layout: 8-byte little-endian header length, then that many bytes of JSON, then tensor data.
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * MiB or length > path.stat().st_size - 8:
                raise ValueError(f"header length {length} is not plausible")
            return json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as e:
        raise ModelLoadError(
            f"{path} is not a readable safetensors file ({e}). Re-download the model."
        ) from None


def estimate_weights_bytes(spec: ModelSpec, dtype: torch.dtype | str) -> int:
    """Bytes of a model's parameters (its ModelSpec's count), in `dtype`."""
    return spec.total_params * dtype_bytes(dtype)


def warmup_shape(config, num_blocks: int) -> tuple[int, int]:
    """(sequences, tokens each) of the warm-up pass: max_num_batched_tokens tokens (at most the cache's), over
    enough sequences that none is longer than max_model_len - 1 (the rotary table's end)."""
    num_tokens = min(config.max_num_batched_tokens, (num_blocks - 1) * config.kvcache_block_size)
    num_seqs = min(config.max_num_seqs, max(1, -(-num_tokens // max(config.max_model_len - 1, 1))))
    return num_seqs, min(num_tokens // num_seqs, config.max_model_len - 1)


def max_sampled_rows(max_num_batched_tokens: int, max_num_seqs: int, num_speculative_tokens: int) -> int:
    """Most rows of logits a step can sample: one a sequence, or 1 + num_speculative_tokens for a speculated
    one (its last token and each proposed token are decode rows of their own), never more than the step's
    tokens."""
    return min(max_num_batched_tokens, max_num_seqs * (1 + num_speculative_tokens))


def estimate_activation_bytes(
    spec: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype | str, tp: int,
    num_speculative_tokens: int = 0,
) -> int:
    """Estimated forward-pass peak on one rank; the engine measures it instead on CUDA.

    For T = max_num_batched_tokens tokens and S rows of logits (max_num_seqs; with n-gram speculation each
    sequence samples up to 1 + num_speculative_tokens rows, at most T in all):
      resident: hidden states and residual, 2 x T x hidden_size
      plus the largest of
        attention: q, k, v and the attention output, T x (2 x heads + 2 x kv_heads) / tp x head_dim
        mlp: gate_up and activation output, T x 3 x intermediate_size / tp
        sampling: logits and probabilities in float32, 2 x S x vocab_size x 4 bytes (full vocab on rank 0)
    Tensors of the dtype take dtype_bytes each. Layers run one at a time, so only one layer's temporaries
    are alive at once.
    """
    size = dtype_bytes(dtype)
    tokens = max_num_batched_tokens
    check_tensor_parallel_size(spec, tp)
    resident = 2 * tokens * spec.hidden_size * size
    attention = tokens * size * max(
        (2 * layer.num_heads // tp + 2 * max(1, layer.num_kv_heads // tp)) * layer.head_dim for layer in spec.layers
    )
    mlp = tokens * 3 * (spec.intermediate_size // tp) * size
    sampling = 2 * max_sampled_rows(tokens, max_num_seqs, num_speculative_tokens) * spec.vocab_size * 4
    return resident + max(attention, mlp, sampling)
