"""TypeScript code nodes on Deno: ``main(state)`` or the default export (plain or async)
returns the node's output.

Deno runs with NO permission flag, so the code cannot read or write files, use the network,
read environment variables or start processes, in either runtime; ``--no-remote`` and
``--cached-only`` mean it can import only what is already in the Deno cache (the image's
/deno-dir, or STUDIO_CODE_TS_DENO_DIR in subprocess mode), and the save-time check
(``check_typescript``) allows only the pinned packages of STUDIO_CODE_TS_PACKAGES.

The runner (``ts_runner.js``) is Deno's main module, given in argv as a data: URL; the user's
code travels on stdin and is imported as a separate module, never pasted into the runner. The
result comes back as a frame on stdout delimited by a per-run secret marker (see
``ts_runner.js`` for why): ``result_bytes`` cuts it out.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import shutil
import signal
from pathlib import Path

from executor.errors import ErrorCode
from executor.languages.base import NO_FACTS, ImageFacts, Language, Problem
from executor.languages.ts_imports import check_typescript
from executor.models import CodeErrorInfo, CodeJob, Limits, RawRun
from executor.settings import Settings, sandbox_ids

RUNNER_SOURCE = (Path(__file__).parent / "ts_runner.js").read_text(encoding="utf-8")
RUNNER_URL = "data:application/javascript;base64," + base64.b64encode(
    RUNNER_SOURCE.encode("utf-8")
).decode("ascii")

#: ``deno run`` flags besides the V8 ones. No --allow-* at all: every permission is refused
#: without a prompt (--no-prompt). No config, lock file or node_modules folder is looked for
#: (the working folder and its parents could hold a deno.json or package.json). Nothing is
#: fetched (--no-remote, --cached-only): an import the cache lacks fails at once.
DENO_FLAGS = (
    "--no-remote",
    "--cached-only",
    "--no-prompt",
    "--no-config",
    "--no-lock",
    "--node-modules-dir=none",
)
IMAGE_DENO = "deno"  # on the image's PATH (/usr/local/bin/deno)
IMAGE_DENO_DIR = "/deno-dir"  # the image's read-only cache, filled from deps.ts at build time
BUILD_COMMAND = "docker/build.sh typescript"

# The sentences an admin sees. The runner gets them in its argv, so the wording lives here.
PERMISSION_MESSAGE = (
    "Code nodes cannot read or write files, use the network, read environment variables or "
    "start processes: Deno runs them with no permission. Pass what the code needs in the "
    "state instead."
)
MISSING_PACKAGE_DOCKER = (
    "{spec} is not in the sandbox's Deno cache: rebuild the image {image} with it in "
    f"docker/studio-code-ts/deps.ts ({BUILD_COMMAND}), or remove it from "
    "STUDIO_CODE_TS_PACKAGES."
)
MISSING_PACKAGE_SUBPROCESS = (
    "{spec} is not in the Deno cache STUDIO_CODE_TS_DENO_DIR={deno_dir}: fill it with "
    "`DENO_DIR={deno_dir} deno cache --no-config --no-lock deps.ts` (a deps.ts importing every "
    "package of STUDIO_CODE_TS_PACKAGES) and make it readable by the sandbox user, or remove "
    "it from STUDIO_CODE_TS_PACKAGES."
)
CACHE_UNREADABLE_DOCKER = (
    "The sandbox user cannot read the Deno cache /deno-dir of the image {image}: rebuild it "
    f"with {BUILD_COMMAND}, which makes the cache readable by every user."
)
CACHE_UNREADABLE_SUBPROCESS = (
    "The sandbox user cannot read the Deno cache STUDIO_CODE_TS_DENO_DIR={deno_dir}: make it "
    "and every parent folder readable by uid {uid} (chmod -R a+rX on the cache, a+x on its "
    "parents); the server runs code nodes as that user."
)
MISSING_PACKAGE_ANY = (
    "A package the code imports is not in the sandbox's Deno cache: rebuild the image with it "
    f"in docker/studio-code-ts/deps.ts ({BUILD_COMMAND}), or in subprocess mode `deno cache` it "
    "into STUDIO_CODE_TS_DENO_DIR; or remove it from STUDIO_CODE_TS_PACKAGES."
)
RUNNER_MESSAGES = {
    "permission": PERMISSION_MESSAGE,
    "syntax": "Fix the code and save it again.",
    "noEntryPoint": (
        "The code exports no main function: add `export function main(state)` (or an export "
        "default function) returning the node's output."
    ),
    "notJson": (
        "main returned a value that is not JSON ({detail}): return objects, arrays, strings, "
        "finite numbers, booleans or null. A BigInt, a function or a cycle cannot be sent."
    ),
    "tooLarge": (
        "main returned {size} bytes of JSON, more than the limit of {limit}: return less, or "
        "keep large data elsewhere."
    ),
    "neverSettles": (
        "main returned a promise that can never settle (nothing was left to wait for): resolve "
        "or reject it, or await the work it stands for."
    ),
}

# What Deno prints when V8 runs out of heap (--max-old-space-size), then it dies of SIGTRAP.
_OOM_MARKERS = (
    b"Fatal JavaScript out of memory",
    b"Reached heap limit",
    b"JavaScript heap out of memory",
    b"Fatal process out of memory",
)
_SIGTRAP_EXITS = (-signal.SIGTRAP, 128 + signal.SIGTRAP)  # subprocess, docker
_NO_THREADS = b"unable to create worker threads"
#: what the runner writes to stdout once Deno runs it, before the node's code is imported (the
#: code can add bytes to stdout, never take these away)
RUNNER_STARTED = b"\x1estudio-runner-started\x1e"
_NEVER_RESOLVED = b"Top-level await promise never resolved"
_PERMISSION_MARKERS = (b"NotCapable", b"PermissionDenied")
_MISSING_MARKERS = (b"not found in cache", b"Could not find npm package")

# Signs the marker: a per-process secret, so a marker cannot be guessed from the job id.
_MARKER_KEY = secrets.token_bytes(32)


class TypeScript(Language):
    name = "typescript"
    test_program = "export function main(state: unknown) {\n  return { ready: true };\n}\n"

    # --- how to start it ---------------------------------------------------------------

    def image(self, settings: Settings) -> str:
        return settings.code_ts_image

    def command(self, settings: Settings, limits: Limits, *, in_container: bool) -> list[str]:
        heap_mib = max(16, limits.memory_bytes * 3 // 4 // (1024 * 1024))
        v8_flags = [f"--max-old-space-size={heap_mib}"]
        if not in_container:
            # V8 gives Deno one worker thread per CPU the process may use (measured: 1 with
            # taskset -c 0, 2 on 2 CPUs, plus ~6 threads of Deno's own). A container gets
            # ceil(STUDIO_CODE_CPUS) CPUs through its cgroup quota, but a host child may use
            # every CPU, and RLIMIT_NPROC (=STUDIO_CODE_PIDS) counts the threads of ALL
            # concurrent runs of the sandbox uid: on a 16-CPU host 4 concurrent runs would need
            # ~90 of 64 and Deno would fail to start. --single-threaded stops V8 from starting
            # worker threads (GC and optimisation run on the main thread), so a run needs ~6
            # threads on any host; raising STUDIO_CODE_PIDS is not needed.
            v8_flags.append("--single-threaded")
        config = {
            "outputMaxBytes": limits.output_max_bytes,
            "packages": self.packages(settings, NO_FACTS),
            "messages": {**RUNNER_MESSAGES, **_cache_messages(settings, in_container)},
        }
        deno = IMAGE_DENO if in_container else deno_binary(settings)
        return [
            deno,
            "run",
            *DENO_FLAGS,
            "--v8-flags=" + ",".join(v8_flags),
            RUNNER_URL,
            json.dumps(config, ensure_ascii=False, separators=(",", ":")),
        ]

    def environment(self, settings: Settings, *, in_container: bool) -> dict[str, str]:
        env = {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1"}
        if in_container:
            return {"HOME": "/tmp", "DENO_DIR": IMAGE_DENO_DIR, **env}
        # Without STUDIO_CODE_TS_DENO_DIR no package may be imported anyway: an empty cache
        # in the run's own folder (the child's cwd; Deno resolves a relative DENO_DIR against
        # it) is all it needs. Without one, a run's own uid (no passwd entry, so no home)
        # leaves Deno nowhere to place its cache and it refuses to start.
        env["DENO_DIR"] = settings.code_ts_deno_dir or ".deno"
        # Deno caches the JavaScript it transpiles from TypeScript in DENO_DIR/gen. On the
        # image's read-only /deno-dir the write fails at once (EROFS), but on a host cache the
        # sandbox user cannot write (or with no DENO_DIR, nobody's /nonexistent home) Deno
        # RETRIES it with back-off: measured +150 ms on every run (188 -> 38 ms for a trivial
        # node). Not caching is right anyway: every node's code is new to the cache.
        env["DENO_EMIT_CACHE_MODE"] = "disable"
        return env

    def stdin_payload(self, job: CodeJob, *, end_mark: str = "") -> bytes:
        head = {"code": job.code, "marker": result_marker(job)}
        if end_mark:
            head["end"] = end_mark
        header = json.dumps(head, ensure_ascii=False)
        return header.encode("utf-8") + b"\n" + job.state_json.encode("utf-8")

    # --- what may be saved, what the editor shows ----------------------------------------

    def check(self, code: str, settings: Settings, facts: ImageFacts) -> list[Problem]:
        # the allow-list is the setting's (the image's cache holds it: docker/README.md)
        return check_typescript(code, settings.ts_packages)

    def packages(self, settings: Settings, facts: ImageFacts) -> list[str]:
        return [str(p) for p in settings.ts_packages]

    # --- reading what it did ---------------------------------------------------------------

    def result_bytes(self, job: CodeJob, raw: RawRun) -> bytes:
        """The JSON between the run's two markers; b"" when the runner wrote no frame (the
        process died or exited first). Bytes the code wrote to fd 1 itself are ignored."""
        marker = result_marker(job).encode("ascii")
        start = raw.stdout.find(marker)
        if start < 0:
            return b""
        start += len(marker)
        end = raw.stdout.find(marker, start)
        return raw.stdout[start:] if end < 0 else raw.stdout[start:end]

    def crash_error(self, raw: RawRun) -> CodeErrorInfo | None:
        """Deno died without a frame (the runner exits 0 right after writing one)."""
        if raw.exit_code in (0, None):
            return None
        logs = raw.logs
        if any(m in logs for m in _OOM_MARKERS) or (
            raw.exit_code in _SIGTRAP_EXITS and raw.logs_truncated
        ):
            # V8's fatal heap exhaustion; the executor words CODE_MEMORY itself.
            return CodeErrorInfo(
                code=ErrorCode.CODE_MEMORY,
                message="V8 reached its heap limit (--max-old-space-size).",
            )
        if _NO_THREADS in logs:
            # Deno's own failure before the runner ran is the operator's to fix; the same
            # words after the runner started came from the node (console.error) or its own
            # Worker, and a node must never be able to claim an infrastructure failure.
            started = RUNNER_STARTED in raw.stdout
            return CodeErrorInfo(
                code=ErrorCode.CODE_ERROR if started else ErrorCode.RUNTIME_UNAVAILABLE,
                message="Deno could not start its threads under the process limit: raise "
                "STUDIO_CODE_PIDS (in subprocess mode it counts the threads of every concurrent "
                "run of the sandbox user) or lower STUDIO_CODE_CONCURRENCY.",
            )
        if _NEVER_RESOLVED in logs:
            return CodeErrorInfo(code=ErrorCode.CODE_ERROR, message=RUNNER_MESSAGES["neverSettles"])
        # Deno's own "error: Uncaught ..." (e.g. from a Worker): say what the admin can do.
        if any(m in logs for m in _PERMISSION_MARKERS):
            sentence = PERMISSION_MESSAGE
        elif any(m in logs for m in _MISSING_MARKERS):
            sentence = MISSING_PACKAGE_ANY
        else:
            return None
        text = logs.decode("utf-8", errors="replace").strip()
        return CodeErrorInfo(code=ErrorCode.CODE_ERROR, message=f"{sentence}\n{text}")


def result_marker(job: CodeJob) -> str:
    """The secret that delimits this run's result frame on stdout."""
    digest = hmac.new(_MARKER_KEY, job.job_id.encode("utf-8"), hashlib.sha256).hexdigest()
    return f"\x1estudio-result:{digest[:40]}\x1e"


