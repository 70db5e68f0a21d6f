"""Python code nodes: ``main(state)`` (plain or async) returns the node's output."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from executor.languages.base import ImageFacts, Language, Problem
from executor.languages.python_modules import imports

if TYPE_CHECKING:
    from executor.models import Limits
    from executor.settings import Settings

RUNNER_SOURCE = (Path(__file__).parent / "python_runner.py").read_text(encoding="utf-8")
# Flags as arguments too: in subprocess mode the environment is empty.
_FLAGS = ["-B", "-u", "-s"]


#: CPython 3.11 can fail ``ast.parse`` in threads parsing at once ("SystemError: AST
#: constructor recursion depth mismatch", seen here): one parse at a time per process.
_PARSE_LOCK = threading.Lock()


class Python(Language):
    name = "python"
    # Ready means every package the image lists imports (a package whose native part does
    # not load under the sandbox policy makes the language not ready, with its name).
    test_program = (
        "import importlib, json\n"
        "def main(state):\n"
        "    try:\n"
        "        with open('/usr/share/studio-code/modules.json') as f:\n"
        "            listed = json.load(f)['packages']\n"
        "    except FileNotFoundError:\n"
        "        listed = {}\n"
        "    for modules in listed.values():\n"
        "        for name in modules:\n"
        "            importlib.import_module(name)\n"
        "    return {'ready': True}\n"
    )

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

    def preimport(self, settings: Settings) -> dict[str, str]:
        # read, and removed from the environment, by python_runner.py's _preimport
        return {"STUDIO_PREIMPORT": settings.code_preimport} if settings.code_preimport else {}

    def preimport_modules(self, settings: Settings) -> list[str]:
        return settings.code_preimport.split(",") if settings.code_preimport else []

    def check(self, code: str, settings: Settings, facts: ImageFacts) -> list[Problem]:
        try:
            with _PARSE_LOCK:
                tree = ast.parse(code, filename="main.py")
        except SyntaxError as e:
            return [Problem(e.lineno or 0, f"SyntaxError: {e.msg}")]
        if not any(_binds_main(node) for node in tree.body):
            return [
                Problem(
                    0,
                    "The code defines no main(state) function: add `def main(state):` "
                    "returning the node's output.",
                )
            ]
        return _unavailable_imports(tree, facts)

    def packages(self, settings: Settings, facts: ImageFacts) -> list[str]:
        # STUDIO_CODE_PACKAGES when set, else the image's own list (executor.package_lists)
        from executor.package_lists import shown_packages

        return shown_packages(settings, self.name, facts.packages())


def _binds_main(node: ast.stmt) -> bool:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return node.name == "main"
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "main" for t in node.targets)
    if isinstance(node, ast.ImportFrom | ast.Import):
        return any((a.asname or a.name) == "main" for a in node.names)
    return False


def _unavailable_imports(tree: ast.Module, facts: ImageFacts) -> list[Problem]:
    """An import that is neither in the image's standard library nor installed in the image
    fails at run time: refuse it at save time, naming what is available. The image's
    modules are asked only for code that imports something; unknown (no image: the
    subprocess runtime; no engine; an image without the file): nothing is refused."""
    found = imports(tree)
    if not found:
        return []
    available = facts.modules()
    if available is None:
        return []
    problems = []
    for line, module in found:
        if not available.allows(module):
            listed = ", ".join(
                f"{pkg} (import {', '.join(mods)})" if [pkg] != mods else pkg
                for pkg, mods in sorted(available.packages.items())
            )
            problems.append(
                Problem(
                    line,
                    (
                        f"`{module}` cannot be imported in the sandbox image "
                        f"{available.image}: it is not in its standard library nor among "
                        f"its packages: {listed}. Use one of those, or ask an admin to add the "
                        "package to the image (docker/README.md)."
                    ),
                )
            )
    return problems
