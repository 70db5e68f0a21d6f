"""All STUDIO_* settings in one pydantic-settings class, validated at start-up.

A malformed value stops start-up with a sentence naming the variable, the value and what
is allowed (``load_settings`` raises ``SettingsError``). One exception, asked for by the
specification: an UNKNOWN ``STUDIO_CODE_RUNTIME`` does not stop anything, it turns Code
nodes off, and validation and meta say why.

An EMPTY value means the default, for every variable (``STUDIO_ENABLE_CODE_NODES=`` is off,
``STUDIO_CODE_MEMORY=`` is 256m), as if it were unset. A ``STUDIO_*`` variable that nothing
reads (a misspelling) is logged as a warning at start-up, naming the closest known one.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from executor.deferred_import import on_first_use
from executor.errors import CodeInvalid, SettingsError
from executor.floors import MIN_CPUS, MIN_MEMORY_BYTES, MIN_PIDS
from executor.packages import (
    DEFAULT_PYTHON_PACKAGES,
    DEFAULT_TS_PACKAGES,
    PackageSpec,
    parse_packages,
    parse_preimport,
)
from executor.sizes import parse_size

# None is used here: asyncio only by CliApp.run, entry_points only to look for plugins,
# dotenv_values only to read an env_file (Settings has none), secrets (hmac, OpenSSL's
# hashlib) only to compare two secret values.
with (
    on_first_use("asyncio"),
    on_first_use("importlib.metadata", functions=("entry_points",)),
    on_first_use("dotenv", functions=("dotenv_values",)),
    on_first_use("secrets"),
):
    from pydantic import Field, SecretStr, ValidationError, ValidationInfo, field_validator
    from pydantic_settings import BaseSettings, SettingsConfigDict

if TYPE_CHECKING:
    from executor.models import RetryPolicy

log = logging.getLogger("studio_code.settings")

KNOWN_RUNTIMES = ("docker", "subprocess")
_MIN_MEMORY = f"{MIN_MEMORY_BYTES // 1024**2}m"
_CPUS_FLOOR = (
    f"a CPU share of at least {MIN_CPUS:g} (1 ms of CPU in every 100 ms, the smallest quota "
    "the kernel enforces; below it a sandbox is refused or gets no CPU limit at all)"
)
KNOWN_LANGUAGES = ("python", "typescript")
API_TOKEN_MIN_CHARS = 16
NOBODY = 65534  # uid/gid a sandbox gets when the server runs as root: no sandbox runs as root

#: STUDIO_CODE_USAGE_CGROUP_PARENT: an absolute cgroup path below the root, each name of safe
#: characters and not starting with a dot (so no "." or ".."), no empty name, no trailing "/"
CGROUP_PARENT_SHAPE = re.compile(r"(/[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}){1,16}")


def parse_uid_range(text: str) -> range:
    """'200000-200999' -> range(200000, 201000). Raises ValueError with what is allowed."""
    first, sep, last = text.strip().partition("-")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError("a uid range FIRST-LAST, such as 200000-200999")
    lo, hi = int(first), int(last)
    if not 1000 <= lo <= hi < 2**31 - 1:
        raise ValueError("a uid range FIRST-LAST with 1000 <= FIRST <= LAST < 2147483647")
    if hi - lo + 1 > 65536:
        raise ValueError("a uid range of at most 65536 uids")
    return range(lo, hi + 1)


def uid_range_problem(ids: range, reserved: Iterable[int]) -> str | None:
    """Why ``ids`` may not be handed to runs: a reserved uid (root, nobody, the Docker
    sandboxes' uid, the server's own) or a uid/gid an account or group of this host uses
    (its files would be readable by a run, and removed after it). None when it is fine."""
    for uid in sorted(set(reserved)):
        if uid in ids:
            return (
                f"a range without uid {uid} (root, nobody, the server's own uid and the "
                "Docker sandboxes' uid are never given to a run)"
            )
    import grp
    import pwd

    for p in pwd.getpwall():
        if p.pw_uid in ids:
            return (
                f"a range that no account uses (uid {p.pw_uid} is the account "
                f"{p.pw_name!r} on this host)"
            )
    for g in grp.getgrall():
        if g.gr_gid in ids:
            return (
                f"a range that no group uses (gid {g.gr_gid} is the group {g.gr_name!r} "
                "on this host)"
            )
    return None


class Settings(BaseSettings):
    """The executor's configuration; every field is a STUDIO_* environment variable."""

    model_config = SettingsConfigDict(
        env_prefix="STUDIO_", extra="ignore", frozen=True, env_ignore_empty=True
    )

    enable_code_nodes: bool = Field(
        False, description="Turns Code nodes on (1). While off, a workflow with one fails."
    )
    code_runtime: str = Field(
        "docker",
        description="docker (a new locked-down container per call) or subprocess (a child of "
        "the server: NOT a sandbox). Any other value turns Code nodes off.",
    )
    code_image: str = Field("studio-code:1", description="The Python sandbox image.")
    code_packages: str = Field(
        DEFAULT_PYTHON_PACKAGES,
        description="Comma-separated packages of STUDIO_CODE_IMAGE, shown in the editor. "
        "Unset: the image's own list (its modules.json), this default only when the image "
        "cannot be read; set and different from the image's, readiness and meta say which "
        "names differ.",
    )
    code_preimport: str = Field(
        "",
        description="Python modules a pre-started sandbox (docker runtime, STUDIO_CODE_PREWARM) "
        "imports while it waits for its one job, e.g. pandas,numpy; image: every package the "
        "image lists. Empty: none. A cold run never pre-imports; the memory they take counts "
        "against the sandbox's own limit.",
    )
    code_memory: str = Field("256m", description="Memory per call (swap equal to memory).")
    code_cpus: float = Field(0.5, le=64, description=f"CPU share per call (at least {MIN_CPUS:g}).")
    code_pids: int = Field(
        64, ge=MIN_PIDS, le=4096, description=f"Processes per call (at least {MIN_PIDS})."
    )
    code_max_seconds: float = Field(30, gt=0, le=3600, description="Cap on a node's timeout.")
    code_max_memory: str = Field(
        "",
        description="Cap on the memory a node may ask for (a size, e.g. 1g). Empty: "
        "STUDIO_CODE_MEMORY, so a node can only ask for less.",
    )
    code_max_cpus: float = Field(
        0,
        le=64,
        description=f"Cap on the CPU share a node may ask for (at least {MIN_CPUS:g}). 0: "
        "STUDIO_CODE_CPUS, so a node can only ask for less.",
    )
    code_concurrency: int = Field(4, ge=1, le=256, description="Sandboxes at once per process.")
    code_test_per_minute: int = Field(
        20, ge=1, le=10000, description="Editor test calls per user per minute."
    )
    code_languages: str = Field(
        "python,typescript", description="Languages the editor offers, comma-separated."
    )
    code_ts_image: str = Field("studio-code-ts:1", description="The Deno sandbox image.")
    code_ts_packages: str = Field(
        DEFAULT_TS_PACKAGES,
        description="The only packages TypeScript may import, each npm:name@major; keep it "
        "equal to the image's list (its studio.packages label; `studio-code image build` "
        "prints the value): readiness and meta say which names differ. none: no package "
        "(empty means the default).",
    )
    python: str = Field(
        "",
        description="The Python interpreter for subprocess mode. Empty: the server's own, or "
        "/usr/bin/python3 when the server runs as root (the child runs as nobody, who must "
        "be able to execute it).",
    )
    deno: str = Field("deno", description="The Deno binary for subprocess mode.")
    code_ts_deno_dir: str = Field(
        "", description="A Deno cache holding the allowed packages, for subprocess mode."
    )
    code_log_max_bytes: int = Field(
        64 * 1024, ge=1024, description="What a call may print that is kept as logs."
    )
    code_output_max_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest JSON result a call may return."
    )
    code_state_max_bytes: int = Field(
        32 * 1024 * 1024, ge=1024, description="Largest state JSON a call may be given."
    )
    data_dir: Path = Field(
        default_factory=lambda: default_data_dir(),
        description="Where the embedded SQLite run store lives. Default: /var/lib/studio-code "
        "for root, else $XDG_DATA_HOME/studio-code (~/.local/share/studio-code): never the "
        "current folder, so every process of one user finds the same store.",
    )
    code_prewarm: int = Field(
        1,
        ge=0,
        le=16,
        description="Pre-started, never-used sandboxes kept per offered language in each "
        "worker slot, so a job does not wait for a sandbox start: containers (docker "
        "runtime), or runner processes with their uid, cgroup and folder (subprocess "
        "runtime). Each is used for ONE job only. 0 turns the pool off.",
    )
    code_prewarm_max_idle_s: float = Field(
        300,
        gt=0,
        le=86400,
        description="Seconds a pre-started sandbox may wait for a job; older ones are "
        "removed and replaced.",
    )
    code_prewarm_rename_after_s: float = Field(
        0,
        ge=0,
        le=1.5,
        description="Seconds a job runs in a pre-started container under its pool name "
        "before the container is renamed studio-code-<job id> (how another process's cancel "
        "backstop, 2 s after the revoke, and `docker ps` find it, and what removes an earlier "
        "attempt's sandbox of the same job). 0 (the default): renamed when taken, every job, "
        "off the answer's path. Above 0: a job that ends sooner is never renamed, one engine "
        "call fewer, but an earlier attempt's sandbox of a re-run short job is left to its "
        "owner or the reaper.",
    )
    code_oci_runtime: str = Field(
        "",
        description="The OCI runtime Docker starts sandboxes with (a name `docker info` lists "
        "under Runtimes, e.g. runsc, crun). Empty: the engine's default (runc). auto: gVisor's "
        "runsc when the engine lists it (scripts/host-setup.sh registers it), else the "
        "default.",
    )
    code_usage_cgroup_parent: str = Field(
        "/docker",
        description="Docker runtime, cgroupfs driver: the engine's cgroup parent for "
        'containers (dockerd\'s --cgroup-parent, "cgroup-parent" in daemon.json; unset '
        "there: /docker). Each sandbox is created under a parent of its own below it, "
        "<this>/studio-code-usage-<16 hex>, so its usage outlives it and the limits and CPU "
        "weight of the engine's group hold it; the socket guard passes only that shape.",
    )
    code_usage: bool = Field(
        True,
        description="Read what each run used (memory peak, CPU, processes: the run's usage) "
        "from its cgroup or rusage. 0: not read, usage null (the bench's comparison).",
    )
    code_host_cgroup: str = Field(
        "/sys/fs/cgroup",
        description="Docker runtime: where this process sees the host's cgroup fs, the "
        "sandboxes' figures (a worker in a container: the host's /sys/fs/cgroup bound there, "
        "read-only under Compose; the usage-sweeper: read-write).",
    )
    code_usage_sweeper: bool = Field(
        False,
        description="Docker runtime: a usage-sweeper service (python -m "
        "executor.runtimes.docker.usage) removes the empty per-run parents, so a worker whose "
        "view of the host's cgroups is read-only still makes them (Compose). Off: such a "
        "worker makes none, and a cold run that ended by itself is not measured.",
    )
    code_sockguard_max_connections: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="The socket guard: client connections it holds at once (an attached "
        "sandbox holds one); past it a connection is answered 503 and closed. Lowered to "
        "what the guard's RLIMIT_NOFILE allows (two descriptors each).",
    )
    code_sockguard_max_per_peer: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="The socket guard: client connections one peer holds at once (the "
        "connecting process by SO_PEERCRED uid and pid; peers in another pid namespace, "
        "such as worker containers, share one per uid); past it 503 and closed.",
    )
    code_sockguard_head_timeout_s: float = Field(
        5.0,
        gt=0,
        le=300,
        description="The socket guard: seconds a request may take from its first byte to "
        "its last (head and body); a slower one is answered 408 and closed.",
    )
    code_sockguard_idle_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86400,
        description="The socket guard: seconds a client connection may sit with no request "
        "begun before it is closed (an attach stream or a call in progress is not idle).",
    )
    code_engine_refuse_vulnerable: bool = Field(
        False,
        description="Docker runtime: refuse to run (the runtime is not ready, naming the "
        "advisories) while the engine's runc, containerd or dockerd has a known container "
        "escape of executor/runtimes/docker/known_escapes.toml. Off: a vulnerable engine is a "
        "start-up WARNING and the studio_code_engine_vulnerable gauge, and runs go on.",
    )
    database_url: str = Field(
        "", description="Run store URL (SQLAlchemy). Empty: a SQLite file in STUDIO_DATA_DIR."
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis for the queue: redis://[:PASSWORD@]HOST:PORT/DB, or a Sentinel "
        "deployment as sentinel://[:PASSWORD@]HOST:PORT[/DB];sentinel://HOST2:PORT2... "
        "(PASSWORD: the master's; the master's name is STUDIO_REDIS_SENTINEL_MASTER).",
    )
    redis_sentinel_master: str = Field(
        "",
        validate_default=True,
        description="With a sentinel:// STUDIO_REDIS_URL: the name the sentinels monitor the "
        "master under (required then).",
    )
    redis_sentinel_password: SecretStr = Field(
        SecretStr(""),
        description="With a sentinel:// STUDIO_REDIS_URL: the password of the sentinels "
        "themselves (empty: none); the master's is in the URL.",
    )
    redis_dead_after_s: float = Field(
        10,
        ge=1,
        le=300,
        description="Seconds after which a silent Redis connection (no reply, no close: a "
        "failover behind a VIP, a NAT reset, a host that lost power) counts as dead and is "
        "dropped and made again, on every connection of workers, API and CLI; a worker whose "
        "consumer showed no round trip for this long is announced paused.",
    )
    redis_give_up_s: float = Field(
        120,
        ge=0,
        le=86400,
        description="A worker whose queue consumer showed no round trip for this long while "
        "Redis answers a fresh connection exits non-zero (its supervisor restarts it). "
        "0: never.",
    )
    queue_visibility_timeout_s: float = Field(
        0,
        ge=0,
        le=7 * 86400,
        description="Seconds a worker may hold a job's queue message before Redis gives it to "
        "another worker (a dead worker's jobs come back after this). Must be longer than "
        "STUDIO_CODE_MAX_SECONDS plus the kill grace. 0: 2 x STUDIO_CODE_MAX_SECONDS + 120.",
    )
    queue_test_slots: int = Field(
        1,
        ge=0,
        le=64,
        description="Worker processes kept for editor test calls (queue code.test) on top of "
        "the STUDIO_CODE_CONCURRENCY slots of workflow runs, so a test never waits behind runs.",
    )
    queue_reap_interval_s: float = Field(
        30,
        gt=0,
        le=3600,
        description="Seconds between a worker's sweeps for sandboxes of dead workers and jobs "
        "stuck running.",
    )
    code_subprocess_uids: str = Field(
        "200000-200999",
        description="Subprocess mode under a root server: the uids (FIRST-LAST) runs are "
        "given, one per concurrent run on the host (gid = the same number), so runs cannot "
        "read, signal or share process limits and files with each other. No account, group, "
        "nobody or the Docker sandboxes' uid may be in it.",
    )
    code_subprocess_cgroup: str = Field(
        "auto",
        description="Subprocess mode: where each run gets a cgroup (memory including /dev/shm "
        "and tmpfs pages, pids, one kill for all at the end). auto: under the server's own "
        "cgroup; a path such as /studio-code: a cgroup made for the server; off: none.",
    )
    code_subprocess_namespaces: str = Field(
        "auto",
        description="Subprocess mode under a non-root server: auto starts each run in a user, "
        "PID and mount namespace of its own (it cannot see, signal or trace the server or "
        "other runs, and the server's folders are covered in it) when the kernel allows "
        "unprivileged user namespaces; off: never.",
    )
    code_subprocess_landlock: str = Field(
        "auto",
        description="Subprocess mode: auto restricts each run with Landlock where the kernel "
        "offers it (Linux 5.13+): it may write only beneath its own temporary folder (not "
        "the run store, the data folder, secret.key or the server's home) and, from Landlock "
        "ABI 6, cannot signal processes outside its run; off: never.",
    )

    queue_require_worker: bool = Field(
        True,
        description="Refuse a submit at once (RUNTIME_UNAVAILABLE) when no live worker "
        "serves its queue. Off (0): the job is queued anyway and waits, bounded by "
        "STUDIO_QUEUE_RUN_MAX_WAIT_S / STUDIO_QUEUE_TEST_MAX_WAIT_S.",
    )
    queue_heartbeat_interval_s: float = Field(
        2.0,
        ge=0.2,
        le=60,
        description="Seconds between a worker's announcements of the queues it serves; an "
        "announcement lives 3 intervals + 1 s, so a dead worker stops counting after that.",
    )
    queue_run_max_wait_s: float = Field(
        1800,
        ge=0,
        le=7 * 86400,
        description="Longest a workflow run may wait in code.run before a worker takes it; "
        "then it ends failed (RUNTIME_UNAVAILABLE: no worker took it). 0: no bound.",
    )
    queue_test_max_wait_s: float = Field(
        60,
        ge=0,
        le=7 * 86400,
        description="Longest an editor test call may wait in code.test before a worker takes "
        "it; then it ends failed (RUNTIME_UNAVAILABLE: no worker took it). 0: no bound.",
    )
    queue_lost_after_s: float = Field(
        60,
        gt=0,
        le=86400,
        description="A job queued longer than this whose message is in no queue and held by "
        "no worker (lost: an API that died between the row and the message, a Redis crash) "
        "is sent again by a worker's sweep (claim keeps it exactly-once).",
    )
    queue_held_lost_after_s: float = Field(
        0,
        ge=0,
        le=86400,
        description="A job still queued whose message a worker took this long ago without "
        "claiming it (its worker lost it, e.g. with a Redis primary a Sentinel failover "
        "replaced) is sent again by the sweep. 0: the larger of STUDIO_QUEUE_LOST_AFTER_S and "
        "STUDIO_CODE_MAX_SECONDS + 40 (a live worker claims a message it took within one "
        "running job's end).",
    )

    code_retry: str = Field(
        "",
        description="The server's default retry policy of a node that sends none, as JSON "
        '(e.g. {"max_attempts": 2, "on": ["CODE_MEMORY"]}: executor.retry; only '
        "CODE_TIMEOUT, CODE_MEMORY and CODE_ERROR may be retried). Empty: off, one attempt; "
        "a submit's own retry (max_attempts 1 included) wins.",
    )
    queue_retry_tick_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description="Seconds between a worker's looks for retries whose delay has passed "
        "(it sends their next attempt; one indexed SELECT of queued rows each time).",
    )

    worker_group: str = Field(
        "default",
        description="The group this worker serves (studio-code worker --group): default "
        "takes code.run and code.test; any other group takes code.run.NAME and "
        "code.test.NAME. What one of its slots holds is its STUDIO_CODE_MAX_MEMORY and "
        "STUDIO_CODE_MAX_CPUS, announced with it.",
    )
    worker_groups: str = Field(
        "",
        description="The worker groups beyond default the API sends jobs to, each "
        "NAME:MEMORY:CPUS (what one slot of the group holds), comma-separated, e.g. "
        "big:4g:4. A job asking more than the default group holds (STUDIO_CODE_MAX_MEMORY, "
        "_MAX_CPUS) goes to the smallest group that holds it. Empty: the default group only.",
    )
    queue_run_fairness: Literal["users", "off"] = Field(
        "users",
        description="How code.run is shared between users. users: each user's runs wait on "
        "their own list and are released into code.run in turns (one user's flood never "
        "holds another user's run behind it; a user alone gets every slot). off: one FIFO "
        "queue for everyone. Set the same on the API and the workers.",
    )
    queue_run_user_slots: int = Field(
        0,
        ge=0,
        le=100_000,
        description="With STUDIO_QUEUE_RUN_FAIRNESS=users: most workflow runs of one user "
        "released to the workers at once (running or about to); more wait, not refused, "
        "until one of theirs ends. 0: no cap beyond fairness.",
    )
    queue_run_share_key: Literal["user", "tenant", "tenant/user"] = Field(
        "user",
        description="With STUDIO_QUEUE_RUN_FAIRNESS=users: what takes turns in code.run. "
        "user: each user; tenant: each tenant (a run's ``tenant`` in the submit); "
        "tenant/user: each user of each tenant. A run that names no tenant takes its "
        "user's turns. Set the same on the API and the workers.",
    )
    queue_run_tenant_slots: int = Field(
        0,
        ge=0,
        le=100_000,
        description="With STUDIO_QUEUE_RUN_FAIRNESS=users: most workflow runs of one tenant "
        "(the submit's ``tenant``) released to the workers at once; more wait, in order, "
        "not refused, until one of the tenant's ends. 0: no cap.",
    )
    queue_run_workflow_slots: int = Field(
        0,
        ge=0,
        le=100_000,
        description="With STUDIO_QUEUE_RUN_FAIRNESS=users: most runs of one workflow (the "
        "submit's ``workflow``, within its tenant) released to the workers at once; more "
        "wait, in order, not refused, until one of the workflow's ends. 0: no cap.",
    )

    code_test_in_flight: int = Field(
        5,
        ge=1,
        le=1000,
        description="Editor test calls one user may have waiting for their result at once "
        "(counted in Redis, across API processes); one more answers 429 RATE_LIMITED.",
    )
    api_token: SecretStr = Field(
        SecretStr(""),
        description="Shared secret between the studio and this API: every route but "
        "/healthz/live then needs 'Authorization: Bearer <token>'. Required to serve on a "
        "non-loopback address. At least 16 characters (e.g. `openssl rand -hex 32`).",
    )
    api_token_file: str = Field(
        "",
        description="A file holding STUDIO_API_TOKEN (a Compose or Kubernetes secret); "
        "used when STUDIO_API_TOKEN is empty.",
    )
    api_allowed_hosts: str = Field(
        "",
        description="Comma-separated Host names the API answers besides the loopback names "
        "(localhost, 127.0.0.1, ::1) and the address it binds; any other Host is 400 (DNS "
        "rebinding). '*' turns the check off (only behind a proxy that checks Host).",
    )
    api_body_max_bytes: int = Field(
        0,
        ge=0,
        description="Largest request body of POST /api/runs and /api/code/test (413 beyond). "
        "0: STUDIO_CODE_STATE_MAX_BYTES + 8 MiB (room for the code). Other routes have "
        "smaller caps of their own.",
    )
    api_json_max_depth: int = Field(
        64,
        ge=2,
        le=500,
        description="Deepest nesting of arrays and objects a JSON request body may have "
        "(400 beyond), checked before the body is parsed.",
    )
    api_header_max_bytes: int = Field(
        16 * 1024,
        ge=1024,
        le=1024 * 1024,
        description="Largest request header line (name and value) the API takes (431 "
        "beyond, before anything else is read).",
    )
    api_head_max_bytes: int = Field(
        64 * 1024,
        ge=4 * 1024,
        le=4 * 1024 * 1024,
        description="Largest request head (request line and every header) the API takes "
        "(431 beyond); studio-code serve closes a connection whose head grows past it "
        "before the head is even complete.",
    )

    runs_keep_days: float = Field(
        30,
        ge=0,
        le=36500,
        description="Days a finished run stays in the run store (then the worker's janitor "
        "deletes it, in small batches); 0 keeps runs forever.",
    )
    runs_payload_keep_days: float = Field(
        7,
        ge=0,
        le=36500,
        description="Days a finished run keeps its code, state, output and logs (then they "
        "are cleared; status, error, timings and trace stay until STUDIO_RUNS_KEEP_DAYS); 0 "
        "keeps them as long as the run.",
    )
    retention_batch_rows: int = Field(
        500,
        ge=10,
        le=100_000,
        description="Rows the janitor deletes or clears per transaction (at most 20 "
        "transactions per sweep), so a retention pass never holds the store for long.",
    )
    idempotency_ttl_s: float = Field(
        86400,
        ge=60,
        le=30 * 86400,
        description="Seconds an Idempotency-Key of a submit (POST /api/runs, POST "
        "/api/code/test, CodeClient.submit's idempotency_key, studio-code submit "
        "--idempotency-key) names its first job: a repeat within them gets that job, never a "
        "second; after them the key is free again (and retention removes it).",
    )
    queue_store_start_wait_s: float = Field(
        300,
        ge=0,
        le=86400,
        description="Seconds a worker whose run store cannot be opened when it starts waits "
        "for it, paused (readiness 503 naming the store); then it stops with an error for its "
        "supervisor to restart it (0: wait for ever). A store that goes down later pauses the "
        "worker for as long as it is down.",
    )
    queue_pool_start_timeout_s: float = Field(
        120,
        gt=0,
        le=3600,
        description="Seconds a worker's pool process may take to start (open the run store, "
        "connect the runtime, pre-start its sandboxes). A worker takes no job and is not "
        "announced until its pool processes have started; one still starting after this long "
        "stops the worker with an error for its supervisor to restart it. A pool process that "
        "replaces another later is killed and started again after this long (Celery's "
        "worker_proc_alive_timeout).",
    )
    queue_probe_interval_s: float = Field(
        5,
        gt=0,
        le=600,
        description="Seconds between a worker's checks that its run store takes writes and its "
        "runtime can run nodes (every second while it is paused for either).",
    )
    queue_pending_ttl_s: int = Field(
        7 * 86400,
        ge=60,
        description="Seconds a result computed while the run store was down is kept in Redis "
        "(studio:pending:<job id>) to be written when the store is back: store outages shorter "
        "than this lose no result.",
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of a worker's /metrics and /healthz (served by its main process); "
        "0: off.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address a worker's metrics server binds (0.0.0.0 under "
        "Compose, so Prometheus can reach it).",
    )
    metrics_ready_interval_s: float = Field(
        30.0,
        ge=0,
        description="Seconds between a worker's language readiness probes "
        "(studio_code_language_ready); 0: no probes.",
    )

    @field_validator("code_memory")
    @classmethod
    def _memory(cls, v: str) -> str:
        try:
            size = parse_size(v)
        except ValueError:
            raise ValueError("a size such as 256m (a number with b, k, m or g)") from None
        if size < MIN_MEMORY_BYTES:
            raise ValueError(f"at least {_MIN_MEMORY} (Deno and Python need that much to start)")
        return v

    @field_validator("code_retry")
    @classmethod
    def _retry(cls, v: str) -> str:
        if not v.strip():
            return v
        from executor.retry import parse_policy

        try:
            parse_policy(v)
        except CodeInvalid as e:
            raise ValueError(f"STUDIO_CODE_RETRY: {e.message}") from None
        return v

    @property
    def retry_policy(self) -> RetryPolicy | None:
        """STUDIO_CODE_RETRY as a policy (None: off)."""
        from executor.retry import parse_policy

        return parse_policy(self.code_retry)

    @field_validator("code_max_memory")
    @classmethod
    def _max_memory(cls, v: str) -> str:
        if v.strip():
            try:
                size = parse_size(v)
            except ValueError:
                raise ValueError(
                    "a size such as 1g (a number with b, k, m or g), or empty "
                    "for STUDIO_CODE_MEMORY"
                ) from None
            if size < MIN_MEMORY_BYTES:
                raise ValueError(
                    f"a size of at least {_MIN_MEMORY} (Deno and Python need that much to "
                    "start), or empty for STUDIO_CODE_MEMORY"
                )
        return v.strip()

    @field_validator("code_cpus")
    @classmethod
    def _cpus(cls, v: float) -> float:
        if not v >= MIN_CPUS:
            raise ValueError(_CPUS_FLOOR)
        return v

    @field_validator("code_max_cpus")
    @classmethod
    def _max_cpus(cls, v: float) -> float:
        if v != 0 and not v >= MIN_CPUS:
            raise ValueError(_CPUS_FLOOR + ", or 0 for STUDIO_CODE_CPUS")
        return v

    @field_validator("worker_group")
    @classmethod
    def _worker_group(cls, v: str) -> str:
        from executor.groups import check_name

        return check_name(v.strip())

    @field_validator("worker_groups")
    @classmethod
    def _worker_groups(cls, v: str) -> str:
        from executor.groups import parse_groups

        parse_groups(v)
        return v.strip()

    @field_validator("code_languages")
    @classmethod
    def _languages(cls, v: str) -> str:
        langs = [x.strip() for x in v.split(",") if x.strip()]
        bad = [x for x in langs if x not in KNOWN_LANGUAGES]
        if bad:
            raise ValueError(f"a comma-separated list of {', '.join(KNOWN_LANGUAGES)}")
        return ",".join(langs)

    @field_validator("code_preimport")
    @classmethod
    def _preimport(cls, v: str) -> str:
        return parse_preimport(v)  # its ValueError names the entry and the form to use

    @field_validator("code_ts_packages")
    @classmethod
    def _ts_packages(cls, v: str) -> str:
        if v.strip().lower() == "none":  # an empty value means the default list
            return ""
        parse_packages(v)  # its ValueError already names the entry and the form to use
        return v

    @field_validator("code_subprocess_uids")
    @classmethod
    def _subprocess_uids(cls, v: str, info: ValidationInfo) -> str:
        ids = parse_uid_range(v)  # its ValueError says what is allowed
        if info.data.get("code_runtime") == "subprocess" and os.getuid() == 0:
            problem = uid_range_problem(ids, {0, NOBODY, *sandbox_ids()})
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("code_subprocess_cgroup")
    @classmethod
    def _subprocess_cgroup(cls, v: str) -> str:
        if v in ("auto", "off") or (v.startswith("/") and ".." not in v.split("/")):
            return v
        raise ValueError("auto, off, or an absolute cgroup path such as /studio-code")

    @field_validator("code_usage_cgroup_parent")
    @classmethod
    def _usage_cgroup_parent(cls, v: str) -> str:
        if CGROUP_PARENT_SHAPE.fullmatch(v):
            return v
        raise ValueError(
            "the engine's cgroup parent as an absolute path below the root, such as /docker "
            "(names of letters, digits, '_', '.' and '-', none starting with '.'; no '..', "
            "no trailing '/')"
        )

    @field_validator("code_subprocess_namespaces", "code_subprocess_landlock")
    @classmethod
    def _subprocess_namespaces(cls, v: str) -> str:
        if v in ("auto", "off"):
            return v
        raise ValueError("auto or off")

    @field_validator("redis_sentinel_master")
    @classmethod
    def _sentinel_master(cls, v: str, info: ValidationInfo) -> str:
        url = str(info.data.get("redis_url") or "")
        if url.startswith("sentinel://") and not v.strip():
            raise ValueError(
                "the name the sentinels monitor the master under (their `sentinel monitor "
                "NAME ...`): STUDIO_REDIS_URL is a sentinel:// URL"
            )
        return v.strip()

    @field_validator("api_token")
    @classmethod
    def _api_token(cls, v: SecretStr) -> SecretStr:
        token = v.get_secret_value()
        if token and (len(token) < API_TOKEN_MIN_CHARS or token != token.strip()):
            raise ValueError(
                f"a secret of at least {API_TOKEN_MIN_CHARS} characters with no "
                "surrounding spaces (e.g. `openssl rand -hex 32`)"
            )
        return v

    @field_validator("api_token_file")
    @classmethod
    def _api_token_file(cls, v: str) -> str:
        if v:
            try:
                token = Path(v).read_text().strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"a readable file holding the token ({e})") from None
            if len(token) < API_TOKEN_MIN_CHARS:
                raise ValueError(
                    f"a file holding a secret of at least {API_TOKEN_MIN_CHARS} "
                    "characters (e.g. `openssl rand -hex 32 > FILE`)"
                )
        return v

    # --- derived values -------------------------------------------------------------

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.code_memory)

    @property
    def max_memory_bytes(self) -> int:
        """The most memory a node may ask for (never below STUDIO_CODE_MEMORY)."""
        cap = parse_size(self.code_max_memory) if self.code_max_memory else 0
        return max(cap, self.memory_bytes)

    @property
    def max_cpus(self) -> float:
        """The most CPU share a node may ask for (never below STUDIO_CODE_CPUS)."""
        return max(self.code_max_cpus, self.code_cpus)

    @property
    def runtime_known(self) -> bool:
        return self.code_runtime in KNOWN_RUNTIMES

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(x for x in self.code_languages.split(",") if x)

    @property
    def python_packages(self) -> tuple[str, ...]:
        return tuple(x.strip() for x in self.code_packages.split(",") if x.strip())

    @cached_property
    def ts_packages(self) -> tuple[PackageSpec, ...]:
        """Allowed TypeScript packages. In subprocess mode with neither
        STUDIO_CODE_TS_DENO_DIR nor STUDIO_CODE_TS_PACKAGES set, none is allowed: there is
        no image cache, so nothing could be imported anyway."""
        if (
            self.code_runtime == "subprocess"
            and not self.code_ts_deno_dir
            and "code_ts_packages" not in self.model_fields_set
        ):
            return ()
        return parse_packages(self.code_ts_packages)

    @property
    def python_interpreter(self) -> str:
        if self.python:
            return self.python
        if os.getuid() == 0 and os.path.exists("/usr/bin/python3"):
            return "/usr/bin/python3"
        return sys.executable

    @cached_property
    def api_token_bytes(self) -> bytes:
        """The shared secret in force (STUDIO_API_TOKEN, else STUDIO_API_TOKEN_FILE's
        content), b"" when none is set."""
        token = self.api_token.get_secret_value()
        if not token and self.api_token_file:
            token = Path(self.api_token_file).read_text().strip()
        return token.encode()

    @property
    def allowed_hosts(self) -> tuple[str, ...]:
        return tuple(
            x.strip().lower().rstrip(".") for x in self.api_allowed_hosts.split(",") if x.strip()
        )

    @property
    def run_body_max_bytes(self) -> int:
        """The body cap of the routes that carry a state."""
        if self.api_body_max_bytes:
            return self.api_body_max_bytes
        return self.code_state_max_bytes + 8 * 1024 * 1024

    @property
    def subprocess_uids(self) -> range:
        return parse_uid_range(self.code_subprocess_uids)

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.data_dir / 'studio-code.db').resolve()}"


