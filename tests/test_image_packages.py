"""Packages an operator adds in one command (issue 34): `studio-code image build` builds a
sandbox image OFFLINE (debootstrap rootfs + PyPI wheels from a local folder + docker import:
no container registry) with a package Debian does not carry (cowsay) and a pinned older
version of another (python-dateutil==2.8.2; Debian trixie has 2.9); the image records the
versions; a node imports both and reports them from inside the sandbox; the save-time check
allows them and refuses one not in the image; meta shows the versions; a setting that
disagrees with the image is named in readiness and meta. Real Docker, real builds.

The images are built once for the module under test tags (never studio-code:1 or
studio-code-ts:1, which other tests use) and removed at the end. The build reuses the
rootfs and Deno caches of `make image` (build.sh keys them by their package lists), so it
costs the wheel install, the compile and the `docker import`s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from testkit.processes import ROOT, require
from testkit.sockguard import REAL_DOCKER_HOST
from tests.conftest import run_cli

TAG = uuid.uuid4().hex[:8]
PY_TAG = f"studio-code-test-packages:{TAG}"
TS_TAG = f"studio-code-ts-test-packages:{TAG}"
#: a PyPI-only package (Debian has no python3-cowsay) and a pinned version Debian lacks
PY_LIST = "cowsay,python-dateutil==2.8.2"
TS_LIST = "npm:zod@3,npm:date-fns@4"
BUILD_ENV = {"DOCKER_HOST": REAL_DOCKER_HOST}


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of wheels, as an air-gapped site brings one (pure-Python wheels: the same
    files for every Python)."""
    folder = tmp_path_factory.mktemp("wheels")
    got = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:", "-d"]
        + [str(folder), *PY_LIST.split(",")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    require(got.returncode == 0, f"pip could not download the test's wheels: {got.stderr[-800:]}")
    return folder


def _wheel_version(folder: Path, dist: str) -> str:
    [wheel] = folder.glob(f"{dist}-*.whl")
    return wheel.name.split("-")[1]


def _expected(wheels: Path) -> dict[str, str]:
    """The listed packages at the versions the build must have taken: cowsay's wheel from
    the folder, dateutil as pinned."""
    return {"cowsay": _wheel_version(wheels, "cowsay"), "python-dateutil": "2.8.2"}


@pytest.fixture(scope="module")
def built(docker_client: Any, wheels: Path) -> Iterator[dict[str, Any]]:
    """Both images, built by the real command, offline, from the wheel folder."""
    require(os.geteuid() == 0, "the offline image build needs root (debootstrap, chroot)")
    out = run_cli(
        "image",
        "build",
        "--python-packages",
        PY_LIST,
        "--wheels",
        str(wheels),
        "--ts-packages",
        TS_LIST,
        "--python-tag",
        PY_TAG,
        "--ts-tag",
        TS_TAG,
        "--offline",
        env=BUILD_ENV,
        timeout=1200,
    )
    try:
        assert out.returncode == 0, out.stdout + out.stderr[-4000:]
        yield json.loads(out.stdout)
    finally:
        for tag in (PY_TAG, TS_TAG):
            try:
                docker_client.images.remove(tag, force=True)
            except Exception:  # noqa: BLE001 - not built
                pass


@pytest.fixture
def make_executor(make_settings: Any, built: dict[str, Any]) -> Any:
    from executor.service import Executor

    def make(**overrides: Any) -> Executor:
        base = {"code_runtime": "docker", "code_image": PY_TAG, "code_ts_image": TS_TAG}
        return Executor(make_settings(**{**base, **overrides}))

    return make


def test_the_command_prints_each_image_at_its_versions(
    built: dict[str, Any], wheels: Path, docker_client: Any
) -> None:
    cowsay = _wheel_version(wheels, "cowsay")
    python = built["images"]["python"]
    assert python["image"] == PY_TAG
    assert python["packages"] == {"cowsay": cowsay, "python-dateutil": "2.8.2"}
    assert python["python"].startswith("3.")
    ts = built["images"]["typescript"]
    assert set(ts["packages"]) == {"npm:zod@3", "npm:date-fns@4"}
    assert ts["packages"]["npm:zod@3"].startswith("3.")
    assert built["settings"] == {"STUDIO_CODE_TS_PACKAGES": TS_LIST}
    # what the image itself carries: its label, and the lock of every distribution in it
    labels = docker_client.images.get(PY_TAG).labels
    assert labels["studio.packages"] == f"cowsay=={cowsay},python-dateutil==2.8.2"
    lock = docker_client.containers.run(
        PY_TAG, ["cat", "/usr/share/studio-code/packages.lock"], remove=True, network_mode="none"
    ).decode()
    assert {
        f"cowsay=={cowsay}",
        "python-dateutil==2.8.2",
        "six==" + _wheel_version(wheels, "six"),
    } <= set(lock.splitlines())
    assert "pydantic" not in lock  # only what was asked for, and its dependencies


def test_modules_json_gives_the_versions(
    built: dict[str, Any], wheels: Path, make_settings: Any
) -> None:
    from executor.languages import get_language
    from executor.runtimes.docker.runtime import DockerRuntime

    settings = make_settings(code_image=PY_TAG)
    found = DockerRuntime.image_facts(settings, get_language("python")).modules()
    assert found is not None
    assert found.packages == {"cowsay": ["cowsay"], "python-dateutil": ["dateutil"]}
    assert found.versions == {
        "cowsay": _wheel_version(wheels, "cowsay"),
        "python-dateutil": "2.8.2",
    }


def test_a_node_imports_both_and_reports_their_versions(make_executor: Any, wheels: Path) -> None:
    from executor.models import CodeJob, Status

    code = (
        "import importlib.metadata as md\n"
        "import cowsay, dateutil\n"
        "def main(state):\n"
        "    return {'cowsay': md.version('cowsay'), 'dateutil': dateutil.__version__,\n"
        "            'from': dateutil.__file__, 'says': cowsay.get_output_string('cow', 'hi')}\n"
    )
    ex = make_executor()
    r = ex.run(CodeJob(job_id=uuid.uuid4().hex, code=code))
    assert r.status is Status.SUCCEEDED, r.error
    assert r.output["cowsay"] == _wheel_version(wheels, "cowsay")
    assert r.output["dateutil"] == "2.8.2"
    # the PyPI wheel in the image's site folder, not a Debian package
    assert r.output["from"].startswith("/usr/local/lib/python3"), r.output["from"]
    assert "hi" in r.output["says"]


def test_the_save_time_check_allows_them_and_refuses_one_not_listed(make_executor: Any) -> None:
    ex = make_executor()
    ok = "import cowsay\nfrom dateutil import parser\n\ndef main(state):\n    return 1\n"
    assert ex.check_code(ok, "python") == []
    bad = "import cowsay\nimport pydantic\n\ndef main(state):\n    return 1\n"
    [problem] = ex.check_code(bad, "python")
    assert problem.line == 2 and "`pydantic`" in problem.message
    assert "cowsay" in problem.message and "python-dateutil (import dateutil)" in problem.message


def test_meta_shows_each_language_at_its_versions(make_executor: Any, wheels: Path) -> None:
    from executor.meta import runtime_meta

    meta = runtime_meta(make_executor(), fresh=True)
    langs = {entry["name"]: entry for entry in meta["languages"]}
    py, ts = langs["python"], langs["typescript"]
    assert py["ready"] and ts["ready"], (py, ts)
    # STUDIO_CODE_PACKAGES unset: the image's own list
    assert py["packages"] == ["cowsay", "python-dateutil"]
    assert py["versions"] == {
        "cowsay": _wheel_version(wheels, "cowsay"),
        "python-dateutil": "2.8.2",
    }
    assert ts["packages"] == ["npm:zod@3", "npm:date-fns@4"]
    assert set(ts["versions"]) == {"npm:zod@3", "npm:date-fns@4"}
    assert py["packages_warning"] is None and ts["packages_warning"] is None


def test_a_setting_that_disagrees_with_the_image_is_named_in_readiness(
    make_executor: Any,
) -> None:
    from executor.meta import runtime_meta

    ex = make_executor(code_packages="cowsay,pydantic", code_ts_packages="npm:zod@3")
    ready = ex.readiness(ex.language("python"), fresh=True)
    assert ready.ready  # the image runs: only the list shown is wrong
    assert ready.warning == (
        f"STUDIO_CODE_PACKAGES lists pydantic, which the image {PY_TAG} does not have, and "
        "leaves out python-dateutil, which it has: unset it (the image's own list is then "
        "shown) or set it to cowsay,python-dateutil."
    )
    ts = ex.readiness(ex.language("typescript"), fresh=True)
    assert ts.ready and ts.warning == (
        f"STUDIO_CODE_TS_PACKAGES leaves out npm:date-fns@4, which the image {TS_TAG} has: "
        "set it to npm:zod@3,npm:date-fns@4."
    )
    langs = {e["name"]: e for e in runtime_meta(ex, fresh=True)["languages"]}
    assert langs["python"]["packages_warning"] == ready.warning
    assert langs["typescript"]["packages_warning"] == ts.warning
    assert langs["python"]["packages"] == ["cowsay", "pydantic"]  # what was set


def test_a_package_that_cannot_be_had_fails_the_build_naming_it(
    docker_client: Any, wheels: Path
) -> None:
    import docker

    tag = f"studio-code-test-packages:missing-{TAG}"
    out = run_cli(
        "image",
        "build",
        "--python-packages",
        "cowsay,no-such-package-i34",
        "--wheels",
        str(wheels),
        "--python-tag",
        tag,
        "--offline",
        env=BUILD_ENV,
        timeout=600,
    )
    body = json.loads(out.stdout)
    assert out.returncode == 1 and body["error"]["code"] == "IMAGE_BUILD_FAILED", out.stdout
    assert "no wheel and no Debian package for no-such-package-i34" in body["error"]["message"]
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get(tag)


def test_the_registry_path_builds_from_a_local_base(docker_client: Any, wheels: Path) -> None:
    """`docker build` of docker/studio-code/Dockerfile (the path used where a registry
    answers), FROM a local base with pip standing in for python:3.12-slim: no registry is
    asked (a local FROM is not pulled)."""
    base, tag = f"studio-code-test-packages:pipbase-{TAG}", f"studio-code-test-packages:reg-{TAG}"
    try:
        made = run_cli(
            "image", "build", "--python-packages", "pip", "--python-tag", base, "--offline",
            env=BUILD_ENV, timeout=600,
        )  # fmt: skip
        assert made.returncode == 0, made.stdout + made.stderr[-2000:]
        out = run_cli(
            "image", "build", "--python-packages", PY_LIST, "--wheels", str(wheels),
            "--python-tag", tag, "--registry",
            env={**BUILD_ENV, "STUDIO_PY_BASE": base}, timeout=600,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr[-3000:]
        assert json.loads(out.stdout)["images"]["python"]["packages"] == _expected(wheels)
        assert "Step 1/" in out.stderr  # docker build's own log: the registry path ran
        report = docker_client.containers.run(
            tag,
            ["python3", "-c", "import cowsay, dateutil; print(dateutil.__version__)"],
            remove=True,
            network_mode="none",
        )
        assert report.decode().strip() == "2.8.2"
    finally:
        for t in (tag, base):
            try:
                docker_client.images.remove(t, force=True)
            except Exception:  # noqa: BLE001 - not built
                pass


# --- the command line, before anything is built ----------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--python-packages", "requests,https://x.test/a.whl"],
            "--python-packages entry 'https://x.test/a.whl' is not a package: write a PyPI "
            "name with an optional version",
        ),
        (["--python-packages", "Pandas,pandas>=2"], "--python-packages names pandas twice"),
        (
            ["--ts-packages", "npm:zod"],
            "--ts-packages entry 'npm:zod' is not pinned: write each package as npm:name@major",
        ),
        (["--wheels", "/nonexistent"], "--wheels /nonexistent is not a folder"),
        (
            ["--ts-packages", "npm:zod@3", "--wheels", "/tmp"],
            "--wheels is for the Python image: give --python-packages too",
        ),
    ],
)
def test_a_bad_list_is_refused_before_building(args: list[str], message: str) -> None:
    out = run_cli("image", "build", *args, "--python-tag", "never-built:x", "--ts-tag", "never:x")
    body = json.loads(out.stdout)
    assert out.returncode == 2 and body["error"]["code"] == "REQUEST_INVALID", out.stdout
    assert body["error"]["message"].startswith(message), body["error"]["message"]


