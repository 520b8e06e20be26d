"""The machinery behind the config dataclasses of :mod:`common.config`: YAML files, command-line
options, and the command line of a child process, all derived from the fields.

Precedence: dataclass defaults < ``--config FILE.yaml`` < explicit command-line options.
``--help`` text comes from each field's ``help`` metadata. Unknown YAML keys and wrongly typed
values are errors naming the key, the file and the accepted keys.

Field metadata understood here, besides ``help``:

* nested dataclasses: ``flatten`` (its options keep their names; its YAML keys may also be
  written at the top level), ``prefix`` (default ``NAME-``), ``skip`` (fields that are no
  options there: a launcher sets them);
* ``metavar``, ``choices``: as in argparse;
* ``negatable=False``: a bool that is only switched on (``--force``; default False);
* ``fallback``: for a field whose default is ``None`` (meaning "not given"), the value it
  stands for; ``--help`` shows it as the default;
* ``mutex`` (a name): options of one name exclude each other; ``mutex_required``: one of them
  must be given.

:func:`to_argv` is the inverse of :func:`add_config_args`: every launcher builds its children's
command lines with it, so no option can be dropped on the way to a child.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from common.errors import ConfigError

T = TypeVar("T")


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A config field with a default and its --help text (``kw``: the metadata above)."""
    if isinstance(default, list):
        items = list(default)
        return field(default_factory=items.copy, metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def parse_int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers like 10,10, got {text!r}"
        ) from e


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


@dataclass(frozen=True)
class Option:
    """One command-line option of a config class: a leaf field, reached through ``path``."""

    path: tuple[str, ...]  # attribute names from the root config
    field: dataclasses.Field
    tp: Any                # the field's type (``X | None`` unwrapped)
    flag: str              # --name
    dest: str              # its argparse dest
    group: str             # argument-group title ("" at the top level)

    @property
    def meta(self) -> Any:
        return self.field.metadata


def options(cls: type, prefix: str = "", skip: tuple[str, ...] = (),
            path: tuple[str, ...] = (), group: str = "",
            keep_skipped: bool = False) -> Iterator[Option]:
    """The options of ``cls``: nested dataclasses flattened or prefixed, ``skip`` (and each
    section's own ``skip``) left out unless ``keep_skipped``."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip and not keep_skipped:
            continue
        tp = hints[f.name]
        if _is_dataclass_type(tp):
            sub = "" if f.metadata.get("flatten") else f.metadata.get("prefix", f.name + "-")
            yield from options(tp, prefix + sub, tuple(f.metadata.get("skip", ())),
                               path + (f.name,), f.metadata.get("help", f.name), keep_skipped)
            continue
        name = prefix + f.name.replace("_", "-")
        yield Option(path + (f.name,), f, _unwrap_optional(tp), "--" + name,
                     name.replace("-", "_"), group)


def _get(cfg: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        cfg = getattr(cfg, name)
    return cfg


def _set(cfg: Any, path: tuple[str, ...], value: Any) -> None:
    setattr(_get(cfg, path[:-1]), path[-1], value)


# ---------------------------------------------------------------- YAML


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check a YAML value against a field type; ints are accepted for floats."""
    origin = typing.get_origin(tp)
    if origin in (list,):
        (inner,) = typing.get_args(tp)
        if isinstance(value, str) and inner is int:
            return parse_int_list(value)
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        return None if value is None else _coerce(value, _unwrap_optional(tp), where)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported config type {tp}")


def _route_flattened(cls: type, data: dict) -> dict:
    """Top-level keys that belong to a flattened section, moved into that section."""
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    data = dict(data)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if not (_is_dataclass_type(tp) and f.metadata.get("flatten")):
            continue
        skip = set(f.metadata.get("skip", ()))
        mine = [k for k in data if k not in names and k not in skip
                and k in {g.name for g in dataclasses.fields(tp)}]
        if mine and isinstance(data.get(f.name) or {}, dict):
            data[f.name] = {**(data.get(f.name) or {}), **{k: data.pop(k) for k in mine}}
    return data


