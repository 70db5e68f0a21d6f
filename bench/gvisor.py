"""gVisor's runsc against runc, side by side in ONE run (interleaved, so both see the same
machine noise): what the second wall costs (docs/security.md, "The second wall").

* a trivial Python node through ``Executor.run``, cold (a sandbox started for the job) and
  pooled (a pre-started one, as in a worker's pool process): end to end, ms;
* inside a pooled sandbox, timed by the code itself (``time.perf_counter``): ``import
  pydantic`` (no pre-import: STUDIO_CODE_PREIMPORT off), a CPU loop of a fixed work (about
  0.5 s on this host under runc), a 100 MB allocation written through;
* the CPU charged to the sandbox's own cgroup per pooled trivial job (``usage.cpu_ms``: under
  gVisor its kernel, the Sentry, runs in that cgroup and counts there);
* the memory charged to one idle pre-started sandbox (its memory cgroup).

The default's rule (issue 39): a pooled trivial job under runsc within 2x of runc's p50 and
every battery holding -> ``STUDIO_CODE_OCI_RUNTIME=auto`` by default.

    python -m bench.gvisor [--n 20]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from bench.common import interleave, pct
from bench.pool import idle_memory
from executor.models import CodeJob, CodeResult
from executor.service import Executor
from executor.settings import load_settings

TRIVIAL = "def main(state):\n    return 1\n"
#: the code times its own work; returns ms
IMPORT = (
    "import time\n"
    "def main(state):\n"
    "    t0 = time.perf_counter()\n"
    "    import pydantic\n"
    "    return (time.perf_counter() - t0) * 1000\n"
)
CPU_LOOP = (
    "import time\n"
    "def main(state):\n"
    "    t0 = time.perf_counter()\n"
    "    x = 0\n"
    "    for i in range(state['n']):\n"
    "        x += i * i\n"
    "    return (time.perf_counter() - t0) * 1000\n"
)
ALLOC = (
    "import time\n"
    "def main(state):\n"
    "    t0 = time.perf_counter()\n"
    "    b = bytearray(100 * 1024 * 1024)\n"
    "    for i in range(0, len(b), 4096):\n"
    "        b[i] = 1\n"
    "    return (time.perf_counter() - t0) * 1000\n"
)
RUNTIMES = ("runc", "runsc")


def job(ex: Executor, code: str, state: str = "{}") -> CodeResult:
    r = ex.run(CodeJob(code=code, state_json=state, timeout_s=30))
    assert r.status == "succeeded", r.error
    return r


def executors(pooled: bool) -> dict[str, Executor]:
    out = {}
    for oci in RUNTIMES:
        ex = Executor(
            load_settings(
                enable_code_nodes=True,
                code_languages="python",
                code_oci_runtime="" if oci == "runc" else oci,
                code_preimport="",
                code_prewarm=1 if pooled else 0,
            )
        )
        if pooled:
            ex.prepare()
            assert ex.runtime is not None and ex.runtime.pool is not None
            assert ex.runtime.pool.wait_ready(120)
        out[oci] = ex
    return out


def inside(exs: dict[str, Executor], code: str, n: int, state: str = "{}") -> list[list[float]]:
    """What the code itself measured, interleaved: one list of ms per runtime."""
    out: list[list[float]] = [[] for _ in exs]
    for _ in range(n):
        for i, ex in enumerate(exs.values()):
            pool = ex.runtime.pool  # type: ignore[union-attr]
            assert pool is not None and pool.wait_settled(60)
            out[i].append(float(job(ex, code, state).output))  # type: ignore[arg-type]
    return out


def show(what: str, runc: list[float], runsc: list[float], unit: str = "ms") -> None:
    a, b = pct(runsc, 50), pct(runc, 50)
    print(
        f"| {what} | {pct(runc, 50):.1f} / {pct(runc, 95):.1f} {unit} | "
        f"{pct(runsc, 50):.1f} / {pct(runsc, 95):.1f} {unit} | {a / b:.2f}x |"
    )


def calibrate(ex: Executor) -> int:
    """The loop count that takes about 0.5 s under runc on this host."""
    n = 2_000_000
    ms = float(job(ex, CPU_LOOP, f'{{"n": {n}}}').output)  # type: ignore[arg-type]
    return int(n * 500 / max(ms, 1.0))


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gvisor")
    p.add_argument("--n", type=int, default=20)
    args = p.parse_args()
    n = args.n
    probe = Executor(load_settings(enable_code_nodes=True, code_oci_runtime="auto"))
    posture = probe.runtime.engine_posture() if probe.runtime is not None else None
    if posture is None or "runsc" not in posture.runtimes:
        print("# bench.gvisor: the engine lists no runsc (scripts/host-setup.sh registers it)")
        return
    print(
        f"# bench.gvisor: n={n} per side, interleaved; p50 / p95; runsc "
        f"{posture.oci_runtime_version} (platform {posture.oci_runtime_platform})"
    )
    print("| what | runc | runsc | runsc / runc (p50) |")
    print("|---|---|---|---|")
    cold = executors(pooled=False)
    fns: list[Callable[[], object]] = [lambda ex=ex: job(ex, TRIVIAL) for ex in cold.values()]
    runc_ms, runsc_ms = interleave(n, fns)
    show("trivial Python node e2e, cold", runc_ms, runsc_ms)
    pooled = executors(pooled=True)
    try:
        cpu: dict[str, list[float]] = {oci: [] for oci in RUNTIMES}
        # the pool settles before each job, untimed in the job's own figure below
        timed_jobs: dict[str, list[float]] = {oci: [] for oci in RUNTIMES}
        for _ in range(n + 2):
            for oci in RUNTIMES:
                pooled[oci].runtime.pool.wait_settled(60)  # type: ignore[union-attr]
                t0 = time.perf_counter()
                r = job(pooled[oci], TRIVIAL)
                timed_jobs[oci].append((time.perf_counter() - t0) * 1000)
                assert [t.detail for t in r.trace if t.step == "sandbox.start"] == ["pool"]
                if r.usage is not None and r.usage.cpu_ms is not None:
                    cpu[oci].append(r.usage.cpu_ms)
        show("trivial Python node e2e, pooled", timed_jobs["runc"][2:], timed_jobs["runsc"][2:])
        show(
            "CPU charged to the sandbox's cgroup per pooled trivial job",
            cpu["runc"][2:],
            cpu["runsc"][2:],
        )
        show("`import pydantic` inside a pooled sandbox", *inside(pooled, IMPORT, n))
        loop = calibrate(pooled["runc"])
        show(
            f"CPU loop of {loop:,} iterations (≈ 0.5 s under runc)",
            *inside(pooled, CPU_LOOP, max(5, n // 4), f'{{"n": {loop}}}'),
        )
        show("100 MB allocation, written through", *inside(pooled, ALLOC, max(5, n // 2)))
        mem = {oci: idle_memory(ex).get("python", float("nan")) for oci, ex in pooled.items()}
        print(
            f"| memory charged to one idle pre-started sandbox | {mem['runc']:.1f} MiB | "
            f"{mem['runsc']:.1f} MiB | {mem['runsc'] / mem['runc']:.2f}x |"
        )
    finally:
        for ex in pooled.values():
            ex.close()


if __name__ == "__main__":
    main()
