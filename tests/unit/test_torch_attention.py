"""The CPU attention paths (C++ paged decode kernel and the torch fallback) against reference.py."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.attention.metadata import AttentionMetadata
from nanoinfer.attention.reference import paged_attention_reference, store_kvcache_reference
from nanoinfer.attention.torch_backend import TorchBackend, _StepPlan
from nanoinfer.platforms.cpu.attention import CpuAttentionBackend
from nanoinfer.platforms.cpu.ops import cpu_ops


def make_backend(use_kernel: bool = True):
    """The CPU backend on the C++ kernels (where they are built), or the plain-torch one."""
    ops = cpu_ops() if use_kernel else None
    return CpuAttentionBackend(ops) if ops is not None else TorchBackend()


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random cache contents and a batch whose sequences own shuffled (non-contiguous) blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, next_block = [], 0
    for n in blocks_needed:
        tables.append(order[next_block: next_block + n])
        next_block += n
    max_blocks = max(blocks_needed)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=list(query_lens),
        seq_lens_cpu=list(seq_lens),
    )
    return query, k_cache, v_cache, metadata


CASES = [
    # (query_lens, seq_lens): pure decode; decode + fresh prefill + chunked prefill over a cached prefix
    ([1, 1, 1, 1], [1, 255, 256, 700]),
    ([1, 37, 1, 20], [300, 37, 513, 290]),
]


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)])
@pytest.mark.parametrize("case", CASES)
def test_torch_backend_matches_reference_float32(use_kernel, heads, case):
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    num_heads, num_kv_heads = heads
    query, k_cache, v_cache, metadata = make_batch(*case, num_heads, num_kv_heads, 64, 256, torch.float32)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    got = make_backend(use_kernel).forward(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


PREFILL_CASES = [
    # (query_lens, seq_lens): prompts spanning several 64-key tiles and 256-token blocks, fresh and over a
    # cached prefix; query tiles of 16 positions cut mid-prompt; a 2-token chunk at a block boundary
    ([300, 17, 1], [300, 17, 40]),
    ([150, 2, 65], [550, 258, 65]),
]


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_cpu_prefill_kernel_matches_reference(case, heads, head_dim):
    """The C++ prefill kernel (every prompt chunk of a step in one call) on queries laid out as the model
    passes them: a view of the fused qkv output, rows contiguous at a wider row stride. A head size of 80
    leaves the AVX-512 tile a last block of 16 value dims (it takes 32 at a time); 1, 3 and 8 query heads
    a KV head give work items of 16, 48 and 128 rows, cut into 12-row tiles with every remainder."""
    if cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    num_heads, num_kv_heads = heads
    query, k_cache, v_cache, metadata = make_batch(*case, num_heads, num_kv_heads, head_dim, 256, torch.float32)
    fused = torch.randn(query.shape[0], (num_heads + 2 * num_kv_heads) * head_dim)
    fused[:, : num_heads * head_dim] = query.reshape(query.shape[0], -1)
    query = fused[:, : num_heads * head_dim].view(-1, num_heads, head_dim)
    assert not query.is_contiguous()
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, head_dim**-0.5)
    got = make_backend().forward(query, k_cache, v_cache, metadata, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)]
                         + [(torch.float32, fp8) for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2)], ids=str)
def test_cpu_prefill_kernel_narrow_types_match_the_torch_path(dtype, cache_dtype):
    """bfloat16 queries, and float32 ones over a bfloat16 / fp8 cache (kv_cache_dtype): the kernel widens
    each element as it reads it, and agrees with SDPA over the same (widened) cache."""
    if cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    query, k_cache, v_cache, metadata = make_batch(*PREFILL_CASES[1], 9, 3, 64, 256, dtype)
    k_cache, v_cache = k_cache.float().to(cache_dtype), v_cache.float().to(cache_dtype)
    got = make_backend().forward(query, k_cache, v_cache, metadata, 0.125)
    expected = TorchBackend().forward(query, k_cache, v_cache, metadata, 0.125)
    assert got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_unwritten_cache_slots_are_never_read(use_kernel):
    """The CPU cache is allocated uninitialised: NaN in every slot past a sequence's length (its last block's
    tail, and block 0 standing in for missing table entries) must not reach the output."""
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    case = ([1, 1, 5, 1], [3, 300, 40, 700])
    query, k_cache, v_cache, metadata = make_batch(*case, 9, 3, 64, 256, torch.float32)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for i, length in enumerate(metadata.seq_lens_cpu):
        for t in range(length):
            written[metadata.block_tables[i, t // 256], t % 256] = True
    k_cache[~written], v_cache[~written] = float("nan"), float("nan")
    got = make_backend(use_kernel).forward(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_cpu_kernel_bfloat16_close_to_reference():
    if cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    query, k_cache, v_cache, metadata = make_batch([1, 1, 1], [5, 300, 600], 9, 3, 64, 256, torch.bfloat16)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    got = make_backend().forward(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_matches_reference_and_skips_padding_slots(use_kernel, dtype):
    # key / value as the model passes them: views of one fused qkv row (row stride 48, not 16).
    qkv = torch.randn(5, 48).to(dtype)
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([0, 7, -1, 300, 511])
    caches = [torch.zeros(2, 256, 2, 8, dtype=dtype) for _ in range(4)]
    make_backend(use_kernel).store_kvcache(key, value, caches[0], caches[1], slots)
    store_kvcache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].abs().sum() > 0 and caches[1].abs().sum() > 0


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_store_kvcache_of_a_prefill_step_matches_reference(use_kernel):
    # 600 rows: the C++ store splits a step of 256 or more rows over the threads; padding slots among them
    qkv = torch.randn(600, 48)
    key, value = qkv[:, 16:32].view(600, 2, 8), qkv[:, 32:].view(600, 2, 8)
    slots = torch.randperm(4 * 256)[:600]
    slots[::7] = -1
    caches = [torch.zeros(4, 256, 2, 8) for _ in range(4)]
    make_backend(use_kernel).store_kvcache(key, value, caches[0], caches[1], slots)
    store_kvcache_reference(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    bad = slots.clone()
    bad[300] = 4 * 256  # one slot past the end: refused before anything is written
    if use_kernel and cpu_ops() is not None:
        fresh = [torch.zeros(4, 256, 2, 8) for _ in range(2)]
        with pytest.raises(RuntimeError, match="outside the cache"):
            make_backend().store_kvcache(key, value, fresh[0], fresh[1], bad)
        assert fresh[0].abs().sum() == 0


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
STORE_PAIRS = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)] + [
    (dtype, fp8) for fp8 in FP8 for dtype in (torch.float32, torch.bfloat16)
]


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)  # fp8 tensors lack torch.equal on CPU; their bytes compare the same


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize(("dtype", "cache_dtype"), STORE_PAIRS, ids=str)
def test_store_kvcache_converts_to_the_cache_dtype_as_torch_does(use_kernel, dtype, cache_dtype):
    """kv_cache_dtype: keys are rounded to nearest even into a narrower cache (widened exactly into a float32
    one), bit for bit as .to() does, on both paths; fp8 saturates at its largest finite value (vLLM's rule:
    e4m3 +-448, e5m2 +-57344), where e5m2's plain .to() would give inf."""
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    qkv = torch.randn(5, 48) * 3
    qkv[1, 20], qkv[3, 40], qkv[4, 17] = 1e6, -1e6, 0.01  # past both fp8 ranges; an fp8 subnormal
    qkv = qkv.to(dtype)
    key, value = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    slots = torch.tensor([0, 7, -1, 300, 511])
    caches = [torch.zeros(2, 256, 2, 8, dtype=cache_dtype) for _ in range(4)]
    make_backend(use_kernel).store_kvcache(key, value, caches[0], caches[1], slots)
    limit = torch.finfo(cache_dtype).max if cache_dtype in FP8 else float("inf")
    rounded = [x.float().clamp(-limit, limit).to(cache_dtype) for x in (key, value)]
    store_kvcache_reference(*rounded, caches[2], caches[3], slots)
    assert torch.equal(as_bytes(caches[0]), as_bytes(caches[2]))
    assert torch.equal(as_bytes(caches[1]), as_bytes(caches[3]))
    assert caches[0].float().abs().sum() > 0
    assert caches[0].float().isfinite().all() and caches[1].float().isfinite().all()
    if cache_dtype in FP8:
        assert caches[0][0, 7].float().abs().max() == limit and caches[1][1, 44].float().abs().max() == limit


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu-kernel", "torch"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
@pytest.mark.parametrize("case", CASES)
def test_float32_queries_over_a_narrower_cache_match_the_reference(use_kernel, cache_dtype, case):
    """A bfloat16 or fp8 cache under a float32 model: values widen exactly (the C++ kernel widens fp8 through
    float16's layout, eight at a time), the rest is float32 arithmetic, so the result matches the float32
    oracle on the same cache to float32 rounding."""
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    query, k_cache, v_cache, metadata = make_batch(*case, 9, 3, 64, 256, torch.float32)
    k_cache[0, :8] *= 0.005  # fp8 subnormals (below 2^-6 in e4m3) among the keys read
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    got = make_backend(use_kernel).forward(query, k_cache, v_cache, metadata, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, *FP8], ids=str)
def test_a_fresh_prompt_attends_to_its_keys_as_the_cache_holds_them(cache_dtype):
    """The torch path's prefill without a cached prefix reads this step's keys directly (new_kv); under a
    narrower cache it must round them as the cache does, so a prompt's output does not depend on whether its
    prefix was cached. (The C++ prefill kernel always reads the cache; it is compared with this path above.)"""
    query, k_cache, v_cache, metadata = make_batch([40], [40], 9, 3, 64, 256, torch.float32)
    k_cache, v_cache = k_cache.to(cache_dtype), v_cache.to(cache_dtype)
    key, value = torch.randn(40, 3, 64), torch.randn(40, 3, 64)
    table = metadata.block_tables[0].tolist()
    slots = torch.tensor([table[t // 256] * 256 + t % 256 for t in range(40)])
    backend = TorchBackend()
    backend.store_kvcache(key, value, k_cache, v_cache, slots)
    from_cache = backend.forward(query, k_cache, v_cache, metadata, 0.125)  # no new_kv: reads the cache
    direct = TorchBackend().forward(query, k_cache, v_cache, metadata, 0.125, new_kv=(key, value))
    torch.testing.assert_close(direct, from_cache, atol=2e-6, rtol=1e-6)
    unrounded = TorchBackend().forward(
        query, k_cache.float(), v_cache.float(), metadata, 0.125, new_kv=(key, value)
    )
    assert not torch.allclose(unrounded, from_cache, atol=1e-4)  # the float32 keys would have differed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_reads_queries_in_place_from_the_fused_qkv_output(dtype):
    """q as the decode loop passes it, a [tokens, heads, D] view of the [tokens, q | k | v] projection output:
    the same bits as from a contiguous copy. Heads that are not contiguous within a token are refused."""
    if cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    query, k_cache, v_cache, metadata = make_batch([1, 1, 1], [5, 300, 600], 9, 3, 64, 16, dtype)
    qkv = torch.cat([query.flatten(1), torch.randn(3, 2 * 3 * 64).to(dtype)], dim=1)  # [3, 960]
    q_view = qkv.narrow(1, 0, 9 * 64).view(3, 9, 64)
    assert not q_view.is_contiguous()
    args = (k_cache, v_cache, metadata.block_tables, metadata.seq_lens, 0.125, 0, 0.0)
    got = cpu_ops().paged_decode(q_view, *args)
    assert got.is_contiguous()
    assert torch.equal(got, cpu_ops().paged_decode(query.contiguous(), *args))
    with pytest.raises(RuntimeError, match="heads contiguous"):
        cpu_ops().paged_decode(query.transpose(0, 1).contiguous().transpose(0, 1), *args)


def test_cpu_kernel_store_refuses_a_slot_outside_the_cache():
    if cpu_ops() is None:
        pytest.skip("no C++ compiler here")
    k_cache, v_cache = torch.zeros(2, 256, 2, 8), torch.zeros(2, 256, 2, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        make_backend().store_kvcache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), k_cache, v_cache, torch.tensor([512]))


@pytest.mark.parametrize("use_kernel", [True, False])
def test_step_plan_is_per_step(use_kernel, monkeypatch):
    """One backend serves every layer and step: a step's plan is built once and reused by its layers, must
    not leak into the next step (another metadata object), and metadata without host-side lengths (a CUDA
    graph's, its tensors changed in place between replays) is planned afresh on every call."""
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    builds = []
    build = _StepPlan.build.__func__
    monkeypatch.setattr(_StepPlan, "build", classmethod(lambda cls, *a: builds.append(1) or build(cls, *a)))
    backend = make_backend(use_kernel)
    cases = CASES + [([1, 1], [9, 400]), ([5, 20], [5, 30])]  # + all decoding, none decoding
    for case in cases:
        query, k_cache, v_cache, metadata = make_batch(*case, 8, 2, 64, 256, torch.float32)
        expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
        for _layer in range(3):
            got = backend.forward(query, k_cache, v_cache, metadata, 0.125)
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert len(builds) == len(cases)
    query, k_cache, v_cache, metadata = make_batch([1, 1, 1], [5, 300, 40], 8, 2, 64, 256, torch.float32)
    metadata.query_lens_cpu = metadata.seq_lens_cpu = None
    backend.forward(query, k_cache, v_cache, metadata, 0.125)
    metadata.seq_lens.copy_(torch.tensor([6, 301, 41], dtype=torch.int32))  # the next replay's lengths
    metadata.max_seq_len = 301
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    got = backend.forward(query, k_cache, v_cache, metadata, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert len(builds) == len(cases) + 2


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_bfloat16_queries_over_a_float32_cache_are_close_to_the_reference(use_kernel):
    """The other mixed pairing (a bfloat16 model with kv_cache_dtype float32): the C++ kernel is instantiated
    for it too; the output is in the queries' dtype."""
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    query, k_cache, v_cache, metadata = make_batch([1, 1, 1], [5, 300, 600], 9, 3, 64, 256, torch.float32)
    query = query.bfloat16()
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    got = make_backend(use_kernel).forward(query, k_cache, v_cache, metadata, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


MASK_CASES = [
    # (query_lens, seq_lens, window, soft cap): decode rows inside, at and past the window; fresh and chunked
    # prompts longer than the window; contexts that fit it
    ([1, 1, 1, 1], [1, 24, 25, 700], 24, None),
    ([1, 37, 1, 20], [300, 37, 513, 290], 24, None),
    ([1, 37, 1, 20], [300, 37, 513, 290], None, 5.0),
    ([1, 37, 1, 20], [300, 37, 513, 290], 100, 20.0),
    ([12, 1, 30], [12, 20, 30], 64, None),
]


def backend_taking_every_step(use_kernel: bool, monkeypatch):
    """The backend under test; the C++ one must take every step itself (plain torch's prefill raises if reached)."""
    if use_kernel and cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    if use_kernel:
        def no_fallback(*args, **kwargs):
            raise AssertionError("a windowed, capped or sink step fell back to plain torch")

        monkeypatch.setattr(TorchBackend, "_prefill_one", no_fallback)
    return make_backend(use_kernel)


# float32: summation order only; bfloat16: the inputs' and output's rounding (a few ulps at 1.0 = 0.0078)
MASKED_TOLERANCE = {False: dict(atol=2e-5, rtol=1e-5), True: dict(atol=3e-2, rtol=3e-2)}


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", MASK_CASES)
def test_sliding_window_and_soft_cap_match_the_reference(use_kernel, bf16, case, monkeypatch):
    """Both backends (the C++ decode and prefill kernels, plain torch) against the reference's masked, capped
    attention; the C++ backend takes every such step itself."""
    backend = backend_taking_every_step(use_kernel, monkeypatch)
    query_lens, seq_lens, window, cap = case
    dtype = torch.bfloat16 if bf16 else torch.float32
    query, k_cache, v_cache, metadata = make_batch(query_lens, seq_lens, 8, 2, 64, 256, dtype)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125, sliding_window=window,
                                         soft_cap=cap)  # fmt: skip
    unmasked = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125)
    assert not torch.allclose(expected.float(), unmasked.float(), atol=1e-3) or max(seq_lens) <= (window or 0)
    got = backend.forward(query, k_cache, v_cache, metadata, 0.125, sliding_window=window, soft_cap=cap)
    torch.testing.assert_close(got.float(), expected.float(), **MASKED_TOLERANCE[bf16])


SINK_CASES = [
    # (query_lens, seq_lens, window, soft cap), every case with sinks: decode rows of one key and of many; fresh
    # and chunked prompts, under a sliding window (gpt-oss's odd layers) and over the whole context; with a soft cap
    ([1, 1, 1, 1], [1, 24, 25, 700], None, None),
    ([1, 37, 1, 20], [300, 37, 513, 290], 24, None),
    ([1, 37, 1, 20], [300, 37, 513, 290], None, 5.0),
    ([12, 1, 30], [12, 20, 30], 64, None),
]
SINKS = torch.tensor([-2.0, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0, 5.0])  # one a query head (8); up to most of the weight


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SINK_CASES)
def test_attention_sinks_match_the_reference(use_kernel, bf16, case, monkeypatch):
    """gpt-oss's sinks (one more logit a head in the softmax, with no value) on both backends: the C++ decode and
    prefill kernels take every such step themselves."""
    backend = backend_taking_every_step(use_kernel, monkeypatch)
    query_lens, seq_lens, window, cap = case
    dtype = torch.bfloat16 if bf16 else torch.float32
    query, k_cache, v_cache, metadata = make_batch(query_lens, seq_lens, 8, 2, 64, 256, dtype)
    mask = dict(sliding_window=window, soft_cap=cap)
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125, sinks=SINKS, **mask)
    without = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125, **mask)
    assert not torch.allclose(expected.float(), without.float(), atol=1e-2)
    got = backend.forward(query, k_cache, v_cache, metadata, 0.125, sinks=SINKS, **mask)
    torch.testing.assert_close(got.float(), expected.float(), **MASKED_TOLERANCE[bf16])


def test_decode_run_of_one_sequences_rows_keeps_each_rows_sinks():
    """Consecutive rows of one sequence (speculative decoding's layout), which the C++ decode kernel otherwise
    runs as one row: with sinks each row still gets its own softmax, sink included."""
    if cpu_ops() is None:
        pytest.skip("no C++ compiler for the CPU kernel")
    query, k_cache, v_cache, metadata = make_batch([1, 1, 1], [40, 41, 42], 8, 2, 64, 256, torch.float32)
    metadata.block_tables[1:] = metadata.block_tables[0]
    expected = paged_attention_reference(query, k_cache, v_cache, metadata, 0.125, sinks=SINKS)
    got = make_backend(True).forward(query, k_cache, v_cache, metadata, 0.125, sinks=SINKS)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
