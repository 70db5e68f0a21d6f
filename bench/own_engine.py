"""runc vs crun, measured in a Docker engine of the bench's OWN (root only).

The shared engine is never touched: registering crun there would need a daemon.json change
and a reload. So this starts a second ``dockerd`` (its own --data-root, --exec-root, socket,
pidfile; --bridge=none --iptables=false; ``--add-runtime crun=<crun>``) inside a cpuacct
cgroup of its own, with ``--cgroup-parent`` putting its containers in another: the CPU of
dockerd, its containerd, every shim and every runc/crun call, and of the sandboxes
themselves, is read from those two cgroups, so the machine's other work is not counted.
The sandbox images are copied in with ``docker save | docker -H … load``; the engine is
stopped by its pid at the end. On a hybrid cgroup host (v1 controllers and a cgroup2
hierarchy at /sys/fs/cgroup/unified, which crun refuses) the engine runs in a mount
namespace of its own without that cgroup2 mount, for both runtimes alike.

    python -m bench.own_engine [--n 15]                  # the benchmark
    python -m bench.own_engine --pytest tests/test_docker_isolation.py   # tests under crun
    python -m bench.own_engine --crun /path/to/crun       # a crun other than PATH's
    python -m bench.own_engine --restarts 5   # only: engine restart -> killed run claimed again
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import bench_stack, end_stack, interleave, pct

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
UNIFIED = "/sys/fs/cgroup/unified"


class OwnEngine:
    """A dockerd of this process's own, with crun registered."""

    def __init__(self, crun: str | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="studio-bench-engine-", dir="/var/tmp"))
        self.host = f"unix://{self.dir / 'docker.sock'}"
        tag = f"studio-bench-{os.getpid()}"
        self.cg_engine = CPUACCT / f"{tag}-engine"
        self.cg_parent = f"/{tag}-sandboxes"
        self.proc: subprocess.Popen[bytes] | None = None
        # crun: a crun binary (or a wrapper script) other than the one on PATH, e.g. a newer
        # release unpacked into a directory of its own.
        self.crun = crun or shutil.which("crun")

    def start(self) -> OwnEngine:
        import docker

        self.cg_engine.mkdir(exist_ok=True)
        args = [
            "dockerd",
            "--data-root",
            str(self.dir / "data"),
            "--exec-root",
            str(self.dir / "exec"),
            "--host",
            self.host,
            "--pidfile",
            str(self.dir / "docker.pid"),
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--cgroup-parent",
            self.cg_parent,
        ]
        if self.crun:
            args += ["--add-runtime", f"crun={self.crun}"]
        if os.path.ismount(UNIFIED):
            # A hybrid host (cgroup v1 controllers plus a cgroup2 hierarchy at
            # /sys/fs/cgroup/unified): crun refuses it ("cgroups in hybrid mode not
            # supported, drop all controllers from cgroupv2") while that hierarchy lists a
            # controller. So this engine runs in a mount namespace of its own without that
            # mount: crun (and runc, measured alike) sees plain cgroup v1. The host's mounts
            # and the shared engine are untouched.
            args = [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                f'umount {UNIFIED} && exec "$@"',
                "sh",
                *args,
            ]
        # The shell joins the cgroup, then becomes dockerd (unshare and a second shell exec
        # in place, so the pid stays dockerd's): containerd, shims and runc inherit it.
        script = f'echo $$ > {self.cg_engine}/cgroup.procs && exec "$@"'
        with open(self.dir / "dockerd.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["sh", "-c", script, "sh", *args], stdout=log, stderr=log, start_new_session=True
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dockerd exited: {(self.dir / 'dockerd.log').read_text()}")
            try:
                docker.APIClient(base_url=self.host, timeout=2).ping()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        raise RuntimeError("the bench's own dockerd did not start")

    def crun_problem(self, image: str) -> str | None:
        """Why crun cannot start a container in this engine (None: it can)."""
        import docker

        if not self.crun:
            return "crun is not installed (apt-get install crun)"
        client = docker.DockerClient(base_url=self.host, timeout=60)
        try:
            client.containers.run(
                image, ["python3", "-c", "pass"], runtime="crun", network_mode="none", remove=True
            )
            return None
        except docker.errors.DockerException as e:
            return str(e)
        finally:
            client.close()

    def load(self, images: list[str]) -> None:
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        subprocess.run(
            ["docker", "-H", self.host, "load", "-q"],
            stdin=save.stdout,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        save.wait()

    def cpu_ms(self) -> tuple[float, float]:
        """CPU so far of the engine (dockerd, containerd, shims, runc/crun) and of its
        sandboxes, in ms."""
        engine = int((self.cg_engine / "cpuacct.usage").read_text())
        parent = CPUACCT / self.cg_parent.lstrip("/") / "cpuacct.usage"
        boxes = int(parent.read_text()) if parent.exists() else 0
        return engine / 1e6, boxes / 1e6

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # dockerd, by its own pid (the exec'd sh)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        for cg in [self.cg_engine, *Path("/sys/fs/cgroup").glob(f"*{self.cg_parent}")]:
            for sub in sorted(cg.glob("**/"), key=lambda p: -len(p.parts)):
                try:
                    sub.rmdir()
                except OSError:
                    pass
        subprocess.run(["umount", "-R", str(self.dir)], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)


TRIVIAL = "def main(state):\n    return 1\n"


def _bench(engine: OwnEngine, n: int, runtimes: list[str]) -> None:
    from bench.core import raw_docker_floor
    from executor.models import CodeJob
    from executor.service import Executor
    from executor.settings import load_settings

    executors: dict[tuple[str, str], Executor] = {}
    for rt in runtimes:
        settings = load_settings(
            enable_code_nodes=True,
            code_languages="python",
            code_oci_runtime="" if rt == "runc" else rt,
        )
        executors[(rt, "cold")] = Executor(settings)
        pooled = Executor(settings)
        pooled.prepare()
        assert pooled.runtime is not None and pooled.runtime.pool is not None
        assert pooled.runtime.pool.wait_ready(60)
        executors[(rt, "pool")] = pooled

    def job(ex: Executor) -> None:
        r = ex.run(CodeJob(code=TRIVIAL, timeout_s=20))
        assert r.status == "succeeded", r.error

    def settle(ex: Executor) -> None:
        if ex.runtime is not None and ex.runtime.pool is not None:
            ex.runtime.pool.wait_settled(60)

    sides, names = [], []
    for rt in runtimes:
        cold = executors[(rt, "cold")]
        sides += [
            raw_docker_floor(cold, "{}"),
            lambda ex=cold: job(ex),
            lambda ex=executors[(rt, "pool")]: job(ex),
        ]
        names += [f"{rt}: raw cold floor", f"{rt}: executor cold", f"{rt}: executor pool"]
    times = interleave(n, sides)
    print(
        f"# bench.own_engine: an own dockerd ({', '.join(runtimes)}); trivial Python node, "
        f"n={n} per side, interleaved; ms"
    )
    print("| what | p50 | p95 |")
    print("|---|---|---|")
    for name, t in zip(names, times, strict=True):
        print(f"| {name} | {pct(t, 50):.1f} | {pct(t, 95):.1f} |")

    # CPU per job: blocks of jobs, alternating runtimes, each block waited out (a pooled
    # job's replacement and its removal in the background are part of its cost).
    cpu: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    block = max(5, n // 2)
    for _ in range(3):
        for rt in runtimes:
            for mode in ("cold", "pool"):
                ex = executors[(rt, mode)]
                settle(ex)
                e0, b0 = engine.cpu_ms()
                c0 = _self_cpu_ms()
                for _ in range(block):
                    job(ex)
                settle(ex)
                e1, b1 = engine.cpu_ms()
                c1 = _self_cpu_ms()
                cpu.setdefault((rt, mode), []).append(
                    ((e1 - e0) / block, (b1 - b0) / block, (c1 - c0) / block)
                )
    print()
    print(
        f"| CPU per job ({3 * block} jobs per row, ms) | engine: dockerd, containerd, shim, "
        "OCI runtime | the sandbox's own processes | this client (executor) | total |"
    )
    print("|---|---|---|---|---|")
    for (rt, mode), rows in cpu.items():
        e = sum(r[0] for r in rows) / len(rows)
        b = sum(r[1] for r in rows) / len(rows)
        c = sum(r[2] for r in rows) / len(rows)
        print(f"| {rt}, {mode} | {e:.1f} | {b:.1f} | {c:.1f} | {e + b + c:.1f} |")
    for ex in executors.values():
        ex.close()


LONG = (
    "import time\n\n"
    "def main(state):\n"
    "    time.sleep(max(0, state['until'] - time.time()))\n"
    "    return state['i']\n"
)


def restarts(rounds: int = 5) -> int:
    """Engine restart -> the killed run started again on the other engine: two workers, the
    machine's engine (e1) and one of this bench's own (e2, testkit.engine's
    KillableEngine: the only one ever stopped), a Redis and a PostgreSQL schema of its own.
    Each round a long job runs on e2 (a long job that lands on e1 is cancelled, so e1 has a
    free slot) when e2's engine crashes (SIGKILL of its dockerd, containerd and shims; then
    started again), or is restarted gracefully (SIGTERM: dockerd kills its containers 10 s
    later; then started again); measured: from the fault to the claim of the killed job's
    re-run (its ``started_at``), against the floor of an idle deployment: submit -> claim."""
    import signal as sig
    import uuid

    from executor.settings import load_settings
    from testkit.engine import KillableEngine
    from testkit.postgres import pg_schema
    from testkit.worker import CeleryWorker

    if os.geteuid() != 0 or not shutil.which("dockerd"):
        print("bench.own_engine --restarts: skipped (needs root and dockerd)")
        return 0
    image = load_settings().code_image
    engine = KillableEngine()
    workers: dict[str, CeleryWorker] = {}
    stack = None
    try:
        engine.start()
        engine.load(image)
        # the stack ends before its schema is dropped; not quiet: e2's worker log says when
        # its gate opens again
        with (
            pg_schema(prefix="bench_restarts") as db,
            bench_stack(
                "restarts",
                quiet=False,
                database_url=db,
                code_image=image,
                code_languages="python",
                code_max_seconds=40,
            ) as stack,
        ):
            tag = uuid.uuid4().hex[:4]
            names = {"e1": f"e1-{tag}", "e2": f"e2-{tag}"}
            hosts = {"e1": "unix:///var/run/docker.sock", "e2": engine.host}
            for key, host in hosts.items():  # `studio-code worker` on each engine
                workers[key] = stack.start_worker(
                    names[key], 3, cli=True, ping=False, stop_timeout=60, env={"DOCKER_HOST": host}
                )
            for w in workers.values():
                w.wait_ready(120)
            client = stack.client

            def on(job: str) -> str:
                worker = client.status(job).worker or ""
                return next((k for k, n in names.items() if worker.startswith(n)), "")

            def e2_serving() -> None:
                end = time.monotonic() + 60
                while time.monotonic() < end:
                    out = workers["e2"].output()
                    if out.count("consumers resumed") >= out.count("consumers paused"):
                        return
                    time.sleep(0.2)
                raise RuntimeError("the e2 worker did not take jobs again")

            def long_on_e2() -> tuple[str, list[str]]:
                """Long jobs until one runs on e2 (the others hold e1 slots, one stays free)."""
                until = time.time() + 25
                held: list[str] = []
                for i in range(3):
                    job = client.submit(LONG, "python", {"i": i, "until": until}, timeout_s=40)
                    end = time.monotonic() + 30
                    while client.status(job).status.value == "queued":
                        if time.monotonic() > end:
                            raise RuntimeError("a long job was not taken")
                        time.sleep(0.05)
                    if on(job) == "e2":
                        return job, held
                    client.cancel(job)  # its e1 slot stays free for the re-run
                    held.append(job)
                raise RuntimeError("no long job ran on e2")

            def start_again() -> None:
                try:
                    engine.start()
                except BaseException as e:  # noqa: BLE001 - pytest's skip: a slow containerd
                    print(f"  the engine did not start at once ({str(e)[:80]}...): again")
                    engine.stop()
                    engine.start()

            floor = []
            for i in range(rounds):
                asked = time.time()
                job = client.submit(LONG, "python", {"i": i, "until": 0}, timeout_s=40)
                rec = client.wait(job, 60)
                assert rec.status.value == "succeeded" and rec.started_at is not None, rec
                floor.append((rec.started_at.timestamp() - asked) * 1000)
            rows: dict[str, list[float]] = {}
            for kind in ["SIGKILL"] * rounds + ["SIGTERM"] * max(2, rounds // 2):
                e2_serving()
                job, held = long_on_e2()
                assert engine.proc is not None
                t0 = time.time()
                if kind == "SIGKILL":  # a crash: its dockerd, containerd and every shim at once
                    pidfile = engine.root / "exec" / "containerd" / "containerd.pid"
                    own = [engine.proc.pid, *engine.shims("")]
                    if pidfile.exists():
                        own.append(int(pidfile.read_text().strip() or 0))
                    for pid in own:
                        try:
                            os.kill(pid, sig.SIGKILL)
                        except (ProcessLookupError, ValueError):
                            pass  # gone with its dockerd already
                    engine.proc.wait(30)
                else:
                    engine.stop()
                start_again()
                rec = client.wait(job, 120)
                assert rec.status.value == "succeeded" and rec.attempts >= 2, rec
                assert rec.started_at is not None
                rows.setdefault(kind, []).append((rec.started_at.timestamp() - t0) * 1000)
                print(
                    f"  {kind}: re-run claimed {rows[kind][-1]:.0f} ms after the fault, on "
                    f"{on(job)}, attempts {rec.attempts}, {rec.trace[0].detail}",
                    flush=True,
                )
                for h in held:
                    assert client.wait(h, 120).status.value == "cancelled"
            print(
                "# bench.own_engine --restarts: two workers on two engines; a long job on e2 "
                "when its engine goes; ms"
            )
            print("| what | n | p50 | max |")
            print("|---|---|---|---|")
            print(
                f"| floor: submit -> claim on an idle deployment | {len(floor)} | "
                f"{pct(floor, 50):.0f} | {max(floor):.0f} |"
            )
            what = {
                "SIGKILL": "engine SIGKILLed (then started again) -> killed run claimed again",
                "SIGTERM": "engine restarted (SIGTERM: its kill comes 10 s later) -> killed "
                "run claimed again",
            }
            for kind, times in rows.items():
                print(f"| {what[kind]} | {len(times)} | {pct(times, 50):.0f} | {max(times):.0f} |")
    finally:
        end_stack(stack)
        engine.stop()
        engine.end_leftovers()
        engine.unmount_own()
        engine.remove()
    return 0


def _self_cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime + r.ru_stime) * 1000


def main(
    n: int = 15,
    pytest_args: list[str] | None = None,
    crun: str | None = None,
    restart_rounds: int = 3,
    only_restarts: bool = False,
) -> int:
    """The runc/crun bench, then the engine-restart rows (``restart_rounds`` SIGKILL rounds;
    0: none); ``only_restarts``: the latter alone."""
    rc = 0 if only_restarts else _engines(n, pytest_args, crun)
    if rc == 0 and pytest_args is None and restart_rounds > 0:
        print(flush=True)
        rc = restarts(restart_rounds)
    return rc


def _engines(n: int, pytest_args: list[str] | None, crun: str | None) -> int:
    if os.geteuid() != 0 or not shutil.which("dockerd") or not CPUACCT.exists():
        print("bench.own_engine: skipped (needs root, dockerd and cgroup v1 cpuacct)")
        return 0
    from executor.settings import load_settings

    settings = load_settings()
    engine = OwnEngine(crun)
    saved = os.environ.get("DOCKER_HOST")

    def stop_on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # so the engine below is stopped, never left running

    signal.signal(signal.SIGTERM, stop_on_term)
    try:
        engine.start()
        engine.load([settings.code_image, settings.code_ts_image])
        crun = engine.crun_problem(settings.code_image)
        if crun is not None:
            print(f"crun: cannot start a container on this host, so it is not measured: {crun}")
        os.environ["DOCKER_HOST"] = engine.host
        if pytest_args is not None:
            if crun is not None:
                return 1
            env = {**os.environ, "STUDIO_CODE_OCI_RUNTIME": "crun"}
            return subprocess.run(
                [sys.executable, "-m", "pytest", *pytest_args], env=env
            ).returncode
        _bench(engine, n, ["runc"] + ([] if crun else ["crun"]))
        return 0
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
        engine.stop()


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m bench.own_engine")
    p.add_argument("--n", type=int, default=15)
    p.add_argument("--crun", help="the crun binary or wrapper to register (default: PATH's)")
    p.add_argument(
        "--pytest",
        nargs=argparse.REMAINDER,
        help="instead of the bench: run pytest with these arguments against the "
        "own engine with STUDIO_CODE_OCI_RUNTIME=crun",
    )
    p.add_argument(
        "--restarts",
        type=int,
        default=None,
        help="only the engine-restart rows (engine restart -> the killed run claimed again "
        "on the other engine), over this many rounds; without it, both sections (3 rounds)",
    )
    a = p.parse_args()
    if a.restarts is not None:
        raise SystemExit(main(restart_rounds=a.restarts, only_restarts=True))
    raise SystemExit(main(a.n, a.pytest, a.crun))
