"""`make mutation`'s chart target: planted bugs in the Helm chart's rendered security settings.

cosmic-ray mutates Python; the chart is Go templates, so its mutants are listed here by hand, one per
setting a careless edit could weaken: each replaces one line of a template, runs `tests/test_chart.py`
(which renders the chart with the real `helm`), and restores the file. A mutant the tests fail on is
killed. Prints the kill rate as a Markdown row and the survivors.

    .venv/bin/python tests/mutation/chart.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "charts" / "pagoda" / "templates"

# (template, the exact text, what a careless edit makes of it)
MUTANTS: list[tuple[str, str, str]] = [
    ("deployment.yaml", "runAsNonRoot: true", "runAsNonRoot: false"),
    ("deployment.yaml", "runAsUser: 10001", "runAsUser: 0"),
    ("deployment.yaml", "runAsGroup: 10001", "runAsGroup: 0"),
    ("deployment.yaml", "type: RuntimeDefault", "type: Unconfined"),
    ("deployment.yaml", "allowPrivilegeEscalation: false", "allowPrivilegeEscalation: true"),
    ("deployment.yaml", "readOnlyRootFilesystem: true", "readOnlyRootFilesystem: false"),
    ("deployment.yaml", "drop: [ALL]", "drop: [NET_RAW]"),
    ("deployment.yaml", "              drop: [ALL]", "              add: [SYS_ADMIN]"),
    ("deployment.yaml", "              mountPath: /tmp", "              mountPath: /scratch"),
    ("deployment.yaml", "          emptyDir: {}", "          hostPath: {path: /tmp}"),
    ("deployment.yaml", "  replicas: 1", "  replicas: 2"),
    ("deployment.yaml", "    type: Recreate", "    type: RollingUpdate"),
    ("clusterrole.yaml", "    resources: [pods]\n    verbs: [get, list, watch]",
     "    resources: [pods, secrets]\n    verbs: [get, list, watch]"),
    ("clusterrole.yaml", "    resources: [pods]\n    verbs: [get, list, watch]",
     "    resources: [pods]\n    verbs: [get, list, watch, delete]"),
    ("clusterrole.yaml", "    resources: [nodes]\n    verbs: [get, list, watch]",
     "    resources: [nodes]\n    verbs: ['*']"),
    ("clusterrole.yaml", "    resources: [inferenceservices/status]\n    verbs: [get, patch]",
     "    resources: [inferenceservices/status]\n    verbs: [get]"),
    ("clusterrolebinding.yaml", "  kind: ClusterRole\n  name:",
     "  kind: ClusterRole\n  name: cluster-admin #"),
    ("clusterrolebinding.yaml", "    namespace: {{ .Release.Namespace }}", "    namespace: default"),
]  # fmt: skip


def run_tests() -> bool:
    """True when tests/test_chart.py passes."""
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:xdist", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, "tests/test_chart.py"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    return result.returncode == 0


def main() -> int:
    if not run_tests():
        print("tests/test_chart.py fails without a mutant (is helm built? `make k8s-bin`)", file=sys.stderr)
        return 2
    survivors = []
    for template, old, new in MUTANTS:
        path = TEMPLATES / template
        text = path.read_text()
        if text.count(old) != 1:
            print(f"{template}: {old!r} is not in it exactly once", file=sys.stderr)
            return 2
        try:
            path.write_text(text.replace(old, new))
            killed = not run_tests()
        finally:
            path.write_text(text)
        if not killed:
            survivors.append(f"{template}: {old!r} -> {new!r}")
    killed = len(MUTANTS) - len(survivors)
    print("| target | mutants | killed | survived | kill rate |")
    print("| --- | ---: | ---: | ---: | ---: |")
    rate = f"{killed / len(MUTANTS):.0%}"
    print(f"| chart security settings | {len(MUTANTS)} | {killed} | {len(survivors)} | {rate} |")
    for survivor in survivors:
        print("survived:", survivor)
    return 0


if __name__ == "__main__":
    sys.exit(main())
