"""Run files: reading a TOML run file into a :class:`~potluck.protos.config.runconfig.RunConfig`, the
``--set SECTION.FIELD=VALUE`` overrides, and writing one back (``dump_toml``). Every mistake is a
:class:`~potluck.protos.config.section.ConfigError` naming the dotted field and, where it can, the fix.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from potluck.protos.config.runconfig import RunConfig
from potluck.protos.config.section import ConfigError


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = unknown(where) if e["type"] == "extra_forbidden" else str(e["msg"]).removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" if where else msg)  # a whole-run rule names its fields itself
    return "; ".join(lines)


def _fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted name a run file can set: sections, and section.field."""
    out = []
    for name, field in model.model_fields.items():
        sub = field.annotation
        out.append(prefix + name)
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            out += _fields(sub, f"{prefix}{name}.")
    return out


def unknown(dotted: str) -> str:
    """'unknown field', with the name meant when one is close (a typo, or the field of another section)."""
    import difflib

    names = _fields(RunConfig)
    leaf = dotted.rsplit(".", 1)[-1]
    elsewhere = [n for n in names if n.rsplit(".", 1)[-1] == leaf and n != dotted]
    close = elsewhere[:1] or difflib.get_close_matches(dotted, names, n=1, cutoff=0.75)
    return f"unknown field (did you mean {close[0]}?)" if close else "unknown field"


def parse_config(data: dict[str, Any], *, source: str = "config") -> RunConfig:
    """Validate a config dict; raises ConfigError naming each bad field."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"invalid {source}: {_describe(err)}") from None


def load_config(path: str | Path | None) -> RunConfig:
    """Read a TOML run file (None gives all defaults)."""
    if path is None:
        return RunConfig()
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    return parse_config(data, source=str(path))


def _coerce(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(config: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    """Return a copy with dotted ``section.field`` overrides applied and the result re-validated.

    String values are read as TOML literals (``"0.5"`` becomes a float, ``"true"`` a bool), so
    ``--set diloco.outer_lr=0.5`` works from a shell. Fields the config did not set stay unset, so
    what other sections decide (``model.vocab_size`` for byte data) is decided again.
    """
    known, data = config.model_dump(), config.model_dump(exclude_unset=True)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        fields, node = known, data
        for p in parts[:-1]:
            if not isinstance(fields.get(p), dict):
                hint = unknown(dotted).removeprefix("unknown field")
                raise ConfigError(f"invalid override {dotted}: unknown section {p!r}{hint}")
            fields, node = fields[p], node.setdefault(p, {})
        if parts[-1] not in fields:
            raise ConfigError(f"invalid override {dotted}: {unknown(dotted)}")
        node[parts[-1]] = _coerce(value) if isinstance(value, str) else value
    return parse_config(data, source="overrides")


def known_fields_only(model: type[BaseModel], data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Drop keys ``model`` does not know (recursively); returns the cleaned dict and what was dropped.

    Used to read a manifest written by a newer coordinator: extra fields are ignored, not fatal.
    """
    clean: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            dropped.append(key)
            continue
        sub = field.annotation
        if isinstance(value, dict) and isinstance(sub, type) and issubclass(sub, BaseModel):
            value, sub_dropped = known_fields_only(sub, value)
            dropped.extend(f"{key}.{d}" for d in sub_dropped)
        clean[key] = value
    return clean, dropped


def dump_toml(config: RunConfig) -> str:
    """Render a config as a TOML run file (None values are left out: they mean 'default')."""

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'

    data = config.model_dump()
    lines = [f"{k} = {value(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
    for section, fields in data.items():
        if isinstance(fields, dict):
            lines.append(f"\n[{section}]")
            lines.extend(f"{k} = {value(v)}" for k, v in fields.items() if v is not None)
    return "\n".join(lines) + "\n"
