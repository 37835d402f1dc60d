"""Why pods do not run, as the status says it: pods.diagnose and the conditions it feeds."""

from __future__ import annotations

from typing import Any

from pagoda.operator import status as status_mod
from pagoda.operator.pods import PodIssue, diagnose
from pagoda.operator.profile import Decision

SCHEDULER = (
    "0/8 nodes are available: 1 Insufficient nvidia.com/gpu, 7 node(s) didn't match Pod's node affinity."
)


def pod(name: str = "llm-1", **status: Any) -> dict:
    return {"metadata": {"name": name}, "status": status}


def waiting(reason: str, message: str = "", **extra: Any) -> dict:
    return {
        "name": "server",
        "ready": False,
        "state": {"waiting": {"reason": reason, "message": message}},
    } | extra


PENDING = pod(
    conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": SCHEDULER}]
)
NO_PVC = pod(
    conditions=[
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": '0/8 nodes are available: persistentvolumeclaim "models" not found.',
        }
    ]
)
PULL = pod(containerStatuses=[waiting("ImagePullBackOff", 'Back-off pulling image "example.invalid/x:1"')])
CONFIG = pod(containerStatuses=[waiting("CreateContainerConfigError", 'secret "hf-token" not found')])
CRASH = pod(
    containerStatuses=[
        waiting(
            "CrashLoopBackOff",
            "back-off 40s restarting failed container",
            restartCount=3,
            lastState={
                "terminated": {"exitCode": 1, "message": "ValueError: fp8 needs compute capability 8.9"}
            },
        )
    ]
)
LOADING = pod(
    containerStatuses=[{"name": "server", "ready": False, "state": {"running": {"startedAt": "T"}}}]
)
RUNNING = pod(containerStatuses=[{"name": "server", "ready": True, "state": {"running": {"startedAt": "T"}}}])


def test_each_cause_has_its_reason_and_words() -> None:
    cases = {
        "Unschedulable": (
            PENDING,
            "pod llm-1 cannot be scheduled: 0/8 nodes are available: 1 Insufficient nvidia",
        ),
        "PersistentVolumeClaimNotReady": (NO_PVC, 'persistentvolumeclaim "models" not found'),
        "ImagePullFailed": (PULL, 'ImagePullBackOff: Back-off pulling image "example.invalid/x:1"'),
        "ContainerConfigError": (CONFIG, 'secret "hf-token" not found'),
        "CrashLoop": (
            CRASH,
            "crashed (exit code 1, 3 restarts): ValueError: fp8 needs compute capability 8.9",
        ),
        "Loading": (LOADING, "container server is loading the model"),
    }
    for reason, (p, words) in cases.items():
        issue = diagnose([p])
        assert issue is not None and issue.reason == reason, (reason, issue)
        assert words in issue.message, issue.message
        assert issue.is_failure is (reason != "Loading")
    assert diagnose([RUNNING]) is None
    assert diagnose([]) is None


def test_a_failure_outranks_a_pod_that_is_only_loading() -> None:
    issue = diagnose([LOADING, pod("llm-2", **PULL["status"])])
    assert issue is not None and issue.reason == "ImagePullFailed" and "llm-2" in issue.message


def test_terminating_pods_are_not_diagnosed() -> None:
    gone = PULL | {"metadata": {"name": "old", "deletionTimestamp": "T"}}
    assert diagnose([gone]) is None


def test_long_crash_messages_keep_their_end() -> None:
    long = CRASH["status"]["containerStatuses"][0] | {
        "lastState": {
            "terminated": {"exitCode": 1, "message": "x" * 5000 + " RuntimeError: CUDA out of memory"}
        }
    }
    issue = diagnose([pod(containerStatuses=[long])])
    assert issue is not None and issue.message.endswith("RuntimeError: CUDA out of memory")
    assert len(issue.message) < 600


SELECTED = Decision(True, "fits")


def _conds(state: status_mod.Rollout, issue: PodIssue | None) -> dict[str, tuple[bool, str, str]]:
    return {
        c.type: (c.is_true, c.reason, c.message) for c in status_mod.conditions(SELECTED, state, issue=issue)
    }


def test_pending_pods_make_ready_and_degraded_say_why() -> None:
    state = status_mod.Rollout(desired=1, replicas=1, ready=0, is_complete=False, updated=1)
    conds = _conds(state, diagnose([PENDING]))
    assert conds["Ready"][:2] == (False, "Unschedulable")
    assert conds["Ready"][2].startswith("0/1 replicas ready; pod llm-1 cannot be scheduled: 0/8 nodes")
    assert conds["Degraded"][:2] == (True, "Unschedulable")
    loading = _conds(state, diagnose([LOADING]))
    assert loading["Ready"][:2] == (False, "Loading")
    assert loading["Degraded"][:2] == (False, "AsExpected")  # loading is not a fault


def test_ready_message_never_contradicts_its_status() -> None:
    # After a re-profile: the old pod is ready, the new template not rolled out yet.
    state = status_mod.Rollout(desired=1, replicas=2, ready=1, is_complete=False, updated=0)
    ready = _conds(state, None)["Ready"]
    assert ready[0] is False
    assert ready[2] == "1/1 replicas ready, 0/1 on the current spec"
