"""Writes the JSON schema of each version of a CustomResourceDefinition, as check-jsonschema reads it.

The schema is the version's `openAPIV3Schema`, made strict the way openapi2jsonschema's
"strict" output is: an object that lists its properties admits no others, so a misspelt
field fails the test instead of being pruned by the API server. `apiVersion` and `kind`
are pinned to the CRD's own, as in the Kubernetes schemas beside it. A pattern in Go's
regex syntax that JSON Schema's (ECMA 262) lacks, the case-insensitive flag `(?i)`, is
spelt out letter by letter.

    python deploy/kubernetes/schemas/from_crd.py CRD.yaml OUT_DIR

Run by hand when the pinned operator version changes (schemas/README.md); tests read
only its output.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def ecma_pattern(pattern: str) -> str:
    """`^(?i)(abort|warn)?$` -> `^([aA][bB]...)?$`: the same language without the inline flag."""
    if "(?i)" not in pattern:
        return pattern
    out, in_class, escaped = [], False, False
    for char in pattern.replace("(?i)", ""):
        if escaped or char == "\\":
            escaped = not escaped and char == "\\"
            out.append(char)
            continue
        if char in "[]":
            in_class = char == "["
        letter = char.isascii() and char.isalpha()
        if letter and in_class:
            raise ValueError(f"pattern {pattern!r}: a letter in a class under (?i) is not handled")
        out.append(f"[{char.lower()}{char.upper()}]" if letter else char)
    return "".join(out)


def strict(schema: Any) -> Any:
    """A copy of `schema` whose objects with listed properties forbid unlisted ones."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "properties":  # a map of field name -> schema, not a schema itself
            out[key] = {name: strict(sub) for name, sub in value.items()}
        elif key == "pattern":
            out[key] = ecma_pattern(value)
        else:
            out[key] = strict(value)
    open_ended = out.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in out
    if "properties" in out and not open_ended:
        out["additionalProperties"] = False
    return out


def schemas(crd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """File name (kind-group-version.json, the Kubernetes schemas' layout) -> schema."""
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    out = {}
    for version in crd["spec"]["versions"]:
        schema = strict(version["schema"]["openAPIV3Schema"])
        schema["properties"]["apiVersion"]["enum"] = [f"{group}/{version['name']}"]
        schema["properties"]["kind"]["enum"] = [kind]
        schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
        out[f"{kind.lower()}-{group.split('.')[0]}-{version['name']}.json"] = schema
    return out


class CrdLoader(yaml.SafeLoader):
    """YAML 1.2 reads a plain `=` as the string it is; PyYAML's 1.1 resolver takes it for the `value` tag
    and cannot build it (AlertmanagerConfig's matchType enum lists `=`)."""


CrdLoader.add_constructor("tag:yaml.org,2002:value", lambda loader, node: loader.construct_scalar(node))


def main(argv: list[str]) -> int:
    crd_file, out_dir = Path(argv[0]), Path(argv[1])
    for name, schema in schemas(yaml.load(crd_file.read_text(), Loader=CrdLoader)).items():
        (out_dir / name).write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(out_dir / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
