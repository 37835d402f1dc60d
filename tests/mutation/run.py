"""`make mutation`: plant small bugs in the modules that matter and count how many the tests catch.

Each target is one source file and the fast tests that should catch a bug in it. cosmic-ray (chosen
over mutmut 3, which copies sources to mutants/ by path and cannot follow pyproject's package-dir map)
mutates the file in place, one mutant at a time (an operator swapped, a constant changed, a condition
negated, a `break` turned `continue`, ...), runs those tests, and restores the file. A mutant the tests
fail on is killed; one they pass on survived. The kill rate per target goes to stdout as a Markdown table
(docs/testing.md keeps the latest), and survivors with `--survivors`.

Too slow for CI (minutes per target on 2 cores): run it when a target's module or its tests change.

    .venv/bin/python tests/mutation/run.py                    # every target
    .venv/bin/python tests/mutation/run.py block_manager http_guards --survivors
"""

from __future__ import annotations

import argparse
import ast
import shlex
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".mutation"  # sessions and configs; ignored by git
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Target:
    source: str  # the file mutated, relative to the repo root
    tests: tuple[str, ...]  # pytest arguments: the files (and -k selections) that should catch its bugs
    timeout_s: float = 60.0  # per mutant: a mutant that hangs the tests counts as killed


TARGETS: dict[str, Target] = {
    # The block manager's tests as they were at 1df8297 (before the prefix-identity tests), for the
    # before/after figure in docs/testing.md: taken from git at run time, not kept as a copy.
    "block_manager_before": Target(
        "service/engine/core/block_manager.py", (".mutation/before_test_block_manager.py",)
    ),
    "block_manager": Target("service/engine/core/block_manager.py", ("tests/test_block_manager.py",)),
    # With the speculative tests that run the scheduler alone (drafts dropped for room, given way first,
    # advanced past).
    "scheduler": Target(
        "service/engine/core/scheduler.py",
        (
            "tests/test_scheduler.py",
            "tests/test_speculative.py::test_drafts_are_dropped_when_the_step_has_no_room_for_them",
            "tests/test_speculative.py::test_drafts_give_way_before_anyone_is_preempted",
            "tests/test_speculative.py::test_blocks_are_hashed_only_over_tokens_the_verifier_kept",
            "tests/test_speculative.py::test_advance_goes_on_past_a_drafting_sequence",
        ),
    ),
    "sampler": Target(
        "service/engine/runner/sampler.py",
        ("tests/test_sampler.py", "tests/test_sampler_reference.py"),
        300.0,
    ),
    "output_processor": Target(
        "service/engine/client/output_processor.py",
        ("tests/test_output_processor.py", "tests/test_output_stream.py"),
    ),
    # The API-key check both transports call (HTTP's APIKeyGuard, gRPC's APIKeyInterceptor), then
    # HTTP's guards around it (which header, which paths are open, the body size limit).
    "api_keys": Target("service/api/api_keys.py", ("tests/test_api_guards.py",)),
    # 30 s: a mutant that never ends the body loop hangs its test client (the tests take 5 s).
    "http_guards": Target("service/api/http_guards.py", ("tests/test_api_guards.py",), 30.0),
    "grammar": Target("service/grammar.py", ("tests/test_grammar.py",)),
    "tool_calls": Target("service/api/tool_calls.py", ("tests/test_tool_calls.py",)),
    # The Responses API: the request as a chat request (unit tests), and the output items and stream
    # events (the unit tests, then a real serve with the openai client and the Agents SDK).
    "responses_protocol": Target("service/api/responses_protocol.py", ("tests/test_responses_protocol.py",)),
    "responses_serving": Target(
        "service/api/responses_serving.py",
        ("tests/test_responses_protocol.py", "tests/test_serve_responses.py"),
        120.0,
    ),
    # Anthropic's Messages API, the same way (tests/test_messages_protocol.py, then the anthropic client).
    "messages_protocol": Target("service/api/messages_protocol.py", ("tests/test_messages_protocol.py",)),
    "messages_serving": Target(
        "service/api/messages_serving.py",
        ("tests/test_messages_protocol.py", "tests/test_serve_messages.py"),
        120.0,
    ),
    # Long prompt chunks through cuDNN (on the CPU, PyTorch's flash op): the split, the padding, the gather
    # and the merge, through the tiny model against the paged path (tests/kernels' file needs the
    # interpreter or a GPU, which a mutant's run does not set).
    "cudnn_attention": Target("kernels/cudnn_attention.py", ("tests/test_model_long_chunks.py",)),
    # The model's attention layer: which chunks go to cuDNN, whole prompts on the step's own K/V rows
    # (their buffers, zeroed tails, plans), the KV cache's layout and budget, on the tiny model.
    "model_attention": Target(
        "service/model/attention.py",
        (
            "tests/test_model_long_chunks.py",
            "tests/test_kv_cache_budget.py",
            "tests/test_kv_cache_layout.py",
            "tests/test_model_llama.py",  # the layer against transformers' attention (its softmax scale)
        ),
    ),
    # fp8 projections: the quantization, both product paths (their GPU calls through a `_scaled_mm`
    # stand-in) and the deferred scales' wiring, against the float32 emulation.
    "fp8": Target("service/model/fp8.py", ("tests/test_fp8.py",)),
    "profile": Target("operator/profile.py", ("tests/test_profile.py",)),
    "status": Target(
        "operator/status.py", ("tests/test_operator_status.py", "tests/test_operator_reconcile.py")
    ),
    # Speculative decoding: the drafts and the load rule, and the verifier (unit tests; the engine's
    # token-for-token tests take seconds each and catch little more).
    "speculation": Target(
        "service/engine/core/speculation.py",
        (
            "tests/test_speculative.py",
            "-k",
            "lookup or load_rule or pause or config or flag or rates or short_of or every_token or proposer"
            " or never_drafts or grammar_request_drafts or decoding_sequences",
        ),
    ),
    # The step loop (in turn and async, failures kept to their request, stops, forks, preemption, KV events,
    # adapters, the speculator's step timing): the engine tests on the tiny checkpoints, fastest first.
    "engine_core": Target(
        "service/engine/core/engine_core.py",
        (
            "tests/test_engine_isolation.py",
            "tests/test_kv_events.py",
            "tests/test_speculative.py::test_step_rates_time_each_step_from_the_completion_before_it",
            "tests/test_lora.py::test_an_adapter_is_loaded_at_run_time_then_unloaded",
            "tests/test_lora.py::test_a_mixed_batch_of_two_adapters_and_the_base_equals_peft",
            "tests/test_lora.py::test_unloading_an_adapter_ends_only_its_own_running_requests",
            "tests/test_lora.py::test_stats_count_waiting_requests_and_name_the_running_and_waiting_adapters",
            "tests/test_engine_sampling.py",
            "tests/test_engine_greedy.py",
            "tests/test_engine_async.py",
            "tests/test_speculative.py::test_greedy_output_is_token_for_token_the_same_with_drafts",
        ),
        120.0,
    ),
    "spec_verify": Target(
        "service/engine/runner/spec_verify.py", ("tests/test_speculative.py", "-k", "verif"), 120.0
    ),
    # The draft model: its proposal rounds and shadow runs, eager and through its graph paths (the target
    # as its own draft must keep every draft and give the target's output).
    "draft_model": Target(
        "service/engine/runner/draft_model.py",
        (
            "tests/test_speculative.py",
            "-k",
            "graph_paths or (draft_model_gives and not tp2) or vocabulary or shadow_run_takes"
            " or rows_the_proposal or proposal_replays",
        ),
        120.0,
    ),
    # The CUDA-graph step paths, as their CPU form (`StepGraphs(capture=False)`: the replays' padded
    # forwards): plain, with adapters, the draft model's, and verify steps past one logit row a sequence,
    # each against the eager engine's output; then the ladders' sizes.
    "cuda_graphs": Target(
        "service/engine/runner/cuda_graphs.py",
        (
            "tests/test_cuda_graphs_padding.py",
            "tests/test_speculative.py",
            "tests/test_lora.py",
            "-k",
            "padded or sizes or graph_paths or verify_steps_replay or graph_steps_with_adapters"
            " or logits_buffer",
        ),
        180.0,
    ),
    # Multi-LoRA: the core's slot books (a unit test, then the engine's mixed batches against PEFT).
    "lora_slots": Target(
        "service/engine/core/lora_slots.py", ("tests/test_lora.py", "-k", "slots or mixed or run_time"), 120.0
    ),
    "model_lora": Target(
        "service/model/lora.py", ("tests/test_lora.py", "-k", "mixed or refused or tensor"), 180.0
    ),
    # What a spec may not override (flags, PAGODA_* variables, pod labels, volumes): the contract's parsing
    # tests and the manifests' refusals, not its servers.
    "reserved": Target(
        "operator/reserved.py",
        (
            "tests/test_operator_contract.py",
            "tests/test_operator_manifests.py",
            "-k",
            "not serve_on_the_cpu and not groups_start and not every_group_pods",
        ),
    ),
    # Where the weights and adapters are mounted: the snapshot, then the manifests' and cache Job's tests.
    "model_mounts": Target(
        "operator/model_mounts.py",
        (
            "tests/test_operator_manifests_snapshot.py",
            "tests/test_operator_manifests.py",
            "tests/test_operator_download.py",
        ),
    ),
    # The snapshot first: it kills most mutants in a fraction of a second, before the slower file runs.
    "manifests": Target(
        "operator/manifests.py",
        ("tests/test_operator_manifests_snapshot.py", "tests/test_operator_manifests.py"),
    ),
}


