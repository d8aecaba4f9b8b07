"""Which attention backend runs where (backend.select_backend / Platform.attention_backend), and FlashAttnBackend's
calls into flash-attn, checked against a stand-in module since flash-attn does not install on CPU machines.
"""

import sys
import types

import pytest
import torch

from nanoinfer.attention import backend
from nanoinfer.attention.reference import paged_attention_reference, store_kvcache_reference
from nanoinfer.errors import ConfigError


@pytest.fixture
def installed(monkeypatch):
    """installed(flash_attn=..., triton=...): pretend these packages are (not) importable."""

    def set_installed(*, flash_attn: bool, triton: bool) -> None:
        monkeypatch.setattr(backend, "flash_attn_available", lambda: flash_attn)
        monkeypatch.setattr(backend, "triton_available", lambda: triton)

    return set_installed


# --- auto selection -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flash_attn", "triton", "device", "dtype", "expected"),
    [
        (True, True, "cuda", "bfloat16", "flash-attn"),
        (True, True, "cuda", "float32", "triton"),  # flash-attn has no float32 kernels
        (False, True, "cuda", "bfloat16", "triton"),  # flash-attn's build is optional: CUDA still gets kernels
        (False, False, "cuda", "bfloat16", "torch"),
        (False, True, "cpu", "float32", "torch"),
        (True, True, "cpu", "bfloat16", "torch"),  # neither kernel package runs on CPU
    ],
)
def test_auto_prefers_flash_attn_then_triton_on_cuda_and_torch_elsewhere(installed, flash_attn, triton, device,
                                                                          dtype, expected):
    installed(flash_attn=flash_attn, triton=triton)
    assert backend.select_backend("auto", device, dtype)[0] == expected


@pytest.mark.parametrize("requested", ["triton", "flash-attn"])
def test_forcing_a_cuda_backend_on_cpu_is_a_config_error_with_a_fix(installed, requested):
    installed(flash_attn=True, triton=True)
    with pytest.raises(ConfigError) as excinfo:
        backend.select_backend(requested, "cpu", "bfloat16")
    message = str(excinfo.value)
    assert f"attention_backend = '{requested}'" in message
    assert "runs only on CUDA but device is cpu" in message
    assert "Use attention_backend: torch (or auto)" in message


def test_forcing_flash_attn_without_the_package_names_the_install_command(installed):
    installed(flash_attn=False, triton=True)
    with pytest.raises(ConfigError, match=r"flash-attn package, which is not installed\. .*nanoinfer\[cuda\]"):
        backend.select_backend("flash-attn", "cuda", "bfloat16")


def test_forcing_flash_attn_in_float32_names_the_dtype_fix(installed):
    installed(flash_attn=True, triton=True)
    with pytest.raises(ConfigError, match=r"supports only float16 and bfloat16, but dtype is float32"):
        backend.select_backend("flash-attn", "cuda", "float32")


def test_heads_wider_than_flash_attn_takes_go_to_triton(installed):
    installed(flash_attn=True, triton=True)  # Gemma 4's global layers: heads of 512
    assert backend.select_backend("auto", "cuda", "bfloat16", max_head_dim=512)[0] == "triton"
    assert backend.select_backend("auto", "cuda", "bfloat16", max_head_dim=256)[0] == "flash-attn"
    with pytest.raises(ConfigError, match=r"heads of at most 256 features, but the model's widest has 512"):
        backend.select_backend("flash-attn", "cuda", "bfloat16", max_head_dim=512)


def test_forced_names_that_can_run_are_kept(installed):
    installed(flash_attn=False, triton=True)
    assert backend.select_backend("triton", "cuda", "float32") == ("triton", "set")
    assert backend.select_backend("torch", "cuda", "bfloat16") == ("torch", "set")


def test_the_platform_builds_the_named_backend():
    pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")
    from nanoinfer.platforms.cuda import CudaPlatform

    assert CudaPlatform().attention_backend("torch").name == "torch"
    assert CudaPlatform().attention_backend("triton").name == "triton"  # builds without touching the device


# --- FlashAttnBackend against a stand-in flash_attn ---------------------------------------------------


