"""Resume: the manifest beside the output (the input's, model's and LoRA adapters' fingerprints and the settings
that change results), what changed since the output was started, and the torn tail cut off the output.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from nanoinfer.errors import BatchFileError
from nanoinfer.jsonl.reader import _READ_CHUNK
from nanoinfer.jsonl.records import record_line_number

MANIFEST_VERSION = 1
# Config fields that change what a request produces; a resumed job must keep them. Others (batch sizes,
# cache size, device) only change speed and may differ between runs.
RESULT_FIELDS = ("max_model_len", "dtype", "seed", "reasoning_parser", "tool_call_parser")
# What a manifest written before a result field existed meant by it
_RESULT_FIELD_DEFAULTS = {"reasoning_parser": "auto", "tool_call_parser": "auto"}


def manifest_path(output: Path) -> Path:
    return output.with_name(output.name + ".manifest.json")


@dataclass
class ResumeState:
    done_lines: set[int] = field(default_factory=set)
    num_cut_bytes: int = 0  # a torn last line (or an unreadable tail) removed from the output
    num_dropped_records: int = 0  # whole records after an unreadable line, dropped to be recomputed


def prepare_resume(output: Path) -> ResumeState:
    """Cut a torn or unreadable tail off `output` and return the input lines it already answers."""
    state = ResumeState()
    keep = 0  # bytes of whole, readable records
    with open(output, "rb") as f:
        for raw in f:
            line = record_line_number(_loads_or_none(raw) or {}) if raw.endswith(b"\n") else None
            if line is None:
                # A torn last line (a write cut short by a full disk or a machine crash) or garbage left
                # by power loss: keep only the records before it; the rest is recomputed.
                state.num_dropped_records = sum(1 for rest in f if rest.endswith(b"\n"))
                break
            state.done_lines.add(line)
            keep += len(raw)
        size = f.seek(0, os.SEEK_END)
    state.num_cut_bytes = size - keep
    if state.num_cut_bytes:
        with open(output, "r+b") as f:
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    return state


def _loads_or_none(raw: bytes) -> dict | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def model_fingerprint(model_dir: str) -> str:
    """sha256 over config.json and the names and sizes of the weight files (cheap, no weights read)."""
    root = Path(model_dir)
    digest = hashlib.sha256()
    config = root / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        if path.suffix in (".safetensors", ".gguf", ".bin"):
            digest.update(f"{path.name}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def adapter_fingerprint(adapter_dir: str) -> str:
    """sha256 over a PEFT adapter's adapter_config.json and weights, read whole: an adapter is small next to its
    model, and one retrained into the same folder has the same config and file sizes."""
    digest = hashlib.sha256()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        digest.update(f"{name}\n".encode())
        with contextlib.suppress(OSError), open(Path(adapter_dir) / name, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def make_manifest(
    input_path: Path, input_sha256: str, num_lines: int, config, sampling_defaults: dict
) -> dict:
    return {
        "version": MANIFEST_VERSION,
        "input": {"path": str(input_path), "sha256": input_sha256, "num_lines": num_lines},
        "model": {"path": config.model, "fingerprint": model_fingerprint(config.model)},
        "result_fields": {name: getattr(config, name) for name in RESULT_FIELDS},
        # the job's adapters by the names lines select them with (a changed adapter changes its lines' results)
        "loras": {name: {"path": str(path), "fingerprint": adapter_fingerprint(path)}
                  for name, path in config.loras.items()},
        "sampling_defaults": sampling_defaults,
        "config": {
            k: v for k, v in config.to_dict().items() if isinstance(v, (int, float, str, bool, type(None)))
        },
    }


def write_manifest(path: Path, manifest: dict) -> None:
    """Atomically: write a temporary file, fsync it, rename it over the old one, fsync the folder."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BatchFileError(
            f"the resume manifest {path} cannot be read ({e}). Pass --overwrite to start the job over."
        ) from None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise BatchFileError(
            f"the resume manifest {path} was not written by this version of nanoinfer. "
            "Pass --overwrite to start the job over."
        )
    return manifest


def manifest_differences(old: dict, new: dict) -> list[str]:
    """What changed between the run that started the output and this one, in words."""
    problems = []
    if old.get("input", {}).get("sha256") != new["input"]["sha256"]:
        problems.append(
            f"the input changed: {new['input']['path']} is not the file the output was started "
            f"from ({old.get('input', {}).get('path')}, {old.get('input', {}).get('num_lines')} "
            "lines); its sha256 differs"
        )
    if old.get("model", {}).get("fingerprint") != new["model"]["fingerprint"]:
        problems.append(
            f"the model changed: the output was started with {old.get('model', {}).get('path')}, "
            f"this run uses {new['model']['path']} (config.json or weight files differ)"
        )
    for name in RESULT_FIELDS:
        before = old.get("result_fields", {}).get(name, _RESULT_FIELD_DEFAULTS.get(name))
        now = new["result_fields"][name]
        if before != now:
            problems.append(
                f"{name} was {before!r} when the output was started and is {now!r} now "
                f"(pass --{name.replace('_', '-')} {before})"
            )
    old_loras = old.get("loras") or {}  # a manifest from before LoRA: none
    if not isinstance(old_loras, dict) or not all(isinstance(v, dict) for v in old_loras.values()):
        problems.append("the manifest's LoRA adapters are unreadable (edited by hand?): start over with --overwrite")
    else:
        problems += _lora_differences(old_loras, new["loras"])
    before, now = old.get("sampling_defaults"), new["sampling_defaults"]
    if before != now:
        problems.append(f"the sampling defaults changed: {before} then, {now} now")
    return problems


def _lora_differences(old: dict, new: dict) -> list[str]:
    """The adapters' changes, by name: a line naming an adapter (or an OpenAI line whose body.model does) would get
    another answer, or an error record, from another set. Their folders may move; their contents may not."""
    problems = []
    removed = [name for name in old if name not in new]
    if removed:
        flags = " ".join(f"--lora {name}={old[name].get('path')}" for name in removed)
        problems.append(f"LoRA adapter(s) {', '.join(removed)} were named when the output was started and are not "
                        f"now (pass {flags})")
    added = [name for name in new if name not in old]
    if added:
        problems.append(f"LoRA adapter(s) {', '.join(added)} are named now but were not when the output was started "
                        "(leave them out)")
    for name in new:
        if name in old and old[name].get("fingerprint") != new[name]["fingerprint"]:
            problems.append(f"LoRA adapter {name} changed: the output was started with {old[name].get('path')}, this "
                            f"run uses {new[name]['path']} (adapter_config.json or its weights differ)")
    return problems
