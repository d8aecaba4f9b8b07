"""LLM(runner="pooling").embed against sentence-transformers, the reference, on a tiny random Llama, float32.

Each pooling mode gets a sentence-transformers folder around the same weights (the classic layout of hub models,
nanoinfer.testing.st_folders), which both sides read: nanoinfer takes pooling and normalize from it. The texts
differ in length, so sentence-transformers pads its batch (right side; its Pooling finds the last real token and
the first from the attention mask), and the comparison checks that both tokenize a text into the same ids.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from nanoinfer import LLM
from nanoinfer.errors import ConfigError
from nanoinfer.pooling import PoolingParams
from nanoinfer.testing.st_folders import make_st_folder
from nanoinfer.testing.tiny_models import build_tiny_model

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog.", "Paris", "capital", "cache", "block", "0",
         "1000", "def", "main():", "{\"key\":", "[1,", "2]}", "Once", "upon", "a", "time"]
MODES = [("mean", True), ("last", True), ("cls", False)]  # (pooling_type, Normalize module)
MIN_COSINE = 0.9999


def make_texts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice([1, 2, 5, 20, 60]))) for _ in range(num)]


TEXTS = make_texts(12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    threads = torch.get_num_threads()  # the engine sets torch's thread count; give it back afterwards
    yield build_tiny_model("llama", tmp_path_factory.mktemp("embed") / "llama")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=MODES, ids=[mode for mode, _ in MODES])
def embedder(request, model_dir, tmp_path_factory):
    """(pooling_type, normalize, nanoinfer's LLM, sentence-transformers' model) for one pooling mode's folder."""
    from sentence_transformers import SentenceTransformer

    pooling_type, normalize = request.param
    folder = make_st_folder(model_dir, tmp_path_factory.mktemp(pooling_type) / "st", pooling_type, normalize)
    llm = LLM(str(folder), runner="pooling", device="cpu", dtype="float32", max_model_len=512,
              cpu_kvcache_space_gib=0.05)
    yield pooling_type, normalize, llm, SentenceTransformer(str(folder), device="cpu")
    del llm


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def st_token_ids(st, texts) -> list[list[int]]:
    features = st.preprocess(texts)
    assert features["modality"] == "text"  # plain text, not rendered through the chat template
    rows = zip(features["input_ids"].tolist(), features["attention_mask"].tolist())
    return [[t for t, m in zip(ids, mask) if m] for ids, mask in rows]


def test_embeddings_equal_sentence_transformers_for_each_pooling_mode(embedder):
    pooling_type, normalize, llm, st = embedder
    assert (llm.config.pooling_type, llm.config.normalize) == (pooling_type, normalize)  # read from the folder
    reference = st.encode(TEXTS, batch_size=32, convert_to_numpy=True)
    outputs = llm.embed(TEXTS)
    assert [o.prompt_token_ids for o in outputs] == st_token_ids(st, TEXTS)
    ours = np.array([o.outputs.embedding for o in outputs])
    assert ours.shape == reference.shape == (len(TEXTS), llm.config.hf_config.hidden_size)
    assert cosines(ours, reference).min() >= MIN_COSINE
    # Normalize (or not) as the folder says: the norms agree too, and are 1 only with a Normalize module.
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), np.linalg.norm(reference, axis=1), rtol=1e-4)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-4) == normalize
    assert [o.finish_reason for o in outputs] == ["stop"] * len(TEXTS)
    assert outputs[0].usage["prompt_tokens"] == len(outputs[0].prompt_token_ids)
    assert outputs[0].usage["completion_tokens"] == 0


def test_token_id_prompts_embed_as_their_text(embedder):
    _, _, llm, st = embedder
    ids = st_token_ids(st, TEXTS[:3])
    by_text, by_ids = llm.embed(TEXTS[:3]), llm.embed(ids)
    assert cosines([o.outputs.embedding for o in by_ids], [o.outputs.embedding for o in by_text]).min() >= MIN_COSINE


