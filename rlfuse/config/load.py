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

from rlfuse.config.algorithms import ALGORITHMS, RECIPES
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


MAX_CONFIG_BYTES = 1 << 20
"""The largest config file read: a config is a few kilobytes, so a bigger file is the wrong file."""
MAX_CONFIG_VALUES = 100_000
"""The most values (mappings, lists, scalars) a config may hold once its aliases are expanded: a config has a few
hundred; YAML's aliases let a kilobyte expand to billions ("billion laughs"), which would fill the memory."""
MAX_CONFIG_DEPTH = 64
"""The deepest nesting of lists and mappings read (a config nests three levels; PyYAML recurses per level)."""


class _Refused(Exception):
    """What the config reader refuses in a YAML text, with the line (1-based) it starts at."""

    def __init__(self, problem: str, fix: str, line: int | None = None):
        super().__init__(problem)
        self.problem, self.fix, self.line = problem, fix, line


class _ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load with limits: a key given twice in one mapping is refused with both lines (PyYAML keeps the
    last and drops the first silently, a whole section with it), and so are a document that expands past
    MAX_CONFIG_VALUES values through its aliases, one that refers to itself, and nesting past MAX_CONFIG_DEPTH."""

    aliases = 0
    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            return super().compose_node(parent, index)
        self.depth += 1
        try:
            if self.depth > MAX_CONFIG_DEPTH:
                raise _Refused(f"nests lists and mappings more than {MAX_CONFIG_DEPTH} levels deep",
                               "a config nests sections, fields and short lists", self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def compose_document(self):
        node = super().compose_document()
        size = _expanded_size(node)
        if size > MAX_CONFIG_VALUES:
            how = f" once its {self.aliases} aliases (*name) are expanded" if self.aliases else ""
            raise _Refused(f"holds more than {MAX_CONFIG_VALUES} values{how}",
                           "a config holds a few hundred: write the values out, without nested anchors and aliases")
        return node

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: explicit keys override merged ones
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the constructor says so
                continue
            if first is not None:
                raise _Refused(f"key {key!r} is given twice in one mapping (lines {first} and "
                               f"{key_node.start_mark.line + 1}); YAML would keep only the second",
                               "merge the two into one (a section's fields all under one heading)")
        return super().construct_mapping(node, deep)


def _expanded_size(root) -> int:
    """The number of values `root` stands for with every alias expanded (an alias is the anchored node itself in
    PyYAML's graph, so shared nodes are counted once per reference), without expanding anything: memoised per node,
    iterative (no recursion limit). A node that contains itself is refused."""
    sizes: dict[int, int] = {}
    stack, on_path = [(root, False)], set()
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        kids = ([n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else
                list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(k)] for k in kids)
            if sizes[id(node)] > MAX_CONFIG_VALUES:
                return sizes[id(node)]
            continue
        if id(node) in on_path:
            raise _Refused("an alias refers to the list or mapping that contains it", "write the values out",
                           node.start_mark.line + 1)
        on_path.add(id(node))
        stack.append((node, True))
        for k in kids:
            if id(k) in on_path:
                raise _Refused("an alias refers to the list or mapping that contains it", "write the values out",
                               k.start_mark.line + 1)
            if id(k) not in sizes:
                stack.append((k, False))
    return sizes[id(root)]


def parse_yaml(text: str):
    """`text` read as YAML under the config reader's limits (_ConfigLoader). Raises _Refused or yaml.YAMLError."""
    loader = _ConfigLoader(text)
    try:
        return loader.get_single_data()
    except RecursionError:
        raise _Refused("nests lists and mappings too deeply",
                       "a config nests sections, fields and short lists") from None
    finally:
        loader.dispose()


def read_config_text(path: str | os.PathLike) -> str:
    """The text of config file `path`, or a ConfigError in one line for a file that is not one: missing, over
    MAX_CONFIG_BYTES, compressed or binary, not UTF-8."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError("config", f"{path} is a folder, not a YAML file", "pass the config file itself (a run "
                          "folder's is RUN_DIR/config.yaml; to continue a run, use --resume RUN_DIR)")
    if not p.is_file():
        raise ConfigError("config", f"file {str(path)!r} not found", "pass an existing YAML file, e.g. configs/default.yaml")
    try:
        size = p.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError("config", f"{path} is {size / 2**20:.1f} MiB, not a config (a config is a few KiB; "
                              f"at most {MAX_CONFIG_BYTES // 2**20} MiB is read)", "pass the YAML config file")
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError("config", f"cannot read {path} ({e.strerror})",
                          "check the path and its permissions") from None
    if raw[:2] == b"\x1f\x8b":
        raise ConfigError("config", f"{path} is gzip-compressed, not YAML text",
                          f"decompress it first (gunzip -k {path})")
    for magic, kind in ((b"PK\x03\x04", "a zip archive"), (b"BZh", "bzip2-compressed"), (b"\xfd7zXZ", "xz-compressed"),
                        (b"\x28\xb5\x2f\xfd", "zstd-compressed")):
        if raw.startswith(magic):
            raise ConfigError("config", f"{path} is {kind}, not YAML text", "extract the YAML config and pass it")
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise ConfigError("config", f"{path} is a binary file, not YAML text (a NUL byte at line {line})",
                          "pass the YAML config file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError("config", f"{path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line})",
                          "save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def read_config_file(path: str | os.PathLike) -> dict:
    """Config file `path` as a dict of sections, read under the limits of read_config_text and _ConfigLoader (no
    duplicate keys, bounded alias expansion). Raises ConfigError in one line."""
    text = read_config_text(path)
    try:
        raw = parse_yaml(text) or {}
    except _Refused as e:
        line = f" at line {e.line}" if e.line else ""
        raise ConfigError("config", f"{path}{line}: {e.problem}", e.fix) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        raise ConfigError("config", f"{path} is not valid YAML{line}", "fix the YAML syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError("config", f"{path} must hold a mapping of sections", "write e.g. 'sft:\\n  lr: 1e-4'")
    return raw


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | tuple | dict = ()) -> Config:
    """YAML file (optional) + `a.b=c` overrides -> validated Config. Raises ConfigError."""
    raw = read_config_file(path) if path is not None else {}
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] | tuple | dict = ()) -> Config:
    """Sections as a nested dict + overrides -> validated Config. Overrides: `a.b=c` strings (c parsed as YAML), or a
    {"a.b": value} mapping whose values are taken as they are (the Python API)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}  # the caller's dict stays as it was
    items = overrides.items() if isinstance(overrides, dict) else [_split_override(o) for o in overrides]
    before = dict(raw.get("rl") or {}) if isinstance(raw.get("rl"), dict) else {}
    overridden = set()
    for key, value in items:
        section, dot, name = str(key).partition(".")
        if not dot or not section or not name:
            raise ConfigError(str(key), "overrides take the form section.field=value", "e.g. sft.lr=1e-4 or run.dir=/tmp/x")
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(section, "must be a mapping of fields", f"write it as '{section}:' with indented fields")
        raw[section][name] = value
        overridden |= {name} if section == "rl" else set()
    cfg = _from_dict(Config, raw, prefix="")
    _apply_preset(cfg, before, overridden)
    return validate(cfg)


