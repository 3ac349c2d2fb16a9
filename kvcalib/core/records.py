"""One serialiser for result records: `to_json(record)` is a command's --json and the layers calibrate's provenance
records.

A record (a dataclass) goes out as an object of its fields, each converted the same way: a record nested, a tuple or
list as a list, a tuple of (name, value) pairs (a frozen record's mapping) as an object, a number under a key ending
in "seconds" rounded to the millisecond. A record declares only where its JSON differs from its fields, in a class
attribute JSON = {key: source}: source None leaves the field `key` out, a str takes the attribute (field or property)
of that name, a callable is called with the record; a key ending in "_" spreads the nested record's keys under that
prefix (`k_` + `sqnr_db`). A record whose OMIT_NONE is true leaves out what is None."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["to_json"]


def to_json(obj: Any, drop: frozenset[str] = frozenset(), seconds: bool = False) -> Any:
    """`obj` as JSON values (module docstring); `drop`: keys left out at every level."""
    if dataclasses.is_dataclass(obj):
        spec = getattr(obj, "JSON", {})
        items = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        items |= {key: s(obj) if callable(s) else getattr(obj, s) for key, s in spec.items() if s}
        out = {}
        for key, value in items.items():
            if (
                key in drop
                or not spec.get(key, key)
                or (value is None and getattr(obj, "OMIT_NONE", False))
            ):
                continue
            value = to_json(value, drop, seconds or key.endswith("seconds"))
            out |= {key + k: v for k, v in value.items()} if key.endswith("_") else {key: value}
        return out
    if isinstance(obj, Mapping):
        return {k: to_json(v, drop, seconds) for k, v in obj.items() if k not in drop}
    if isinstance(obj, (tuple, list)):
        if obj and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in obj):
            return {k: to_json(v, drop, seconds) for k, v in obj}
        return [to_json(v, drop, seconds) for v in obj]
    return round(obj, 3) if seconds and isinstance(obj, float) else obj
