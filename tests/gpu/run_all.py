"""The GPU check in one run (tests/gpu/run_all.sh starts it): steps in one time budget, a line per check, JSON.

Steps (:data:`STEPS`, each with its estimate and its own time limit; no step outlives the budget):

- ``gpu``: ``nvidia-smi -L`` lists a GPU; else it prints ``skipped: no GPU visible`` and exits 0.
- ``build``: a venv (``--system-site-packages``, plus the site-packages of the Python that runs this,
  which may itself be a venv) gets ``pip install --no-build-isolation --no-deps --no-index -e .``
  with ``JAXCCL_CUDA=ON``: offline, from what is installed. Wheels in ``$JAXCCL_GPU_WHEELS`` are
  installed into it first (a machine without some package: carry its wheel).
- ``probe``: the CUDA module loads, the transport is there, which UCX transports it would use,
  whether JAX sees the GPU (without JAX's CUDA plugin the JAX-level checks are ``skipped``).
- ``core``: tests/gpu/check_core.py (the executor core on the GPU against the CPU core and jax.lax).
- ``measurement``: tests/gpu/check_measurement.py --quick (needs JAX on the GPU).
- ``cpu_reference``: the collectives of tests/gpu/mp_worker.py on the CPU executor, 2 and 4 processes.
- ``mp2``: 2 processes sharing the GPU (UCX between them): the collectives, a hot-swap at an agreed
  call, the meter, its overhead, the swap latency, a 16 MiB AllGather against jax.lax.
- ``mp4``: 4 processes sharing the GPU: the collectives.

The collectives are compared bitwise with a NumPy model in every process, with the CPU executor
(the SHA-256 of every process's shards of every case against the ``cpu_reference`` job's) and with
jax.lax (NCCL; where NCCL refuses two ranks on one GPU the check says so and the other two stand).

Every check prints ``check <name>: ok|FAILED|skipped  <numbers>``; the JSON file (written after each
step) holds the checks, each step's time against its estimate, the environment and, for a failed
check, the end of its log; the whole output of every step goes to a log file beside it. The exit
status is 1 if a check FAILED.

This file uses only the standard library: it runs before jaxccl is built.

Usage:
    bash tests/gpu/run_all.sh [--json PATH] [--budget S] [--python PY] [--only STEP,...] [--platform cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import site
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "results"  # gitignored
DEFAULT_BUDGET_S = 470.0  # under the 8 minutes the issue allows, with room for the shell's own start
DEFAULT_UCX_TLS = "cuda_copy,cuda_ipc,tcp,sm,self"
OVERHEAD_LIMIT = 1.5  # meter on / off median step time above this fails (processes share one GPU: noisy)
JOB_MARGIN_S = 15.0  # a job's own deadline ends this much before its step's, so it still writes its JSON
MIN_STEP_S = 10.0  # a step with less time left than this is skipped
TAIL_LINES = 40  # of a failed check's log, in the JSON
PRINTED_TAIL_LINES = 15  # of those, printed under its line
BUILD_MODULES = {  # import name -> pip name: what the build needs
    "jax": "jax",
    "jaxlib": "jaxlib",
    "numpy": "numpy",
    "ml_dtypes": "ml_dtypes",
    "nanobind": "nanobind",
    "scikit_build_core": "scikit-build-core",
    "libucx": "libucx-cu12",
}
RUN_MODULES = {"networkx": "networkx", "scipy": "scipy", "highspy": "highspy"}  # what some checks import


@dataclass(frozen=True)
class Step:
    name: str
    estimate_s: float  # on one H100 or H200 machine with 16 cores (stated in run_all.sh's header too)
    timeout_s: float


STEPS = (
    Step("gpu", 2, 20),
    Step("build", 100, 300),
    Step("probe", 15, 90),
    Step("core", 60, 200),
    Step("measurement", 30, 150),
    Step("cpu_reference", 40, 150),
    Step("mp2", 75, 200),
    Step("mp4", 50, 150),
)
STEP = {s.name: s for s in STEPS}


@dataclass
class Check:
    """One summary line: ``check <name>: <status>  <summary>``."""

    name: str
    status: str  # "ok", "FAILED" or "skipped"
    summary: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)
    log_tail: str = ""

    def line(self, width: int = 600) -> str:
        """The line printed for it (the summary cut at ``width``; the JSON has all of it).

        >>> Check("core", "ok", "12/12 checks").line()
        'check core: ok  12/12 checks'
        """
        summary = self.summary if len(self.summary) <= width else self.summary[: width - 3] + "..."
        return f"check {self.name}: {self.status}  {summary}".rstrip()


def ok(name: str, summary: str, **numbers: Any) -> Check:
    return Check(name, "ok", summary, numbers)


def failed(name: str, summary: str, **numbers: Any) -> Check:
    return Check(name, "FAILED", summary, numbers)


def skipped(name: str, why: str) -> Check:
    return Check(name, "skipped", f"({why})")


class Budget:
    """The run's time: each step gets its own limit, cut to what is left of the total.

    >>> b = Budget(100.0, clock=lambda: 0.0)
    >>> b.limit(30.0), b.limit(200.0)
    (30.0, 95.0)
    >>> Budget(12.0, clock=lambda: 0.0).limit(30.0) is None  # under MIN_STEP_S once the reserve is kept
    True
    """

    RESERVE_S = 5.0  # kept for writing the summary

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic):
        self.total_s, self.clock = float(total_s), clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.total_s - self.elapsed()

    def limit(self, timeout_s: float) -> float | None:
        """The step's time limit, or ``None`` when too little is left to start it."""
        limit = min(float(timeout_s), self.left() - self.RESERVE_S)
        return limit if limit >= MIN_STEP_S else None


