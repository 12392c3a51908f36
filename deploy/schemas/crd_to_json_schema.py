#!/usr/bin/env python3
"""Turns a CustomResourceDefinition's openAPIV3Schema into a JSON Schema (draft 2020-12) that
check-jsonschema can validate a custom resource against, offline.

Usage: crd_to_json_schema.py CRD.yaml OUT_DIR
Writes OUT_DIR/<kind lower case>_<version>.json for every served version. Like the API server's
structural-schema checks: objects with properties refuse unknown fields (unless
x-kubernetes-preserve-unknown-fields), x-kubernetes-int-or-string is an integer or a string,
nullable adds null, Go's inline "(?i)" (which ECMAScript regexes lack) becomes letter classes
([aA]), and apiVersion / kind / metadata.name are required.
"""
import json
import os
import sys

import yaml


def ecma_pattern(pattern):
    """A Go (RE2) pattern as ECMAScript: text after "(?i)" matches either case letter by letter."""
    if "(?i)" not in pattern:
        return pattern
    head, rest = pattern.split("(?i)", 1)
    out, in_class, escaped = [], False, False
    for ch in rest:
        if escaped:
            out.append(ch)
            escaped = False
        elif ch == "\\":
            out.append(ch)
            escaped = True
        elif ch == "[":
            in_class = True
            out.append(ch)
        elif ch == "]":
            in_class = False
            out.append(ch)
        elif ch.isalpha() and not in_class:
            out.append(f"[{ch.lower()}{ch.upper()}]")
        else:
            out.append(ch)
    return head + "".join(out)


def convert(node):
    """The JSON Schema of one OpenAPI v3 schema node (a copy; the input is not changed)."""
    if isinstance(node, list):
        return [convert(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: convert(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = convert(value) if isinstance(value, (dict, list)) else value
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [convert(child) for child in value]
        elif key == "pattern":
            out[key] = ecma_pattern(value)
        elif key == "nullable":
            continue
        elif key.startswith("x-kubernetes-"):
            continue  # extensions: handled below, or meaningless to a validator
        else:
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"] if isinstance(out["type"], str) else out["type"] + ["null"]
    if (out.get("type") == "object" and "properties" in out and "additionalProperties" not in out
            and not node.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def main():
    crd_path, out_dir = sys.argv[1], sys.argv[2]
    with open(crd_path, encoding="utf-8") as f:
        crd = yaml.safe_load(f)
    spec = crd["spec"]
    group, kind = spec["group"], spec["names"]["kind"]
    for version in spec["versions"]:
        if not version.get("served", False):
            continue
        schema = convert(version["schema"]["openAPIV3Schema"])
        props = schema.setdefault("properties", {})
        props["apiVersion"] = {"type": "string", "const": f"{group}/{version['name']}"}
        props["kind"] = {"type": "string", "const": kind}
        props["metadata"] = {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 253}},
        }
        schema["required"] = sorted(set(schema.get("required", [])) | {"apiVersion", "kind", "metadata"})
        schema = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "title": f"{kind} ({group}/{version['name']})",
            "description": f"Converted from {os.path.basename(crd_path)} by crd_to_json_schema.py.",
            **schema,
        }
        out = os.path.join(out_dir, f"{kind.lower()}_{version['name']}.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(schema, f, indent=1, sort_keys=True)
            f.write("\n")
        print(out)


if __name__ == "__main__":
    main()
