"""The Python language contract, in BOTH runtimes: main(state) in, JSON out, prints as logs,
and a clear error code and sentence for every way user code can go wrong."""

from __future__ import annotations

import json

import pytest

from executor.models import CodeJob, Status
from testkit.processes import require


@pytest.fixture(
    params=[
        pytest.param("docker", marks=pytest.mark.docker),
        pytest.param("docker-pool", marks=pytest.mark.docker),
        "subprocess",
    ]
)
def executor(request):
    name = {
        "docker": "docker_executor",
        "docker-pool": "docker_pool_executor",
        "subprocess": "subprocess_executor",
    }[request.param]
    return request.getfixturevalue(name)


def run(executor, code, state="{}", timeout_s=20):
    return executor.run(CodeJob(code=code, state_json=state, timeout_s=timeout_s))


def test_main_gets_the_state_and_returns_the_output(executor):
    r = run(executor, "def main(state):\n    return {'n': state['n'] + 1}\n", '{"n": 41}')
    assert r.status is Status.SUCCEEDED and r.output == {"n": 42}
    assert r.error is None and r.exit_code == 0
    assert r.code_runtime == executor.settings.code_runtime
    assert [row.runtime for row in r.trace] == [executor.settings.code_runtime] * 2


def test_async_main(executor):
    code = "import asyncio\nasync def main(state):\n    await asyncio.sleep(0)\n    return [1]\n"
    assert run(executor, code).output == [1]


def test_prints_are_logs_never_the_result(executor):
    code = (
        "import os, sys, subprocess\n"
        "def main(state):\n"
        "    print('to stdout')\n"
        "    print('to stderr', file=sys.stderr)\n"
        "    os.write(1, b'raw fd 1\\n')\n"
        "    return 'result'\n"
    )
    r = run(executor, code)
    assert r.output == "result"
    for text in ("to stdout", "to stderr", "raw fd 1"):
        assert text in r.logs


def test_pydantic_and_dateutil_are_importable(executor):
    code = (
        "import pydantic, dateutil.parser\n"
        "class M(pydantic.BaseModel):\n    n: int\n"
        "def main(state):\n"
        "    return [M(n='3').n, dateutil.parser.parse('2026-11-30T10:00:00Z').year]\n"
    )
    r = run(executor, code)
    if executor.settings.code_runtime == "subprocess":
        require(
            r.status is Status.SUCCEEDED,
            "the subprocess interpreter has no pydantic/dateutil (apt-get install "
            "python3-pydantic python3-dateutil)",
        )
    assert r.output == [3, 2026]


def test_a_user_exception_reports_the_users_line_numbers(executor):
    code = "def helper(x):\n    return 1 / x\n\ndef main(state):\n    return helper(0)\n"
    r = run(executor, code)
    assert r.status is Status.FAILED and r.error.code == "CODE_ERROR"
    assert 'File "main.py", line 5, in main' in r.error.message
    assert 'File "main.py", line 2, in helper' in r.error.message
    assert "return 1 / x" in r.error.message
    assert "ZeroDivisionError" in r.error.message
    assert "<string>" not in r.error.message  # no runner frames


@pytest.mark.parametrize(
    ("code", "state", "status", "error", "says"),
    [
        (
            "def main(state):\n    return {1, 2}\n",
            "{}",
            "failed",
            "CODE_OUTPUT_INVALID",
            "not JSON",
        ),
        (
            "def main(state):\n    return float('nan')\n",
            "{}",
            "failed",
            "CODE_OUTPUT_INVALID",
            "not JSON",
        ),
        ("def main(state)\n    return 1\n", "{}", "invalid", "CODE_INVALID", "line 1"),
        ("def run(state):\n    return 1\n", "{}", "invalid", "CODE_INVALID", "def main(state)"),
        (
            "import sys\ndef main(state):\n    sys.exit(3)\n",
            "{}",
            "failed",
            "CODE_ERROR",
            "sys.exit(3)",
        ),
        (
            "import os\ndef main(state):\n    os._exit(0)\n",
            "{}",
            "failed",
            "CODE_ERROR",
            "exit status 0",
        ),
        (
            "def main(state):\n    return 1\n",
            "{not json",
            "invalid",
            "CODE_INVALID",
            "state is not valid JSON",
        ),
        ("main = 3\n", "{}", "invalid", "CODE_INVALID", "def main(state)"),
    ],
    ids=["set", "nan", "syntax", "no-main", "sys-exit", "os-exit", "bad-state", "main-not-fn"],
)
def test_each_failure_has_a_code_and_a_sentence(executor, code, state, status, error, says):
    r = run(executor, code, state)
    assert (str(r.status), r.error.code) == (status, error), r
    assert says in r.error.message
    assert r.output is None


