"""The runner that executes ONE Python code node inside the sandbox.

This file's text is passed to ``python3 -c`` (it is not imported by the server and never
baked into an image), so any image with python3 works. It uses the standard library only.

Protocol (the same for every language): stdin is one JSON header line ``{"code": ...}``
followed by the state as JSON. The user's code is data: it is compiled under the file name
``main.py`` so tracebacks carry its own line numbers; it is never pasted into this source.
Everything the code prints (fd 1 and fd 2, child processes included) goes to stderr and is
kept as logs; the result is ONE JSON object written to the original stdout, saved first.
"""

# Only what every call needs is imported up front: asyncio, inspect and traceback cost tens
# of milliseconds, so they are imported when a call needs them.
import json
import os
import sys

FILENAME = "main.py"
#: the end-of-logs mark the host asked for in the header ("end"), written to stderr after
#: the result: the host knows the result and the logs are complete without waiting for the
#: process and its container to end (a pre-started sandbox answers at once)
_END = b""


def _emit(fd, payload):
    _write_all(fd, json.dumps(payload, ensure_ascii=False).encode("utf-8"))


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _user_traceback(exc):
    """The traceback of ``exc`` limited to frames of the user's code (and what they call)."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return "".join(lines).rstrip()


def _fail(fd, code, message):
    _emit(fd, {"ok": False, "error": {"code": code, "message": message}})
    return 0


def _run(result_fd, output_max_bytes):
    raw = sys.stdin.buffer.read()
    header_raw, _, state_raw = raw.partition(b"\n")
    del raw
    header = json.loads(header_raw)
    code = header["code"]
    global _END
    _END = str(header.get("end") or "").encode("utf-8")
    try:
        state = json.loads(state_raw) if state_raw.strip() else {}
    except ValueError as e:
        return _fail(result_fd, "CODE_INVALID", f"The state is not valid JSON: {e}.")
    del state_raw

    import linecache  # small; lets tracebacks show the user's source lines

    linecache.cache[FILENAME] = (len(code), None, code.splitlines(True), FILENAME)
    try:
        compiled = compile(code, FILENAME, "exec", dont_inherit=True)
    except SyntaxError as e:
        return _fail(
            result_fd,
            "CODE_INVALID",
            f"SyntaxError at line {e.lineno}: {e.msg}. Fix the code and save it again.",
        )

    namespace = {"__name__": "__code_node__", "__file__": FILENAME}
    try:
        exec(compiled, namespace)
        main = namespace.get("main")
        if not callable(main):
            return _fail(
                result_fd,
                "CODE_INVALID",
                "The code defines no main(state) function: add `def main(state):` "
                "returning the node's output.",
            )
        out = main(state)
        if hasattr(out, "__await__"):
            import asyncio

            out = asyncio.run(_await(out))
    except MemoryError:
        return _fail(result_fd, "CODE_MEMORY", "The code ran out of memory (MemoryError).")
    except SystemExit as e:
        return _fail(
            result_fd,
            "CODE_ERROR",
            f"The code called sys.exit({e.code!r}) before main returned: "
            "return the output from main instead of exiting.",
        )
    except BaseException as e:  # noqa: BLE001 - everything the user's code raises is a result
        return _fail(result_fd, "CODE_ERROR", _user_traceback(e))

    try:
        data = json.dumps(out, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned a value that is not JSON ({type(out).__name__}: {e}): return "
            "dicts, lists, strings, numbers, booleans or None.",
        )
    if len(data) > output_max_bytes:
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned {len(data)} bytes of JSON, more than the limit of "
            f"{output_max_bytes}: return less, or keep large data elsewhere.",
        )
    _write_all(result_fd, b'{"ok": true, "output": ' + data.encode("utf-8") + b"}")
    return 0


async def _await(awaitable):
    return await awaitable


def _bootstrap():
    # Keep the real stdout for the result only; from here on, fd 1 IS stderr, so print(),
    # os.write(1, ...) and child processes all land in the logs, never in the result.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    output_max_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16 * 1024 * 1024
    sys.argv = [FILENAME]
    try:
        _run(result_fd, output_max_bytes)
    except MemoryError:
        _fail(result_fd, "CODE_MEMORY", "The code ran out of memory (MemoryError).")
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.close(result_fd)
        if _END:
            try:
                _write_all(2, _END)
            except OSError:
                pass
    # Skip interpreter teardown: threads or atexit hooks the code left must not alter the result.
    os._exit(0)


_bootstrap()
