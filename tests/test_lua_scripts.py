"""The Redis scripts are .lua files (worker.lua): each one run on its own on a real
redis-server with realistic keys and arguments (the Redis state and the reply asserted; the
fair-share operations also through FairQueue in tests/test_fair.py), every .lua file of the
packages loaded by a module, none shipped without it, and no Lua left in a Python string."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.redis import RedisServer, start_redis

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("executor", "worker", "api_client")
#: the module-scoped redis-server below is a Redis service (tests/conftest.py's markers)
SERVICE_FIXTURES = {"redis_proc": ("redis",)}
#: two instants of one script call, one read from TIME, one Redis's expiry clock: the same
#: but for a few ms (far from the seconds the assertions tell apart)
SAME_MS = 500


def lua_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.lua"))


@pytest.fixture(scope="module")
def redis_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with start_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def r(redis_proc: RedisServer) -> Iterator[Any]:
    """A client of the module's redis-server, emptied for each test."""
    import redis

    client = redis.Redis.from_url(redis_proc.url, decode_responses=True)
    client.flushdb()
    yield client
    client.flushdb()
    client.close()


def _now_us(r: Any) -> int:
    """Redis's clock (what the scripts read), in microseconds."""
    seconds, micros = r.time()
    return int(seconds) * 1_000_000 + int(micros)


def _entry(nodename: str, slots: int, **more: Any) -> str:
    return json.dumps({"nodename": nodename, "queue": "code.run", "slots": slots, **more})


# --- worker/upkeep/heartbeat_beat.lua, worker/registry_read.lua ------------------------------


def test_the_beat_stamps_entries_with_redis_clock_and_drops_expired_ones(r: Any) -> None:
    from worker.protocol import workers_key
    from worker.upkeep.heartbeat import _BEAT_LUA

    beat = r.register_script(_BEAT_LUA)
    run_key, test_key = workers_key("code.run"), workers_key("code.test")
    r.hset(run_key, "dead@h", _entry("dead@h", 2, expires_at=1.0))  # expired long ago
    r.hset(run_key, "junk@h", "not json")
    r.hset(run_key, "other@h", _entry("other@h", 3, expires_at=4e9))  # still alive
    before = _now_us(r) / 1e6
    reply = beat(
        keys=[run_key, test_key],
        args=["w@h", 30, _entry("w@h", 4), _entry("w@h", 1, queue="code.test")],
    )
    after = _now_us(r) / 1e6
    assert reply == 1
    assert set(r.hkeys(run_key)) == {"w@h", "other@h"}  # the expired and the junk dropped
    mine = json.loads(r.hget(run_key, "w@h"))
    assert mine["slots"] == 4 and mine["nodename"] == "w@h"
    assert before <= mine["seen_at"] <= after and mine["expires_at"] == mine["seen_at"] + 30
    assert json.loads(r.hget(test_key, "w@h"))["slots"] == 1
    for key in (run_key, test_key):  # EXPIRE ceil(ttl) + 1 from the beat: 31 s
        assert int(before) + 31 <= r.execute_command("EXPIRETIME", key) <= int(after) + 32


def test_the_read_returns_redis_clock_and_only_live_entries_per_key(r: Any) -> None:
    from worker.protocol import workers_key
    from worker.registry import _READ_LUA

    read = r.register_script(_READ_LUA)
    run_key, test_key = workers_key("code.run"), workers_key("code.test")
    live = _entry("a@h", 2, expires_at=4e9)
    r.hset(run_key, mapping={"a@h": live, "b@h": _entry("b@h", 1, expires_at=1.0), "c": "{"})
    before = _now_us(r) / 1e6
    reply = read(keys=[run_key, test_key, workers_key("nobody")])
    assert before <= float(reply[0]) <= _now_us(r) / 1e6
    assert reply[1:] == [[live], [], []]
    assert r.hlen(run_key) == 3, "a read changes nothing"


# --- worker/fair.lua -----------------------------------------------------------------------------