# ------------------------------------------------------------------ running commands


@dataclass
class Ran:
    """How a command ended: exit code (``None``: killed at its limit), seconds, its output."""

    returncode: int | None
    seconds: float
    output: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def tail(self, lines: int = TAIL_LINES) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


class Interrupted(Exception):
    """SIGTERM or SIGINT: the current command's processes were killed."""


_running: subprocess.Popen | None = None


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)  # its own session: every process it started, and only those


def _on_signal(signum: int, _frame: Any) -> None:
    if _running is not None:
        _kill_group(_running)
    raise Interrupted(signal.Signals(signum).name)


def run_logged(cmd: Sequence[str], *, log: Path, timeout_s: float, env: dict[str, str] | None = None) -> Ran:
    """Runs ``cmd`` in the repository root with output to ``log``; kills it and all it started at ``timeout_s``.

    The command runs in a session of its own, so a timeout kills its children too (workers, compilers),
    and its output goes to a file, so nothing it leaves behind can keep this process waiting on a pipe.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     r = run_logged([sys.executable, "-c", "print('hi')"], log=Path(d) / "x.log", timeout_s=30)
    >>> r.returncode, r.output
    (0, 'hi\\n')
    """
    global _running
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as out:
        p = subprocess.Popen(
            list(cmd), cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        _running = p
        try:
            rc: int | None = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            p.wait()
            rc = None
        finally:
            _running = None
    seconds = time.monotonic() - t0
    output = log.read_text(errors="replace")
    if rc is None:
        output += f"\n[run_all: killed after {timeout_s:.0f} s]\n"
    return Ran(rc, seconds, output)


# ------------------------------------------------------------------ reading results


def gpus_listed(nvidia_smi_output: str) -> list[str]:
    """The GPUs ``nvidia-smi -L`` lists.

    >>> gpus_listed("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\\n")
    ['GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)']
    >>> gpus_listed("No devices were found\\n")
    []
    """
    return [line.strip() for line in nvidia_smi_output.splitlines() if line.startswith("GPU ")]


def prefixed_json(output: str, prefix: str) -> list[dict[str, Any]]:
    """The JSON objects of the lines that start with ``prefix`` (lines cut off by a kill are left out).

    >>> prefixed_json('noise\\nRESULT {"kind": "done"}\\nRESULT {"kind": "ca', "RESULT ")
    [{'kind': 'done'}]
    """
    out = []
    for line in output.splitlines():
        if line.startswith(prefix):
            try:
                out.append(json.loads(line[len(prefix) :]))
            except json.JSONDecodeError:
                continue
    return out


@dataclass
class Job:
    """A multi-process job's results (tests/gpu/mp_job.py's JSON): each process's records and exit code."""

    records: dict[int, list[dict[str, Any]]]
    returncodes: dict[int, int | None]
    problem: str = ""  # why it has no results at all
    outputs: dict[int, str] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path, ran: Ran | None = None) -> Job:
        if not path.exists():
            why = "it did not finish within its limit" if ran is None or ran.timed_out else f"exit {ran.returncode}"
            return cls({}, {}, f"the job left no results ({why})")
        procs = json.loads(path.read_text())["processes"]
        return cls(
            {p["process_id"]: prefixed_json(p["output"], "RESULT ") for p in procs},
            {p["process_id"]: p["returncode"] for p in procs},
            outputs={p["process_id"]: p["output"] for p in procs},
        )

    def tail(self, lines: int = 12) -> str:
        """The end of every process's output less its result lines (errors and tracebacks stay), for a report."""
        out = []
        for p, text in sorted(self.outputs.items()):
            kept = [line for line in text.splitlines() if not line.startswith("RESULT ") or '"error"' in line]
            out.append(f"[process {p}, exit {self.returncodes.get(p)}; {len(text.splitlines()) - len(kept)} results]")
            out += [line[:300] for line in kept[-lines:]]
        return "\n".join(out) or self.problem

    def error(self, *parts: str) -> str:
        """Each process's first error (in one of ``parts``, if given), else ''.

        Every process's, since the first process's error may only be the deadline of waiting for another.
        """
        found = []
        for p, errors in sorted(self.of("error").items()):
            e = next((e for e in errors if not parts or e.get("part") in parts), None)
            if e is not None:
                found.append(f"process {p} failed in part {e.get('part')}: {str(e.get('error'))[:300]}")
        return " | ".join(found)

    def of(self, kind: str) -> dict[int, list[dict[str, Any]]]:
        """Per process, its records of ``kind``."""
        return {p: [r for r in recs if r.get("kind") == kind] for p, recs in self.records.items()}

    def one(self, kind: str) -> dict[int, dict[str, Any]]:
        """Per process, its (last) record of ``kind``; processes without one are left out."""
        return {p: recs[-1] for p, recs in self.of(kind).items() if recs}

    def why_missing(self, kind: str) -> str:
        """Why some process has no ``kind`` record: its error, its exit, or the job's problem."""
        part = "cases" if kind == "case" else kind  # mp_worker.py's part that writes it
        error = self.error(part, "setup") or (self.error() if kind == "done" else "")
        if self.problem or error:
            return self.problem or error
        have = self.one(kind)
        missing = [p for p in sorted(self.records) if p not in have]
        codes = {p: self.returncodes.get(p) for p in missing}
        return f"no {kind} result from processes {missing} (exit codes {codes}; None: killed at the deadline)"


