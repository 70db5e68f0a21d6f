"""`make bench`: every benchmark section, one after the other, in one run."""

from __future__ import annotations

import importlib
import sys

SECTIONS = [
    "bench.core",
    "bench.typescript",
    "bench.queue",
    "bench.tracing",
    "bench.fair",
    "bench.isolation",
    "bench.outputs",
    "bench.http",
    "bench.cli",
    "bench.history",
    "bench.store_open",
    "bench.live_logs",
    "bench.pool",
    "bench.preimport",
    "bench.upkeep",
    "bench.metrics_files",
    "bench.own_engine",
    "bench.gvisor",
    "bench.sockguard",
    "bench.redis_faults",
    "bench.cpu",
    "bench.engine_calls",
]

if __name__ == "__main__":
    for name in SECTIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        print(f"\n## {name}", flush=True)
        sys.argv = [name]
        module.main()
