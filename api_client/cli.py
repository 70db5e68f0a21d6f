"""``studio-code``: run, validate and inspect Code nodes; every command prints ONE JSON object.

Exit status: 0 only when the command did what was asked (``run``: status succeeded).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, cast

from executor.errors import ErrorCode, StudioCodeError
from executor.models import CodeJob, Language
from executor.settings import Settings, load_settings

EXTENSIONS = {".py": "python", ".ts": "typescript", ".mts": "typescript", ".tsx": "typescript"}


def _print(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def _failure(code: ErrorCode, message: str, status: str = "failed", runtime: str = "") -> dict:
    return {
        "status": status,
        "output": None,
        "error": {"code": str(code), "message": message},
        "logs": "",
        "runtime": runtime,
        "duration_ms": 0,
        "warnings": [],
    }


def _language(args: argparse.Namespace) -> Language:
    if args.language:
        return cast(Language, args.language)
    return cast(Language, EXTENSIONS.get(Path(args.file).suffix.lower(), "python"))


def _read_code(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StudioCodeError(
            f"Cannot read {path}: {e}. Give the path of a UTF-8 source file.",
            code=ErrorCode.CODE_INVALID,
        ) from e


def _read_state(args: argparse.Namespace) -> str:
    if args.state_file:
        try:
            text = Path(args.state_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise StudioCodeError(f"Cannot read --state-file {args.state_file}: {e}.",
                                  code=ErrorCode.CODE_INVALID) from e
        where = f"--state-file {args.state_file}"
    else:
        text, where = args.state or "{}", "--state"
    try:
        json.loads(text)
    except ValueError as e:
        raise StudioCodeError(f"{where} is not valid JSON: {e}. Pass a JSON object.",
                              code=ErrorCode.CODE_INVALID) from e
    return text


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from executor.service import Executor

    try:
        job = CodeJob(language=_language(args), code=_read_code(args.file),
                      state_json=_read_state(args), timeout_s=args.timeout)
    except StudioCodeError as e:
        _print(_failure(e.code, e.message, "invalid", settings.code_runtime))
        return 1
    result = Executor(settings).run(job)
    _print(result.cli_dict())
    return 0 if result.status == "succeeded" else 1


def cmd_validate(args: argparse.Namespace, settings: Settings) -> int:
    from executor.service import Executor

    language = _language(args)
    try:
        problems = Executor(settings).check_code(_read_code(args.file), language)
    except StudioCodeError as e:
        _print({"ok": False, "language": language, "error": e.to_dict(), "problems": []})
        return 1
    error = None
    if problems:
        error = {"code": str(ErrorCode.CODE_INVALID),
                 "message": "; ".join(str(p) for p in problems)}
    _print({
        "ok": not problems,
        "language": language,
        "error": error,
        "problems": [{"line": p.line, "message": p.message} for p in problems],
    })
    return 0 if not problems else 1


def cmd_meta(args: argparse.Namespace, settings: Settings) -> int:
    from executor.meta import runtime_meta
    from executor.service import Executor

    meta = runtime_meta(Executor(settings), fresh=True)
    _print(meta)
    return 0


COMMANDS = {"run": cmd_run, "validate": cmd_validate, "meta": cmd_meta}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="studio-code", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run a code node file once, here (no queue)")
    run.add_argument("file")
    run.add_argument("--language", choices=["python", "typescript"])
    state = run.add_mutually_exclusive_group()
    state.add_argument("--state", help="the state as JSON (default {})")
    state.add_argument("--state-file", help="a file holding the state as JSON")
    run.add_argument("--timeout", type=float, help="seconds (capped by STUDIO_CODE_MAX_SECONDS)")

    val = sub.add_parser("validate", help="the save-time check of a code node file")
    val.add_argument("file")
    val.add_argument("--language", choices=["python", "typescript"])

    sub.add_parser("meta", help="what GET /api/meta/runtime reports")
    for extend in _EXTENSIONS:
        extend(sub)
    return p


#: other modules (the queue's commands) add subcommands here
_EXTENSIONS: list[Any] = []


# --- the queue's commands: submit, status, cancel, worker ---------------------------------


def _record_dict(rec: Any) -> dict[str, Any]:
    """A run-store record as the queue commands print it (the ``run`` keys + the job's)."""
    d = rec.model_dump(mode="json", exclude={"code", "state_json"})
    d["runtime"] = d.get("runtime") or d.get("code_runtime")
    return d


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from api_client.client import CodeClient

    try:
        code, state = _read_code(args.file), _read_state(args)
    except StudioCodeError as e:
        _print(_failure(e.code, e.message, "invalid", settings.code_runtime))
        return 1
    with CodeClient(settings) as client:
        try:
            job_id = client.submit(code, _language(args), state, timeout_s=args.timeout,
                                   user=args.user, kind=args.kind)
        except StudioCodeError as e:
            status = "invalid" if e.code is ErrorCode.CODE_INVALID else "failed"
            out = _failure(e.code, e.message, status, settings.code_runtime)
            if getattr(e, "retry_after_s", None) is not None:
                out["retry_after_s"] = e.retry_after_s  # type: ignore[attr-defined]
            _print(out)
            return 1
        if not args.wait:
            rec = client.status(job_id)
            _print({"job_id": job_id, "status": rec.status.value, "kind": args.kind,
                    "queue": "code.test" if args.kind == "test" else "code.run"})
            return 0
        rec = client.wait(job_id, args.wait_timeout)
        _print(_record_dict(rec))
        return 0 if rec.status == "succeeded" else 1


def _not_found(job_id: str, e: Exception) -> int:
    _print({"job_id": job_id, "status": None, "error": {"code": "NOT_FOUND", "message": str(e)}})
    return 1


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from api_client.client import CodeClient, JobNotFound

    with CodeClient(settings) as client:
        try:
            rec = client.status(args.job_id)
        except JobNotFound as e:
            return _not_found(args.job_id, e)
    _print(_record_dict(rec))
    return 0


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    from api_client.client import CodeClient, JobNotFound

    with CodeClient(settings) as client:
        try:
            status = client.cancel(args.job_id)
        except JobNotFound as e:
            return _not_found(args.job_id, e)
    ok = status in ("cancelling", "cancelled")
    out: dict[str, Any] = {"job_id": args.job_id, "status": status.value, "error": None}
    if not ok:
        out["error"] = {"code": "NOT_CANCELLED",
                        "message": f"The job had already ended ({status.value}) before the "
                        "cancel; nothing was stopped."}
    _print(out)
    return 0 if ok else 1


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    """Run a Celery worker (``celery -A worker worker`` with this process's Settings). Its
    banner and logs go to stderr; ONE JSON object goes to stdout when it stops."""
    import os

    from worker.app import worker_app

    extra = list(args.celery_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    argv = ["worker"]
    if not any(a in ("-Q", "--queues") or a.startswith(("-Q", "--queues=")) for a in extra):
        argv += ["-Q", "code.test,code.run"]
    if not any(a in ("-P", "--pool") or a.startswith(("-P", "--pool=")) for a in extra):
        argv += ["--pool", "prefork"]
    argv += extra
    from celery import signals

    app = worker_app(settings)
    controllers: list[Any] = []

    def remember(sender: Any = None, **_: Any) -> None:
        controllers.append(sender)

    signals.worker_init.connect(remember, weak=False)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # Celery prints its banner to the real stdout
    error: str | None = None
    try:
        code = app.worker_main(argv)
    except SystemExit as e:
        code = e.code
    except Exception as e:  # noqa: BLE001 - reported in the JSON line, exit non-zero
        code, error = 1, f"{type(e).__name__}: {e}"
    finally:
        signals.worker_init.disconnect(remember)
        # Celery's worker sends sys.stdout/stderr to its logger; this JSON goes to stdout.
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        if sys.stdout is not None:
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    exit_code = code if isinstance(code, int) else (0 if code is None else 1)
    # worker_main returns nothing: the worker's own exit code says whether it stopped
    # because of an error (Celery's "Unrecoverable error" sets it to 1).
    worker_code = getattr(controllers[-1], "exitcode", None) if controllers else None
    if isinstance(worker_code, int) and worker_code != 0 and exit_code == 0:
        exit_code = worker_code
    out: dict[str, Any] = {"command": "worker", "status": "stopped", "exit_code": exit_code}
    if exit_code != 0:
        out["status"] = "failed"
        out["error"] = {"code": "WORKER_FAILED",
                        "message": (error or "The worker stopped because of an error")
                        + ": see its log above (stderr); a supervisor should restart it."}
    _print(out)
    return 0 if exit_code == 0 else 1


def _queue_commands(sub: Any) -> None:
    submit = sub.add_parser("submit", help="queue a code node file for a worker")
    submit.add_argument("file")
    submit.add_argument("--language", choices=["python", "typescript"])
    state = submit.add_mutually_exclusive_group()
    state.add_argument("--state", help="the state as JSON (default {})")
    state.add_argument("--state-file", help="a file holding the state as JSON")
    submit.add_argument("--timeout", type=float,
                        help="seconds (capped by STUDIO_CODE_MAX_SECONDS)")
    submit.add_argument("--kind", choices=["run", "test"], default="run",
                        help="run: a workflow run (queue code.run); test: an editor test "
                        "call (queue code.test, rate limited per user)")
    submit.add_argument("--user", default="", help="who asks (editor test calls' limit)")
    submit.add_argument("--wait", action="store_true", help="wait for the result; print it")
    submit.add_argument("--wait-timeout", type=float, default=600.0,
                        help="seconds --wait waits at most (default 600)")
    submit.set_defaults(handler=cmd_submit)

    status = sub.add_parser("status", help="a queued job's status and result")
    status.add_argument("job_id")
    status.set_defaults(handler=cmd_status)

    cancel = sub.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id")
    cancel.set_defaults(handler=cmd_cancel)

    worker = sub.add_parser(
        "worker", help="run a worker: celery worker arguments follow (-c, -n, --loglevel...)",
        add_help=False, prefix_chars="+")  # every argument, options included, is Celery's
    worker.add_argument("celery_args", nargs=argparse.REMAINDER)
    worker.set_defaults(handler=cmd_worker)


_EXTENSIONS.append(_queue_commands)


# --- the HTTP API: serve --------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Run the studio's HTTP routes (api_client.http) with uvicorn until SIGTERM / Ctrl-C.
    uvicorn logs to stderr; ONE JSON object goes to stdout when it stops."""
    try:
        from api_client.http import serve
    except ImportError as e:
        _print(_failure(ErrorCode.RUNTIME_UNAVAILABLE,
                        f"The HTTP API needs the http extra ({e}): pip install "
                        "'studio-code[http]'."))
        return 2
    serve(settings, args.host, args.port, args.log_level)
    _print({"command": "serve", "status": "stopped", "host": args.host, "port": args.port})
    return 0


def _serve_command(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the HTTP API (/api/meta/runtime, /api/code/*, "
                           "/api/runs*, /healthz/*, /metrics) with uvicorn")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1; the API trusts the "
                       "X-Studio-User header, so only the studio may reach it)")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug"])
    serve.set_defaults(handler=cmd_serve)


_EXTENSIONS.append(_serve_command)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings()
    except StudioCodeError as e:
        _print(_failure(e.code, e.message))
        return 2
    handler = COMMANDS.get(args.command) or args.handler
    return int(handler(args, settings))


if __name__ == "__main__":
    sys.exit(main())