def _fmt(x: float | None, unit: str = "", digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:.{digits}g}{unit}"


def evaluate_json_check(name: str, path: Path, ran: Ran) -> Check:
    """A check script's JSON (check_core.py, check_measurement.py): skipped, all passed, or which failed."""
    if not path.exists():
        return failed(name, f"no result ({'killed at its limit' if ran.timed_out else f'exit {ran.returncode}'})")
    res = json.loads(path.read_text())
    if res.get("skipped"):
        return skipped(name, str(res.get("reason", "")))
    checks = res.get("checks", [])
    bad = [c.get("check", "?") for c in checks if not c.get("ok")]
    numbers: dict[str, Any] = {"passed": len(checks) - len(bad), "total": len(checks)}
    timing = next((c for c in checks if str(c.get("check", "")).startswith("timing")), None)
    extra = ""
    if timing is not None:
        numbers.update({k: timing[k] for k in ("gpu_ms", "cpu_ms", "gpu_algbw_GBps") if k in timing})
        extra = f"; 16 MiB/rank AllGather GPU {timing.get('gpu_ms')} ms vs CPU core {timing.get('cpu_ms')} ms"
    if bad or not res.get("all_ok") or ran.returncode != 0:
        return failed(name, f"{len(bad)}/{len(checks)} failed: {'; '.join(bad[:4])}{extra}", **numbers)
    return ok(name, f"{len(checks)}/{len(checks)} checks{extra}", **numbers)


def evaluate_collectives(name: str, job: Job, reference: Job | None, why_no_reference: str = "") -> Check:
    """Every case bitwise: the NumPy model in every process, the CPU executor's digests, jax.lax (where it ran)."""
    cases = job.of("case")
    if not any(cases.values()):
        return failed(name, job.why_missing("case"))
    names = {p: [c["name"] for c in cs] for p, cs in cases.items()}
    ref_cases = reference.of("case") if reference is not None else {}
    want = max([*names.values(), *([c["name"] for c in cs] for cs in ref_cases.values())], key=len)
    problems = []
    if job.error("setup", "cases"):
        problems.append(job.error("setup", "cases"))
    elif any(n != want for n in names.values()):
        problems.append(f"cases missing in some process ({job.why_missing('lax')})")
    model_bad = sorted({c["name"] for cs in cases.values() for c in cs if not c["model"]})
    if model_bad:
        problems.append(f"NumPy model mismatch: {', '.join(model_bad[:3])}")
    numbers: dict[str, Any] = {"processes": len(cases), "cases": len(want), "model_mismatches": model_bad}
    parts = [
        f"{len(cases)} processes x {len(want)} cases bitwise: NumPy model {len(want) - len(model_bad)}/{len(want)}"
    ]
    # the CPU executor on the same tables
    if any(ref_cases.values()):
        ref_digest = {(p, c["name"]): c["digest"] for p, cs in ref_cases.items() for c in cs}
        pairs = [(p, c["name"], c["digest"]) for p, cs in cases.items() for c in cs]
        differ = sorted({n for p, n, d in pairs if ref_digest.get((p, n), d) != d})
        absent = sorted({n for p, n, _ in pairs if (p, n) not in ref_digest} - set(differ))
        numbers.update(cpu_executor_mismatches=differ, not_in_cpu_reference=absent)
        same = len(want) - len(differ) - len(absent)
        parts.append(f"CPU executor {same}/{len(want)}" + (f" ({len(absent)} not in its results)" if absent else ""))
        if differ:
            problems.append(f"differs from the CPU executor: {', '.join(differ[:3])}")
    else:
        why = why_no_reference or (reference.why_missing("case") if reference is not None else "not run")
        parts.append(f"CPU executor n/a ({why})")
    # jax.lax
    lax = job.one("lax")
    statuses = {r["status"] for r in lax.values()}
    if lax and statuses == {"ok"}:
        verdicts = [v for r in lax.values() for v in r["cases"].values()]
        mismatch = sorted({n for r in lax.values() for n, v in r["cases"].items() if v == "MISMATCH"})
        differs = sorted({n for r in lax.values() for n, v in r["cases"].items() if v == "differs"})
        numbers.update(lax_mismatches=mismatch, lax_float_sums_differ=differs)
        parts.append(
            f"jax.lax {len(want) - len(mismatch) - len(differs)}/{len(want)}"
            + (f" ({len(differs)} float sums differ: jax.lax's own order)" if differs else "")
        )
        if mismatch or len(verdicts) != len(want) * len(lax):
            problems.append(f"jax.lax mismatch: {', '.join(mismatch[:3]) or 'cases missing'}")
    elif lax:
        error = next((r.get("error", "") for r in lax.values() if r["status"] != "ok"), "")
        numbers["lax"] = f"{'/'.join(sorted(statuses))}: {error}"
        parts.append(f"jax.lax not comparable ({'/'.join(sorted(statuses))}: {error[:120]}); the NumPy model stands")
    else:
        parts.append(f"jax.lax no result ({job.why_missing('lax')})")
    summary = "; ".join(parts)
    return failed(name, "; ".join(problems) + f" [{summary}]", **numbers) if problems else ok(name, summary, **numbers)


