"""tests/gpu/run_all.sh where there is no GPU: it says ``skipped`` and exits 0; its orchestration runs on CPU devices.

- Without a GPU (no ``nvidia-smi``, or one that lists none) the script prints ``skipped: no GPU visible``,
  writes a JSON that says so and exits 0.
- Its header states the budget and every step's estimate, the same as ``run_all.STEPS``.
- A command that outlives its limit is killed with everything it started.
- ``--platform cpu`` runs the multi-process steps on CPU devices: the same worker, job launcher,
  reference job and readers as on a GPU, with the CPU executor in place of the CUDA one.
- The readers judge real results (of that run) right, and fail them when a digest, a model check or
  a swap point is changed.
"""

from __future__ import annotations

import copy
import doctest
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import run_all

from jaxccl.distributed.transport import unavailable_reason as transport_unavailable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "run_all.sh"
TRANSPORT = transport_unavailable()


def _run_script(tmp_path: Path, path_dirs: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PATH"] = os.pathsep.join(path_dirs)
    env["PYTHON"] = sys.executable
    return subprocess.run(
        ["bash", str(SCRIPT), "--json", str(tmp_path / "gpu.json"), "--work", str(tmp_path / "work")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _check_skipped(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped: no GPU visible" in proc.stdout.splitlines(), proc.stdout
    assert json.loads((tmp_path / "gpu.json").read_text())["skipped"] is True
    assert not (tmp_path / "work").exists()  # nothing built, nothing run


def test_an_nvidia_smi_that_lists_no_gpu_means_skipped(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")  # what it does then
    (fake / "nvidia-smi").chmod(0o755)
    _check_skipped(tmp_path, _run_script(tmp_path, [str(fake), *os.environ["PATH"].split(os.pathsep)]))


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has nvidia-smi")
def test_without_nvidia_smi_it_says_skipped_and_exits_0(tmp_path):
    _check_skipped(tmp_path, _run_script(tmp_path, os.environ["PATH"].split(os.pathsep)))


def test_the_header_states_the_budget_and_each_steps_estimate():
    header = SCRIPT.read_text().split("set -uo pipefail")[0]
    steps = {m[1]: float(m[2]) for m in re.finditer(r"^#   (\w+) +(\d+) s(?:  |$)", header, re.M)}
    total = sum(s.estimate_s for s in run_all.STEPS)
    assert steps.pop("total") == total
    assert steps == {s.name: s.estimate_s for s in run_all.STEPS}
    assert f"Estimate: {total:.0f} s ({total / 60:.1f} min)" in header
    assert "Budget: 8 minutes" in header and total < 8 * 60
    assert f'budget="${{JAXCCL_GPU_BUDGET_S:-{run_all.DEFAULT_BUDGET_S:.0f}}}"' in SCRIPT.read_text()
    assert run_all.DEFAULT_BUDGET_S < 8 * 60
    assert all(s.timeout_s >= 2 * s.estimate_s for s in run_all.STEPS[1:])  # room for a slow machine


def test_a_command_past_its_limit_is_killed_with_what_it_started(tmp_path):
    start = time.monotonic()
    ran = run_all.run_logged(["bash", "-c", "sleep 60 & echo child $!; wait"], log=tmp_path / "x.log", timeout_s=1.0)
    assert ran.timed_out and time.monotonic() - start < 15
    child = int(re.search(r"child (\d+)", ran.output)[1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":  # killed, not yet reaped by its new parent
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the command's child {child} still runs")
    assert "killed after 1 s" in ran.output


def test_a_check_scripts_json_is_read_as_skipped_passed_or_failed(tmp_path):
    # check_core.py's own output where there is no GPU
    out = tmp_path / "core.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "check_core.py"), "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    ran = run_all.Ran(proc.returncode, 1.0, proc.stdout)
    assert run_all.evaluate_json_check("core", out, ran).status == "skipped"
    # what it writes where a GPU ran it (check_core.main's "checks")
    timing = {"check": "timing: 16 MiB", "ok": True, "gpu_ms": 1.5, "cpu_ms": 40.0, "gpu_algbw_GBps": 90.0}
    result = {"skipped": False, "all_ok": True, "checks": [{"check": "a", "ok": True}, timing]}
    out.write_text(json.dumps(result))
    check = run_all.evaluate_json_check("core", out, run_all.Ran(0, 1.0, ""))
    assert (check.status, check.numbers["passed"], check.numbers["gpu_ms"]) == ("ok", 2, 1.5)
    result["checks"][0]["ok"] = result["all_ok"] = False
    out.write_text(json.dumps(result))
    check = run_all.evaluate_json_check("core", out, run_all.Ran(1, 1.0, ""))
    assert check.status == "FAILED" and "1/2 failed: a" in check.summary
    out.unlink()
    assert run_all.evaluate_json_check("core", out, run_all.Ran(None, 9.0, "")).status == "FAILED"


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``run_all.py --platform cpu --only mp2``: the probe, the 2-process CPU reference and the 2-process job."""
    if TRANSPORT is not None:
        pytest.skip(TRANSPORT)
    tmp = tmp_path_factory.mktemp("dry")
    cmd = [sys.executable, str(HERE / "run_all.py"), "--platform", "cpu", "--python", sys.executable]
    cmd += ["--only", "mp2", "--json", str(tmp / "dry.json"), "--work", str(tmp / "work")]
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "XLA_FLAGS", "JAX_PLATFORMS")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return tmp, proc


@pytest.mark.multiprocess
def test_the_orchestration_runs_on_cpu_devices(dry_run):
    tmp, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = json.loads((tmp / "dry.json").read_text())
    status = {c["name"]: c["status"] for c in summary["checks"]}
    assert status == {
        "build": "skipped",  # --python
        "probe": "ok",
        "cpu_reference": "ok",
        "mp2_collectives": "ok",
        "hot_swap": "ok",
        "meter": "ok",
        "meter_overhead": "skipped",  # the cpu backend has no kernel measurement to switch
        "swap_latency": "ok",
        "allgather_16mib": "ok",
    }, proc.stdout
    for c in summary["checks"]:
        assert f"check {c['name']}: {c['status']}" in proc.stdout
    collectives = next(c for c in summary["checks"] if c["name"] == "mp2_collectives")
    assert "CPU executor 18/18" in collectives["summary"] and "jax.lax 18/18" in collectives["summary"]
    assert summary["steps"]["mp2"]["seconds"] > 0 and summary["log"].endswith("dry.log")
    assert "===== mp2 process 1" in (tmp / "dry.log").read_text()


@pytest.mark.multiprocess
def test_the_readers_fail_changed_results(dry_run):
    tmp, _ = dry_run
    job = run_all.Job.read(tmp / "work" / "mp2.json")
    ref = run_all.Job.read(tmp / "work" / "cpu2.json")
    assert run_all.evaluate_collectives("c", job, ref).status == "ok"

    other = copy.deepcopy(ref)
    case = other.of("case")[1][5]
    case["digest"] = "0" * 64
    check = run_all.evaluate_collectives("c", job, other)
    assert check.status == "FAILED" and case["name"] in check.summary and "CPU executor" in check.summary

    wrong = copy.deepcopy(job)
    wrong.of("case")[0][2]["model"] = False
    assert run_all.evaluate_collectives("c", wrong, ref).status == "FAILED"

    refused = copy.deepcopy(job)
    for recs in refused.records.values():
        lax = next(r for r in recs if r["kind"] == "lax")
        lax.clear()
        lax.update(kind="lax", status="refused", error="XlaRuntimeError: NCCL: duplicate GPU", cases={})
    check = run_all.evaluate_collectives("c", refused, ref)
    assert check.status == "ok" and "jax.lax not comparable (refused" in check.summary

    assert run_all.evaluate_swap(job).status == "ok"
    late = copy.deepcopy(job)
    swap = late.one("swap")[1]
    k = run_all._switch_step(swap["steps"], swap["version"])
    swap["steps"][k][1] = swap["steps"][k - 1][1]  # process 1 switched one call later
    assert run_all.evaluate_swap(late).status == "FAILED"

    gone = run_all.Job.read(tmp / "work" / "nothing.json", run_all.Ran(None, 1.0, ""))
    for evaluate in (run_all.evaluate_swap, run_all.evaluate_swap_latency, run_all.evaluate_overhead):
        check = evaluate(gone)
        assert check.status == "FAILED" and "left no results (it did not finish" in check.summary


@pytest.mark.multiprocess
@pytest.mark.skipif(TRANSPORT is not None, reason=f"{TRANSPORT}")
def test_after_a_part_fails_in_one_process_the_next_part_runs_in_step(tmp_path):
    # A copy of the worker whose swap part raises in process 1 only: process 0 waits for it in a collective
    # until the executor's deadline, then both meet at the barrier and run the meter part.
    for name in ("mp_worker.py", "mp_job.py"):
        shutil.copy(HERE / name, tmp_path / name)
    worker = tmp_path / "mp_worker.py"
    source = worker.read_text()
    anchor = '        comm = self.communicator()\n        slot = comm.slot("all_gather")'
    assert anchor in source
    worker.write_text(
        source.replace(anchor, '        if self.me == 1:\n            raise RuntimeError("boom")\n' + anchor)
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "OUT")}
    env.update(JAX_PLATFORMS="cpu", JAXCCL_TIMEOUT_S="5", PYTHONPATH=str(ROOT))
    out = tmp_path / "job.json"
    cmd = [sys.executable, str(tmp_path / "mp_job.py"), "--processes", "2", "--timeout", "200", "--json", str(out)]
    subprocess.run([*cmd, "--", "--platform", "cpu", "--parts", "swap,meter"], cwd=ROOT, env=env, timeout=300)
    job = run_all.Job.read(out)
    errors = {p: e["error"] for p, e in job.one("error").items()}
    assert errors[1] == "RuntimeError: boom" and "process 1" in errors[0], errors
    swap = run_all.evaluate_swap(job)
    assert swap.status == "FAILED" and "boom" in swap.summary
    assert run_all.evaluate_meter(job, "cpu").status == "ok"
    assert job.returncodes == {0: 1, 1: 1} and [d["ok"] for d in job.one("done").values()] == [False, False]


def test_the_examples_in_the_docstrings_run():
    import mp_worker

    for module in (run_all, mp_worker):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
