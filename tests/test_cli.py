"""The `studio-code` CLI contract: ONE JSON object per command, exit 0 only on success."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

CONTRACT = {"status", "output", "error", "logs", "runtime", "duration_ms", "warnings"}
ON = {"STUDIO_ENABLE_CODE_NODES": "1"}


@pytest.fixture
def node(tmp_path):
    def write(code: str, name: str = "node.py"):
        path = tmp_path / name
        path.write_text(code)
        return str(path)

    return write


def one_json(proc) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr
    return json.loads(lines[0])


@pytest.mark.parametrize(
    "runtime", [pytest.param("docker", marks=pytest.mark.docker), "subprocess"]
)
def test_run_prints_the_contract_and_exits_zero_on_success(node, runtime, request):
    if runtime == "docker":
        request.getfixturevalue("python_image")
    path = node("def main(state):\n    print('hi')\n    return state['x'] * 2\n")
    proc = run_cli(
        "run",
        path,
        "--state",
        '{"x": 21}',
        "--timeout",
        "10",
        env={**ON, "STUDIO_CODE_RUNTIME": runtime},
    )
    out = one_json(proc)
    assert proc.returncode == 0
    assert CONTRACT <= set(out)
    assert (out["status"], out["output"], out["error"]) == ("succeeded", 42, None)
    assert out["logs"] == "hi\n" and out["runtime"] == runtime
    assert isinstance(out["duration_ms"], float)


def test_run_failure_exits_nonzero_with_code_and_message(node, python_image):
    path = node("def main(state):\n    raise ValueError('boom')\n")
    proc = run_cli("run", path, env=ON)
    out = one_json(proc)
    assert proc.returncode == 1
    assert out["status"] == "failed" and out["error"]["code"] == "CODE_ERROR"
    assert "ValueError: boom" in out["error"]["message"]


def test_run_with_a_state_file_and_a_timeout(node, tmp_path, python_image):
    state = tmp_path / "state.json"
    state.write_text('{"n": 5}')
    path = node("import time\ndef main(state):\n    time.sleep(state['n'])\n")
    proc = run_cli("run", path, "--state-file", str(state), "--timeout", "1", env=ON)
    out = one_json(proc)
    assert (proc.returncode, out["status"], out["error"]["code"]) == (
        1,
        "timed_out",
        "CODE_TIMEOUT",
    )


def test_bad_state_json_is_invalid_before_anything_runs(node):
    proc = run_cli("run", node("def main(s):\n    return 1\n"), "--state", "{nope", env=ON)
    out = one_json(proc)
    assert (proc.returncode, out["status"], out["error"]["code"]) == (1, "invalid", "CODE_INVALID")
    assert "--state is not valid JSON" in out["error"]["message"]


def test_code_nodes_off_says_how_to_turn_them_on(node):
    proc = run_cli(
        "run", node("def main(s):\n    return 1\n"), env={"STUDIO_ENABLE_CODE_NODES": "0"}
    )
    out = one_json(proc)
    assert out["error"]["code"] == "CODE_NODES_DISABLED"
    assert "STUDIO_ENABLE_CODE_NODES=1" in out["error"]["message"]


def test_a_malformed_setting_stops_with_a_sentence(node):
    proc = run_cli(
        "run", node("def main(s):\n    return 1\n"), env={**ON, "STUDIO_CODE_MEMORY": "lots"}
    )
    out = one_json(proc)
    assert proc.returncode == 2
    assert "STUDIO_CODE_MEMORY='lots'" in out["error"]["message"]


def test_validate(node):
    ok = run_cli("validate", node("async def main(state):\n    return 1\n"))
    assert ok.returncode == 0 and one_json(ok)["ok"] is True
    bad = run_cli("validate", node("def main(state:\n    return 1\n"))
    out = one_json(bad)
    assert bad.returncode == 1 and out["error"]["code"] == "CODE_INVALID"
    assert out["problems"][0]["line"] == 1


def test_meta(python_image):
    proc = run_cli("meta", env={**ON, "STUDIO_CODE_LANGUAGES": "python"})
    out = one_json(proc)
    assert proc.returncode == 0
    assert out["enabled"] is True and out["code_runtime"] == "docker"
    python = next(lang for lang in out["languages"] if lang["name"] == "python")
    assert python["ready"] is True, python["reason"]
    assert python["packages"] == ["pydantic", "python-dateutil"]
    assert out["limits"]["memory"] == "256m" and out["limits"]["pids"] == 64
    assert "uid" in out["sandbox_user"]
    # the engine, and (asked fresh) what the kernel applied inside a sandbox
    assert out["engine"]["this_process"]["docker"]["version"]
    assert out["engine"]["sandbox"]["no_new_privs"] is True, out["engine"]
    assert out["engine"]["sandbox"]["seccomp_filter"] is True


# --- every outcome is ONE JSON object of the documented shape (issue 11) --------------------

SUB = {**ON, "STUDIO_CODE_RUNTIME": "subprocess"}


def run_fields() -> set[str]:
    from executor.models import CodeResult

    return set(CodeResult.model_fields)  # job_id, language, ..., code_runtime, trace


def refused_run(proc, code: str, exit_status: int) -> dict:
    """The run's whole object, refused with ``code``, and the exit status."""
    out = one_json(proc)
    assert set(out) == run_fields(), out
    assert out["status"] == "invalid" and out["output"] is None, out
    assert out["error"]["code"] == code, out
    assert isinstance(out["job_id"], str) and len(out["job_id"]) == 32
    assert (out["logs"], out["warnings"], out["trace"]) == ("", [], [])
    assert proc.returncode == exit_status, out
    return out


