"""What a sandbox used, read by the host from its cgroup (never claimed by the code in it).

A container's own cgroup is removed by the engine (runc) the moment its last process exits,
before ``docker rm``: a cold sandbox whose code ran to its end, or was OOM-killed, has no
cgroup left to read when its exit is seen (measured on Docker 20.10, cgroup v1: an fd opened
before reads ENODEV after). So where this process can read the host's cgroup fs, each
sandbox is created under a cgroup parent of its own, ``/docker/studio-code-usage-<random>``:
the kernel charges the container's memory peak, CPU and processes to that parent too, the
parent outlives the container, and it is removed (``release``) when the container is.

The per-run parents sit under the engine's own parent for containers (``/docker``, what
dockerd's cgroupfs driver uses when its ``cgroup-parent`` is unset; another one:
``STUDIO_CODE_USAGE_CGROUP_PARENT``), never at the hierarchy's root: a limit an operator puts
on ``/docker`` (memory, CPU, pids of all containers) holds the sandboxes too, and on v1 their
CPU weight is a share of ``/docker``'s ``cpu.shares``, not 1024 each beside it (a few
sandboxes out-weighing the host's services and the worker). The engine's parent is a setting,
not found: it cannot be seen from the engine's API, only from a container made without a
parent, and the socket guard, which passes exactly ``<it>/studio-code-usage-<16 hex>``, must
agree with the workers (both read the setting). A parent that is not a group of the
hierarchy (the engine configured otherwise) means no per-run parents: not measured.

- **cgroup v1**: ``memory.max_usage_in_bytes``, ``cpuacct.usage`` (ns), ``pids.peak``.
- **cgroup v2**: ``memory.peak`` (Linux >= 5.19, else no memory figure), ``cpu.stat``
  ``usage_usec``, ``pids.peak`` (Linux >= 6.1?, else none).
- **a read-only view** (a worker in a container under Compose: the host's /sys/fs/cgroup
  bound read-only at ``STUDIO_CODE_HOST_CGROUP``, ``Settings.code_host_cgroup``): parents
  are made only when another process removes them (``STUDIO_CODE_USAGE_SWEEPER=1``,
  ``Settings.code_usage_sweeper``: Compose's usage-sweeper service,
  ``python -m executor.runtimes.docker.usage``, ``sweep_empty``).
- **no view**: not measured (null). The engine's stats call is no way out: on Docker 20.10
  the engine samples every container in one loop (collect, publish, sleep 1 s), and a
  ``GET /containers/<id>/stats?stream=false&one-shot=true`` waits for its next pass
  (measured: 3 ms on an idle loop, 300-1000 ms otherwise; ~2 s without one-shot), and a
  container that exited meanwhile has nothing left.

A pre-started sandbox (pool.py) is handed its job long after its interpreter started:
``hand_over`` reads its CPU then, and the job's CPU is what it used after; on v1 it also
resets the memory peak to the current usage, so the peak counts the idle interpreter's
resident memory (the job runs in it) but not the transient peak of its start.

Per-run parents are used only for the cgroupfs driver (systemd's parents are slices it
manages) and an engine on this host (a ``unix://`` DOCKER_HOST: its own socket, or a socket
guard's, which passes a ``CgroupParent`` of exactly ``<engine parent>/studio-code-usage-<16
hex>``). Tested on cgroup v1 (Docker 20.10, cgroupfs); the v2 paths are the same paths under
the unified mount, untested here.
``STUDIO_CODE_USAGE=0`` (``Settings.code_usage``) turns the reading off (usage null): the
bench's comparison. The three switches are settings, read by the caller's ``Settings``.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from executor.models import Usage, UsageSource
from executor.sandbox_names import ENGINE_PARENT, USAGE_PARENT_PREFIX

if TYPE_CHECKING:
    from executor.settings import Settings

log = logging.getLogger("studio_code")

MOUNTINFO = "/proc/self/mountinfo"
PARENT_PREFIX = USAGE_PARENT_PREFIX
#: a parent left this long past the longest run is a dead process's (``sweep``)
SWEEP_GRACE_S = 600.0
V1_FILES = {
    "memory": "memory/memory.max_usage_in_bytes",
    "cpu": "cpuacct/cpuacct.usage",
    "pids": "pids/pids.peak",
}


@dataclass(frozen=True)
class CgroupHost:
    """How this process sees the sandboxes' cgroups: v1 (a mount per controller) or v2."""

    version: int
    #: v1: controller -> mount point ("memory", "cpuacct", "pids"); v2: {"": mount point}
    mounts: dict[str, str]
    driver: str
    #: per-run parents are made (cgroupfs driver, an engine on this host)
    parents: bool
    #: this process removes them (its view is writable); else another does (Compose: the
    #: usage-sweeper service)
    removes: bool = True
    #: the engine's parent for containers (cgroupfs driver): the per-run parents' own
    engine_parent: str = ENGINE_PARENT

    @property
    def source(self) -> UsageSource:
        return "cgroup-v2" if self.version == 2 else "cgroup-v1"

    def path(self, parent: str) -> str:
        """The per-run parent named ``parent`` as a cgroup path (the ``CgroupParent``)."""
        return f"{self.engine_parent}/{parent}"

    def own_dir(self, controller: str, cid: str, parent: str | None) -> str:
        """The container's own cgroup directory (gone once it exited)."""
        base = self.mounts["" if self.version == 2 else controller]
        if parent is not None:
            return f"{base}{self.path(parent)}/{cid}"
        if self.driver == "systemd":
            return f"{base}/system.slice/docker-{cid}.scope"
        return f"{base}{self.engine_parent}/{cid}"

    def parent_dir(self, controller: str, parent: str) -> str:
        return f"{self.mounts['' if self.version == 2 else controller]}{self.path(parent)}"

    def parents_dir(self) -> str:
        """Where the per-run parents are (the engine's parent), in the memory hierarchy (v2:
        the unified one)."""
        return f"{self.mounts['' if self.version == 2 else 'memory']}{self.engine_parent}"

    def all_parent_dirs(self, parent: str) -> list[str]:
        """Every hierarchy's directory of ``parent`` (runc makes it in each: v1 mounts them
        all, hybrid hosts the unified one too)."""
        root = os.path.dirname(next(iter(self.mounts.values())))
        if self.version == 2:
            return [f"{self.mounts['']}/{parent}"]
        dirs = []
        try:
            names = os.listdir(root)
        except OSError:
            return [self.parent_dir(c, parent) for c in self.mounts]
        for name in names:
            d = f"{root}/{name}{self.path(parent)}"
            if os.path.isdir(d):
                dirs.append(d)
        return dirs