def from_dict(cls: type[T], data: dict, where: str) -> T:
    """Build ``cls`` from a (YAML) dict; unknown keys and bad types are ConfigErrors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of option: value, got {type(data).__name__}")
    data = _route_flattened(cls, data)
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{where}: unknown option(s) {unknown}; valid options are {sorted(names)}"
        )
    kwargs = {}
    for key, value in data.items():
        tp = hints[key]
        if _is_dataclass_type(tp):
            kwargs[key] = from_dict(tp, value or {}, f"{where}.{key}")
        else:
            kwargs[key] = _coerce(value, tp, f"{where}: option {key!r}")
    return cls(**kwargs)


# ---------------------------------------------------------------- command line


def _shown_default(o: Option, defaults: Any) -> Any:
    value = _get(defaults, o.path)
    if value is None and "fallback" in o.meta:
        value = o.meta["fallback"]
    return ",".join(map(str, value)) if isinstance(value, list) else value


def _argparse_kwargs(o: Option) -> dict[str, Any]:
    kw = {k: o.meta[k] for k in ("metavar", "choices") if k in o.meta}
    if o.tp is bool:
        negatable = o.meta.get("negatable", True)
        return {"action": argparse.BooleanOptionalAction if negatable else "store_true", **kw}
    if typing.get_origin(o.tp) is list:
        return {"type": parse_int_list, "metavar": "N,N", **kw}
    return {"type": o.tp, **kw}


def add_config_args(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                    prefix: str = "", skip: tuple[str, ...] = (),
                    defaults: Any = None) -> None:
    """Add one ``--option`` per field of ``cls`` (nested dataclasses flattened or prefixed).

    Options default to ``argparse.SUPPRESS`` so only those given override the YAML file;
    ``--help`` shows the defaults of ``defaults`` (an instance; ``cls()`` if None).
    """
    defaults = cls() if defaults is None else defaults
    groups: dict[str, Any] = {"": parser}
    mutexes: dict[str, Any] = {}
    for o in options(cls, prefix, skip):
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(o.group)
        target = groups[o.group]
        if "mutex" in o.meta:
            if o.meta["mutex"] not in mutexes:
                mutexes[o.meta["mutex"]] = target.add_mutually_exclusive_group(
                    required=o.meta.get("mutex_required", False))
            target = mutexes[o.meta["mutex"]]
        help_text = f"{o.meta.get('help', '')} (default: {_shown_default(o, defaults)!r})"
        target.add_argument(o.flag, dest=o.dest, default=argparse.SUPPRESS, help=help_text,
                            **_argparse_kwargs(o))


def _apply_overrides(cfg: Any, ns: dict) -> None:
    for o in options(type(cfg)):
        if o.dest in ns:
            _set(cfg, o.path, ns[o.dest])


def _render(o: Option, value: Any) -> list[str]:
    if o.tp is bool:
        if value:
            return [o.flag]
        if not o.meta.get("negatable", True):
            raise ConfigError(f"{o.flag} cannot be switched off on a command line")
        return ["--no-" + o.flag[2:]]
    if value is None:
        raise ConfigError(f"{o.flag}: 'not given' (None) cannot be written on a command line")
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return [f"{o.flag}={text}"]  # "=": a value like -1,-1 must not parse as an option


def to_argv(cfg: Any) -> list[str]:
    """The command-line options that make a parser built by ``add_config_args(parser,
    type(cfg))`` rebuild ``cfg`` (the inverse: :func:`from_argv`): one ``--name=value``
    (bools ``--x`` / ``--no-x``, lists comma-separated) per field that differs from its
    default. A field of a nested section's ``skip`` that differs from its default is an
    error: the child would silently lose it."""
    defaults = type(cfg)()
    argv: list[str] = []
    given = set()
    for o in options(type(cfg)):
        given.add(o.path)
        value = _get(cfg, o.path)
        if value != _get(defaults, o.path):
            argv += _render(o, value)
    lost = [".".join(o.path) for o in options(type(cfg), keep_skipped=True)
            if o.path not in given and _get(cfg, o.path) != _get(defaults, o.path)]
    if lost:
        raise ConfigError(f"to_argv: {type(cfg).__name__} field(s) {lost} differ from their "
                          "defaults but are no command-line options")
    return argv


def load_config(cls: type[T], config_path: str | None, cli: argparse.Namespace | dict,
                base: T | None = None) -> T:
    """The defaults (or, without a YAML file, a copy of ``base``), then the YAML file (if
    any), then the explicitly given CLI options (keys that are no option of ``cls`` are
    ignored); validated."""
    if config_path:
        path = Path(config_path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist; fix --config")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
        cfg = from_dict(cls, data, str(path))
    else:
        cfg = cls() if base is None else copy.deepcopy(base)
    ns = vars(cli) if isinstance(cli, argparse.Namespace) else dict(cli)
    _apply_overrides(cfg, ns)
    if hasattr(cfg, "validate"):
        cfg.validate()
    return cfg


def from_argv(cls: type[T], argv: list[str]) -> T:
    """Parse ``argv`` as the :func:`add_config_args` options of ``cls`` and load it: the
    inverse of :func:`to_argv` (a launched child, or a test, reading its config back)."""
    p = argparse.ArgumentParser(prog=cls.__name__)
    add_config_args(p, cls)
    return load_config(cls, None, p.parse_args(argv))


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)