def _apply_preset(cfg: Config, before: dict, overridden: set) -> None:
    """The algorithm's own defaults (ALGORITHMS[...].preset) for the rl fields the config leaves out, and, where the
    overrides switch the algorithm (a Config object or saved config given rl.algo=grpo), for those that hold the
    previous algorithm's own value; then rl.recipe's fields (RECIPES) the config leaves out. A saved config.yaml
    names every field, so a resumed run keeps what it ran with."""
    algo, was = ALGORITHMS.get(cfg.rl.algo), ALGORITHMS.get(str(before.get("algo", "ppo")))
    for name, value in (algo.preset.items() if algo else ()):
        left_out = name not in before and name not in overridden
        previous_own = was is not None and was is not algo and name not in overridden and \
            before.get(name) == was.preset.get(name)
        if left_out or previous_own:
            setattr(cfg.rl, name, value)
    for name, value in RECIPES.get(cfg.rl.recipe, {}).items():  # rl.recipe: after the algorithm's own
        if name not in before and name not in overridden:
            setattr(cfg.rl, name, value)


def _split_override(item: str) -> tuple[str, Any]:
    key, sep, value = str(item).partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(str(item), "overrides take the form section.field=value", "e.g. sft.lr=1e-4 or run.dir=/tmp/x")
    try:
        return key, _parse_scalar(value)
    except _Refused as e:
        raise ConfigError(key, f"the value {e.problem}", e.fix) from None


def _parse_scalar(text: str) -> Any:
    """An override's value as YAML (under the config file's limits: _Refused), or the text as it is where it is not
    valid YAML."""
    try:
        return parse_yaml(text) if text != "" else None
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
