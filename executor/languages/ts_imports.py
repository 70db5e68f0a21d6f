"""Save-time checks for TypeScript code nodes: syntax, entry point and the package policy.

`STUDIO_CODE_TS_PACKAGES` lists the only packages a code node may import, each pinned as
``registry:name@major`` (default :data:`DEFAULT_TS_PACKAGES`). The sandbox image caches exactly
those packages, so an import must name one of them with the same major: ``npm:zod@3``,
``npm:zod@3.25.1`` and ``npm:zod@3/mini`` are fine, while an unversioned ``npm:zod`` would make
Deno look for the newest version, which the cache does not have.

The code is parsed with the tree-sitter TypeScript grammar and the syntax tree is walked, so
the word ``import`` inside a comment or a string is never mistaken for an import.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal

import tree_sitter
import tree_sitter_typescript

# Problem lives with the languages, the package list's parser in executor.packages (so
# Settings loads no tree-sitter); their names stay importable from here.
from executor.languages.base import Problem
from executor.packages import (
    DEFAULT_TS_PACKAGES,
    NAME_PART,
    REGISTRIES,
    SCHEME_RE,
    SETTING_REASONS,
    PackageSpec,
    parse_packages,
)

__all__ = [
    "ALLOWED_LIST",
    "ALLOWED_NONE",
    "DEFAULT_TS_PACKAGES",
    "REASONS",
    "SETTING_REASONS",
    "ImportKind",
    "ImportRef",
    "PackageSpec",
    "Problem",
    "check_typescript",
    "find_imports",
    "parse_packages",
]

#: The reasons a code node is refused, as format strings. Their text is part of the contract:
#: admins see them in the CODE_INVALID error, and the tests check each one exactly.
#: ``{allowed}`` is filled with :data:`ALLOWED_LIST` or :data:`ALLOWED_NONE`.
REASONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "syntax": "syntax error at line {line}",
        "syntax_missing": "syntax error at line {line}: missing {token}",
        "no_entry_point": (
            "no entry point: export a function named main (export function main() {{ ... }})"
            " or an export default"
        ),
        "dynamic": (
            "dynamic import() must use a string literal so the package can be checked at save time"
        ),
        "empty": "an empty module specifier cannot be imported; {allowed}",
        "unpinned": "{spec} must be pinned to major {major}: write {suggestion}",
        "wrong_major": (
            "{spec} is not allowed: {package} is pinned to major {major}: write {suggestion}"
        ),
        "not_a_major": (
            "{spec} is not pinned to a major version ('{version}' is a range or a tag):"
            " write {suggestion}"
        ),
        "not_listed": "{package} is not an allowed package; {allowed}",
        "bad_package": "{spec} is not a valid package specifier: write {form}; {allowed}",
        "node": "{spec} is a Node.js built-in module: code nodes may not use the host; {allowed}",
        "url": "{spec} is a URL: code nodes may not import from the network; {allowed}",
        "file": (
            "{spec} is a local file: a code node is a single module and cannot import files;"
            " {allowed}"
        ),
        "scheme": "{spec} uses the unsupported scheme {scheme}; {allowed}",
        "bare_allowed": "{spec} has no registry prefix: write {suggestion}",
        "bare": "{spec} is a bare specifier: import a package as npm:name@major; {allowed}",
    }
)
ALLOWED_LIST: Final = "allowed: {specs}"
ALLOWED_NONE: Final = "no package is allowed (STUDIO_CODE_TS_PACKAGES is empty)"

_REGISTRIES: Final = REGISTRIES
_FORMS: Final = {"npm": "npm:name@major", "jsr": "jsr:@scope/name@major"}
_NAME_PART: Final = NAME_PART
_PACKAGE_RE: Final = re.compile(
    rf"(?P<name>(?:@{_NAME_PART}/)?{_NAME_PART})(?:@(?P<version>[^/]*))?(?P<subpath>/.*)?",
    re.DOTALL,
)
# A concrete version (3, 3.25, 3.25.1, 3.0.0-beta.1): anything else is a range or a dist-tag.
_EXACT_VERSION_RE: Final = re.compile(
    r"(?P<major>0|[1-9][0-9]*)"
    r"(?:\.(?:0|[1-9][0-9]*)(?:\.(?:0|[1-9][0-9]*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?)?)?"
)
_SCHEME_RE: Final = SCHEME_RE
# A data: URL can be as long as the code itself; the reason only needs to identify it.
_MAX_SHOWN: Final = 80

ImportKind = Literal["static", "type", "export", "dynamic", "require"]

# Nodes under which an import() is a type (``typeof import("x")``, ``let a: import("x").T``),
# erased before the code runs.
_TYPE_CONTEXTS: Final = frozenset(
    {
        "type_annotation",
        "opt_type_annotation",
        "type_query",
        "type_alias_declaration",
        "type_arguments",
        "type_parameters",
        "interface_declaration",
        "extends_type_clause",
        "implements_clause",
        "asserts_annotation",
        "type_predicate_annotation",
    }
)
# Exported declarations that give the module a callable ``main``.
_FUNCTION_DECLARATIONS: Final = frozenset(
    {"function_declaration", "generator_function_declaration"}
)
_VARIABLE_DECLARATIONS: Final = frozenset({"lexical_declaration", "variable_declaration"})
# ``export default interface X {}`` exports a type only; nothing exists at run time.
_TYPE_ONLY_DECLARATIONS: Final = frozenset(
    {"interface_declaration", "type_alias_declaration", "ambient_declaration"}
)


@dataclass(frozen=True)
class ImportRef:
    """A module the code imports, as written, with the 1-based line of its specifier.

    ``specifier`` is None for an ``import(expr)`` whose argument is not a string literal.
    ``kind`` is ``static`` (``import … from``, ``import "…"``), ``type`` (erased before run
    time: ``import type``, ``export type … from``, ``typeof import("…")``), ``export``
    (``export … from``), ``dynamic`` (``import("…")``) or ``require``
    (``import x = require("…")``).
    """

    specifier: str | None
    line: int
    kind: ImportKind


def find_imports(code: str) -> list[ImportRef]:
    """Every module the code imports, in source order, found in the syntax tree.

    Covers ``import … from``, side-effect ``import "…"``, ``import type``,
    ``import x = require("…")``, ``export … from`` and ``import(…)``. Parts of the code that
    do not parse (ERROR nodes) are skipped: they are reported as syntax errors instead.
    """
    tree = _parse(code)
    return list(_imports(tree.root_node))


def check_typescript(code: str, allowed: Sequence[PackageSpec]) -> list[Problem]:
    """Everything wrong with a TypeScript code node at save time; ``[]`` when it may be saved.

    Reports syntax errors, a missing entry point (the module must ``export default`` something
    or export a binding named ``main``) and every import that is not one of ``allowed`` with
    its pinned major. Problems are ordered by line.
    """
    tree = _parse(code)
    root = tree.root_node
    problems = list(_syntax_problems(root))
    # A broken file may hide its `export function main` inside an ERROR node; claiming there is
    # no entry point would send the admin after the wrong problem.
    if not problems and not _has_entry_point(root):
        problems.append(Problem(1, REASONS["no_entry_point"].format()))
    by_package: dict[tuple[str, str], PackageSpec] = {}
    for spec in allowed:
        by_package.setdefault((spec.registry, spec.name), spec)
    allowed_text = _allowed_text(allowed)
    for ref in _imports(root):
        reason = _specifier_problem(ref.specifier, by_package, allowed_text)
        if reason is not None:
            problems.append(Problem(ref.line, reason))
    # sorted() is stable, so problems on one line keep the order they were found in.
    return sorted(problems, key=lambda problem: problem.line)


@functools.cache
def _language() -> tree_sitter.Language:
    return tree_sitter.Language(tree_sitter_typescript.language_typescript())


def _parse(code: str) -> tree_sitter.Tree:
    # A Parser is cheap but not safe to share between threads; the Language is.
    parser = tree_sitter.Parser(_language())
    # "replace" keeps one byte sequence per character, so line numbers stay right even when
    # the code holds a lone surrogate that UTF-8 cannot encode.
    return parser.parse(code.encode("utf-8", errors="replace"))


def _line(node: tree_sitter.Node) -> int:
    return node.start_point.row + 1


def _syntax_problems(root: tree_sitter.Node) -> Iterator[Problem]:
    if not root.has_error:
        return
    reported: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            line = _line(node)
            if line not in reported:
                reported.add(line)
                if node.is_missing:
                    # Name a missing node (`identifier`), quote a missing token (`')'`).
                    token = node.type if node.is_named else f"'{node.type}'"
                    message = REASONS["syntax_missing"].format(line=line, token=token)
                else:
                    message = REASONS["syntax"].format(line=line)
                yield Problem(line, message)
            # Errors nested in an ERROR node repeat the same mistake.
            continue
        stack.extend(child for child in reversed(node.children) if child.has_error)


def _imports(root: tree_sitter.Node) -> Iterator[ImportRef]:
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error:
            continue
        ref = _import_ref(node)
        if ref is not None:
            yield ref
        stack.extend(reversed(node.children))


def _import_ref(node: tree_sitter.Node) -> ImportRef | None:
    if node.type == "import_statement":
        source = node.child_by_field_name("source")
        kind: ImportKind = "static"
        if source is None:
            # `import x = require("…")` keeps its source on the clause, not the statement.
            clause = _first_child(node, "import_require_clause")
            source = clause.child_by_field_name("source") if clause is not None else None
            kind = "require"
        if _first_child(node, "type") is not None:
            kind = "type"
        if source is None:
            return None
        return ImportRef(_string_value(source), _line(source), kind)
    if node.type == "export_statement":
        source = node.child_by_field_name("source")
        if source is None:
            return None
        kind = "type" if _first_child(node, "type") is not None else "export"
        return ImportRef(_string_value(source), _line(source), kind)
    if node.type == "call_expression":
        function = node.child_by_field_name("function")
        if function is None or function.type != "import":
            return None
        arguments = node.child_by_field_name("arguments")
        first = arguments.named_children[0] if arguments and arguments.named_children else None
        specifier = _string_value(first) if first is not None else None
        kind = "type" if _in_type_context(node) else "dynamic"
        return ImportRef(specifier, _line(first or node), kind)
    return None


def _first_child(node: tree_sitter.Node, node_type: str) -> tree_sitter.Node | None:
    return next((child for child in node.children if child.type == node_type), None)


def _in_type_context(node: tree_sitter.Node) -> bool:
    parent = node.parent
    while parent is not None:
        if parent.type in _TYPE_CONTEXTS:
            return True
        parent = parent.parent
    return False


def _string_value(node: tree_sitter.Node) -> str | None:
    """The value of a string literal, or of a template literal without ``${}``; else None."""
    if node.type not in ("string", "template_string"):
        return None
    parts: list[str] = []
    for child in node.named_children:
        text = _text(child)
        if child.type == "string_fragment":
            parts.append(text)
        elif child.type == "escape_sequence":
            parts.append(_unescape(text))
        else:
            # A ${…} substitution: the value is only known at run time.
            return None
    return "".join(parts)


_SIMPLE_ESCAPES: Final = {
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
    "0": "\0",
}
_LINE_CONTINUATIONS: Final = ("\r\n", "\n", "\r", "\u2028", "\u2029")


def _unescape(escape: str) -> str:
    # Deno resolves the decoded specifier, so `"npm:lodash\x404"` must be checked as
    # `npm:lodash@4`, not as written.
    body = escape[1:]
    if body in _LINE_CONTINUATIONS:
        return ""
    if body in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[body]
    if body.startswith("u{") and body.endswith("}"):
        return _code_point(body[2:-1], escape)
    if body[:1] in ("u", "x") and len(body) > 1:
        return _code_point(body[1:], escape)
    if body[:1].isdigit():
        # Legacy octal escapes are a SyntaxError in a module; leaving them undecoded makes the
        # specifier invalid, which is what Deno would say too.
        return escape
    return body


def _code_point(hex_digits: str, escape: str) -> str:
    try:
        return chr(int(hex_digits, 16))
    except ValueError:
        return escape


def _text(node: tree_sitter.Node) -> str:
    return (node.text or b"").decode("utf-8", errors="replace")


def _has_entry_point(root: tree_sitter.Node) -> bool:
    # Only top-level exports count: `namespace N { export function main() {} }` is not one.
    return any(
        _exports_entry_point(node) for node in root.children if node.type == "export_statement"
    )


def _exports_entry_point(statement: tree_sitter.Node) -> bool:
    if _first_child(statement, "type") is not None:
        return False  # `export type { main }` exports nothing at run time
    declaration = statement.child_by_field_name("declaration")
    if _first_child(statement, "default") is not None:
        return declaration is None or declaration.type not in _TYPE_ONLY_DECLARATIONS
    if declaration is not None:
        if declaration.type in _FUNCTION_DECLARATIONS:
            name = declaration.child_by_field_name("name")
            return name is not None and _text(name) == "main"
        if declaration.type in _VARIABLE_DECLARATIONS:
            return "main" in _declared_names(declaration)
        return False
    clause = _first_child(statement, "export_clause")
    if clause is None:
        return False
    for specifier in clause.named_children:
        if specifier.type != "export_specifier" or _first_child(specifier, "type") is not None:
            continue
        exported = specifier.child_by_field_name("alias") or specifier.child_by_field_name("name")
        if exported is None:
            continue
        exported_name = _string_value(exported) if exported.type == "string" else _text(exported)
        if exported_name in ("main", "default"):
            return True
    return False


def _declared_names(declaration: tree_sitter.Node) -> set[str]:
    """Names bound by ``const``/``let``/``var``, including destructuring patterns."""
    names: set[str] = set()
    for declarator in declaration.named_children:
        if declarator.type == "variable_declarator":
            pattern = declarator.child_by_field_name("name")
            if pattern is not None:
                names.update(_bound_names(pattern))
    return names


def _bound_names(pattern: tree_sitter.Node) -> Iterator[str]:
    # Follow only binding positions: in `{ a = main }` and `{ main: a }` the name bound is `a`.
    stack = [pattern]
    while stack:
        node = stack.pop()
        if node.type in ("identifier", "shorthand_property_identifier_pattern"):
            yield _text(node)
        elif node.type in ("object_pattern", "array_pattern", "rest_pattern"):
            stack.extend(node.named_children)
        elif node.type == "pair_pattern":
            stack.extend(_fields(node, "value"))
        elif node.type in ("assignment_pattern", "object_assignment_pattern"):
            stack.extend(_fields(node, "left"))


def _fields(node: tree_sitter.Node, field: str) -> list[tree_sitter.Node]:
    child = node.child_by_field_name(field)
    return [] if child is None else [child]


def _allowed_text(allowed: Sequence[PackageSpec]) -> str:
    if not allowed:
        return ALLOWED_NONE
    return ALLOWED_LIST.format(specs=", ".join(str(spec) for spec in allowed))


def _shown(specifier: str) -> str:
    if len(specifier) <= _MAX_SHOWN:
        return specifier
    return specifier[: _MAX_SHOWN - 1] + "…"


def _specifier_problem(
    specifier: str | None,
    by_package: Mapping[tuple[str, str], PackageSpec],
    allowed: str,
) -> str | None:
    """Why ``specifier`` may not be imported, or None when it is an allowed pinned package."""
    if specifier is None:
        return REASONS["dynamic"].format()
    spec = _shown(specifier)
    if specifier == "":
        return REASONS["empty"].format(allowed=allowed)
    if specifier.startswith(("./", "../", "/")) or specifier in (".", ".."):
        return REASONS["file"].format(spec=spec, allowed=allowed)
    scheme_match = _SCHEME_RE.match(specifier)
    if scheme_match is None:
        return _bare_problem(specifier, spec, by_package, allowed)
    # URL schemes are case-insensitive: Deno reads `NPM:zod@3` as `npm:zod@3`.
    scheme = scheme_match["scheme"].lower()
    if scheme in _REGISTRIES:
        rest = specifier[scheme_match.end() :]
        return _package_problem(scheme, rest, spec, by_package, allowed)
    if scheme == "node":
        return REASONS["node"].format(spec=spec, allowed=allowed)
    if scheme in ("http", "https"):
        return REASONS["url"].format(spec=spec, allowed=allowed)
    if scheme == "file":
        return REASONS["file"].format(spec=spec, allowed=allowed)
    return REASONS["scheme"].format(spec=spec, scheme=f"{scheme}:", allowed=allowed)


def _package_problem(
    registry: str,
    rest: str,
    spec: str,
    by_package: Mapping[tuple[str, str], PackageSpec],
    allowed: str,
) -> str | None:
    match = _PACKAGE_RE.fullmatch(rest)
    if match is None or (registry == "jsr" and not rest.startswith("@")):
        return REASONS["bad_package"].format(spec=spec, form=_FORMS[registry], allowed=allowed)
    name, version, subpath = match["name"], match["version"], match["subpath"] or ""
    pinned = by_package.get((registry, name))
    if pinned is None:
        return REASONS["not_listed"].format(package=f"{registry}:{name}", allowed=allowed)
    suggestion = f"{pinned}{subpath}"
    if not version:
        return REASONS["unpinned"].format(spec=spec, major=pinned.major, suggestion=suggestion)
    exact = _EXACT_VERSION_RE.fullmatch(version)
    if exact is None:
        return REASONS["not_a_major"].format(spec=spec, version=version, suggestion=suggestion)
    if int(exact["major"]) != pinned.major:
        return REASONS["wrong_major"].format(
            spec=spec, package=f"{registry}:{name}", major=pinned.major, suggestion=suggestion
        )
    return None


def _bare_problem(
    specifier: str,
    spec: str,
    by_package: Mapping[tuple[str, str], PackageSpec],
    allowed: str,
) -> str:
    # `zod` or `zod@3` for a listed package is almost right: say exactly what to write.
    match = _PACKAGE_RE.fullmatch(specifier)
    if match is not None:
        for (_registry, name), pinned in by_package.items():
            if name == match["name"]:
                suggestion = f"{pinned}{match['subpath'] or ''}"
                return REASONS["bare_allowed"].format(spec=spec, suggestion=suggestion)
    return REASONS["bare"].format(spec=spec, allowed=allowed)
