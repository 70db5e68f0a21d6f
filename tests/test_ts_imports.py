"""Save-time checks of TypeScript code nodes: the package policy, entry point and syntax."""

from __future__ import annotations

from pathlib import Path

import pytest

from executor.languages.ts_imports import (
    DEFAULT_TS_PACKAGES,
    ImportRef,
    PackageSpec,
    Problem,
    check_typescript,
    find_imports,
    parse_packages,
)

DEFAULT = parse_packages(DEFAULT_TS_PACKAGES)
# The tail of every refusal that names the allowed list under the default setting.
LIST = "allowed: npm:zod@3, npm:date-fns@4"
NONE = "no package is allowed (STUDIO_CODE_TS_PACKAGES is empty)"
DYNAMIC = "dynamic import() must use a string literal so the package can be checked at save time"
NO_ENTRY = (
    "no entry point: export a function named main (export function main() { ... })"
    " or an export default"
)
DEPS_TS = Path(__file__).resolve().parents[1] / "docker" / "studio-code-ts" / "deps.ts"


def node_with(form: str) -> str:
    """A valid code node with ``form`` starting on line 2."""
    return f"// a code node\n{form}\nexport default async function main() {{}}\n"


# (form, expected reason or None when accepted, line of the problem)
IMPORT_FORMS = [
    # accepted: the pinned major, in every import form
    ('import { z } from "npm:zod@3";', None, 2),
    ("import z from 'npm:zod@3.25.1';", None, 2),
    ('import * as z from "npm:zod@3/mini";', None, 2),
    ('import { z } from "npm:zod@3.25.1/mini";', None, 2),
    ('import def, { z } from "npm:zod@3.0.0-beta.1";', None, 2),
    ('import "npm:date-fns@4";', None, 2),
    ('import type { ZodType } from "npm:zod@3";', None, 2),
    ('import { type ZodType } from "npm:zod@3";', None, 2),
    ('export { format } from "npm:date-fns@4";', None, 2),
    ('export * from "npm:zod@3";', None, 2),
    ('export * as dates from "npm:date-fns@4";', None, 2),
    ('export type { ZodType } from "npm:zod@3";', None, 2),
    ('const z = await import("npm:zod@3");', None, 2),
    ("const z = await import(`npm:zod@3/mini`);", None, 2),
    ('const z = import("npm:zod@3", { with: {} });', None, 2),
    ('import z = require("npm:zod@3");', None, 2),
    ('type Z = typeof import("npm:zod@3");', None, 2),
    ('import z from "npm:zod\\x403";', None, 2),  # an escape decodes to npm:zod@3
    ('import z from "NPM:zod@3";', None, 2),  # schemes are case-insensitive
    # refused: not pinned, or pinned to another major
    ('import { z } from "npm:zod";', "npm:zod must be pinned to major 3: write npm:zod@3", 2),
    (
        'import { z } from "npm:zod/mini";',
        "npm:zod/mini must be pinned to major 3: write npm:zod@3/mini",
        2,
    ),
    ('import "npm:zod@";', "npm:zod@ must be pinned to major 3: write npm:zod@3", 2),
    (
        'import { z } from "npm:zod@4";',
        "npm:zod@4 is not allowed: npm:zod is pinned to major 3: write npm:zod@3",
        2,
    ),
    (
        'export * from "npm:zod@4.1.0/mini";',
        "npm:zod@4.1.0/mini is not allowed: npm:zod is pinned to major 3: write npm:zod@3/mini",
        2,
    ),
    (
        'import { format } from "npm:date-fns@3";',
        "npm:date-fns@3 is not allowed: npm:date-fns is pinned to major 4: write npm:date-fns@4",
        2,
    ),
    # refused: a range or a tag is not a pinned major
    (
        'import { z } from "npm:zod@^3";',
        "npm:zod@^3 is not pinned to a major version ('^3' is a range or a tag): write npm:zod@3",
        2,
    ),
    (
        'import { z } from "npm:zod@~3.1";',
        "npm:zod@~3.1 is not pinned to a major version ('~3.1' is a range or a tag):"
        " write npm:zod@3",
        2,
    ),
    (
        'import { z } from "npm:zod@latest";',
        "npm:zod@latest is not pinned to a major version ('latest' is a range or a tag):"
        " write npm:zod@3",
        2,
    ),
    (
        'import { z } from "npm:zod@3.x";',
        "npm:zod@3.x is not pinned to a major version ('3.x' is a range or a tag): write npm:zod@3",
        2,
    ),
    (
        'import { z } from "npm:zod@>=3";',
        "npm:zod@>=3 is not pinned to a major version ('>=3' is a range or a tag): write npm:zod@3",
        2,
    ),
    (
        'import { z } from "npm:zod@*/mini";',
        "npm:zod@*/mini is not pinned to a major version ('*' is a range or a tag):"
        " write npm:zod@3/mini",
        2,
    ),
    # refused: packages that are not listed, in every import form
    ('import _ from "npm:lodash@4";', f"npm:lodash is not an allowed package; {LIST}", 2),
    ('import _ from "npm:lodash";', f"npm:lodash is not an allowed package; {LIST}", 2),
    ('import type { T } from "npm:lodash@4";', f"npm:lodash is not an allowed package; {LIST}", 2),
    (
        'export type { T } from "npm:lodash@4";',
        f"npm:lodash is not an allowed package; {LIST}",
        2,
    ),
    ('export * as _ from "npm:lodash@4";', f"npm:lodash is not an allowed package; {LIST}", 2),
    ('import _ = require("npm:lodash@4");', f"npm:lodash is not an allowed package; {LIST}", 2),
    (
        'type T = typeof import("npm:lodash@4");',
        f"npm:lodash is not an allowed package; {LIST}",
        2,
    ),
    (
        "const _ = await import('npm:lodash@4');",
        f"npm:lodash is not an allowed package; {LIST}",
        2,
    ),
    ('import _ from "npm:lodash\\x404";', f"npm:lodash is not an allowed package; {LIST}", 2),
    ('import p from "npm:@scope/pkg@2";', f"npm:@scope/pkg is not an allowed package; {LIST}", 2),
    ('import p from "jsr:@std/path";', f"jsr:@std/path is not an allowed package; {LIST}", 2),
    (
        'import p from "jsr:@std/path@1/posix";',
        f"jsr:@std/path is not an allowed package; {LIST}",
        2,
    ),
    # refused: not a package specifier at all
    (
        'import p from "npm:@scope";',
        f"npm:@scope is not a valid package specifier: write npm:name@major; {LIST}",
        2,
    ),
    ('import "npm:";', f"npm: is not a valid package specifier: write npm:name@major; {LIST}", 2),
    (
        'import p from "jsr:path@1";',
        f"jsr:path@1 is not a valid package specifier: write jsr:@scope/name@major; {LIST}",
        2,
    ),
    (
        'import fs from "node:fs";',
        f"node:fs is a Node.js built-in module: code nodes may not use the host; {LIST}",
        2,
    ),
    (
        'export * from "node:child_process";',
        f"node:child_process is a Node.js built-in module: code nodes may not use the host; {LIST}",
        2,
    ),
    (
        'import { z } from "https://esm.sh/zod@3";',
        f"https://esm.sh/zod@3 is a URL: code nodes may not import from the network; {LIST}",
        2,
    ),
    (
        'import "http://example.com/x.js";',
        f"http://example.com/x.js is a URL: code nodes may not import from the network; {LIST}",
        2,
    ),
    (
        'import x from "./x.ts";',
        f"./x.ts is a local file: a code node is a single module and cannot import files; {LIST}",
        2,
    ),
    (
        'import x from "../x";',
        f"../x is a local file: a code node is a single module and cannot import files; {LIST}",
        2,
    ),
    (
        'import x from "/etc/x";',
        f"/etc/x is a local file: a code node is a single module and cannot import files; {LIST}",
        2,
    ),
    (
        'import x from "file:///etc/passwd";',
        "file:///etc/passwd is a local file: a code node is a single module and cannot import"
        f" files; {LIST}",
        2,
    ),
    (
        'import x from "data:text/javascript,export default 1";',
        "data:text/javascript,export default 1 uses the unsupported scheme data:; " + LIST,
        2,
    ),
    (
        'import x from "data:text/javascript,' + "x" * 100 + '";',
        "data:text/javascript," + "x" * 58 + "… uses the unsupported scheme data:; " + LIST,
        2,
    ),
    ('import { z } from "zod";', "zod has no registry prefix: write npm:zod@3", 2),
    ('import { z } from "zod@3";', "zod@3 has no registry prefix: write npm:zod@3", 2),
    (
        'import { format } from "date-fns/format";',
        "date-fns/format has no registry prefix: write npm:date-fns@4/format",
        2,
    ),
    (
        'import _ from "lodash";',
        f"lodash is a bare specifier: import a package as npm:name@major; {LIST}",
        2,
    ),
    (
        'import fs from "fs";',
        f"fs is a bare specifier: import a package as npm:name@major; {LIST}",
        2,
    ),
    ('import "";', f"an empty module specifier cannot be imported; {LIST}", 2),
    # refused: dynamic imports whose module is only known at run time
    ("const m = await import(name);", DYNAMIC, 2),
    ("const m = await import(`npm:${name}@3`);", DYNAMIC, 2),
    ('const m = await import("npm:" + "zod@3");', DYNAMIC, 2),
    ("const m = await import(...names);", DYNAMIC, 2),
    ("const m = await import();", DYNAMIC, 2),
    # the line is the specifier's, even when the statement spans lines
    (
        'import {\n  a,\n  b,\n} from "npm:zod";',
        "npm:zod must be pinned to major 3: write npm:zod@3",
        5,
    ),
    (
        'const z = await import(\n  "npm:zod@4"\n);',
        "npm:zod@4 is not allowed: npm:zod is pinned to major 3: write npm:zod@3",
        3,
    ),
]


