"""NanoinferPredictor, the Ray Data class: rows holding a JSONL line's fields become rows holding its record's
fields, bad rows error records (never an exception); through `ds.map_batches` on a real local Ray instance,
and called directly on the numpy batches Ray Data hands a class by default."""

from __future__ import annotations

import json
import logging
import re
import signal

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from nanoinfer.cli import app
from nanoinfer.ray import RECORD_FIELDS, NanoinferPredictor
from nanoinfer.testing.tiny_models import build_tiny_model

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data")  # Ray Data's own settings

ENGINE = {"device": "cpu", "max_model_len": 256, "cpu_kvcache_space_gib": 0.02, "max_num_seqs": 4, "num_threads": 1}
ROWS = [{"id": f"r{i}", "prompt": f"the quick brown fox {i}", "max_tokens": 2 + i % 5} for i in range(20)] + [
    {"id": "chat", "messages": [{"role": "user", "content": "the capital of paris"}], "max_tokens": 4},
    {"id": "n2", "prompt": "the lazy dog", "n": 2, "max_tokens": 3},
    {"id": "tokens", "prompt_token_ids": [5, 6, 7], "max_tokens": 3},
    {"id": "empty", "prompt": ""},
    {"id": "unknown", "prompt": "x", "temprature": 0.5},
    {"id": "long", "prompt_token_ids": [7] * 300},
    {"id": "oov", "prompt_token_ids": [1, 10**6]},
    {"custom_id": "openai", "method": "POST", "url": "/v1/completions", "body": {"prompt": "fox", "max_tokens": 3}},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    threads = torch.get_num_threads()
    yield str(build_tiny_model("qwen3", tmp_path_factory.mktemp("ray-data") / "model"))
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory):
    """What `nanoinfer generate` writes for ROWS as JSONL lines, keyed by id."""
    root = tmp_path_factory.mktemp("ray-data-reference")
    (root / "in.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    flags = ["--model", model, "--device", "cpu", "--max-model-len", "256", "--cpu-kvcache-space-gib", "0.02",
             "--max-num-seqs", "4", "--num-threads", "1", "--temperature", "0", "--quiet"]
    result = CliRunner().invoke(app, ["generate", str(root / "in.jsonl"), "-o", str(root / "out.jsonl"), *flags])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (root / "out.jsonl").read_text().splitlines()]
    return {key(record): comparable(record) for record in records}


def key(record: dict) -> str:
    return record.get("custom_id") or record["id"]


def comparable(record: dict) -> dict:
    """A record with what depends on where a row was numbered or when it ran taken out (line numbers, `created`)."""
    text = re.sub(r"line[- _]?\d+", "line#", json.dumps({name: record.get(name) for name in RECORD_FIELDS}))
    record = json.loads(text)
    record["line"] = None
    if record.get("response"):
        record["response"]["body"].pop("created", None)
    return record


@pytest.fixture(scope="module")
def ray_instance():
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def test_map_batches_gives_each_row_the_record_generate_writes(ray_instance, model, reference):
    dataset = ray.data.from_items(ROWS)
    rows = dataset.map_batches(
        NanoinferPredictor,
        fn_constructor_kwargs={"model": model, "sampling": {"temperature": 0}, **ENGINE},
        compute=ray.data.ActorPoolStrategy(size=2),
        num_cpus=1,
        batch_size=6,
        batch_format="pyarrow",
    ).take_all()
    assert len(rows) == len(ROWS)
    got = {key(row): comparable(row) for row in rows}
    assert got == reference  # every row once; errors and greedy results as on one engine
    assert sorted(r["error"]["code"] for r in got.values() if r["error"]) == [
        "empty_prompt", "out_of_vocabulary", "prompt_too_long", "unknown_field"]


def test_a_numpy_batch_with_gaps_gets_one_record_per_row_and_no_exception(model, reference):
    predictor = NanoinferPredictor(model, sampling={"temperature": 0}, **ENGINE)
    # As Ray Data's default (numpy) batches hold rows of different shapes: None where a row has no such field,
    # NaN in an integer column with gaps, nested lists as arrays.
    columns = {
        "id": np.array(["r3", "tokens", "bytes", "n2"], dtype=object),
        "prompt": np.array([ROWS[3]["prompt"], None, "x", "the lazy dog"], dtype=object),
        "prompt_token_ids": np.array([None, np.array([5, 6, 7]), None, None], dtype=object),
        "max_tokens": np.array([ROWS[3]["max_tokens"], 3.0, np.nan, 3.0]),
        "n": np.array([np.nan, np.nan, np.nan, 2.0]),
        "extra": np.array([None, None, b"\x00", None], dtype=object),  # no JSON form: this row's error
    }
    out = predictor(columns)
    assert set(out) == set(RECORD_FIELDS) and all(len(column) == 4 for column in out.values())
    records = [{name: out[name][i] for name in RECORD_FIELDS} for i in range(4)]
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert comparable(records[0]) == reference["r3"]
    assert comparable(records[1]) == reference["tokens"]
    assert records[2]["error"]["code"] == "invalid_row" and records[2]["id"] is None
    assert comparable(records[3]) == reference["n2"]
    again = predictor({"id": np.array(["r4"], dtype=object), "prompt": np.array([ROWS[4]["prompt"]], dtype=object),
                       "max_tokens": np.array([ROWS[4]["max_tokens"]])})
    assert list(again["line"]) == [5]  # numbered on from the rows this predictor has seen
    assert comparable({name: again[name][0] for name in RECORD_FIELDS}) == reference["r4"]