def test_per_request_dimensions_truncate_before_normalizing_and_normalize_overrides_the_folder(embedder):
    from sentence_transformers import SentenceTransformer

    _, normalize, llm, st = embedder
    raw = SentenceTransformer(modules=[st[0], st[1]], device="cpu")  # Transformer + Pooling: no Normalize
    reference = raw.encode(TEXTS[:4], convert_to_numpy=True)
    # Matryoshka, as OpenAI's `dimensions`: the first 16 values of the pooled vector, then L2-normalized.
    short = llm.embed(TEXTS[:4], PoolingParams(dimensions=16, normalize=True))
    ours = np.array([o.outputs.embedding for o in short])
    truncated = reference[:, :16] / np.linalg.norm(reference[:, :16], axis=1, keepdims=True)
    assert ours.shape == (4, 16)
    np.testing.assert_allclose(ours, truncated, rtol=1e-4, atol=1e-5)
    # The request's normalize wins over the folder's, either way.
    flipped = np.array([o.outputs.embedding for o in llm.embed(TEXTS[:4], PoolingParams(normalize=not normalize))])
    expected = reference / np.linalg.norm(reference, axis=1, keepdims=True) if not normalize else reference
    np.testing.assert_allclose(flipped, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("modalities", ["text", "message"])
def test_a_folder_saved_by_sentence_transformers_itself_is_read(model_dir, tmp_path, modalities):
    """What sentence-transformers 6 saves: its v6 module paths, a `pooling_mode` string and a base-model checkpoint
    (LlamaModel: no LM head, no `model.` prefix). With a chat template in the tokenizer it saves a "message"
    modality and embeds each text as a user message rendered by the template: nanoinfer does the same."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    text_only = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    options = {"modality_config": text_only, "module_output_name": "token_embeddings"} if modalities == "text" else {}
    transformer = Transformer(str(model_dir), **options)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(tmp_path / "st"))
    st = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    reference = st.encode(TEXTS, convert_to_numpy=True)
    llm = LLM(str(tmp_path / "st"), runner="pooling", device="cpu", max_model_len=512, cpu_kvcache_space_gib=0.05)
    assert (llm.config.pooling_type, llm.config.normalize) == ("mean", True)
    assert llm.embeds_messages == (modalities == "message")
    outputs = llm.embed(TEXTS)
    assert outputs[0].prompt_token_ids == st.preprocess(TEXTS[:1])["input_ids"][0].tolist()  # one text: no padding
    assert cosines([o.outputs.embedding for o in outputs], reference).min() >= MIN_COSINE


def test_a_base_model_checkpoint_only_embeds(model_dir, tmp_path):
    from sentence_transformers.base.modules import Transformer

    Transformer(str(model_dir)).save(str(tmp_path / "base"))  # LlamaModel: the decoder without its LM head
    with pytest.raises(ConfigError, match="base model .*LlamaModel.* without an LM head"):
        LLM(str(tmp_path / "base"), device="cpu", max_model_len=512, cpu_kvcache_space_gib=0.05)


@pytest.mark.parametrize("pooling_type", ["mean", "last", "cls"])
def test_chunked_prefill_preemption_and_prefix_hits_give_the_same_vectors(model_dir, pooling_type):
    """Each vector is gathered a chunk at a time (16-token steps), through a preemption by recompute mid-prompt (made
    by hand: the scheduler preempts only a sequence that grows, and a prompt being embedded finishes first) and
    prefix-cache hits (a second identical batch): the same vectors as one plain batch, within float32 rounding."""
    texts = [" ".join(["block cache token"] * 45), " ".join(["Paris capital"] * 70), "Once upon a time"]
    settings = dict(runner="pooling", pooling_type=pooling_type, device="cpu", dtype="float32", max_model_len=512)
    expected = np.array([o.outputs.embedding for o in LLM(str(model_dir), **settings).embed(texts)])
    llm = LLM(str(model_dir), **settings, max_num_batched_tokens=16, max_num_seqs=3)
    for params in (PoolingParams(), PoolingParams()):
        ids = [llm.add_request(text, params) for text in texts]
        outputs = {}
        for step in itertools.count():
            if step == 3:  # the first prompt is 48 tokens in: start it over
                scheduler = llm.engine.scheduler
                seq = scheduler.running[0]
                assert 0 < seq.num_computed_tokens < seq.num_tokens
                scheduler.running.remove(seq)
                scheduler._preempt(seq)
            outputs.update((o.request_id, o) for o in llm.step()[0])
            if not llm.has_unfinished_requests():
                break
        got = np.array([outputs[i].outputs.embedding for i in ids])
        np.testing.assert_allclose(got, expected, atol=1e-5)
    assert llm.engine.scheduler.num_preemptions >= 1  # the second batch of last-token pooling is done before step 3
    assert outputs[ids[0]].num_cached_tokens > 0 if pooling_type == "last" else outputs[ids[0]].num_cached_tokens == 0


def test_sentence_transformers_folders_nanoinfer_cannot_run_are_refused_before_loading(model_dir, tmp_path,
                                                                                        monkeypatch):
    import json

    from nanoinfer.engine import model_runner

    def refuse_loading(*args):
        pytest.fail("the weights loaded before the refusal")

    monkeypatch.setattr(model_runner, "load_weights", refuse_loading)
    folder = make_st_folder(model_dir, tmp_path / "max", "mean", True)
    pooling = folder / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({**json.loads(pooling.read_text()), "pooling_mode_mean_tokens": False,
                                   "pooling_mode_max_tokens": True}))  # fmt: skip
    settings = dict(runner="pooling", device="cpu", max_model_len=512)
    with pytest.raises(ConfigError, match="pools by max_tokens.*Set --pooling"):
        LLM(str(folder), **settings)
    monkeypatch.undo()
    assert LLM(str(folder), **settings, pooling_type="mean").config.pooling_type == "mean"  # the flag decides
    modules = folder / "modules.json"
    dense = {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    modules.write_text(json.dumps([*json.loads(modules.read_text()), dense]))
    monkeypatch.setattr(model_runner, "load_weights", refuse_loading)
    with pytest.raises(ConfigError, match="has the module Dense"):  # whatever the flags say
        LLM(str(folder), **settings, pooling_type="mean", normalize=True)