def _switch_step(steps: list[list[Any]], version: int) -> int | None:
    """The first step that ran ``version``.

    >>> _switch_step([[0, 1, True, 1.0], [1, 2, True, 1.0]], 2)
    1
    """
    return next((s[0] for s in steps if s[1] == version), None)


def evaluate_swap(job: Job) -> Check:
    """Bitwise before, across and after the swap; every process switched at the same call, as agreed."""
    swaps = job.one("swap")
    if len(swaps) != len(job.records) or not swaps:
        return failed("hot_swap", job.why_missing("swap"))
    problems = []
    agreed = {(r["version"], r["transition"]) for r in swaps.values()}
    switch = {p: _switch_step(r["steps"], r["version"]) for p, r in swaps.items()}
    if len(agreed) != 1:
        problems.append(f"processes staged different (version, transition): {sorted(agreed)}")
    if None in switch.values() or len(set(switch.values())) != 1:
        problems.append(f"switched at different steps (per process: {switch})")
    for p, r in swaps.items():
        versions = [s[1] for s in r["steps"]]
        k = switch[p]
        if k is not None and (len(set(versions[:k])) != 1 or set(versions[k:]) != {r["version"]}):
            problems.append(f"process {p} ran versions {versions}")
        if not all(s[2] for s in r["steps"]):
            problems.append(f"process {p}: not bitwise at steps {[s[0] for s in r['steps'] if not s[2]]}")
        st = r["state"]
        if st.get("current_version") != r["version"] or st.get("last_swap_seq") != r["transition"] + 1:
            problems.append(
                f"process {p}: swap_state {st} (want version {r['version']} from seq {r['transition'] + 1})"
            )
    version, transition = sorted(agreed)[0]
    steps = len(next(iter(swaps.values()))["steps"])
    summary = (
        f"{len(swaps)} processes switched to version {version} at step {switch[min(switch)]} of {steps} "
        f"(agreed seq {transition}), every step bitwise"
    )
    numbers = {"version": version, "transition_seq": transition, "switch_step": switch}
    return failed("hot_swap", "; ".join(problems), **numbers) if problems else ok("hot_swap", summary, **numbers)


def evaluate_swap_latency(job: Job) -> Check:
    """stage_agreed's time plus the first call on the new table, against a call on the old one (worst process)."""
    swaps = job.one("swap")
    if not swaps:
        return failed("swap_latency", job.why_missing("swap"))
    rows = []
    for r in swaps.values():
        k = _switch_step(r["steps"], r["version"])
        if k is None:
            return failed("swap_latency", "the new table never ran")
        old = [s[3] for s in r["steps"][1:k]]  # step 0 compiles
        rows.append((r["stage_ms"], r["steps"][k][3], statistics.median(old) if old else math.nan))
    stage, first, old = (max(c) for c in zip(*rows))
    numbers = {"stage_ms": stage, "first_call_ms": first, "old_call_ms": old, "swap_latency_ms": stage + first}
    return ok(
        "swap_latency",
        f"{_fmt(stage + first, ' ms')} = stage_agreed {_fmt(stage, ' ms')} + first call on the new table "
        f"{_fmt(first, ' ms')} (a call on the old one: {_fmt(old, ' ms')})",
        **numbers,
    )


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def evaluate_meter(job: Job, backend: str) -> Check:
    """measurement() has windows (cuda; where the API exists) and the transport's rates are finite and positive."""
    meters = job.one("meter")
    if len(meters) != len(job.records) or not meters:
        return failed("meter", job.why_missing("meter"))
    problems = []
    rates = [rate for r in meters.values() for _, _, rate in r["rates"]]
    if not rates or not all(_finite_positive(x) for x in rates):
        problems.append(f"transport rates not all finite and positive: {[r['rates'] for r in meters.values()]}")
    if not all(r["bitwise"] for r in meters.values()):
        problems.append("AllGather results not bitwise right")
    windows = [(r.get("measurement") or {}).get("windows") for r in meters.values()]
    if not all(r["measurement_api"] for r in meters.values()):
        measured = "measurement(): skipped (no measurement API)"
    elif backend == "cuda" and not all(isinstance(w, int) and w > 0 for w in windows):
        errors = [r.get("measurement_error") for r in meters.values() if r.get("measurement_error")]
        problems.append(f"measurement() windows {windows}{f' ({errors[0]})' if errors else ''}")
        measured = f"measurement() windows {windows}"
    else:
        measured = f"measurement() windows {windows}"
    numbers = {
        "transport_rate_GBps_median": statistics.median(rates) / 1e9 if rates else None,
        "windows": windows,
        "measurement": {p: r.get("measurement") for p, r in meters.items()},
    }
    summary = (
        f"{measured}; transport rates of {len(rates)} pairs finite and positive, "
        f"median {_fmt(numbers['transport_rate_GBps_median'], ' GB/s')}"
    )
    return failed("meter", "; ".join(problems), **numbers) if problems else ok("meter", summary, **numbers)


