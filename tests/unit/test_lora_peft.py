"""PEFT adapter folders (lora/peft.py): every refusal is one clear problem line, never a traceback, and what is read
scales like PEFT. Hand-written folders (adapter_config.json + safetensors) for the refusals; adapters PEFT saves for
the scalings (alpha_pattern, rank_pattern, rsLoRA) and a vision-language checkpoint's names, compared with
transformers + PEFT token for token (greedy, float32)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from nanoinfer import LLM, LoRARequest, SamplingParams
from nanoinfer.errors import LoRAError
from nanoinfer.lora.peft import adapter_problems, adapter_rank, read_adapter
from nanoinfer.testing.tiny_lora import build_tiny_adapter, peft_greedy
from nanoinfer.testing.tiny_models import build_tiny_model

HIDDEN, KV, MLP = 64, 32, 128
# A two-layer model's adaptable modules as ModelSpec.lora_shapes names them: module -> (in, out) features
SHAPES = {}
for _i in range(2):
    _layer = f"model.layers.{_i}"
    SHAPES |= {f"{_layer}.self_attn.q_proj": (HIDDEN, HIDDEN), f"{_layer}.self_attn.k_proj": (HIDDEN, KV),
               f"{_layer}.self_attn.v_proj": (HIDDEN, KV), f"{_layer}.self_attn.o_proj": (HIDDEN, HIDDEN),
               f"{_layer}.mlp.gate_proj": (HIDDEN, MLP), f"{_layer}.mlp.up_proj": (HIDDEN, MLP),
               f"{_layer}.mlp.down_proj": (MLP, HIDDEN)}  # fmt: skip
Q0, V1 = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.v_proj"
KEY = "base_model.model.{}.lora_{}.weight"


def lora_tensors(module: str, rank: int = 4, fan_in: int | None = None, fan_out: int | None = None, seed: int = 0):
    """lora_A [rank, in] and lora_B [out, rank] of `module` (SHAPES' features unless told)."""
    default_in, default_out = SHAPES.get(module, (HIDDEN, HIDDEN))
    generator = torch.Generator().manual_seed(seed)
    return {KEY.format(module, "A"): torch.randn(rank, fan_in or default_in, generator=generator),
            KEY.format(module, "B"): torch.randn(fan_out or default_out, rank, generator=generator)}  # fmt: skip


def write_adapter(path: Path, config: dict | None = None, tensors: dict | None = None, **fields) -> Path:
    """A PEFT folder: adapter_config.json (a plain rank-4 LoRA on q_proj and v_proj, `fields` replacing or adding
    keys; `config` as the whole file instead, a dict or raw text) and adapter_model.safetensors (`tensors`, or
    layer 0's q_proj and layer 1's v_proj at rank 4)."""
    path.mkdir(parents=True, exist_ok=True)
    if config is None:
        config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                  "base_model_name_or_path": "org/tiny-base", "bias": "none", **fields}  # fmt: skip
    (path / "adapter_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if tensors is None:
        tensors = lora_tensors(Q0) | lora_tensors(V1, seed=1)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path


def only_problem(path: Path, max_lora_rank: int = 16, shapes: dict = SHAPES) -> str:
    problems = adapter_problems(path, max_lora_rank, shapes)
    assert len(problems) == 1, problems
    return problems[0]


def test_a_plain_adapter_has_no_problems_and_reads_scaled_weights(tmp_path):
    path = write_adapter(tmp_path / "plain")
    assert adapter_problems(path, 16, SHAPES) == []
    adapter = read_adapter(path, 16, SHAPES)
    assert [(t.module, t.rank, t.scaling) for t in adapter.targets] == [(Q0, 4, 2.0), (V1, 4, 2.0)]
    weights = adapter.read_weights()
    tensors = lora_tensors(Q0)
    torch.testing.assert_close(weights[Q0][0], tensors[KEY.format(Q0, "A")])
    torch.testing.assert_close(weights[Q0][1], tensors[KEY.format(Q0, "B")] * 2.0)  # B carries lora_alpha / r


# ---- what PEFT can save that nanoinfer does not run -------------------------------------------------------------


def test_modules_to_save_is_one_problem(tmp_path):
    # PEFT saves the replaced module's weights beside the LoRA (base_model.model.lm_head.weight): said once
    tensors = lora_tensors(Q0) | {"base_model.model.lm_head.weight": torch.zeros(256, HIDDEN)}
    problem = only_problem(write_adapter(tmp_path / "a", tensors=tensors, modules_to_save=["lm_head"]))
    assert "modules_to_save is ['lm_head']" in problem and "merge_and_unload" in problem
    assert only_problem(write_adapter(tmp_path / "b", tensors=tensors, modules_to_save="lm_head")).startswith(
        "modules_to_save is 'lm_head': adapters that replace whole modules")  # one name, not PEFT's list
    for odd in (5, {"lm_head": True}):  # no list of names at all: a problem, the module's weight one more
        problems = adapter_problems(write_adapter(tmp_path / "c", tensors=tensors, modules_to_save=odd), 16, SHAPES)
        assert problems[0].startswith(f"modules_to_save is {odd!r}: adapters that replace whole modules")
        assert problems[1].startswith("base_model.model.lm_head.weight: not a LoRA weight nanoinfer reads")


@pytest.mark.parametrize("fields", [dict(bias="lora_only"), dict(lora_bias=True)])
def test_lora_biases_are_one_problem(tmp_path, fields):
    tensors = lora_tensors(Q0) | {f"base_model.model.{Q0}.lora_B.bias": torch.zeros(HIDDEN)}
    problem = only_problem(write_adapter(tmp_path / "a", tensors=tensors, **fields))
    assert "trains biases" in problem and "bias='none'" in problem


def test_dora_is_one_problem_not_two(tmp_path):
    # use_dora in the config and the magnitude vectors in the file say the same thing: one problem
    tensors = lora_tensors(Q0) | {f"base_model.model.{Q0}.lora_magnitude_vector": torch.ones(HIDDEN)}
    problem = only_problem(write_adapter(tmp_path / "a", tensors=tensors, use_dora=True))
    assert "use_dora is true" in problem and "DoRA" in problem


def test_dora_magnitudes_without_use_dora_are_still_refused(tmp_path):
    tensors = lora_tensors(Q0) | {f"base_model.model.{Q0}.lora_magnitude_vector": torch.ones(HIDDEN)}
    assert "DoRA" in only_problem(write_adapter(tmp_path / "a", tensors=tensors))


def test_another_peft_method_is_refused(tmp_path):
    assert "peft_type is 'LOHA': nanoinfer runs LoRA adapters only" in only_problem(
        write_adapter(tmp_path / "a", peft_type="LOHA"))


# ---- folders that are not (complete) PEFT adapters ---------------------------------------------------------------


def test_adapter_model_bin_alone_gets_the_conversion_hint(tmp_path):
    path = tmp_path / "a"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    (path / "adapter_model.bin").write_bytes(b"pickle")
    problem = only_problem(path)
    assert "adapter_model.safetensors is missing" in problem
    assert "adapter_model.bin" in problem and "safe_serialization=True" in problem


def test_missing_config_is_a_problem(tmp_path):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_config.json").unlink()
    assert "adapter_config.json is missing: is this a PEFT adapter folder?" in only_problem(path)


@pytest.mark.parametrize("text, expected", [("{not json", "is not valid JSON"), ("[1, 2]", "is not a JSON object"),
                                            ('{"r": ' * 100_000, "is not a PEFT LoRA adapter this nanoinfer reads: "
                                             "RecursionError")])  # fmt: skip
def test_a_config_that_is_no_json_object_is_a_problem(tmp_path, text, expected):
    # the last: nesting deep enough for a RecursionError, caught as one problem too
    assert expected in only_problem(write_adapter(tmp_path / "a", config=text))


def test_a_folder_that_is_not_there_is_a_problem(tmp_path):
    assert "is not a folder" in only_problem(tmp_path / "nowhere")


def test_a_broken_safetensors_file_is_a_problem(tmp_path):
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad}")
    assert "is not a readable safetensors file" in only_problem(path)


