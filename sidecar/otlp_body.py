"""OTLP/HTTP bodies in and out: content type, gzip, size limit, protobuf or JSON.

Parsing goes through `opentelemetry-proto`'s generated messages for both
encodings; the only thing done by hand is OTLP/JSON's one departure from the
protobuf JSON mapping (ids are hex, not base64).
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"


class BodyError(Exception):
    """A request the sidecar refuses as a whole, with the HTTP status to answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def media_type(content_type: str | None) -> str:
    """The bare media type of a Content-Type header, or raise 415."""
    bare = (content_type or "").split(";", 1)[0].strip().lower()
    if bare in (PROTOBUF, "application/protobuf"):
        return PROTOBUF
    if bare == JSON:
        return JSON
    raise BodyError(415, f"unsupported content type {content_type!r}: send {PROTOBUF} or {JSON}")


def decompress(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """Undo Content-Encoding, refusing (413) anything that grows past max_bytes."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > max_bytes:
            raise BodyError(413, f"body of {len(body)} bytes exceeds the limit of {max_bytes}")
        return body
    if encoding != "gzip":
        raise BodyError(415, f"unsupported content encoding {content_encoding!r}: use gzip or none")
    # Bounded inflate: a small bomb must not cost more than the limit in memory.
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise BodyError(400, f"malformed gzip body: {exc}") from None
    if len(out) > max_bytes or inflater.unconsumed_tail:
        raise BodyError(413, f"body exceeds the limit of {max_bytes} bytes after decompression")
    if not inflater.eof:
        raise BodyError(400, "malformed gzip body: truncated")
    return out


def _hex_ids_to_base64(node: object) -> None:
    """OTLP/JSON spells trace and span ids as hex; protobuf's JSON mapping wants base64."""
    for rs in _items(node, "resourceSpans", "resource_spans"):
        for ss in _items(rs, "scopeSpans", "scope_spans"):
            for span in _items(ss, "spans"):
                _convert_ids(span)
                for link in _items(span, "links"):
                    _convert_ids(link)


def _items(node: object, *keys: str) -> list[Any]:
    if not isinstance(node, dict):
        return []
    for key in keys:
        value = node.get(key)
        if isinstance(value, list):
            return value
    return []


_ID_KEYS = ("traceId", "trace_id", "spanId", "span_id", "parentSpanId", "parent_span_id")


def _convert_ids(obj: object) -> None:
    if not isinstance(obj, dict):
        return
    for key in _ID_KEYS:
        value = obj.get(key)
        if isinstance(value, str) and value:
            try:
                raw = binascii.unhexlify(value)
            except (binascii.Error, ValueError):
                raw = b"\xff"  # not hex: keep a wrong-length id so that span alone is rejected
            obj[key] = base64.b64encode(raw).decode("ascii")


def parse_request(body: bytes, media: str) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    if media == PROTOBUF:
        try:
            request.ParseFromString(body)
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise BodyError(400, f"malformed OTLP protobuf: {exc}") from None
        return request
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BodyError(400, f"malformed JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BodyError(400, "malformed OTLP/JSON: the body must be an object")
    _hex_ids_to_base64(doc)
    try:
        json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    except (json_format.ParseError, ValueError, TypeError, RecursionError) as exc:
        raise BodyError(400, f"malformed OTLP/JSON: {exc}") from None
    return request


def response_body(rejected: int, message: str, media: str) -> bytes:
    response = ExportTraceServiceResponse()
    if rejected or message:
        response.partial_success.rejected_spans = rejected
        response.partial_success.error_message = message
    if media == PROTOBUF:
        body: bytes = response.SerializeToString()  # protobuf ships no types: Any to mypy
        return body
    return json.dumps(json_format.MessageToDict(response)).encode()
