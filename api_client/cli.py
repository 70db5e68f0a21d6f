"""``studio-code``: run, validate and inspect Code nodes; every command prints ONE JSON object.

Exit status: 0 only when the command did what was asked (``run``: status succeeded).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from executor.errors import ErrorCode, StudioCodeError
from executor.models import CodeJob
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


def _language(args: argparse.Namespace) -> str:
    if args.language:
        return args.language
    return EXTENSIONS.get(Path(args.file).suffix.lower(), "python")


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
