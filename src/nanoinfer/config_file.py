"""Settings -> Config: the one place that merges flags, YAML and defaults, and resolves the model argument first.

`load_config_file` reads a file and refuses what PyYAML would silently accept (duplicate keys, unknown
keys, quoted numbers, yes/no for numbers). `make_config` resolves the model argument (model_source) and builds
the Config, which checks the values themselves; LLM calls it. `build_config` applies the precedence
flag > YAML > default before it; every CLI command calls that.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from pathlib import Path

import yaml

from nanoinfer.config import DEFAULT_MODEL, NOT_SETTABLE, Config, settable_fields, type_problem
from nanoinfer.errors import ConfigError, ConfigProblem


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate mapping keys (PyYAML keeps the last one without a word)."""

    def __init__(self, stream):
        super().__init__(stream)
        self.duplicate_keys: list[tuple[object, int, int]] = []  # (key, first line, repeated line)

    def construct_mapping(self, node, deep=False):
        first_line: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` then overriding a key is how YAML merges are meant to be used
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    self.duplicate_keys.append((key, first_line[key], line))
                else:
                    first_line[key] = line
            except TypeError:
                pass  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path) -> tuple[dict, list[ConfigProblem], dict]:
    """Parse a YAML config: (settable values as written, file-level problems, key -> line number).

    Values are not type-checked here (Config does that, with the same messages from Python). Raises
    ConfigError at once when the file cannot be read, is not valid YAML, or is not a mapping.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"config file {path} cannot be read ({reason}). Check the path.") from None
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(
            f"{where}: YAML syntax error: {what}. Fix the YAML at that line and column."
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: YAML error: {e}") from None
    finally:
        loader.dispose()
    if data is None:  # an empty file (or only comments): every field keeps its default
        return {}, [], {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config file must be a mapping of `field: value` lines (e.g. `max_num_seqs: 64`), "
            f"but this one is a {type(data).__name__}."
        )
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value if isinstance(k, yaml.ScalarNode)}
    problems = [
        ConfigProblem(
            str(key),
            data.get(key),
            f"is given twice in {path} (lines {first} and {again}); YAML would silently keep only the last one. "
            "Keep one of them.",
        )
        for key, first, again in loader.duplicate_keys
    ]
    valid = settable_fields()
    values = {}
    unknown = []
    for key, value in data.items():
        if key in valid:
            values[key] = value
        elif key in NOT_SETTABLE:
            problems.append(
                ConfigProblem(key, value, f"cannot be set in a config file: {NOT_SETTABLE[key]}. Remove it.")
            )
        else:
            unknown.append(key)
    if unknown:
        problems.append(_unknown_keys_problem(path, unknown, lines, valid))
    return values, problems, lines


def _unknown_keys_problem(path: Path, unknown: list, lines: dict, valid: list[str]) -> ConfigProblem:
    parts = []
    for key in unknown:
        match = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
        details = [f"line {lines[str(key)]}"] if str(key) in lines else []
        details += [f"did you mean {match[0]}?"] if match else []
        parts.append(f"{key} ({'; '.join(details)})" if details else str(key))
    return ConfigProblem(
        "", None, f"unknown key(s) {', '.join(parts)} in {path}. Valid keys: {', '.join(valid)}."
    )


def load_config_file(path: str | Path) -> dict:
    """Read a YAML config file into a dict of field -> value, refusing every mistake at once.

    Args:
        path: the YAML file, a mapping of Config field names to values.

    Returns:
        The fields the file sets, with their values (types checked; ranges are Config's job).

    Raises:
        ConfigError: listing every problem: YAML syntax (with line:column), not a mapping, duplicate keys
            (both lines), unknown keys (did-you-mean and the valid keys), keys that are not settable
            (hf_config, notes, eos) and wrong types (`max_num_seqs: "64"`, `max_num_seqs: yes`, `2.0`).
    """
    values, problems, _ = read_config_file(path)
    problems += [p for key, value in values.items() if (p := type_problem(key, value))]
    if problems:
        raise ConfigError(problems)
    return values


def merge_settings(
    config_path: str | Path | None, overrides: dict, defaults: dict | None = None
) -> tuple[dict, dict, list[ConfigProblem]]:
    """Apply flag > YAML > default: (values to pass to Config, field -> "flag"|"yaml"|"default", file problems).

    An override whose value is None was not given and does not count. `defaults` are a command's own defaults
    (e.g. bench's cpu_kernels: wait): they win over Config's, never over a flag or the file.
    """
    unknown = (set(overrides) | set(defaults or {})) - set(settable_fields())
    if unknown:  # a CLI command passed a name Config does not have: a bug in that command, not user input
        raise TypeError(f"not Config fields: {sorted(unknown)}")
    file_values, problems, _ = read_config_file(config_path) if config_path is not None else ({}, [], {})
    flags = {key: value for key, value in overrides.items() if value is not None}
    values = {**(defaults or {}), **file_values, **flags}
    if isinstance(file_values.get("loras"), dict) and "loras" in flags:  # --lora adds to the file's adapters
        values["loras"] = {**file_values["loras"], **flags["loras"]}
    sources = {
        key: "flag" if key in flags else "yaml" if key in file_values else "default"
        for key in settable_fields()
    }
    return values, sources, problems


def build_config(config_path: str | Path | None, overrides: dict, defaults: dict | None = None) -> Config:
    """The Config for a CLI command: each field from its flag, else the YAML file, else the default.

    Args:
        config_path: a YAML config file (relative `model:` paths in it resolve against the current working
            directory), or None for no file.
        overrides: field name -> value from the command's flags (same names as Config's fields); a value of
            None means the flag was not given.
        defaults: the command's own defaults for fields neither a flag nor the file sets (else Config's).

    Returns:
        The validated Config (model resolved, hf_config loaded, "auto" values filled in, see `notes`).

    Raises:
        ConfigError: every problem at once, those of the file (duplicate, unknown or unsettable keys) and
            those of the merged values (types, ranges, cross-field rules, model, device).
        ModelLoadError: the built-in default or a hub model could not be fetched.
    """
    values, _, problems = merge_settings(config_path, overrides, defaults)
    return make_config(values, problems)


def make_config(settings: dict, problems: Sequence[ConfigProblem] = ()) -> Config:
    """Resolve the model argument to a local folder (model_source.resolve_model), then build the Config.

    Args:
        settings: Config fields. `model` may be anything resolve_model takes: a model folder, a .gguf file (or a
            folder holding one), the built-in default's name, a hub repo id; without it, the built-in default.
        problems: problems found before (a YAML file's), reported first.

    Returns:
        The validated Config. `model` is the local folder; a note records the argument it was resolved from.

    Raises:
        ConfigError: every problem at once: the earlier ones, the model argument's and the other fields'.
        ModelLoadError: the built-in default or a hub model could not be fetched.
    """
    from nanoinfer.model_source import resolve_model

    settings = dict(settings)
    given = settings.get("model", DEFAULT_MODEL)
    if isinstance(given, os.PathLike):
        given = os.fspath(given)
    model_problems: list[ConfigProblem] = []
    if isinstance(given, str) and given.strip():  # a wrong type or an empty value is Config's to report
        try:
            settings["model"] = str(resolve_model(given))
        except ConfigError as e:
            model_problems = e.problems
    try:
        config = Config(**settings)
    except ConfigError as e:
        raise ConfigError([*problems, *_in_place_of_model_problems(e.problems, model_problems)]) from None
    if problems or model_problems:
        raise ConfigError([*problems, *model_problems])
    if config.model != given:  # the user's text, for messages; Config's own note only saw the resolved folder
        config.notes[:] = [note for note in config.notes if note[0] != "model"]
        config.notes.insert(0, ("model", config.model, f"resolved from {given!r}"))
    return config


def _in_place_of_model_problems(problems: list[ConfigProblem], model_problems: list[ConfigProblem]) -> list:
    """Config's problems, with those of an unresolvable model argument where Config's "not a model folder" was."""
    if not model_problems:
        return problems
    merged = []
    for problem in problems:
        if problem.field != "model":
            merged.append(problem)
        elif model_problems:
            merged += model_problems
            model_problems = []
    return merged + model_problems