@pytest.mark.parametrize("value", ["abc", "-1", "0", "nan"])
def test_a_bad_timeout_is_refused_as_http_refuses_it(node, value):
    proc = run_cli("run", node("def main(s):\n    return 1\n"), "--timeout", value, env=SUB)
    out = refused_run(proc, "CODE_INVALID", 1)
    assert f"--timeout={value!r} is not a timeout" in out["error"]["message"]
    assert out["code_runtime"] == "subprocess"


@pytest.mark.parametrize(
    ("state", "says"),
    [
        ('{"x": NaN}', "NaN is not a JSON number"),
        ("[1,2]", "is an array, not a JSON object"),
    ],
)
def test_a_state_http_refuses_is_refused(node, state, says):
    proc = run_cli("run", node("def main(s):\n    return s\n"), "--state", state, env=SUB)
    assert says in refused_run(proc, "CODE_INVALID", 1)["error"]["message"]


def test_an_unreadable_file_prints_every_field(tmp_path):
    proc = run_cli("run", str(tmp_path / "missing.py"), env=SUB)
    out = refused_run(proc, "CODE_INVALID", 1)
    assert "Cannot read" in out["error"]["message"]
    assert (out["runtime"], out["code_runtime"], out["language"]) == (
        "subprocess",
        "subprocess",
        "python",
    )


@pytest.mark.parametrize("name", ["node.js", "node.txt", "node"])
def test_an_unknown_extension_is_refused_with_the_supported_list(node, name):
    path = node("def main(s):\n    return 1\n", name)
    out = refused_run(run_cli("run", path, env=SUB), "CODE_INVALID", 1)
    assert ".py (python), .ts (typescript)" in out["error"]["message"]
    assert "--language" in out["error"]["message"] and out["language"] is None
    bad = run_cli("validate", path)
    val = one_json(bad)
    assert (bad.returncode, val["ok"], val["error"]["code"]) == (1, False, "CODE_INVALID")


