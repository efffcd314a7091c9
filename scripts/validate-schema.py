#!/usr/bin/env python3
"""Validates YAML specs against pipec's committed JSON Schema with an independent validator
(the `jsonschema` package, draft 2020-12), as an editor's YAML extension would.

Usage: validate-schema.py SCHEMA SPEC...          every SPEC must be valid
       validate-schema.py --reject SCHEMA SPEC... every SPEC must be invalid
Exit status 0 when every spec is as expected, 1 otherwise (each failure printed).
"""
import json
import re
import sys

import jsonschema
import yaml


class Yaml12Loader(yaml.SafeLoader):
    """PyYAML reads YAML 1.1, where `1e-8` is a string; pipec (serde-saphyr) and editors read
    YAML 1.2's core schema, where it is a number. This loader resolves floats as 1.2 does."""


Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def problems(validator, path):
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=Yaml12Loader)
    except (OSError, yaml.YAMLError) as e:
        return [f"cannot read: {e}"]
    return [
        f"{'/'.join(map(str, err.absolute_path)) or '(top)'}: {err.message}"
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]


def main(argv):
    reject = argv[:1] == ["--reject"]
    if reject:
        argv = argv[1:]
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    failed = 0
    for path in argv[1:]:
        found = problems(validator, path)
        if reject and not found:
            print(f"{path}: valid, but it should have been rejected", file=sys.stderr)
            failed += 1
        elif not reject and found:
            for p in found:
                print(f"{path}: {p}", file=sys.stderr)
            failed += 1
    what = "rejected" if reject else "valid"
    print(f"schema: {len(argv) - 1 - failed} of {len(argv) - 1} spec(s) {what} as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
