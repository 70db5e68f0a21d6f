"""The subprocess runtime: the code runs as a child of the server. THIS IS NOT A SANDBOX.

The child gets an empty environment, its own temporary folder (removed afterwards), its own
session, and on Linux rlimits on memory, CPU time, open files, file size and processes.
The time limit kills the whole process group.

Under a root server the runs are also kept from each other (``isolation`` says what holds
on this host, and meta and the start-up warning repeat it):

- each concurrent run gets its own uid and gid from STUDIO_CODE_SUBPROCESS_UIDS
  (``uids.UidPool``), never nobody and never the Docker sandboxes' uid, with no
  supplementary group and ``no_new_privs``: RLIMIT_NPROC, ``/proc/<pid>/mem`` and
  ``environ``, signals and files are per run;
- a cgroup per run (``cgroups``) caps memory, ``/dev/shm`` and tmpfs pages included, and
  processes; the child joins it before exec;
- the end of the run kills everything in that cgroup and every process of its uid (a
  grandchild that called ``setsid()`` too), then removes what the uid left in ``/tmp``,
  ``/var/tmp``, ``/dev/shm`` (``uids.remove_owned_files``), then the cgroup.

Under a non-root server (``namespaces``) the server is not dumpable, so a run cannot read
its ``/proc`` files, and where the kernel allows unprivileged user namespaces
(STUDIO_CODE_SUBPROCESS_NAMESPACES=auto) each run starts in a user, PID and mount namespace
of its own: it cannot see, signal or trace the server, its other children or other runs,
and the end of the run kills everything it started.

Root or not, where the kernel offers Landlock (STUDIO_CODE_SUBPROCESS_LANDLOCK=auto,
``landlock``) each run may write only beneath its own temporary folder (and /dev/null), and
cannot trace processes outside its run nor (Landlock ABI >= 6) signal them.

Root or not (a non-root server: where its runs have namespaces), the server's own folders
(the data folder, the run store's, its home, the token file's) are covered in the run's
mount namespace (``fence``): the run cannot read, stat, chmod, lock or otherwise name
anything in them, which Landlock (writes only) does not give. And a seccomp filter refuses
the kernel keyrings (``seccomp``), which outlive a run and would pass keys to the next run
of the same uid.

It can still use the network and read any other file its uid can read.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from typing import IO, Any

from executor.audit import SUBPROCESS_RUNTIME_USED
from executor.errors import RuntimeUnavailable
from executor.languages.base import Language
from executor.models import CodeJob, Limits, RawRun
from executor.runtimes.base import (
    LOG_TAP,
    POLL_S,
    BoundedBuffer,
    CancelCheck,
    MetaSection,
    PoolObserver,
    ProbeRun,
    Runtime,
)
from executor.runtimes.subprocess import fence, landlock, namespaces, seccomp, usage
from executor.runtimes.subprocess.cgroups import CgroupError, CgroupParent, RunCgroup, find_parent
from executor.runtimes.subprocess.prestarted import Runner, RunnerPool
from executor.runtimes.subprocess.uids import (
    SWEPT_DIRS,
    UidLease,
    UidPool,
    kill_uid,
    remove_owned_files,
    remove_owned_ipc,
)
from executor.settings import Settings, sandbox_ids

log = logging.getLogger("studio_code")

NOFILE = 256
FSIZE_BYTES = 64 * 1024 * 1024  # as much as the container's /tmp holds
RSS_POLL_S = 0.02
#: how long a killed run in namespaces waits for its init (the kernel empties the namespace
#: as init exits: microseconds, but a loaded host may take longer)
INIT_EXIT_WAIT_S = 5.0
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

RUN_WARNING = (
    "Runs on host: this node ran as a child process of the server (STUDIO_CODE_RUNTIME="
    "subprocess), not in a sandbox."
)


def rlimits(limits: Limits, *, address_space: bool = True) -> dict[int, tuple[int, int]]:
    """The whole resource policy of a child, on one screen."""
    cpu_s = math.ceil(limits.timeout_s) + 1
    policy = {
        resource.RLIMIT_CPU: (cpu_s, cpu_s + 1),
        resource.RLIMIT_NOFILE: (NOFILE, NOFILE),
        resource.RLIMIT_FSIZE: (FSIZE_BYTES, FSIZE_BYTES),
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NPROC: (limits.pids, limits.pids),
    }
    if address_space:  # V8 reserves far more address space than it uses: see _wait's watch
        policy[resource.RLIMIT_AS] = (limits.memory_bytes, limits.memory_bytes)
    return policy


class SubprocessRuntime(Runtime):
    """Runs each call as an rlimited child process in its own session; under a root server
    with its own uid and, where one can be made, its own cgroup."""

    name = "subprocess"
    isolated = False
    warnings: tuple[str, ...] = ()  # set per instance: startup_warning, what holds here
    run_warnings = (RUN_WARNING,)
    audit_event = SUBPROCESS_RUNTIME_USED

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        linux = sys.platform.startswith("linux")
        self._uids = UidPool(settings.subprocess_uids) if linux and os.getuid() == 0 else None
        self._cgroups: CgroupParent | None = None
        self._cgroup_note = "not Linux"
        if linux:
            self._cgroups, self._cgroup_note = find_parent(settings.code_subprocess_cgroup)
        self._seq = 0
        self.pool: RunnerPool | None = None
        # before the first run, in every process that starts runs (a Celery pool process
        # inherits it from the worker's main process, and sets it again here)
        undumpable = namespaces.make_undumpable()
        self._namespaces_note = _namespaces_note(settings)
        self._namespaces = self._namespaces_note is None
        self._landlock_abi, self._landlock_note = _landlock(settings)
        self._keyrings, self._keyrings_note = _keyring_filter()
        self._needed: dict[str, list[str]] = {}  # argv[0] -> what runs read beneath covers
        self._covers, self._cover_note = _covers(
            settings, root=self._uids is not None, in_namespaces=self._namespaces
        )
        self.isolation = isolation_report(
            settings,
            self._uids,
            self._cgroups,
            self._cgroup_note,
            namespaces_note=self._namespaces_note,
            undumpable=undumpable,
            landlock_abi=self._landlock_abi if self._landlock_note is None else 0,
            landlock_note=self._landlock_note,
            covers=self._covers,
            cover_note=self._cover_note,
            keyrings_note=self._keyrings_note,
        )
        self.warnings = (startup_warning(self.isolation),)
        log.warning(isolation_warning(self.isolation))

    def meta_section(self, posture: object, *, fresh: bool, probe: ProbeRun) -> MetaSection:
        """What holds runs apart (``isolation``, and it in a sentence among the warnings),
        and whose uid a run gets under a root server."""
        return MetaSection(
            warnings=(isolation_warning(self.isolation),),
            root_note=(
                "The server runs as root, so each subprocess run gets its own uid and gid "
                f"from STUDIO_CODE_SUBPROCESS_UIDS={self.settings.code_subprocess_uids}."
            ),
            isolation=self.isolation,
        )

    def unavailable_reason(self, language: Language) -> str | None:
        binary = language.command(self.settings, _PROBE_LIMITS, in_container=False)[0]
        if shutil.which(binary) is None:
            return f"{binary} is not installed or not on PATH for the server user."
        return None  # off Linux it runs, but without the memory limit: meta's warning says so

    # --- pre-started runners (STUDIO_CODE_PREWARM: see subprocess/prestarted.py) ---------

    def prepare(
        self, languages: list[Language], limits: Limits, observe: PoolObserver | None = None
    ) -> None:
        linux = sys.platform.startswith("linux")
        if self.settings.code_prewarm > 0 and languages and linux and self.pool is None:
            self.pool = RunnerPool(
                self._start,
                self._discard,
                self._key,
                languages,
                limits,
                self.settings.code_prewarm,
                self.settings.code_prewarm_max_idle_s,
                observe,
            )
            self.pool.start()

    def close(self) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close()

    def on_path(self) -> AbstractContextManager[None]:
        return self.pool.on_path() if self.pool is not None else nullcontext()

    def pool_stats(self) -> dict[str, Any] | None:
        return self.pool.stats() if self.pool is not None else None

    # --- one run ----------------------------------------------------------------------------

    def run(
        self,
        job: CodeJob,
        language: Language,
        limits: Limits,
        *,
        should_cancel: CancelCheck | None = None,
    ) -> RawRun:
        t0 = time.monotonic()
        pool = self.pool
        with pool.on_path() if pool is not None else nullcontext():
            runner = None
            if pool is not None:
                runner = pool.take(language, limits, _cpu_s(limits), should_cancel)
            if runner is None:
                runner = self._start(language, limits, prestart=False)
            return self._serve(runner, job, language, limits, should_cancel, t0)

    def _key(self, language: Language, limits: Limits) -> tuple[Any, ...]:
        """What a job must match to use a pre-started runner: everything its start used
        (the rlimits but RLIMIT_CPU, set at hand-out; the cgroup's caps; argv)."""
        argv = language.command(self.settings, limits, in_container=False)
        return (language.name, tuple(argv), limits.memory_bytes, limits.pids)

    def _start(self, language: Language, limits: Limits, *, prestart: bool = True) -> Runner:
        """Start ``language``'s runner under ``limits`` with everything it holds: its uid
        lease, cgroup and workdir. ``prestart``: its RLIMIT_CPU hard limit stays open, to be
        set at hand-out (``Runner.hand_out``)."""
        lease = self._uids.acquire() if self._uids is not None else None
        try:
            return self._start_leased(language, limits, lease, prestart)
        except BaseException:
            if lease is not None:
                lease.release()
            raise

    def _start_leased(
        self, language: Language, limits: Limits, lease: UidLease | None, prestart: bool
    ) -> Runner:
        if lease is not None and lease.was_dirty:
            # the last holder of this uid died mid-run: what it left goes first
            kill_uid(lease.uid, lease.gid)
            remove_owned_files(lease.uid)
            remove_owned_ipc(lease.uid)
        group = self._make_cgroup(lease, limits)
        ids = (lease.uid, lease.gid) if lease is not None else None
        linux = sys.platform.startswith("linux")
        shared_ids = sandbox_ids() if not linux and os.getuid() == 0 else None
        workdir = tempfile.mkdtemp(prefix="studio-code-")
        owner = ids or shared_ids
        if owner is not None:
            os.chown(workdir, *owner)
        address_space = language.name != "typescript"
        policy = rlimits(limits, address_space=address_space)
        if prestart:  # the soft limit bounds the wait; the hand-out sets both
            policy[resource.RLIMIT_CPU] = (policy[resource.RLIMIT_CPU][0], resource.RLIM_INFINITY)
        argv = language.command(self.settings, limits, in_container=False)
        env = language.environment(self.settings, in_container=False)
        ruleset = None
        try:
            if linux and self._landlock_note is None:  # made here: the child only enters it
                ruleset = landlock.ruleset(self._landlock_abi, workdir)
            cover = self._plan(argv, workdir)
            setup = None
            if linux:
                setup = _child_setup(
                    policy, group, ids, self._namespaces, ruleset, cover, self._keyrings
                )
            child = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                close_fds=True,
                preexec_fn=setup,
                # not Linux: no uid of its own, but never root (nobody, as before)
                user=shared_ids[0] if shared_ids else None,
                group=shared_ids[1] if shared_ids else None,
                extra_groups=[] if shared_ids else None,
            )
        except (OSError, subprocess.SubprocessError) as e:
            shutil.rmtree(workdir, ignore_errors=True)
            self._end(group, lease)
            raise RuntimeUnavailable(f"Could not start {argv[0]}: {e}.") from e
        finally:
            if ruleset is not None:
                os.close(ruleset)
        key = self._key(language, limits)
        return Runner(child, lease, group, workdir, key, self._namespaces, prestarted=prestart)

    def _plan(self, argv: list[str], workdir: str) -> fence.Plan | None:
        """The covers of a run of ``argv`` in ``workdir`` (``fence``), None without."""
        if self._cover_note is not None:
            return None
        needed = self._needed.get(argv[0])
        if needed is None:
            needed = self._needed[argv[0]] = fence.needed_paths(self.settings, [argv])
        return fence.Plan.make(list(self._covers.values()), needed, workdir)

    def _serve(
        self,
        runner: Runner,
        job: CodeJob,
        language: Language,
        limits: Limits,
        should_cancel: CancelCheck | None,
        t0: float,
    ) -> RawRun:
        """Give ``job`` to ``runner`` (its one job), wait for its end, end it whole."""
        child = runner.child
        with self._lock:
            self._children[job.job_id] = child
        base = usage.hand_over(runner, on=self.settings.code_usage)
        started = time.monotonic()  # the time limit counts from here (a hand-out too)
        out = BoundedBuffer(limits.output_max_bytes + 4096)
        logs = BoundedBuffer(limits.log_max_bytes, tap=LOG_TAP.get())  # live logs
        assert child.stdin and child.stdout and child.stderr
        threads = [
            threading.Thread(target=_feed, args=(child.stdin, language.stdin_payload(job))),
            threading.Thread(target=_drain, args=(child.stdout, out)),
            threading.Thread(target=_drain, args=(child.stderr, logs)),
        ]
        for t in threads:
            t.daemon = True
            t.start()
        ending = "eof"
        try:
            rss_cap = None if language.name != "typescript" else limits.memory_bytes
            ending = _wait(
                child, started + limits.timeout_s, should_cancel, rss_cap, self._namespaces
            )
        finally:
            exit_code = self._kill(runner)
            for t in threads:
                t.join(timeout=2)
            with self._lock:
                self._children.pop(job.job_id, None)
            # before its cgroup goes
            used = usage.measure(child, runner.group, base, on=self.settings.code_usage)
            oom_kills = self._release(runner)
        if oom_kills and ending == "eof":
            ending = "memory"  # the cgroup's limit (e.g. pages written to /dev/shm)
        if ending == "eof" and exit_code == -signal.SIGKILL and should_cancel is not None:
            ending = "cancel" if should_cancel() else ending  # killed by kill() elsewhere
        # RLIMIT_CPU's SIGXCPU is the backstop of the wall-clock deadline: also a timeout.
        cpu_limit = ending == "eof" and exit_code == -signal.SIGXCPU
        return RawRun(
            exit_code=exit_code,
            stdout=out.getvalue(),
            stdout_truncated=out.truncated,
            logs=logs.getvalue(),
            logs_total=logs.total,
            timed_out=ending == "deadline" or cpu_limit,
            oom_killed=ending == "memory",
            cancelled=ending == "cancel",
            pooled=runner.prestarted,
            start_ms=(started - t0) * 1000,
            run_ms=(time.monotonic() - started) * 1000,
            usage=used,
        )

    def _kill(self, runner: Runner) -> int:
        """Whatever the runner started dies with it, in its session, its cgroup (a setsid()
        grandchild too) and under its uid; returns its exit status. In namespaces, a run
        killed before it ended returns once its namespace is empty: the relay dies at once,
        its init a moment later, and only then does the kernel kill what is left in it."""
        init = None
        if runner.in_namespaces and not usage.exited(runner.child):
            init = namespaces.open_init(runner.child.pid)
        _kill_group(runner.child.pid)
        emptied = runner.group.kill_all() if runner.group is not None else False
        if runner.lease is not None and not emptied:
            # With an emptied cgroup this is not needed: the leased uid had no process
            # before the child, which joined the group before exec, and no process can
            # leave a group whose files only root may write.
            kill_uid(runner.lease.uid, runner.lease.gid)
        status = usage.reap(runner.child)  # with its rusage (the run's CPU)
        if init is not None:
            namespaces.wait_closed(init, INIT_EXIT_WAIT_S)
        return status

    def _release(self, runner: Runner) -> int:
        """After ``_kill``: its workdir, files, cgroup and uid lease go; returns the cgroup's
        OOM kills."""
        try:
            shutil.rmtree(runner.workdir, ignore_errors=True)
            oom_kills = runner.group.oom_kills() if runner.group is not None else 0
            self._end(runner.group, runner.lease)
        finally:
            if runner.lease is not None:
                runner.lease.release()
        return oom_kills

    def _discard(self, runner: Runner) -> None:
        """End a runner that never got a job (closing, idle too long, died waiting)."""
        self._kill(runner)
        for pipe in (runner.child.stdin, runner.child.stdout, runner.child.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass
        self._release(runner)

    def _make_cgroup(self, lease: UidLease | None, limits: Limits) -> RunCgroup | None:
        if self._cgroups is None:
            return None
        with self._lock:
            self._seq += 1
            seq = self._seq
        # a leased uid is this run's alone on the host, so it names the group (and a dead
        # run's group of the same uid is found and emptied by the next holder)
        name = f"uid-{lease.uid}" if lease is not None else f"run-{os.getpid()}-{seq}"
        try:
            return self._cgroups.create(name, limits.memory_bytes, limits.pids)
        except CgroupError as e:
            log.warning(
                "subprocess run without a cgroup (%s): memory in /dev/shm and tmpfs "
                "is not counted, and only its session and uid are killed at the end",
                e,
            )
            return None

    def _end(self, group: RunCgroup | None, lease: UidLease | None) -> None:
        """After the run: no process of it is left; its files go, then its cgroup (pages
        in /dev/shm stay charged to the group until the files are gone)."""
        if lease is not None:
            remove_owned_files(lease.uid)
            remove_owned_ipc(lease.uid)
        if group is not None and not group.remove():
            log.warning(
                "could not remove the run cgroup %s (the next run of the same uid removes it)",
                group.dirs,
            )

    def kill(self, job_id: str) -> bool:
        with self._lock:
            child = self._children.get(job_id)
        if child is None:
            return False
        _kill_group(child.pid)
        return True


def isolation_report(
    settings: Settings,
    uids: UidPool | None,
    cgroups: CgroupParent | None,
    cgroup_note: str,
    *,
    namespaces_note: str | None = "not asked for",
    undumpable: bool = False,
    landlock_abi: int = 0,
    landlock_note: str | None = "not asked for",
    covers: dict[str, str] | None = None,
    cover_note: str | None = "not asked for",
    keyrings_note: str | None = "not asked for",
) -> dict[str, Any]:
    """What keeps subprocess runs apart on this host, and what does not: meta's
    ``subprocess_isolation`` and the start-up warning. ``namespaces_note`` is None when
    each run gets namespaces of its own, else why not; ``undumpable``: the server is not
    dumpable; ``landlock_note`` is None when each run enters a Landlock ruleset of ABI
    ``landlock_abi``, else why not; ``cover_note`` is None when each run gets ``covers``
    (name -> folder) covered (``fence``), else why not; ``keyrings_note`` is None when each
    run's seccomp filter refuses the kernel keyrings, else why not.

    ``run_can`` sums it up from what was applied, one flag per claim: ``read`` files outside
    its own folder that its uid may read; ``write`` (create, change, truncate, remove) files
    outside its own folder that its uid may write; ``signal`` a process outside its run;
    ``see`` the processes outside its run in /proc; ``server_files`` name (open, stat,
    chmod, lock...) the server's own folders and the files in them; ``keyrings`` use its
    uid's kernel keyrings (which outlive the run)."""
    root_uids = uids is not None
    landlocked = landlock_note is None
    scoped = landlocked and landlock.scopes(landlock_abi) != 0
    # before ABI 3 (Linux 6.2) Landlock cannot refuse truncate(2): emptying a file is a write
    truncates = landlocked and not landlock.handled_fs(landlock_abi) & landlock.ACCESS_FS_TRUNCATE
    non_root = not root_uids and os.getuid() != 0
    if scoped or root_uids:  # Landlock's scope, or a uid no process outside the run has
        signal = False
    elif non_root:
        signal = namespaces_note is not None  # in namespaces, no outside pid exists for it
    else:
        signal = True  # root off Linux: every run is nobody
    run_can = {
        "read": True,
        "write": not landlocked or truncates,
        "signal": signal,
        "see": not (non_root and namespaces_note is None),
        "server_files": cover_note is not None,
        "keyrings": keyrings_note is not None,
    }
    holds: list[str] = [
        "Each run starts with an empty environment, in a temporary folder of its own "
        "(removed afterwards), in a session of its own that the end of the run kills, with "
        "no_new_privs and rlimits on memory, CPU time, open files, file size and processes."
    ]
    lacks: list[str] = []
    swept = ", ".join(d for d in SWEPT_DIRS if os.path.isdir(d))
    if landlocked:
        holds.append(_landlock_holds(landlock_abi, scoped, truncates))
    if cover_note is None:
        named = _and(list(covers or {"(none here)": ""}))
        holds.append(
            f"The server's own folders ({named}) are each covered, in a mount namespace of "
            "the run's own, by an empty read-only folder it cannot list: it cannot read, "
            "stat, chmod, change the times or extended attributes of, or lock any file in "
            "them (the run store, secret.key), nor uncover them."
        )
    else:
        lacks.append(
            f"The server's own folders are not covered ({cover_note}): "
            + (
                "a run reads what they hold that all users may read."
                if root_uids
                else "a run reads every file in them and, as the files' owner, can change "
                "their mode, times and extended attributes and lock them (Landlock covers "
                "none of these): a lock on the SQLite run store makes every server write "
                "fail for the run's length."
            )
        )
    if keyrings_note is None:
        holds.append(
            "A seccomp filter refuses the kernel keyrings (add_key, request_key, keyctl: "
            "EPERM, as in the Docker sandboxes): a run leaves nothing in its uid's keyrings "
            "for the next run of that uid and reads nothing left there."
        )
    else:
        lacks.append(
            f"No seccomp filter ({keyrings_note}): a run can leave keys in its uid's kernel "
            "keyrings (user and persistent) that the next run of that uid reads."
        )
    if truncates:
        lacks.append(
            f"Landlock ABI {landlock_abi} (before Linux 6.2) cannot refuse truncate(2): a run "
            "can still empty any file its uid may write."
        )
    if uids is not None:
        holds.append(
            f"Each run has its own uid and gid from STUDIO_CODE_SUBPROCESS_UIDS="
            f"{settings.code_subprocess_uids} and no supplementary group: it "
            "cannot read the memory or environment (/proc/<pid>/mem, environ) of another run "
            "or of the server, cannot signal them or a Docker sandbox, and its process limit "
            "(RLIMIT_NPROC) is its own."
        )
        holds.append(
            f"Every file a run's uid leaves in {swept}, and every System V IPC "
            "object (shared memory, semaphores, message queues) it owns, is removed "
            "after the run."
        )
        holds.append(
            "The end of a run kills every process of its uid, including a "
            "grandchild that called setsid()."
        )
        lacks.append(
            "A run can read every file readable by all users "
            + (
                "outside the covered folders"
                if cover_note is None
                else "(check that the database and secret.key are not)"
            )
            + " and use the network"
            + (
                "."
                if landlocked
                else f"; with no Landlock ({landlock_note}) it can write every file and "
                "folder writable by all users, and what it leaves outside those folders (a "
                "file in another world-writable folder, an abstract Unix socket while it "
                "runs) is not looked for."
            )
        )
        lacks.append(
            "A run sees every process of the host in /proc (their pids and command lines), "
            "though it cannot signal or read those of other uids."
        )
    elif os.getuid() == 0:
        lacks.append(
            "Not Linux: every run runs as nobody, shared with every other run and "
            "the Docker sandboxes (they can read and signal each other), and its "
            "files are not removed."
        )
    else:
        _non_root(
            holds,
            lacks,
            namespaces_note,
            undumpable,
            swept,
            landlock_note,
            scoped,
            truncates,
            covered=cover_note is None,
        )
    if cgroups is not None:
        holds.append(
            f"Each run has its own {cgroups.describe()}: memory, /dev/shm and tmpfs pages "
            "included, and processes are capped for the whole run, and its end kills "
            "everything in the cgroup (a grandchild that called setsid() too)."
        )
    else:
        lacks.append(
            f"No cgroup per run ({cgroup_note}): memory is capped per process only, so "
            "pages written to /dev/shm or a tmpfs are not counted against "
            "STUDIO_CODE_MEMORY"
            + (
                "."
                if uids is not None or namespaces_note is None
                else ", and a grandchild that called setsid() survives the end of the run."
            )
        )
    return {
        "separate_uids": uids is not None,
        "uids": settings.code_subprocess_uids if uids is not None else None,
        "cgroup": cgroups.describe() if cgroups is not None else None,
        "cgroup_reason": None if cgroups is not None else cgroup_note,
        "namespaces": namespaces_note is None,
        "namespaces_reason": namespaces_note,
        "server_dumpable": not undumpable,
        "landlock": landlocked,
        "landlock_abi": landlock_abi if landlocked else None,
        "landlock_reason": landlock_note,
        "covered": sorted(covers or {}) if cover_note is None else None,
        "cover_reason": cover_note,
        "keyrings_filtered": keyrings_note is None,
        "keyrings_reason": keyrings_note,
        "run_can": run_can,
        "holds": holds,
        "does_not_hold": lacks,
    }


def _landlock_holds(abi: int, scoped: bool, truncates: bool) -> str:
    writable = ", ".join(landlock.WRITABLE_FILES)
    if truncates:
        write, verbs = "write (truncating aside)", "create, change, rename or remove"
    else:
        write, verbs = "write", "create, change, truncate, rename or remove"
    text = (
        f"Landlock (ABI {abi}): a run cannot {write} anywhere but beneath its own temporary "
        f"folder (and {writable}): it cannot {verbs} any "
        "other file, such as the run store, the data folder, secret.key or the server's "
        "home (Landlock does not cover a file's mode, times, extended attributes or locks), "
        "nor mount anything; and it cannot trace, or read the memory or environment "
        "(/proc/<pid>/mem, environ) of, a process outside its run"
    )
    if scoped:
        return f"{text}, signal one, or connect to an abstract Unix socket made outside its run."
    return f"{text} (Landlock ABI {abi} cannot keep it from signalling one: ABI 6 can)."


def _non_root(
    holds: list[str],
    lacks: list[str],
    namespaces_note: str | None,
    undumpable: bool,
    swept: str,
    landlock_note: str | None = "not asked for",
    scoped: bool = False,
    truncates: bool = False,
    *,
    covered: bool = False,
) -> None:
    """A non-root server's runs share its uid: what the kernel's other fences still hold."""
    landlocked = landlock_note is None
    if undumpable:
        holds.append(
            "The server process is not dumpable (PR_SET_DUMPABLE 0): its /proc files belong "
            "to root, so a run cannot read the server's environment or memory "
            "(/proc/<server>/environ, mem) or ptrace it."
        )
    if namespaces_note is None:
        holds.append(
            "Each run starts in a user, PID and mount namespace of its own with a private "
            "/proc: it keeps the server's uid but has no capability, sees only its own "
            "processes, cannot signal, trace or read the server, its other children or "
            "concurrent runs (none of their pids exists for it), and the end of the run "
            "kills every process it started (a grandchild that called setsid() too)."
        )
    can = []
    if not undumpable and not landlocked:
        mem = (
            "and memory (/proc/<ppid>/mem: ptrace is not restricted by Yama here)"
            if _ptrace_scope() == 0
            else "(its memory is kept from it by Yama's ptrace_scope, its environment is not)"
        )
        can.append(f"read the server's own environment (/proc/<ppid>/environ) {mem}")
    if namespaces_note is not None:
        peers = (
            "environment and memory (/proc/<pid>/environ, mem)"
            if _ptrace_scope() == 0
            else "environment (/proc/<pid>/environ; Yama's ptrace_scope keeps their memory)"
        )
        reach = ["see every process of the host in /proc"]
        if not scoped:
            reach.append("signal the server, its other children and concurrent runs")
        if not landlocked:
            reach.append(f"read the {peers} of concurrent runs")
        can.append(f"{_and(reach)} (no namespaces per run: {namespaces_note})")
    mine = "outside the server's covered folders" if covered else "the server can"
    if landlocked:
        can.append(
            f"read every file {mine} (but write none outside its own folder"
            + (", except emptying one with truncate(2))" if truncates else ")")
        )
    elif covered:
        can.append(f"read and write every file {mine} (no Landlock, {landlock_note})")
    else:
        can.append(
            "read and write every file the server can (the run store, the data folder, "
            f"secret.key, its home: no Landlock, {landlock_note})"
        )
    lacks.append(
        f"The server is not root, so every run runs as the server's own uid {os.getuid()}: a "
        f"run can {'; '.join(can)}; and it shares the RLIMIT_NPROC count of every process "
        "of that user."
    )
    lacks.append(
        f"Files a run leaves in {swept} are not removed (they cannot be told "
        "from the server user's own)"
        + (
            ", but under Landlock it can leave none: it writes only in its own folder."
            if landlocked
            else "."
        )
    )


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _namespaces_note(settings: Settings) -> str | None:
    """None when each run starts in namespaces of its own, else why not (probed once)."""
    if not sys.platform.startswith("linux"):
        return "not Linux"
    if os.getuid() == 0:
        # its runs have uids of their own; namespaces there would also take two processes
        # of each run's RLIMIT_NPROC and pids.max (see namespaces.py)
        return "the server is root: each run has a uid of its own instead"
    if settings.code_subprocess_namespaces == "off":
        return "STUDIO_CODE_SUBPROCESS_NAMESPACES=off"
    return namespaces.probe()


def _keyring_filter() -> tuple[seccomp.Filter | None, str | None]:
    """The seccomp filter each run gets (no kernel keyrings) and None, or None and why
    none (probed once)."""
    f, why = seccomp.program()
    if f is not None:
        why = seccomp.probe(f)
    return (f, None) if why is None else (None, why)


def _covers(
    settings: Settings, *, root: bool, in_namespaces: bool
) -> tuple[dict[str, str], str | None]:
    """The server's folders each run gets covered (``fence``) and None, or {} and why none
    (proved once by a trial run that covers them and a throwaway folder)."""
    if not sys.platform.startswith("linux"):
        return {}, "not Linux"
    if not root and not in_namespaces:
        return {}, "no namespaces per run: they are what covers them under a non-root server"
    folders = fence.server_folders(settings)
    trial = tempfile.mkdtemp(prefix="studio-code-cover-")
    try:
        hidden, workdir = os.path.join(trial, "hidden"), os.path.join(trial, "run")
        os.mkdir(hidden)
        os.mkdir(workdir)
        open(os.path.join(hidden, "file"), "w").close()
        needed = fence.needed_paths(settings, [[sys.executable]])
        plan = fence.Plan.make([*folders.values(), hidden], needed, workdir)

        def setup() -> None:
            if in_namespaces:
                namespaces.enter(plan)
            else:
                fence.unshare_mounts()
                plan.apply()

        why = fence.probe(sys.executable, setup, hidden, workdir)
        if why is not None and not in_namespaces:
            why += (
                "; a root server needs CAP_SYS_ADMIN to make a mount namespace per run (a "
                "container's root has none by default)"
            )
    finally:
        shutil.rmtree(trial, ignore_errors=True)
    return (folders, None) if why is None else ({}, why)


def _landlock(settings: Settings) -> tuple[int, str | None]:
    """The Landlock ABI each run gets and None, or 0 and why none (probed once)."""
    if settings.code_subprocess_landlock == "off":
        return 0, "STUDIO_CODE_SUBPROCESS_LANDLOCK=off"
    abi, why = landlock.abi_version()
    if why is None:
        why = landlock.probe(abi)
    return (abi, None) if why is None else (0, why)


def startup_warning(report: dict[str, Any]) -> str:
    """The start-up warning: not a sandbox, and what a run can read, write, signal and see
    here (``run_can``)."""
    root = report["separate_uids"]
    if not report["run_can"]["server_files"]:
        read = (
            "read any file readable by all users"
            if root
            else "read any file the server user can read"
        ) + (
            ", but not the server's own folders (its data folder, run store and home are "
            "covered: hidden from it)"
        )
    elif root:
        read = (
            "read any file readable by all users (check that a SQLite database and "
            "secret.key are not)"
        )
    else:
        read = (
            "read any file the server user can read (including a SQLite database and "
            "secret.key) and, as their owner, change their mode and times and lock them"
        )
    if not report["landlock"]:
        write = (
            "It can also write every file and folder writable by all users."
            if root
            else "It can also write every file the server user can write (the same ones)."
        )
    elif report["run_can"]["write"]:
        write = (
            f"It cannot write outside its own temporary folder, but it can empty a file it "
            f"may write with truncate(2) (Landlock ABI {report['landlock_abi']}: refusing "
            "that needs ABI 3, Linux 6.2)."
        )
    else:
        write = (
            f"It cannot write outside its own temporary folder (Landlock ABI "
            f"{report['landlock_abi']})."
        )
    can = report["run_can"]
    reach = f"It {'can' if can['signal'] else 'cannot'} signal a process outside its run, and " + (
        "it sees every process of the host." if can["see"] else "it sees only its own."
    )
    keys = (
        " It can leave keys in its uid's kernel keyrings for the next run of that uid."
        if can["keyrings"]
        else ""
    )
    return (
        "STUDIO_CODE_RUNTIME=subprocess: Code nodes run on the host as child processes, NOT "
        f"in a sandbox. Code can use the network and {read}. {write} {reach}{keys} Use it "
        "only for trusted local work."
    )


def isolation_warning(report: dict[str, Any]) -> str:
    """One sentence block for the log and meta's warnings."""
    held = " ".join(report["holds"]) or "Nothing keeps runs from each other."
    return f"Subprocess runs, what holds: {held} What does not: {' '.join(report['does_not_hold'])}"


def _ptrace_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return 0  # no Yama: same-uid ptrace and /proc/<pid>/mem are allowed


_PROBE_LIMITS = Limits(
    memory_bytes=1, cpus=1, pids=1, timeout_s=1, log_max_bytes=1, output_max_bytes=1
)


PR_SET_NO_NEW_PRIVS = 38
try:
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _cpu_s(limits: Limits) -> int:
    return rlimits(limits)[resource.RLIMIT_CPU][0]


def _child_setup(
    policy: dict[int, tuple[int, int]],
    group: RunCgroup | None,
    ids: tuple[int, int] | None,
    in_namespaces: bool = False,
    ruleset: int | None = None,
    cover: fence.Plan | None = None,
    keyrings: seccomp.Filter | None = None,
):  # type: ignore[no-untyped-def]
    """What the child does between fork and exec, still as the server's user: join the
    run's cgroup (so nothing it starts is ever outside it), set its rlimits, then drop to
    the run's uid and gid with no supplementary group and no_new_privs (no setuid binary
    gives a uid back). Popen's own user= would drop the uid BEFORE this runs, and a
    dropped uid may not write to the cgroup's files. ``in_namespaces``: then enter the
    run's namespaces (``namespaces.enter``), and only the runner sets the rlimits (the
    relay and init are copies of the server, whose address space RLIMIT_AS may not fit).
    ``cover``: the server's folders covered in a mount namespace of the run's own
    (``fence``): for a root server made here, still as root, for a non-root one in the
    run's namespaces. ``keyrings``: the runner installs this seccomp filter (``seccomp``:
    no kernel keyrings). ``ruleset``: last, the runner enters this Landlock ruleset
    (``landlock``; made by the server before the fork), after the namespaces' mount of
    /proc and the covers, which it would refuse."""
    procs_files = group.procs_files if group is not None else []

    def setup() -> None:
        pid = str(os.getpid()).encode()
        for path in procs_files:
            fd = os.open(path, os.O_WRONLY)
            try:
                os.write(fd, pid)
            finally:
                os.close(fd)
        if cover is not None and not in_namespaces:
            fence.unshare_mounts()
            cover.apply()
        if not in_namespaces:
            _set_rlimits()
        if ids is not None:
            uid, gid = ids
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        if _prctl is not None:
            _prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if in_namespaces:
            namespaces.enter(cover)  # returns in the runner only
            _set_rlimits()
        if keyrings is not None:
            seccomp.install(keyrings)
        if ruleset is not None:
            landlock.restrict(ruleset)

    def _set_rlimits() -> None:
        for which, value in policy.items():
            resource.setrlimit(which, value)

    return setup


def _wait(
    child: subprocess.Popen[bytes],
    deadline: float,
    should_cancel: CancelCheck | None,
    rss_cap: int | None = None,
    in_namespaces: bool = False,
) -> str:
    """Wait for the child's exit, the deadline, a cancel or (with ``rss_cap``) too much
    resident memory: "eof", "deadline", "cancel" or "memory".

    A pidfd wakes us the moment the child exits; Popen.wait(timeout) would poll with a
    back-off of up to 50 ms, which is most of a trivial node's cost. ``rss_cap`` is for Deno,
    which cannot run under RLIMIT_AS or RLIMIT_DATA (V8 reserves gigabytes of address space
    up front): V8's heap flag caps JavaScript objects, and this watch, every 20 ms, caps
    what the heap flag does not see (ArrayBuffers); it may overshoot by what can be touched
    in 20 ms. ``in_namespaces``: the child is the relay, and the runner whose memory is
    watched its grandchild (``namespaces``)."""
    try:
        pidfd = os.pidfd_open(child.pid)
    except (AttributeError, OSError):
        pidfd = None  # not Linux >= 5.3: poll
    step_max = RSS_POLL_S if rss_cap else POLL_S * 2
    watched = None if in_namespaces else child.pid
    try:
        while not usage.exited(child):  # not reaped here: _kill reaps it with its rusage
            now = time.monotonic()
            if now >= deadline:
                return "deadline"
            if should_cancel is not None and should_cancel():
                return "cancel"
            if rss_cap is not None:
                watched = watched or namespaces.runner_pid(child.pid)
                if watched is not None and _rss_bytes(watched) > rss_cap:
                    return "memory"
            step = min(step_max, deadline - now)
            if pidfd is not None:
                select.select([pidfd], [], [], step)
            else:
                try:
                    child.wait(timeout=step)
                except subprocess.TimeoutExpired:
                    pass
        return "eof"
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0  # gone, or not Linux


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _feed(pipe: IO[bytes], payload: bytes) -> None:
    try:
        pipe.write(payload)
    except (BrokenPipeError, OSError):
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _drain(pipe: IO[bytes], sink: BoundedBuffer) -> None:
    fd = pipe.fileno()
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        sink.write(chunk)
    pipe.close()
