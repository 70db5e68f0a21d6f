"""Constants every runtime, the queue and the front doors share, apart from any runtime's SDK,
so the queue's wire contract (worker.protocol), the settings and the CLI's argument checks can
import them without loading Docker: the timings, and the floors of a sandbox's limits."""

from __future__ import annotations

#: seconds a sandbox gets past its timeout before it is killed for good; the queue's
#: timings (visibility timeout, stuck-job sweep, Celery's hard time limit) add it too
KILL_GRACE_S = 10.0

# --- the floors of a sandbox's limits ---------------------------------------------------------
# Below these a limit is not a limit the sandbox can be given: every door (the settings, the
# CLI, CodeClient, the HTTP bodies, the executor's own check) refuses a value below its floor,
# and the Docker policy never emits one (executor/runtimes/docker/policy.py).

#: the smallest CPU share: the kernel's smallest CFS quota is 1 ms, and Docker turns a
#: NanoCpus into a quota per 100 ms period, so 0.01 CPU is 1 ms of every 100 ms. Below it
#: the engine's runtime refuses the start (runc: "invalid argument"), and a share that
#: rounds to 0 NanoCpus is no limit at all (the engine reads 0 as "unlimited").
MIN_CPUS = 0.01
#: MIN_CPUS as the engine's NanoCpus (CPUs x 1e9)
MIN_NANO_CPUS = 10_000_000
#: the smallest memory (swap equal to it): a trivial Python node and a trivial TypeScript
#: (Deno) node still succeed in a sandbox with it, with margin (measured: docs/operations.md,
#: "Per-node limits")
MIN_MEMORY_BYTES = 32 * 1024**2
#: the fewest processes and threads: Deno starts a dozen threads before the node's code runs
#: (measured: docs/operations.md, "Per-node limits")
MIN_PIDS = 16
