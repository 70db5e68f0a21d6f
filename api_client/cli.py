"""``studio-code``: run, validate and inspect Code nodes; every command prints ONE JSON object.

Every outcome is one JSON object on stdout, refusals of the command line included (logs go
to stderr). ``run`` (and a refused ``submit``) prints the run's object: ``job_id``,
``language``, ``status``, ``output``, ``error`` ({code, message} or null), ``logs``,
``runtime``, ``code_runtime``, ``duration_ms``, ``warnings``, ``trace``, ``usage``... Any other
command's refusal is ``{"ok": false, "command": ..., "error": {code, message}}``.

Exit status: 0 only when the command did what was asked (``run``: status succeeded); 1 when
the input or the outcome is refused; 2 when the command line or a setting is malformed.
Only ``--help`` prints text.

Only what a command needs is imported, and only when it runs: ``--help`` and ``validate``
load no database driver, Redis, Celery or Docker SDK; ``run`` loads no queue or store.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from executor.errors import CodeInvalid, ErrorCode, StudioCodeError
from executor.floors import MIN_CPUS, MIN_MEMORY_BYTES

if TYPE_CHECKING:
    from executor.languages import base as languages
    from executor.models import Language
    from executor.settings import Settings

log = logging.getLogger("studio_code.cli")

EXTENSIONS = {".py": "python", ".ts": "typescript", ".mts": "typescript", ".tsx": "typescript"}
#: a malformed command line (the HTTP API's code for a malformed request)
REQUEST_INVALID = "REQUEST_INVALID"
#: commands whose refusals print the run's object
JOB_COMMANDS = ("run", "submit")
#: commands that run until stopped (every other one does one thing and exits)
SERVICES = ("serve", "worker", "sockguard")


class UsageError(Exception):
    """Raised when the command line does not parse (argparse's own refusal, as JSON)."""

    def __init__(self, command: str | None, message: str) -> None:
        super().__init__(message)
        self.command = command
        self.message = message


class Parser(argparse.ArgumentParser):
    """argparse, except that a refusal raises UsageError instead of printing text."""

    def error(self, message: str) -> NoReturn:
        words = self.prog.split()
        command = words[1] if len(words) > 1 else None
        raise UsageError(
            command, f"{self.prog}: {message}. Run `{self.prog} --help` to see what it takes."
        )


def _print(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False) + "\n")


def _refusal(
    command: str | None,
    code: str,
    message: str,
    *,
    status: str = "invalid",
    runtime: str = "",
    language: str | None = None,
) -> dict[str, Any]:
    """The object a refused command prints: the run's (every field, a new job id) for
    ``run`` and ``submit``; ``{ok: false, command, error}`` for the others."""
    error = {"code": str(code), "message": message}
    if command not in JOB_COMMANDS:
        out: dict[str, Any] = {"ok": False, "command": command, "error": error}
        if command == "validate":
            out.update(language=language, problems=[])
        return out
    from executor.models import CodeResult, Status

    # Every field of CodeResult, from the model itself, so the shape cannot drift.
    result = CodeResult.ended(
        uuid.uuid4().hex, "python", Status(status), ErrorCode.CODE_INVALID, message, runtime=runtime
    )
    return {**result.cli_dict(), "language": language, "error": error}


def _language(args: argparse.Namespace) -> Language:
    """The --language, else the one the file's extension names; CodeInvalid otherwise."""
    if args.language:
        return args.language  # type: ignore[no-any-return]  # argparse choices
    suffix = Path(args.file).suffix.lower()
    if suffix in EXTENSIONS:
        return EXTENSIONS[suffix]  # type: ignore[return-value]
    known = ", ".join(f"{ext} ({lang})" for ext, lang in EXTENSIONS.items())
    what = f"the extension {suffix!r}" if suffix else "no extension"
    raise CodeInvalid(
        f"{args.file} has {what}, which names no Code node language: use "
        f"{known}, or say which with --language python|typescript."
    )


