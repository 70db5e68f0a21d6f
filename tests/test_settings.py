"""Settings: every variable of the specification with its default; a malformed value stops
start-up with a sentence naming the variable, the value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.errors import SettingsError
from executor.settings import load_settings

SPEC_DEFAULTS = {
    "enable_code_nodes": False,
    "code_runtime": "docker",
    "code_image": "studio-code:1",
    "code_memory": "256m",
    "code_cpus": 0.5,
    "code_pids": 64,
    "code_max_seconds": 30,
    "code_concurrency": 4,
    "code_test_per_minute": 20,
    "code_languages": "python,typescript",
    "code_ts_image": "studio-code-ts:1",
    "code_ts_packages": "npm:zod@3,npm:date-fns@4",
    "deno": "deno",
    "code_ts_deno_dir": "",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("STUDIO_"):
            monkeypatch.delenv(name)


def test_defaults_are_the_specifications():
    s = load_settings()
    for field, value in SPEC_DEFAULTS.items():
        assert getattr(s, field) == value, field
    assert s.memory_bytes == 256 * 1024 * 1024
    assert s.languages == ("python", "typescript")
    assert [str(p) for p in s.ts_packages] == ["npm:zod@3", "npm:date-fns@4"]


def test_every_variable_is_read_from_the_environment(monkeypatch):
    env = {
        "STUDIO_ENABLE_CODE_NODES": "1",
        "STUDIO_CODE_RUNTIME": "subprocess",
        "STUDIO_CODE_IMAGE": "mine:2",
        "STUDIO_CODE_PACKAGES": "numpy, pandas",
        "STUDIO_CODE_MEMORY": "1g",
        "STUDIO_CODE_CPUS": "1.5",
        "STUDIO_CODE_PIDS": "128",
        "STUDIO_CODE_MAX_SECONDS": "10",
        "STUDIO_CODE_CONCURRENCY": "8",
        "STUDIO_CODE_TEST_PER_MINUTE": "5",
        "STUDIO_CODE_LANGUAGES": "python",
        "STUDIO_CODE_TS_IMAGE": "ts:9",
        "STUDIO_CODE_TS_PACKAGES": "npm:zod@3",
        "STUDIO_DENO": "/opt/deno",
        "STUDIO_CODE_TS_DENO_DIR": "/var/cache/deno",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = load_settings()
    assert s.enable_code_nodes is True and s.code_runtime == "subprocess"
    assert s.python_packages == ("numpy", "pandas")
    assert s.memory_bytes == 1024**3 and s.code_cpus == 1.5 and s.code_pids == 128
    assert (s.code_max_seconds, s.code_concurrency, s.code_test_per_minute) == (10, 8, 5)
    assert s.languages == ("python",) and s.code_ts_image == "ts:9"
    assert [str(p) for p in s.ts_packages] == ["npm:zod@3"]
    assert (s.deno, s.code_ts_deno_dir) == ("/opt/deno", "/var/cache/deno")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("STUDIO_CODE_MEMORY", "lots", "a size such as 256m"),
        ("STUDIO_CODE_MEMORY", "1m", "at least 64m"),
        ("STUDIO_CODE_MEMORY", "63m", "at least 64m"),
        ("STUDIO_CODE_MAX_MEMORY", "16m", "at least 64m"),
        ("STUDIO_CODE_CPUS", "half", "valid number"),
        ("STUDIO_CODE_CPUS", "0", "at least 0.01"),
        # below the kernel's smallest quota: a sandbox refused (0.005) or with no CPU limit
        ("STUDIO_CODE_CPUS", "0.005", "at least 0.01"),
        ("STUDIO_CODE_CPUS", "1e-10", "at least 0.01"),
        ("STUDIO_CODE_MAX_CPUS", "0.005", "at least 0.01"),
        ("STUDIO_CODE_MAX_CPUS", "1e-10", "at least 0.01"),
        ("STUDIO_CODE_MAX_CPUS", "-1", "at least 0.01"),
        ("STUDIO_CODE_PIDS", "2", "greater than or equal to 8"),
        ("STUDIO_CODE_MAX_SECONDS", "-1", "greater than 0"),
        ("STUDIO_CODE_CONCURRENCY", "many", "valid integer"),
        ("STUDIO_CODE_LANGUAGES", "python,cobol", "python, typescript"),
        ("STUDIO_ENABLE_CODE_NODES", "perhaps", "valid boolean"),
        ("STUDIO_CODE_TS_PACKAGES", "npm:zod", "entry 'npm:zod' is not pinned"),
        ("STUDIO_CODE_SUBPROCESS_NAMESPACES", "yes", "use auto or off"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "docker", "an absolute path below the root"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/", "an absolute path below the root"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/docker/../x", "no '..'"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/docker/", "no trailing '/'"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/docker//x", "such as /docker"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/docker/.hidden", "none starting with '.'"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/doc ker", "letters, digits"),
        ("STUDIO_CODE_USAGE_CGROUP_PARENT", "/docker\n", "such as /docker"),
    ],
)
def test_a_malformed_value_stops_start_up_naming_variable_and_value(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as e:
        load_settings()
    assert f"{name}={value!r}" in e.value.message
    assert says in e.value.message
    assert e.value.code == "RUNTIME_UNAVAILABLE"


def test_the_limits_floors_themselves_are_taken(monkeypatch):
    """The floors (executor/floors.py) are the smallest values a setting takes."""
    from executor.floors import MIN_CPUS, MIN_MEMORY_BYTES, MIN_PIDS

    for name, value in (
        ("STUDIO_CODE_CPUS", str(MIN_CPUS)),
        ("STUDIO_CODE_MAX_CPUS", str(MIN_CPUS)),
        ("STUDIO_CODE_MEMORY", f"{MIN_MEMORY_BYTES // 1024**2}m"),
        ("STUDIO_CODE_MAX_MEMORY", f"{MIN_MEMORY_BYTES // 1024**2}m"),
        ("STUDIO_CODE_PIDS", str(MIN_PIDS)),
    ):
        monkeypatch.setenv(name, value)
    s = load_settings()
    assert (s.code_cpus, s.memory_bytes, s.code_pids) == (MIN_CPUS, MIN_MEMORY_BYTES, MIN_PIDS)
    monkeypatch.setenv("STUDIO_CODE_MAX_CPUS", "0")  # 0: the cap is STUDIO_CODE_CPUS
    assert load_settings().max_cpus == MIN_CPUS


def test_the_engine_cgroup_parent_is_docker_unless_set(monkeypatch):
    """STUDIO_CODE_USAGE_CGROUP_PARENT: /docker (dockerd's cgroupfs default), or the path set."""
    assert load_settings().code_usage_cgroup_parent == "/docker"
    monkeypatch.setenv("STUDIO_CODE_USAGE_CGROUP_PARENT", "/studio.engine/containers_1")
    assert load_settings().code_usage_cgroup_parent == "/studio.engine/containers_1"


def test_an_unknown_runtime_does_not_crash_it_turns_code_nodes_off(monkeypatch):
    from executor.errors import CodeNodesDisabled
    from executor.meta import runtime_meta
    from executor.service import Executor

    monkeypatch.setenv("STUDIO_ENABLE_CODE_NODES", "1")
    monkeypatch.setenv("STUDIO_CODE_RUNTIME", "firecracker")
    ex = Executor(load_settings())
    assert ex.runtime is None
    with pytest.raises(CodeNodesDisabled, match="'firecracker' is not a known runtime"):
        ex.validate_node("python")
    meta = runtime_meta(ex)
    assert meta["enabled"] is False and "firecracker" in meta["reason"]
    assert all(not lang["ready"] for lang in meta["languages"])


def test_subprocess_mode_with_no_deno_dir_and_no_package_list_allows_no_package(monkeypatch):
    monkeypatch.setenv("STUDIO_CODE_RUNTIME", "subprocess")
    assert load_settings().ts_packages == ()
    monkeypatch.setenv("STUDIO_CODE_TS_DENO_DIR", "/var/cache/deno")
    assert [str(p) for p in load_settings().ts_packages] == ["npm:zod@3", "npm:date-fns@4"]


def test_an_empty_value_means_the_default_for_every_variable(monkeypatch):
    from executor.settings import Settings

    for name in Settings.model_fields:
        monkeypatch.setenv(f"STUDIO_{name.upper()}", "")
    assert load_settings() == Settings.model_construct()  # every field at its default
    assert load_settings().enable_code_nodes is False
    assert [str(p) for p in load_settings().ts_packages] == ["npm:zod@3", "npm:date-fns@4"]


def test_no_typescript_package_is_written_none(monkeypatch):
    monkeypatch.setenv("STUDIO_CODE_TS_PACKAGES", "none")
    assert load_settings().ts_packages == ()


def test_a_misspelled_variable_is_named_with_the_closest_known_one(monkeypatch, caplog):
    import logging

    from executor.settings import unknown_variables

    env = {
        "STUDIO_CODE_MEMROY": "1g",
        "STUDIO_REDIS": "redis://x",
        "STUDIO_NOTHING_LIKE": "1",
        "STUDIO_CODE_MEMORY": "1g",
        "STUDIO_METRICS_PORT": "9808",
        "OTHER_CODE_MEMROY": "1",
    }
    assert unknown_variables(env) == [
        "STUDIO_CODE_MEMROY is not a studio-code setting and is ignored: did you mean "
        "STUDIO_CODE_MEMORY?",
        "STUDIO_NOTHING_LIKE is not a studio-code setting and is ignored: see the "
        "configuration table in the README for the variables there are.",
        "STUDIO_REDIS is not a studio-code setting and is ignored: did you mean STUDIO_REDIS_URL?",
    ]
    monkeypatch.setenv("STUDIO_CODE_CONCURENCY", "8")
    with caplog.at_level(logging.WARNING, logger="studio_code.settings"):
        assert load_settings().code_concurrency == 4  # ignored, as before, but now said
    assert any("did you mean STUDIO_CODE_CONCURRENCY?" in r.getMessage() for r in caplog.records)


#: the usage switches: settings since issue 40 (they were read outside Settings), their
#: names unchanged so that operators' configurations (the Compose file) keep working
USAGE_SWITCHES = ("STUDIO_CODE_USAGE", "STUDIO_CODE_HOST_CGROUP", "STUDIO_CODE_USAGE_SWEEPER")


def test_every_setting_has_a_row_in_the_readme_and_every_read_variable_is_known():
    """The README's configuration table is where an operator looks: every setting has its
    row there. The usage switches (the Compose file sets STUDIO_CODE_HOST_CGROUP) are
    settings, known, not warned about as misspelled."""
    import re

    from executor.settings import OTHER_VARIABLES, Settings, unknown_variables

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    rows = set(re.findall(r"^\| `(STUDIO_[A-Z0-9_]+)` \|", readme, re.M))
    missing = sorted(f"STUDIO_{name.upper()}" for name in Settings.model_fields)
    missing = [name for name in missing if name not in rows]
    assert missing == [], f"settings without a README row: {missing}"
    fields = {f"STUDIO_{name.upper()}" for name in Settings.model_fields}
    assert set(USAGE_SWITCHES) <= fields and not set(USAGE_SWITCHES) & OTHER_VARIABLES
    assert unknown_variables({name: "1" for name in USAGE_SWITCHES}) == []


def test_the_usage_switches_are_read_through_the_settings(monkeypatch, caplog):
    """STUDIO_CODE_USAGE=0 (and the two others) reach the runtimes through Settings, with no
    misspelling warning: a Settings with usage off makes no meter, whatever the
    environment says afterwards."""
    import logging

    from executor.runtimes.docker import usage
    from executor.settings import unknown_variables

    env = dict(zip(USAGE_SWITCHES, ("0", "/host/sys/fs/cgroup", "1"), strict=True))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING, logger="studio_code.settings"):
        s = load_settings()
    assert (s.code_usage, s.code_host_cgroup, s.code_usage_sweeper) == (
        False,
        "/host/sys/fs/cgroup",
        True,
    )
    assert unknown_variables(env) == []
    assert not [r for r in caplog.records if "STUDIO_CODE_" in r.getMessage()]
    for off in ("0", "off", "false", "False"):
        monkeypatch.setenv("STUDIO_CODE_USAGE", off)
        assert load_settings().code_usage is False, off
    for name in USAGE_SWITCHES[1:]:
        monkeypatch.delenv(name)
    off = load_settings()  # STUDIO_CODE_USAGE=0, this host's own view of its cgroups
    monkeypatch.delenv("STUDIO_CODE_USAGE")
    on = load_settings()
    assert on.code_usage is True and on.code_usage_sweeper is False
    assert on.code_host_cgroup == "/sys/fs/cgroup"
    if usage.new_meter(on) is None:
        pytest.skip("this process cannot see the host's cgroups: no meter either way")
    assert usage.new_meter(off) is None  # the settings decide, not the environment now


