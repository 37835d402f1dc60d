"""Generate the CRD's pass-through field schemas from the Kubernetes OpenAPI (core/v1), never by hand.

`resources`, `env`, `tolerations` and `affinity` are handed to the pod as they are, so the API server
must refuse at admission what a pod would refuse (`env: [{value: x}]`, a string for affinity). Their
schemas are core/v1's ResourceRequirements, EnvVar, Toleration and Affinity, converted to structural
CRD schemas (refs inlined, descriptions and defaults dropped, Quantity and IntOrString as
`x-kubernetes-int-or-string`), and written between the `# BEGIN generated <field>` / `# END generated`
markers of crds/serving.pagoda.dev_inferenceservices.yaml and its copy in charts/pagoda/crds/.

The source is a live kube-apiserver's /openapi/v3/api/v1 (`make cluster` runs the pinned one): unlike
the JSON committed in the Go module, it carries the enums (toleration effects, selector operators).

    make cluster && export KUBECONFIG=...                 # the pinned API server (e2e/tools/build.sh)
    python crds/gen_passthrough.py                        # `kubectl get --raw /openapi/v3/api/v1`
    python crds/gen_passthrough.py --openapi spec.json    # a saved copy of it
    python crds/gen_passthrough.py --check                # exit 1 if the CRD is not what it generates

e2e/test_operator_admission.py checks the CRD against the test cluster's API server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml"
CHART_CRD = ROOT / "charts" / "pagoda" / "crds" / CRD.name
KUBE_VERSION = "v1.36.3"  # e2e/tools/build.sh pins the same API server
CORE = "io.k8s.api.core.v1."
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
# apimachinery's Quantity grammar, as controller-gen writes it into CRDs.
_NUMBER = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^(\+|-)?{_NUMBER}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_NUMBER}))?$"
KEEP = ("type", "format", "enum", "required", "pattern", "minimum", "maximum", "minItems", "maxItems",
        "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "x-kubernetes-map-type")  # fmt: skip

# field -> (core/v1 type, is a list of it, description)
FIELDS: dict[str, tuple[str, bool, str]] = {
    "resources": (
        "ResourceRequirements",
        False,
        "Container resources (core/v1 ResourceRequirements). nvidia.com/gpu is always set to the "
        "tensor-parallel degree; cpu and memory requests default to a size from the model.",
    ),
    "env": ("EnvVar", True, "Extra container environment (core/v1 EnvVar)."),
    "tolerations": (
        "Toleration",
        True,
        "Passed to the pods (core/v1 Toleration; nvidia.com/gpu NoSchedule is always tolerated).",
    ),
    "affinity": (
        "Affinity",
        False,
        "Passed to the pods (core/v1 Affinity); the operator adds node affinity to the chosen GPU product.",
    ),
    "cache.resources": (
        "ResourceRequirements",
        False,
        "The download Job's container resources (core/v1 ResourceRequirements; default: 1 CPU and 1 GiB "
        "requested).",
    ),
    "cache.tolerations": (
        "Toleration",
        True,
        "The download Job's tolerations (core/v1 Toleration; default: the service's); nvidia.com/gpu "
        "NoSchedule is always tolerated.",
    ),
}


def yaml_key(field: str) -> str:
    """The key a field's block writes: `cache.resources` is `resources` inside model.cache."""
    return field.rpartition(".")[2]


def _ref_name(schema: dict[str, Any]) -> str | None:
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    refs = [s for s in schema.get("allOf") or () if "$ref" in s]
    return str(refs[0]["$ref"]).rsplit("/", 1)[-1] if len(refs) == 1 else None


def structural(schema: dict[str, Any], defs: dict[str, Any], seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """One OpenAPI v3 schema as a structural CRD schema: refs inlined, only validating keys kept."""
    name = _ref_name(schema)
    if name in (QUANTITY, INT_OR_STRING):
        out: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "string"}]}
        if name == QUANTITY:
            out["pattern"] = QUANTITY_PATTERN
        return out | {"x-kubernetes-int-or-string": True}
    if name is not None:
        if name in seen:
            raise ValueError(f"recursive schema {name}: cannot inline")
        return structural(defs[name], defs, (*seen, name)) | {k: v for k, v in schema.items() if k in KEEP}
    out = {k: schema[k] for k in KEEP if k in schema and not (k == "format" and schema[k] == "int-or-string")}
    if "properties" in schema:
        out["properties"] = {k: structural(v, defs, seen) for k, v in sorted(schema["properties"].items())}
    if "items" in schema:
        out["items"] = structural(schema["items"], defs, seen)
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = structural(schema["additionalProperties"], defs, seen)
    return out


def field_schemas(openapi: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """field -> its CRD schema, from core/v1's OpenAPI v3 document."""
    defs = openapi["components"]["schemas"]
    out = {}
    for field, (kind, is_list, description) in FIELDS.items():
        schema = structural(defs[CORE + kind], defs)
        if is_list:
            schema = {"type": "array", "items": schema}
        out[field] = {"description": description, **schema}
    return out


def render(text: str, schemas: dict[str, dict[str, Any]]) -> str:
    """The CRD text with each generated block replaced; everything outside the markers is kept."""
    for field, schema in schemas.items():
        name = re.escape(field)
        pattern = re.compile(
            rf"^(?P<indent> *)# BEGIN generated {name}\b.*?\n.*?^(?P=indent)# END generated {name}\n",
            re.MULTILINE | re.DOTALL,
        )
        match = pattern.search(text)
        if match is None:
            raise ValueError(f"{CRD.name}: no '# BEGIN generated {field}' ... '# END generated' block")
        indent = match["indent"]
        body = yaml.safe_dump({yaml_key(field): schema}, sort_keys=False, width=10_000)
        block = "".join(indent + line + "\n" for line in body.splitlines())
        source = f"core/v1 {FIELDS[field][0]} ({KUBE_VERSION}), crds/gen_passthrough.py"
        begin = f"{indent}# BEGIN generated {field}: {source}\n"
        end = f"{indent}# END generated {field}\n"
        text = text[: match.start()] + begin + block + end + text[match.end() :]
    return text


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--openapi", type=Path, help="core/v1 OpenAPI v3 JSON; default: ask kubectl")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = parser.parse_args(argv)
    if args.openapi is None:
        cmd = [os.environ.get("KUBECTL", "kubectl"), "get", "--raw", "/openapi/v3/api/v1"]
        source = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    else:
        source = args.openapi.read_text()
    schemas = field_schemas(json.loads(source))
    text = CRD.read_text()
    rendered = render(text, schemas)
    if args.check:
        stale = [p for p in (CRD, CHART_CRD) if p.read_text() != rendered]
        for path in stale:
            print(f"{path.relative_to(ROOT)} is stale: run python crds/gen_passthrough.py", file=sys.stderr)
        return 1 if stale else 0
    CRD.write_text(rendered)
    CHART_CRD.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