# Plugins no target's tests use: without them a run starts in 0.7 s instead of 3 s.
_PLUGINS_OFF = "-p no:hypothesispytest -p no:schemathesis -p no:anyio -p no:xdist -p no:xdist.looponfail"


def _test_command(target: Target) -> str:
    args = " ".join(shlex.quote(a) for a in target.tests)  # a `-k` expression has spaces
    return f"{sys.executable} -m pytest -x -q -p no:cacheprovider {_PLUGINS_OFF} {args}"


def _config(name: str, target: Target) -> Path:
    pytest = _test_command(target)
    path = WORK / f"{name}.toml"
    path.write_text(
        textwrap.dedent(
            f"""\
            [cosmic-ray]
            module-path = "{ROOT / target.source}"
            timeout = {target.timeout_s}
            excluded-modules = []
            test-command = "{pytest}"

            [cosmic-ray.distributor]
            name = "local"
            """
        )
    )
    return path


BEFORE_COMMIT = "1df8297ebddea12cedfcc2fb68ed880734d6370a"


def run(name: str, target: Target) -> None:
    WORK.mkdir(exist_ok=True)
    if name == "block_manager_before":
        old = subprocess.run(
            ["git", "show", f"{BEFORE_COMMIT}:tests/test_block_manager.py"],
            cwd=ROOT, check=True, capture_output=True,
        )  # fmt: skip
        (WORK / "before_test_block_manager.py").write_bytes(old.stdout)
    config, session = _config(name, target), WORK / f"{name}.sqlite"
    source = ROOT / target.source
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", target.source], cwd=ROOT).returncode != 0:
        # Also what a run killed inside a mutant leaves behind: never take a mutant for the original.
        raise SystemExit(
            f"{target.source} differs from HEAD: commit or stash it first (it is edited in place)"
        )
    # The tests must pass on the unmutated source, or every mutant would count as killed.
    baseline = subprocess.run(shlex.split(_test_command(target)), cwd=ROOT, capture_output=True, text=True)
    if baseline.returncode != 0:
        raise SystemExit(f"{name}: the tests fail without a mutant:\n{baseline.stdout[-3000:]}")
    original = source.read_bytes()
    try:
        if not session.exists():
            subprocess.run([str(BIN / "cosmic-ray"), "init", str(config), str(session)], check=True, cwd=ROOT)
        # Resumes a session that was interrupted: exec only runs the mutants without a result.
        subprocess.run([str(BIN / "cosmic-ray"), "exec", str(config), str(session)], check=True, cwd=ROOT)
    finally:
        # cosmic-ray restores each mutant itself, but not when it is interrupted halfway through one.
        if source.read_bytes() != original:
            source.write_bytes(original)
            print(f"restored {target.source} (the run was interrupted inside a mutant)", file=sys.stderr)


