"""The hostile battery: what a code-node author who means harm would write, in both languages
and both runtimes where it applies. Each program is asserted from inside the sandbox (it
returns what it saw: an errno, a flag) or by the clear error code it must end with.

Table-driven: CASES is the list; each runtime runs its cases once, concurrently (a fixture per
runtime), and every case is one parametrized test. Then every result is stored in SQLite and
PostgreSQL and read back through GET /api/runs/{id} (the FastAPI app) - no output can wedge a
run, break the store or make a route answer 500 - and a few go through the CLI.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from executor.errors import ErrorCode
from executor.models import CodeJob, CodeResult, Status
from executor.outputs import MESSAGE_MAX_CHARS, OUTPUT_MAX_DEPTH
from executor.service import Executor
from testkit.gvisor import KERNEL_PROBE, RUNSC, assert_ran_under, require_runsc
from testkit.processes import require
from tests.conftest import run_cli

OUTPUT_MAX = 1_000_000  # STUDIO_CODE_OUTPUT_MAX_BYTES of the battery's executors
DOCKER = ("docker",)
BOTH = ("docker", "subprocess")
SUBPROCESS = ("subprocess",)
NOT_JSON = object()  # "any output": the case asserts its error only

E = ErrorCode
OK, FAILED, INVALID = Status.SUCCEEDED, Status.FAILED, Status.INVALID


@dataclass(frozen=True)
class Case:
    name: str
    language: str
    code: str
    status: Status
    error: ErrorCode | None = None
    output: Any = NOT_JSON  # the exact output of a succeeded case
    says: str = ""  # in the error's message
    state: str = "{}"
    runtimes: tuple[str, ...] = DOCKER
    check: Callable[[CodeResult], None] | None = field(default=None, compare=False)


def nested_py(depth: int, kind: str = "list") -> str:
    inner = "o = [o]" if kind == "list" else "o = {'k': o}"
    return (
        f"def main(state):\n    o = 1\n    for _ in range({depth}):\n        {inner}\n"
        "    return o\n"
    )


def nested_ts(depth: int) -> str:
    return (
        f"export function main() {{\n  let o: unknown = 1;\n  for (let i = 0; i < {depth}; "
        "i++) o = [o];\n  return o;\n}\n"
    )


def nested_value(depth: int) -> Any:
    o: Any = 1
    for _ in range(depth):
        o = [o]
    return o


def py_forge(frame: bytes) -> str:
    """Python code that writes ``frame`` to the runner's result fd (3: the runner's dup of
    stdout, its first fd) and ends the process before the runner writes its own."""
    return f"import os\ndef main(state):\n    os.write(3, {frame!r})\n    os._exit(0)\n"


def syscall_case(name: str, nr: int, *args: int) -> Case:
    code = (
        "import ctypes, errno\n"
        "def main(state):\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        f"    args = [ctypes.c_long(a) for a in {list(args)!r}]\n"
        f"    r = libc.syscall({nr}, *args)\n"
        "    return 'ok' if r >= 0 else errno.errorcode[ctypes.get_errno()]\n"
    )
    return Case(f"seccomp-{name}", "python", code, OK, output="EPERM")


def socket_case(name: str, family: int, kind: int, expected: str) -> Case:
    # creating the socket only: nothing is ever connected
    code = (
        "import socket, errno\n"
        "def main(state):\n"
        "    try:\n"
        f"        socket.socket({family}, {kind}).close()\n"
        "        return 'ok'\n"
        "    except OSError as e:\n"
        "        return errno.errorcode[e.errno]\n"
    )
    return Case(f"seccomp-socket-{name}", "python", code, OK, output=expected)


def ts_denied(name: str, body: str) -> Case:
    code = f"export async function main() {{\n  {body}\n  return 'not refused';\n}}\n"
    return Case(
        f"ts-{name}", "typescript", code, FAILED, E.CODE_ERROR, says="no permission", runtimes=BOTH
    )


def message_has_no_surrogate(r: CodeResult) -> None:
    assert r.error is not None
    r.error.message.encode("utf-8")  # raises on a lone surrogate
    assert "\ufffd" in r.error.message


def message_is_cut(r: CodeResult) -> None:
    assert r.error is not None
    assert len(r.error.message) < MESSAGE_MAX_CHARS + 200
    assert "[cut:" in r.error.message


SURROGATE = "lone surrogate"
TOO_DEEP = f"deeper than {OUTPUT_MAX_DEPTH} levels"

CASES: list[Case] = [
    # --- Python: what main returns or raises (runtime-independent) -----------------------
    Case(
        "py-surrogate-return",
        "python",
        "def main(s):\n    return 'a\\ud800b'\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=SURROGATE,
        runtimes=BOTH,
    ),
    Case(
        "py-surrogate-key",
        "python",
        "def main(s):\n    return {'\\udc00': 1}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=SURROGATE,
        runtimes=BOTH,
    ),
    Case(
        "py-surrogate-in-exception",
        "python",
        "def main(s):\n    raise ValueError('x\\ud800y')\n",
        FAILED,
        E.CODE_ERROR,
        says="ValueError: x\ufffdy",
        runtimes=BOTH,
        check=message_has_no_surrogate,
    ),
    Case(
        "py-deep-300",
        "python",
        nested_py(300),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "py-deep-2000-dicts",
        "python",
        nested_py(2000, "dict"),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "py-deep-200000",
        "python",
        nested_py(200_000),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "py-depth-at-the-limit",
        "python",
        nested_py(OUTPUT_MAX_DEPTH - 1),
        OK,
        output=nested_value(OUTPUT_MAX_DEPTH - 1),
        runtimes=BOTH,
    ),
    Case(
        "py-cycle",
        "python",
        "def main(s):\n    l = []\n    l.append(l)\n    return l\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "py-nul-in-output",
        "python",
        "def main(s):\n    return {'a\\x00': 'b\\x00c'}\n",
        OK,
        output={"a\x00": "b\x00c"},
        runtimes=BOTH,
    ),
    Case(
        "py-nul-in-exception",
        "python",
        "def main(s):\n    raise ValueError('a\\x00b')\n",
        FAILED,
        E.CODE_ERROR,
        says="ValueError: a",
        runtimes=BOTH,
    ),
    Case(
        "py-huge-int",
        "python",
        "def main(s):\n    return 10 ** 100000\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="digits",
        runtimes=BOTH,
    ),
    Case(
        "py-huge-int-past-the-digit-limit",
        "python",
        "import sys\ndef main(s):\n    sys.set_int_max_str_digits(0)\n    return 10 ** 100000\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="digits",
        runtimes=BOTH,
    ),
    Case(
        "py-long-int-within-the-limit",
        "python",
        "def main(s):\n    return 10 ** 4000\n",
        OK,
        output=10**4000,
        runtimes=BOTH,
    ),
    Case(
        "py-nan",
        "python",
        "def main(s):\n    return {'x': float('nan')}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not JSON",
        runtimes=BOTH,
    ),
    Case(
        "py-infinity",
        "python",
        "def main(s):\n    return [float('-inf')]\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not JSON",
        runtimes=BOTH,
    ),
    Case(
        "py-over-the-output-limit",
        "python",
        f"def main(s):\n    return 'x' * {OUTPUT_MAX + 1}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="more than the limit",
        runtimes=BOTH,
    ),
    Case(
        "py-huge-exception-message",
        "python",
        "def main(s):\n    raise ValueError('x' * 200000)\n",
        FAILED,
        E.CODE_ERROR,
        runtimes=BOTH,
        check=message_is_cut,
    ),
    Case(
        "py-object",
        "python",
        "def main(s):\n    return object()\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not JSON",
        runtimes=BOTH,
    ),
    Case(
        "py-bytes",
        "python",
        "def main(s):\n    return b'\\xff'\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not JSON",
        runtimes=BOTH,
    ),
    Case(
        "py-replaces-json-dumps",
        "python",
        "import json\ndef main(s):\n    json.dumps = lambda *a, **k: '\"forged\"'\n"
        "    return {'real': True}\n",
        OK,
        output={"real": True},
        runtimes=BOTH,
    ),
    Case(
        "py-str-of-exception-raises",
        "python",
        "class E(Exception):\n    def __str__(self):\n        raise RuntimeError('no')\n"
        "def main(s):\n    raise E()\n",
        FAILED,
        E.CODE_ERROR,
        runtimes=BOTH,
    ),
    Case(
        "py-getattr-raises-on-await-check",
        "python",
        "class O:\n    def __getattr__(self, n):\n        raise RuntimeError('gotcha')\n"
        "def main(s):\n    return O()\n",
        FAILED,
        E.CODE_ERROR,
        says="gotcha",
        runtimes=BOTH,
    ),
    Case(
        "py-list-whose-iteration-raises",
        "python",
        "class L(list):\n    def __iter__(self):\n        raise RuntimeError('no')\n"
        "def main(s):\n    return L([1])\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="could not be read",
        runtimes=BOTH,
    ),
    Case(
        "py-closes-result-fd",
        "python",
        "import os\ndef main(s):\n    os.close(3)\n    return 1\n",
        FAILED,
        E.CODE_ERROR,
        says="ended the process",
        runtimes=BOTH,
    ),
    Case(
        "py-deep-state",
        "python",
        "def main(s):\n    return 1\n",
        INVALID,
        E.CODE_INVALID,
        says="nested too deep",
        state="[" * 50_000 + "]" * 50_000,
        runtimes=BOTH,
    ),
    Case(
        "py-prints-nul-and-bad-utf8",
        "python",
        "import sys\ndef main(s):\n    print('a\\x00b')\n"
        "    sys.stderr.buffer.write(b'\\xed\\xa0\\x80\\xff')\n    return 1\n",
        OK,
        output=1,
        runtimes=BOTH,
    ),
    # --- Python: what lands on the result channel itself (the host's reading) ------------
    Case(
        "forge-200000-deep-frame",
        "python",
        py_forge(b'{"ok": true, "output": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "forge-300-deep-frame",
        "python",
        py_forge(b'{"ok": true, "output": ' + b"[" * 300 + b"]" * 300 + b"}"),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "forge-invalid-utf8",
        "python",
        py_forge(b'{"ok": true, "output": "\xff\xfe"}'),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not UTF-8",
        runtimes=BOTH,
    ),
    Case(
        "forge-nan",
        "python",
        py_forge(b'{"ok": true, "output": [NaN]}'),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="NaN",
        runtimes=BOTH,
    ),
    Case(
        "forge-huge-int",
        "python",
        py_forge(b'{"ok": true, "output": ' + b"9" * 5000 + b"}"),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="digits",
        runtimes=BOTH,
    ),
    Case(
        "forge-surrogate-output",
        "python",
        py_forge(b'{"ok": true, "output": "\\ud800"}'),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=SURROGATE,
        runtimes=BOTH,
    ),
    Case(
        "forge-infrastructure-code",
        "python",
        py_forge(b'{"ok": false, "error": {"code": "RUNTIME_UNAVAILABLE", "message": "x"}}'),
        FAILED,
        E.CODE_ERROR,
        says="x",
        runtimes=BOTH,
    ),
    Case(
        "forge-surrogate-message",
        "python",
        py_forge(b'{"ok": false, "error": {"code": "CODE_ERROR", "message": "a\\udfffb"}}'),
        FAILED,
        E.CODE_ERROR,
        says="a\ufffdb",
        runtimes=BOTH,
        check=message_has_no_surrogate,
    ),
    Case(
        "forge-message-not-text",
        "python",
        py_forge(b'{"ok": false, "error": {"code": "CODE_ERROR", "message": [[[1]]]}}'),
        FAILED,
        E.CODE_ERROR,
        says="no message",
        runtimes=BOTH,
    ),
    Case(
        "forge-ok-not-boolean",
        "python",
        py_forge(b'{"ok": "yes", "output": 1}'),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not the runner's reply",
        runtimes=BOTH,
    ),
    Case(
        "forge-nul-bytes",
        "python",
        py_forge(b"\x00\x00\x00"),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="not the runner's JSON",
        runtimes=BOTH,
    ),
    # --- TypeScript: what main returns or throws --------------------------------------
    Case(
        "ts-surrogate-return",
        "typescript",
        "export function main() { return 'a\\ud800b'; }\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=SURROGATE,
        runtimes=BOTH,
    ),
    Case(
        "ts-surrogate-key",
        "typescript",
        "export function main() { return { ['\\udc00']: 1 }; }\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=SURROGATE,
        runtimes=BOTH,
    ),
    Case(
        "ts-escaped-backslash-is-not-a-surrogate",
        "typescript",
        "export function main() { return '\\\\ud800'; }\n",
        OK,
        output="\\ud800",
        runtimes=BOTH,
    ),
    Case(
        "ts-surrogate-pair-is-fine",
        "typescript",
        "export function main() { return '\\ud83d\\ude00'; }\n",
        OK,
        output="\U0001f600",
        runtimes=BOTH,
    ),
    Case(
        "ts-throw-stack-surrogate",
        "typescript",
        "export function main() { throw { stack: 'x\\ud800y' }; }\n",
        FAILED,
        E.CODE_ERROR,
        says="x\ufffdy",
        runtimes=BOTH,
        check=message_has_no_surrogate,
    ),
    Case(
        "ts-throw-error-surrogate",
        "typescript",
        "export function main() { throw new Error('a\\ud800'); }\n",
        FAILED,
        E.CODE_ERROR,
        says="Error: a\ufffd",
        runtimes=BOTH,
        check=message_has_no_surrogate,
    ),
    Case(
        "ts-deep-300",
        "typescript",
        nested_ts(300),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "ts-deep-2000",
        "typescript",
        nested_ts(2000),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "ts-deep-200000",
        "typescript",
        nested_ts(200_000),
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=f"deeper than {OUTPUT_MAX_DEPTH}",
        runtimes=BOTH,
    ),
    Case(
        "ts-depth-at-the-limit",
        "typescript",
        nested_ts(OUTPUT_MAX_DEPTH - 1),
        OK,
        output=nested_value(OUTPUT_MAX_DEPTH - 1),
        runtimes=BOTH,
    ),
    Case(
        "ts-recursive-tojson",
        "typescript",
        "export function main() { const o: any = {}; o.toJSON = () => [o]; return o; }\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="deeper than",
        runtimes=BOTH,
    ),
    Case(
        "ts-nan",
        "typescript",
        "export function main() { return { x: NaN }; }\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="NaN or Infinity",
        runtimes=BOTH,
    ),
    Case(
        "ts-infinity-nested",
        "typescript",
        "export function main() { return [[{ y: -Infinity }]]; }\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="NaN or Infinity",
        runtimes=BOTH,
    ),
    Case(
        "ts-bigint",
        "typescript",
        "export function main() { return 10n ** 100n; }\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="BigInt",
        runtimes=BOTH,
    ),
    Case(
        "ts-nul-in-output",
        "typescript",
        "export function main() { return 'a\\u0000b'; }\n",
        OK,
        output="a\x00b",
        runtimes=BOTH,
    ),
    Case(
        "ts-over-the-output-limit",
        "typescript",
        f"export function main() {{ return 'x'.repeat({OUTPUT_MAX + 1}); }}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="more than the limit",
        runtimes=BOTH,
    ),
    Case(
        "ts-huge-error-message",
        "typescript",
        "export function main() { throw new Error('x'.repeat(200000)); }\n",
        FAILED,
        E.CODE_ERROR,
        runtimes=BOTH,
        check=message_is_cut,
    ),
    Case(
        "ts-species-reads-the-frame",
        "typescript",
        """\