@pytest.mark.parametrize(("form", "reason", "line"), IMPORT_FORMS)
def test_import_forms(form: str, reason: str | None, line: int) -> None:
    problems = check_typescript(node_with(form), DEFAULT)
    expected = [] if reason is None else [Problem(line, reason)]
    assert problems == expected


def test_import_form_table_is_large() -> None:
    assert len(IMPORT_FORMS) >= 30
    assert sum(reason is None for _, reason, _ in IMPORT_FORMS) >= 10


def test_a_listed_scoped_package_is_accepted() -> None:
    allowed = parse_packages("npm:@scope/pkg@2")
    code = node_with('import p from "npm:@scope/pkg@2";\nimport q from "npm:@scope/pkg@2.1/sub";')
    assert check_typescript(code, allowed) == []
    assert check_typescript(node_with('import p from "npm:@scope/pkg@1";'), allowed) == [
        Problem(
            2,
            "npm:@scope/pkg@1 is not allowed: npm:@scope/pkg is pinned to major 2:"
            " write npm:@scope/pkg@2",
        ),
    ]


def test_a_listed_jsr_package_is_accepted() -> None:
    allowed = parse_packages("jsr:@std/path@1")
    assert (
        check_typescript(node_with('import { join } from "jsr:@std/path@1/posix";'), allowed) == []
    )
    assert check_typescript(node_with('import { join } from "jsr:@std/path";'), allowed) == [
        Problem(2, "jsr:@std/path must be pinned to major 1: write jsr:@std/path@1"),
    ]