def _read_code(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CodeInvalid(f"Cannot read {path}: {e}. Give the path of a UTF-8 source file.") from e


def _read_state(args: argparse.Namespace, settings: Settings) -> str:
    """The state JSON of --state / --state-file, under the one state rule (executor.inputs:
    JSON, no NaN or Infinity, an object, at most STUDIO_CODE_STATE_MAX_BYTES)."""
    from executor.inputs import state_json

    if args.state_file:
        try:
            text = Path(args.state_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise CodeInvalid(
                f"Cannot read --state-file {args.state_file}: {e}. Give the "
                "path of a UTF-8 file holding a JSON object."
            ) from e
        where = f"--state-file {args.state_file}"
    else:
        text, where = ("{}" if args.state is None else args.state), "--state"
    return state_json(text, max_bytes=settings.code_state_max_bytes, source=where)


def _timeout(args: argparse.Namespace, settings: Settings) -> float:
    """--timeout under the one timeout rule (executor.inputs): a number above 0, capped."""
    from executor.inputs import timeout_s

    return timeout_s(args.timeout, max_seconds=settings.code_max_seconds, source="--timeout")


def _limits(
    args: argparse.Namespace, settings: Settings, *, groups: bool = False
) -> tuple[int | None, float | None]:
    """--memory and --cpus under the one rule of the node's limits (executor.inputs):
    each between its floor and the server's cap (``groups``: the widest of the worker
    groups', executor.groups, as a submit's), or none for the default."""
    from executor.groups import groups_of, widest
    from executor.inputs import check_cpus, check_memory, memory_bytes

    max_memory, max_cpus = (
        widest(groups_of(settings)) if groups else (settings.max_memory_bytes, settings.max_cpus)
    )
    memory = memory_bytes(args.memory)
    check_memory(memory, max_bytes=max_memory, source="--memory")
    check_cpus(args.cpus, max_cpus=max_cpus, source="--cpus")
    return memory, args.cpus


def cmd_run(args: argparse.Namespace, settings: Settings) -> int:
    from executor.models import CodeJob
    from executor.service import Executor

    language: str | None = args.language
    try:
        language = _language(args)
        memory, cpus = _limits(args, settings)
        job = CodeJob(
            language=language,
            code=_read_code(args.file),
            state_json=_read_state(args, settings),
            timeout_s=_timeout(args, settings),
            memory_bytes=memory,
            cpus=cpus,
        )
    except StudioCodeError as e:
        _print(_refusal("run", e.code, e.message, runtime=settings.code_runtime, language=language))
        return 1
    result = Executor(settings).run(job)
    _print(result.cli_dict())
    return 0 if result.status == "succeeded" else 1


def _image_facts(settings: Settings, language: languages.Language) -> languages.ImageFacts:
    """``language``'s image facts as the runtime STUDIO_CODE_RUNTIME names reads them,
    asked of its class (no runtime is made); none for an unknown runtime."""
    from executor.languages.base import NO_FACTS
    from executor.service import runtime_class

    cls = runtime_class(settings)
    return NO_FACTS if cls is None else cls.image_facts(settings, language)


def cmd_validate(args: argparse.Namespace, settings: Settings) -> int:
    # The language's own check, without an Executor: no runtime (Docker SDK) is loaded
    # unless the check asks for the image's facts (code that imports something).
    from executor.languages import offered_language
    from executor.languages.base import AskedLater

    language: str | None = args.language
    try:
        language = _language(args)
        lang = offered_language(language, settings)
        facts = AskedLater(lambda: _image_facts(settings, lang))
        problems = lang.check(_read_code(args.file), settings, facts)
    except StudioCodeError as e:
        _print(_refusal("validate", e.code, e.message, language=language))
        return 1
    error = None
    if problems:
        error = {
            "code": str(ErrorCode.CODE_INVALID),
            "message": "; ".join(str(p) for p in problems),
        }
    _print(
        {
            "ok": not problems,
            "language": language,
            "error": error,
            "problems": [{"line": p.line, "message": p.message} for p in problems],
        }
    )
    return 0 if not problems else 1


class _NoStoreYet:
    """The run store ``meta`` reports when its SQLite file does not exist (nothing was ever
    submitted to it): its URL, and no id, as the API shows a store it cannot read. Opening
    it would create it, and ``meta`` changes nothing."""

    def __init__(self, url: str, why: StudioCodeError) -> None:
        from executor.store.sql import describe_url

        self.url = describe_url(url)
        self.why = why

    def describe(self) -> str:
        return self.url

    @property
    def store_id(self) -> str | None:
        raise self.why

    def close(self) -> None:
        pass


def cmd_meta(args: argparse.Namespace, settings: Settings) -> int:
    """The document of GET /api/meta/runtime, built by the same code (``CodeClient.meta``)
    from this process's settings: the run store, the workers and the fair share read from
    STUDIO_REDIS_URL (``workers: {"error": ...}`` when Redis cannot be read, as the API
    says it), the admin's view (``fairness.top`` names the users: whoever runs this has the
    settings to read them). Asked fresh: each language's test program runs, and
    ``engine.sandbox`` says what the kernel applied inside one sandbox."""
    from typing import cast

    from api_client.client import CodeClient
    from executor.errors import StoreUnavailable
    from executor.store import RunStore

    try:
        client = CodeClient(settings, create_store=False)  # reading creates nothing
    except StoreUnavailable as e:
        none = cast(RunStore, _NoStoreYet(settings.sqlalchemy_url, e))
        client = CodeClient(settings, store=none)
    with client:
        meta = client.meta(fresh=True, names=True)
    _print(meta)
    return 0


#: commands a parser is built for alone when the command line names them (see build_parser)
PARSED_ALONE = ("run", "validate")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's, or only ``command``'s when it is one of
    PARSED_ALONE (``main`` asks so when the command line names it): building every other
    command's parser (and importing the image command's module) was ~9 ms of each
    one-shot ``run`` and ``validate``. The named command parses and refuses exactly as in
    the whole parser; only ``studio-code --help`` lists the commands, and it gets them all."""
    p = Parser(
        prog="studio-code",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in PARSED_ALONE:
        (_run_command if command == "run" else _validate_command)(sub)
        return p
    _run_command(sub)
    _validate_command(sub)
    meta = sub.add_parser(
        "meta", help="what GET /api/meta/runtime reports (an admin's view), asked fresh"
    )
    meta.set_defaults(handler=cmd_meta)
    _queue_commands(sub)
    _serve_command(sub)
    _sockguard_command(sub)
    from api_client.image import add_image_command

    add_image_command(sub, cmd_image)
    return p


def _run_command(sub: Any) -> None:
    run = sub.add_parser("run", help="run a code node file once, here (no queue)")
    run.add_argument("file")
    run.add_argument(
        "--language",
        choices=["python", "typescript"],
        help="default: from the extension (.py; .ts, .mts, .tsx)",
    )
    state = run.add_mutually_exclusive_group()
    state.add_argument("--state", help="the state as a JSON object (default {})")
    state.add_argument("--state-file", help="a file holding the state as a JSON object")
    run.add_argument("--timeout", help="seconds above 0 (capped by STUDIO_CODE_MAX_SECONDS)")
    run.set_defaults(handler=cmd_run)
    _limit_args(run)


def _validate_command(sub: Any) -> None:
    val = sub.add_parser("validate", help="the save-time check of a code node file")
    val.add_argument("file")
    val.add_argument(
        "--language",
        choices=["python", "typescript"],
        help="default: from the extension (.py; .ts, .mts, .tsx)",
    )
    val.set_defaults(handler=cmd_validate)


def cmd_image(args: argparse.Namespace, settings: Settings) -> int:
    """``studio-code image build`` (api_client/image.py): the images built, or the refusal."""
    from api_client.image import ImageRefused, build_images

    try:
        out = build_images(args, settings)
    except ImageRefused as e:
        status = "invalid" if e.exit_status == 2 else "failed"
        _print(_refusal("image", e.code, e.message, status=status))
        return e.exit_status
    _print(out)
    return 0


def _limit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--memory",
        help=f"memory for this node, e.g. 512m (from {MIN_MEMORY_BYTES // 1024**2}m to "
        "STUDIO_CODE_MAX_MEMORY; default STUDIO_CODE_MEMORY)",
    )
    p.add_argument(
        "--cpus",
        type=float,
        help=f"CPU share for this node (from {MIN_CPUS:g} to STUDIO_CODE_MAX_CPUS; default "
        "STUDIO_CODE_CPUS)",
    )


# --- the queue's commands: submit, status, cancel, worker ---------------------------------


def _record_dict(rec: Any) -> dict[str, Any]:
    """A run-store record as the queue commands print it (the ``run`` keys + the job's)."""
    d = rec.model_dump(mode="json", exclude={"code", "state_json"})
    d["runtime"] = d.get("runtime") or d.get("code_runtime")
    return d


def cmd_submit(args: argparse.Namespace, settings: Settings) -> int:
    from api_client.client import CodeClient

    language: str | None = args.language
    try:
        language = _language(args)
        code, state = _read_code(args.file), _read_state(args, settings)
        timeout = _timeout(args, settings)
        _limits(args, settings, groups=True)
        from executor.keys import check_key
        from executor.retry import parse_policy

        retry = parse_policy(args.retry)
        check_key("--tenant", args.tenant)
        check_key("--workflow", args.workflow)
    except StudioCodeError as e:
        _print(
            _refusal("submit", e.code, e.message, runtime=settings.code_runtime, language=language)
        )
        return 1
    with CodeClient(settings) as client:
        try:
            job_id = client.submit(
                code,
                language,
                state,
                timeout_s=timeout,
                user=args.user,
                kind=args.kind,
                memory=args.memory,
                cpus=args.cpus,
                idempotency_key=args.idempotency_key,
                retry=retry,
                tenant=args.tenant,
                workflow=args.workflow,
                group=args.group,
            )
        except StudioCodeError as e:
            from executor.models import Status

            out = _refusal(
                "submit",
                e.code,
                e.message,
                status=Status.ended_by(e.code).value,
                runtime=settings.code_runtime,
                language=language,
            )
            for extra in ("retry_after_s", "job_id"):  # RateLimited's; IdempotencyConflict's
                if getattr(e, extra, None) is not None:
                    out[extra] = getattr(e, extra)
            _print(out)
            return 1
        if not args.wait:
            rec = client.status(job_id)
            _print(
                {
                    "job_id": job_id,
                    "status": rec.status.value,
                    "kind": args.kind,
                    "queue": "code.test" if args.kind == "test" else "code.run",
                    "store": client.store.describe(),
                }
            )
            return 0
        rec = client.wait(job_id, args.wait_timeout, submitted=True)
        _print({**_record_dict(rec), "store": client.store.describe()})
        return 0 if rec.status == "succeeded" else 1


def _not_found(job_id: str, e: Exception) -> int:
    _print({"job_id": job_id, "status": None, "error": {"code": "NOT_FOUND", "message": str(e)}})
    return 1


def cmd_status(args: argparse.Namespace, settings: Settings) -> int:
    from api_client.client import CodeClient, JobNotFound

    with CodeClient(settings, create_store=False) as client:  # reading creates nothing
        try:
            rec = client.status(args.job_id)
        except JobNotFound as e:
            return _not_found(args.job_id, e)
        store = client.store.describe()
        why = client.why_waiting(rec)
    out = {**_record_dict(rec), "store": store}
    if why is not None:
        out["waiting"] = why.as_dict()
    _print(out)
    return 0


def cmd_cancel(args: argparse.Namespace, settings: Settings) -> int:
    from api_client.client import CodeClient, JobNotFound

    with CodeClient(settings, create_store=False) as client:
        try:
            status = client.cancel(args.job_id)
        except JobNotFound as e:
            return _not_found(args.job_id, e)
    ok = status in ("cancelling", "cancelled")
    out: dict[str, Any] = {"job_id": args.job_id, "status": status.value, "error": None}
    if not ok:
        out["error"] = {
            "code": "NOT_CANCELLED",
            "message": f"The job had already ended ({status.value}) before the "
            "cancel; nothing was stopped.",
        }
    _print(out)
    return 0 if ok else 1


WORKER_HELP = """\
usage: studio-code worker [--group NAME] [CELERY WORKER OPTION ...]

Run a Celery worker for Code nodes on this machine, with this process's STUDIO_* settings
(STUDIO_REDIS_URL, STUDIO_DATABASE_URL, STUDIO_ENABLE_CODE_NODES=1, ...). It consumes the
queues code.test (editor test calls, STUDIO_QUEUE_TEST_SLOTS processes of their own) and
code.run (workflow runs, STUDIO_CODE_CONCURRENCY processes) until SIGTERM or Ctrl-C, then
prints ONE JSON object: {"command": "worker", "status": "stopped", "exit_code": N}.
The banner and logs go to stderr.

  --group NAME      the worker group it serves (default: STUDIO_WORKER_GROUP, "default"):
                    another group consumes code.test.NAME and code.run.NAME, and one of
                    its slots holds STUDIO_CODE_MAX_MEMORY and STUDIO_CODE_MAX_CPUS
                    (docs/operations.md, "Worker groups")

Every other argument is passed to `celery worker` unchanged, for example:
  -n NAME           the worker's node name (default celery@HOSTNAME)
  -l, --loglevel L  DEBUG, INFO, WARNING (default), ERROR
  -Q, --queues Q    default: code.test,code.run
  -P, --pool POOL   default: prefork (a cancel kills the job's sandbox in its process)
  --max-tasks-per-child N   a new pool process after N jobs (a bound on a slow leak;
                    docs/operations.md, "A worker that runs for weeks")
Celery's whole list: `celery worker --help`.
"""


def _wants_help(celery_args: list[str]) -> bool:
    args = celery_args[1:] if celery_args[:1] == ["--"] else celery_args
    return any(a in ("-h", "--help") for a in args)


def _rerun_line(data: str) -> str:
    """The attempt boundary ``logs --follow`` prints where a re-run starts."""
    attempt = json.loads(data).get("attempt")
    return (
        f"\n[studio-code: attempt {attempt} starts here: the attempt before did not finish "
        "(lost to the infrastructure, or its worker stopped), so the text above is not "
        "this run's]\n"
    )


def _cut_line(data: str) -> str:
    """What ``logs --follow`` prints when the live view ended before the job."""
    return f"\n[studio-code: the live logs stopped: {json.loads(data).get('message')}]\n"


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
                    elif event.event == "rerun":
                        sys.stderr.write(_rerun_line(event.data))
                    elif event.event == "end" and "reason" in event.data:
                        sys.stderr.write(_cut_line(event.data))
                    sys.stderr.flush()
            rec = client.status(args.job_id)
        except JobNotFound as e:
            return _not_found(args.job_id, e)
    _print(
        {
            "job_id": rec.job_id,
            "status": rec.status.value,
            "finished": rec.finished,
            "logs": rec.logs,
            "logs_truncated": rec.logs_truncated,
            "error": None,
        }
    )
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
                user=args.user,
                status=args.status or None,
                language=args.language,
                code_runtime=args.code_runtime,
                kind=args.kind,
                since=since,
                until=until,
                limit=args.limit,
                cursor=args.cursor,
            )
    except ValueError as e:
        _print(
            {
                "runs": [],
                "next_cursor": None,
                "error": {"code": "REQUEST_INVALID", "message": str(e)},
            }
        )
        return 1
    _print(
        {
            "runs": [r.model_dump(mode="json") for r in page.runs],
            "next_cursor": page.next_cursor,
            "error": None,
        }
    )
    return 0


def _worker_group(extra: list[str], settings: Settings) -> tuple[list[str], Settings]:
    """``--group NAME`` (or ``--group=NAME``) taken out of the worker's arguments, as its
    STUDIO_WORKER_GROUP; raises CodeInvalid for a bad or missing name."""
    from executor.groups import check_name

    rest: list[str] = []
    group: str | None = None
    items = iter(extra)
    for a in items:
        if a == "--group":
            group = next(items, "")
        elif a.startswith("--group="):
            group = a.split("=", 1)[1]
        else:
            rest.append(a)
    if group is None:
        return rest, settings
    try:
        check_name(group)
    except ValueError as e:
        raise CodeInvalid(f"--group: {e}.") from None
    return rest, settings.model_copy(update={"worker_group": group})


def cmd_worker(args: argparse.Namespace, settings: Settings) -> int:
    """Run a Celery worker (``celery -A worker worker`` with this process's Settings). Its
    banner and logs go to stderr; ONE JSON object goes to stdout when it stops."""
    from worker.assembly import worker_app
    from worker.protocol import group_queues

    extra = list(args.celery_args or [])
    if extra and extra[0] == "--":
        extra = extra[1:]
    extra, settings = _worker_group(extra, settings)
    argv = ["worker"]
    if not any(a in ("-Q", "--queues") or a.startswith(("-Q", "--queues=")) for a in extra):
        argv += ["-Q", ",".join(group_queues(settings.worker_group))]
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
    fatal = app.context.fatal  # the worker stopped itself for a reason of its own
    if fatal and exit_code == 0:
        exit_code, error = 1, fatal
    out: dict[str, Any] = {"command": "worker", "status": "stopped", "exit_code": exit_code}
    if exit_code != 0:
        out["status"] = "failed"
        out["error"] = {
            "code": "WORKER_FAILED",
            "message": (error or "The worker stopped because of an error")
            + ": see its log above (stderr); a supervisor should restart it.",
        }
    _print(out)
    return 0 if exit_code == 0 else 1


def _queue_commands(sub: Any) -> None:
    submit = sub.add_parser("submit", help="queue a code node file for a worker")
    submit.add_argument("file")
    submit.add_argument(
        "--language",
        choices=["python", "typescript"],
        help="default: from the extension (.py; .ts, .mts, .tsx)",
    )
    state = submit.add_mutually_exclusive_group()
    state.add_argument("--state", help="the state as a JSON object (default {})")
    state.add_argument("--state-file", help="a file holding the state as a JSON object")
    submit.add_argument("--timeout", help="seconds above 0 (capped by STUDIO_CODE_MAX_SECONDS)")
    submit.add_argument(
        "--kind",
        choices=["run", "test"],
        default="run",
        help="run: a workflow run (queue code.run); test: an editor test "
        "call (queue code.test, rate limited per user)",
    )
    submit.add_argument("--user", default="", help="who asks (editor test calls' limit)")
    submit.add_argument(
        "--tenant",
        default=None,
        help="the run's tenant, a concurrency key (STUDIO_QUEUE_RUN_SHARE_KEY, _TENANT_SLOTS)",
    )
    submit.add_argument(
        "--workflow",
        default=None,
        help="the run's workflow, a concurrency key (STUDIO_QUEUE_RUN_WORKFLOW_SLOTS)",
    )
    submit.add_argument(
        "--idempotency-key",
        default=None,
        help="this submit's key (e.g. a UUID): the same key and request again, by the same "
        "user, within STUDIO_IDEMPOTENCY_TTL_S, give the first job, never a second",
    )
    submit.add_argument(
        "--retry",
        default=None,
        metavar="JSON",
        help='the node\'s retry policy, e.g. \'{"max_attempts": 3, "on": ["CODE_MEMORY"]}\' '
        "(only CODE_TIMEOUT, CODE_MEMORY, CODE_ERROR; a CODE_MEMORY retry asks for more "
        "memory up to STUDIO_CODE_MAX_MEMORY); default STUDIO_CODE_RETRY (off)",
    )
    _limit_args(submit)
    submit.add_argument(
        "--group",
        default=None,
        help="the worker group to run on (default, or one of STUDIO_WORKER_GROUPS); "
        "default: chosen by size (the smallest group whose slot holds --memory and --cpus)",
    )
    submit.add_argument("--wait", action="store_true", help="wait for the result; print it")
    submit.add_argument(
        "--wait-timeout",
        type=float,
        default=600.0,
        help="seconds --wait waits at most (default 600)",
    )
    submit.set_defaults(handler=cmd_submit)

    status = sub.add_parser("status", help="a queued job's status and result")
    status.add_argument("job_id")
    status.set_defaults(handler=cmd_status)

    cancel = sub.add_parser("cancel", help="cancel a queued or running job")
    cancel.add_argument("job_id")
    cancel.set_defaults(handler=cmd_cancel)

    logs = sub.add_parser("logs", help="a job's logs; --follow: live, until it ends")
    logs.add_argument("job_id")
    logs.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="print what the job prints to stderr as it prints it",
    )
    logs.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds --follow waits at most (default 3600)",
    )
    logs.set_defaults(handler=cmd_logs)

    runs = sub.add_parser("runs", help="run history, newest first (filters, pages)")
    runs.add_argument("--user", help="only this user's runs")
    runs.add_argument(
        "--status",
        action="append",
        choices=[
            "queued",
            "running",
            "cancelling",
            "succeeded",
            "failed",
            "timed_out",
            "cancelled",
            "invalid",
        ],
        help="only this status (repeat for several)",
    )
    runs.add_argument("--language", choices=["python", "typescript"])
    runs.add_argument("--code-runtime", choices=["docker", "subprocess"])
    runs.add_argument("--kind", choices=["run", "test"])
    runs.add_argument("--since", help="queued at or after (ISO 8601; no zone: UTC)")
    runs.add_argument("--until", help="queued before (ISO 8601; no zone: UTC)")
    runs.add_argument("--limit", type=int, default=50, help="runs per page (1-200)")
    runs.add_argument("--cursor", help="next_cursor of the previous page")
    runs.set_defaults(handler=cmd_runs)

    worker = sub.add_parser(
        "worker",
        help="run a worker: celery worker arguments follow (-c, -n, --loglevel...)",
        add_help=False,
        prefix_chars="+",
    )  # every argument, options included, is Celery's
    worker.add_argument("celery_args", nargs=argparse.REMAINDER)
    worker.set_defaults(handler=cmd_worker)