def test_the_product_reads_no_studio_variable_outside_the_settings():
    """A STUDIO_* variable the product reads from the environment itself (``os.environ``,
    ``os.getenv``) is one of OTHER_VARIABLES (the image build's, the test suite's): every
    other one is a Settings field, read once, validated and documented."""
    import ast

    from executor.settings import OTHER_VARIABLES

    root = Path(__file__).resolve().parent.parent
    # runs inside the sandbox, where the host sets STUDIO_PREIMPORT: no operator's variable
    in_the_sandbox = {root / "executor/languages/python_runner.py"}
    read: list[str] = []
    for package in ("executor", "worker", "api_client"):
        for path in sorted(set((root / package).rglob("*.py")) - in_the_sandbox):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                name = _environ_read(node)
                if name is not None and name.startswith("STUDIO_"):
                    read.append(f"{path.relative_to(root)}:{node.lineno} {name}")
    assert [r for r in read if r.split()[-1] not in OTHER_VARIABLES] == []


def _environ_read(node: object) -> str | None:
    """The constant name ``node`` reads, when it is ``os.environ.get(NAME...)``,
    ``os.getenv(NAME...)``, ``os.environ[NAME]`` or ``NAME in os.environ``."""
    import ast

    def environ(n: ast.AST) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "environ"

    def const(n: ast.AST) -> str | None:
        return n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None

    if isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Attribute) and (
            (f.attr in ("get", "pop", "setdefault") and environ(f.value)) or f.attr == "getenv"
        ):
            return const(node.args[0])
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and environ(node.value):
        return const(node.slice)
    if isinstance(node, ast.Compare) and any(environ(c) for c in node.comparators):
        return const(node.left)
    return None