def evaluate_overhead(job: Job) -> Check:
    """Median AllGather step time with the kernel's measurement on over off, same run (worst process)."""
    recs = job.one("overhead")
    if len(recs) != len(job.records) or not recs:
        return failed("meter_overhead", job.why_missing("overhead"))
    if any("skipped" in r for r in recs.values()):
        return skipped("meter_overhead", next(r["skipped"] for r in recs.values() if "skipped" in r))
    ratio = max(r["ratio"] for r in recs.values())
    on, off = max(r["on_ms"] for r in recs.values()), max(r["off_ms"] for r in recs.values())
    numbers = {"ratio": ratio, "on_ms": on, "off_ms": off, "limit": OVERHEAD_LIMIT}
    summary = f"on/off {_fmt(ratio)} (median step {_fmt(on, ' ms')} on, {_fmt(off, ' ms')} off; limit {OVERHEAD_LIMIT})"
    if not all(r["bitwise"] for r in recs.values()):
        return failed("meter_overhead", "results not bitwise right; " + summary, **numbers)
    if not (math.isfinite(ratio) and ratio <= OVERHEAD_LIMIT):
        return failed("meter_overhead", summary, **numbers)
    return ok("meter_overhead", summary, **numbers)


def evaluate_timing(job: Job, backend: str) -> Check:
    """The 16 MiB per rank AllGather: jaxccl's median (worst process) against jax.lax's, in the same run."""
    recs = job.one("timing")
    if len(recs) != len(job.records) or not recs:
        return failed("allgather_16mib", job.why_missing("timing"))
    ms = max(r["jaxccl_ms"] for r in recs.values())
    n = len(job.records)
    per_rank = next(iter(recs.values()))["bytes_per_rank"]
    algbw = n * per_rank / (ms * 1e-3) / 1e9 if _finite_positive(ms) else None
    lax = job.one("lax")
    lax_ms = [r.get("lax_ms") for r in lax.values()]
    numbers: dict[str, Any] = {"jaxccl_ms": ms, "algbw_GBps": algbw, "runs": next(iter(recs.values()))["runs"]}
    if lax and all(_finite_positive(x) for x in lax_ms):
        numbers.update(lax_ms=max(lax_ms), ratio=ms / max(lax_ms))
        versus = f"jax.lax {_fmt(max(lax_ms), ' ms')}, jaxccl/lax {_fmt(ms / max(lax_ms))}"
    else:
        why = next((r.get("error") for r in lax.values() if r.get("error")), None) or job.why_missing("lax")
        versus = f"jax.lax n/a ({why[:120]})"
    summary = f"{backend} {_fmt(ms, ' ms')} ({_fmt(algbw, ' GB/s')} algbw, median of {numbers['runs']}); {versus}"
    if not all(r["bitwise"] for r in recs.values()) or algbw is None:
        return failed("allgather_16mib", "not bitwise right or no time; " + summary, **numbers)
    return ok("allgather_16mib", summary, **numbers)


# ------------------------------------------------------------------ the run