def default_data_dir() -> Path:
    """Where the SQLite run store lives when STUDIO_DATA_DIR is unset: /var/lib/studio-code
    for root, else $XDG_DATA_HOME/studio-code (default ~/.local/share/studio-code). It
    does not depend on the current folder."""
    if os.getuid() == 0:
        return Path("/var/lib/studio-code")
    xdg = os.environ.get("XDG_DATA_HOME", "").strip()
    if xdg and Path(xdg).is_absolute():
        return Path(xdg) / "studio-code"
    try:
        home = Path.home()
    except (RuntimeError, KeyError):  # no HOME and no passwd entry (a bare container uid)
        return Path(f"/var/tmp/studio-code-{os.getuid()}")
    return home / ".local" / "share" / "studio-code"


def sandbox_ids() -> tuple[int, int]:
    """The uid:gid sandboxes run as: the server's own, or nobody when the server is root."""
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        return NOBODY, NOBODY
    return uid, gid


#: STUDIO_* variables read by something other than Settings: the image build
#: (docker/build.sh) and the test suite (tests/conftest.py). Not misspellings.
OTHER_VARIABLES = frozenset(
    {
        "STUDIO_BUILD_NETWORK",
        "STUDIO_BUILD_CA_FILE",
        "STUDIO_DEBIAN_MIRROR",
        "STUDIO_DEBIAN_SUITE",
        "STUDIO_PULL_TIMEOUT",
        "STUDIO_PY_BASE",
        "STUDIO_TS_BASE",
        "STUDIO_TEST_THROUGH_SOCKGUARD",
    }
)
_warned: set[str] = set()


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """A sentence for each STUDIO_* variable in ``environ`` that nothing reads (a misspelled
    setting is otherwise silently ignored), naming the closest known variable."""
    known = {f"STUDIO_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    sentences = []
    for name in sorted(environ):
        if not name.startswith("STUDIO_") or name in known:
            continue
        import difflib  # only for a misspelling

        # compared without the common prefix, which would make every name look close
        close = difflib.get_close_matches(name[7:], sorted(k[7:] for k in known), n=1, cutoff=0.7)
        hint = (
            f"did you mean STUDIO_{close[0]}?"
            if close
            else "see the configuration table in the README for the variables there are."
        )
        sentences.append(f"{name} is not a studio-code setting and is ignored: {hint}")
    return sentences


def _env_name(loc: tuple[Any, ...]) -> str:
    return "STUDIO_" + str(loc[0]).upper() if loc else "STUDIO_*"


def load_settings(**overrides: Any) -> Settings:
    """Read STUDIO_* from the environment (overrides win); raise SettingsError on a bad value.
    Warns (once per process and name) about a STUDIO_* variable that nothing reads."""
    for sentence in unknown_variables(os.environ):
        if sentence not in _warned:
            _warned.add(sentence)
            log.warning("%s", sentence)
    try:
        return Settings(**overrides)
    except ValidationError as e:
        sentences = []
        for err in e.errors():
            name = _env_name(err["loc"])
            value = err.get("input")
            field = Settings.model_fields.get(str(err["loc"][0])) if err["loc"] else None
            if field is not None and field.annotation is SecretStr:
                value = "<hidden>"  # a secret never goes into a log line
            custom = str(err.get("ctx", {}).get("error", ""))
            if custom:
                sentences.append(f"{name}={value!r} is not valid: use {custom}.")
            else:
                meaning = f" ({field.description})" if field and field.description else ""
                sentences.append(f"{name}={value!r} is not valid: {err['msg'].lower()}{meaning}.")
        raise SettingsError(" ".join(sentences)) from e
