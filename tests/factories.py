"""Small builders for engine tests: requests, sequences and schedulers with tiny defaults, knobs as keywords,
plus a model-free step driver (the test chooses the "sampled" tokens).

Block sizes: the product config wants a multiple of 256, but BlockManager takes any size. Scheduler tests
that mirror real configs use 256 (the default here); hand-written block-manager scenarios use 4 so the token
lists stay readable.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.ngram_proposer import NgramProposer
from nanoinfer.engine.scheduler import Scheduler, SchedulerOutput
from nanoinfer.engine.sequence import Request, Sequence
from nanoinfer.sampling_params import SamplingParams

EOS = 2  # the eos id every make_scheduler() knows unless told otherwise

_request_ids = itertools.count()


def make_request(
    prompt_token_ids: list[int] | None = None,
    *,
    num_prompt_tokens: int = 8,
    request_id: str | None = None,
    **sampling,
) -> Request:
    """A Request; the prompt defaults to `num_prompt_tokens` distinct ids (100, 101, ...: never EOS).
    Other keywords are SamplingParams fields (n=, max_tokens=, ignore_eos=, ...)."""
    if prompt_token_ids is None:
        prompt_token_ids = list(range(100, 100 + num_prompt_tokens))
    if request_id is None:
        request_id = f"req-{next(_request_ids)}"
    return Request(request_id, list(prompt_token_ids), SamplingParams(**sampling))


def make_seq(token_ids: list[int]) -> Sequence:
    """One sequence holding `token_ids` as its prompt (for block-manager tests)."""
    return make_request(token_ids).sequences[0]


def make_scheduler(
    *,
    num_blocks: int = 16,
    block_size: int = 256,
    enable_prefix_caching: bool = True,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 2048,
    eos_token_ids=(EOS,),
    proposer: NgramProposer | None = None,
) -> Scheduler:
    """A Scheduler over a fresh BlockManager (16 blocks of 256 tokens unless told otherwise)."""
    block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(
        block_manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        eos_token_ids=set(eos_token_ids),
        proposer=proposer,
    )


def fake_sampled(out: SchedulerOutput, choose: Callable[[Sequence], int] | int) -> dict[int, list[int]]:
    """What a model would sample this step: one token for each sequence whose scheduled tokens reach its end
    (a prefill chunk that stops short samples nothing). `choose` is a token id or seq -> token id."""
    sampled = {}
    for seq, num_new in out.scheduled:
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            sampled[seq.seq_id] = [choose(seq) if callable(choose) else choose]
    return sampled


def run_step(
    scheduler: Scheduler, choose: Callable[[Sequence], int] | int = 7
) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step without a model: schedule, "sample" with `choose`, update."""
    out = scheduler.schedule()
    finished = scheduler.update(out, fake_sampled(out, choose))
    return out, finished


def run_to_completion(
    scheduler: Scheduler,
    choose: Callable[[Sequence], int] | int = 7,
    max_steps: int = 10_000,
) -> list[Request]:
    """Step until nothing is unfinished; fails (instead of hanging) after `max_steps` steps."""
    finished: list[Request] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished:
            return finished
        finished += run_step(scheduler, choose)[1]
    raise AssertionError(
        f"still unfinished after {max_steps} steps: {scheduler.running + list(scheduler.waiting)}"
    )


def spec_of(config: dict):
    """The ModelSpec of a config.json's contents (a dict), as Config derives it through the registry."""
    import transformers

    from nanoinfer.models import registry

    values = {k: v for k, v in config.items() if k != "model_type"}
    return registry.model_spec(transformers.AutoConfig.for_model(config["model_type"], **values))


def stop_by_full_decode(tokenizer, output_token_ids: list[int], params: SamplingParams) -> tuple[int, str, str] | None:
    """Where params' stop strings end an output, found as nanoinfer found them before it detokenized incrementally:
    the whole output decoded after each token (from min_tokens on) and searched from its start, the stop string that
    starts first winning (then the first listed). Returns (output tokens kept, stop string, text before it), or None."""
    for n in range(max(params.min_tokens, 1), len(output_token_ids) + 1):
        text = tokenizer.decode(output_token_ids[:n], skip_special_tokens=params.skip_special_tokens)
        found = [(text.find(stop), i, stop) for i, stop in enumerate(params.stop) if stop in text]
        if found:
            index, _, stop = min(found)
            return n, stop, text[:index]
    return None


# ---- `nanoinfer generate` in a process of its own (the kill -9 and resume tests) ----------------------------------


def start_generate(source, out, *flags: str) -> subprocess.Popen:
    """`nanoinfer generate SOURCE -o OUT FLAGS...` in a subprocess (one OpenMP thread, no tokenizer threads), its
    stderr kept for the failure report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "nanoinfer", "generate", str(source), "-o", str(out), *flags]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def wait_for(proc: subprocess.Popen, condition: Callable[[], bool], timeout: float = 120.0,
             poll: float = 0.005) -> None:  # fmt: skip
    """Until `condition()` holds or the job has exited; the job must make progress within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and not condition():
        assert time.monotonic() < deadline, "the job made no progress"
        time.sleep(poll)


def count_lines(path: Path) -> int:
    """Whole lines written to `path` so far (0 before it exists)."""
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


# ---- Config's checks ---------------------------------------------------------------------------------------------


def config_problems(**kwargs) -> list:
    """The ConfigProblems Config(**kwargs) raises (it must raise)."""
    import pytest

    from nanoinfer.config import Config
    from nanoinfer.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        Config(**kwargs)
    return info.value.problems


def only_config_problem(**kwargs):
    """The one ConfigProblem Config(**kwargs) raises."""
    problems = config_problems(**kwargs)
    assert len(problems) == 1, [str(p) for p in problems]
    return problems[0]