class Run:
    """One run of the steps: the budget, the checks so far, the JSON and the log."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.budget = Budget(args.budget)
        self.json_path = Path(args.json)
        self.log_path = self.json_path.with_suffix(".log")
        self.work = Path(args.work)
        self.checks: list[Check] = []
        self.steps: dict[str, dict[str, Any]] = {}
        self.env_info: dict[str, Any] = {"platform": args.platform}
        self.python = args.python  # set by the build step when not given
        self.probe: dict[str, Any] = {}
        self.ucx_tls = os.environ.get("UCX_TLS") or (DEFAULT_UCX_TLS if args.platform == "cuda" else "")
        self.reference: dict[int, Job] = {}
        self.no_reference = ""
        self.blocked = ""  # why the steps that need the build cannot run

    # --------------------------------------------------------------- bookkeeping
    def add(self, check: Check, ran: Ran | None = None) -> None:
        if check.status == "FAILED" and ran is not None and not check.log_tail:
            check.log_tail = ran.tail()
        self.checks.append(check)
        print(check.line(), flush=True)
        if check.status == "FAILED" and check.log_tail:
            lines = check.log_tail.splitlines()[-PRINTED_TAIL_LINES:]
            print("\n".join(f"    | {line[:200]}" for line in lines), flush=True)

    def write(self, **extra: Any) -> None:
        data = {
            "skipped": False,
            "budget_s": self.args.budget,
            "estimate_s": sum(s.estimate_s for s in STEPS),
            "elapsed_s": round(self.budget.elapsed(), 1),
            "steps": self.steps,
            "checks": [asdict(c) for c in self.checks],
            "environment": self.env_info,
            "probe": self.probe,
            "log": str(self.log_path),
            **extra,
        }
        write_json(self.json_path, data)

    def step_limit(self, step: Step) -> float | None:
        """What the next command of ``step`` may take: the step's limit less its commands so far, within the budget."""
        return self.budget.limit(step.timeout_s - self.steps.get(step.name, {}).get("seconds", 0.0))

    def run(self, step: Step, cmd: Sequence[str], *, env: dict[str, str] | None = None, log: str = "") -> Ran | None:
        """Runs one command of ``step`` within its limit; ``None`` when too little time is left."""
        limit = self.step_limit(step)
        if limit is None:
            return None
        ran = run_logged(cmd, log=self.work / f"{log or step.name}.log", timeout_s=limit, env=env)
        with open(self.log_path, "a") as f:
            f.write(f"===== {log or step.name}: {' '.join(cmd)} (exit {ran.returncode}, {ran.seconds:.1f} s)\n")
            f.write(ran.output if ran.output.endswith("\n") else ran.output + "\n")
        entry = self.steps.setdefault(step.name, {"estimate_s": step.estimate_s, "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + ran.seconds, 1)
        return ran

    def wanted(self, name: str) -> bool:
        """Whether ``--only`` asks for step ``name`` (the multi-process steps need their CPU reference)."""
        needs = {"cpu_reference": ("cpu_reference", "mp2", "mp4")}
        return not self.args.only or any(s in self.args.only for s in needs.get(name, (name,)))

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def budget_spent(self, *names: str) -> None:
        for name in names:
            self.add(skipped(name, "the time budget is spent"))

    # --------------------------------------------------------------- steps
    def gpu(self) -> bool:
        """Whether a GPU is visible (``--platform cpu`` runs without one)."""
        if self.args.platform == "cpu":
            return True
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=STEP["gpu"].timeout_s)
            listed = gpus_listed(out.stdout)
        except (OSError, subprocess.TimeoutExpired) as e:
            listed, out = [], None
            self.env_info["nvidia_smi_error"] = str(e)
        if not listed:
            return False
        self.env_info["gpus"] = listed
        query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
        try:
            self.env_info["nvidia_smi"] = subprocess.run(
                query, capture_output=True, text=True, timeout=20
            ).stdout.strip()
            nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout
            self.env_info["nvcc"] = nvcc.strip().splitlines()[-1] if nvcc.strip() else ""
        except (OSError, subprocess.TimeoutExpired) as e:
            self.env_info["nvcc"] = f"not found ({e})"
        return True

    def build(self) -> None:
        step = STEP["build"]
        if self.python:
            self.add(skipped("build", f"--python {self.python} given"))
            return
        venv = Path(self.args.venv)
        py = venv / "bin" / "python"
        t0 = time.monotonic()
        if not py.exists():
            ran = self.run(
                step,
                [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                log="build-venv",
            )
            if ran is None or ran.returncode != 0:
                return self._build_failed("could not make the venv", ran)
        try:
            self._link_parent_site(py)
        except (OSError, subprocess.SubprocessError) as e:
            return self._build_failed(f"could not link the venv to this Python's packages: {e}", None)
        wheels = os.environ.get("JAXCCL_GPU_WHEELS", "")
        if wheels:
            found = sorted(str(p) for p in Path(wheels).resolve().glob("*.whl"))
            cmd = [str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile", *found]
            ran = self.run(step, cmd, log="build-wheels") if found else None
            if not found or ran is None or ran.returncode != 0:
                return self._build_failed(f"could not install the wheels in JAXCCL_GPU_WHEELS={wheels}", ran)
        missing = self._missing(py, {**BUILD_MODULES, **RUN_MODULES})
        if missing is None:
            return self._build_failed("the venv's Python does not run", None)
        blocking = [pip for mod, pip in BUILD_MODULES.items() if mod in missing]
        if blocking:
            return self._build_failed(
                f"missing Python packages {blocking}: this machine cannot download them; carry their wheels and "
                "set JAXCCL_GPU_WHEELS=DIR (tests/gpu/README.md)",
                None,
            )
        env = {  # not self.env(): the source tree stays off the build's sys.path
            **os.environ,
            "JAXCCL_CUDA": "ON",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4),
        }
        cmd = [
            str(py),
            "-m",
            "pip",
            "install",
            "-v",
            "--no-build-isolation",
            "--no-deps",
            "--no-index",
            "-e",
            str(ROOT),
        ]
        ran = self.run(step, cmd, env=env, log="build-pip")
        if ran is None or ran.returncode != 0:
            return self._build_failed("pip install -e . (JAXCCL_CUDA=ON) failed", ran)
        self.python = str(py)
        runtime_missing = [RUN_MODULES[m] for m in missing if m in RUN_MODULES]
        note = f"; missing (some checks will fail): {runtime_missing}" if runtime_missing else ""
        self.add(
            ok("build", f"JAXCCL_CUDA=ON in {time.monotonic() - t0:.0f} s, venv {venv}{note}", missing=runtime_missing)
        )

    def _build_failed(self, why: str, ran: Ran | None) -> None:
        self.blocked = "the build failed"
        if ran is None and self.budget.limit(MIN_STEP_S) is None:
            why = "the time budget is spent"
        self.add(failed("build", why), ran)

    def _link_parent_site(self, py: Path) -> None:
        """Makes the venv see the packages of the Python running this, also when that Python is itself a venv.

        ``--system-site-packages`` reaches only the base interpreter's; a ``.pth`` line that calls
        ``site.addsitedir`` adds the others after the venv's own (their ``.pth`` files included).
        """
        dirs = [d for d in [*site.getsitepackages(), *sys.path] if d.endswith(("site-packages", "dist-packages"))]
        out = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        lines = [f"import site; site.addsitedir({d!r})" for d in dict.fromkeys(dirs) if Path(d).is_dir()]
        (Path(out.stdout.strip()) / "_jaxccl_gpu_check_parent.pth").write_text("\n".join(lines) + "\n")

    def _missing(self, py: Path | str, modules: dict[str, str]) -> list[str] | None:
        code = (
            "import importlib.util as u, json, sys; print(json.dumps([m for m in sys.argv[1:] if not u.find_spec(m)]))"
        )
        try:
            out = subprocess.run([str(py), "-c", code, *modules], capture_output=True, text=True, timeout=60)
            return json.loads(out.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError):
            return None

    def probe_step(self) -> None:
        step = STEP["probe"]
        ran = self.run(step, [self.python, str(HERE / "probe.py"), "--ucx-tls", self.ucx_tls], env=self.env())
        if ran is None:
            self.blocked = "the time budget is spent"
            return self.budget_spent("probe")
        found = prefixed_json(ran.output, "PROBE ")
        if ran.returncode != 0 or not found:
            self.blocked = "jaxccl does not import (see the probe)"
            return self.add(failed("probe", "jaxccl does not import"), ran)
        self.probe = p = found[-1]
        transports = (p.get("ucx") or {}).get("transports", [])
        problems = []
        if self.args.platform == "cuda" and not p["cuda_module"]["loads"]:
            problems.append(f"the CUDA module does not load: {p['cuda_module']['reason']}")
        if p.get("transport"):
            problems.append(f"no transport: {p['transport']}")
        summary = (
            f"python {p['python']}, jax {p['jax']} (plugins {p['jax_plugins'] or 'none'}), "
            f"JAX GPUs {len(p.get('jax_gpu', []))}, UCX {(p.get('ucx') or {}).get('version', '?')} "
            f"with UCX_TLS={self.ucx_tls or '(its default)'}: {','.join(transports) or p.get('ucx_error', '?')}, "
            f"measurement API {'yes' if p['measurement_api'] else 'no'}"
        )
        if self.args.platform == "cuda" and not any(t.startswith("cuda") for t in transports):
            summary += "; WARNING: UCX offers no cuda transport (cuda_copy/cuda_ipc): device memory cannot move"
        self.add(failed("probe", "; ".join(problems) + f" [{summary}]") if problems else ok("probe", summary), ran)
        if problems:
            self.blocked = problems[0]

    def no_jax_gpu(self) -> str:
        """Why the JAX-level checks cannot run ('' when they can)."""
        if self.args.platform == "cpu" or self.probe.get("jax_gpu"):
            return ""
        return f"no jax cuda plugin: {self.probe.get('jax_gpu_error', 'JAX sees no GPU')}"

    def core(self) -> None:
        if self.args.platform == "cpu":
            return self.add(skipped("core", "--platform cpu"))
        out = self.work / "core.json"
        out.unlink(missing_ok=True)
        ran = self.run(STEP["core"], [self.python, str(HERE / "check_core.py"), "--json", str(out)], env=self.env())
        if ran is None:
            return self.budget_spent("core")
        self.add(evaluate_json_check("core", out, ran), ran)

    def measurement(self) -> None:
        if self.args.platform == "cpu":
            return self.add(skipped("measurement", "--platform cpu"))
        if self.no_jax_gpu():
            return self.add(skipped("measurement", self.no_jax_gpu()))
        out = self.work / "measurement.json"
        out.unlink(missing_ok=True)
        cmd = [self.python, str(HERE / "check_measurement.py"), "--quick", "--json", str(out)]
        ran = self.run(STEP["measurement"], cmd, env=self.env())
        if ran is None:
            return self.budget_spent("measurement")
        self.add(evaluate_json_check("measurement", out, ran), ran)

    def job(self, step: Step, processes: int, platform: str, parts: str, label: str) -> tuple[Job, Ran | None]:
        """Runs a job of ``processes`` mp_worker.py processes on ``platform``; its results."""
        out = self.work / f"{label}.json"
        out.unlink(missing_ok=True)
        limit = self.step_limit(step)
        if limit is None:
            return Job({}, {}, "the time budget is spent"), None
        job_s = max(MIN_STEP_S, limit - JOB_MARGIN_S)
        cmd = [self.python, str(HERE / "mp_job.py"), "--processes", str(processes), "--timeout", f"{job_s:.0f}"]
        cmd += ["--json", str(out), "--", "--platform", platform, "--parts", parts]
        if platform == "cuda":
            env = self.env(
                CUDA_VISIBLE_DEVICES=os.environ.get("JAXCCL_GPU_DEVICE", "0"),  # every process: the same GPU
                JAX_PLATFORMS="cuda",
                XLA_PYTHON_CLIENT_PREALLOCATE="false",
                XLA_PYTHON_CLIENT_MEM_FRACTION=os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.15"),
                UCX_TLS=self.ucx_tls,
                JAXCCL_TIMEOUT_S=os.environ.get("JAXCCL_TIMEOUT_S", "30"),  # a hung part costs this, not more
            )
        else:
            env = self.env(JAX_PLATFORMS="cpu", JAXCCL_TIMEOUT_S=os.environ.get("JAXCCL_TIMEOUT_S", "60"))
            env.pop("UCX_TLS", None)
        ran = self.run(step, cmd, env=env, log=label)
        job = Job.read(out, ran)
        with open(self.log_path, "a") as f:
            for p, text in sorted(job.outputs.items()):
                f.write(f"===== {label} process {p} (exit {job.returncodes[p]})\n{text}\n")
        return job, ran

    def cpu_reference(self) -> None:
        if self.no_jax_gpu():
            self.no_reference = "not needed: " + self.no_jax_gpu()
            return self.add(skipped("cpu_reference", self.no_jax_gpu()))
        results, notes, problems = [], [], []
        for n in (2, 4):
            if self.args.only and not {"cpu_reference", f"mp{n}"} & set(self.args.only):
                continue
            job, ran = self.job(STEP["cpu_reference"], n, "cpu", "cases", f"cpu{n}")
            if ran is None:
                notes.append(f"{n} processes: skipped (the time budget is spent)")
                continue
            self.reference[n] = job
            results.append((n, job))
            bad = sorted({c["name"] for cs in job.of("case").values() for c in cs if not c["model"]})
            done = job.one("done")
            if job.problem or not job.records or len(done) != len(job.records):
                problems.append(f"{n} processes: {job.why_missing('done')}")
            elif bad or not all(d["ok"] for d in done.values()):
                problems.append(f"{n} processes: NumPy model mismatch {bad[:3]}")
            else:
                notes.append(f"{n} processes x {len(job.of('case')[0])} cases")
        if problems:
            self.no_reference = "the CPU executor's job failed"
            check = failed("cpu_reference", "; ".join(problems + notes))
            check.log_tail = "\n".join(j.tail() for _, j in results)
            self.add(check)
        elif not results:
            self.add(skipped("cpu_reference", "the time budget is spent"))
        else:
            self.add(ok("cpu_reference", f"CPU executor bitwise equal to the NumPy model: {', '.join(notes)}"))

    def mp(self, n: int) -> None:
        step = STEP[f"mp{n}"]
        names = ["mp2_collectives", "hot_swap", "meter", "meter_overhead", "swap_latency", "allgather_16mib"]
        names = names if n == 2 else [f"mp{n}_collectives"]
        if self.no_jax_gpu():
            for name in names:
                self.add(skipped(name, self.no_jax_gpu()))
            return
        backend = "cuda" if self.args.platform == "cuda" else "cpu"
        parts = "cases,swap,meter,overhead,timing,lax" if n == 2 else "cases,lax"
        job, ran = self.job(step, n, self.args.platform, parts, f"mp{n}")
        if ran is None:
            return self.budget_spent(*names)
        ref = self.reference.get(n)
        checks = [evaluate_collectives(names[0], job, ref, self.no_reference if ref is None else "")]
        if n == 2:
            checks += [
                evaluate_swap(job),
                evaluate_meter(job, backend),
                evaluate_overhead(job),
                evaluate_swap_latency(job),
                evaluate_timing(job, backend),
            ]
        for c in checks:
            if c.status == "FAILED":
                c.log_tail = job.tail() or ran.tail()
            self.add(c)

    # --------------------------------------------------------------- all
    def main(self) -> int:
        print(
            f"GPU check: budget {self.args.budget:.0f} s, estimate {sum(s.estimate_s for s in STEPS):.0f} s; "
            f"JSON {self.json_path}, log {self.log_path}",
            flush=True,
        )
        t0 = time.monotonic()
        visible = self.gpu()
        self.steps["gpu"] = {"estimate_s": STEP["gpu"].estimate_s, "seconds": round(time.monotonic() - t0, 1)}
        if not visible:
            print("skipped: no GPU visible", flush=True)
            write_json(self.json_path, {"skipped": True, "reason": "no GPU visible", "environment": self.env_info})
            return 0
        self.work.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        self.write()
        order: list[tuple[str, Callable[[], None]]] = [
            ("build", self.build),
            ("probe", self.probe_step),
            ("core", self.core),
            ("measurement", self.measurement),
            ("cpu_reference", self.cpu_reference),
            ("mp2", lambda: self.mp(2)),
            ("mp4", lambda: self.mp(4)),
        ]
        try:
            for name, fn in order:
                if not self.wanted(name) and name not in ("build", "probe"):
                    continue
                if self.blocked and name != "build":
                    self.add(skipped(name, self.blocked))
                    continue
                print(
                    f"-- {name} (estimate {STEP[name].estimate_s:.0f} s, limit {STEP[name].timeout_s:.0f} s)",
                    flush=True,
                )
                fn()
                self.write()
        except Interrupted as e:
            self.add(failed("interrupted", f"{e} after {self.budget.elapsed():.0f} s"))
        self.write()
        counts = {s: sum(c.status == s for c in self.checks) for s in ("ok", "FAILED", "skipped")}
        estimate = sum(s.estimate_s for s in STEPS)
        print(
            f"summary: {counts['ok']} ok, {counts['FAILED']} FAILED, {counts['skipped']} skipped in "
            f"{self.budget.elapsed():.0f} s (estimate {estimate:.0f} s, budget {self.args.budget:.0f} s)\n"
            f"json: {self.json_path}\nlog: {self.log_path}",
            flush=True,
        )
        return 1 if counts["FAILED"] else 0


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Writes ``data`` to ``path`` whole or not at all (a file that is read while the run goes on)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def default_json() -> str:
    """``$OUT/gpu_summary.json`` where ``OUT`` is set, else tests/gpu/results/run_all.json."""
    out = os.environ.get("OUT")
    return str(Path(out) / "gpu_summary.json") if out else str(RESULTS / "run_all.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=default_json(), help="where the summary goes (a .log file beside it)")
    ap.add_argument("--budget", type=float, default=float(os.environ.get("JAXCCL_GPU_BUDGET_S", DEFAULT_BUDGET_S)))
    ap.add_argument("--python", default="", help="a Python with jaxccl built (JAXCCL_CUDA=ON): no build step")
    ap.add_argument("--venv", default=str(RESULTS / "venv"), help="the venv the build step makes (or reuses)")
    ap.add_argument("--work", default=str(RESULTS / "work"), help="each step's log and results")
    ap.add_argument("--only", default="", help=f"comma-separated steps of {[s.name for s in STEPS[3:]]}")
    ap.add_argument(
        "--platform",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: no GPU needed; runs the multi-process steps on CPU devices (a dry run of this script)",
    )
    args = ap.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(STEP))
    if unknown:
        ap.error(f"unknown steps {unknown}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
