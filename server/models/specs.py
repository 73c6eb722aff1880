"""Which models a server can serve: ``ModelSpec`` (an id, a file, aliases, the settings that
differ for it, whether it loads at start) and ``model_specs``, which reads them from the command
line (``--model PATH`` or repeated ``--model ID=PATH``), a folder (``--models-dir``) and a presets
file (``--models-preset``, TOML or INI).

The single-model command line is unchanged: one ``--model PATH`` (or none: the embedded model)
is one model, loaded at start, that answers whatever ``model`` a request names. With more than
one model (or a folder, or a presets file), a request's ``model`` picks one, by id or alias.
"""

from __future__ import annotations

import configparser
import dataclasses
import os
import pathlib
import re
import tomllib
from dataclasses import dataclass
from typing import Any

from server.model_files import default_model_path
from server.settings import Settings, model_settings_error, read_bool

# A split GGUF is named NAME-00001-of-00003.gguf; llama.cpp loads the rest from the first.
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
# Per-model keys a presets file may set: the settings a model's load and engine read.
PER_MODEL_SETTINGS = frozenset(
    {
        "ctx_size",
        "parallel",
        "batch_size",
        "threads",
        "chat_template_file",
        "chat_template",
        "embeddings",
        "pooling",
        "max_queue",
    }
)
# Keys of a preset that are not settings.
_SPEC_KEYS = frozenset({"model", "path", "aliases", "load_on_start", "tags"})


class ModelSpecError(ValueError):
    """The models given on the command line or in a presets file do not make sense; the
    message says which and why (the command exits with status 2)."""


@dataclass(frozen=True)
class ModelSpec:
    id: str
    path: str
    settings: Settings  # the server's, with this model's presets applied
    aliases: tuple[str, ...] = ()
    load_on_start: bool = False
    tags: tuple[str, ...] = ()  # free labels, listed in /v1/models (llama-server's --tags)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.id, *self.aliases)

    def file_bytes(self) -> int:
        """The size of the model's file(s), the estimate of what loading it costs in memory."""
        path = pathlib.Path(self.path)
        match = _SPLIT.match(path.stem)
        if match is None:
            return path.stat().st_size if path.exists() else 0
        count = int(match["count"])
        shards = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
        return sum(s.stat().st_size for s in shards if s.exists())


def is_multi_model(settings: Settings) -> bool:
    """Whether the command line names several models (or a folder or presets of them)."""
    named = settings.model
    return bool(settings.models_dir or settings.models_preset or len(named) > 1 or any("=" in m for m in named))


def model_specs(settings: Settings) -> list[ModelSpec]:
    """The models ``settings`` name, in order (the first answers requests that name none)."""
    if not is_multi_model(settings):
        path = settings.model[0] if settings.model else str(default_model_path())
        listed = _names(settings.alias)
        tags = _names(settings.tags)
        if len(listed) > 1:  # llama-server's list: the id is the first in order, every one an alias
            return [ModelSpec(listed[0], path, settings, listed, load_on_start=True, tags=tags)]
        return [ModelSpec(settings.alias or os.path.basename(path), path, settings, load_on_start=True, tags=tags)]
    for flag, value in (("--alias", settings.alias), ("--tags", settings.tags)):
        if value:  # it would name no model in particular
            raise ModelSpecError(
                f"{flag} names the one model of a single-model command line; with several, give each its "
                "names in --models-preset (aliases, tags) or its id in --model ID=PATH"
            )
    paths: dict[str, str] = {}
    for entry in settings.model:
        id_, sep, path = entry.partition("=")
        if not sep:
            id_, path = _model_id(pathlib.Path(entry)), entry
        _add(paths, id_, path, f"--model {entry}")
    if settings.models_dir:
        for id_, path in _folder(settings.models_dir):
            paths.setdefault(id_, path)  # --model ID=PATH wins over the folder
    presets = _read_presets(settings.models_preset) if settings.models_preset else {}
    specs = [_spec(id_, paths.get(id_), presets.pop(id_, {}), settings) for id_ in paths]
    specs += [_spec(id_, None, preset, settings) for id_, preset in presets.items()]
    if not specs:
        raise ModelSpecError("no models: --models-dir has no .gguf files and nothing else names one")
    names: dict[str, str] = {}
    for spec in specs:
        for name in spec.names:
            if names.setdefault(name, spec.id) != spec.id:
                raise ModelSpecError(f"the name {name!r} is used by both {names[name]!r} and {spec.id!r}")
    # --cache-ram is the process's: each model's prompt cache gets an equal share of it, for as
    # many models as may be loaded at once.
    at_once = min(len(specs), settings.models_max or len(specs))
    share = settings.cache_ram // at_once
    return [dataclasses.replace(spec, settings=dataclasses.replace(spec.settings, cache_ram=share)) for spec in specs]


