"""The one state rule and the one timeout rule (executor.inputs), and that the CLI and
CodeClient (through which the HTTP routes submit) give the same answer for the same input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from executor.errors import CodeInvalid
from executor.inputs import state_json, timeout_s
from tests.conftest import run_cli

MAX = 1024

#: (state as JSON text, what the refusal says); every door refuses each of these
BAD_STATES = [
    ('{"x": NaN}', "NaN is not a JSON number"),
    ('{"x": Infinity}', "Infinity is not a JSON number"),
    ('{"x": -Infinity}', "-Infinity is not a JSON number"),
    ('{"x": 1e999}', "1e999 is too large for a JSON number"),
    ("{nope", "is not valid JSON"),
    ("[1, 2]", "is an array, not a JSON object"),
    ('"text"', "is a string, not a JSON object"),
    ("3", "is a number, not a JSON object"),
    ("null", "is null, not a JSON object"),
    ("true", "is true or false, not a JSON object"),
    ('{"blob": "' + "x" * MAX + '"}', "more than STUDIO_CODE_STATE_MAX_BYTES=1024"),
]


@pytest.mark.parametrize(("text", "says"), BAD_STATES)
def test_a_bad_state_is_refused_with_a_sentence(text: str, says: str) -> None:
    with pytest.raises(CodeInvalid) as e:
        state_json(text, max_bytes=MAX, source="--state")
    assert says in e.value.message and e.value.message.startswith("--state ")
    assert e.value.code == "CODE_INVALID"


def test_a_good_state_passes_untouched_and_a_value_is_serialised() -> None:
    text = '{ "b": 1.50, "a": "é" }'
    assert state_json(text, max_bytes=MAX) == text  # the node sees exactly what was given
    assert state_json(text.encode(), max_bytes=MAX) == text
    assert state_json(None, max_bytes=MAX) == "{}"
    assert json.loads(state_json({"a": [1, "é"]}, max_bytes=MAX)) == {"a": [1, "é"]}
    # exactly at the limit passes, ASCII or not (the size is UTF-8 bytes)
    for pad in ("x" * (MAX - 11), "é" * ((MAX - 11) // 2) + "x" * ((MAX - 11) % 2)):
        text = json.dumps({"pad": pad}, ensure_ascii=False)
        assert len(text.encode()) == MAX
        assert state_json(text, max_bytes=MAX) == text


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"x": float("nan")}, "cannot be sent as JSON"),
        ({"x": {1, 2}}, "cannot be sent as JSON"),
        ([1, 2], "is an array, not a JSON object"),
        (b"\xff", "is not UTF-8 text"),
        ({"blob": "x" * MAX}, "more than STUDIO_CODE_STATE_MAX_BYTES"),
        # the size is UTF-8 bytes, not characters: 400 "é" are 800 bytes + the rest
        ({"blob": "é" * 400 + "x" * 300}, "more than STUDIO_CODE_STATE_MAX_BYTES"),
        ({"x": "\ud800"}, "holds a lone surrogate"),
    ],
)
def test_a_bad_state_value_is_refused(value: Any, says: str) -> None:
    with pytest.raises(CodeInvalid, match=says):
        state_json(value, max_bytes=MAX)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, 30.0),
        (5, 5.0),
        (2.5, 2.5),
        ("2.5", 2.5),
        (" 7 ", 7.0),
        (1e9, 30.0),
        ("1e9", 30.0),
    ],
)
def test_a_timeout_is_above_zero_and_capped(value: Any, seconds: float) -> None:
    assert timeout_s(value, max_seconds=30) == seconds


@pytest.mark.parametrize(
    "value", [0, -1, "-1", "0", "abc", "", "nan", "inf", float("nan"), float("inf"), True]
)
def test_a_bad_timeout_is_refused(value: Any) -> None:
    with pytest.raises(CodeInvalid) as e:
        timeout_s(value, max_seconds=30, source="--timeout")
    assert e.value.message.startswith(f"--timeout={value!r} is not a timeout")
    assert "STUDIO_CODE_MAX_SECONDS=30" in e.value.message


def test_the_cli_and_the_client_refuse_the_same_states(make_settings: Any, tmp_path: Path) -> None:
    """`studio-code run --state` used to accept {"x": NaN} while CodeClient.submit refused
    it: one rule now, so every bad state gets the same sentence from both."""
    from api_client import CodeClient

    node = tmp_path / "node.py"
    node.write_text("def main(state):\n    return state\n")
    env = {
        "STUDIO_ENABLE_CODE_NODES": "1",
        "STUDIO_CODE_RUNTIME": "subprocess",
        "STUDIO_CODE_STATE_MAX_BYTES": str(MAX),
    }
    settings = make_settings(
        redis_url="redis://127.0.0.1:1/0",
        code_runtime="subprocess",
        code_state_max_bytes=MAX,
        database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
    )
    with CodeClient(settings) as client:
        for text, says in BAD_STATES[:1] + BAD_STATES[4:6] + BAD_STATES[-1:]:
            with pytest.raises(CodeInvalid) as e:
                client.submit(node.read_text(), "python", text)
            proc = run_cli("run", str(node), "--state", text, env=env)
            out = json.loads(proc.stdout)
            assert (proc.returncode, out["status"], out["error"]["code"]) == (
                1,
                "invalid",
                "CODE_INVALID",
            ), text
            assert says in out["error"]["message"] and says in e.value.message
            assert out["error"]["message"].removeprefix("--state") == e.value.message.removeprefix(
                "The state"
            ), text
        for bad in (0, -1):
            with pytest.raises(CodeInvalid, match="is not a timeout"):
                client.submit(node.read_text(), "python", {}, timeout_s=bad)
        assert client.store.counts_by_status().get("queued", 0) == 0