# ---- tensors ----------------------------------------------------------------------------------------------------


def test_another_base_models_shapes_name_the_base_model(tmp_path):
    tensors = lora_tensors(Q0, fan_in=96, fan_out=96) | lora_tensors(V1, fan_in=96, fan_out=48)
    problem = only_problem(write_adapter(tmp_path / "a", tensors=tensors, base_model_name_or_path="org/other-7b"))
    assert problem.startswith("the adapter was trained for org/other-7b, not this model:")
    assert f"{Q0} maps 96 -> 96 features, this model's 64 -> 64" in problem


def test_rank_over_max_is_one_problem_listing_the_modules(tmp_path):
    tensors = lora_tensors(Q0, rank=32) | lora_tensors(V1, rank=24) | lora_tensors("model.layers.0.mlp.down_proj")
    problem = only_problem(write_adapter(tmp_path / "a", tensors=tensors), max_lora_rank=16)
    assert problem.startswith(f"rank 32, over max_lora_rank 16 ({Q0}, {V1}): raise max_lora_rank (--max-lora-rank 32)")


def test_lora_a_without_lora_b_is_a_problem(tmp_path):
    tensors = lora_tensors(V1) | {KEY.format(Q0, "A"): torch.zeros(4, HIDDEN)}
    assert only_problem(write_adapter(tmp_path / "a", tensors=tensors)) == f"{Q0} has lora_B missing."


