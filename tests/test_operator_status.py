"""`pagoda.operator.status` on its own: what a Deployment says about itself, the four conditions of each
situation, and transition times that move only when a status flips. The reconcile tests
(tests/test_operator_reconcile.py) see these through the operator; these pin each branch."""

from __future__ import annotations

from typing import Any

import pytest

from pagoda.operator.pods import PodIssue
from pagoda.operator.profile import Decision
from pagoda.operator.status import Condition, Rollout, conditions, merge_conditions, rollout, status

SELECTED = Decision(True, "H100 fits in fp8")
NONE_FITS = Decision(False, "no GPU has 80 GiB")


def deployment(generation: int = 2, spec_replicas: int = 2, **status_fields: Any) -> dict[str, Any]:
    """A Deployment at `generation` asking `spec_replicas`, with these status fields."""
    spec = {"replicas": spec_replicas}
    return {"metadata": {"generation": generation}, "spec": spec, "status": status_fields}


def table(conds: list[Condition]) -> dict[str, tuple[bool, str]]:
    return {c.type: (c.is_true, c.reason) for c in conds}


def test_a_finished_rollout() -> None:
    done = deployment(
        observedGeneration=2, replicas=2, updatedReplicas=2, availableReplicas=2, readyReplicas=2
    )
    assert rollout(done) == Rollout(desired=2, replicas=2, ready=2, is_complete=True, failure=None, updated=2)
    assert rollout(None) is None


@pytest.mark.parametrize(
    "field", ["observedGeneration", "replicas", "updatedReplicas", "availableReplicas"], ids=str
)
def test_a_rollout_is_complete_only_when_every_count_matches(field: str) -> None:
    counts = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 2, "availableReplicas": 2}
    for wrong in (1, 3):
        state = rollout(deployment(**(counts | {field: wrong})))
        assert state is not None
        # A newer observed generation than the spec's is fine (observed >= generation).
        assert state.is_complete is (field == "observedGeneration" and wrong == 3), (field, wrong)