def test_unicode_round_trips(executor):
    r = run(
        executor,
        "def main(state):\n    print('ünï')\n    return state\n",
        json.dumps({"s": "日本語 ✓"}),
    )
    assert r.output == {"s": "日本語 ✓"} and "ünï" in r.logs


@pytest.mark.docker
def test_output_larger_than_the_limit_is_refused(make_settings, request):
    from executor.service import Executor

    request.getfixturevalue("python_image")
    ex = Executor(make_settings(code_output_max_bytes=4096))
    r = run(ex, "def main(state):\n    return 'x' * 10000\n")
    assert r.error.code == "CODE_OUTPUT_INVALID"
    assert "limit of 4096" in r.error.message


@pytest.mark.parametrize(
    "forged",
    [
        '{"ok": false, "error": "x"}',
        '{"ok": false, "error": {"code": "RATE_LIMITED"}}',
        "[1, 2]",
        '{"ok": true',
    ],
    ids=["error-not-a-dict", "foreign-code", "not-an-object", "truncated"],
)
def test_code_writing_to_the_result_channel_cannot_break_the_executor(executor, forged):
    # The runner's result fd is reachable from user code; whatever it writes there must
    # end as a result with a runner's error code, never an exception or a foreign code.
    code = (
        "import os\n"
        "def main(state):\n"
        "    for fd in range(3, 10):\n"
        "        try:\n"
        f"            os.write(fd, {forged!r}.encode())\n"
        "            os.close(fd)\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"
    )
    r = run(executor, code)
    assert r.status is Status.FAILED
    assert r.error.code in ("CODE_ERROR", "CODE_OUTPUT_INVALID")


#: how many times each fork program runs: the bug it guards against was a race (the child's
#: reply beside the parent's on the result channel, or in place of it), so one run proves little
FORK_RUNS = 10

FORK_PROGRAMS = {
    # the child does not _exit: it returns from main too, with the same value
    "child-returns-the-same": (
        "import os\ndef main(state):\n    os.fork()\n    return {'n': state['n']}\n"
    ),
    # the child answers FIRST (the parent waits for it), with a value of its own
    "child-returns-first": (
        "import os\n"
        "def main(state):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        print('child was here', flush=True)\n"
        "        return {'n': -1, 'who': 'child'}\n"
        "    os.waitpid(pid, 0)\n"
        "    return {'n': state['n']}\n"
    ),
    # the child raises after the parent waited for it: its error is no result either
    "child-raises-first": (
        "import os\n"
        "def main(state):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        raise ValueError('from the child')\n"
        "    os.waitpid(pid, 0)\n"
        "    return {'n': state['n']}\n"
    ),
    # a fork before main (at import), and an atexit hook the child would run at exit
    "fork-at-import-with-atexit": (
        "import atexit, os\n"
        'atexit.register(lambda: os.write(3, b\'{"ok": true, "output": "atexit"}\'))\n'
        "CHILD = os.fork() == 0\n"
        "def main(state):\n"
        "    if CHILD:\n"
        "        return {'n': -1, 'who': 'child'}\n"
        "    return {'n': state['n']}\n"
    ),
}


@pytest.mark.parametrize("program", list(FORK_PROGRAMS), ids=list(FORK_PROGRAMS))
def test_only_the_process_that_started_main_answers(executor, program):
    """A node that forks without _exit in the child: the child returns from main (or raises)
    into the runner as well. Only the process that started main writes the result, so the
    outcome is the parent's, every time (it was a race: succeeded, or CODE_OUTPUT_INVALID
    blaming the code for writing to the runner's file descriptors, or the child's output)."""
    outcomes = []
    for i in range(FORK_RUNS):
        r = run(executor, FORK_PROGRAMS[program], json.dumps({"n": i}))
        outcomes.append((r.status, r.error and r.error.code, r.output))
        if program == "child-returns-first":
            assert "child was here" in r.logs  # the child's own logs are kept
    assert outcomes == [(Status.SUCCEEDED, None, {"n": i}) for i in range(FORK_RUNS)]