def test_ranks_of_a_and_b_that_differ_are_a_problem(tmp_path):
    tensors = lora_tensors(V1) | {KEY.format(Q0, "A"): torch.zeros(4, HIDDEN),
                                  KEY.format(Q0, "B"): torch.zeros(HIDDEN, 8)}  # fmt: skip
    assert only_problem(write_adapter(tmp_path / "a", tensors=tensors)) == f"{Q0}: lora_A has rank 4, lora_B 8."


@pytest.mark.parametrize("a_shape, b_shape", [((4 * HIDDEN,), (HIDDEN, 4)), ((4, HIDDEN), (HIDDEN * 4,)),
                                              ((0, HIDDEN), (HIDDEN, 0)), ((1, 4, HIDDEN), (HIDDEN, 4))])  # fmt: skip
def test_tensors_that_are_no_lora_matrices_are_a_problem(tmp_path, a_shape, b_shape):
    # a 1-D or 3-D tensor (unsharded ZeRO-3 saves: 1-D) and rank 0, once a ValueError or a ZeroDivisionError
    tensors = lora_tensors(V1) | {KEY.format(Q0, "A"): torch.zeros(a_shape), KEY.format(Q0, "B"): torch.zeros(b_shape)}
    path = write_adapter(tmp_path / "a", tensors=tensors)
    problem = only_problem(path)
    assert problem.startswith(f"tensors that are no LoRA matrices: {Q0} (lora_A {list(a_shape)}, lora_B "
                              f"{list(b_shape)})")  # fmt: skip
    assert "lora_A is [rank, in_features]" in problem and "PeftModel.save_pretrained" in problem
    with pytest.raises(LoRAError, match="no LoRA matrices"):
        read_adapter(path, 16, SHAPES)


def test_unknown_targets_name_the_supported_ones(tmp_path):
    tensors = lora_tensors(Q0) | lora_tensors("lm_head", fan_in=HIDDEN, fan_out=256)
    problem = only_problem(write_adapter(tmp_path / "a", tensors=tensors))
    assert problem.startswith("targets modules nanoinfer does not adapt in this model: lm_head.")
    assert "q_proj, k_proj, v_proj" in problem