def test_an_unobserved_generation_counts_no_updated_replicas() -> None:
    state = rollout(deployment(observedGeneration=1, replicas=2, updatedReplicas=2, readyReplicas=2))
    assert state is not None and state.updated == 0 and not state.is_complete and state.ready == 2
    fresh = rollout({"metadata": {}, "spec": {}, "status": {}})  # nothing observed, one replica asked
    assert fresh == Rollout(desired=1, replicas=0, ready=0, is_complete=False, failure=None, updated=0)
    bare = rollout({"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {}})
    assert bare is not None and bare.updated == 0 and not bare.is_complete


def test_rollout_failures_from_the_deployment_conditions() -> None:
    stalled = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "x"}
    replica = {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": "quota"}
    fine = [
        {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable", "message": "ok"},
        {"type": "ReplicaFailure", "status": "False", "message": "no"},
        {"type": "Available", "status": "True", "reason": "ProgressDeadlineExceeded", "message": "odd"},
        {"type": "Zzz", "status": "True", "reason": "ProgressDeadlineExceeded"},
    ]
    assert rollout(deployment(conditions=[stalled])).failure == "rollout stalled: x"  # type: ignore[union-attr]
    assert rollout(deployment(conditions=[replica])).failure == "pods cannot be created: quota"  # type: ignore[union-attr]
    assert rollout(deployment(conditions=fine)).failure is None  # type: ignore[union-attr]
    no_message = [{"type": "ReplicaFailure", "status": "True"}]
    assert rollout(deployment(conditions=no_message)).failure == "pods cannot be created:"  # type: ignore[union-attr]


def ready_state(ready: int = 2, desired: int = 2, complete: bool = True, **kw: Any) -> Rollout:
    return Rollout(desired=desired, replicas=desired, ready=ready, is_complete=complete, **kw)


def test_ready_when_complete_and_every_replica_ready() -> None:
    conds = conditions(SELECTED, ready_state())
    assert table(conds) == {
        "ProfileSelected": (True, "Selected"),
        "Ready": (True, "ReplicasReady"),
        "Progressing": (False, "RolloutComplete"),
        "Degraded": (False, "AsExpected"),
    }
    assert conds[1].message == "2/2 replicas ready"


def test_the_not_ready_reasons_in_order() -> None:
    loading = PodIssue("Loading", "loading weights", is_failure=False)
    crash = PodIssue("CrashLoop", "exit 1", is_failure=True)
    assert table(conditions(SELECTED, ready_state(desired=0, ready=0)))["Ready"] == (False, "ScaledToZero")
    got = conditions(SELECTED, ready_state(ready=1, complete=False), issue=loading)
    assert (
        table(got)["Ready"] == (False, "Loading") and got[1].message == "1/2 replicas ready; loading weights"
    )
    assert table(got)["Degraded"] == (False, "AsExpected")  # loading is no fault
    got = conditions(SELECTED, ready_state(ready=1, complete=False), issue=crash)
    assert table(got)["Degraded"] == (True, "CrashLoop")
    rolling = conditions(SELECTED, ready_state(ready=2, complete=False, updated=1))
    assert table(rolling)["Ready"] == (False, "RollingOut")
    assert rolling[1].message == "2/2 replicas ready, 1/2 on the current spec"
    assert table(rolling)["Progressing"] == (True, "RollingOut")
    few = conditions(SELECTED, ready_state(ready=1, complete=False))
    assert table(few)["Ready"] == (False, "ReplicasNotReady") and few[1].message == "1/2 replicas ready"
    # Complete but fewer ready (a pod went unready after the rollout): not Ready.
    assert table(conditions(SELECTED, ready_state(ready=1)))["Ready"] == (False, "ReplicasNotReady")


def test_a_failed_rollout_and_a_kept_workload_are_degraded() -> None:
    failed = conditions(SELECTED, ready_state(ready=1, complete=False, failure="rollout stalled: x"))
    assert table(failed)["Degraded"] == (True, "RolloutFailed") and failed[3].message == "rollout stalled: x"
    kept = conditions(NONE_FITS, ready_state(), is_kept=True)
    assert table(kept)["Degraded"] == (True, "NoFittingGpu")
    assert table(kept)["Ready"] == (True, "ReplicasReady")
    moved = conditions(SELECTED, ready_state(), is_kept=True)
    assert table(moved)["ProfileSelected"] == (True, "KeptRunning")
    assert moved[0].message.endswith(SELECTED.reason) and table(moved)["Degraded"] == (False, "AsExpected")


def test_an_invalid_spec_or_a_conflict_wins_over_everything() -> None:
    failure = ("InvalidSpec", "spec.model is required")
    got = conditions(SELECTED, ready_state(), conflicts=["Service x is not ours"], failure=failure)
    assert table(got) == {
        "ProfileSelected": (True, "Selected"),
        "Ready": (False, "InvalidSpec"),
        "Progressing": (False, "InvalidSpec"),
        "Degraded": (True, "InvalidSpec"),
    }
    unknown = conditions(NONE_FITS, None, failure=("UnknownModel", "no such model"))
    assert table(unknown)["ProfileSelected"] == (False, "UnknownModel")
    conflict = conditions(SELECTED, ready_state(), conflicts=["a", "b"])
    assert table(conflict) == {
        "ProfileSelected": (True, "Selected"),
        "Ready": (False, "Conflict"),
        "Progressing": (False, "Conflict"),
        "Degraded": (True, "Conflict"),
    }
    assert conflict[1].message == "a; b"


def test_before_a_deployment_exists() -> None:
    caching = PodIssue("Caching", "downloading", is_failure=False)
    failed = PodIssue("CacheFailed", "404", is_failure=True)
    assert table(conditions(SELECTED, None, issue=caching)) == {
        "ProfileSelected": (True, "Selected"),
        "Ready": (False, "Caching"),
        "Progressing": (True, "Caching"),
        "Degraded": (False, "Caching"),
    }
    assert table(conditions(SELECTED, None, issue=failed))["Progressing"] == (False, "CacheFailed")
    assert table(conditions(SELECTED, None, issue=failed))["Degraded"] == (True, "CacheFailed")
    creating = conditions(SELECTED, None)
    assert (
        table(creating)["Ready"] == (False, "Creating") and creating[1].message == "creating the Deployment"
    )
    assert table(creating)["Progressing"] == (True, "Creating") and not creating[3].is_true
    none = conditions(NONE_FITS, None, issue=caching)  # no profile: the issue is not what matters
    assert table(none) == {
        "ProfileSelected": (False, "NoFittingGpu"),
        "Ready": (False, "NoProfile"),
        "Progressing": (False, "NoProfile"),
        "Degraded": (True, "NoProfile"),
    }
    assert none[1].message == "no workload: " + NONE_FITS.reason


def test_transition_times_move_only_when_the_status_flips() -> None:
    old = [
        {"type": "Ready", "status": "True", "lastTransitionTime": "t0"},
        {"type": "Degraded", "status": "False", "lastTransitionTime": "t0"},
    ]
    new = [Condition("Ready", True, "ReplicasReady", "m"), Condition("Degraded", True, "CrashLoop", "m")]
    merged = merge_conditions(old, new, now="t1", generation=3)
    assert [(c["status"], c["lastTransitionTime"]) for c in merged] == [("True", "t0"), ("True", "t1")]
    assert all(c["observedGeneration"] == 3 for c in merged)
    flipped = merge_conditions(
        [{"type": "Ready", "status": "False", "lastTransitionTime": "t0"}],
        [Condition("Ready", True, "ReplicasReady", "m")],
        now="t2",
        generation=3,
    )
    assert flipped[0]["lastTransitionTime"] == "t2"


def test_status_counts_replicas_and_none_without_a_deployment() -> None:
    args: dict[str, Any] = {"decision": SELECTED, "generation": 1, "now": "t", "urls": {}, "selector": "s"}
    without = status(old={}, state=None, **args)
    assert (without["replicas"], without["readyReplicas"]) == (0, 0)
    running = status(old={}, state=Rollout(3, 3, 2, False), **args)
    assert (running["replicas"], running["readyReplicas"]) == (3, 2)


def test_what_the_api_server_sends_is_compared_by_value() -> None:
    """Parsed from JSON, as the API server's objects are: strings and large counts are equal values,
    not the same objects as the literals in the code."""
    import json

    counts = {"observedGeneration": 7, "replicas": 300, "updatedReplicas": 300, "availableReplicas": 300}
    big = json.loads(json.dumps(deployment(generation=7, spec_replicas=300, readyReplicas=300, **counts)))
    state = rollout(big)
    assert state is not None and state.is_complete and state.updated == 300
    conditions_seen = [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded", "message": "x"},
        {"type": "ReplicaFailure", "status": "True", "message": "quota"},
    ]
    for cond in conditions_seen:
        parsed = json.loads(json.dumps(deployment(conditions=[cond])))
        assert rollout(parsed).failure is not None  # type: ignore[union-attr]
    others = [
        {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"},  # sorts after the deadline
        {"type": "ReplicaFailure", "status": "Unknown"},  # sorts after "True"
    ]
    assert rollout(deployment(conditions=others)).failure is None  # type: ignore[union-attr]
    merged = merge_conditions(
        json.loads('[{"type": "Ready", "status": "True", "lastTransitionTime": "t0"}]'),
        [Condition("Ready", True, "ReplicasReady", "m")],
        now="t1",
        generation=1,
    )
    assert merged[0]["lastTransitionTime"] == "t0"


def test_defaults_a_caller_leans_on() -> None:
    # No generation on either side: observed, and complete when the counts match.
    bare = {"metadata": {}, "spec": {"replicas": 1}}
    bare["status"] = {"replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}
    assert rollout(bare).is_complete  # type: ignore[union-attr]
    # is_kept defaults to False: then no fitting GPU does not make a running workload Degraded.
    assert table(conditions(NONE_FITS, ready_state()))["Degraded"] == (False, "AsExpected")
    rolling = conditions(SELECTED, ready_state(ready=2, complete=False))  # updated defaults to 0
    assert rolling[1].message == "2/2 replicas ready, 0/2 on the current spec"
    unknown = conditions(NONE_FITS, None, failure=("UnknownModel", "no such model"))
    assert unknown[0].message == "no such model"
