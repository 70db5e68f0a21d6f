"""The TypeScript language contract on a REAL Deno, in BOTH runtimes: main(state) or the
default export in, JSON out, console.* as logs, the user's line numbers in errors, no
permission at all (files, env, network, processes), memory and time limits, and a clear
sentence for every way it can go wrong."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from executor.errors import CodeInvalid, RuntimeUnavailable
from executor.languages.typescript import PERMISSION_MESSAGE, RUNNER_MESSAGES
from executor.meta import runtime_meta
from executor.models import CodeJob, Status
from executor.service import Executor
from executor.settings import NOBODY
from testkit.gvisor import KERNEL_PROBE, RUNSC, assert_ran_under, require_runsc
from testkit.processes import ROOT, require
from tests.conftest import run_cli

DEPS_TS = ROOT / "docker" / "studio-code-ts" / "deps.ts"
#: docker-pool: the docker runtime with its pool of pre-started sandboxes filled first
RUNTIMES = [
    pytest.param("docker", marks=pytest.mark.docker),
    pytest.param("docker-pool", marks=pytest.mark.docker),
    "subprocess",
]
#: the same tests in sandboxes gVisor's runsc starts (the second wall): a lean subset, each
#: listing it with ``@under_runsc`` (the executor's Python probe proves the kernel first).
#: Not the timeout's timing: a cold runsc start of Deno alone can take more than its second
#: of slack (the isolation suite's pool-runsc form times timeouts under runsc)
WITH_RUNSC = [*RUNTIMES, pytest.param("docker-runsc", marks=pytest.mark.docker)]
under_runsc = pytest.mark.parametrize("runtime", WITH_RUNSC, indirect=True)
ON = {"STUDIO_ENABLE_CODE_NODES": "1"}

pytestmark = pytest.mark.deno


# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def deno_cache(deno_bin: str) -> Iterator[str]:
    """A Deno cache of docker/studio-code-ts/deps.ts, as an operator would make one for
    subprocess mode: owned by the server user and readable (not writable) by the sandbox
    user, in a folder every user can traverse."""
    root = Path(tempfile.mkdtemp(prefix="studio-ts-cache-", dir="/tmp"))
    root.chmod(0o755)
    cache = root / "deno-dir"
    env = {**os.environ, "DENO_DIR": str(cache), "NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1"}
    try:
        proc = subprocess.run(
            [deno_bin, "cache", "--no-config", "--no-lock", str(DEPS_TS)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=240,
        )
        require(
            proc.returncode == 0,
            f"deno cache of deps.ts failed (is the npm registry reachable?): {proc.stderr[-2000:]}",
        )
        for path in [cache, *cache.rglob("*")]:
            if not path.is_symlink():
                path.chmod(path.stat().st_mode | 0o444 | (0o111 if path.is_dir() else 0))
        yield str(cache)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_executor(
    runtime: str, request: pytest.FixtureRequest, make_settings
) -> Iterator[Callable[..., Executor]]:
    """Executors of the parametrized runtime with real Deno: the image in docker, the
    session's cache in subprocess mode; keyword overrides win. In docker-pool the pool is
    filled before the executor is handed out, and its idle sandboxes removed at the end."""
    made: list[Executor] = []

    def make(**overrides: object) -> Executor:
        if runtime.startswith("docker"):
            base: dict[str, object] = {
                "code_runtime": "docker",
                "code_ts_image": request.getfixturevalue("ts_image"),
            }
            if runtime == "docker-pool":
                base["code_languages"] = "typescript"
            if runtime == "docker-runsc":
                require_runsc(request.getfixturevalue("docker_client").api, RUNSC)
                base["code_oci_runtime"] = RUNSC
                base["code_image"] = request.getfixturevalue("python_image")
        else:
            base = {
                "code_runtime": "subprocess",
                "code_ts_deno_dir": request.getfixturevalue("deno_cache"),
            }
        ex = Executor(make_settings(**{**base, **overrides}))
        made.append(ex)
        if runtime == "docker-runsc":
            # a TypeScript node may read nothing of its kernel: the same settings' Python
            # probe reports it, from inside a sandbox of the same runtime
            seen = ex.run(CodeJob(code=KERNEL_PROBE, timeout_s=20))
            assert seen.status is Status.SUCCEEDED, seen.error
            assert_ran_under(RUNSC, seen.output)  # type: ignore[arg-type]
        if runtime == "docker-pool" and "typescript" in ex.settings.languages:
            ex.prepare()
            assert ex.runtime is not None and ex.runtime.pool is not None
            assert ex.runtime.pool.wait_ready(60)
        return ex

    yield make
    for ex in made:
        ex.close()


@pytest.fixture
def executor(make_executor) -> Executor:
    return make_executor()


def run(executor: Executor, code: str, state: str = "{}", timeout_s: float = 20):
    return executor.run(
        CodeJob(language="typescript", code=code, state_json=state, timeout_s=timeout_s)
    )


# --- the contract ---------------------------------------------------------------------------


@under_runsc
def test_zod_and_date_fns_are_usable(executor):
    code = (
        'import { z } from "npm:zod@3";\n'
        'import { format, addDays } from "npm:date-fns@4";\n'
        "\n"
        "const Order = z.object({ id: z.string(), qty: z.number().int().positive() });\n"
        "\n"
        "export function main(state: { order: unknown; day: string }) {\n"
        "  const order = Order.parse(state.order);\n"
        "  const bad = Order.safeParse({ id: 1, qty: -1 });\n"
        "  const next = addDays(new Date(state.day), 1);\n"
        "  return {\n"
        "    order,\n"
        "    issues: bad.success ? [] : bad.error.issues.map((i) => i.path.join('.')),\n"
        '    next: format(next, "yyyy-MM-dd (EEEE)"),\n'
        "  };\n"
        "}\n"
    )
    state = json.dumps(
        {"order": {"id": "A-1", "qty": 3, "extra": True}, "day": "2026-11-30T12:00:00Z"}
    )
    r = run(executor, code, state)
    assert r.status is Status.SUCCEEDED, r.error
    assert r.output == {
        "order": {"id": "A-1", "qty": 3},  # zod strips unknown keys
        "issues": ["id", "qty"],
        "next": "2026-12-01 (Tuesday)",
    }
    assert r.exit_code == 0 and r.runtime == executor.settings.code_runtime


def test_a_zod_validation_error_is_a_code_error(executor):
    code = (
        'import { z } from "npm:zod@3";\n'
        "export function main(state: unknown) {\n"
        "  return z.object({ n: z.number() }).parse(state);\n"
        "}\n"
    )
    r = run(executor, code, '{"n": "x"}')
    assert r.status is Status.FAILED and r.error.code == "CODE_ERROR"
    assert "ZodError" in r.error.message and "main.ts:3" in r.error.message


@pytest.mark.parametrize(
    "code",
    [
        "export async function main(state: { n: number }) {\n"
        "  await new Promise((r) => setTimeout(r, 20));\n"
        "  return state.n + 1;\n"
        "}\n",
        "export default async (state: { n: number }) => {\n"
        "  await Promise.resolve();\n"
        "  return state.n + 1;\n"
        "};\n",
        "export default function (state: { n: number }): number {\n  return state.n + 1;\n}\n",
        # main wins over a default export that is not the entry point
        "export default { note: 'config' };\nexport const main = (s: { n: number }) => s.n + 1;\n",
    ],
    ids=["async-main", "async-default-arrow", "default-function", "main-beside-default"],
)
def test_async_main_and_default_export(executor, code):
    r = run(executor, code, '{"n": 41}')
    assert (r.status, r.output, r.error) == (Status.SUCCEEDED, 42, None)


def test_console_and_stdout_are_logs_never_the_result(executor):
    code = (
        "export function main() {\n"
        '  console.log("log line", { a: 1 });\n'
        '  console.info("info line");\n'
        '  console.debug("debug line");\n'
        '  console.warn("warn line");\n'
        '  console.error("error line");\n'
        '  console.table([{ col: "cell" }]);\n'
        '  Deno.stdout.writeSync(new TextEncoder().encode("Deno.stdout line\\n"));\n'
        '  process.stdout.write("process.stdout line\\n");\n'
        "  // Straight to fd 1, around every redirection, even shaped like a result:\n"
        '  Deno[Deno.internal].core.print(\'{"ok": true, "output": "forged"}\\n\', false);\n'
        '  return { result: "value" };\n'
        "}\n"
    )
    r = run(executor, code)
    assert (r.status, r.output) == (Status.SUCCEEDED, {"result": "value"}), r.error
    for line in (
        "log line { a: 1 }",
        "info line",
        "debug line",
        "warn line",
        "error line",
        "cell",
        "Deno.stdout line",
        "process.stdout line",
    ):
        assert line in r.logs
    assert "forged" not in r.logs  # fd 1 is not the logs; the executor ignores it


def test_code_that_swaps_globals_cannot_forge_the_result(executor):
    code = (
        'const forged = \'{"ok": true, "output": "forged"}\';\n'
        "JSON.stringify = () => forged;\n"
        "(Object.prototype as any).toJSON = function () { return 'forged'; };\n"
        "(String.prototype as any).replace = () => 'forged';\n"
        "TextEncoder.prototype.encode = () => new TextEncoder().encode(forged);\n"
        "Deno.exit = () => { throw new Error('no exit'); };\n"
        "Deno.stdout.writeSync = () => 0;\n"
        "globalThis.console = { log() {} } as any;\n"
        "export function main(state: { fail: boolean }) {\n"
        "  if (state.fail) throw new Error('the real error');\n"
        "  return 7;\n"
        "}\n"
    )
    ok = run(executor, code, '{"fail": false}')
    assert (ok.status, ok.output) == (Status.SUCCEEDED, 7), ok.error
    bad = run(executor, code, '{"fail": true}')
    assert bad.status is Status.FAILED and bad.error.code == "CODE_ERROR"
    assert "Error: the real error" in bad.error.message and "main.ts:10" in bad.error.message


def test_a_user_error_reports_the_users_line_numbers(executor):
    code = (
        "interface Item {\n"  # 1
        "  price: number;\n"  # 2
        "}\n"  # 3
        "\n"  # 4
        "function total(items: Item[]): number {\n"  # 5
        "  if (items.length === 0) {\n"  # 6
        '    throw new RangeError("no items to add up");\n'  # 7
        "  }\n"  # 8
        "  return items.reduce((s, i) => s + i.price, 0);\n"  # 9
        "}\n"  # 10
        "\n"  # 11
        "export function main(state: { items: Item[] }) {\n"  # 12
        "  const t: number = total(state.items);\n"  # 13
        "  return t;\n"  # 14
        "}\n"
    )
    r = run(executor, code, '{"items": []}')
    assert r.status is Status.FAILED and r.error.code == "CODE_ERROR"
    message = r.error.message
    assert message.startswith("RangeError: no items to add up")
    assert "at total (main.ts:7:11)" in message
    assert "at main (main.ts:13:21)" in message
    assert "data:" not in message  # neither the user's module URL nor runner frames


def test_errors_outside_main_keep_line_numbers(executor):
    top_level = 'const x = 1;\nthrow new Error("at import");\nexport function main() {}\n'
    r = run(executor, top_level)
    assert r.error.code == "CODE_ERROR" and "main.ts:2" in r.error.message
    timer = (
        "export async function main() {\n"
        '  setTimeout(() => { throw new Error("from a timer"); }, 1);\n'
        "  await new Promise((r) => setTimeout(r, 200));\n"
        "}\n"
    )
    r = run(executor, timer)
    assert r.error.code == "CODE_ERROR" and "Error: from a timer" in r.error.message
    assert "main.ts:2" in r.error.message


def test_a_syntax_error_only_v8_sees_is_invalid_with_its_line(executor):
    # tree-sitter (the save-time check) parses these; V8 refuses to compile them.
    code = "let a = 1;\nlet a = 2;\nexport function main() {\n  return a;\n}\n"
    assert executor.check_code(code, "typescript") == []
    r = run(executor, code)
    assert (r.status, r.error.code) == (Status.INVALID, "CODE_INVALID")
    assert r.error.message == (
        "SyntaxError: Identifier 'a' has already been declared at main.ts:2:5\n"
        + RUNNER_MESSAGES["syntax"]
    )
    # a SyntaxError thrown while the module runs is the code's error, not its syntax
    r = run(executor, 'const c = JSON.parse("{");\nexport function main() {\n  return c;\n}\n')
    assert (r.status, r.error.code) == (Status.FAILED, "CODE_ERROR")
    assert "at main.ts:1:16" in r.error.message


@pytest.mark.parametrize(
    ("returned", "says"),
    [
        ("() => 1", "(a function)"),
        ("10n", "BigInt"),
        ("{ n: NaN }", "(NaN or Infinity)"),
        ("(() => { const a: any = {}; a.self = a; return a; })()", "circular"),
        ("Symbol('s')", "(a symbol)"),
    ],
    ids=["function", "bigint", "nan", "cycle", "symbol"],
)
def test_a_non_json_return_is_output_invalid(executor, returned, says):
    r = run(executor, f"export function main(): unknown {{\n  return {returned};\n}}\n")
    assert r.status is Status.FAILED and r.error.code == "CODE_OUTPUT_INVALID"
    assert says in r.error.message and "main returned a value that is not JSON" in r.error.message


def test_undefined_is_null_like_a_python_main_without_return(executor):
    r = run(executor, "export function main(state: unknown): void {\n  console.log('done');\n}\n")
    assert (r.status, r.output, r.error) == (Status.SUCCEEDED, None, None)
    # nested undefined and functions follow JSON.stringify: dropped from objects
    r = run(executor, "export default () => ({ a: undefined, f() {}, b: [undefined] });\n")
    assert r.output == {"b": [None]}


def test_output_over_the_limit_is_output_invalid(make_executor):
    r = run(make_executor(code_output_max_bytes=1024), "export default () => 'x'.repeat(5000);\n")
    assert r.error.code == "CODE_OUTPUT_INVALID" and "5002 bytes of JSON" in r.error.message


def test_exports_without_a_function_and_a_bad_state_are_invalid(executor):
    r = run(executor, "export default 42;\n")
    assert (r.status, r.error.code) == (Status.INVALID, "CODE_INVALID")
    assert "exports no main function" in r.error.message
    r = run(executor, "export default (s: unknown) => s;\n", state="{not json")
    assert (r.status, r.error.code) == (Status.INVALID, "CODE_INVALID")
    assert "The state is not valid JSON" in r.error.message


def test_exiting_or_never_settling_is_a_clear_code_error(executor):
    r = run(executor, "export function main() {\n  Deno.exit(3);\n}\n")
    assert r.error.code == "CODE_ERROR" and "exit status 3" in r.error.message
    t0 = time.monotonic()
    r = run(executor, "export function main() {\n  return new Promise(() => {});\n}\n")
    assert r.error.code == "CODE_ERROR" and r.error.message == RUNNER_MESSAGES["neverSettles"]
    assert time.monotonic() - t0 < 10  # not a timeout


# --- no permission at all -----------------------------------------------------------------


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A TCP listener of the test's own on loopback: the code must never reach it."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv
    srv.close()


SECRET_NAME = "STUDIO_TEST_FAKE_SECRET"
# what the code tries, and what Deno says when it refuses
REFUSALS = {
    "read-file": ('Deno.readTextFileSync("/etc/passwd")', 'Requires read access to "/etc/passwd"'),
    "read-env": (f'Deno.env.get("{SECRET_NAME}")', f'Requires env access to "{SECRET_NAME}"'),
    "fetch-loopback": (
        'await fetch("http://127.0.0.1:{port}/")',
        'Requires net access to "127.0.0.1:{port}"',
    ),
    # An absolute path: Deno looks a bare name up on PATH BEFORE its permission check, and the
    # subprocess child has no PATH (see the bare-name test below).
    "start-process": (
        'new Deno.Command("/usr/bin/id").outputSync()',
        'Requires run access to "/usr/bin/id"',
    ),
}


@pytest.mark.parametrize("what", list(REFUSALS))
@under_runsc
def test_deno_refuses_files_env_network_and_processes(executor, what, listener, monkeypatch):
    secret = f"fake-secret-{uuid.uuid4().hex}"
    monkeypatch.setenv(SECRET_NAME, secret)  # in the server's own environment
    port = listener.getsockname()[1]
    expr, refusal = (s.replace("{port}", str(port)) for s in REFUSALS[what])

    caught = (
        "export async function main() {\n"
        "  try {\n"
        f"    const got = {expr};\n"
        "    return { allowed: true, got: String(got) };\n"
        "  } catch (err) {\n"
        "    return { name: (err as Error).name, message: (err as Error).message };\n"
        "  }\n"
        "}\n"
    )
    r = run(executor, caught)
    assert r.status is Status.SUCCEEDED, r.error
    assert r.output["name"] == "NotCapable", r.output  # what the code itself sees
    assert refusal in r.output["message"]

    uncaught = f"export async function main() {{\n  return String({expr});\n}}\n"
    r = run(executor, uncaught)
    assert r.status is Status.FAILED and r.error.code == "CODE_ERROR"
    assert r.error.message.startswith(PERMISSION_MESSAGE)
    assert f"NotCapable: {refusal}" in r.error.message and "main.ts:2" in r.error.message
    assert "--allow-" not in r.error.message  # an admin cannot grant a permission

    everything = json.dumps(r.model_dump(mode="json"))
    assert secret not in everything
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing ever connected


def test_a_bare_command_name_never_starts_a_process(executor):
    code = (
        "export function main() {\n"
        "  try {\n"
        '    const out = new Deno.Command("id").outputSync();\n'
        "    return { ran: true, stdout: new TextDecoder().decode(out.stdout) };\n"
        "  } catch (err) {\n"
        "    return { ran: false, name: (err as Error).name };\n"
        "  }\n"
        "}\n"
    )
    r = run(executor, code)
    assert r.status is Status.SUCCEEDED and r.output["ran"] is False, r.output
    # docker: the image's PATH finds id, then the permission check refuses it; subprocess:
    # no PATH at all, so Deno fails to resolve the name ("no path to search") before that.
    if executor.settings.code_runtime == "docker":
        assert r.output["name"] == "NotCapable"


# --- limits -----------------------------------------------------------------------------------


@under_runsc
def test_a_heap_bomb_is_code_memory(executor):
    code = (
        "export function main() {\n"
        "  const keep: number[][] = [];\n"
        "  for (;;) keep.push(new Array(1000).fill(keep.length));\n"
        "}\n"
    )
    r = run(executor, code, timeout_s=30)
    assert r.status is Status.FAILED and r.error.code == "CODE_MEMORY", (r.error, r.logs[-500:])
    assert "STUDIO_CODE_MEMORY=256m" in r.error.message


def test_memory_outside_the_v8_heap_is_code_memory_too(executor):
    # ArrayBuffers live outside the heap the V8 flag caps: docker's cgroup or the
    # subprocess runtime's resident-memory watch must stop them (1 GiB, touched).
    code = (
        "export function main() {\n"
        "  const chunks: Uint8Array[] = [];\n"
        "  for (let i = 0; i < 16; i++) chunks.push(new Uint8Array(64 * 1024 * 1024).fill(1));\n"
        "  return chunks.length;\n"
        "}\n"
    )
    r = run(executor, code, timeout_s=30)
    assert r.status is Status.FAILED and r.error.code == "CODE_MEMORY", (r.error, r.logs[-500:])


def test_an_endless_loop_times_out_within_a_second_of_its_timeout(executor):
    t0 = time.monotonic()
    r = run(executor, "export function main() {\n  for (;;) {}\n}\n", timeout_s=2)
    elapsed = time.monotonic() - t0
    assert r.status is Status.TIMED_OUT and r.error.code == "CODE_TIMEOUT"
    assert elapsed < 2 + 1, elapsed


def test_an_allowed_package_missing_from_the_cache_is_a_clear_error(make_executor):
    ex = make_executor(code_ts_packages="npm:zod@3,npm:date-fns@4,npm:is-number@7")
    code = (
        'import isNumber from "npm:is-number@7";\n'
        "export function main() {\n  return isNumber(3);\n}\n"
    )
    assert ex.check_code(code, "typescript") == []  # allowed at save time
    t0 = time.monotonic()
    r = run(ex, code, timeout_s=20)
    assert time.monotonic() - t0 < 10  # no hang, no download
    assert r.status is Status.FAILED and r.error.code == "CODE_ERROR"
    assert r.error.message.startswith("npm:is-number@7 is not in the ")
    assert "Deno cache" in r.error.message
    if ex.settings.code_runtime == "docker":
        assert "docker/build.sh typescript" in r.error.message
    else:
        assert f"STUDIO_CODE_TS_DENO_DIR={ex.settings.code_ts_deno_dir}" in r.error.message


@under_runsc
def test_four_concurrent_runs_start_under_the_process_limit(make_executor):
    """RLIMIT_NPROC (subprocess, per uid) and the pids cgroup (docker) count THREADS."""
    ex = make_executor(code_concurrency=4, code_pids=64)
    code = (
        'import { z } from "npm:zod@3";\n'
        "export async function main(state: { i: number }) {\n"
        "  await new Promise((r) => setTimeout(r, 500));\n"
        "  return z.number().parse(state.i);\n"
        "}\n"
    )
    barrier = threading.Barrier(4)

    def one(i: int):
        barrier.wait()
        return run(ex, code, json.dumps({"i": i}))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [(r.status, r.output) for r in results] == [(Status.SUCCEEDED, i) for i in range(4)], [
        r.error for r in results
    ]


# --- subprocess mode as nobody ------------------------------------------------------------


@pytest.mark.skipif(os.getuid() != 0, reason="the sandbox user is nobody only for a root server")
def test_subprocess_deno_and_cache_are_usable_by_nobody(deno_bin, deno_cache, make_settings):
    proc = subprocess.run(
        [deno_bin, "--version"],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        capture_output=True,
        text=True,
        env={},
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    # A cache nobody cannot reach: a clear sentence, not Deno's bare "Permission denied".
    private = Path(tempfile.mkdtemp(prefix="studio-ts-private-", dir="/tmp"))
    try:
        private.chmod(0o700)
        (private / "deno-dir").symlink_to(deno_cache)
        ex = Executor(
            make_settings(code_runtime="subprocess", code_ts_deno_dir=str(private / "deno-dir"))
        )
        r = run(ex, 'import { z } from "npm:zod@3";\nexport default () => z.string().parse("x");\n')
        assert r.error.code == "CODE_ERROR"
        assert r.error.message.startswith("The sandbox user cannot read the Deno cache")
        assert f"readable by uid {NOBODY}" in r.error.message
    finally:
        shutil.rmtree(private, ignore_errors=True)


# --- languages, readiness, meta ----------------------------------------------------------------


def test_typescript_off_fails_validation_saying_so(make_executor):
    ex = make_executor(code_languages="python")
    with pytest.raises(CodeInvalid) as e:
        ex.validate_node("typescript")
    said = "typescript Code nodes are not offered here (STUDIO_CODE_LANGUAGES=python)"
    assert said in str(e.value)
    r = run(ex, "export function main() {\n  return 1;\n}\n")
    assert (r.status, r.error.code) == (Status.INVALID, "CODE_INVALID")
    assert "STUDIO_CODE_LANGUAGES=python" in r.error.message
    meta = {lang["name"]: lang for lang in runtime_meta(ex)["languages"]}
    assert meta["typescript"]["offered"] is False and meta["typescript"]["ready"] is False


@under_runsc
def test_meta_shows_typescript_ready_with_its_packages(executor):
    meta = runtime_meta(executor, fresh=True)
    ts = {lang["name"]: lang for lang in meta["languages"]}["typescript"]
    assert ts["ready"] is True and ts["reason"] is None, ts
    assert ts["packages"] == ["npm:zod@3", "npm:date-fns@4"]
    if executor.settings.code_runtime == "docker":
        assert ts["image"] == executor.settings.code_ts_image
    executor.validate_node("typescript")  # returns: it can run


def test_a_missing_image_is_not_ready_and_names_the_build_command(make_settings, docker_client):
    tag = f"studio-code-ts:missing-{uuid.uuid4().hex[:8]}"
    ex = Executor(
        make_settings(code_runtime="docker", code_ts_image=tag, code_languages="typescript")
    )
    ts = {lang["name"]: lang for lang in runtime_meta(ex, fresh=True)["languages"]}["typescript"]
    assert ts["ready"] is False
    assert tag in ts["reason"] and "docker/build.sh typescript" in ts["reason"]
    with pytest.raises(RuntimeUnavailable, match="docker/build.sh typescript"):
        ex.validate_node("typescript")


# --- CLI -----------------------------------------------------------------------------------------


def _cli_env(runtime: str, request: pytest.FixtureRequest) -> dict[str, str]:
    env = {**ON, "STUDIO_CODE_RUNTIME": runtime}
    if runtime == "docker":
        env["STUDIO_CODE_TS_IMAGE"] = request.getfixturevalue("ts_image")
    else:
        env["STUDIO_CODE_TS_DENO_DIR"] = request.getfixturevalue("deno_cache")
    return env


def _one_json(proc) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0])


@pytest.mark.parametrize(  # the CLI runs one job: no pool
    "runtime", [pytest.param("docker", marks=pytest.mark.docker), "subprocess"]
)
def test_cli_run_and_validate_a_ts_file(runtime, request, tmp_path):
    env = _cli_env(runtime, request)
    node = tmp_path / "x.ts"
    node.write_text(
        'import { z } from "npm:zod@3";\n'
        "export default async function (state: { n: number }) {\n"
        '  console.log("doubling", state.n);\n'
        "  return { doubled: z.number().parse(state.n) * 2 };\n"
        "}\n"
    )
    proc = run_cli("run", str(node), "--state", '{"n": 21}', "--timeout", "20", env=env)
    out = _one_json(proc)
    assert proc.returncode == 0, out
    assert (out["status"], out["output"], out["error"]) == ("succeeded", {"doubled": 42}, None)
    assert out["logs"] == "doubling 21\n" and out["runtime"] == runtime
    assert out["language"] == "typescript"

    proc = run_cli("validate", str(node), env=env)
    assert proc.returncode == 0
    assert _one_json(proc) == {"ok": True, "language": "typescript", "error": None, "problems": []}

    bad = tmp_path / "bad.ts"
    bad.write_text('import _ from "npm:lodash@4";\nexport default () => 1;\n')
    proc = run_cli("validate", str(bad), env=env)
    out = _one_json(proc)
    assert proc.returncode == 1 and out["ok"] is False and out["language"] == "typescript"
    assert out["error"]["code"] == "CODE_INVALID"
    assert (
        out["problems"][0]["line"] == 1
        and "npm:lodash is not an allowed package" in (out["problems"][0]["message"])
    )
