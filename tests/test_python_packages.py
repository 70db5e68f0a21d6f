"""Python packages like TypeScript's: ONE list (docker/studio-code/requirements.txt) is what
`make image` (studio-code image build) builds and STUDIO_CODE_PACKAGES' fallback default; the
image records what it can import; the save-time check refuses an import the image cannot
satisfy; readiness imports every listed package. Real Docker, the real image
(STUDIO_CODE_IMAGE). Other lists, offline builds and versions: tests/test_image_packages.py."""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import ROOT
from tests.conftest import run_cli

REQUIREMENTS = ROOT / "docker" / "studio-code" / "requirements.txt"


def _listed() -> list[str]:
    out = []
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0])
    return out


def test_packages_default_equals_the_requirements_file() -> None:
    from api_client.image import DEFAULT_REQUIREMENTS
    from executor.settings import Settings

    default = Settings.model_fields["code_packages"].default
    assert default.split(",") == _listed()
    assert DEFAULT_REQUIREMENTS == REQUIREMENTS  # what `make image` builds
    dockerfile = (ROOT / "docker" / "studio-code" / "Dockerfile").read_text()
    assert "-r /tmp/build/requirements.txt" in dockerfile


def test_build_sh_maps_the_requirements_to_debian_names(tmp_path: Path) -> None:
    req = tmp_path / "requirements.txt"
    req.write_text("pydantic\npython-dateutil  # dates\nPyYAML\nrequests\n")
    out = subprocess.run(
        [str(ROOT / "docker" / "build.sh"), "--debian-packages"],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "STUDIO_PY_REQUIREMENTS": str(req)},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "python3,python3-pydantic,python3-dateutil,python3-yaml,python3-requests"
    )
    # the real list
    out = subprocess.run(
        [str(ROOT / "docker" / "build.sh"), "--debian-packages"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout.strip() == "python3,python3-pydantic,python3-dateutil"


@pytest.mark.docker
def test_the_image_records_what_it_can_import(make_settings: Any, python_image: str) -> None:
    from executor.languages import get_language
    from executor.runtimes.docker.runtime import DockerRuntime

    settings = make_settings(code_image=python_image)
    found = DockerRuntime.image_facts(settings, get_language("python")).modules()
    assert found is not None, f"{python_image} has no modules.json: rebuild it (make image)"
    assert sorted(found.packages) == sorted(_listed())
    assert found.packages["python-dateutil"] == ["dateutil"]
    assert {"pydantic", "dateutil"} <= found.modules
    assert "json" in found.stdlib and "requests" not in found.modules


@pytest.mark.docker
def test_a_file_is_read_out_of_an_image_with_the_settings_given(
    make_settings: Any, python_image: str, docker_client: Any
) -> None:
    """The docker runtime reads the file (executor/runtimes/docker/images.py) in a container
    made with the caller's settings, not settings re-read from the environment: its process
    limit is the one given. The real engine; the container is removed."""
    from executor.languages.python_modules import MODULES_PATH
    from executor.runtimes.docker.images import read_file

    settings = make_settings(code_image=python_image, code_pids=77)  # the default is 64
    made: list[dict[str, Any]] = []
    real = docker_client.api

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def create_container(self, **kwargs: Any) -> Any:
            made.append(kwargs)
            return real.create_container(**kwargs)

    data = json.loads(read_file(Recording(), settings, python_image, MODULES_PATH))
    assert "json" in data["stdlib"]
    [create] = made
    assert create["host_config"]["PidsLimit"] == 77
    assert create["labels"]["studio.owner"]
    assert real.containers(all=True, filters={"name": create["name"]}) == []


@pytest.mark.docker
def test_validate_refuses_an_import_the_image_lacks(make_settings: Any, python_image: str) -> None:
    from executor.service import Executor

    ex = Executor(make_settings(code_runtime="docker", code_image=python_image))
    bad = "import json\nimport requests\n\ndef main(state):\n    return requests.get('x')\n"
    [problem] = ex.check_code(bad, "python")
    assert problem.line == 2
    assert "`requests`" in problem.message and "pydantic" in problem.message
    assert "python-dateutil (import dateutil)" in problem.message
    ok = (
        "import json, asyncio\nimport pydantic\nfrom dateutil import parser\n"
        "try:\n    import orjson\nexcept ImportError:\n    orjson = None\n"
        "from . import nothing_relative_is_checked\n"
        "def main(state):\n    import typing_extensions\n    return 1\n"
    )
    assert ex.check_code(ok, "python") == []
    # the same through the CLI, as a save would show it: ONE JSON object, CODE_INVALID
    node = Path(ex.settings.data_dir) / "node.py"
    node.write_text(bad)
    out = run_cli(
        "validate",
        str(node),
        env={
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "docker",
            "STUDIO_CODE_IMAGE": python_image,
        },
    )
    body = json.loads(out.stdout)
    assert out.returncode == 1 and body["error"]["code"] == "CODE_INVALID"
    assert "requests" in body["error"]["message"]


@pytest.mark.docker
def test_readiness_imports_every_listed_package(
    make_settings: Any, python_image: str, docker_client: Any
) -> None:
    from executor.service import Executor

    ex = Executor(make_settings(code_runtime="docker", code_image=python_image))
    assert ex.readiness(ex.language("python"), fresh=True).ready
    # an image whose list names a package it cannot import is not ready, and says which
    tag = f"studio-code-test-broken:{uuid.uuid4().hex[:8]}"
    c = docker_client.containers.create(python_image, command=["true"])
    try:
        data = json.dumps(
            {
                "python": "3",
                "stdlib": [],
                "modules": ["ghost_pkg"],
                "packages": {"ghost": ["ghost_pkg"]},
            }
        ).encode()
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("modules.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        c.put_archive("/usr/share/studio-code", buf.getvalue())
        c.commit(repository=tag.split(":")[0], tag=tag.split(":")[1])
    finally:
        c.remove(force=True)
    try:
        broken = Executor(make_settings(code_runtime="docker", code_image=tag))
        r = broken.readiness(broken.language("python"), fresh=True)
        assert not r.ready and "ghost_pkg" in (r.reason or ""), r
    finally:
        docker_client.images.remove(tag, force=True)