export function main() {
  class Spy extends Uint8Array {
    static get [Symbol.species]() {
      return function (b: ArrayBuffer, o: number, l: number) {
        const seen = new TextDecoder().decode(new Uint8Array(b));
        const marker = seen.slice(0, 56);
        (Deno as any)[(Deno as any).internal].core.print(
          marker + '{"ok": true, "output": "forged"}' + marker);
        new Uint8Array(b).fill(0x20);
        return new Uint8Array(b, o, l);
      };
    }
  }
  Object.defineProperty(Uint8Array.prototype, "constructor", { value: Spy });
  return "real";
}
""",
        OK,
        output="real",
        runtimes=BOTH,
    ),
    Case(
        "ts-prints-a-frame-to-fd1",
        "typescript",
        "export function main() {\n  (Deno as any)[(Deno as any).internal].core.print(\n"
        '    \'{"ok": true, "output": "forged"}\');\n  return \'real\';\n}\n',
        OK,
        output="real",
        runtimes=BOTH,
    ),
    Case(
        "ts-deep-300-objects",
        "typescript",
        "export function main() {\n  let o: unknown = 1;\n"
        "  for (let i = 0; i < 300; i++) o = { a: o };\n  return o;\n}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=TOO_DEEP,
        runtimes=BOTH,
    ),
    Case(
        "ts-proxy-trap-throws",
        "typescript",
        "export function main() {\n  return new Proxy({}, { ownKeys() { throw new Error("
        "'trap'); } });\n}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="trap",
        runtimes=BOTH,
    ),
    Case(
        "ts-getter-throws",
        "typescript",
        "export function main() {\n  return { get x() { throw new Error('getter'); } };\n}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says="getter",
        runtimes=BOTH,
    ),
    Case(
        "ts-tojson-returns-a-surrogate",
        "typescript",
        "export function main() {\n  return { toJSON() { return 'a\\ud800'; } };\n}\n",
        FAILED,
        E.CODE_OUTPUT_INVALID,
        says=SURROGATE,
        runtimes=BOTH,
    ),
    Case(
        "ts-replaces-json-stringify",
        "typescript",
        "export function main() {\n  JSON.stringify = () => '\"forged\"';\n"
        "  return { real: true };\n}\n",
        OK,
        output={"real": True},
        runtimes=BOTH,
    ),
    Case(
        "ts-replaces-textencoder",
        "typescript",
        "export function main() {\n  TextEncoder.prototype.encode = () => "
        "new Uint8Array([34, 102, 34]);\n  return 'real';\n}\n",
        OK,
        output="real",
        runtimes=BOTH,
    ),
    Case(
        "ts-object-prototype-tojson-then-throw",
        "typescript",
        "export function main() {\n  (Object.prototype as any).toJSON = () => 'forged';\n"
        "  throw new Error('the real error');\n}\n",
        FAILED,
        E.CODE_ERROR,
        says="the real error",
        runtimes=BOTH,
    ),
    Case(
        "ts-claims-deno-had-no-threads",
        "typescript",
        "export function main() {\n  console.error('unable to create worker threads');\n"
        "  Deno.exit(1);\n}\n",
        FAILED,
        E.CODE_ERROR,
        runtimes=BOTH,
    ),
    Case(
        "ts-exits",
        "typescript",
        "export function main() { Deno.exit(0); }\n",
        FAILED,
        E.CODE_ERROR,
        runtimes=BOTH,
    ),
    # --- TypeScript: what Deno's permissions refuse (no raw syscalls without FFI) ---------
    ts_denied("connect-loopback", "await Deno.connect({ hostname: '127.0.0.1', port: 9 });"),
    ts_denied("listen", "Deno.listen({ hostname: '127.0.0.1', port: 0 });"),
    ts_denied("ffi-dlopen", "Deno.dlopen('libc.so.6', {});"),
    ts_denied("read-proc", "Deno.readTextFileSync('/proc/self/status');"),
    ts_denied("env", "Deno.env.get('PATH');"),
    ts_denied("run-process", "new Deno.Command('/bin/true').outputSync();"),
    # --- seccomp, asserted from inside (docker): each call fails with EPERM --------------
    # clone3's flags are behind a pointer no filter reads: ENOSYS, so libc falls back to
    # clone (whose flags are checked); under gVisor its own kernel answers ENOSYS (the
    # profile's gVisor variant lets it through: a runsc that implements clone3 fails here)
    dataclasses.replace(syscall_case("clone3", 435, 0, 0), output="ENOSYS"),
    syscall_case("io_uring_setup", 425, 1, 0),
    syscall_case("io_uring_enter", 426, 0, 0, 0, 0, 0, 0),
    syscall_case("io_uring_register", 427, 0, 0, 0, 0),
    syscall_case("userfaultfd", 323, 0),
    syscall_case("bpf", 321, 0, 0, 0),
    syscall_case("keyctl", 250, 0, -2, 0),
    syscall_case("add_key", 248, 0, 0, 0, 0, 0),
    syscall_case("request_key", 249, 0, 0, 0, 0),
    syscall_case("perf_event_open", 298, 0, 0, -1, -1, 0),
    syscall_case("ptrace-traceme", 101, 0, 0, 0, 0),
    syscall_case("process_vm_readv", 310, 1, 0, 0, 0, 0, 0),
    syscall_case("unshare-newuser", 272, 0x10000000),
    syscall_case("unshare-newns", 272, 0x00020000),
    syscall_case("unshare-newnet", 272, 0x40000000),
    syscall_case("setns", 308, 0, 0),
    syscall_case("mount", 165, 0, 0, 0, 0, 0),
    syscall_case("clone-newuser", 56, 0x10000000 | 17, 0, 0, 0, 0),
    syscall_case("fsopen", 430, 0, 0),
    socket_case("vsock", 40, 1, "EPERM"),
    socket_case("netlink", 16, 3, "EPERM"),
    socket_case("packet", 17, 3, "EPERM"),
    socket_case("inet", 2, 1, "EPERM"),
    socket_case("inet6", 10, 2, "EPERM"),
    socket_case("alg", 38, 5, "EPERM"),
    socket_case("unix-is-allowed", 1, 1, "ok"),
    Case(
        "seccomp-asyncio-still-works",
        "python",
        "import asyncio\nasync def main(s):\n    await asyncio.sleep(0)\n    return 'ok'\n",
        OK,
        output="ok",
    ),
    # --- the rest of the sandbox, from inside (docker) ---------------------------------
    Case(
        "docker-write-root",
        "python",
        "import errno\ndef main(s):\n    try:\n        open('/etc/x', 'w')\n"
        "    except OSError as e:\n        return errno.errorcode[e.errno]\n",
        OK,
        output="EROFS",
    ),
    Case(
        "docker-setuid-root",
        "python",
        "import os, errno\ndef main(s):\n    try:\n        os.setuid(0)\n"
        "    except OSError as e:\n        return errno.errorcode[e.errno]\n",
        OK,
        output="EPERM",
    ),
    Case(
        "docker-mknod",
        "python",
        "import os, stat, errno\ndef main(s):\n    try:\n"
        "        os.mknod('/tmp/x', stat.S_IFCHR | 0o600, os.makedev(1, 3))\n"
        "    except OSError as e:\n        return errno.errorcode[e.errno]\n",
        OK,
        output="EPERM",
    ),
    Case(
        "docker-exec-from-tmp",
        "python",
        "import os, errno\ndef main(s):\n    p = '/tmp/x.sh'\n"
        "    open(p, 'w').write('#!/bin/sh\\necho hi\\n')\n    os.chmod(p, 0o755)\n"
        "    try:\n        os.execv(p, [p])\n    except OSError as e:\n"
        "        return errno.errorcode[e.errno]\n",
        OK,
        output="EACCES",
    ),
    Case(
        "docker-only-loopback",
        "python",
        "def main(s):\n    return [l.split(':')[0].strip() for l in "
        "open('/proc/net/dev').readlines()[2:]]\n",
        OK,
        output=["lo"],
    ),
    # --- subprocess runtime: what holds today (another branch is changing it) ----------
    Case(
        "subprocess-not-root",
        "python",
        "import os\ndef main(s):\n    return os.getuid() != 0 and os.geteuid() != 0\n",
        OK,
        output=True,
        runtimes=SUBPROCESS,
    ),
    Case(
        "subprocess-own-session",
        "python",
        "import os\ndef main(s):\n    return os.getsid(0) == os.getpid()\n",
        OK,
        output=True,
        runtimes=SUBPROCESS,
    ),
    Case(
        "subprocess-empty-environment",
        "python",
        "import os\ndef main(s):\n    return sorted(k for k in os.environ if k != 'LC_CTYPE')\n",
        OK,
        output=[],
        runtimes=SUBPROCESS,
    ),
]

NAMES = [c.name for c in CASES]
assert len(set(NAMES)) == len(NAMES), "case names must be unique"


def _cases(runtime: str) -> list[Case]:
    return [c for c in CASES if runtime in c.runtimes]


#: the battery's job ids are this process's own: another process or session running the
#: battery on the same engine with the same ids would meet its names (409), and each run's
#: create removes the sandbox of that job it finds (a redelivery's rule: DockerRuntime._create)
RUN = uuid.uuid4().hex[:8]


def _job(case: Case, runtime: str) -> CodeJob:
    return CodeJob(
        job_id=f"hostile-{runtime}-{case.name}-{RUN}",
        language=case.language,  # type: ignore[arg-type]
        code=case.code,
        state_json=case.state,
        timeout_s=20,
        user="hostile",
    )


Results = dict[str, tuple[CodeJob, CodeResult]]


def _run_all(executor: Executor, runtime: str, cases: list[Case] | None = None) -> Results:
    cases = _cases(runtime) if cases is None else cases
    jobs = [_job(c, runtime) for c in cases]
    with ThreadPoolExecutor(executor.settings.code_concurrency) as pool:
        results = list(pool.map(executor.run, jobs))
    # A sandbox lost to the infrastructure (InfrastructureLost: the trace's sandbox.lost) is
    # not the code's answer; a worker runs such a job again, and so does the battery, once.
    # (CI runs saw sandboxes of the battery vanish: the battery ran on several xdist
    # processes at once with the same job ids, whose creates removed each other's sandboxes;
    # the module now keeps to one process, testkit/xdist_groups.py, and the ids to RUN.)
    results = [
        executor.run(j) if any(t.step == "sandbox.lost" for t in r.trace) else r
        for j, r in zip(jobs, results, strict=True)
    ]
    return {c.name: (j, r) for c, j, r in zip(cases, jobs, results, strict=True)}


def _docker_executor(
    tmp_path_factory: pytest.TempPathFactory, python_image: str, ts_image: str, oci: str
) -> Executor:
    from executor.settings import load_settings

    settings = load_settings(
        enable_code_nodes=True,
        data_dir=tmp_path_factory.mktemp(f"hostile-docker{oci}"),
        code_runtime="docker",
        code_image=python_image,
        code_ts_image=ts_image,
        code_output_max_bytes=OUTPUT_MAX,
        code_oci_runtime=oci,
    )
    return Executor(settings)


@pytest.fixture(scope="module")
def docker_results(
    docker_client: Any, python_image: str, ts_image: str, tmp_path_factory: pytest.TempPathFactory
) -> Results:
    return _run_all(_docker_executor(tmp_path_factory, python_image, ts_image, ""), "docker")


@pytest.fixture(scope="module")
def runsc_results(
    docker_client: Any, python_image: str, ts_image: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Results, dict[str, CodeResult]]:
    """The docker cases again under gVisor's runsc (the second wall), and what two probes of
    the same executor saw of their kernel (one per language)."""
    require_runsc(docker_client.api, RUNSC)
    executor = _docker_executor(tmp_path_factory, python_image, ts_image, RUNSC)
    kernels = {
        lang: executor.run(CodeJob(language=lang, code=code, timeout_s=20))  # type: ignore[arg-type]
        for lang, code in (("python", KERNEL_PROBE), ("typescript", TS_MARKER))
    }
    return _run_all(executor, "runsc", _runsc_cases()), kernels


#: a TypeScript node may read nothing of its kernel (no --allow-sys, no --allow-read): the
#: kernel is proven by the Python probe of the same executor; this one shows Deno starts
TS_MARKER = "export default function main() { return 1; }\n"


@pytest.fixture(scope="module")
def subprocess_results(tmp_path_factory: pytest.TempPathFactory) -> Results:
    from executor.languages.typescript import deno_binary
    from executor.settings import load_settings

    settings = load_settings(
        enable_code_nodes=True,
        data_dir=tmp_path_factory.mktemp("hostile-subprocess"),
        code_runtime="subprocess",
        code_output_max_bytes=OUTPUT_MAX,
    )
    require(shutil.which(deno_binary(settings)) is not None, "no deno binary: pip install deno")
    return _run_all(Executor(settings), "subprocess")


def _assert_case(case: Case, r: CodeResult) -> None:
    detail = (
        f"{case.name}: {r.status} {r.error} output={str(r.output)[:200]!r} logs={r.logs[-500:]!r}"
    )
    assert r.status is case.status, detail
    if case.error is None:
        assert r.error is None, detail
    else:
        assert r.error is not None and r.error.code is case.error, detail
        assert r.error.message.strip(), detail  # always a sentence
        assert case.says in r.error.message, detail
    if case.output is not NOT_JSON:
        assert r.output == case.output, detail
    if case.check is not None:
        case.check(r)
    # never an infrastructure code, and always storable/renderable text
    assert r.error is None or r.error.code not in (
        E.RUNTIME_UNAVAILABLE,
        E.RATE_LIMITED,
        E.CODE_NODES_DISABLED,
    ), detail
    json.dumps(r.cli_dict(), ensure_ascii=False).encode("utf-8")


@pytest.mark.docker
@pytest.mark.deno
@pytest.mark.parametrize("case", _cases("docker"), ids=lambda c: c.name)
def test_hostile_in_docker(case: Case, docker_results) -> None:
    _assert_case(case, docker_results[case.name][1])


#: where gVisor's answer differs, still a refusal or contained (docs/security.md, "The
#: second wall"): its kernel checks the file's permission before the read-only mount; and
#: it lets a node be made in its own /tmp, a node of ITS devices (the next case: no host
#: device can be reached through one)
RUNSC_OUTPUT = {"docker-write-root": "EACCES", "docker-mknod": None}
RUNSC_CASES = [
    Case(
        "runsc-mknod-reaches-no-host-device",
        "python",
        "import os, stat, errno\ndef main(s):\n    out = {}\n"
        "    for name, kind, dev in (('sda', stat.S_IFBLK, (8, 0)), ('mem', stat.S_IFCHR, (1, 1)),"
        " ('kmsg', stat.S_IFCHR, (1, 11))):\n"
        "        p = '/tmp/' + name\n"
        "        try:\n            os.mknod(p, kind | 0o600, os.makedev(*dev))\n"
        "            open(p, 'rb').read(1)\n            out[name] = 'read'\n"
        "        except OSError as e:\n            out[name] = errno.errorcode[e.errno]\n"
        "    return out\n",
        OK,
        output={"sda": "ENXIO", "mem": "ENXIO", "kmsg": "ENXIO"},
    )
]


def _runsc_cases() -> list[Case]:
    return [
        dataclasses.replace(c, output=RUNSC_OUTPUT[c.name]) if c.name in RUNSC_OUTPUT else c
        for c in _cases("docker")
    ] + RUNSC_CASES


@pytest.mark.docker
@pytest.mark.deno
@pytest.mark.parametrize("case", _runsc_cases(), ids=lambda c: c.name)
def test_hostile_in_runsc(case: Case, runsc_results) -> None:
    """The battery under gVisor: the same answers but RUNSC_OUTPUT's, the code having met
    gVisor's kernel."""
    results, kernels = runsc_results
    py = kernels["python"]
    assert py.status is Status.SUCCEEDED, py
    assert_ran_under(RUNSC, py.output)
    assert kernels["typescript"].status is Status.SUCCEEDED, kernels["typescript"]
    _assert_case(case, results[case.name][1])


