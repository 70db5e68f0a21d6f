"""Imports follow the layers and load only what a command needs, each checked in a fresh
interpreter (by ``sys.modules``), so a stray top-level import cannot creep back in:
``studio-code --help`` and ``validate`` of a Python file load no database driver, Redis,
Celery, Docker SDK or tree-sitter; ``run`` loads no queue or store."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from testkit.imports import loaded_after, loaded_of

ROOT = Path(__file__).resolve().parent.parent
HEAVY = (
    "sqlalchemy",
    "alembic",
    "redis",
    "celery",
    "kombu",
    "docker",
    "requests",
    "tree_sitter",
)
#: the Docker SDK and the HTTP client beneath it
DOCKER_SDK = ("docker", "requests", "urllib3")

#: the queue and the run store, which `studio-code run` (no queue) must not load
QUEUE_AND_STORE = (
    "sqlalchemy",
    "alembic",
    "redis",
    "celery",
    "kombu",
    "psycopg",
    "executor.store",
    "worker",
    "api_client.client",
    "api_client.http",
    "fastapi",
)


@pytest.mark.parametrize(
    "module",
    ["api_client.cli", "worker.protocol", "api_client", "executor.settings", "executor.inputs"],
)
def test_importing_loads_nothing_heavy(module):
    assert loaded_of(loaded_after(f"import {module}"), HEAVY) == []


def test_the_package_still_exports_every_name_on_first_use():
    mods = loaded_after("""
        import api_client
        from api_client import CodeClient, JobRecord, Status, CodeInvalid
        from api_client.client import CodeClient as Direct
        assert CodeClient is Direct and api_client.CodeClient is Direct
        assert set(api_client.__all__) <= set(dir(api_client))
        for name in api_client.__all__:
            getattr(api_client, name)
        try:
            api_client.Nope
        except AttributeError:
            pass
        else:
            raise SystemExit("api_client.Nope did not raise AttributeError")
    """)
    assert "redis" in mods  # CodeClient was really loaded, on use


def test_help_loads_nothing_heavy_nor_pydantic():
    mods = loaded_after("""
        from api_client.cli import main
        try:
            main(["--help"])
        except SystemExit as e:
            assert e.code == 0
    """)
    assert loaded_of(mods, (*HEAVY, "pydantic", "executor.settings")) == []


def test_validate_of_a_python_file_loads_nothing_heavy(tmp_path):
    node = tmp_path / "node.py"
    node.write_text("def main(state):\n    return 1\n")
    mods = loaded_after(f"""
        from api_client.cli import main
        assert main(["validate", {str(node)!r}]) == 0
    """)
    assert loaded_of(mods, HEAVY) == []


@pytest.mark.parametrize("runtime", ["docker", "subprocess"])
def test_validate_loads_no_runtime_nor_asyncio(tmp_path, runtime):
    """Settings load without asyncio (pydantic_settings imports it for CliApp.run only) and
    without the runtimes (the uid range is checked in executor.settings)."""
    node = tmp_path / "node.py"
    node.write_text("def main(state):\n    return 1\n")
    mods = loaded_after(
        f"""
        from api_client.cli import main
        assert main(["validate", {str(node)!r}]) == 0
    """,
        env={"STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": runtime},
    )
    assert "pydantic_settings" in mods  # the settings were loaded, by pydantic-settings
    unused = ("asyncio", "importlib.metadata", "dotenv", "executor.runtimes", "ctypes")
    unused += ("api_client.image",)  # the other commands' parsers (api_client/cli.py)
    assert loaded_of(mods, unused) == []


def test_asyncio_left_out_of_pydantic_settings_still_works_when_used():
    """The stand-in pydantic_settings.main holds imports the real asyncio on first use, and
    every other importer gets the real module."""
    mods = loaded_after("""
        import sys
        import executor.settings
        import pydantic_settings.main as m
        assert "asyncio" not in sys.modules
        try:
            m.asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise SystemExit("get_running_loop() outside a loop did not raise")
        import asyncio
        assert sys.modules["asyncio"] is asyncio and type(asyncio).__name__ == "module"
        assert m.asyncio.run is asyncio.run
        assert asyncio.run(asyncio.sleep(0, "ok")) == "ok"
    """)
    assert "asyncio" in mods


def test_an_env_file_is_still_read_with_dotenv_loaded_on_first_use(tmp_path):
    env_file = tmp_path / "studio.env"
    env_file.write_text("STUDIO_CODE_CPUS=2\n")
    mods = loaded_after(f"""
        import sys
        from executor.settings import Settings
        assert "dotenv" not in sys.modules
        assert Settings(_env_file={str(env_file)!r}).code_cpus == 2.0
        assert type(sys.modules["dotenv"]).__name__ == "module"
    """)
    assert "dotenv" in mods


def test_pydantic_still_looks_for_plugins_unless_they_are_turned_off():
    """pydantic's plugin loader got a deferred entry_points: a process that does not turn
    plugins off (the API, a worker) still scans for them, with the real importlib.metadata;
    the CLI's one-shot commands turn them off and never import it."""
    mods = loaded_after(
        """
        import os, sys
        assert os.environ["PYDANTIC_DISABLE_PLUGINS"] == ""  # plugins on
        from executor.settings import load_settings
        load_settings()
        import importlib, importlib.metadata
        assert sys.modules["importlib.metadata"] is importlib.metadata
        assert type(importlib.metadata).__name__ == "module"
        from pydantic.plugin import _loader
        assert list(_loader.get_plugins()) == []  # none installed; the scan ran
    """,
        env={"PYDANTIC_DISABLE_PLUGINS": ""},
    )
    assert "importlib.metadata" in mods


