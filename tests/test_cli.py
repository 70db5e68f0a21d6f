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


@pytest.mark.parametrize("runtime", ["docker", "subprocess"])
def test_run_prints_the_contract_and_exits_zero_on_success(node, runtime, request):
    if runtime == "docker":
        request.getfixturevalue("python_image")
    path = node("def main(state):\n    print('hi')\n    return state['x'] * 2\n")
    proc = run_cli("run", path, "--state", '{"x": 21}', "--timeout", "10",
                   env={**ON, "STUDIO_CODE_RUNTIME": runtime})
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
    assert (proc.returncode, out["status"], out["error"]["code"]) == (1, "timed_out",
                                                                       "CODE_TIMEOUT")


def test_bad_state_json_is_invalid_before_anything_runs(node):
    proc = run_cli("run", node("def main(s):\n    return 1\n"), "--state", "{nope", env=ON)
    out = one_json(proc)
    assert (proc.returncode, out["status"], out["error"]["code"]) == (1, "invalid",
                                                                       "CODE_INVALID")
    assert "--state is not valid JSON" in out["error"]["message"]


def test_code_nodes_off_says_how_to_turn_them_on(node):
    proc = run_cli("run", node("def main(s):\n    return 1\n"),
                   env={"STUDIO_ENABLE_CODE_NODES": "0"})
    out = one_json(proc)
    assert out["error"]["code"] == "CODE_NODES_DISABLED"
    assert "STUDIO_ENABLE_CODE_NODES=1" in out["error"]["message"]


def test_a_malformed_setting_stops_with_a_sentence(node):
    proc = run_cli("run", node("def main(s):\n    return 1\n"),
                   env={**ON, "STUDIO_CODE_MEMORY": "lots"})
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
