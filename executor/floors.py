"""The floors of a sandbox's limits, in one place: below these a limit is not a limit a
sandbox can be given. Every door (the settings, the CLI, CodeClient, the HTTP bodies, the
executor's own check: executor.inputs) refuses a value below its floor, and the Docker policy
never emits one (executor/runtimes/docker/policy.py). Standard library only, outside the
runtimes: the CLI's ``validate`` loads neither."""

from __future__ import annotations

#: the smallest CPU share: the kernel's smallest CFS quota is 1 ms, and Docker turns a
#: NanoCpus into a quota per 100 ms period, so 0.01 CPU is 1 ms of every 100 ms. Below it
#: the engine's runtime refuses the start (runc: "invalid argument"), and a share that
#: rounds to 0 NanoCpus is no limit at all (the engine reads 0 as "unlimited").
MIN_CPUS = 0.01
#: MIN_CPUS as the engine's NanoCpus (CPUs x 1e9)
MIN_NANO_CPUS = 10_000_000
#: the smallest memory (swap equal to it), in which a trivial node of either language starts
#: in either runtime. Measured (cgroup v1, cold runs, three each): docker runtime, a trivial
#: TypeScript node peaks at ~12 MiB (fails at 10m), one importing npm:zod at ~14 MiB (fails
#: at 12m), a trivial Python node at ~5.5 MiB (runs at 6m, the engine's own minimum);
#: subprocess runtime, a trivial TypeScript node is killed for memory at 36m and runs at 40m
#: (Deno's binary, mapped, counts in its resident size), Python runs at 16m. 64m leaves
#: half as much again over the largest of these.
MIN_MEMORY_BYTES = 64 * 1024**2
#: the fewest processes and threads (STUDIO_CODE_PIDS). Measured: a trivial TypeScript node
#: fails at 1 and 2 in a container ("Deno could not start its threads") and runs at 3; in
#: the subprocess runtime (V8 --single-threaded) Deno peaks at 4 threads; Python needs 1.
#: 8 leaves twice the largest of these.
MIN_PIDS = 8
#: the fewest under gVisor (an OCI runtime named runsc*): its Sentry's and gofer's own host
#: threads live in the sandbox's pids cgroup. Measured with ptrace on this machine kind, an
#: idle sandbox holds 33-38; at --pids-limit 32 `docker run --runtime=runsc` failed two
#: starts of three ("urpc method containerManager.StartRoot failed: EOF"), and a pre-started
#: one that did start ended mid-job with its cgroup full (a CI run: no output, pids peak 32).
#: 48 starts every time and leaves the code about ten; the default 64 leaves it ~26.
GVISOR_MIN_PIDS = 48
