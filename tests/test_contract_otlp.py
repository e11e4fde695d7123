"""How attribute values are written into OTLP messages (contract/otlp.py), read back through protobuf."""

from __future__ import annotations

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from pdwatch.contract.otlp import add_attributes, set_value


def read(value: AnyValue):
    """The Python value and OTLP type of one AnyValue, lists item by item."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [read(item) for item in value.array_value.values]
    return kind, getattr(value, kind)


def written(v) -> AnyValue:
    span = Span()
    add_attributes(span, {"k": v})
    back = Span.FromString(span.SerializeToString())  # what the sidecar reads
    return back.attributes[0].value


@pytest.mark.parametrize(("items", "kind"), [
    (["a", "b", ""], "string_value"),
    ([1, -2, 2**62], "int_value"),
    ([0.5, -1.0], "double_value"),
    ([True, False], "bool_value"),
])
def test_a_list_of_one_type_is_written_item_by_item_with_that_type(items, kind):
    assert read(written(items)) == [(kind, x) for x in items]


def test_mixed_lists_keep_each_items_own_type():
    # bool is an int subclass: a list of both must not be written as all ints.
    assert read(written([1, True, "x", 2.5])) == [
        ("int_value", 1), ("bool_value", True), ("string_value", "x"), ("double_value", 2.5)]


def test_an_item_of_no_otel_type_is_kept_as_text_as_before():
    assert read(written(["a", None])) == [("string_value", "a"), ("string_value", "None")]


def test_an_empty_list_is_an_empty_array_not_a_missing_value():
    value = written([])
    assert value.WhichOneof("value") == "array_value" and len(value.array_value.values) == 0


def test_the_typed_path_writes_what_the_item_by_item_path_writes():
    items = [f"{i:032x}" for i in range(100)]
    one_by_one = AnyValue()
    one_by_one.array_value.SetInParent()
    for item in items:
        set_value(one_by_one.array_value.values.add(), item)
    assert written(items).SerializeToString() == one_by_one.SerializeToString()