# ---- config values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, expected", [
    (dict(alpha_pattern=["q_proj"]), "alpha_pattern is ['q_proj']: expected a mapping of module-name patterns"),
    (dict(rank_pattern="q_proj"), "rank_pattern is 'q_proj': expected a mapping of module-name patterns"),
    (dict(alpha_pattern={"(q_proj": 16}), "alpha_pattern key '(q_proj' is not a valid regular expression"),
    (dict(rank_pattern={"[v_proj": 4}), "rank_pattern key '[v_proj' is not a valid regular expression"),
    (dict(alpha_pattern={"q_proj": "big"}), "alpha_pattern['q_proj'] is 'big': expected a positive number"),
    (dict(alpha_pattern={"q_proj": None}), "alpha_pattern['q_proj'] is None: expected a positive number"),
    (dict(alpha_pattern={"q_proj": float("inf")}), "alpha_pattern['q_proj'] is inf: expected a positive number"),
    (dict(rank_pattern={"q_proj": 0}), "rank_pattern['q_proj'] is 0: expected a positive number"),
    (dict(lora_alpha="16"), "lora_alpha is '16': expected a positive number"),
    # past float's range: alpha / r would overflow
    (dict(lora_alpha=10**400), "lora_alpha is 1" + "0" * 400 + ": expected a positive number"),
    (dict(lora_alpha=float("nan")), "lora_alpha is nan: expected a positive number"),
    (dict(r=True), "r is True: expected a positive number"),
    (dict(r=-4), "r is -4: expected a positive number"),
    (dict(use_rslora="yes"), "use_rslora is 'yes': expected true or false"),
])  # fmt: skip
def test_malformed_config_values_are_one_problem_each(tmp_path, fields, expected):
    path = write_adapter(tmp_path / "a", **fields)
    problem = only_problem(path)
    assert problem.startswith(expected), problem
    assert "Fix it in adapter_config.json, or save the adapter again" in problem  # the fix
    with pytest.raises(LoRAError, match=re.escape(expected)):
        read_adapter(path, 16, SHAPES, "broken")


def test_every_config_and_tensor_problem_is_listed_at_once(tmp_path):
    tensors = lora_tensors(V1) | {KEY.format(Q0, "A"): torch.zeros(HIDDEN), KEY.format(Q0, "B"): torch.zeros(HIDDEN)}
    path = write_adapter(tmp_path / "a", tensors=tensors, alpha_pattern={"(": "x"}, rank_pattern=[1])
    problems = adapter_problems(path, 16, SHAPES)
    assert len(problems) == 4, problems
    assert [p.split(" ")[0] for p in problems] == ["rank_pattern", "alpha_pattern", "alpha_pattern['(']", "tensors"]


def test_anything_unforeseen_in_a_header_is_one_problem_not_a_traceback(tmp_path, monkeypatch):
    import nanoinfer.lora.peft as peft_module

    path = write_adapter(tmp_path / "a")

    def broken_open(*args, **kwargs):
        raise RuntimeError("an error no check foresaw\nsecond line")

    monkeypatch.setattr(peft_module, "_read_config", broken_open)
    assert only_problem(path) == (f"{path} is not a PEFT LoRA adapter this nanoinfer reads: RuntimeError: an error "
                                  "no check foresaw.")  # fmt: skip


def test_adapter_rank_reads_rank_pattern_and_never_raises(tmp_path):
    assert adapter_rank(write_adapter(tmp_path / "a", r=8, rank_pattern={"q_proj": 32})) == 32
    assert adapter_rank(write_adapter(tmp_path / "b", r=float("inf"))) is None
    assert adapter_rank(write_adapter(tmp_path / "c", rank_pattern=["q_proj"])) is None


# ---- vision-language checkpoints --------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_a_vision_language_checkpoints_language_model_names_are_the_text_models(tmp_path, prefix):
    # transformers 5's layout and the older one; the tensors are read under the file's names
    file_q, file_v = (prefix + m.removeprefix("model.") for m in (Q0, V1))
    tensors = lora_tensors(file_q, fan_in=HIDDEN, fan_out=HIDDEN)
    tensors |= lora_tensors(file_v, fan_in=HIDDEN, fan_out=KV, seed=1)
    path = write_adapter(tmp_path / "a", tensors=tensors, alpha_pattern={re.escape(file_q): 16})
    adapter = read_adapter(path, 16, SHAPES)
    assert [(t.module, t.file_module, t.scaling) for t in adapter.targets] == [(Q0, file_q, 4.0), (V1, file_v, 2.0)]
    weights = adapter.read_weights()
    torch.testing.assert_close(weights[V1][0], tensors[KEY.format(file_v, "A")])
    torch.testing.assert_close(weights[Q0][1], tensors[KEY.format(file_q, "B")] * 4.0)