def test_an_unknown_extension_runs_when_the_language_is_given(node):
    path = node("def main(s):\n    return s['n'] + 1\n", "node.txt")
    proc = run_cli("run", path, "--language", "python", "--state", '{"n": 1}', env=SUB)
    out = one_json(proc)
    assert (proc.returncode, out["status"], out["output"]) == (0, "succeeded", 2)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["run"], "the following arguments are required: file"),
        (["run", "x.py", "--language", "cobol"], "invalid choice: 'cobol'"),
        (["run", "x.py", "--state", "{}", "--state-file", "s.json"], "not allowed with"),
        (["run", "x.py", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_a_malformed_run_command_line_is_the_run_object(args, says):
    out = refused_run(run_cli(*args, env=SUB), "REQUEST_INVALID", 2)
    assert says in out["error"]["message"]
    assert f"Run `studio-code {args[0]} --help`" in out["error"]["message"]


@pytest.mark.parametrize(
    ("args", "command", "says"),
    [
        ([], None, "the following arguments are required: COMMAND"),
        (["bogus"], None, "invalid choice: 'bogus'"),
        (["validate"], "validate", "the following arguments are required: file"),
        (["status"], "status", "the following arguments are required: job_id"),
        (["meta", "--x"], "meta", "unrecognized arguments: --x"),
        (["serve", "--port", "http"], "serve", "invalid int value: 'http'"),
    ],
)
def test_a_malformed_command_line_is_one_json_object(args, command, says):
    proc = run_cli(*args)
    out = one_json(proc)
    assert proc.returncode == 2
    assert (out["ok"], out["command"], out["error"]["code"]) == (False, command, "REQUEST_INVALID")
    assert says in out["error"]["message"]
    assert "usage:" not in proc.stdout + proc.stderr  # no argparse text anywhere


def test_worker_help_is_our_own_and_prints_no_stopped_line():
    proc = run_cli("worker", "--help")
    assert proc.returncode == 0
    assert proc.stdout.startswith("usage: studio-code worker")
    assert "STUDIO_REDIS_URL" in proc.stdout and "code.test,code.run" in proc.stdout
    assert not [line for line in proc.stdout.splitlines() if line.startswith("{")]  # no JSON
    assert "celery worker [OPTIONS]" not in proc.stdout + proc.stderr  # Celery's own help


def test_a_misspelled_variable_is_warned_on_stderr_naming_the_closest(node):
    proc = run_cli(
        "validate",
        node("def main(s):\n    return 1\n"),
        env={"STUDIO_CODE_MEMROY": "1g", "STUDIO_ENABLE_CODE_NODE": "1"},
    )
    assert proc.returncode == 0 and one_json(proc)["ok"] is True  # stdout: the object only
    assert "STUDIO_CODE_MEMROY is not a studio-code setting" in proc.stderr
    assert "did you mean STUDIO_CODE_MEMORY?" in proc.stderr
    assert "did you mean STUDIO_ENABLE_CODE_NODES?" in proc.stderr


def test_an_empty_value_means_the_default(node):
    path = node("def main(s):\n    return 1\n")
    off = run_cli("run", path, env={"STUDIO_ENABLE_CODE_NODES": ""})
    out = one_json(off)  # off by default: not a malformed setting
    assert (off.returncode, out["error"]["code"]) == (1, "CODE_NODES_DISABLED")
    empty = {
        name: ""
        for name in (
            "STUDIO_CODE_MEMORY",
            "STUDIO_CODE_CPUS",
            "STUDIO_CODE_PIDS",
            "STUDIO_CODE_MAX_SECONDS",
            "STUDIO_CODE_LANGUAGES",
        )
    }
    proc = run_cli("run", path, env={**SUB, **empty})
    assert (proc.returncode, one_json(proc)["output"]) == (0, 1)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "x.py"],
        ["run", "x.py", "--state", '{"n": 1}', "--timeout", "3", "--memory", "512m"],
        ["run", "x.py", "--cpus", "0.5", "--language", "typescript", "--state-file", "s"],
        ["run"],
        ["run", "x.py", "--language", "cobol"],
        ["run", "x.py", "--state", "{}", "--state-file", "s.json"],
        ["run", "x.py", "--cpus", "many"],
        ["run", "x.py", "--bogus", "y"],
        ["validate", "x.py", "--language", "python"],
        ["validate"],
        ["validate", "x.py", "--timeout", "3"],
    ],
)
def test_a_command_parsed_alone_parses_and_refuses_as_in_the_whole_parser(argv, capsys):
    """`run` and `validate` get a parser of their own command only (api_client/cli.py
    build_parser): what it parses, refuses and prints for help is the whole parser's."""
    from api_client.cli import UsageError, build_parser

    def parse(parser):
        try:
            args, extra = parser.parse_known_args(argv)
        except UsageError as e:
            return ("refused", e.command, e.message)
        seen = vars(args)
        return ("parsed", seen.pop("handler").__name__, seen, extra)

    assert parse(build_parser(argv[0])) == parse(build_parser())

    def help_text(parser):
        with pytest.raises(SystemExit):
            parser.parse_known_args([argv[0], "--help"])
        return capsys.readouterr().out

    assert help_text(build_parser(argv[0])) == help_text(build_parser())
