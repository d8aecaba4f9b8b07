"""The decode graph runner's buffer logic, on CPU: a stand-in capturer whose 'replay' re-runs the captured
step, which reads only the runner's static buffers. A stale row, a missing copy or a padded row writing
into the cache shows here exactly as it would on a GPU. (Real capture runs in tests/gpu.)"""

from __future__ import annotations

from collections import Counter

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.platforms.cuda.cuda_graph import graph_batch_sizes


class ReplayingCapturer:
    def __init__(self):
        self.replays: Counter = Counter()

    def capture(self, fn, pool):
        bs = len(self.replays)  # one key per captured bucket, in capture order

        def replay():
            self.replays[bs] += 1
            fn()

        self.replays[bs] = 0
        return replay, pool

    def synchronize(self):
        pass


@pytest.mark.parametrize("max_num_seqs, expected", [
    (1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]), (1024, [1, 2, 4, 8] + list(range(16, 513, 16))),
])  # fmt: skip
def test_graph_batch_sizes_cover_every_batch_up_to_max_num_seqs(max_num_seqs, expected):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == expected
    assert all(any(s >= n for s in sizes) for n in range(1, min(max_num_seqs, 512) + 1))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_graph_decode_matches_eager_as_the_batch_shrinks(tiny_model_dirs, tmp_path, family):
    """Qwen3.5 too: its linear-attention layers' padded rows (state slot -1) must leave every slot alone."""
    from nanoinfer.testing.tiny_models import build_tiny_model

    model = str(tiny_model_dirs[family] if family in tiny_model_dirs else build_tiny_model(family, tmp_path / family))
    # Different lengths so the batch shrinks 7 -> 1 through buckets 8, 4, 2, 1 (padded rows in most steps),
    # and freed blocks are reused by later requests while padded rows still hold their old slots.
    prompts = [f"Prompt {i}: the quick brown fox" + " jumps" * i for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(10)]
    settings = dict(max_model_len=128, cpu_kvcache_space_gib=0.05, max_num_seqs=7,
                    enable_prefix_caching=False)  # fmt: skip
    eager = [o.token_ids for o in LLM(model, **settings).generate(prompts, params)]

    llm = LLM(model, **settings)
    capturer = ReplayingCapturer()
    llm.engine.model_runner.capture_cuda_graphs(capturer=capturer)
    runner = llm.engine.model_runner.graph_runner
    assert runner.batch_sizes == [1, 2, 4, 7]
    graphed = [o.token_ids for o in llm.generate(prompts, params)]
    assert graphed == eager
    used = {bs for bs, count in capturer.replays.items() if count}
    assert len(used) >= 3  # several buckets replayed, not one


def test_reallocating_the_cache_drops_the_graphs(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["qwen3"]), max_model_len=64, cpu_kvcache_space_gib=0.02, max_num_seqs=2)
    runner = llm.engine.model_runner
    runner.capture_cuda_graphs(capturer=ReplayingCapturer())
    assert runner.graph_runner is not None
    runner.allocate_kv_cache(runner.num_blocks)
    assert runner.graph_runner is None
    assert not runner.uses_cuda_graphs  # CPU: the engine never captures here