#: memory peak (bytes), CPU (ns), processes peak, source
Reading = tuple[int | None, int | None, int | None, UsageSource]

#: by DOCKER_HOST (a socket guard or a test's engine put in front later is another view), engine
#: parent, where the host's cgroup fs is seen and whether a sweeper removes the parents: the
#: view, and when to look again for one not found
_hosts: dict[tuple[str, str, str, bool], tuple[CgroupHost | None, float]] = {}
_host_lock = threading.Lock()
#: how often a process that found no view of the engine's cgroups looks again
REDETECT_S = 60.0


def cgroup_host(settings: Settings) -> CgroupHost | None:
    """This process's view of the host's cgroups (read once per engine), or None: they
    cannot be seen from here (a worker in a container): its runs are not measured.
    ``settings``: the engine's parent (STUDIO_CODE_USAGE_CGROUP_PARENT), where the host's
    cgroup fs is seen (STUDIO_CODE_HOST_CGROUP) and STUDIO_CODE_USAGE_SWEEPER."""
    engine_parent = settings.code_usage_cgroup_parent
    view, swept = settings.code_host_cgroup.rstrip("/"), settings.code_usage_sweeper
    key = (os.environ.get("DOCKER_HOST", ""), engine_parent, view, swept)
    got = _hosts.get(key)
    if got is not None and (got[0] is not None or time.monotonic() < got[1]):
        return got[0]
    with _host_lock:
        host = _detect(engine_parent, view, swept)
        _hosts[key] = (host, time.monotonic() + REDETECT_S)
        return host