def test_fair_enqueue_leaves_the_state_its_keys_describe(r: Any) -> None:
    """fair.lua's enqueue, called as FairQueue calls it: with no live worker, FAIR_MIN_AHEAD
    runs go to code.run and the rest wait on the user's list."""
    from worker.fair import KEYS, FairQueue
    from worker.protocol import FAIR_MIN_AHEAD

    fair = FairQueue(r, cap=0)
    replies = [fair._run("enqueue", f"j{i}", "ann", f"msg-j{i}") for i in range(FAIR_MIN_AHEAD + 2)]
    assert replies == [1] * FAIR_MIN_AHEAD + [0, 0]
    assert r.lrange("code.run", 0, -1) == [f"msg-j{i}" for i in reversed(range(FAIR_MIN_AHEAD))]
    waiting = [f"j{i}" for i in range(FAIR_MIN_AHEAD, FAIR_MIN_AHEAD + 2)]
    assert r.lrange("studio:fair:wait:ann", 0, -1) == waiting
    assert r.hgetall("studio:fair:jobs") == {j: "ann" for j in waiting}
    assert r.hgetall("studio:fair:messages") == {j: f"msg-{j}" for j in waiting}
    assert r.hgetall("studio:fair:held") == {f"j{i}": "ann" for i in range(FAIR_MIN_AHEAD)}
    # per key: the user's (u:), and its flow's (f:, the user under the default share key)
    assert r.hgetall("studio:fair:held_count") == {
        "u:ann": str(FAIR_MIN_AHEAD),
        "f:ann": str(FAIR_MIN_AHEAD),
    }
    assert r.zscore("studio:fair:counts", "ann") == 2 and r.llen("studio:fair:backlog") == 2
    assert r.zrange("studio:fair:users", 0, -1) == ["ann"]
    # every key the script touched is one of KEYS, a lane's list or a flow's lanes
    assert set(r.keys()) <= {*KEYS, "studio:fair:wait:ann", "studio:fair:lanes:ann"}


def test_fair_names_an_unknown_operation(r: Any) -> None:
    import redis

    from worker.fair import FairQueue

    with pytest.raises(redis.ResponseError, match="worker/fair.lua: no operation nope"):
        FairQueue(r, cap=0)._run("nope")


def test_fair_ended_takes_more_job_ids_than_lua_can_unpack(r: Any) -> None:
    """The reconcile of a sweep may end thousands of runs in one call: the script walks
    ARGV, it never unpacks it (Lua's unpack stops near 8000)."""
    from worker.fair import FairQueue

    fair = FairQueue(r, cap=0)
    r.hset("studio:fair:held", mapping={f"j{i}": "ann" for i in range(10_000)})
    r.hset("studio:fair:held_count", mapping={"u:ann": 10_000, "f:ann": 10_000})
    assert fair.ended([f"j{i}" for i in range(10_000)]) == 0
    assert r.hlen("studio:fair:held") == 0 and not r.exists("studio:fair:held_count")


# --- api_client/admit.lua ------------------------------------------------------------------------


def test_admit_counts_the_rate_alone_as_the_client_calls_it(r: Any) -> None:
    from api_client.client import ADMIT_LUA
    from worker.protocol import rate_key

    admit = r.register_script(ADMIT_LUA)
    key, window_us = rate_key("ann"), 60_000_000
    assert [admit(keys=[key], args=[2, window_us, t]) for t in ("t1", "t2")] == [[1, 0], [1, 0]]
    first, second = r.zscore(key, "t1"), r.zscore(key, "t2")
    before = _now_us(r)
    over, wait_us = admit(keys=[key], args=[2, window_us, "t3"])
    after = _now_us(r)
    assert over == 0  # refused, until t1 leaves the window:
    assert first + window_us - after <= wait_us <= first + window_us - before
    assert r.zrange(key, 0, -1) == ["t1", "t2"], "a refused call is not recorded"
    # kept the window and a second after the last call recorded (PEXPIRE from t2's call;
    # Redis's expiry clock may stand a few ms from TIME's within a script)
    assert abs(r.execute_command("PEXPIRETIME", key) - second / 1000 - 61_000) < SAME_MS
    assert r.keys() == [key]


def test_admit_takes_an_in_flight_slot_first_then_the_rate(r: Any) -> None:
    from api_client.client import ADMIT_LUA
    from worker.protocol import in_flight_key, rate_key

    admit = r.register_script(ADMIT_LUA)
    rate, slots, window_us = rate_key("ann"), in_flight_key("ann"), 60_000_000
    before = _now_us(r) // 1000
    r.zadd(slots, {"gone": before - 1000})  # a call whose waiting ended (its API died)
    assert admit(keys=[rate, slots], args=[10, window_us, "a", 2, 30_000]) == [1, 0]
    assert admit(keys=[rate, slots], args=[10, window_us, "b", 2, 5_000]) == [1, 0]
    after = _now_us(r) // 1000
    assert r.zrange(slots, 0, -1) == ["b", "a"]  # by when each gives up; "gone" dropped
    assert before + 30_000 <= r.zscore(slots, "a") <= after + 30_000
    # kept a second past the longest wait (a's, though b came later)
    assert abs(r.execute_command("PEXPIRETIME", slots) - r.zscore(slots, "a") - 1000) < SAME_MS
    # too many waiting: said first, and the rate is not counted
    assert admit(keys=[rate, slots], args=[10, window_us, "c", 2, 5_000]) == [2, 0]
    assert r.zrange(rate, 0, -1) == ["a", "b"]
    # over the rate with a free slot: no slot taken
    r.zrem(slots, "a", "b")
    over, wait_us = admit(keys=[rate, slots], args=[2, window_us, "d", 2, 5_000])
    assert over == 0 and 0 < wait_us <= window_us
    assert r.zcard(slots) == 0 and r.zrange(rate, 0, -1) == ["a", "b"]


