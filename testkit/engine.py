"""A dockerd of the test's or the bench's own (never the machine's), which it may stop,
restart or kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import (
    needs,
    require,
)
from testkit.reaper import disown, own


class SecondEngine:
    """A dockerd of this test's own, stopped by its pid (and started again with the same
    dirs: a restart). Its containerd is its own too: dockerd starts one under its
    exec-root (there is no system containerd socket for it to use, see ``own_containerd``)."""

    def __init__(self) -> None:
        # a short path: a unix socket path has at most 107 bytes
        self.root = Path(tempfile.mkdtemp(prefix="sc-engine2-", dir="/tmp"))
        self.sock = self.root / "docker.sock"
        self.host = f"unix://{self.sock}"
        self.pidfile = self.root / "docker.pid"
        (self.root / "daemon.json").write_text("{}")  # not the machine's /etc/docker one
        self.log = self.root / "dockerd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        needs("docker", "a second dockerd")
        dockerd = shutil.which("dockerd")
        require(dockerd is not None, "dockerd is not installed")
        assert dockerd is not None
        with open(self.log, "ab") as log:  # a restart appends
            self.proc = subprocess.Popen(
                [
                    dockerd,
                    "--config-file",
                    str(self.root / "daemon.json"),
                    "--data-root",
                    str(self.root / "data"),
                    "--exec-root",
                    str(self.root / "exec"),
                    "--host",
                    self.host,
                    "--pidfile",
                    str(self.pidfile),
                    "--bridge=none",
                    "--iptables=false",
                    "--ip6tables=false",
                    "--containerd-namespace",
                    "studio-engine2",
                    "--containerd-plugins-namespace",
                    "studio-engine2-plugins",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        own(self.proc.pid, remove=self.root)  # the reaper: SIGTERM (its containers too), rm
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.docker("version", check=False).returncode == 0:
                require(self.own_containerd(), "the second dockerd uses another containerd")
                return
            time.sleep(0.3)
        require(False, f"the second dockerd did not start:\n{self.log.read_text()[-3000:]}")

    def docker(self, *args: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["docker", "-H", self.host, *args],
            capture_output=True,
            text=True,
            timeout=kw.pop("timeout", 120),
            **kw,
        )
        if check:
            assert out.returncode == 0, out.stderr
        return out

    def load(self, *images: str) -> None:
        save = subprocess.Popen(["docker", "save", *images], stdout=subprocess.PIPE)
        load = subprocess.run(
            ["docker", "-H", self.host, "load", "-q"],
            stdin=save.stdout,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert save.stdout is not None
        save.stdout.close()
        assert save.wait(60) == 0 and load.returncode == 0, load.stderr

    def own_containerd(self) -> bool:
        """Its containerd is the one it started under its own exec-root."""
        return (self.root / "exec" / "containerd" / "containerd.sock").exists()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the daemon's pid: it stops its containers and its containerd."""
        if self.running():
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.proc is not None:
            disown(self.proc.pid)

    def remove(self) -> None:
        mounted = [
            line.split()[1]
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(self.root))
        ]
        if mounted:  # never rm -rf through a live mount
            pytest.fail(f"the second engine left mounts: {mounted}")
        shutil.rmtree(self.root, ignore_errors=True)


class KillableEngine(SecondEngine):
    """The second engine, which this module may also SIGKILL (its dockerd, and the shim of
    one of its containers: processes it started, found by its own exec-root)."""

    def kill_hard(self, container: str) -> list[int]:
        """SIGKILL dockerd and the containerd-shim of ``container`` (an id); the pids."""
        assert container
        assert self.proc is not None
        shims = self.shims(container)
        assert shims, f"no containerd-shim of {container[:12]} under {self.root}"
        os.kill(self.proc.pid, signal.SIGKILL)
        for pid in shims:
            os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)
        disown(self.proc.pid)
        return [self.proc.pid, *shims]

    def shims(self, container: str) -> list[int]:
        """The containerd-shim processes of ``container`` started by THIS engine (their
        command line names its containerd's socket under this engine's exec-root)."""
        address = str(self.root / "exec" / "containerd" / "containerd.sock")
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv]
            if (
                words
                and os.path.basename(words[0]).startswith("containerd-shim")
                and address in words
                and (not container or container in words)
            ):
                found.append(int(proc.name))
        return found

    def end_leftovers(self) -> list[int]:
        """A stopped engine's processes still alive: a shim (and its sandbox's processes)
        that outlived its dockerd and containerd (a sandbox a pool made through a connection
        kept alive while the engine shut down, which its shutdown never stopped). SIGKILL
        to what this engine started (its exec-root in the shim's command line), their
        cgroups removed. The pids."""
        ended = []
        for shim in self.shims(""):
            children = Path(f"/proc/{shim}/task/{shim}/children")
            try:
                kids = [int(p) for p in children.read_text().split()]
            except OSError:
                kids = []
            for pid in [*kids, shim]:
                try:
                    os.kill(pid, signal.SIGKILL)
                    ended.append(pid)
                except ProcessLookupError:
                    pass
            argv = Path(f"/proc/{shim}/cmdline")
            cid = ""
            try:
                words = argv.read_bytes().split(b"\0")
                cid = words[words.index(b"-id") + 1].decode()
            except (OSError, ValueError, IndexError):
                pass
            time.sleep(0.5)
            for cg in Path("/sys/fs/cgroup").glob(f"*/docker/{cid}") if cid else []:
                try:
                    cg.rmdir()
                except OSError:
                    pass
        return ended

    def unmount_own(self) -> None:
        """What a SIGKILLed dockerd could not unmount, under this engine's root only (its
        data-root's own bind mount, a container's rootfs): deepest first."""
        mounts = [
            line.split()[1]
            for line in Path("/proc/mounts").read_text().splitlines()
            if line.split()[1].startswith(str(self.root) + "/")
        ]
        for mount in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)