@pytest.mark.deno
@pytest.mark.parametrize("case", _cases("subprocess"), ids=lambda c: c.name)
def test_hostile_in_subprocess(case: Case, subprocess_results) -> None:
    _assert_case(case, subprocess_results[case.name][1])


def test_the_battery_has_at_least_sixty_programs() -> None:
    assert len(CASES) >= 60
    assert {c.language for c in CASES} == {"python", "typescript"}


# --- stored, and readable by every route -------------------------------------------------


def _hand_made() -> list[CodeResult]:
    """CodeResults no executor makes (it refuses these first): the store must still never
    fail on one, since a failed write leaves the run `running`."""
    base = {"language": "python", "runtime": "docker", "code_runtime": "docker"}
    err = {"code": E.CODE_ERROR, "message": "a\ud800b\x00c"}
    return [
        CodeResult(job_id="made-deep-300", status=OK, output=nested_value(300), **base),
        CodeResult(job_id="made-deep-5000", status=OK, output=nested_value(5000), **base),
        CodeResult(job_id="made-surrogate", status=OK, output={"k": "a\ud800"}, **base),
        CodeResult(job_id="made-nan", status=OK, output=[float("nan")], **base),
        CodeResult(job_id="made-object", status=OK, output=object(), **base),
        CodeResult(
            job_id="made-bad-message", status=FAILED, error=err, logs="x\x00y\udcff", **base
        ),
    ]


