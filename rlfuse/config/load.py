"""Loading and saving configs: a YAML file (or a dict of sections) plus `section.field=value` overrides -> a validated
`Config`; the resolved config written back as YAML into each run folder, where `load_config` reads it unchanged."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlfuse.config.algorithms import ALGORITHMS
from rlfuse.config.docs import field_summary
from rlfuse.config.sections import Config
from rlfuse.config.trl_names import TRL_SECTIONS, trl_hint
from rlfuse.config.validate import validate
from rlfuse.errors import ConfigError
from rlfuse.files import write_text_atomic


def split_args(args: list[str]) -> tuple[str | None, list[str]]:
    """Command-line arguments -> (config file, overrides): the first argument without '=' is the file, the rest
    are overrides."""
    config, overrides = None, []
    for a in args:
        if "=" in a or config is not None:
            overrides.append(a)
        else:
            config = a
    return config, overrides


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple | dict = ()) -> Config:
    """YAML file (optional) + `a.b=c` overrides -> validated Config. Raises ConfigError."""
    raw: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError("config", f"file {str(path)!r} not found", "pass an existing YAML file, e.g. configs/default.yaml")
        try:
            raw = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            line = f" at line {where.line + 1}" if where else ""
            raise ConfigError("config", f"{path} is not valid YAML{line}", "fix the YAML syntax") from None
        if not isinstance(raw, dict):
            raise ConfigError("config", f"{path} must hold a mapping of sections", "write e.g. 'sft:\\n  lr: 1e-4'")
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] | tuple | dict = ()) -> Config:
    """Sections as a nested dict + overrides -> validated Config. Overrides: `a.b=c` strings (c parsed as YAML), or a
    {"a.b": value} mapping whose values are taken as they are (the Python API)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # the caller's dict stays as it was
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides]
    for key, value in items:
        section, dot, name = str(key).partition(".")
        if not dot or not section or not name:
            raise ConfigError(str(key), "overrides take the form section.field=value", "e.g. sft.lr=1e-4 or run.dir=/tmp/x")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(section, "must be a mapping of fields", f"write it as '{section}:' with indented fields")
        raw[section][name] = value
    cfg = _from_dict(Config, raw, prefix="")
    _apply_preset(cfg, set(raw.get("rl") or ()))
    return validate(cfg)


def _apply_preset(cfg: Config, given: set) -> None:
    """The algorithm's own defaults (ALGORITHMS[...].preset) for the rl fields the config leaves out. A saved
    config.yaml names every field, so a resumed run keeps what it ran with."""
    algo = ALGORITHMS.get(cfg.rl.algo)
    for name, value in (algo.preset.items() if algo else ()):
        if name not in given:
            setattr(cfg.rl, name, value)


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, value = str(item).partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(str(item), "overrides take the form section.field=value", "e.g. sft.lr=1e-4 or run.dir=/tmp/x")
    return key, _parse_scalar(value)


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else None
    except yaml.YAMLError:
        return text


def _from_dict(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "config", "must be a mapping of fields", "indent its fields under it")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in known:
            _refuse_trl_name(prefix, str(key), value)
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            doc = field_summary(cls, close[0]) if close else ""
            hint = (f"did you mean {prefix}{close[0]}" + (f" ({doc.rstrip('.')})" if doc else "") + "?" if close else
                    f"known: {', '.join(sorted(known))}")
            raise ConfigError(name, "unknown key", f"remove it ({hint}; `rlfuse --help` lists every field)")
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            kwargs[key] = _from_dict(hint, value if value is not None else {}, prefix=f"{name}.")
        else:
            kwargs[key] = _coerce(name, value, hint)
    return cls(**kwargs)


def _refuse_trl_name(prefix: str, key: str, value: Any) -> None:
    """An unknown key that is TRL's name for a field: the error names rlfuse's field (config/trl_names.py)."""
    section = prefix.rstrip(".")
    if not section and key in TRL_SECTIONS:
        raise ConfigError(key, f"no section {key!r}: TRL's settings for it live in rlfuse's {TRL_SECTIONS[key]}",
                          f"write them as {TRL_SECTIONS[key]}.FIELD (docs/from_trl.md maps each)")
    hint = trl_hint(section, key, value)
    if hint is not None:
        raise ConfigError(f"{prefix}{key}", *hint)


def _coerce(name: str, value: Any, hint) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(name, value, args[0])
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(name, f"expected true or false, got {value!r}", f"set {name}=true or {name}=false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(name, f"expected a whole number, got {value!r}", f"set e.g. {name}=8")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(name, f"expected a number, got {value!r}", f"set e.g. {name}=1e-4")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(name, f"expected text, got {value!r}", f"quote it, e.g. {name}=\"...\"")
    if hint is list or origin is list:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list):
            return value
        raise ConfigError(name, f"expected a list, got {value!r}", f"write e.g. {name}=[a,b]")
    return value


def config_to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, run_dir: str | os.PathLike) -> Path:
    """Write the resolved config as YAML into the run folder; `load_config` reads it back unchanged."""
    return write_text_atomic(Path(run_dir) / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
