"""check-config and plan-memory on every model family's tiny folder: the config is accepted, and plan-memory's
KV bytes a token are what the engine allocates (every layer that owns a cache, each of its own shape), as are a
hybrid model's state bytes a sequence slot."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.testing.tiny_models import TINY_FAMILIES, build_tiny_model

runner = CliRunner()


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_check_config_and_plan_memory_take_every_family(tmp_path, family):
    folder = build_tiny_model(family, tmp_path / family)
    checked = runner.invoke(app, ["check-config", "--model", str(folder), "--device", "cpu"])
    assert checked.exit_code == 0, checked.output
    planned = runner.invoke(app, ["plan-memory", "--model", str(folder), "--gpu", "H100", "--dtype", "float32",
                                  "--json"])  # fmt: skip
    assert planned.exit_code == 0, planned.output
    report = json.loads(planned.stdout)
    assert report["fits"]

    from nanoinfer import LLM

    llm = LLM(str(folder), device="cpu", dtype="float32", max_model_len=256, cpu_kvcache_space_gib=0.05)
    runner_ = llm.engine.model_runner
    allocated = [k for k, _ in runner_.kv_cache.layers]  # the layers that own a cache (not those sharing one)
    bytes_per_token = sum(2 * k.shape[2] * k.shape[3] * k.element_size() for k in allocated)
    assert report["kv_bytes_per_token"] == bytes_per_token
    states = runner_.state_cache or []
    slot_bytes = sum(t[0].numel() * t.element_size() for pair in states for t in pair)  # one slot of each tensor
    assert report["state_slot_bytes"] == slot_bytes
    assert report["num_state_slots"] == (report["max_num_seqs"] if states else 0)  # an H100 holds every slot
    assert llm.engine.plan.num_state_slots == runner_.num_state_slots == llm.engine.block_manager.num_state_slots


def test_a_family_that_runs_on_one_rank_is_refused_more_ranks_by_name(tmp_path):
    folder = build_tiny_model("gemma4", tmp_path / "gemma4")
    checked = runner.invoke(app, ["check-config", "--model", str(folder), "--device", "cpu", "--tp", "2"])
    assert checked.exit_code == 2
    assert "must be 1 for Gemma4ForCausalLM" in checked.output
    planned = runner.invoke(app, ["plan-memory", "--model", str(folder), "--gpu", "H100", "--tp", "2"])
    assert planned.exit_code == 2
    assert "runs Gemma4ForCausalLM on one rank only" in planned.output