# --- the HTTP API: serve --------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    """Run the studio's HTTP API (api_client.http.app) with uvicorn until SIGTERM / Ctrl-C.
    uvicorn logs to stderr; ONE JSON object goes to stdout when it stops."""
    try:
        from api_client.http.app import serve
    except ImportError as e:
        _print(
            _refusal(
                "serve",
                ErrorCode.RUNTIME_UNAVAILABLE,
                f"The HTTP API needs the http extra ({e}): pip install 'studio-code[http]'.",
            )
        )
        return 2
    from api_client.http.limits import bind_refusal

    refusal = bind_refusal(settings, args.host)
    if refusal:  # before binding: a non-loopback port with no shared secret is anyone's
        _print(_refusal(args.command, ErrorCode.RUNTIME_UNAVAILABLE, refusal, status="failed"))
        return 2
    serve(settings, args.host, args.port, args.log_level)
    _print({"command": "serve", "status": "stopped", "host": args.host, "port": args.port})
    return 0


def _serve_command(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the HTTP API (/api/meta/runtime, /api/code/*, "
        "/api/runs*, /healthz/*, /metrics) with uvicorn",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; the API trusts the "
        "X-Studio-User header, so only the studio may reach it: any other "
        "than a loopback address needs STUDIO_API_TOKEN)",
    )
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.set_defaults(handler=cmd_serve)


# --- the Docker socket guard: sockguard ---------------------------------------------------


def cmd_sockguard(args: argparse.Namespace, settings: Settings) -> int:
    """Serve the socket guard (executor.runtimes.docker.sockguard) until SIGTERM / Ctrl-C; its log
    (each refusal and why) goes to stderr, ONE JSON object to stdout when it stops."""
    import signal

    from executor.runtimes.docker.sockguard import Bounds, Policy, SockGuard, policy_table

    if args.print_policy:
        sys.stdout.write(policy_table())
        return 0
    if not args.listen:
        message = (
            "studio-code sockguard: --listen is required (the unix socket to serve). "
            "Run `studio-code sockguard --help` to see what it takes."
        )
        _print(_refusal("sockguard", REQUEST_INVALID, message))
        return 2

    if not os.path.exists(args.upstream):
        _print(
            _refusal(
                "sockguard",
                ErrorCode.RUNTIME_UNAVAILABLE,
                f"The Docker socket {args.upstream} does not exist: start the Docker engine, "
                "or mount its socket into this service and name it with --upstream.",
                status="failed",
            )
        )
        return 2
    images = args.image or [settings.code_image, settings.code_ts_image]
    guard = SockGuard(
        Policy.from_settings(settings, images),
        args.listen,
        args.upstream,
        mode=int(args.mode, 8),
        trace=args.log_requests,
        bounds=Bounds.from_settings(settings),
    )
    guard.bind()
    signal.signal(signal.SIGTERM, lambda *_: guard.close())
    try:
        guard.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        guard.close()
    _print({"command": "sockguard", "status": "stopped", "listen": args.listen})
    return 0


def _sockguard_command(sub: Any) -> None:
    guard = sub.add_parser(
        "sockguard",
        help="serve a Docker socket that passes on only the calls sandboxes need "
        "(give it to the workers instead of the engine's own)",
    )
    guard.add_argument("--listen", help="the unix socket path to serve (required to serve)")
    guard.add_argument(
        "--print-policy",
        action="store_true",
        help="print the table of calls passed on (as docs/security.md has it) and exit",
    )
    guard.add_argument(
        "--upstream", default="/var/run/docker.sock", help="the engine's socket (the real one)"
    )
    guard.add_argument(
        "--image",
        action="append",
        help="a sandbox image a create may name (repeat it; default: STUDIO_CODE_IMAGE and "
        "STUDIO_CODE_TS_IMAGE)",
    )
    guard.add_argument("--mode", default="660", help="the listening socket's mode (octal)")
    guard.add_argument(
        "--log-requests", action="store_true", help="log every call passed on, not only refusals"
    )
    guard.set_defaults(handler=cmd_sockguard)


def _load_settings(command: str) -> Settings:
    """The Settings, loaded as cheaply as a one-shot command can (its start-up is most of
    what ``studio-code validate`` costs):

    * no cyclic garbage collection while pydantic and the Settings class load: they
      allocate many objects and free almost none, so its passes find nothing to collect;
    * a one-shot command in a fresh process skips pydantic's plugin scan (every installed
      package's metadata is read to look for ``pydantic`` entry points; studio-code has
      no plugin) unless PYDANTIC_DISABLE_PLUGINS is set. ``serve`` and ``worker``, which
      run on, keep whatever plugins are installed.
    """
    if command not in SERVICES and "pydantic" not in sys.modules:
        os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    collecting = gc.isenabled()
    gc.disable()
    try:
        from executor.settings import load_settings

        return load_settings()
    finally:
        if collecting:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(words[0] if words else None)
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # parse_args would refuse them in the top parser's name: say the command's
            prog = f"{parser.prog} {args.command}"
            raise UsageError(
                args.command,
                f"{prog}: unrecognized arguments: {' '.join(extra)}"
                f". Run `{prog} --help` to see what it takes.",
            )
    except UsageError as e:
        _print(_refusal(e.command, REQUEST_INVALID, e.message))
        return 2
    if args.command == "worker" and _wants_help(args.celery_args):
        sys.stdout.write(WORKER_HELP)  # ours, not Celery's, and no "stopped" object
        return 0
    try:
        settings = _load_settings(args.command)
    except StudioCodeError as e:
        _print(_refusal(args.command, e.code, e.message, status="failed"))
        return 2
    if args.command in SERVICES:
        # Services log what they use at start (the run store, the queues they serve).
        logging.getLogger("studio_code").setLevel(logging.INFO)
    try:
        return int(args.handler(args, settings))
    except StudioCodeError as e:  # e.g. the run store unreachable: said, not a traceback
        out = _refusal(
            args.command, e.code, e.message, status="failed", runtime=settings.code_runtime
        )
        if getattr(args, "job_id", None):
            out["job_id"] = args.job_id
        _print(out)
        return 1
    except Exception as e:  # noqa: BLE001 - still ONE JSON object; the traceback to stderr
        from executor.outage import is_redis_outage

        if is_redis_outage(e):
            log.warning("studio-code %s: Redis is not reachable: %s", args.command, e)
            _print(
                _refusal(
                    args.command,
                    ErrorCode.RUNTIME_UNAVAILABLE,
                    f"Redis is not reachable ({type(e).__name__}: {e}): check that it is up "
                    "and that STUDIO_REDIS_URL points at it, then try again.",
                    status="failed",
                    runtime=settings.code_runtime,
                )
            )
            return 1
        log.exception("studio-code %s failed", args.command)
        _print(
            _refusal(
                args.command,
                ErrorCode.RUNTIME_UNAVAILABLE,
                f"studio-code {args.command} failed: {type(e).__name__}: {e}. The "
                "log above (stderr) has the details; check that the services in "
                "STUDIO_REDIS_URL and STUDIO_DATABASE_URL are up.",
                status="failed",
                runtime=settings.code_runtime,
            )
        )
        return 1


#: one-shot commands that leave no thread, child, connection or atexit hook behind
NO_TEARDOWN = ("run", "validate")


def entry() -> NoReturn:
    """The ``studio-code`` console script: ``main()``. ``run`` and ``validate`` run without
    cyclic garbage collection (a short process that makes few cycles: its passes would walk
    every pydantic object for nothing) and exit without the interpreter's teardown, which
    frees every module and object one by one (tens of milliseconds, more than some of the
    work) where the kernel frees the process at once. Their output is flushed first; they
    hold nothing that needs closing."""
    one_shot = len(sys.argv) > 1 and sys.argv[1] in NO_TEARDOWN
    if one_shot:
        gc.disable()
    code = main()
    if one_shot:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            sys.exit(code)  # the usual exit reports it (a closed pipe, a closed stream)
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