async def _get_all(app: Any, job_ids: list[str]) -> dict[str, Any]:
    """GET /api/runs/{id} of each job through the app itself (httpx's ASGI transport)."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        return {
            job_id: await http.get(f"/api/runs/{job_id}", headers={"X-Studio-User": "hostile"})
            for job_id in job_ids
        }


def _store_and_read(url: str, results: list[tuple[CodeJob, CodeResult]]) -> None:
    from api_client.client import CodeClient
    from api_client.http.app import create_app
    from executor.settings import load_settings
    from executor.store import open_store

    store = open_store(url)
    settings = load_settings(enable_code_nodes=True, database_url=url)
    client = CodeClient(settings, store=store)
    try:
        for job, result in results:
            assert store.create(job, code_runtime="docker")
            assert store.claim(job.job_id, "hostile-worker") is not None
            assert store.finish(result, worker="hostile-worker")  # never raises
        # an output stored by an older version, unchecked: still readable
        from sqlalchemy import update

        from executor.store.schema import jobs

        first = results[0][0].job_id
        with store._write() as conn:  # type: ignore[attr-defined]
            conn.execute(
                update(jobs).where(jobs.c.job_id == first).values(output='{"old":"a\\ud800b"}')
            )
        app = create_app(settings, client=client)
        responses = asyncio.run(_get_all(app, [job.job_id for job, _ in results]))
        for job, result in results:
            r = responses[job.job_id]
            assert r.status_code == 200, (job.job_id, r.text[:500])
            body = r.json()
            assert body["finished"] is True
            if job.job_id == first:
                assert body["output"] == {"old": "a\ufffdb"}
                continue
            if result.error is not None or body["status"] != result.status.value:
                # refused by the store itself (hand-made) or by the executor
                assert body["error"]["code"] in {
                    c.value for c in (E.CODE_OUTPUT_INVALID, E.CODE_ERROR, E.CODE_INVALID)
                }, body
                assert body["error"]["message"], body
            if result.error is not None:
                assert body["error"]["code"] == result.error.code.value
            if body["status"] == "succeeded":
                assert body["output"] == json.loads(json.dumps(result.output)), job.job_id
    finally:
        client.close()
        store.close()


def _all_results(docker_results, subprocess_results) -> list[tuple[CodeJob, CodeResult]]:
    out = list(docker_results.values()) + list(subprocess_results.values())
    for r in _hand_made():
        out.append((CodeJob(job_id=r.job_id, code="x", user="hostile"), r))
    return out


@pytest.mark.docker
def test_every_hostile_result_is_stored_and_read_back_sqlite(
    tmp_path, docker_results, subprocess_results
) -> None:
    _store_and_read(
        f"sqlite:///{tmp_path / 'runs.db'}", _all_results(docker_results, subprocess_results)
    )


@pytest.mark.docker
@pytest.mark.postgres
def test_every_hostile_result_is_stored_and_read_back_postgresql(
    pg_schema_url, docker_results, subprocess_results
) -> None:
    _store_and_read(pg_schema_url, _all_results(docker_results, subprocess_results))


@pytest.mark.docker
@pytest.mark.parametrize(
    "name,suffix,code,error",
    [
        ("py-deep-300", ".py", nested_py(300), "CODE_OUTPUT_INVALID"),
        (
            "ts-surrogate",
            ".ts",
            "export function main() { return 'a\\ud800b'; }\n",
            "CODE_OUTPUT_INVALID",
        ),
        (
            "ts-throw-stack-surrogate",
            ".ts",
            "export function main() { throw { stack: 'x\\ud800y' }; }\n",
            "CODE_ERROR",
        ),
    ],
)
def test_the_cli_prints_its_one_json_object(
    name, suffix, code, error, tmp_path, python_image, ts_image
) -> None:
    src = tmp_path / f"node{suffix}"
    src.write_text(code, encoding="utf-8")
    language = "python" if suffix == ".py" else "typescript"
    proc = run_cli(
        "run",
        str(src),
        "--language",
        language,
        env={
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "docker",
            "STUDIO_CODE_IMAGE": python_image,
            "STUDIO_CODE_TS_IMAGE": ts_image,
            "STUDIO_DATA_DIR": str(tmp_path),
        },
    )
    out = json.loads(proc.stdout)  # exactly one JSON object
    assert out["error"]["code"] == error, (proc.stdout[-1000:], proc.stderr[-2000:])
    assert out["status"] == "failed"


# --- the host's reading, without a sandbox (fast) -------------------------------------------


@pytest.mark.parametrize(
    "data,says",
    [
        (b'{"ok": true, "output": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", TOO_DEEP),
        (b'{"ok": true, "output": ' + b'{"a":' * 101 + b"1" + b"}" * 101 + b"}", TOO_DEEP),
        (b'{"ok": true, "output": "\\ud800"}', SURROGATE),
        (b'{"ok": true, "output": {"\\uDFFF": 1}}', SURROGATE),
        (b'{"ok": true, "output": Infinity}', "Infinity"),
        (b'{"ok": true, "output": -Infinity}', "Infinity"),
        (b'{"ok": true, "output": ' + b"1" * 5000 + b"}", "digits"),
        (b'{"ok": true, "output": "\xc3"}', "not UTF-8"),
        (b'{"ok": true, "output": "\xed\xa0\x80"}', "not UTF-8"),  # an encoded surrogate
        (b'{"ok": 1}', "not the runner's reply"),
        (b"[1, 2]", "not the runner's reply"),
        (b'{"ok": true', "not the runner's JSON"),
        (b"x" * 2000, "more than the limit"),
    ],
)
def test_the_host_refuses_what_no_route_could_render(data: bytes, says: str) -> None:
    from executor.outputs import OutputInvalid, parse_reply

    with pytest.raises(OutputInvalid) as e:
        parse_reply(data, max_bytes=1000 if len(data) == 2000 else 10_000_000)
    assert says in str(e.value)


def test_the_host_keeps_what_is_fine() -> None:
    from executor.outputs import parse_reply

    assert parse_reply(
        b'{"ok": true, "output": "\\ud83d\\ude00 a\\u0000b \\\\ud800"}', max_bytes=1000
    ) == {"ok": True, "output": "\U0001f600 a\x00b \\ud800"}
    deep = b"[" * OUTPUT_MAX_DEPTH + b"]" * OUTPUT_MAX_DEPTH
    assert parse_reply(b'{"ok": true, "output": ' + deep + b"}", max_bytes=1000)["ok"] is True
    # an error's message is the node's own text: kept (made safe by the executor)
    reply = parse_reply(
        b'{"ok": false, "error": {"code": "CODE_ERROR", "message": "\\ud800"}}', max_bytes=1000
    )
    assert reply["error"]["message"] == "\ud800"


@pytest.mark.docker
def test_meta_shows_the_seccomp_profile_and_both_languages_are_ready_under_it(
    make_settings, python_image: str, ts_image: str
) -> None:
    import hashlib

    from executor.meta import runtime_meta
    from executor.runtimes.docker.seccomp import PROFILE_PATH

    ex = Executor(
        make_settings(code_runtime="docker", code_image=python_image, code_ts_image=ts_image)
    )
    meta = runtime_meta(ex, fresh=True)
    assert meta["seccomp"]["sha256"] == hashlib.sha256(PROFILE_PATH.read_bytes()).hexdigest()
    # the readiness probes ran the test programs under the profile
    assert [(lang["name"], lang["ready"]) for lang in meta["languages"]] == [
        ("python", True),
        ("typescript", True),
    ], meta["languages"]
    profile = json.loads(PROFILE_PATH.read_text(encoding="utf-8"))
    allowed = {
        n
        for rule in profile["syscalls"]
        if rule["action"] == "SCMP_ACT_ALLOW"
        for n in rule["names"]
    }
    assert not allowed & {
        "io_uring_setup",
        "userfaultfd",
        "keyctl",
        "bpf",
        "ptrace",
        "unshare",
        "setns",
        "mount",
        "perf_event_open",
        "socketcall",
    }


def test_the_shipped_profile_is_what_derive_makes_of_mobys_default() -> None:
    import subprocess
    import sys
    from pathlib import Path

    from executor.runtimes.docker.seccomp import PROFILE_PATH

    root = Path(__file__).resolve().parent.parent
    made = subprocess.run(
        [
            sys.executable,
            str(root / "docker/seccomp/derive.py"),
            str(root / "docker/seccomp/moby-default.json"),
        ],
        capture_output=True,
        check=True,
    ).stdout
    assert made == PROFILE_PATH.read_bytes(), "regenerate executor/runtimes/docker/seccomp.json"


def test_the_gvisor_variant_differs_only_in_passing_clone3_to_gvisors_kernel() -> None:
    """runsc answers every errno rule EPERM (it ignores errnoRet): the variant lets clone3
    through to gVisor's kernel (which answers ENOSYS itself), and changes nothing else."""
    from executor.runtimes.docker.seccomp import (
        PROFILE_PATH,
        for_gvisor,
        is_gvisor,
        profile_json,
        profile_sha256,
    )

    profile = json.loads(PROFILE_PATH.read_text(encoding="utf-8"))
    variant = for_gvisor(profile)
    changed = [
        (a["names"], a["action"], b["action"])
        for a, b in zip(profile["syscalls"], variant["syscalls"], strict=True)
        if a != b
    ]
    assert changed == [(["clone3"], "SCMP_ACT_ERRNO", "SCMP_ACT_ALLOW")]
    assert {k: v for k, v in variant.items() if k != "syscalls"} == {
        k: v for k, v in profile.items() if k != "syscalls"
    }
    assert json.loads(profile_json(gvisor=True)) == variant
    assert profile_sha256(gvisor=True) != profile_sha256()
    assert [is_gvisor(n) for n in ("runsc", "runsc-kvm", "runc", "crun", None, "")] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


