"""Structured output through xgrammar, on a tiny random-weight model (the mask does all the work) and on the
built-in default model: every output that finishes with "stop" parses and validates (jsonschema), regex and
choice outputs match, grammar outputs parse; greedy constrained output equals unconstrained output when that
already satisfies the schema; the same under chunked prefill, forced preemption and n = 3."""

from __future__ import annotations

import ast
import json
import random
import re
import threading

import jsonschema
import pytest

from nanoinfer import LLM, SamplingParams, StructuredOutputsParams
from nanoinfer.structured_output import manager as manager_module

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 20},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                            },
                            "required": ["sku", "qty"],
                        },
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["id", "items"],
            },
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["order", "status"],
    },
    "weather": {
        "type": "object",
        "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 50},
            "unit": {"enum": ["C", "F"]},
            "readings": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 4},
        },
        "required": ["temperature", "unit", "readings"],
    },
    "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 4},
    "flags": {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "note": {"type": ["string", "null"], "maxLength": 12},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        },
        "required": ["ok", "note", "tags"],
    },
}
REGEX = r"[a-z]{3}-[0-9]{2,4}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMAR = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= [1-9] [0-9]{0,2} | "(" [1-9] ("+" [1-9]){0,2} ")"
"""
PROMPTS = ["Describe it:", "The answer is", "Output:", "Hello", "JSON please", "Once upon a time"]


def constraints() -> list[tuple[str, StructuredOutputsParams]]:
    kinds = [(f"json:{name}", StructuredOutputsParams(json=schema)) for name, schema in SCHEMAS.items()]
    kinds += [("json_object", StructuredOutputsParams(json_object=True)),
              ("regex", StructuredOutputsParams(regex=REGEX)),
              ("choice", StructuredOutputsParams(choice=CHOICES)),
              ("grammar", StructuredOutputsParams(grammar=GRAMMAR))]
    return kinds


def check_output(name: str, text: str) -> None:
    """The output of a request that finished with "stop" satisfies its constraint."""
    if name.startswith("json:"):
        jsonschema.validate(json.loads(text), SCHEMAS[name[5:]])
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(REGEX, text), text
    elif name == "choice":
        assert text in CHOICES
    else:
        tree = ast.parse(text, mode="eval")  # an arithmetic expression of the grammar's shape
        allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub)
        assert all(isinstance(node, allowed) for node in ast.walk(tree)), text


def run_all(llm: LLM, prompts: list, n: int = 1, max_tokens: int = 160) -> dict[str, list]:
    """Every constraint on every prompt, greedy and seeded random, in one batch."""
    names, requests, params = [], [], []
    for name, so in constraints():
        for j, prompt in enumerate(prompts):
            for temperature in (0.0, 1.0):
                names.append(name)
                requests.append(prompt)
                params.append(SamplingParams(temperature=temperature, seed=j, n=n, max_tokens=max_tokens,
                                             structured_outputs=so))
    outputs = llm.generate(requests, params)
    results: dict[str, list] = {}
    for name, out in zip(names, outputs):
        results.setdefault(name, []).extend(out.outputs)
    return results


def assert_all_valid(results: dict[str, list], min_stop_fraction: float) -> None:
    for name, completions in results.items():
        stopped = [c for c in completions if c.finish_reason == "stop"]
        assert all(c.finish_reason in ("stop", "length") for c in completions), [c.error for c in completions]
        for c in stopped:
            check_output(name, c.text)
        assert len(stopped) >= min_stop_fraction * len(completions), (name, len(stopped), len(completions))


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dirs):
    return LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=512, cpu_kvcache_space_gib=0.1)


@pytest.fixture(scope="module")
def default_llm(default_model_dir):
    return LLM(default_model_dir, device="cpu", max_model_len=512, cpu_kvcache_space_gib=0.1)


def test_every_finished_output_satisfies_its_constraint_on_random_weights(tiny_llm):
    # With random weights the mask does all the work: still, every output that stops is valid.
    assert_all_valid(run_all(tiny_llm, PROMPTS[:3]), min_stop_fraction=0.3)


def test_every_finished_output_satisfies_its_constraint_on_the_default_model(default_llm):
    chats = [default_llm.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    assert_all_valid(run_all(default_llm, chats), min_stop_fraction=0.5)


def test_greedy_output_that_already_satisfies_the_schema_is_unchanged(default_llm):
    """The mask only removes what the model would not pick: the same tokens, EOS included."""
    prompt = default_llm.apply_chat_template(
        [{"role": "user", "content": 'Reply with only this JSON and nothing else: {"name": "John", "age": 25}'}]
    )
    free = default_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60))[0]
    assert free.text == '{"name": "John", "age": 25}' and free.finish_reason == "stop"
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    constrained = default_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": schema})
    )[0]
    assert constrained.token_ids == free.token_ids and constrained.finish_reason == "stop"


def test_greedy_regex_of_the_free_output_keeps_its_tokens_on_random_weights(tiny_llm):
    """A grammar holding exactly the unconstrained greedy text changes no token (a literal EBNF string)."""
    for prompt in PROMPTS:
        free = tiny_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        if "\ufffd" not in free.text and free.text:
            break
    else:
        pytest.fail("every prompt's greedy output ended inside a UTF-8 character")
    grammar = f"root ::= {json.dumps(free.text, ensure_ascii=False)}"
    constrained = tiny_llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, structured_outputs={"grammar": grammar})
    )[0]
    assert constrained.token_ids[: len(free.token_ids)] == free.token_ids
    assert constrained.finish_reason == "stop" and constrained.text == free.text


def test_logprobs_are_of_the_masked_distribution(tiny_llm):
    out = tiny_llm.generate(["Pick"], SamplingParams(temperature=0, max_tokens=5, logprobs=5,
                                                     structured_outputs={"choice": ["yes", "no"]}))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    first = out.outputs[0].logprobs[0]
    allowed = {t for t, _ in first.top}
    assert first.token_id in allowed and all(v > float("-inf") for _, v in first.top)
    assert len(first.top) <= 5  # only tokens the grammar allows are alternatives


@pytest.mark.parametrize(
    "regime",
    [
        dict(max_num_batched_tokens=32, max_num_seqs=8),  # chunked prefill
        dict(num_kvcache_blocks=3),  # forced preemption: 3 blocks of 256 tokens for 8 prompts of ~150
        dict(num_speculative_tokens=3),  # constrained sequences are never speculated; the others still are
    ],
    ids=["chunked_prefill", "preemption", "speculation"],
)
def test_constraints_hold_under_chunked_prefill_and_preemption(tiny_model_dirs, regime):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(100, 200))] for _ in range(8)]
    llm = LLM(str(tiny_model_dirs["qwen3"]), device="cpu", max_model_len=512, cpu_kvcache_space_gib=0.1, **regime)
    results = run_all(llm, prompts[:2] if "max_num_batched_tokens" in regime else prompts, max_tokens=100)
    assert_all_valid(results, min_stop_fraction=0.2)
    if "num_kvcache_blocks" in regime:
        assert llm.engine.scheduler.num_preemptions > 0


def test_n_3_gives_three_valid_outputs_each(tiny_llm):
    results = run_all(tiny_llm, PROMPTS[:1], n=3)
    assert all(len(c) == 3 * 2 for c in results.values())  # 3 sequences x (greedy, random)
    assert_all_valid(results, min_stop_fraction=0.3)


def test_each_distinct_grammar_compiles_once(tiny_llm, monkeypatch):
    calls = []
    compile_ = manager_module.StructuredOutputManager._compile

    def counting(self, params):
        calls.append(params.cache_key())
        return compile_(self, params)

    monkeypatch.setattr(manager_module.StructuredOutputManager, "_compile", counting)
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    same = [SamplingParams(temperature=0, max_tokens=20, structured_outputs={"json": dict(reversed(schema.items()))}),
            SamplingParams(temperature=0, max_tokens=20, structured_outputs={"json": json.dumps(schema)})] * 3
    outs = tiny_llm.generate(["a", "b", "c", "d", "e", "f"], same)
    assert [o.text for o in outs if o.finish_reason == "stop"] and len(calls) == 1


def test_a_compiling_grammar_holds_up_only_its_own_request(tiny_llm, monkeypatch):
    release = threading.Event()
    compile_ = manager_module.StructuredOutputManager._compile

    def slow(self, params):
        release.wait(timeout=30)
        return compile_(self, params)

    monkeypatch.setattr(manager_module.StructuredOutputManager, "_compile", slow)
    tiny_llm.add_request("wait", SamplingParams(temperature=0, max_tokens=10, structured_outputs={"regex": "z+"}),
                         request_id="constrained")
    tiny_llm.add_request("go", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), request_id="free")
    finished = []
    while "free" not in finished:
        finished += [o.request_id for o in tiny_llm.step()[0]]
    assert "constrained" not in finished  # the free request finished while the grammar was compiling
    release.set()
    while tiny_llm.has_unfinished_requests():
        finished += [o.request_id for o in tiny_llm.step()[0]]
    assert "constrained" in finished


def test_a_grammar_that_compiles_too_long_is_an_error(tiny_llm, monkeypatch):
    release = threading.Event()
    monkeypatch.setattr(manager_module.StructuredOutputManager, "_compile", lambda self, p: release.wait(30))
    monkeypatch.setattr(tiny_llm.structured_outputs, "compile_timeout_s", 0.2)
    out = tiny_llm.generate(["x"], SamplingParams(max_tokens=5, structured_outputs={"regex": "never+"}))[0]
    release.set()
    assert out.finish_reason == "error" and "did not compile within 0.2 s" in out.error
    assert out.error_code == "invalid_structured_outputs"


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
        ({"regex": "(ab"}, "parenthesis is not closed"),
        ({"grammar": "root ::= missing"}, 'Rule "missing" is not defined'),
    ],
)
def test_a_grammar_that_cannot_compile_fails_its_request_only(tiny_llm, spec, words):
    bad, good = tiny_llm.generate(["x", "y"], [SamplingParams(max_tokens=5, structured_outputs=spec),
                                              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)])
    assert bad.finish_reason == "error" and words in bad.error and bad.error_code == "invalid_structured_outputs"
    assert good.finish_reason == "length"