@pytest.mark.parametrize("runtime", ["docker", "subprocess"])
def test_run_loads_no_queue_and_no_store(tmp_path, runtime):
    """``run`` in either runtime: no queue, store, HTTP API, nor the other runtime."""
    node = tmp_path / "node.py"
    node.write_text("import json\n\ndef main(state):\n    return state['n'] + 1\n")
    mods = loaded_after(
        f"""
        from api_client.cli import main
        assert main(["run", {str(node)!r}, "--state", '{{"n": 1}}']) == 0
    """,
        env={"STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": runtime},
    )
    assert f"executor.runtimes.{runtime}.runtime" in mods  # it did run, in that runtime
    other = "subprocess" if runtime == "docker" else "docker"
    # the subprocess runtime talks to no engine: not a module of the Docker SDK's
    sdk = DOCKER_SDK if runtime == "subprocess" else ()
    assert loaded_of(mods, (*QUEUE_AND_STORE, f"executor.runtimes.{other}", *sdk)) == []


#: what a one-shot ``run`` never uses: the engine posture and its table of escapes
#: (tomllib), tokenize's first compile (a builtin default factory's signature); in the
#: subprocess runtime also socket, and secrets and hmac (pydantic.types, for comparing two
#: secret values; the Docker SDK's requests loads them whatever we do)
RUN_NEVER_USES = (
    "executor.runtimes.docker.posture",
    "api_client.image",  # the other commands' parsers (api_client/cli.py build_parser)
    "tomllib",
    "importlib.metadata",  # pydantic's plugins, urllib3's HTTP/2 (runtimes/docker/client.py)
    # requests' guess of a text's encoding (runtimes/docker/client.py): its package, which loads
    # .api first, and not its version module (imported for requests to read)
    "charset_normalizer.api",
    # requests' re-export of idna (a host name not ASCII) and its zip archive reader (a CA
    # bundle inside one): runtimes/docker/client.py
    "idna",
    "zipfile",
)
SUBPROCESS_RUN_NEVER_USES = ("socket", "secrets", "hmac")


@pytest.mark.parametrize("runtime", ["docker", "subprocess"])
def test_run_loads_only_what_a_one_shot_run_needs(tmp_path, runtime):
    node = tmp_path / "node.py"
    node.write_text("def main(state):\n    return state['n'] + 1\n")
    mods = loaded_after(
        f"""
        import re, tokenize
        compiled = []
        real = tokenize._compile
        tokenize._compile = lambda *a: compiled.append(a) or real(*a)
        from api_client.cli import main
        assert main(["run", {str(node)!r}, "--state", '{{"n": 1}}']) == 0
        assert not compiled, "a signature was read through tokenize"
    """,
        env={"STUDIO_ENABLE_CODE_NODES": "1", "STUDIO_CODE_RUNTIME": runtime},
    )
    assert f"executor.runtimes.{runtime}.runtime" in mods  # it did run, in that runtime
    unused = (*RUN_NEVER_USES, *(SUBPROCESS_RUN_NEVER_USES if runtime == "subprocess" else ()))
    assert loaded_of(mods, unused) == []