@pytest.mark.parametrize("tower, what", [
    ("model.vision_tower.encoder.layers.0.self_attn.q_proj", "the vision tower"),
    ("model.visual.blocks.0.attn.qkv", "the vision tower"),
    ("multi_modal_projector.linear_1", "the multimodal projector"),
    ("model.audio_tower.layers.0.self_attn.q_proj", "the audio tower"),
])  # fmt: skip
def test_vision_and_audio_tower_targets_are_skipped_beside_text_ones(tmp_path, tower, what):
    """Text prompts never reach a tower: its deltas change nothing nanoinfer computes (PEFT's text output is the
    same), so they are skipped; an adapter of towers alone is a problem."""
    text = lora_tensors("model.language_model.layers.0.self_attn.q_proj")
    both = write_adapter(tmp_path / "a", tensors=text | lora_tensors(tower, fan_in=16, fan_out=16))
    assert [t.module for t in read_adapter(both, 16, SHAPES).targets] == [Q0]
    alone = write_adapter(tmp_path / "b", tensors=lora_tensors(tower, fan_in=16, fan_out=16))
    assert only_problem(alone).startswith(f"targets only {what} ({tower}), which nanoinfer does not run")


def test_two_names_of_one_module_are_a_problem(tmp_path):
    tensors = lora_tensors(Q0) | lora_tensors("model.language_model.layers.0.self_attn.q_proj")
    assert "both adapt this model's model.layers.0.self_attn.q_proj" in only_problem(
        write_adapter(tmp_path / "a", tensors=tensors))


# ---- scaling equals PEFT's (adapters PEFT saved, generation compared token for token) ---------------------------

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def make_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(4, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def test_odd_adapters_are_errors_through_the_llm_not_tracebacks(llama, tmp_path):
    from nanoinfer.errors import ConfigError, RequestError

    q0 = lora_tensors(Q0, fan_in=64, fan_out=64)
    bad = {"list": write_adapter(tmp_path / "list", tensors=q0, alpha_pattern=["q_proj"]),
           "regex": write_adapter(tmp_path / "regex", tensors=q0, alpha_pattern={"(q_proj": 2}),
           "vector": write_adapter(tmp_path / "vector", tensors={KEY.format(Q0, "A"): torch.zeros(256),
                                                                 KEY.format(Q0, "B"): torch.zeros(64, 4)}),
           "rank0": write_adapter(tmp_path / "rank0", tensors={KEY.format(Q0, "A"): torch.zeros(0, 64),
                                                               KEY.format(Q0, "B"): torch.zeros(64, 0)})}  # fmt: skip
    with pytest.raises(ConfigError) as info:
        LLM(llama, loras={name: str(path) for name, path in bad.items()})
    assert sorted(next(iter(p.value)) for p in info.value.problems) == sorted(bad)
    llm = LLM(llama, enable_lora=True)
    for i, (name, path) in enumerate(bad.items(), start=1):
        with pytest.raises(RequestError) as info:
            llm.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest(name, i, str(path)))
        assert info.value.code == "invalid_lora"


def test_alpha_pattern_rank_pattern_and_rslora_scale_as_peft(llama, tmp_path):
    model = llama
    targets = ("q_proj", "v_proj", "o_proj", "down_proj")
    # layer 1's o_proj by a regex naming the layer, every down_proj by a suffix; q_proj at rank 8 by rank_pattern
    patterns = dict(rank_pattern={"q_proj": 8}, alpha_pattern={r"layers\.1\.self_attn\.o_proj": 40, "down_proj": 2})
    adapters = [build_tiny_adapter(model, tmp_path / "patterns", rank=4, lora_alpha=16, target_modules=targets,
                                   std=0.1, seed=1, **patterns),
                build_tiny_adapter(model, tmp_path / "rslora", rank=4, lora_alpha=16, target_modules=targets,
                                   use_rslora=True, std=0.1, seed=2, **patterns)]  # fmt: skip
    loras = [LoRARequest(f"adapter{i}", i, str(path)) for i, path in enumerate(adapters, start=1)]
    scalings = [{t.module: (t.rank, t.scaling) for t in read_adapter(path, 16, _shapes(model)).targets}
                for path in adapters]  # fmt: skip
    # the patterns were read (the comparison below could pass with them ignored only if they did not matter)
    assert scalings[0]["model.layers.0.self_attn.q_proj"] == (8, 2.0)
    assert scalings[0]["model.layers.1.self_attn.o_proj"] == (4, 10.0)
    assert scalings[0]["model.layers.0.self_attn.o_proj"] == (4, 4.0)
    assert scalings[0]["model.layers.0.mlp.down_proj"] == (4, 0.5)
    assert scalings[1]["model.layers.0.self_attn.q_proj"] == (8, pytest.approx(16 / 8**0.5))
    assert scalings[1]["model.layers.1.self_attn.o_proj"] == (4, 20.0)

    prompts = make_prompts(6, seed=0)
    choice = [loras[i % 2] for i in range(len(prompts))]
    outs = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=8).generate(prompts, GREEDY, lora_request=choice)
    for lora in loras:
        rows = [i for i, c in enumerate(choice) if c == lora]
        expected = peft_greedy(model, lora.lora_path, [prompts[i] for i in rows], NUM_TOKENS)
        assert [outs[i].token_ids for i in rows] == expected, lora.lora_name
        assert expected != peft_greedy(model, None, [prompts[i] for i in rows], NUM_TOKENS)  # the adapter matters


