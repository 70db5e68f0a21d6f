"""Python code nodes: ``main(state)`` (plain or async) returns the node's output."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING

from executor.languages.base import Language, Problem

if TYPE_CHECKING:
    from executor.models import Limits
    from executor.settings import Settings

RUNNER_SOURCE = (Path(__file__).parent / "python_runner.py").read_text(encoding="utf-8")
# Flags as arguments too: in subprocess mode the environment is empty.
_FLAGS = ["-B", "-u", "-s"]


class Python(Language):
    name = "python"
    test_program = "def main(state):\n    return {'ready': True}\n"

    def image(self, settings: Settings) -> str:
        return settings.code_image

    def command(self, settings: Settings, limits: Limits, *, in_container: bool) -> list[str]:
        # -I in subprocess mode: ignore PYTHON* variables, user site and the working folder.
        if in_container:
            interpreter = ["python3", *_FLAGS]
        else:
            interpreter = [settings.python_interpreter, "-I", *_FLAGS]
        return [*interpreter, "-c", RUNNER_SOURCE, str(limits.output_max_bytes)]

    def environment(self, settings: Settings, *, in_container: bool) -> dict[str, str]:
        if not in_container:
            return {}
        return {"HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}

    def check(self, code: str, settings: Settings) -> list[Problem]:
        try:
            tree = ast.parse(code, filename="main.py")
        except SyntaxError as e:
            return [Problem(e.lineno or 0, f"SyntaxError: {e.msg}")]
        if not any(_binds_main(node) for node in tree.body):
            return [
                Problem(0, "The code defines no main(state) function: add `def main(state):` "
                        "returning the node's output.")
            ]
        return []

    def packages(self, settings: Settings) -> list[str]:
        return list(settings.python_packages)


def _binds_main(node: ast.stmt) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return node.name == "main"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "main" for t in node.targets)
    if isinstance(node, ast.ImportFrom | ast.Import):
        return any((a.asname or a.name) == "main" for a in node.names)
    return False