def test_secrets_left_out_of_pydantic_still_compare_when_used():
    mods = loaded_after("""
        import sys
        import executor.settings
        from pydantic import SecretStr
        assert "secrets" not in sys.modules
        assert SecretStr("a" * 16) == SecretStr("a" * 16)
        assert SecretStr("a" * 16) != SecretStr("b" * 16)
        import secrets
        assert sys.modules["secrets"] is secrets and type(secrets).__name__ == "module"
    """)
    assert "secrets" in mods


def test_what_the_docker_sdk_is_imported_without_still_works_when_used():
    """import_sdk leaves out charset_normalizer, importlib.metadata, idna and zipfile:
    requests still reads their versions at import, guesses a body's encoding with the real
    library, encodes a host name that is not ASCII and reads a path inside a zip archive, and
    urllib3's HTTP/2 check still reads a package's version, each importing it then."""
    mods = loaded_after("""
        import sys
        from executor.runtimes.docker.client import import_sdk
        import_sdk()
        assert "docker" in sys.modules
        for name in ("charset_normalizer", "importlib.metadata", "idna", "zipfile"):
            assert name not in sys.modules, name
        import requests.models, requests.utils
        host = requests.models.PreparedRequest._get_idna_encoded_host("bücher.example")
        assert host == "xn--bcher-kva.example"
        assert type(sys.modules["idna"]).__name__ == "module"
        assert requests.packages.idna.encode("bücher") == b"xn--bcher-kva"
        import os, tempfile
        not_zip = os.path.join(sys.executable, "ca.pem")  # beneath a file that is no archive
        assert requests.utils.extract_zipped_paths(not_zip) == not_zip
        assert type(sys.modules["zipfile"]).__name__ == "module"
        import zipfile as real_zip
        with tempfile.TemporaryDirectory() as tmp:
            archive = os.path.join(tmp, "certs.zip")
            with real_zip.ZipFile(archive, "w") as z:
                z.writestr("ca.pem", "x")
            found = requests.utils.extract_zipped_paths(os.path.join(archive, "ca.pem"))
            assert found != os.path.join(archive, "ca.pem") and open(found).read() == "x"
        import requests, urllib3.http2
        from requests.models import Response
        r = Response()
        r._content = "naïve café, déjà vu".encode("utf-8")
        assert r.encoding is None and r.apparent_encoding == "utf-8"
        assert r.text == "naïve café, déjà vu"
        assert type(sys.modules["charset_normalizer"]).__name__ == "module"
        assert urllib3.http2.version("requests") == requests.__version__
        assert type(sys.modules["importlib.metadata"]).__name__ == "module"
        import charset_normalizer
        assert charset_normalizer.__version__ == requests.compat.chardet.__version__
    """)
    assert {"charset_normalizer", "importlib.metadata", "idna", "zipfile"} <= mods


def test_executor_never_imports_worker_or_api_client():
    mods = loaded_after("""
        import pkgutil, importlib, executor
        for m in pkgutil.walk_packages(executor.__path__, "executor."):
            if not m.name.endswith("_runner"):  # the sandbox's script, not a module
                importlib.import_module(m.name)
    """)
    assert sorted(m for m in mods if m.split(".")[0] in ("worker", "api_client")) == []


def test_the_languages_never_import_the_runtimes():
    """RawRun lives with the models, so a language reads a run without the runtimes: no
    import circle between executor/languages/ and executor/runtimes/ (each imported first)."""
    for first in ("executor.languages.base", "executor.runtimes.base"):
        mods = loaded_after(f"import {first}")
        assert first in mods
    mods = loaded_after("""
        import pkgutil, importlib, executor.languages
        for m in pkgutil.walk_packages(executor.languages.__path__, "executor.languages."):
            if not m.name.endswith("_runner"):
                importlib.import_module(m.name)
        from executor.models import RawRun
    """)
    assert "executor.models" in mods


def test_a_pool_process_loads_no_metrics_server():
    """worker.metrics (what pool processes record) loads neither the server nor the health
    checks."""
    mods = loaded_after("import worker.metrics")
    assert loaded_of(mods, ("worker.metrics.server", "worker.health")) == []


def test_the_wire_records_load_without_the_routes():
    """api_client.http.wire is models only: importing it (and so the api_client.http
    package) loads no FastAPI, no route."""
    mods = loaded_after("import api_client.http.wire")
    assert "api_client.http.wire" in mods
    assert loaded_of(mods, ("fastapi", "starlette", "api_client.http.kit")) == []