def test_the_lists_parse_as_pip_and_the_allow_list_do() -> None:
    from api_client.image import python_requirements, ts_specs

    text = "requests==2.32.*, pandas>=2,<3  # data\n\npython-dateutil\n"
    assert python_requirements(text, "f") == ["requests==2.32.*", "pandas>=2,<3", "python-dateutil"]
    deps = (ROOT / "docker" / "studio-code-ts" / "deps.ts").read_text()
    assert ts_specs(deps, "deps.ts") == TS_LIST.split(",")
    assert ts_specs("npm:zod@3\nnpm:date-fns@4\n", "f") == TS_LIST.split(",")


NOT_PINS = [
    "--index-url http://127.0.0.1:9/simple",
    "--find-links=/tmp/elsewhere",
    "-i http://127.0.0.1:9/simple",
    "-r other.txt",
    "requests>=2",
    "requests==2.32.*",
    "requests==2.32.3,<3",
    "requests[socks]==2.32.3",
    "requests==2.32.3; python_version > '3'",
    "requests @ http://127.0.0.1:9/requests-2.32.3.whl",
    "requests==2.32.3 --hash=sha256:0",
]


@pytest.mark.parametrize("line", NOT_PINS)
def test_a_constraints_line_that_is_not_a_pin_is_refused(line: str) -> None:
    """--python-constraints is read with the list checker: a line pip would take as an
    option (another index, links, another file) or anything but name==version is refused,
    its line named."""
    from api_client.image import ListInvalid, python_constraints

    with pytest.raises(ListInvalid) as e:
        python_constraints(f"# pins\ncowsay==6.1\n\n{line}\n", "--python-constraints f")
    assert str(e.value).startswith(f"--python-constraints f line 4 '{line}' is not"), e.value
    with pytest.raises(ListInvalid, match="names Cowsay twice"):
        python_constraints("cowsay==6.1\nCowsay==6.0\n", "f")