def _detect(engine_parent: str, view: str, swept: bool) -> CgroupHost | None:
    mounts: dict[str, str] = {}
    v2: str | None = None
    try:
        with open(MOUNTINFO, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rest = left.split(), right.split()
        if len(parts) < 5 or not rest:
            continue
        root, point = parts[3], parts[4]
        if root != "/":
            continue  # a view of a sub-group (a container's own): not the host's sandboxes
        if rest[0] == "cgroup2" and point == view:
            v2 = point
        elif rest[0] == "cgroup" and len(rest) >= 3 and point.startswith(view + "/"):
            for opt in rest[2].split(","):
                if opt in ("memory", "cpuacct", "pids"):
                    mounts[opt] = point
    # an engine on this host: its own socket or a socket guard's (which passes a parent of
    # exactly this module's shape); an engine over TCP is another host's, whose groups these
    # are not
    local = (os.environ.get("DOCKER_HOST") or "unix://").startswith("unix://")
    if v2 is not None:
        version, found = 2, {"": v2}
    elif "memory" in mounts and "cpuacct" in mounts:
        version, found = 1, mounts
    else:
        return None
    base = found["" if version == 2 else "memory"]
    # the engine's cgroup driver, from the groups it made (no engine call on a one-shot run's
    # path: `docker info` is 10-15 ms). Neither there: this view is not the engine's host
    # (a worker in a container with a cgroup namespace of its own), or the engine never ran
    # a container yet: not measured, and ``cgroup_host`` looks again later. (An engine whose
    # parent is not STUDIO_CODE_USAGE_CGROUP_PARENT's: not found here either, not measured.)
    if os.path.isdir(f"{base}{engine_parent}"):
        driver = "cgroupfs"
    elif any(n.startswith("docker-") for n in _listdir(f"{base}/system.slice")):
        driver = "systemd"
    else:
        return None
    # a parent is removed by this process, or by a sweeper the deployment runs: a view it
    # cannot write (mounted read-only into a worker's container) without one reads the
    # sandboxes' own groups only
    writable = os.access(base, os.W_OK)
    parents = driver == "cgroupfs" and local and (writable or swept)
    return CgroupHost(version, found, driver, parents, writable, engine_parent)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


@dataclass(eq=False)
class Meter:
    """One sandbox's readings, from its creation to its removal: it rides on the sandbox's
    handle (sandbox.py), never looked up by container id."""

    host: CgroupHost | None
    parent: str | None
    cid: str = ""
    #: CPU (ns) at hand-over: a pre-started sandbox's start is not its job's
    base_cpu_ns: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def host_config(self, hc: dict[str, Any]) -> dict[str, Any]:
        """``hc`` (sandbox_policy's host config keywords) under this sandbox's parent."""
        if self.host is None or self.parent is None:
            return hc
        return {**hc, "cgroup_parent": self.host.path(self.parent)}

    def hand_over(self, api: Any) -> None:
        """A pre-started sandbox gets its job now: what it used so far is not the job's."""
        got = self._read(api)
        self.base_cpu_ns = (got[1] or 0) if got is not None else 0
        if self.host is not None and self.host.version == 1:
            # resets the peak to the current usage (the idle interpreter's memory stays in)
            for d in self._dirs("memory"):
                try:
                    _write(f"{d}/memory.max_usage_in_bytes", b"0")
                except OSError:
                    pass  # not ours to write (a non-root worker): the peak counts the start

    def read(self, api: Any) -> Usage | None:
        """What the sandbox used so far (its job's share), or None when it cannot be read."""
        got = self._read(api)
        if got is None:
            return None
        memory, cpu_ns, pids, source = got
        cpu_ms = None if cpu_ns is None else round(max(0, cpu_ns - self.base_cpu_ns) / 1e6, 3)
        if memory is None and cpu_ms is None:
            return None
        return Usage(memory_peak_bytes=memory, cpu_ms=cpu_ms, pids_peak=pids, source=source)

    def resident(self) -> int | None:
        """The anonymous memory the sandbox holds now (v1 ``memory.stat`` ``total_rss``,
        v2 ``anon``; file cache left out), or None when it cannot be read
        (preimport_memory.py: what an idle pre-started sandbox holds)."""
        h = self.host
        if h is None:
            return None
        d = self._dirs("memory" if h.version == 1 else "")[0]
        return _stat_field(f"{d}/memory.stat", "total_rss" if h.version == 1 else "anon")

    def source(self) -> UsageSource | None:
        return self.host.source if self.host is not None else None

    def _dirs(self, controller: str) -> list[str]:
        """Where to read ``controller``: the parent (outlives the container), else its own."""
        h = self.host
        if h is None:
            return []
        if self.parent is not None:
            return [h.parent_dir(controller, self.parent)]
        return [h.own_dir(controller, self.cid, None)]

    def _read(self, api: Any) -> Reading | None:
        h = self.host
        if h is None:
            return None
        if h.version == 1:
            memory = _int_file(f"{self._dirs('memory')[0]}/memory.max_usage_in_bytes")
            cpu = _int_file(f"{self._dirs('cpuacct')[0]}/cpuacct.usage")
            pids = _int_file(f"{self._dirs('pids')[0]}/pids.peak") if "pids" in h.mounts else None
        else:
            d = self._dirs("")[0]
            memory = _int_file(f"{d}/memory.peak")
            usec = _stat_field(f"{d}/cpu.stat", "usage_usec")
            cpu = None if usec is None else usec * 1000
            pids = _int_file(f"{d}/pids.peak")
        if memory is None and cpu is None:
            return None
        return memory, cpu, pids, h.source

    def release(self) -> None:
        """After the container's removal: its parent's directories go."""
        with _unreleased_lock:
            _unreleased.discard(self)
        if self.host is None or self.parent is None or not self.host.removes:
            return
        for d in self.host.all_parent_dirs(self.parent):
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                log.debug("usage: could not remove %s: %s", d, e)


#: this process's meters not released yet: ``sweep`` leaves their parents (each is found on
#: its sandbox's handle, never here)
_unreleased: weakref.WeakSet[Meter] = weakref.WeakSet()
_unreleased_lock = threading.Lock()


def new_meter(settings: Settings) -> Meter | None:
    """A meter for a sandbox about to be created, or None when usage is off
    (STUDIO_CODE_USAGE=0) or the cgroups cannot be seen from here."""
    if not settings.code_usage:
        return None
    host = cgroup_host(settings)
    if host is None:
        return None
    meter = Meter(host, PARENT_PREFIX + secrets.token_hex(8) if host.parents else None)
    with _unreleased_lock:
        _unreleased.add(meter)
    return meter


def host_config(meter: Meter | None, policy: dict[str, Any]) -> dict[str, Any]:
    """sandbox_policy's host config keywords, under the meter's parent cgroup if any."""
    hc: dict[str, Any] = policy["host_config"]
    return meter.host_config(hc) if meter is not None else hc


#: read at hand-over and at the end (the bench turns it off for its without-usage side, the
#: sandboxes made alike: what it measures is the cost on a job's path)
READING = True


def hand_over(api: Any, meter: Meter | None) -> None:
    if meter is not None and READING:
        meter.hand_over(api)


def read(api: Any, meter: Meter | None) -> Usage | None:
    """What the sandbox of ``meter`` used so far, or None (off, or it could not be read)."""
    if meter is None or not READING:
        return None
    try:
        return meter.read(api)
    except Exception as e:  # noqa: BLE001 - figures never fail a run
        log.debug("usage of %s not read: %s", meter.cid[:12], e)
        return None


def sweep(settings: Settings, older_than_s: float) -> int:
    """Remove the empty per-run parents made more than ``older_than_s`` ago: those of a
    process that died before it removed its sandboxes (the reaper removed them). A parent of
    a run still going holds its container's group (rmdir fails: EBUSY), and one whose
    container just ended is younger than the longest run. Returns how many went."""
    host = cgroup_host(settings)
    if host is None or not host.parents or not host.removes:
        return 0
    with _unreleased_lock:
        mine = {m.parent for m in _unreleased}
    base = host.parents_dir()
    cutoff = time.time() - older_than_s
    gone = 0
    try:
        names = [n for n in os.listdir(base) if n.startswith(PARENT_PREFIX) and n not in mine]
    except OSError:
        return 0
    for name in names:
        try:
            if os.stat(f"{base}/{name}").st_mtime > cutoff:
                continue
        except OSError:
            continue
        Meter(host, name).release()
        gone += not os.path.exists(f"{base}/{name}")
    return gone


#: how long a parent must have been seen empty before the sweeper removes it: its sandbox
#: exited that long ago, and its worker reads the figures on the run's path (milliseconds)
EMPTY_FOR_S = 20.0
SWEEP_EVERY_S = 5.0


def sweep_empty(
    settings: Settings, seen: dict[str, float], empty_for_s: float = EMPTY_FOR_S
) -> int:
    """One pass of the sweeper (a process that can write the host's cgroup fs, for workers
    whose view is read-only): remove the per-run parents seen empty (no sandbox group in them)
    for ``empty_for_s``; ``seen`` carries when each was first seen empty. Returns how many
    went."""
    host = cgroup_host(settings)
    if host is None or not host.parents or not host.removes:
        return 0
    base = host.parents_dir()
    now = time.monotonic()
    names = {n for n in _listdir(base) if n.startswith(PARENT_PREFIX)}
    for gone in set(seen) - names:
        del seen[gone]
    removed = 0
    for name in sorted(names):
        try:
            busy = any(e.is_dir() for e in os.scandir(f"{base}/{name}"))
        except OSError:
            continue
        if busy:
            seen.pop(name, None)
            continue
        if now - seen.setdefault(name, now) < empty_for_s:
            continue
        Meter(host, name).release()
        if not os.path.exists(f"{base}/{name}"):
            removed += 1
            del seen[name]
    return removed


def main(argv: list[str] | None = None) -> int:
    """``python -m executor.runtimes.docker.usage``: the sweeper (Compose's usage-sweeper
    service): every ``--every`` s, remove the per-run parents empty for ``--empty-for`` s;
    at SIGTERM (the workers stopped first) every empty one. They are below
    STUDIO_CODE_USAGE_CGROUP_PARENT (set it as the workers have it)."""
    import argparse
    import signal

    from executor.errors import SettingsError
    from executor.settings import load_settings

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--every", type=float, default=SWEEP_EVERY_S)
    ap.add_argument("--empty-for", type=float, default=EMPTY_FOR_S)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        settings = load_settings()
    except SettingsError as e:
        log.error("usage sweeper: %s", e.message)
        return 2
    engine_parent = settings.code_usage_cgroup_parent
    host = cgroup_host(settings)
    if host is None or not host.removes:
        log.error(
            "usage sweeper: no writable view of the engine's cgroups (cgroupfs driver, its "
            "containers under STUDIO_CODE_USAGE_CGROUP_PARENT=%s) under "
            "STUDIO_CODE_HOST_CGROUP=%s: mount the host's /sys/fs/cgroup there, read-write",
            engine_parent,
            settings.code_host_cgroup,
        )
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    log.info(
        "usage sweeper: removing the per-run parents under %s empty for %.0f s",
        engine_parent,
        args.empty_for,
    )
    seen: dict[str, float] = {}
    while not stop.wait(args.every):
        if n := sweep_empty(settings, seen, args.empty_for):
            log.info("usage sweeper: removed %d empty per-run parents", n)
    n = sweep_empty(settings, seen, 0.0)
    log.info("usage sweeper: stopping, removed %d empty per-run parents", n)
    return 0


def _int_file(path: str) -> int | None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return int(os.read(fd, 64))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _stat_field(path: str, key: str) -> int | None:
    try:
        with open(path, "rb") as f:
            for line in f:
                k, _, v = line.partition(b" ")
                if k == key.encode():
                    return int(v)
    except (OSError, ValueError):
        return None
    return None


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main())
