"""What a worker's ``/metrics`` costs after weeks of pool processes replaced
(``--max-tasks-per-child``, SIGKILLs, hard time limits), side by side in ONE run:

* prometheus-client's own MultiProcessCollector, which reads every value file of every
  process the worker ever had (each ended one leaves its counter and histogram files);
* the worker's FoldingCollector (worker/metrics/server.py), which folds the files of
  ended processes into one per type at a scrape, then reads only those and the live ones.

Each ended "pool process" is a real fork that records what a pool process records (a job's
counters and histograms, the pool's hits and idle gauge) in multiprocess mode, then exits.

    python -m bench.metrics_files [--ended 100 1000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import pct


def _ended_processes(path: Path, n: int) -> None:
    """``n`` processes that each record one job's metrics in ``path`` and exit."""
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            try:
                from worker import metrics

                m, pool = metrics.metrics(), metrics.pool_metrics()
                m.jobs.labels("python", "docker", "succeeded").inc()
                m.run.labels("python", "docker").observe(0.05)
                m.sandbox_start.labels("python", "docker").observe(0.01)
                m.queue_wait.labels("code.run").observe(0.01)
                pool.hits.labels("python").inc()
                pool.idle.labels("python").set(1)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


def _scrapes(registry: object, n: int = 7) -> list[float]:
    from prometheus_client import generate_latest

    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        generate_latest(registry)  # type: ignore[arg-type]
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ended", type=int, nargs="*", default=[100, 1000])
    p.add_argument("--dir", help=argparse.SUPPRESS)  # set by the process this one starts
    args = p.parse_args()
    if args.dir is None:
        # prometheus-client picks its value store when it is first imported: measured in a
        # process of its own that imports it after PROMETHEUS_MULTIPROC_DIR is set
        tmp = Path(tempfile.mkdtemp(prefix="studio-bench-metrics-"))
        try:
            ended = [str(n) for n in args.ended]
            subprocess.run(
                [sys.executable, "-m", "bench.metrics_files", "--dir", str(tmp), "--ended", *ended],
                env={**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp)},
                check=True,
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp = Path(args.dir)
    from prometheus_client import CollectorRegistry, multiprocess

    from worker.metrics.server import FoldingCollector

    print("# bench.metrics_files: one worker's /metrics after N pool processes ended; ms")
    print("| ended processes | files | plain collector p50 | folding: first scrape | then p50 |")
    print("|---|---|---|---|---|")
    for n in args.ended:
        for f in tmp.glob("*.db"):
            f.unlink()
        _ended_processes(tmp, n)
        files = len(list(tmp.glob("*.db")))
        plain = CollectorRegistry()
        multiprocess.MultiProcessCollector(plain)
        plain_t = _scrapes(plain)
        folding = CollectorRegistry()
        FoldingCollector(folding, tmp)
        first = _scrapes(folding, 1)[0]
        then = _scrapes(folding)
        left = len(list(tmp.glob("*.db")))
        print(
            f"| {n} | {files} -> {left} | {pct(plain_t, 50):.1f} | {first:.1f} | "
            f"{pct(then, 50):.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
