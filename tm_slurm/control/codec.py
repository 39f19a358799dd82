"""The control plane's only encoding: JSON of plain fields, building nothing but the dataclasses of
`messages.py` (security model: docs/design.md §9).

Nothing that crossed a process boundary is unpickled. Values are None, bool, int, float, str,
lists, tuples (tagged, so a decoded message equals the one sent) and dicts (tagged when a key is
not a plain string). On the control plane a message is {"#m": name, "a": [its fields' values,
in their order]}: positional, as a controller decodes ~16,000 of them a second at 1,024 nodes x 8
and field names cost it a dict and two set operations each, and both ends are one version of
this file, started together. In a file that outlives the job's processes (a checkpoint's index,
`dumps`) a message is {"#m": name, "f": {field: value}}, so a later version still reads it.
Decoding refuses an unknown message name, an unknown or missing field, too many or too few
values, and any tag it does not know.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from .. import messages

_TUPLE, _DICT, _MSG = "#t", "#d", "#m"


class DecodeError(ValueError):
    pass


def _registry() -> dict[str, type]:
    return {name: obj for name, obj in vars(messages).items()
            if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == messages.__name__}


_TYPES = _registry()
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _TYPES.values()}
_REQUIRED = {cls: frozenset(f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                            and f.default_factory is dataclasses.MISSING) for cls in _TYPES.values()}


def _enc(v: Any, named: bool) -> Any:
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, tuple):
        return {_TUPLE: [_enc(x, named) for x in v]}
    if isinstance(v, list):
        return [_enc(x, named) for x in v]
    if isinstance(v, dict):
        if all(isinstance(k, str) and not k.startswith("#") for k in v):
            return {k: _enc(x, named) for k, x in v.items()}
        return {_DICT: [[_enc(k, named), _enc(x, named)] for k, x in v.items()]}
    names = _FIELDS.get(type(v))
    if names is not None:
        if named:
            return {_MSG: type(v).__name__, "f": {n: _enc(getattr(v, n), named) for n in names}}
        return {_MSG: type(v).__name__, "a": [_enc(getattr(v, n), named) for n in names]}
    raise TypeError(f"{type(v).__name__} cannot cross the control plane (plain values and messages.py types only)")


_PLAIN = frozenset({str, int, float, bool, type(None)})


def _dec(v: Any) -> Any:
    # the tagged shapes are tested first, by exact keys: a controller decodes every agent's
    # heartbeat (10 a second each), so this is its hottest code at 1,024 nodes
    t = type(v)
    if t is list:
        return [y if type(y) in _PLAIN else _dec(y) for y in v]
    if t is not dict:
        return v
    n = len(v)
    if n == 1:
        if (x := v.get(_TUPLE)) is not None and type(x) is list:
            return tuple([y if type(y) in _PLAIN else _dec(y) for y in x])
        if (x := v.get(_DICT)) is not None and type(x) is list:
            if not all(isinstance(p, list) and len(p) == 2 for p in x):
                raise DecodeError("malformed mapping")
            return {_hashable(_dec(k)): _dec(y) for k, y in x}
    elif n == 2 and _MSG in v:
        if type(a := v.get("a")) is list:
            return _message(v[_MSG], a)
        if type(f := v.get("f")) is dict:
            return _named(v[_MSG], f)
    tags = [k for k in v if k.startswith("#")]
    if tags:
        raise DecodeError(f"unknown tags {tags}")
    return {k: _dec(x) for k, x in v.items()}


def _hashable(k: Any) -> Any:
    if isinstance(k, (list, dict)):
        raise DecodeError("a mapping key must be a plain value")
    return k


def _cls(name: Any) -> type:
    cls = _TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise DecodeError(f"unknown message type {name!r}")
    return cls


def _message(name: Any, args: list) -> Any:
    cls = _cls(name)
    if not len(_REQUIRED[cls]) <= len(args) <= len(_FIELDS[cls]):
        raise DecodeError(f"{name}: {len(args)} fields, not {len(_REQUIRED[cls])}..{len(_FIELDS[cls])}")
    try:
        return cls(*[x if type(x) in _PLAIN else _dec(x) for x in args])
    except TypeError as e:
        raise DecodeError(f"{name}: {e}") from None


def _named(name: Any, fields: dict) -> Any:
    cls = _cls(name)
    extra = set(fields).difference(_FIELDS[cls])
    if extra:
        raise DecodeError(f"{name}: unknown fields {sorted(extra)}")
    missing = _REQUIRED[cls].difference(fields)
    if missing:
        raise DecodeError(f"{name}: missing fields {sorted(missing)}")
    try:
        return cls(**{k: x if type(x) in _PLAIN else _dec(x) for k, x in fields.items()})
    except TypeError as e:
        raise DecodeError(f"{name}: {e}") from None


def decode(plain: Any) -> Any:
    """A value from the JSON of `prepare` or `dumps`; anything else raises DecodeError (never
    another exception)."""
    try:
        return _dec(plain)
    except DecodeError:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise DecodeError(f"not a control-plane value: {type(e).__name__}") from None


class Encoded(str):
    """A message already encoded to JSON: a broadcast encodes once for every link (a swap plan
    at 1,024 nodes took 2.6 ms to encode, 2.7 s for all of them)."""


def prepare(msg: Any) -> Encoded:
    return Encoded(json.dumps(_enc(msg, False), separators=(",", ":")))


def dumps(v: Any) -> bytes:
    """`v` for a file that outlives this version: messages with their field names."""
    return json.dumps(_enc(v, True), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    try:
        plain = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise DecodeError(f"not JSON: {type(e).__name__}") from None
    return decode(plain)