def import_graph(*tops: Path) -> dict[str, dict[str, bool]]:
    """Every module of the packages in ``tops`` -> the modules of those packages it imports
    anywhere (top level, inside a function, under TYPE_CHECKING: an import it would only
    hide a circle), each with True when every import of it is under ``if TYPE_CHECKING:``.
    Read from the source, nothing imported. ``from a.b import c`` imports the package a.b
    first: an edge to it, and to a.b.c when that is a module. A package a module lives in is
    not an edge (importing a submodule imports its packages first, by design)."""
    import importlib.util

    modules = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for top in tops
        for path in sorted(top.rglob("*.py"))
    }
    graph: dict[str, dict[str, bool]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test).endswith("TYPE_CHECKING")
            for stmt in block.body
            for node in ast.walk(stmt)
        }
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, bool] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    edges[target] = edges.get(target, True) and id(node) in typing_only
        graph[name] = edges
    return graph


def circle_in(graph: dict[str, dict[str, bool]]) -> list[str] | None:
    """A module that imports itself back through others (the modules, in order), or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for target in sorted(graph[name]):
            found = visit(target, [*path, name])
            if found is not None:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found is not None:
            return found
    return None


def test_api_client_has_no_import_circle():
    """No module of api_client (the HTTP package api_client.http included) imports, at any
    depth, a module that imports it back, directly or not. A package a module lives in is
    not counted (importing a submodule imports its packages first, by design)."""
    graph = import_graph(ROOT / "api_client")
    assert {"api_client.http.app", "api_client.http.kit", "api_client.http.routes.runs"} <= set(
        graph
    )
    assert "api_client.http.kit" in graph["api_client.http.routes.runs"]  # the scan sees it
    found = circle_in(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_product_has_no_import_circle():
    """No module of the product (executor, worker, api_client, the test kit) imports itself
    back through others, counting the imports inside functions and under TYPE_CHECKING: an
    import moved into a function hides a circle, it does not end it. (The languages read
    their image's facts as data the runtime hands them, never through a runtime's module.)"""
    graph = import_graph(*(ROOT / top for top in ("executor", "worker", "api_client", "testkit")))
    # the scan sees an import inside a function (runtime_class's import of a runtime)
    assert "executor.runtimes.docker.runtime" in graph["executor.service"]
    found = circle_in(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


def test_the_api_loads_no_docker_sdk():
    """The API's process talks to Redis and the run store, never to the Docker engine at
    import: neither the client nor the HTTP app loads the Docker SDK (a runtime loads it
    when it is made, e.g. by a readiness probe)."""
    for module in ("api_client.client", "api_client.http.app"):
        mods = loaded_after(f"import {module}")
        assert module in mods
        assert loaded_of(mods, ("docker", "executor.runtimes.docker")) == [], module


def runtime_name_branches(*tops: Path) -> list[str]:
    """Where the code compares STUDIO_CODE_RUNTIME's value (``code_runtime``) with a
    runtime's name, as ``path:function``: read from the source."""
    found = []
    for top in tops:
        for path in sorted(top.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for func in ast.walk(tree):
                if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(func):
                    if isinstance(node, ast.Compare) and "code_runtime" in ast.unparse(node):
                        sides = [node.left, *node.comparators]
                        if any(
                            isinstance(x, ast.Constant) and isinstance(x.value, str) for x in sides
                        ):
                            found.append(f"{path.relative_to(ROOT)}:{func.name}")
    return sorted(set(found))


def test_only_runtime_class_branches_on_the_runtimes_name():
    """Callers ask a runtime what it can do (executor/runtimes/base.py): the one place that
    compares STUDIO_CODE_RUNTIME with a runtime's name is the choice of the runtime
    (``runtime_class``); the settings may check their own values by it."""
    branches = runtime_name_branches(*(ROOT / top for top in ("executor", "worker", "api_client")))
    assert "executor/service.py:runtime_class" in branches  # the scan sees it
    others = [b for b in branches if not b.startswith("executor/settings.py:")]
    assert others == ["executor/service.py:runtime_class"]


RUNTIMES = ROOT / "executor" / "runtimes"


def test_the_runtimes_are_laid_out_by_runtime():
    """executor/runtimes/: what both runtimes share (base, constants) at the top; all that
    is Docker's in docker/ (the policy, the attach stream, the pool, seccomp, the engine's
    posture, the socket guard), all that is the subprocess runtime's in subprocess/ (its
    pre-started runners, uids, cgroups, namespaces)."""
    top = sorted(p.name for p in RUNTIMES.iterdir() if p.name != "__pycache__")
    assert top == ["__init__.py", "base.py", "constants.py", "docker", "subprocess"]
    docker_files = sorted(p.name for p in (RUNTIMES / "docker").iterdir() if p.is_file())
    assert {"runtime.py", "pool.py", "attached.py", "policy.py", "seccomp.py"} <= set(docker_files)
    assert {"seccomp.json", "known_escapes.toml"} <= set(docker_files)
    subprocess_files = {p.name for p in (RUNTIMES / "subprocess").iterdir() if p.is_file()}
    assert {"runtime.py", "prestarted.py", "uids.py", "cgroups.py"} <= subprocess_files
    graph = import_graph(RUNTIMES)
    for name, edges in graph.items():
        for own, other in (("docker", "subprocess"), ("subprocess", "docker")):
            if name.startswith(f"executor.runtimes.{own}"):
                crossing = [t for t in edges if t.startswith(f"executor.runtimes.{other}")]
                assert crossing == [], f"{name} imports the {other} runtime: {crossing}"
    # the shared modules import no runtime (base names the engine's posture as a type only)
    for shared in ("executor.runtimes.base", "executor.runtimes.constants"):
        loaded = [t for t, typing_only in graph[shared].items() if not typing_only]
        assert [t for t in loaded if t.count(".") > 2] == [], shared


def engine_calls(method: str) -> list[str]:
    """Where the product calls ``<anything>.<method>(...)``: ``path:function`` per call."""
    calls = []
    for top in ("executor", "worker", "api_client"):
        for path in sorted((ROOT / top).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for fn in ast.walk(tree):
                if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                for node in ast.walk(fn):
                    if (
                        isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr == method
                    ):
                        calls.append(f"{path.relative_to(ROOT)}:{fn.name}")
    return calls


def test_one_function_creates_every_sandbox():
    """A sandbox's life begins in one place: ``sandbox.create`` is the only engine call that
    creates a container (a cold run's, a pre-started one, the never-started one an image's
    file is read from), so each gets its handle, and its usage meter, the same way."""
    assert engine_calls("create_container") == ["executor/runtimes/docker/sandbox.py:create"]


def test_one_rule_says_what_an_engine_error_means():
    """What an engine's answer means (the engine away, a refusal, the sandbox gone, a name
    taken) is decided in executor/runtimes/docker/engine_errors.py only: no other module
    imports the SDK's error classes (its base class, DockerException, aside: "any engine
    failure") or requests' errors to decide by them."""
    deciding = set()
    for top in ("executor", "worker", "api_client"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "docker.errors":
                    if any(a.name != "DockerException" for a in node.names):
                        deciding.add(str(path.relative_to(ROOT)))
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "requests"
                ):
                    deciding.add(str(path.relative_to(ROOT)))
                elif isinstance(node, ast.Import) and any(
                    a.name.split(".")[0] == "requests" for a in node.names
                ):
                    deciding.add(str(path.relative_to(ROOT)))
    assert sorted(deciding) == ["executor/runtimes/docker/engine_errors.py"]


def test_no_import_circle_in_the_runtimes():
    """No module of executor/runtimes/ imports itself back through others, counting the
    imports inside functions and under TYPE_CHECKING (a cycle they would only hide)."""
    graph = import_graph(RUNTIMES)
    assert "executor.runtimes.docker.pool" in graph["executor.runtimes.docker.runtime"]
    found = circle_in(graph)
    assert found is None, "import circle: " + " -> ".join(found or [])


WORKER = ROOT / "worker"
#: worker/'s rooms, one process's part each; everything else at worker/'s top is shared
#: (protocol, registry, broker, ...) but worker.assembly, which puts the rooms together
WORKER_ROOMS = ("job", "upkeep", "metrics", "consumer")
ASSEMBLY = "worker.assembly"


def room_of(module: str) -> str | None:
    """``job`` for worker.job.tasks; None for a shared module: one at worker/'s top, or the
    metrics package's instruments (worker.metrics, recorded by every process; its server,
    worker.metrics.server, is the main process's)."""
    parts = module.split(".")
    if module == "worker.metrics":  # the instruments, which every process records into
        return None
    if parts[0] == "worker" and len(parts) > 1 and (WORKER / parts[1]).is_dir():
        return parts[1]
    return None


def test_the_worker_is_assembled_at_the_top():
    """worker/'s arrows point one way: the assembly (the app factories and the steps each
    worker gets) imports the rooms, the rooms import the shared modules at the top. So
    job/, upkeep/ and metrics/ never import the consumer's steps nor the assembly, a shared
    module imports no room, and no two rooms import each other (imports inside functions
    counted)."""
    folders = {p.name for p in WORKER.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(WORKER_ROOMS)
    graph = import_graph(WORKER)
    assert {ASSEMBLY, "worker.job.tasks", "worker.registry"} <= set(graph)
    assert "worker.job.tasks" in graph[ASSEMBLY]  # the scan sees the assembly's imports
    up = sorted(
        f"{name} -> {target}"
        for name, edges in graph.items()
        if room_of(name) in ("job", "upkeep", "metrics")
        for target in edges
        if room_of(target) == "consumer" or target == ASSEMBLY
    )
    assert up == [], "arrows back up inside worker/"
    # by process: the main process's rooms (upkeep) never load a pool process's (job), and
    # the consumer's steps never load the main process's upkeep: what two processes share
    # (the gate, the parked results, the page between them) lives at worker/'s top
    crossing = sorted(
        f"{name} -> {target}"
        for name, edges in graph.items()
        for target in edges
        if (room_of(name), room_of(target)) in {("upkeep", "job"), ("consumer", "upkeep")}
    )
    assert crossing == [], "a room of one process imports another process's room"
    shared = sorted(
        f"{name} -> {target}"
        for name, edges in graph.items()
        if room_of(name) is None and name not in (ASSEMBLY, "worker")
        for target in edges
        if room_of(target) is not None
    )
    assert shared == [], "a shared module of worker/ imports a room"
    rooms = {
        (room_of(name), room_of(target))
        for name, edges in graph.items()
        for target in edges
        if None is not room_of(name) != room_of(target) is not None
    }
    loops = sorted(f"{a} <-> {b}" for a, b in rooms if (b, a) in rooms and str(a) < str(b))
    assert loops == [], "rooms of worker/ that import each other"


def test_the_api_imports_no_room_of_the_worker():
    """What the API and the CLI read of the worker (the registry of live workers, the cancel
    watch, the health checks, the autoscaling signals, the app factory) is in worker/'s
    shared modules: no module of api_client imports a per-process room."""
    graph = import_graph(ROOT / "api_client", WORKER)
    assert "worker.protocol" in graph["api_client.client"]  # the scan crosses packages
    reads = sorted(
        f"{name} -> {target}"
        for name, edges in graph.items()
        if name.startswith("api_client")
        for target in edges
        if room_of(target) is not None
    )
    assert reads == [], "the API imports a room of the worker"


# --- the tests themselves ----------------------------------------------------------------------


def imports_between_tests(folder: Path) -> dict[str, list[str]]:
    """Every test module (``test_*.py``) of ``folder`` -> the other test modules it imports,
    anywhere in it (top level or inside a function), in any form: ``import tests.test_x``,
    ``from tests.test_x import y``, ``from tests import test_x``, ``from .test_x import y``,
    ``from . import test_x``, ``import test_x``. Read from the source, nothing imported."""
    own = {path.stem for path in folder.glob("test_*.py")}
    found: dict[str, list[str]] = {}
    for path in sorted(folder.glob("test_*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                names |= {base, *(f"{base}.{a.name}" for a in node.names)}
        imported = {
            last for name in names if (last := name.rpartition(".")[2]) in own and last != path.stem
        }
        found[path.stem] = sorted(imported)
    return {name: others for name, others in found.items() if others}


def test_no_test_module_imports_another():
    """What test modules share lives in tests/conftest.py (fixtures), tests/snippets.py (what
    they send) or testkit/ (the services and the helpers): a test module that imports
    another runs that module's import-time code and ties the two together."""
    assert len(list((ROOT / "tests").glob("test_*.py"))) > 50  # the scan sees the tests
    assert imports_between_tests(ROOT / "tests") == {}


def test_the_scan_sees_every_form_of_a_test_module_import(tmp_path):
    forms = [
        "import tests.test_b",
        "from tests.test_b import x",
        "from tests import test_b",
        "from .test_b import x",
        "from . import test_b",
        "import test_b",
        "def f():\n    from tests.test_b import x",
    ]
    (tmp_path / "test_b.py").write_text("x = 1\n")
    (tmp_path / "snippets.py").write_text("y = 1\n")
    for form in forms:
        (tmp_path / "test_a.py").write_text(f"from tests.snippets import y\n{form}\n")
        assert imports_between_tests(tmp_path) == {"test_a": ["test_b"]}, form
    (tmp_path / "test_a.py").write_text("from tests.snippets import y\nimport testkit.stack\n")
    assert imports_between_tests(tmp_path) == {}
