"""What Python code in the sandbox image can import, for the save-time check: the
image's modules (data) and the imports of a node's code.

The image records them at build time in ``/usr/share/studio-code/modules.json``
(docker/studio-code/record_modules.py): the image's standard library, each listed package's
top-level modules, and every installed top-level module. Reading that file is the docker
runtime's (executor/runtimes/docker/images.py), which hands it to the language as
``ImageFacts.modules()``; this module never reads an image.

No file (an image built before this), no Docker, or the subprocess runtime: ``None``, and
the check of imports is skipped (readiness still imports every listed package).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from executor import sandbox_names

MODULES_PATH = sandbox_names.MODULES_PATH


@dataclass(frozen=True)
class ImageModules:
    """What one image's Python can import."""

    image: str
    stdlib: frozenset[str]
    packages: dict[str, list[str]]  # listed package -> its top-level modules
    modules: frozenset[str]  # every installed top-level module
    # listed package -> its version; empty for an image built before versions were recorded
    versions: dict[str, str] = field(default_factory=dict)

    def allows(self, module: str) -> bool:
        return module in self.stdlib or module in self.modules


_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _guarded(handler: ast.ExceptHandler) -> bool:
    t = handler.type
    if t is None:
        return True
    names = t.elts if isinstance(t, ast.Tuple) else [t]
    return any(isinstance(n, ast.Name) and n.id in _IMPORT_ERRORS for n in names)


def imports(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, top-level module) of each absolute import, except those inside a ``try``
    that handles ImportError (optional imports with a fallback)."""
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try | ast.TryStar):
            inner = guarded or any(_guarded(h) for h in node.handlers)
            for stmt in node.body:
                visit(stmt, inner)
            rest: list[ast.AST] = [*node.handlers, *node.orelse, *node.finalbody]
            for other in rest:
                visit(other, guarded)
            return
        if not guarded:
            if isinstance(node, ast.Import):
                out.extend((node.lineno, a.name.split(".")[0]) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((node.lineno, node.module.split(".")[0]))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return out