def test_the_command_refuses_a_constraints_file_with_an_index_before_building(
    tmp_path: Path,
) -> None:
    """The real command, given a constraints file with an --index-url line: exit status 2,
    REQUEST_INVALID naming the line, nothing built."""
    constraints = tmp_path / "packages.lock"
    constraints.write_text("cowsay==6.1\n--index-url http://127.0.0.1:9/simple\n", encoding="utf-8")
    out = run_cli(
        "image",
        "build",
        "--python-packages",
        "cowsay",
        "--python-constraints",
        str(constraints),
        "--python-tag",
        "never-built:x",
    )
    body = json.loads(out.stdout)
    assert out.returncode == 2 and body["error"]["code"] == "REQUEST_INVALID", out.stdout
    message = body["error"]["message"]
    assert message.startswith(
        f"--python-constraints {constraints} line 2 '--index-url http://127.0.0.1:9/simple' "
        "is not a pin"
    ), message


def test_pip_gets_a_constraints_file_written_from_the_pins_only(tmp_path: Path) -> None:
    """A clean constraints file (comments, blank lines, pins): build.sh is handed a file of
    the command's own, its pins one a line and nothing else, never the caller's file."""
    from api_client.cli import build_parser
    from api_client.image import build_env, check_lists

    given = tmp_path / "packages.lock"
    given.write_text(
        "# an image's packages.lock\ncowsay==6.1   # the cow\n\nPython_Dateutil==2.8.2\n",
        encoding="utf-8",
    )
    args = build_parser().parse_args(
        ["image", "build", "--python-packages", "cowsay", "--python-constraints", str(given)]
    )
    plan = check_lists(args)
    assert plan["constraints"] == ["cowsay==6.1", "Python_Dateutil==2.8.2"]
    folder = tmp_path / "build"
    folder.mkdir()
    env = build_env(args, plan, folder, "never-built:x", "never-built-ts:x")
    written = Path(env["STUDIO_PY_CONSTRAINTS"])
    assert written.parent == folder and written != given
    assert written.read_text(encoding="utf-8") == "cowsay==6.1\nPython_Dateutil==2.8.2\n"


def test_the_label_parses_by_language() -> None:
    from executor.packages import parse_image_packages

    assert parse_image_packages("cowsay==6.1,python-dateutil==2.8.2", "python") == {
        "cowsay": "6.1",
        "python-dateutil": "2.8.2",
    }
    assert parse_image_packages("npm:zod@3.25.76,npm:@scope/x@1.0.0,junk", "typescript") == {
        "npm:zod@3": "3.25.76",
        "npm:@scope/x@1": "1.0.0",
    }