def test_empty_allowed_list_refuses_every_package() -> None:
    code = node_with(
        'import { z } from "npm:zod@3";\n'
        'import { format } from "npm:date-fns@4";\n'
        'import fs from "node:fs";\n'
        'import z2 from "zod";'
    )
    assert parse_packages("") == ()
    assert check_typescript(code, parse_packages("")) == [
        Problem(2, f"npm:zod is not an allowed package; {NONE}"),
        Problem(3, f"npm:date-fns is not an allowed package; {NONE}"),
        Problem(
            4, f"node:fs is a Node.js built-in module: code nodes may not use the host; {NONE}"
        ),
        Problem(5, f"zod is a bare specifier: import a package as npm:name@major; {NONE}"),
    ]


def test_problems_are_ordered_by_line() -> None:
    code = (
        "export default function main() {\n"
        '  return import("npm:lodash@4");\n'
        "}\n"
        'import { z } from "npm:zod";\n'
        'export * from "node:os";\n'
    )
    assert [problem.line for problem in check_typescript(code, DEFAULT)] == [2, 4, 5]


@pytest.mark.parametrize(
    "code",
    [
        '// import _ from "npm:lodash@4";\n',
        '/* import("npm:lodash@4") */\n',
        '/**\n * import "node:fs";\n */\n',
        "const s = 'import _ from \"npm:lodash@4\"';\n",
        'const t = `export * from "node:fs"`;\n',
        'const from = "npm:lodash"; const imports = [from];\n',
        'const re = /import "npm:lodash@4"/;\n',
        'loader.import("npm:lodash@4");\n',
        'const o = { import: "node:fs" };\n',
    ],
)
def test_comments_and_strings_are_not_imports(code: str) -> None:
    code += "export function main() {}\n"
    assert find_imports(code) == []
    assert check_typescript(code, DEFAULT) == []