def test_peft_targets_on_a_vision_language_checkpoint_reach_its_vision_tower_too(tmp_path):
    """PEFT's suffix targets (target_modules=["q_proj", "v_proj"]) on Gemma3ForConditionalGeneration adapt the vision
    tower's q_proj / v_proj beside the language model's: the tower's are skipped, and text output equals PEFT's."""
    model = build_tiny_model("gemma3_multimodal", tmp_path / "gemma3")
    with_tower = build_tiny_adapter(model, tmp_path / "with_tower", rank=4, std=0.1, target_modules=("q_proj",
                                                                                                    "v_proj"))
    assert adapter_problems(with_tower, 16, _shapes(model)) == []
    lora = LoRARequest("t", 1, str(with_tower))
    prompts = [[5, 9, 17, 40], [3, 8, 100, 200, 7]]
    outs = LLM(model, enable_lora=True, max_lora_rank=4).generate(prompts, GREEDY, lora_request=lora)
    assert [o.token_ids for o in outs] == peft_greedy(model, with_tower, prompts, NUM_TOKENS)


@pytest.mark.parametrize("family", ["gemma3_multimodal", "gemma4_multimodal"])
def test_vision_language_adapter_equals_peft(tmp_path, family):
    """PEFT on Gemma3/4ForConditionalGeneration names the text model's modules model.language_model.layers.N."""
    model = build_tiny_model(family, tmp_path / family)
    shapes = _shapes(model)
    # the language model only; alpha_pattern names a module as PEFT does, by its name in the checkpoint
    adapter = build_tiny_adapter(model, tmp_path / "text", rank=4, std=0.1, seed=3, target_modules=(
        "q_proj", "v_proj", "o_proj", "down_proj"), exclude_modules=r".*(vision_tower|audio_tower).*",
        alpha_pattern={r"language_model\.layers\.0\.self_attn\.o_proj": 64})  # fmt: skip
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        assert "base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.weight" in f.keys()
    targets = {t.module: t for t in read_adapter(adapter, 16, shapes).targets}
    assert targets["model.layers.0.self_attn.o_proj"].scaling == 16.0
    assert targets["model.layers.1.self_attn.o_proj"].scaling == 4.0

    # the older layout's names (language_model.model.layers.N), written by hand from the same tensors
    old = tmp_path / "old_layout"
    old.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["alpha_pattern"] = {r"language_model\.model\.layers\.0\.self_attn\.o_proj": 64}
    (old / "adapter_config.json").write_text(json.dumps(config))
    save_file({k.replace("model.language_model.", "language_model.model."): v
               for k, v in load_file(adapter / "adapter_model.safetensors").items()},
              str(old / "adapter_model.safetensors"))  # fmt: skip

    prompts = make_prompts(4, seed=1)
    lora, lora_old = LoRARequest("text", 1, str(adapter)), LoRARequest("old", 2, str(old))
    llm = LLM(model, enable_lora=True, max_lora_rank=4)
    outs = llm.generate(prompts * 2, GREEDY, lora_request=[lora] * 4 + [lora_old] * 4)
    expected = peft_greedy(model, adapter, prompts, NUM_TOKENS)
    assert [o.token_ids for o in outs] == expected * 2
    assert expected != peft_greedy(model, None, prompts, NUM_TOKENS)


def _shapes(model_dir) -> dict:
    from nanoinfer.config import Config

    return Config(model=str(model_dir), device="cpu").model_spec.lora_shapes