def _attend_one(q, k, v, scale):
    """Causal attention with flash-attn's bottom-right alignment; q [q_len, H, D], k/v [k_len, H_kv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_len, k_len = q.shape[0], k.shape[0]
    hidden = torch.arange(k_len).unsqueeze(0) > torch.arange(q_len).unsqueeze(1) + (k_len - q_len)
    probs = torch.softmax(scores.masked_fill(hidden.to(scores.device), float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def _paged_keys(cache, table, length):
    block_size = cache.shape[1]
    return torch.cat([cache[block_id] for block_id in table[: -(-length // block_size)].tolist()])[:length]


def _check_inputs(q, k_cache, block_table, *int32_tensors):
    # What flash-attn 2.x itself rejects, so a wrong call fails here rather than only on a GPU.
    assert q.dtype in (torch.float16, torch.bfloat16) and k_cache.dtype == q.dtype
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert all(t.dtype == torch.int32 for t in int32_tensors)
    if block_table is not None:
        assert block_table.dtype == torch.int32 and k_cache.shape[1] % 256 == 0


def make_fake_flash_attn(calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        calls.append(("varlen", block_table is not None))
        _check_inputs(q, k, block_table, cu_seqlens_q, cu_seqlens_k)
        assert causal and dropout_p == 0.0
        out = torch.empty_like(q)
        q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        for i in range(len(q_starts) - 1):
            k_len = k_starts[i + 1] - k_starts[i]
            assert q_starts[i + 1] - q_starts[i] <= max_seqlen_q and k_len <= max_seqlen_k
            if block_table is None:
                keys, values = k[k_starts[i] : k_starts[i + 1]], v[k_starts[i] : k_starts[i + 1]]
            else:
                keys, values = _paged_keys(k, block_table[i], k_len), _paged_keys(v, block_table[i], k_len)
            out[q_starts[i] : q_starts[i + 1]] = _attend_one(q[q_starts[i] : q_starts[i + 1]], keys, values,
                                                              softmax_scale)
        return out

    def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        calls.append(("with_kvcache", block_table is not None))
        _check_inputs(q, k_cache, block_table, cache_seqlens)
        assert q.dim() == 4 and k is None and v is None
        out = torch.empty_like(q)
        for i, seq_len in enumerate(cache_seqlens.tolist()):
            keys = _paged_keys(k_cache, block_table[i], seq_len)
            values = _paged_keys(v_cache, block_table[i], seq_len)
            out[i] = _attend_one(q[i], keys, values, softmax_scale)
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_with_kvcache = flash_attn_with_kvcache
    return module


@pytest.mark.parametrize(
    ("specs", "expected_call"),
    [
        pytest.param([(299, 1), (4, 1), (511, 1)], ("with_kvcache", True), id="pure-decode"),
        pytest.param([(299, 1), (0, 12), (250, 9)], ("varlen", True), id="cached-prefix"),
        pytest.param([(0, 7), (0, 12)], ("varlen", False), id="fresh-prompts"),
    ],
)
def test_flash_attn_backend_calls_match_the_reference(monkeypatch, installed, paged_batch, specs, expected_call):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", make_fake_flash_attn(calls))
    installed(flash_attn=True, triton=True)
    from nanoinfer.platforms.cuda import CudaPlatform

    attn = CudaPlatform().attention_backend("flash-attn")
    assert attn.name == "flash-attn"
    batch = paged_batch(specs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=256, dtype=torch.bfloat16)
    store_kvcache_reference(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)

    out = attn.forward(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125,
                       new_kv=(batch.key, batch.value))

    assert calls == [expected_call]
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125)
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)


def test_flash_attn_backend_runs_layers_with_sinks_on_the_triton_kernels(monkeypatch, installed, paged_batch):
    """flash-attn has no attention sinks (gpt-oss): such a layer runs on our Triton kernels over the same cache."""
    pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[dev]'")
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", make_fake_flash_attn(calls))
    installed(flash_attn=True, triton=True)
    from nanoinfer.platforms.cuda import CudaPlatform

    attn = CudaPlatform().attention_backend("flash-attn")
    batch = paged_batch([(299, 1), (0, 12), (250, 9)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=256,
                        dtype=torch.bfloat16)  # fmt: skip
    store_kvcache_reference(batch.key, batch.value, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping)
    sinks = torch.tensor([-2.0, 0.5, 2.0, 5.0], device=batch.query.device)

    out = attn.forward(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125,
                       new_kv=(batch.key, batch.value), sliding_window=24, sinks=sinks)  # fmt: skip

    assert calls == []
    expected = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125,
                                         sliding_window=24, sinks=sinks)  # fmt: skip
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)
