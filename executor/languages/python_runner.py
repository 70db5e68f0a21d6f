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
#: the same numbers as executor/outputs.py (this file runs alone, it cannot import them)
OUTPUT_MAX_DEPTH = 100
MESSAGE_MAX_CHARS = 64 * 1024

# Captured before the code runs: a node that replaces json.dumps or os.write cannot change
# how the runner writes. (The code can still write to the result fd itself: the host checks
# every byte it reads, so this runner is not a trust boundary, only a polite one.)
_dumps = json.dumps
_loads = json.loads
_os_write = os.write
_getpid = os.getpid
_exit = os._exit
_isinstance = isinstance
_len = len
_str = str
_dict = dict
_list = list
_tuple = tuple

#: the end-of-logs mark the host asked for in the header ("end"), written to stderr after
#: the result: the host knows the result and the logs are complete without waiting for the
#: process and its container to end (a pre-started sandbox answers at once)
_END = b""

#: the process that runs main: only it answers. A process the code forked (os.fork() with no
#: _exit in the child) returns from main, or raises, into this runner too; its reply beside
#: (or before) the parent's made the outcome a race between the two.
_RUNNER_PID = _getpid()


def _emit(fd, payload):
    # ASCII (lone surrogates escaped): writing a reply can never fail on the text it holds.
    _write_all(fd, _dumps(payload).encode("ascii"))


def _write_all(fd, data):
    # Every write of the runner (the result, the end-of-logs mark) comes here. A forked child
    # that got back into the runner ends at once, writing nothing: no reply, no mark, no
    # flush of buffered streams and no atexit hook (os._exit), so the outcome is the parent's.
    if _getpid() != _RUNNER_PID:
        _exit(0)
    view = memoryview(data)
    while view:
        n = _os_write(fd, view)
        view = view[n:]


def _depth_exceeds(value, limit):
    """True when ``value`` nests more than ``limit`` containers. One level at a time: no
    depth makes it recurse, and a cycle ends at the limit."""
    level = [value]
    depth = 0
    while True:
        containers = [x for x in level if _isinstance(x, (_dict, _list, _tuple))]
        if not containers:
            return False
        depth += 1
        if depth > limit:
            return True
        level = []
        for c in containers:
            level.extend(c.values() if _isinstance(c, _dict) else c)


def _user_traceback(exc):
    """The traceback of ``exc`` limited to frames of the user's code (and what they call)."""
    import traceback

    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != FILENAME:
        tb = tb.tb_next
    lines = traceback.format_exception(type(exc), exc, tb)
    return "".join(lines).rstrip()


def _fail(fd, code, message):
    if _len(message) > MESSAGE_MAX_CHARS:
        message = (
            message[:MESSAGE_MAX_CHARS]
            + f"\n[cut: {_len(message) - MESSAGE_MAX_CHARS} more characters]"
        )
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
        state = _loads(state_raw) if state_raw.strip() else {}
    except ValueError as e:
        return _fail(result_fd, "CODE_INVALID", f"The state is not valid JSON: {e}.")
    except RecursionError:
        return _fail(
            result_fd,
            "CODE_INVALID",
            "The state is nested too deep for Python to read: send a flatter state.",
        )
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
        too_deep = _depth_exceeds(out, OUTPUT_MAX_DEPTH)
    except Exception as e:  # noqa: BLE001 - a container subclass whose iteration raises
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned a value that could not be read ({type(e).__name__}: {e}): return "
            "dicts, lists, strings, numbers, booleans or None.",
        )
    if too_deep:
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned a value nested deeper than {OUTPUT_MAX_DEPTH} levels of objects "
            "and arrays: flatten it.",
        )
    try:
        data = _dumps(out, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        if "integer string conversion" in _str(e):
            return _fail(
                result_fd,
                "CODE_OUTPUT_INVALID",
                "main returned an integer with more than "
                f"{sys.get_int_max_str_digits() or 4300} digits: return it as a string.",
            )
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned a value that is not JSON ({type(out).__name__}: {e}): return "
            "dicts, lists, strings, numbers, booleans or None.",
        )
    try:
        encoded = data.encode("utf-8")
    except UnicodeEncodeError as e:
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned a string with a lone surrogate (\\u{ord(data[e.start]):04x}), which "
            "is not valid Unicode and cannot be stored: return well-formed text.",
        )
    if _len(encoded) > output_max_bytes:
        return _fail(
            result_fd,
            "CODE_OUTPUT_INVALID",
            f"main returned {_len(encoded)} bytes of JSON, more than the limit of "
            f"{output_max_bytes}: return less, or keep large data elsewhere.",
        )
    _write_all(result_fd, b'{"ok": true, "output": ' + encoded + b"}")
    return 0


async def _await(awaitable):
    return await awaitable


def _preimport():
    """A pre-started sandbox (its pool sets STUDIO_PREIMPORT; a cold run never does) imports
    the heavy modules now, while it waits for its one job's stdin, so the job does not pay
    for them. ``image``: every module of the packages the image lists. The variable is
    removed first: the job sees the environment a cold run has. A module that fails to
    import is left for the job's own import to report. Once the job's stdin has bytes, the
    rest is left to the job (it imports what it uses): a job that comes early waits for one
    module's import at most, not for the whole list."""
    names = os.environ.pop("STUDIO_PREIMPORT", "")
    if names == "image":
        try:
            with open("/usr/share/studio-code/modules.json", encoding="utf-8") as f:
                listed = _loads(f.read())["packages"]
            names = ",".join(m for modules in listed.values() for m in modules)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
    if not names:
        return
    import importlib
    import select

    for name in names.split(","):
        if select.select([0], [], [], 0)[0]:
            return  # the job is here
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - the job's import says why, if it imports it
            pass


def _bootstrap():
    # Keep the real stdout for the result only; from here on, fd 1 IS stderr, so print(),
    # os.write(1, ...) and child processes all land in the logs, never in the result.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    output_max_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16 * 1024 * 1024
    sys.argv = [FILENAME]
    _preimport()
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
    _exit(0)


_bootstrap()
