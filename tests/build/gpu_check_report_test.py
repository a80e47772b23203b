"""scripts/gpu_check_report.py, the JSON writer of scripts/gpu-check.sh: steps in, one document out,
the exit code says whether the check passed.

    gpu_check_report_test.py PATH/TO/gpu_check_report.py
"""
import json
import pathlib
import subprocess
import sys
import tempfile

TOOL = sys.argv[1]
failures = []


def run(*arguments):
    return subprocess.run([sys.executable, TOOL, *arguments], capture_output=True, text=True)


def check(condition, what):
    print(("ok: " if condition else "FAILED: ") + what)
    if not condition:
        failures.append(what)


with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    steps, out = scratch / "steps.jsonl", scratch / "out.json"
    log = scratch / "build.log"
    log.write_text("x" * 5000 + "the end")
    check(run("step", "--file", str(steps), "--name", "detect", "--status", "pass", "--seconds", "1.5",
              "--detail", "torch 2.11").returncode == 0, "a passing step is recorded")
    check(run("step", "--file", str(steps), "--name", "build", "--status", "pass", "--seconds", "80",
              "--detail", "built", "--log", str(log)).returncode == 0, "a step with a log is recorded")
    bad = run("step", "--file", str(steps), "--name", "x", "--status", "maybe", "--seconds", "1")
    check(bad.returncode != 0 and "'maybe' is not one of pass, fail, skip" in bad.stderr, "an unknown status is refused")
    # GoogleTest's JSON: one pass, one skip.
    gtest = scratch / "gtest.json"
    gtest.write_text(json.dumps({"testsuites": [{"name": "GpuEngine", "testsuite": [
        {"name": "Trains", "result": "COMPLETED", "time": "3s"},
        {"name": "Offload", "result": "SKIPPED", "time": "0s"}]}]}))
    bench = []
    for side, tokens, memory in (("fsdp_cpp", 9000.0, 30e9), ("pytorch_fsdp2", 10000.0, 40e9)):
        path = scratch / f"bench-{side}.json"
        path.write_text(json.dumps({"side": side, "gpus": 1, "tokens_per_second": tokens,
                                    "peak_memory_bytes": memory, "mfu": tokens / 1e5}))
        bench += ["--bench", str(path)]
    done = run("finish", "--file", str(steps), "--output", str(out), "--gtest", str(gtest), *bench)
    document = json.loads(out.read_text())
    check(done.returncode == 0 and document["passed"], f"a clean check passes ({done.stderr.strip()})")
    check(document["tests"]["passed"] == 1 and document["tests"]["skipped"] == 1, "the tests are counted")
    check(document["steps"][1]["log_tail"].endswith("the end") and len(document["steps"][1]["log_tail"]) == 4000,
          "a step keeps the end of its log")
    ratio = document["bench"]["vs_pytorch_fsdp2"][0]
    check(abs(ratio["tokens_per_second_ratio"] - 0.9) < 1e-12 and abs(ratio["peak_memory_bytes_ratio"] - 0.75) < 1e-12,
          "the benchmark ratios are ours over FSDP2's")
    check(not list(scratch.glob(".out.json.*")), "no temporary file is left beside the output")

    # A failing test fails the check even when every step passed.
    gtest.write_text(json.dumps({"testsuites": [{"name": "GpuEngine", "testsuite": [
        {"name": "Trains", "result": "COMPLETED", "time": "3s", "failures": [{"failure": "loss differs"}]}]}]}))
    failed = run("finish", "--file", str(steps), "--output", str(out), "--gtest", str(gtest))
    document = json.loads(out.read_text())
    check(failed.returncode == 1 and not document["passed"] and "1 GPU test(s) failed" in document["problems"],
          "a failed GPU test fails the check")
    check(document["tests"]["tests"][0]["failures"] == ["loss differs"], "the failure text is kept")

    # A full check without test results, a failed step, bad input files.
    missing = run("finish", "--file", str(steps), "--output", str(out))
    check(missing.returncode == 1 and "a full check recorded no GPU test results" in json.loads(out.read_text())["problems"],
          "a full check must have run its tests")
    check(run("finish", "--file", str(steps), "--output", str(out), "--mode", "build").returncode == 0,
          "a build-only check passes without tests")
    run("step", "--file", str(steps), "--name", "bench_fsdp_cpp_1gpu", "--status", "fail", "--seconds", "2",
        "--detail", "out of memory")
    failed_step = run("finish", "--file", str(steps), "--output", str(out), "--mode", "build")
    check(failed_step.returncode == 1 and json.loads(out.read_text())["failed_steps"] == ["bench_fsdp_cpp_1gpu"],
          "a failed step is named and fails the check")
    gtest.write_text("not json")
    with steps.open("a") as handle:
        handle.write("{broken\n")
    broken = run("finish", "--file", str(steps), "--output", str(out), "--gtest", str(gtest))
    problems = json.loads(out.read_text())["problems"]
    check(broken.returncode == 1 and any("line 4 is not JSON" in problem for problem in problems)
          and any("is not GoogleTest's JSON output" in problem for problem in problems),
          "bad step lines and a bad GoogleTest file are named")

print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
