"""``python -m executor.store.migrations``: write a new revision, show or apply a store's.

    new "what changes"   the next revision file, from script.py.mako (prints its path)
    current [--url URL]  the store's revision (none: made before migrations, or empty)
    upgrade [--url URL]  open the store, as every worker does at start (prints the steps)

The URL defaults to the one the workers use (STUDIO_DATABASE_URL, else the SQLite file in
STUDIO_DATA_DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from executor.store import migrations


def _new(message: str, location: Path) -> Path:
    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(location))
    config.set_main_option("file_template", "%%(rev)s_%%(slug)s")
    rev_id = f"{int(migrations.head(location)) + 1:04d}"
    script = command.revision(config, message=message, rev_id=rev_id)
    assert script is not None and not isinstance(script, list)
    return Path(script.path)


def _url(args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url)
    from executor.settings import load_settings

    return load_settings().sqlalchemy_url


def _current(url: str) -> str | None:
    from executor.store.sql import SqlRunStore
    from executor.store.sqlite import no_fork_inside

    store = SqlRunStore(url, create_tables=False)
    try:
        with no_fork_inside(), store.engine.connect() as conn:
            return migrations.context(conn).get_current_revision()
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m executor.store.migrations")
    sub = parser.add_subparsers(dest="command", required=True)
    new = sub.add_parser("new", help="write the next revision file")
    new.add_argument("message", help="what the revision changes (its file's name and docstring)")
    new.add_argument("--location", type=Path, default=migrations.LOCATION, help=argparse.SUPPRESS)
    for name in ("current", "upgrade"):
        sub.add_parser(name).add_argument("--url", help="the run store (a SQLAlchemy URL)")
    args = parser.parse_args(argv)
    if args.command == "new":
        print(_new(args.message, args.location))
        return 0
    url = _url(args)
    if args.command == "current":
        print(_current(url) or "none")
        return 0
    from executor.store.sql import SqlRunStore, describe_url

    with SqlRunStore(url) as store:
        steps = store.schema_steps
    out = {"store": describe_url(url), "steps": list(steps), "revision": _current(url)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
