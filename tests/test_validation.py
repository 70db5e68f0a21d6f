"""Workflow validation and readiness: a Code node that cannot run fails validation and says
why and how to fix it. Readiness is proven by running the language's test program."""

from __future__ import annotations

import pytest

from executor.errors import CodeInvalid, CodeNodesDisabled, RuntimeUnavailable
from executor.service import Executor


def test_mode_off(make_settings):
    ex = Executor(make_settings(enable_code_nodes=False))
    with pytest.raises(CodeNodesDisabled, match="STUDIO_ENABLE_CODE_NODES=1"):
        ex.validate_node("python")


def test_missing_image_names_the_build_command(make_settings, docker_client):
    ex = Executor(make_settings(code_image="studio-code-missing:0"))
    with pytest.raises(RuntimeUnavailable) as e:
        ex.validate_node("python")
    assert "studio-code-missing:0 is missing" in e.value.message
    assert "make image" in e.value.message


def test_language_not_offered(make_settings):
    ex = Executor(make_settings(code_languages="typescript"))
    with pytest.raises(CodeInvalid, match="not offered here"):
        ex.validate_node("python")


def test_ready_runtime_passes_and_is_cached(docker_executor, monkeypatch):
    docker_executor.validate_node("python")
    calls = []
    monkeypatch.setattr(docker_executor, "_probe", lambda lang: calls.append(lang) or None)
    docker_executor.validate_node("python")  # within the TTL: no second probe
    assert calls == []


def test_readiness_means_the_test_program_ran(make_settings, docker_client):
    # An image that exists but has no python3: the image check passes, the test program
    # cannot run, so the language is not ready (a file's existence proves nothing).
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("README")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"empty"))
    image = docker_client.api.import_image_from_data(
        buf.getvalue(), repository="studio-code-empty", tag="1"
    )
    assert image
    try:
        from executor.languages import get_language

        ex = Executor(make_settings(code_image="studio-code-empty:1"))
        ready = ex.readiness(get_language("python"), fresh=True)
        assert ready.ready is False
        assert "test program did not run" in ready.reason
        with pytest.raises(RuntimeUnavailable, match="test program did not run"):
            ex.validate_node("python")
    finally:
        docker_client.images.remove("studio-code-empty:1", force=True)