Span = tuple[tuple[int, int], tuple[int, int]]  # (line, column) from, to: parso's, as ast's


def annotation_spans(source: str) -> list[Span]:
    """Where `source` has type annotations (parameters, returns, annotated names). Every module here
    starts with `from __future__ import annotations`, so these are never evaluated: a mutant inside one
    (cosmic-ray turns `str | bytes` into `str + bytes`) is equivalent, and left out of the rate."""
    found: list[ast.expr] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.annotation is not None:
            found.append(node.annotation)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            found.append(node.returns)
        elif isinstance(node, ast.AnnAssign):
            found.append(node.annotation)
    return [((n.lineno, n.col_offset), (n.end_lineno or n.lineno, n.end_col_offset or 0)) for n in found]


def in_annotation(start: tuple[int, int], end: tuple[int, int], spans: list[Span]) -> bool:
    return any(lo <= tuple(start) and tuple(end) <= hi for lo, hi in spans)


def summary(name: str, show_survivors: bool) -> tuple[int, int, int, int]:
    """(killed, survived, in annotations, incompetent) of a finished session; survivors inside type
    annotations are equivalent (`annotation_spans`) and counted apart. Prints each other survivor when
    asked."""
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import TestOutcome

    spans = annotation_spans((ROOT / TARGETS[name].source).read_text())
    killed = survived = annotations = incompetent = 0
    with use_db(str(WORK / f"{name}.sqlite"), WorkDB.Mode.open) as db:
        for item, result in db.completed_work_items:
            if result.test_outcome is TestOutcome.KILLED:
                killed += 1
            elif result.test_outcome is TestOutcome.SURVIVED:
                if all(in_annotation(m.start_pos, m.end_pos, spans) for m in item.mutations):
                    annotations += 1
                    continue
                survived += 1
                if show_survivors:
                    print(f"--- survived: {name} job {item.job_id}\n{result.diff}")
            else:
                incompetent += 1
    return killed, survived, annotations, incompetent


def main() -> int:
    # SIGTERM as an exception: `run` then kills cosmic-ray and restores the file it was mutating.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("targets", nargs="*", choices=[[], *TARGETS], help="default: all")
    parser.add_argument("--survivors", action="store_true", help="print the diff of every survivor")
    parser.add_argument("--fresh", action="store_true", help="start the sessions again")
    args = parser.parse_args()
    names = args.targets or list(TARGETS)
    rows = []
    for name in names:
        if args.fresh:
            (WORK / f"{name}.sqlite").unlink(missing_ok=True)
        run(name, TARGETS[name])
        killed, survived, annotations, incompetent = summary(name, args.survivors)
        total = killed + survived
        rate = 100.0 * killed / total if total else 0.0
        rows.append(
            f"| {name} | `{TARGETS[name].source}` | {total + annotations} | {annotations} | {killed} "
            f"| {survived} | {rate:.0f}% |"
        )
        if incompetent:
            rows[-1] += f" ({incompetent} incompetent: the mutant did not import)"
    print("| target | module | mutants | in annotations | killed | survived | kill rate |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
