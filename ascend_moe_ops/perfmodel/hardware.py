"""Hardware parameter tables of the performance models.

A table is a JSON file ``ascend_moe_ops/perfmodel/hardware/<name>.json``::

    {
      "name": "a2",
      "title": "Atlas A2 training series (Ascend 910B)",
      "version": "2026-12-04.1",
      "params": {
        "cube_cores": {"value": 24, "unit": "cores", "source": "<public document and page>"},
        "clock_hz":   {"value": 1.65e9, "unit": "Hz", "assumption": "<why this value>"},
        ...
      }
    }

Every entry has a numeric ``value``, a ``unit`` and exactly one of ``source`` (a public document,
with enough detail to find the figure) or ``assumption`` (why the value was chosen and what would
settle it). A table that breaks this rule does not load; nor does one with a negative value (no
entry is a signed quantity) or with zero for a rate, clock or count (:data:`POSITIVE_KEYS`: a clock,
a bandwidth other than ``host_bandwidth`` -- 0 there is "no host link" --, a per-cycle rate, a peak, a
core / device / link count, a line size), which the models divide by. ``version`` is shown next to every modelled
number so that a reader can tell which table produced it.

Sensitivity studies take ``table.scaled({"key": 1.3})``: a copy with those values multiplied.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Mapping

__all__ = ["Param", "HardwareTable", "load_table", "available_tables", "TableError", "POSITIVE_KEYS"]

#: keys whose value must be > 0 (the models divide by them); every other value must be >= 0
#: (``host_bandwidth`` 0 means no host link, as ``Cluster.host_bw``: swapping is then refused)
POSITIVE_KEYS = re.compile(r"clock_hz$|(?<!^host_)bandwidth|_per_cycle|^peak_.*_flops$|_cores$|^devices_per_node$"
                           r"|_links$|_line_bytes$")


class TableError(ValueError):
    """A hardware table is malformed (missing value, unit, or source/assumption)."""


@dataclass(frozen=True)
class Param:
    """One hardware parameter: its value, unit and where the value comes from."""

    key: str
    value: float
    unit: str
    source: str | None = None
    assumption: str | None = None

    @property
    def is_assumption(self) -> bool:
        return self.assumption is not None

    @property
    def citation(self) -> str:
        return self.source if self.source is not None else "assumption: " + str(self.assumption)


@dataclass(frozen=True)
class HardwareTable:
    """A checked hardware table. ``table["key"]`` is the value; ``table.param("key")`` the entry."""

    name: str
    title: str
    version: str
    params: Mapping[str, Param] = field(default_factory=dict)

    def __getitem__(self, key: str) -> float:
        return self.param(key).value

    def __contains__(self, key: object) -> bool:
        return key in self.params

    def param(self, key: str) -> Param:
        try:
            return self.params[key]
        except KeyError:
            raise KeyError(f"hardware table {self.name!r} (version {self.version}) has no parameter "
                           f"{key!r}; it has: {', '.join(sorted(self.params))}") from None

    def require(self, keys, what: str) -> "HardwareTable":
        """This table, if it has every one of ``keys`` (what ``what`` reads); else a TableError
        naming the table and the missing keys."""
        missing = [k for k in keys if k not in self.params]
        if missing:
            raise TableError(f"hardware table {self.name!r} (version {self.version}) lacks "
                             f"{', '.join(map(repr, missing))}, which {what} needs")
        return self

    @property
    def label(self) -> str:
        """What to print next to a number this table produced."""
        return f"{self.title} (model, table {self.name} v{self.version})"

    def assumptions(self) -> list[Param]:
        return [p for p in self.params.values() if p.is_assumption]

    def markdown(self) -> str:
        """The table as Markdown rows (parameter, value, unit, source or assumption), in file order:
        what the docs print under "The table" (a test keeps them equal)."""
        rows = ["| parameter | value | unit | source or assumption |", "|---|---|---|---|"]
        for p in self.params.values():
            cite = p.source if p.source is not None else "**assumption**: " + str(p.assumption)
            rows.append(f"| `{p.key}` | {p.value:g} | {p.unit} | {cite} |")
        return "\n".join(rows)

    def scaled(self, factors: Mapping[str, float]) -> "HardwareTable":
        """A copy with ``params[key].value *= factor`` for each entry of ``factors``."""
        params = dict(self.params)
        for key, f in factors.items():
            p = self.param(key)
            if not (isinstance(f, (int, float)) and math.isfinite(f) and f > 0):
                raise ValueError(f"scaled: factor for {key!r} must be a positive finite number, got {f!r}")
            params[key] = Param(key, p.value * f, p.unit, p.source, p.assumption)
        tag = ",".join(f"{k}x{v:g}" for k, v in sorted(factors.items()))
        return HardwareTable(self.name, self.title, f"{self.version}+{tag}" if tag else self.version, params)

    @classmethod
    def from_dict(cls, data: Mapping, *, where: str = "<dict>") -> "HardwareTable":
        def need(obj, key, typ, ctx):
            if key not in obj:
                raise TableError(f"{where}: {ctx} has no {key!r}")
            if not isinstance(obj[key], typ) or isinstance(obj[key], bool):
                raise TableError(f"{where}: {ctx}.{key} must be {typ}, got {type(obj[key]).__name__}")
            return obj[key]

        if not isinstance(data, Mapping):
            raise TableError(f"{where}: a table must be a JSON object, got {type(data).__name__}")
        name = need(data, "name", str, "table")
        if where == "<dict>":
            where = f"table {name!r}"
        title = need(data, "title", str, "table")
        version = need(data, "version", str, "table")
        raw = need(data, "params", dict, "table")
        params = {}
        for key, entry in raw.items():
            ctx = f"params[{key!r}]"
            if not isinstance(entry, dict):
                raise TableError(f"{where}: {ctx} must be an object")
            value = need(entry, "value", (int, float), ctx)
            if not math.isfinite(value):
                raise TableError(f"{where}: {ctx}.value must be finite, got {value!r}")
            if POSITIVE_KEYS.search(key) and not value > 0:
                raise TableError(f"{where}: {ctx}.value must be > 0 (a rate, clock or count), got {value!r}")
            if value < 0:
                raise TableError(f"{where}: {ctx}.value must be >= 0, got {value!r}")
            unit = need(entry, "unit", str, ctx)
            src, asm = entry.get("source"), entry.get("assumption")
            if (src is None) == (asm is None):
                raise TableError(f"{where}: {ctx} needs exactly one of 'source' (a public document) "
                                 f"or 'assumption' (why the value was chosen)")
            text = src if src is not None else asm
            if not isinstance(text, str) or len(text.strip()) < 8:
                raise TableError(f"{where}: {ctx}.{'source' if src is not None else 'assumption'} "
                                 f"must say where the figure comes from (got {text!r})")
            extra = set(entry) - {"value", "unit", "source", "assumption", "note"}
            if extra:
                raise TableError(f"{where}: {ctx} has unknown fields {sorted(extra)}")
            params[key] = Param(key, float(value), unit, src, asm)
        return cls(name, title, version, params)


def _dir():
    return resources.files(__package__) / "hardware"


def available_tables() -> list[str]:
    """Names of the shipped tables (``load_table(name)`` loads one)."""
    return sorted(p.name[:-5] for p in _dir().iterdir() if p.name.endswith(".json"))


def load_table(name_or_path: str | Path) -> HardwareTable:
    """Load and check a shipped table by name (``"a2"``) or a JSON file by path."""
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        text, where = p.read_text(), str(p)
    else:
        f = _dir() / f"{name_or_path}.json"
        if not f.is_file():
            raise ValueError(f"load_table: no hardware table {name_or_path!r}; shipped tables: "
                             f"{', '.join(available_tables()) or 'none'}")
        text, where = f.read_text(), f"hardware/{name_or_path}.json"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise TableError(f"{where}: not valid JSON ({e})") from None
    return HardwareTable.from_dict(data, where=where)