# --- worker/upkeep/take_stale.lua ------------------------------------------------------------


def test_take_stale_removes_only_deliveries_still_there_and_still_old(r: Any) -> None:
    """A delivery made before the cutoff and one the index lost go (hash and index); one made
    after it (taken again meanwhile) and one only in the index (acknowledged halfway) stay."""
    from worker.protocol import KOMBU_UNACKED, KOMBU_UNACKED_INDEX
    from worker.upkeep.queued import take_stale

    entry = json.dumps([{"headers": {"id": "j"}}, "", "code.run"])
    r.hset(KOMBU_UNACKED, mapping={"old": entry, "fresh": entry, "unindexed": entry})
    r.zadd(KOMBU_UNACKED_INDEX, {"old": 1000.0, "fresh": 2000.0, "acked": 500.0})
    assert take_stale(r, ["old", "fresh", "unindexed", "acked", "absent"], 1500.0) == 2
    assert sorted(r.hkeys(KOMBU_UNACKED)) == ["fresh"]
    assert r.zrange(KOMBU_UNACKED_INDEX, 0, -1, withscores=True) == [
        ("acked", 500.0),
        ("fresh", 2000.0),
    ]
    assert take_stale(r, ["old"], 1500.0) == 0, "gone: nothing more to remove"


# --- every script is a loaded file, shipped, and no Lua hides in Python ------------------------


def test_every_lua_file_is_loaded_by_a_module() -> None:
    """Importing every module of the packages (in a fresh interpreter) reads every .lua file
    of them: no orphan script, none loaded from a name that is not there."""
    probe = """
import importlib, json, pkgutil, sys
for top in ("executor", "worker", "api_client"):
    pkg = importlib.import_module(top)
    for m in pkgutil.walk_packages(pkg.__path__, top + "."):
        if not m.name.endswith("_runner"):  # the sandbox's script, not a module
            importlib.import_module(m.name)
from worker import lua
print(json.dumps(sorted(lua.LOADED)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    loaded = {
        (ROOT / package.replace(".", "/") / name).relative_to(ROOT).as_posix()
        for package, name in json.loads(proc.stdout.splitlines()[-1])
    }
    files = {p.relative_to(ROOT).as_posix() for p in lua_files()}
    assert len(files) >= 4, files  # the scan sees them
    assert files == loaded, f"orphans: {sorted(files - loaded)}; missing: {sorted(loaded - files)}"


def test_no_python_string_holds_a_redis_script() -> None:
    """The rule: Lua lives in .lua files (worker.lua), never in a Python string."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    if "redis.call(" in node.value:
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"Lua in a Python string (move it to a .lua file): {found}"


def test_the_scripts_are_in_the_wheel_and_the_app_image() -> None:
    """The wheel (hatchling: every file under the packages but what git ignores) and the app
    image (deploy/Dockerfile copies the package folders whole, from build-images.sh's
    context or Compose's, which its .dockerignore keeps whole) take the .lua files. Checked
    once by hand: the built wheel holds them and, installed, its modules load them."""
    hatch = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]
    wheel = hatch["targets"]["wheel"]
    assert set(wheel["packages"]) == set(PACKAGES)
    for config in (hatch, wheel):  # nothing narrows the packages to their .py files
        assert not {"only-include", "exclude", "include", "artifacts"} & config.keys(), config
    files = [p.relative_to(ROOT).as_posix() for p in lua_files()]
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *files], capture_output=True, text=True, cwd=ROOT
    )
    assert ignored.stdout == "", f"git ignores (so hatchling leaves out): {ignored.stdout}"
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    for pkg in PACKAGES:
        assert re.search(rf"^COPY {pkg} \./{pkg}$", dockerfile, re.M), pkg
    # deploy/build-images.sh's context: the package folders copied whole (cp -r)
    script = (ROOT / "deploy" / "build-images.sh").read_text()
    assert all(f'"$ROOT/{pkg}"' in script for pkg in PACKAGES)
    # Compose's build (BuildKit reads <Dockerfile>.dockerignore): the folders kept whole
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert rules[0] == "*" and {f"!{pkg}/" for pkg in PACKAGES} <= set(rules)
    after = [rule for rule in rules[1:] if not rule.startswith("!")]
    assert not [rule for rule in after if "lua" in rule or rule in ("**", "**/*")], after
