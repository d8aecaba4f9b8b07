"""model argument -> local Hugging Face folder: a path, the built-in default, or a hub repo id."""

from __future__ import annotations

from pathlib import Path

from nanoinfer.errors import ConfigError, ConfigProblem


def resolve_model(model: str) -> Path:
    """Return the local folder for `model` (placeholder: local folders only; the default comes next)."""
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    raise ConfigError([ConfigProblem("model", model, "is not a folder with a config.json. Pass a local Hugging Face folder.")])
