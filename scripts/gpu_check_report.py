#!/usr/bin/env python3
"""The JSON writer of scripts/gpu-check.sh: one document with every step of the check, the machine,
the GPU tests (from GoogleTest's JSON) and the benchmark figures with their ratios to PyTorch FSDP2.
Standard library only: it runs under whatever python3 the GPU machine has.

    gpu_check_report.py step --file STEPS --name NAME --status pass|fail|skip --seconds S
                             --detail TEXT [--log FILE]
    gpu_check_report.py finish --file STEPS --output OUT [--mode full|build|detect] [--detect J]
                             [--gtest J] [--bench J ...] [--deps-manifest J]

`step` appends one line to STEPS (JSON lines). `finish` writes OUT (atomically: a temporary name,
fsync, rename) and exits 0 only when the check passed: every step passed or was skipped, the tests
(when they ran) had no failure, and a full check ran its tests. Bad input (a step file that is not
JSON lines, a GoogleTest file that is not its JSON) is named in the document and fails the check.
"""
import argparse
import datetime
import json
import os
import pathlib
import sys
import tempfile

SCHEMA = "fsdp.cpp/gpu-check/1"
STATUSES = ("pass", "fail", "skip")
LOG_TAIL_CHARACTERS = 4000


def add_step(arguments):
    if arguments.status not in STATUSES:
        sys.exit(f"gpu_check_report: --status '{arguments.status}' is not one of {', '.join(STATUSES)}")
    seconds = float(arguments.seconds)
    if seconds < 0:
        sys.exit(f"gpu_check_report: --seconds {arguments.seconds} is negative")
    step = {"name": arguments.name, "status": arguments.status, "seconds": seconds, "detail": arguments.detail}
    if arguments.log:
        text = pathlib.Path(arguments.log).read_text(errors="replace")
        step["log_tail"] = text[-LOG_TAIL_CHARACTERS:]
    with open(arguments.file, "a", encoding="utf-8") as steps:
        steps.write(json.dumps(step) + "\n")


def read_steps(path, problems):
    steps = []
    for number, line in enumerate(pathlib.Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            step = json.loads(line)
        except json.JSONDecodeError as error:
            problems.append(f"{path} line {number} is not JSON ({error}); expected one step per line")
            continue
        if not isinstance(step, dict) or step.get("status") not in STATUSES or "name" not in step:
            problems.append(f"{path} line {number} is not a step (name, status pass/fail/skip): {line[:120]}")
            continue
        steps.append(step)
    return steps


def summarize_gtest(path, problems):
    """GoogleTest's --gtest_output=json document, reduced to counts and one entry per test."""
    try:
        document = json.loads(pathlib.Path(path).read_text())
        tests = []
        for suite in document["testsuites"]:
            for case in suite["testsuite"]:
                failures = [failure.get("failure", "") for failure in case.get("failures", [])]
                skipped = case.get("result") == "SKIPPED"
                tests.append({
                    "name": f"{suite['name']}.{case['name']}",
                    "status": "fail" if failures else "skip" if skipped else "pass",
                    "time": case.get("time", ""),
                    "failures": [text[:2000] for text in failures],
                })
    except (OSError, ValueError, KeyError, TypeError) as error:
        problems.append(f"{path} is not GoogleTest's JSON output ({error!r})")
        return None
    count = {status: sum(1 for test in tests if test["status"] == status) for status in STATUSES}
    return {"passed": count["pass"], "failed": count["fail"], "skipped": count["skip"], "tests": tests}


def read_json(path, what, problems):
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError) as error:
        problems.append(f"{what} {path} is not readable JSON ({error!r})")
        return None


def bench_comparisons(runs):
    """For each GPU count with both sides: our tokens/s and peak memory over PyTorch FSDP2's."""
    by_count = {}
    for run in runs:
        if isinstance(run, dict) and "side" in run and "gpus" in run:
            by_count.setdefault(run["gpus"], {})[run["side"]] = run
    comparisons = []
    for gpus, sides in sorted(by_count.items()):
        ours, theirs = sides.get("fsdp_cpp"), sides.get("pytorch_fsdp2")
        if not ours or not theirs:
            continue
        entry = {"gpus": gpus}
        for key in ("tokens_per_second", "peak_memory_bytes", "mfu"):
            if ours.get(key) and theirs.get(key):
                entry[f"{key}_ratio"] = ours[key] / theirs[key]
        comparisons.append(entry)
    return comparisons


def write_atomically(path, text):
    path = pathlib.Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


def finish(arguments):
    problems = []
    steps = read_steps(arguments.file, problems)
    document = {
        "schema": SCHEMA,
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mode": arguments.mode,
        "steps": steps,
    }
    if arguments.detect:
        document["machine"] = read_json(arguments.detect, "the detection result", problems)
    if arguments.deps_manifest:
        document["prepared_dependencies"] = read_json(arguments.deps_manifest, "the --prepare manifest", problems)
    tests = summarize_gtest(arguments.gtest, problems) if arguments.gtest else None
    if tests is not None:
        document["tests"] = tests
    runs = [read_json(path, "the benchmark result", problems) for path in arguments.bench or []]
    if runs:
        document["bench"] = {"runs": [run for run in runs if run is not None], "vs_pytorch_fsdp2": bench_comparisons(runs)}
    failed_steps = [step["name"] for step in steps if step["status"] == "fail"]
    if not steps:
        problems.append("no step was recorded")
    if arguments.mode == "full" and not failed_steps and tests is None:
        problems.append("a full check recorded no GPU test results")
    if tests is not None and tests["failed"]:
        problems.append(f"{tests['failed']} GPU test(s) failed")
    document["failed_steps"] = failed_steps
    document["problems"] = problems
    document["passed"] = not failed_steps and not problems
    write_atomically(arguments.output, json.dumps(document, indent=1) + "\n")
    return 0 if document["passed"] else 1


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    step = commands.add_parser("step")
    step.add_argument("--file", required=True)
    step.add_argument("--name", required=True)
    step.add_argument("--status", required=True)
    step.add_argument("--seconds", required=True, type=float)
    step.add_argument("--detail", default="")
    step.add_argument("--log")
    done = commands.add_parser("finish")
    done.add_argument("--file", required=True)
    done.add_argument("--output", required=True)
    done.add_argument("--mode", choices=("full", "build", "detect"), default="full")
    done.add_argument("--detect")
    done.add_argument("--gtest")
    done.add_argument("--bench", action="append")
    done.add_argument("--deps-manifest")
    arguments = parser.parse_args(argv)
    if arguments.command == "step":
        add_step(arguments)
        return 0
    return finish(arguments)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
