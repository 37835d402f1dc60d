"""Bad pass-through fields are refused at admission (schemas generated from core/v1), and what the CRD
cannot know is refused by the API server's dry run of the children: a status and a Warning event with
the API server's message, and no Service or PDB left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from by_path import load_by_path

base = load_by_path("pagoda_e2e_test_operator_base", Path(__file__).with_name("test_operator.py"))
operator = base.operator  # the module-scoped fixture: chart installed, `pagoda operator` running
ROOT = base.ROOT

# spec fragment -> what the API server says (core/v1's schema, as generated into the CRD)
REFUSED = [
    ({"env": [{"value": "x"}]}, "spec.env[0].name: Required value"),
    (
        {"affinity": "anywhere"},
        'spec.affinity: Invalid value: "string": spec.affinity in body must be of type object',
    ),
    ({"tolerations": [{"key": "a", "tolerationSeconds": "soon"}]}, "spec.tolerations[0].tolerationSeconds"),
    ({"resources": {"limits": {"memory": "lots"}}}, "spec.resources.limits.memory"),
    ({"tolerations": [{"key": "a", "effect": "NoSchedul"}]}, "spec.tolerations[0].effect: Unsupported value"),
    (
        {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {}}}},
        "nodeSelectorTerms: Required value",
    ),
    ({"engine": {"extraArgs": ["--api-key=secret"]}}, "cannot carry --api-key"),
    ({"engine": {"extraArgs": ["--api", "secret"]}}, "cannot carry --api-key"),
    (
        {"engine": {"extraArgs": ["--tensor-parallel-size 2"]}},
        "holds a flag and its value separated by a space",
    ),
    ({"env": [{"name": "PAGODA_MAX_MODEL_LEN", "value": "9"}]}, "spec.env cannot set the PAGODA_ variable"),
    ({"env": [{"name": "PAGODA_API_KEY", "value": "k"}]}, "nor PAGODA_API_KEY (use apiKeySecret)"),
    ({"service": {"type": "ExternalName"}}, 'spec.service.type: Unsupported value: "ExternalName"'),
    ({"podLabels": {"team": 7}}, "spec.podLabels.team: Invalid value"),
    ({"apiKeySecret": {"key": "k"}}, "spec.apiKeySecret.name: Required value"),
]


def _crd(cluster) -> None:
    if not base.get(cluster, "default", "crd", "inferenceservices.serving.pagoda.dev"):
        cluster.kubectl(
            "apply", "--server-side", "-f", str(ROOT / "crds" / "serving.pagoda.dev_inferenceservices.yaml")
        )
        cluster.kubectl("wait", "--for=condition=Established", "crd/inferenceservices.serving.pagoda.dev")


@pytest.mark.parametrize(
    ("spec", "message"), REFUSED, ids=[f"{next(iter(s))}-{i}" for i, (s, _) in enumerate(REFUSED)]
)
def test_bad_pass_through_fields_are_refused(cluster, namespace, spec: dict, message: str) -> None:
    _crd(cluster)
    body = base.small_service("bad", **spec)
    out = cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(body), check=False)
    assert out.returncode != 0
    assert message in out.stderr


def test_good_pass_through_fields_are_accepted(cluster, namespace) -> None:
    _crd(cluster)
    body = base.small_service(
        "good",
        env=[
            {"name": "A", "value": "1"},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        tolerations=[{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
        resources={"requests": {"cpu": "500m", "memory": 1073741824}, "limits": {"memory": "8Gi"}},
        affinity={"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}},
    )  # fmt: skip
    out = cluster.kubectl(
        "create", "--dry-run=server", "-n", namespace, "-f", "-", input=json.dumps(body), check=False
    )
    assert out.returncode == 0, out.stderr


def test_the_generated_schemas_are_the_api_servers_own(cluster, tmp_path) -> None:
    """The live kube-apiserver's core/v1 OpenAPI generates exactly what the CRD holds."""
    spec = tmp_path / "core-v1.json"
    spec.write_text(cluster.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
    cmd = [sys.executable, str(ROOT / "crds" / "gen_passthrough.py"), "--check", "--openapi", str(spec)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_spec_the_deployment_refuses_is_a_status_and_an_event(cluster, namespace, operator) -> None:
    # A valid EnvVar for the CRD schema, but core/v1 validation refuses '=' in a name.
    base.apply(cluster, namespace, base.small_service("refused", env=[{"name": "A=B", "value": "1"}]))

    def invalid() -> dict | None:
        isvc = base.get(cluster, namespace, "inferenceservice", "refused")
        conds = {c["type"]: c for c in ((isvc or {}).get("status") or {}).get("conditions") or ()}
        return conds if conds.get("Ready", {}).get("reason") == "InvalidSpec" else None

    conds = base.wait_for("Ready=False InvalidSpec", invalid, context=operator.tail)
    assert conds["Ready"]["status"] == "False" and conds["Degraded"]["status"] == "True"
    assert (
        'Deployment refused refused by the API server: Deployment.apps "refused" is invalid'
        in conds["Ready"]["message"]
    )
    assert 'Invalid value: "A=B"' in conds["Ready"]["message"]
    for kind in ("service", "poddisruptionbudget", "deployment"):
        assert base.get(cluster, namespace, kind, "refused") is None, kind
    isvc = base.get(cluster, namespace, "inferenceservice", "refused")
    assert "url" not in isvc["status"]
    events = cluster.kubectl(
        "get", "events", "-n", namespace, "--field-selector", "reason=InvalidSpec", "-o", "json"
    )
    messages = [e["message"] for e in json.loads(events.stdout)["items"]]
    assert len(messages) == 1 and "A=B" in messages[0]  # once, not at every resync

    # Fixed: everything is created.
    cluster.kubectl(
        "patch",
        "pis/refused",
        "-n",
        namespace,
        "--type=merge",
        "-p",
        '{"spec":{"env":[{"name":"A","value":"1"}]}}',
    )
    base.ready_service(cluster, namespace, "refused", operator)
    assert base.get(cluster, namespace, "service", "refused") is not None
    assert "Traceback" not in operator.log.read_text(errors="replace")
