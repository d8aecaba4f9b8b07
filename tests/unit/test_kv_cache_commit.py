"""LazyKVCache.commit_new_blocks (platforms/cpu/kv_cache.py): the CPU KV cache is committed a whole block at a
time, at the block's first write, and never again (a second commit would wipe the rows already stored there)."""

from __future__ import annotations

import pytest
import torch

from nanoinfer import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_model_len=1024, cpu_kvcache_space_gib=0.25, max_num_seqs=4)


def test_fresh_blocks_are_zeroed_in_every_layer_and_written_blocks_are_left_alone(llm):
    runner = llm.engine.model_runner
    bs = runner.block_size
    runner.kv_cache.committed.zero_()
    for k_cache, v_cache in runner.kv_caches:
        k_cache[:4].fill_(7.0)
        v_cache[:4].fill_(7.0)
    runner.kv_cache.committed[1] = True  # block 1 holds rows already: a commit must not touch it
    # A step writing into blocks 1 and 2, and a padded row (-1) that writes nothing.
    runner.kv_cache.commit_new_blocks(torch.tensor([bs + 5, 2 * bs, 2 * bs + 1, -1]))
    assert runner.kv_cache.committed.tolist() == [False, True, True] + [False] * (runner.num_blocks - 3)
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            assert bool((cache[2] == 0).all())  # fresh: committed whole
            assert bool((cache[1] == 7).all()) and bool((cache[0] == 7).all()) and bool((cache[3] == 7).all())


def test_a_run_commits_the_blocks_its_sequences_hold_and_no_others(llm):
    runner = llm.engine.model_runner
    runner.allocate_kv_cache(runner.num_blocks)  # a fresh cache: nothing committed
    assert not bool(runner.kv_cache.committed.any())
    prompts = [[1, 2, 3] * 100, [4, 5] * 20]  # 300 tokens + 8 outputs: 2 blocks; 40 + 8: 1 block
    first = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert int(runner.kv_cache.committed.sum()) == 3 < runner.num_blocks
    # A second run shares what the first left: the long prompt's full first block through its hash, and the rows
    # of both prompts' partly filled blocks, copied into two blocks committed now (the blocks they come from hold
    # the first run's outputs past them, which the copies keep findable). The same tokens.
    again = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]
    assert [o.num_cached_tokens for o in again] == [299, 39]
    assert int(runner.kv_cache.committed.sum()) == 5
