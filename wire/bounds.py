"""What one message's schema allows, in msgpack terms (``Bounds``): derived once from the pydantic
schema when a message registers (wire.message), checked on the bytes before anything is built from
them (wire.walk, wire.decode). Every string, binary and container field must declare a ``max_length``:
a field without one cannot be bounded, and registration refuses it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one message's schema allows, in msgpack terms: the longest string
    (in UTF-8 bytes: 4 per character the schema counts), binary, array and map
    anywhere in it, its deepest nesting (the top map is depth 1), the most
    objects (every key, value and item) a valid message can hold, and the most
    bytes its encoding can take."""

    str_bytes: int = 0
    bin_bytes: int = 0
    array_len: int = 0
    map_len: int = 0
    depth: int = 0
    objects: int = 1
    encoded_bytes: int = 9


# Objects past this are not counted further: a bound that large is no bound,
# and the protocol's ``max_objects`` caps it.
_MANY = 1 << 40


def _bounds_of_schema(schema: Mapping[str, Any], refs: dict[str, Mapping[str, Any]], where: str) -> Bounds:
    kind = schema["type"]
    if kind == "definitions":
        for definition in schema["definitions"]:
            refs[definition["ref"]] = definition
        return _bounds_of_schema(schema["schema"], refs, where)
    if kind == "definition-ref":
        ref = schema["schema_ref"]
        target = refs.get(ref)
        if target is None:
            raise TypeError(f"{where}: a recursive schema has no bound")
        # Mark it while descending: a schema that reaches itself is unbounded.
        refs[ref] = {"type": "definition-ref", "schema_ref": "<recursion>"}
        try:
            return _bounds_of_schema(target, refs, where)
        finally:
            refs[ref] = target
    if kind == "model":
        return _bounds_of_schema(schema["schema"], refs, schema["cls"].__name__)
    if kind == "model-fields":
        fields = schema["fields"]
        parts = [_bounds_of_schema(f["schema"], refs, f"{where}.{name}") for name, f in fields.items()]
        objects = 1 + len(fields) + sum(p.objects for p in parts)
        encoded = 5 + sum(5 + len(name.encode()) + p.encoded_bytes for name, p in zip(fields, parts, strict=True))
        depth = 1 + max((p.depth for p in parts), default=0)
        # The keys are strings too.
        parts.append(Bounds(str_bytes=max((len(name.encode()) for name in fields), default=0)))
        return _merge(parts, map_len=len(fields), depth=depth, objects=objects, encoded_bytes=encoded)
    if kind in ("default", "nullable", "model-field", "function-after", "function-before", "function-wrap"):
        return _bounds_of_schema(schema["schema"], refs, where)
    if kind in ("int", "float", "bool", "none"):
        return Bounds()
    if kind == "literal":
        return _literal_bounds(schema["expected"], where)
    if kind == "enum":
        return _literal_bounds([member.value for member in schema["members"]], where)
    if kind in ("str", "bytes"):
        length = schema.get("max_length")
        if length is None:
            raise TypeError(f"{where}: a {kind} field on the wire needs a max_length")
        if kind == "str":
            return Bounds(str_bytes=4 * length, encoded_bytes=5 + 4 * length)
        return Bounds(bin_bytes=length, encoded_bytes=5 + length)
    if kind == "function-plain":
        length = schema.get("metadata", {}).get("wire_bin_max")
        if length is None:
            raise TypeError(f"{where}: a custom field type on the wire must declare its wire_bin_max")
        return Bounds(bin_bytes=length, encoded_bytes=5 + length)
    if kind in ("list", "dict"):
        length = schema.get("max_length")
        if length is None:
            raise TypeError(f"{where}: a {kind} field on the wire needs a max_length")
        if kind == "list":
            item = _bounds_of_schema(schema["items_schema"], refs, f"{where}[]")
            return _merge(
                [item],
                array_len=length,
                depth=item.depth + 1,
                objects=1 + length * item.objects,
                encoded_bytes=5 + length * item.encoded_bytes,
            )
        key = _bounds_of_schema(schema["keys_schema"], refs, f"{where}{{key}}")
        value = _bounds_of_schema(schema["values_schema"], refs, f"{where}{{value}}")
        return _merge(
            [key, value],
            map_len=length,
            depth=max(key.depth, value.depth) + 1,
            objects=1 + length * (key.objects + value.objects),
            encoded_bytes=5 + length * (key.encoded_bytes + value.encoded_bytes),
        )
    if kind in ("union", "tagged-union"):
        choices = schema["choices"]
        options = choices.values() if isinstance(choices, dict) else choices
        parts = [
            _bounds_of_schema(option[0] if isinstance(option, tuple) else option, refs, where) for option in options
        ]
        return _merge(
            parts,
            depth=max(p.depth for p in parts),
            objects=max(p.objects for p in parts),
            encoded_bytes=max(p.encoded_bytes for p in parts),
        )
    raise TypeError(f"{where}: cannot bound a {kind!r} field on the wire")


def _literal_bounds(values: list[Any], where: str) -> Bounds:
    if not all(isinstance(value, str | int | bool) for value in values):
        raise TypeError(f"{where}: literals on the wire are strings or ints")
    longest = max((len(v.encode()) for v in values if isinstance(v, str)), default=0)
    return Bounds(str_bytes=longest, encoded_bytes=max(9, 5 + longest))


def _merge(
    parts: list[Bounds], *, array_len: int = 0, map_len: int = 0, depth: int, objects: int, encoded_bytes: int
) -> Bounds:
    return Bounds(
        str_bytes=max([p.str_bytes for p in parts], default=0),
        bin_bytes=max([p.bin_bytes for p in parts], default=0),
        array_len=max([array_len, *(p.array_len for p in parts)]),
        map_len=max([map_len, *(p.map_len for p in parts)]),
        depth=max([depth, *(p.depth for p in parts)]),
        objects=min(objects, _MANY),
        encoded_bytes=min(encoded_bytes, _MANY),
    )


def schema_bounds(model: type[BaseModel]) -> Bounds:
    """The ``Bounds`` of ``model``'s schema; TypeError if a field is unbounded."""
    return _bounds_of_schema(model.__pydantic_core_schema__, {}, model.__name__)


# Bound once: looking them up on every per-token message shows in the profile.
_new = object.__new__
_setattr = object.__setattr__