def _add(paths: dict[str, str], id_: str, path: str, where: str) -> None:
    if not id_ or not path:
        raise ModelSpecError(f"{where}: expected ID=PATH or PATH")
    if id_ in paths:
        raise ModelSpecError(f"{where}: the model id {id_!r} is given twice")
    paths[id_] = path


def _model_id(path: pathlib.Path) -> str:
    """A model's id from its file: the name without ``.gguf`` (and without a split's suffix)."""
    match = _SPLIT.match(path.stem)
    return match["stem"] if match else path.stem


def _folder(folder: str) -> list[tuple[str, str]]:
    """Every model in ``folder``: each ``*.gguf``, a split GGUF once (its first file)."""
    root = pathlib.Path(folder)
    if not root.is_dir():
        raise ModelSpecError(f"--models-dir {folder}: not a folder")
    found = []
    for path in sorted(root.glob("*.gguf")):
        match = _SPLIT.match(path.stem)
        if match is not None and int(match["index"]) != 1:
            continue  # a later shard: loaded with the first
        found.append((_model_id(path), str(path)))
    return found


def _read_presets(file: str) -> dict[str, dict[str, Any]]:
    """A presets file: one table (TOML) or section (INI) per model id."""
    path = pathlib.Path(file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSpecError(f"--models-preset {file}: {exc}") from None
    if path.suffix.lower() == ".toml":
        try:
            tables = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ModelSpecError(f"--models-preset {file}: {exc}") from None
        if not all(isinstance(table, dict) for table in tables.values()):
            raise ModelSpecError(f"--models-preset {file}: every top-level entry must be a [model-id] table")
        return {id_: dict(table) for id_, table in tables.items()}
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text, source=file)
    except configparser.Error as exc:
        raise ModelSpecError(f"--models-preset {file}: {exc}") from None
    return {section: dict(parser[section]) for section in parser.sections()}


def _spec(id_: str, path: str | None, preset: dict[str, Any], settings: Settings) -> ModelSpec:
    where = f"--models-preset [{id_}]"
    if not id_.strip():
        raise ModelSpecError(f"{where}: a model id must not be empty")
    unknown = set(preset) - PER_MODEL_SETTINGS - _SPEC_KEYS
    if unknown:
        allowed = ", ".join(sorted(PER_MODEL_SETTINGS | _SPEC_KEYS))
        raise ModelSpecError(f"{where}: unknown keys {', '.join(sorted(unknown))} (allowed: {allowed})")
    path = preset.get("model", preset.get("path", path))
    if not isinstance(path, str) or not path:
        raise ModelSpecError(f"{where}: no file for this model (set model = PATH)")
    overrides = {key: _typed(where, key, preset[key]) for key in PER_MODEL_SETTINGS & set(preset)}
    found = {}
    for key in ("aliases", "tags"):
        value = preset.get(key, ())
        if isinstance(value, str):
            value = tuple(a.strip() for a in value.split(",") if a.strip())
        if not isinstance(value, (list, tuple)) or not all(isinstance(a, str) and a.strip() for a in value):
            raise ModelSpecError(f"{where}: {key} must be names (a list of strings, or one string with commas)")
        found[key] = tuple(a.strip() for a in value)
    load = _typed(where, "load_on_start", preset.get("load_on_start", False))
    settings = dataclasses.replace(settings, **overrides)
    wrong = model_settings_error(settings)
    if wrong is not None:
        raise ModelSpecError(f"{where}: {wrong[0]} {wrong[1]}")
    return ModelSpec(id_, path, settings, found["aliases"], bool(load), tags=found["tags"])


def _names(value: str | None) -> tuple[str, ...]:
    """A comma-separated list of names, in order, without blanks or repeats."""
    return tuple(sorted({name.strip() for name in (value or "").split(",") if name.strip()}))


def _typed(where: str, key: str, value: Any) -> Any:
    """A preset's value as its setting's type (INI gives strings; TOML must give the type)."""
    kind = bool if key == "load_on_start" else _setting_type(key)
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        try:
            return read_bool(text) if kind is bool else kind(text)
        except ValueError:
            raise ModelSpecError(f"{where}: {key} = {value!r} is not a {kind.__name__}") from None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ModelSpecError(f"{where}: {key} = {value!r} is not a {kind.__name__}")
    return value


def _setting_type(key: str) -> type:
    if key in {"chat_template_file", "chat_template", "pooling"}:
        return str
    return type(getattr(Settings(), key))