def deno_binary(settings: Settings) -> str:
    """STUDIO_DENO resolved on PATH; for the default ``deno``, the binary of the ``deno`` PyPI
    package of this environment when PATH has none (a virtualenv that is not activated).
    Unresolved, it is returned as given, and the runtime reports it missing."""
    found = shutil.which(settings.deno)
    if found:
        return found
    if settings.deno == "deno":
        try:
            from deno import find_deno_bin

            return find_deno_bin()
        except (ImportError, FileNotFoundError):
            pass
    return settings.deno


def _cache_messages(settings: Settings, in_container: bool) -> dict[str, str]:
    """What to do about the Deno cache, in this runtime's words; {spec} is the runner's."""
    if in_container:
        image = settings.code_ts_image
        return {
            "missingPackage": MISSING_PACKAGE_DOCKER.replace("{image}", image),
            "cacheUnreadable": CACHE_UNREADABLE_DOCKER.replace("{image}", image),
        }
    deno_dir = settings.code_ts_deno_dir or "(unset)"
    uid = str(sandbox_ids()[0])
    return {
        "missingPackage": MISSING_PACKAGE_SUBPROCESS.replace("{deno_dir}", deno_dir),
        "cacheUnreadable": CACHE_UNREADABLE_SUBPROCESS.replace("{deno_dir}", deno_dir).replace(
            "{uid}", uid
        ),
    }
