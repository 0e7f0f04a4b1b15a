#!/usr/bin/env python3
"""Every JSON file in bench/results/ matches bench/results/schema.json, and the baselines it names exist.

The schema uses a small part of JSON Schema (type, required, properties, additionalProperties); this checks exactly
that part, so that no package is needed. Exit status 1 with one line per finding.
"""
import json
import pathlib
import sys

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results"
TYPES = {"object": dict, "string": str, "integer": int, "boolean": bool, "number": (int, float)}


def type_ok(value, names):
    names = names if isinstance(names, list) else [names]
    for name in names:
        if name in ("integer", "number") and isinstance(value, bool):
            continue
        if isinstance(value, TYPES[name]):
            return True
    return False


def check(value, schema, where, findings):
    if "type" in schema and not type_ok(value, schema["type"]):
        findings.append(f"{where}: {type(value).__name__} is not {schema['type']}")
        return
    if not isinstance(value, dict):
        return
    for key in schema.get("required", []):
        if key not in value:
            findings.append(f"{where}: missing '{key}'")
    properties = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key, item in value.items():
        if key in properties:
            check(item, properties[key], f"{where}.{key}", findings)
        elif extra is False:
            findings.append(f"{where}: '{key}' is not in the schema")
        elif isinstance(extra, dict):
            check(item, extra, f"{where}.{key}", findings)


def main():
    schema = json.loads((RESULTS / "schema.json").read_text())
    findings = []
    files = sorted(p for p in RESULTS.glob("*.json") if p.name not in ("schema.json", "baselines.json"))
    for path in files:
        try:
            check(json.loads(path.read_text()), schema, path.name, findings)
        except json.JSONDecodeError as error:
            findings.append(f"{path.name}: not JSON ({error})")
    baselines = json.loads((RESULTS / "baselines.json").read_text())
    for kind, runs in baselines["baselines"].items():
        for bench, name in runs.items():
            if not (RESULTS / name).is_file():
                findings.append(f"baselines.json: {kind} {bench}: {name} does not exist")
    stray = sorted(p.name for p in RESULTS.iterdir() if p.suffix not in (".json", ".md"))
    findings += [f"{name}: only JSON results (and README.md) belong in bench/results" for name in stray]
    for finding in findings:
        print(finding)
    print(f"bench_results_test: {len(files)} result files, {len(findings)} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