def test_find_imports_reports_each_kind_in_order() -> None:
    code = (
        'import a from "s1";\n'
        'import type { B } from "t1";\n'
        'import c = require("r1");\n'
        'export { d } from "e1";\n'
        'export * from "e2";\n'
        'export * as f from "e3";\n'
        'export type { G } from "t2";\n'
        'const h = await import("d1");\n'
        "const i = import(name);\n"
        'let j: typeof import("t3");\n'
        'import "s2";\n'
    )
    assert find_imports(code) == [
        ImportRef("s1", 1, "static"),
        ImportRef("t1", 2, "type"),
        ImportRef("r1", 3, "require"),
        ImportRef("e1", 4, "export"),
        ImportRef("e2", 5, "export"),
        ImportRef("e3", 6, "export"),
        ImportRef("t2", 7, "type"),
        ImportRef("d1", 8, "dynamic"),
        ImportRef(None, 9, "dynamic"),
        ImportRef("t3", 10, "type"),
        ImportRef("s2", 11, "static"),
    ]


def test_deeply_nested_code_does_not_exhaust_the_stack() -> None:
    depth = 3000
    code = "export default 1;\n" + "[" * depth + 'import("npm:lodash@4")' + "]" * depth + ";\n"
    assert check_typescript(code, DEFAULT) == [
        Problem(2, f"npm:lodash is not an allowed package; {LIST}"),
    ]


@pytest.mark.parametrize(
    "code",
    [
        "export default function () {}",
        "export default async function main() {}",
        "export default class {}",
        "export default 42;",
        "const handler = () => 1;\nexport default handler;",
        "const handler = () => 1;\nexport { handler as default };",
        "export { default } from 'npm:zod@3';",
        "export function main() {}",
        "export async function main(input: unknown) { return input; }",
        "export function* main() {}",
        "export const main = async () => 1;",
        "export let main = () => 1;",
        "export var main = function () {};",
        "export const other = 1, main = () => other;",
        "export const { main } = { main: () => 1 };",
        "export const [, main] = [0, () => 1];",
        "export const { run: main } = { run: () => 1 };",
        "function foo() {}\nexport { foo as main };",
        "function main() {}\nexport { main };",
        "function foo() {}\nexport { foo as 'main' };",
    ],
)
def test_entry_point_is_found(code: str) -> None:
    assert check_typescript(code, DEFAULT) == []


@pytest.mark.parametrize(
    "code",
    [
        "",
        "   \n\n",
        "function main() {}",
        "export function run() {}",
        "export const { main: run } = { main: () => 1 };",
        "export const { run = main } = {};",
        "export class main {}",
        "export type { main };\ntype main = () => void;",
        "type main = () => void;\nexport { type main };",
        "export default interface Main {}",
        "export declare function main(): void;",
        "export namespace n { export function main() {} }",
        "export * from 'npm:zod@3';",
    ],
)
def test_missing_entry_point_is_a_problem(code: str) -> None:
    assert check_typescript(code, DEFAULT) == [Problem(1, NO_ENTRY)]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("export default 1;\nconst = ;\n", [Problem(2, "syntax error at line 2")]),
        (
            "export function main() {\n  let x = f(1;\n}\n",
            [Problem(2, "syntax error at line 2: missing ')'")],
        ),
        (
            "export function main() {\n  return 1;\n",
            [Problem(2, "syntax error at line 2: missing '}'")],
        ),
        (
            "export default 1 +;\n",
            [Problem(1, "syntax error at line 1: missing identifier")],
        ),
        # a broken file is not also told it has no entry point, but its imports are checked
        (
            'import { z } from "npm:zod";\nexport function main() {\n  @@@\n}\n',
            [
                Problem(1, "npm:zod must be pinned to major 3: write npm:zod@3"),
                Problem(3, "syntax error at line 3"),
            ],
        ),
    ],
)
def test_syntax_errors_name_their_line(code: str, expected: list[Problem]) -> None:
    assert check_typescript(code, DEFAULT) == expected