@pytest.mark.docker
def test_under_runsc_meta_shows_the_variant_and_both_languages_are_ready(
    make_settings, python_image: str, ts_image: str, docker_client: Any
) -> None:
    """Under gVisor with --oci-seccomp the profile is in force (the battery's AF_INET case
    is refused) and Deno starts its threads: both languages are ready, meta names the
    variant and the wall."""
    from executor.meta import runtime_meta
    from executor.runtimes.docker.seccomp import profile_sha256

    require_runsc(docker_client.api, RUNSC)
    ex = Executor(
        make_settings(
            code_runtime="docker",
            code_image=python_image,
            code_ts_image=ts_image,
            code_oci_runtime="auto",
        )
    )
    meta = runtime_meta(ex, fresh=True)
    assert meta["seccomp"]["sha256"] == profile_sha256(gvisor=True)
    assert meta["seccomp"]["variant"].startswith("gvisor")
    engine = meta["engine"]["this_process"]
    assert (engine["oci_runtime"], engine["oci_runtime_kernel"]) == (RUNSC, "gvisor")
    assert engine["oci_runtime_platform"] == "ptrace" and "not the host's" in engine["wall"]
    assert [(lang["name"], lang["ready"], lang["reason"]) for lang in meta["languages"]] == [
        ("python", True, None),
        ("typescript", True, None),
    ], meta["languages"]
    ts = ex.run(CodeJob(language="typescript", code="export default () => 40 + 2;\n", timeout_s=20))
    assert (ts.status, ts.output) == (Status.SUCCEEDED, 42), ts.error
