"""How pdwatch writes attribute values into OTLP messages, for everyone who sends spans.

The engine's spans (engine_patches/otlp.py) and the sidecar's `pd.stuck`
spans (sidecar/forward.py) both go through these two functions, so one value
is written one way wherever it comes from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue


class HasAttributes(Protocol):
    @property
    def attributes(self) -> Any: ...  # a repeated KeyValue field: a span's or a resource's


def set_value(value: AnyValue, v: Any) -> None:
    """Write one attribute value; bool before int, as True is an int too."""
    if isinstance(v, str):
        value.string_value = v
    elif isinstance(v, bool):
        value.bool_value = v
    elif isinstance(v, int):
        value.int_value = v
    elif isinstance(v, float):
        value.double_value = v
    elif isinstance(v, Sequence):
        array: ArrayValue = value.array_value
        array.SetInParent()  # an empty list is a list, not a missing value
        if not _set_items_of_one_type(array, v):
            for item in v:
                set_value(array.values.add(), item)
    else:  # not an OTel attribute type: kept readable rather than lost
        value.string_value = str(v)


def _set_items_of_one_type(array: ArrayValue, items: Sequence[Any]) -> bool:
    """Write a list whose items all share one scalar type with one setter each; False if they do not.

    A heartbeat lists up to PDWATCH_INVENTORY_MAX open legs in twelve lists, tens of
    thousands of items a beat on the engine's GIL; through the per-item dispatch above
    a full heartbeat cost 1.67x as much (bench/heartbeat_cost.py).
    """
    if not items:
        return False
    kind = type(items[0])
    if kind not in (str, int, float, bool) or not all(type(item) is kind for item in items):
        return False
    add = array.values.add
    if kind is str:
        for item in items:
            add().string_value = item
    elif kind is int:
        for item in items:
            add().int_value = item
    elif kind is float:
        for item in items:
            add().double_value = item
    else:
        for item in items:
            add().bool_value = item
    return True


def add_attributes(message: HasAttributes, attrs: Mapping[str, Any]) -> None:
    """Append `attrs`, in their order, to the message's attributes."""
    for key, v in attrs.items():
        kv: KeyValue = message.attributes.add()
        kv.key = key
        set_value(kv.value, v)