def test_parse_packages_default() -> None:
    assert DEFAULT == (PackageSpec("npm", "zod", 3), PackageSpec("npm", "date-fns", 4))
    assert [str(spec) for spec in DEFAULT] == ["npm:zod@3", "npm:date-fns@4"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("", ()),
        (" , ,", ()),
        ("npm:zod@3", (PackageSpec("npm", "zod", 3),)),
        (
            " npm:zod@3 , , npm:date-fns@4 ",
            (PackageSpec("npm", "zod", 3), PackageSpec("npm", "date-fns", 4)),
        ),
        ("npm:@scope/pkg@2", (PackageSpec("npm", "@scope/pkg", 2),)),
        ("jsr:@std/path@1", (PackageSpec("jsr", "@std/path", 1),)),
        ("npm:pkg@0", (PackageSpec("npm", "pkg", 0),)),
    ],
)
def test_parse_packages_accepts(value: str, expected: tuple[PackageSpec, ...]) -> None:
    assert parse_packages(value) == expected


HOW = "write each package as npm:name@major, e.g. npm:zod@3"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("npm:zod", f"STUDIO_CODE_TS_PACKAGES entry 'npm:zod' is not pinned: {HOW}"),
        ("npm:zod@", f"STUDIO_CODE_TS_PACKAGES entry 'npm:zod@' is not pinned: {HOW}"),
        ("zod@3", f"STUDIO_CODE_TS_PACKAGES entry 'zod@3' has no registry: {HOW}"),
        (
            "npm:zod@^3",
            "STUDIO_CODE_TS_PACKAGES entry 'npm:zod@^3' is not pinned to a major version"
            f" ('^3' is not a plain major number): {HOW}",
        ),
        (
            "npm:zod@x",
            "STUDIO_CODE_TS_PACKAGES entry 'npm:zod@x' is not pinned to a major version"
            f" ('x' is not a plain major number): {HOW}",
        ),
        (
            "npm:zod@3.25.1",
            "STUDIO_CODE_TS_PACKAGES entry 'npm:zod@3.25.1' is not pinned to a major version"
            f" ('3.25.1' is not a plain major number): {HOW}",
        ),
        (
            "npm:zod@03",
            "STUDIO_CODE_TS_PACKAGES entry 'npm:zod@03' is not pinned to a major version"
            f" ('03' is not a plain major number): {HOW}",
        ),
        (
            "npm:@scope@1",
            "STUDIO_CODE_TS_PACKAGES entry 'npm:@scope@1' has an invalid package name '@scope':"
            f" {HOW}",
        ),
        (
            "npm:zod@3, pypi:requests@2",
            "STUDIO_CODE_TS_PACKAGES entry 'pypi:requests@2' has the unsupported registry"
            f" 'pypi' (use npm or jsr): {HOW}",
        ),
        (
            "jsr:path@1",
            "STUDIO_CODE_TS_PACKAGES entry 'jsr:path@1' names a jsr package without a scope"
            f" (jsr names are @scope/name): {HOW}",
        ),
        (
            "npm:zod@3,npm:zod@4",
            "STUDIO_CODE_TS_PACKAGES entry 'npm:zod@4' repeats the package npm:zod, which is"
            f" already listed: {HOW}",
        ),
    ],
)
def test_parse_packages_refuses(value: str, message: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        parse_packages(value)
    assert str(excinfo.value) == message


def test_image_deps_match_the_default_packages() -> None:
    # deps.ts fills the sandbox image's Deno cache; a package missing there fails at run time.
    imports = find_imports(DEPS_TS.read_text(encoding="utf-8"))
    assert {ref.kind for ref in imports} == {"static"}
    assert {ref.specifier for ref in imports} == {str(spec) for spec in DEFAULT}
    assert len(imports) == len(DEFAULT)
