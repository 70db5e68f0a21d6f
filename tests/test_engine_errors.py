"""The docker runtime's one rule of engine errors (executor/runtimes/docker/engine_errors.py):
what each error means at each step of a sandbox's life, with every error code and sentence a
job reports (a stable contract), on errors the Docker SDK really raises: the real engine's
404, 409 and 400, no engine behind a socket, and an engine socket that answers 500 or
nothing at all (a loopback unix socket of the test's own)."""

from __future__ import annotations

import socket
import socketserver
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from executor.errors import InfrastructureLost, RuntimeUnavailable, SandboxRefused

pytestmark = pytest.mark.docker


def _raised(call: Callable[[], Any]) -> BaseException:
    with pytest.raises(Exception) as got:  # noqa: PT011 - any error: its kind is the point
        call()
    return got.value


class _Engine(socketserver.ThreadingUnixStreamServer):
    """A unix socket that answers every request with ``answer`` (None: reads it and never
    answers, until ``close``), as an engine would."""

    daemon_threads = True

    def __init__(self, path: Path, answer: bytes | None) -> None:
        self.answer, self.closing = answer, threading.Event()
        super().__init__(str(path), _Answer)
        self.path = path
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.closing.set()
        self.shutdown()
        self.server_close()


class _Answer(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        engine: _Engine = self.server  # type: ignore[assignment]
        self.request.recv(65536)
        if engine.answer is None:
            engine.closing.wait(30)
        else:
            self.request.sendall(engine.answer)


@pytest.fixture(scope="module")
def errors(docker_client: Any, python_image: str, tmp_path_factory: Any) -> Iterator[dict]:
    """One real error of each kind, by kind."""
    import docker

    api = docker_client.api
    name = f"studio-code-errors-{uuid.uuid4().hex[:8]}"
    made = api.create_container(python_image, command=["true"], name=name)["Id"]
    where = tmp_path_factory.mktemp("engine")
    failing = _Engine(
        where / "500.sock",
        b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
        b'Content-Length: 27\r\nConnection: close\r\n\r\n{"message":"engine failed"}',
    )
    silent = _Engine(where / "silent.sock", None)
    try:

        def client(path: Path, timeout: float = 5) -> Any:
            return docker.APIClient(base_url=f"unix://{path}", version="1.41", timeout=timeout)

        yield {
            "gone": _raised(lambda: api.inspect_container(f"{name}-nothing")),
            "no_image": _raised(
                lambda: api.create_container(f"studio-code-no-such:{uuid.uuid4().hex[:6]}")
            ),
            "conflict": _raised(lambda: api.create_container(python_image, ["true"], name=name)),
            "refused": _raised(
                lambda: api.create_container(python_image, ["true"], name="bad name!")
            ),
            "failed": _raised(lambda: client(failing.path).start(made)),
            "down": _raised(lambda: client(where / "nothing.sock").start(made)),
            "no_answer": _raised(lambda: client(silent.path, timeout=0.3).start(made)),
            "stream": _raised(_broken_pipe),
        }
    finally:
        failing.close()
        silent.close()
        api.remove_container(made, force=True)


def _broken_pipe() -> None:
    a, b = socket.socketpair()
    b.close()
    with a:
        for _ in range(64):
            a.sendall(b"x" * 65536)


def test_each_engine_error_is_of_its_kind(errors: dict) -> None:
    from executor.runtimes.docker.engine_errors import kind

    assert {name: kind(e) for name, e in errors.items()} == {name: name for name in errors}
    assert kind(ValueError("ours")) is None  # not the engine's: passed on as it is


def _said(e: BaseException, step: str, job: str = "j1") -> tuple[str, str, str]:
    from executor.runtimes.docker.engine_errors import meaning

    got = meaning(e, step, job, image="img:1")  # type: ignore[arg-type]
    if got is None:
        return ("passed on", "", "")
    if isinstance(got, InfrastructureLost):  # its message wraps the detail: one sentence
        return (type(got).__name__, got.cause, got.detail)
    return (type(got).__name__, "", got.message)


def test_what_each_error_means_at_each_step(errors: dict) -> None:
    """Before the input (create, start) an engine's answer is a refusal, never run again;
    while it runs, the infrastructure's loss (run again) or, for a 4xx, a fault; an engine
    away is lost at every step. The codes and the sentences, word for word."""
    from executor.runtimes.docker.engine_errors import docker_down

    e = errors
    refused = "The Docker engine refused to {step} the sandbox of job j1, so the job did not run"
    for step in ("create", "start"):
        for what in ("refused", "failed") + (("gone",) if step == "create" else ()):
            name, cause, message = _said(e[what], step)
            assert (name, cause) == ("SandboxRefused", ""), (step, what)
            assert message.startswith(refused.format(step=step)), message
            assert "STUDIO_CODE_OCI_RUNTIME" in message
    for step in ("create", "start", "run"):
        assert _said(e["down"], step) == (
            "InfrastructureLost",
            InfrastructureLost.ENGINE_UNREACHABLE,
            docker_down(e["down"]),
        )
    assert _said(e["no_image"], "create") == (
        "RuntimeUnavailable",
        "",
        "The image img:1 is missing: build it with `make image`.",
    )
    for what in ("conflict", "no_answer", "stream"):  # the caller's to decide, or raw
        assert _said(e[what], "create") == ("passed on", "", ""), what
    # a 409 at start ("container is marked for removal"): removed from outside between its
    # create and its start, lost to the infrastructure, never a refusal a re-run would meet
    assert _said(e["conflict"], "start") == (
        "InfrastructureLost",
        InfrastructureLost.SANDBOX_VANISHED,
        f"the sandbox of job j1 was being removed before it started ({e['conflict']})",
    )
    for step in ("start", "run"):
        assert _said(e["gone"], step) == (
            "InfrastructureLost",
            InfrastructureLost.SANDBOX_VANISHED,
            f"the sandbox of job j1 was removed while it ran ({e['gone']})",
        )
        for what in ("no_answer", "stream"):
            assert _said(e[what], step) == (
                "InfrastructureLost",
                InfrastructureLost.STREAM_BROKEN,
                f"the sandbox's stream to the engine broke: {e[what]}",
            )
    assert _said(e["failed"], "run") == (
        "InfrastructureLost",
        InfrastructureLost.ENGINE_ERROR,
        f"the engine failed the sandbox: {e['failed']}",
    )
    for what in ("refused", "conflict"):
        assert _said(e[what], "run") == (
            "RuntimeUnavailable",
            "",
            f"The sandbox for job j1 failed to run: {e[what]}. Check the Docker engine "
            "(docker info) and the image.",
        )


def test_a_refusal_is_never_run_again_and_a_loss_is(errors: dict) -> None:
    """What the job path does with them (executor/errors.py): a refusal is not the
    infrastructure's loss; the engine's failure while it ran is."""
    from executor.runtimes.docker.engine_errors import meaning

    refusal = meaning(errors["failed"], "start", "j1")
    lost = meaning(errors["failed"], "run", "j1")
    assert isinstance(refusal, SandboxRefused) and not isinstance(refusal, InfrastructureLost)
    assert isinstance(lost, InfrastructureLost) and isinstance(lost, RuntimeUnavailable)