def test_graph_memory_is_measured_even_though_capture_empties_the_allocator_cache(monkeypatch):
    """torch.cuda.graph() empties the caching allocator on entry. The warm-up pass's cached activations then
    go back to the driver during the capture and used to cancel out the graphs' own pool (an H200 run
    measured 0 bytes). A fake allocator replays that: 300 MiB cached, a 40 MiB graph pool, 2 MiB of
    instantiated graphs outside the allocator."""
    from nanoinfer.platforms.cuda import memory_planning as engine

    mib = 2**20
    gpu = {"live": 1000 * mib, "cached": 300 * mib, "pool": 0, "driver": 0, "total": 10_000 * mib}

    def empty_cache():
        gpu["cached"] = 0

    def reserved() -> int:
        return gpu["live"] + gpu["cached"] + gpu["pool"]

    class Runner:
        def capture_cuda_graphs(self):
            empty_cache()  # what torch.cuda.graph() does first
            gpu["pool"], gpu["driver"] = 40 * mib, 2 * mib

        def release_cuda_graphs(self):
            gpu["pool"] = gpu["driver"] = 0

    monkeypatch.setattr(engine.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(engine.torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(engine.torch.cuda, "memory_reserved", reserved)
    monkeypatch.setattr(engine.torch.cuda, "mem_get_info",
                        lambda: (gpu["total"] - reserved() - gpu["driver"], gpu["total"]))  # fmt: skip
    assert engine._measure_cuda_graph_bytes(Runner()) == 42 * mib


@pytest.mark.timeout(300)
def test_graph_steps_give_prompt_logprobs_and_copy_shared_rows_as_eager(tiny_model_dirs):
    """Two sequences and a two-token budget: once one decodes, the other's prompt goes a row a step through the
    graphs, its prompt logprobs read from the graph's outputs; a follower admitted beside a decoding sequence gets a
    copy of the shared context rows before its first replay."""
    model = str(tiny_model_dirs["qwen3"])
    settings = dict(max_model_len=128, cpu_kvcache_space_gib=0.05, max_num_seqs=2, max_num_batched_tokens=2)
    context = list(range(40, 80))
    tails = [[7, 8, 9], [11, 12], [13, 14, 15, 16]]
    score = SamplingParams(max_tokens=0, prompt_logprobs=2)
    generate = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm):
        outs = llm.generate([context + tails[0]], generate)  # leaves the context's rows in the cache
        llm.add_request(context + tails[1], generate, request_id="owner")  # copies the context's rows
        while not llm.engine.scheduler.running or llm.engine.scheduler.running[0].num_output_tokens == 0:
            outs += llm.step()[0]
        llm.add_request(context + tails[2], score, request_id="copier", prompt_logprobs_start=len(context))
        while llm.has_unfinished_requests():
            outs += llm.step()[0]
        return sorted(outs, key=lambda o: o.request_id)

    eager = run(LLM(model, **settings))
    llm = LLM(model, **settings)
    capturer = ReplayingCapturer()
    llm.engine.model_runner.capture_cuda_graphs(capturer=capturer)
    copies = []
    copy_rows = llm.engine.model_runner.kv_cache.copy_rows
    llm.engine.model_runner.kv_cache.copy_rows = lambda c: copies.append(c) or copy_rows(c)
    graphed = run(llm)
    assert sum(capturer.replays.values()) > 10 and len(copies) == 2  # the owner's (eager), the copier's (graphed)
    for a, b in zip(eager, graphed):
        assert b.token_ids == a.token_ids and b.num_cached_tokens == a.num_cached_tokens
    (a, b), n = (eager[1], graphed[1]), len(context)
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in b.prompt_logprobs[n:]] == \
        [(lp.token_id, [t for t, _ in lp.top]) for lp in a.prompt_logprobs[n:]]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[n:], b.prompt_logprobs[n:])) < 1e-5
    assert [(o.request_id, o.num_cached_tokens) for o in graphed[1:]] == [("copier", 39), ("owner", 40)]


def test_graph_decode_with_lora_adapters_matches_eager(tiny_model_dirs, tmp_path):
    """Rows of three adapters and the base model through the graphs: each replay reads the slots its step copied into
    the LoRA row buffer (padded rows -1), as the eager steps compute them; adapters swap slots between steps."""
    from nanoinfer import LoRARequest
    from nanoinfer.testing.tiny_lora import build_tiny_adapter

    model = str(tiny_model_dirs["llama"])
    targets = [("q_proj", "v_proj"), ("o_proj", "gate_proj", "down_proj"), ("k_proj", "up_proj")]
    loras = [LoRARequest(f"a{i}", i, str(build_tiny_adapter(model, tmp_path / f"a{i}", rank=4 * i,
                                                            target_modules=t, seed=i)))
             for i, t in enumerate(targets, start=1)]  # fmt: skip
    prompts = [f"Prompt {i}: the quick brown fox" + " jumps" * i for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(10)]
    choice = [([None, *loras])[i % 4] for i in range(10)]
    settings = dict(max_model_len=128, cpu_kvcache_space_gib=0.05, max_num_seqs=7, enable_lora=True, max_loras=2,
                    max_lora_rank=12)  # fmt: skip
    eager = [o.token_ids for o in LLM(model, **settings).generate(prompts, params, lora_request=choice)]
    llm = LLM(model, **settings)
    capturer = ReplayingCapturer()
    llm.engine.model_runner.capture_cuda_graphs(capturer=capturer)
    graphed = [o.token_ids for o in llm.generate(prompts, params, lora_request=choice)]
    assert graphed == eager
    assert sum(capturer.replays.values()) > 10
    base = [o.token_ids for o in LLM(model, **{k: v for k, v in settings.items() if "lora" not in k}).generate(
        prompts, params)]  # fmt: skip
    for lora in loras:  # each adapter changes what its rows say
        assert [g for g, c in zip(graphed, choice) if c == lora] != [b for b, c in zip(base, choice) if c == lora]
