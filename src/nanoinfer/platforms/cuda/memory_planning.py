"""Sizing the KV cache on CUDA: load the model, measure the activation peak with a warm-up pass (and the CUDA
graphs' memory), then give what is left of gpu_memory_utilization to the cache (memory.plan_kv_cache)."""

from __future__ import annotations

import torch

from nanoinfer import memory


def build_cuda_runner(config, block_bytes: int, make_runner, state_slot_bytes: int = 0):
    """Load the model, measure the activation peak with a warm-up pass, then size and allocate the cache (and a
    hybrid model's state slots: the warm-up's own sequences get one each)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    free_before, total = torch.cuda.mem_get_info()
    other_bytes = total - free_before
    # A minimal cache for the warm-up: enough blocks for max_num_batched_tokens tokens.
    warmup_blocks = -(-config.max_num_batched_tokens // config.kvcache_block_size) + 1
    warmup_slots = memory.warmup_shape(config, warmup_blocks)[0] if state_slot_bytes else 0
    runner = make_runner(config, warmup_blocks, warmup_slots)
    weights_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    warmup_cache_bytes = warmup_blocks * block_bytes + warmup_slots * state_slot_bytes
    runner.warmup()
    peak = torch.cuda.max_memory_allocated()
    activation_bytes = max(peak - weights_bytes - warmup_cache_bytes, 0)
    graphs = getattr(runner, "uses_cuda_graphs", False)  # the tensor-parallel executor runs eager
    graph_bytes = _measure_cuda_graph_bytes(runner) if graphs else 0
    plan = memory.plan_kv_cache(
        total_bytes=total, utilization=config.gpu_memory_utilization, weights_bytes=weights_bytes,
        activation_bytes=activation_bytes, other_bytes=other_bytes, block_bytes=block_bytes,
        block_size=config.kvcache_block_size, max_model_len=config.max_model_len,
        num_kvcache_blocks=config.num_kvcache_blocks, graph_bytes=graph_bytes, spec=config.model_spec,
        state_slot_bytes=state_slot_bytes, max_num_seqs=config.max_num_seqs,
    )  # fmt: skip
    memory.check_fits(plan, config.max_model_len)
    runner.allocate_kv_cache(plan.num_blocks, plan.num_state_slots)
    if graphs:
        runner.capture_cuda_graphs()  # over the final cache: graphs keep the addresses they were captured on
    return runner, plan


def _measure_cuda_graph_bytes(runner) -> int:
    """Capture the decode graphs once over the warm-up cache and see how much memory they hold: their private
    pool (torch's allocator) and the instantiated graphs themselves (the driver's, seen only by mem_get_info)."""

    def settled() -> tuple[int, int]:
        # torch.cuda.graph() empties the allocator's cache on entry: without emptying it here too, the warm-up
        # pass's cached activations, released during the capture, would cancel out the graphs' own memory
        # (an H200 run measured 0 bytes that way).
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()

    free_before, reserved_before = settled()
    runner.capture_cuda_graphs()
    free_after, reserved_after = settled()
    runner.release_cuda_graphs()
    torch.cuda.empty_cache()
    return max(free_before - free_after, reserved_after - reserved_before, 0)
