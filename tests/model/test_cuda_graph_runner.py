"""The decode graph runner's buffer logic, on CPU: a stand-in capturer whose 'replay' re-runs the captured
step, which reads only the runner's static buffers. A stale row, a missing copy or a padded row writing
into the cache shows here exactly as it would on a GPU. (Real capture runs in tests/gpu.)"""

from __future__ import annotations

from collections import Counter

import pytest

from nanoinfer import LLM, SamplingParams
from nanoinfer.engine.cuda_graph import graph_batch_sizes


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
def test_graph_decode_matches_eager_as_the_batch_shrinks(tiny_model_dirs):
    model = str(tiny_model_dirs["qwen3"])
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
