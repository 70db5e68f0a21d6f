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
        from api_client.client import _memory_bytes

        job = CodeJob(language=_language(args), code=_read_code(args.file),
                      state_json=_read_state(args), timeout_s=args.timeout,
                      memory_bytes=_memory_bytes(args.memory), cpus=args.cpus)
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
    _limit_args(run)

    val = sub.add_parser("validate", help="the save-time check of a code node file")
    val.add_argument("file")
    val.add_argument("--language", choices=["python", "typescript"])

    sub.add_parser("meta", help="what GET /api/meta/runtime reports")
    for extend in _EXTENSIONS:
        extend(sub)
    return p


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory", help="memory for this node, e.g. 512m (at most "
                   "STUDIO_CODE_MAX_MEMORY; default STUDIO_CODE_MEMORY)")
    p.add_argument("--cpus", type=float, help="CPU share for this node (at most "
                   "STUDIO_CODE_MAX_CPUS; default STUDIO_CODE_CPUS)")


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
                                   user=args.user, kind=args.kind, memory=args.memory,
                                   cpus=args.cpus)
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


def cmd_logs(args: argparse.Namespace, settings: Settings) -> int:
    """A job's logs. With --follow, what it prints goes to stderr AS IT PRINTS IT, until it
    ends; then (as without --follow) ONE JSON object with the stored logs (the truth)."""
    from api_client.client import CodeClient, JobNotFound

    with CodeClient(settings) as client:
        try:
            if args.follow:
                for event in client.follow_logs(args.job_id, timeout_s=args.timeout):
                    if event.event in ("log", "truncated"):
                        sys.stderr.write(event.data)
                        sys.stderr.flush()
            rec = client.status(args.job_id)
        except JobNotFound as e:
            return _not_found(args.job_id, e)
    _print({"job_id": rec.job_id, "status": rec.status.value, "finished": rec.finished,
            "logs": rec.logs, "logs_truncated": rec.logs_truncated, "error": None})
    return 0


def cmd_runs(args: argparse.Namespace, settings: Settings) -> int:
    """Run history from the run store, newest first: ONE JSON object with ``runs`` and
    ``next_cursor`` (pass it to --cursor for the next page)."""
    from datetime import datetime

    from api_client.client import CodeClient

    try:
        since = datetime.fromisoformat(args.since) if args.since else None
        until = datetime.fromisoformat(args.until) if args.until else None
        with CodeClient(settings) as client:
            page = client.list_runs(
                user=args.user, status=args.status or None, language=args.language,
                code_runtime=args.code_runtime, kind=args.kind, since=since, until=until,
                limit=args.limit, cursor=args.cursor)
    except ValueError as e:
        _print({"runs": [], "next_cursor": None,
                "error": {"code": "REQUEST_INVALID", "message": str(e)}})
        return 1
    _print({"runs": [r.model_dump(mode="json") for r in page.runs],
            "next_cursor": page.next_cursor, "error": None})
    return 0


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
    app = worker_app(settings)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # Celery prints its banner to the real stdout
    try:
        code = app.worker_main(argv)
    except SystemExit as e:
        code = e.code
    finally:
        # Celery's worker sends sys.stdout/stderr to its logger; this JSON goes to stdout.
        sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
        if sys.stdout is not None:
            sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    exit_code = code if isinstance(code, int) else (0 if code is None else 1)
    _print({"command": "worker", "status": "stopped", "exit_code": exit_code})
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
    _limit_args(submit)
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

    logs = sub.add_parser("logs", help="a job's logs; --follow: live, until it ends")
    logs.add_argument("job_id")
    logs.add_argument("--follow", "-f", action="store_true",
                      help="print what the job prints to stderr as it prints it")
    logs.add_argument("--timeout", type=float, default=3600.0,
                      help="seconds --follow waits at most (default 3600)")
    logs.set_defaults(handler=cmd_logs)

    runs = sub.add_parser("runs", help="run history, newest first (filters, pages)")
    runs.add_argument("--user", help="only this user's runs")
    runs.add_argument("--status", action="append",
                      choices=["queued", "running", "cancelling", "succeeded", "failed",
                               "timed_out", "cancelled", "invalid"],
                      help="only this status (repeat for several)")
    runs.add_argument("--language", choices=["python", "typescript"])
    runs.add_argument("--code-runtime", choices=["docker", "subprocess"])
    runs.add_argument("--kind", choices=["run", "test"])
    runs.add_argument("--since", help="queued at or after (ISO 8601; no zone: UTC)")
    runs.add_argument("--until", help="queued before (ISO 8601; no zone: UTC)")
    runs.add_argument("--limit", type=int, default=50, help="runs per page (1-200)")
    runs.add_argument("--cursor", help="next_cursor of the previous page")
    runs.set_defaults(handler=cmd_runs)

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
