"""The run store's schema migrations (executor/store/migrations), on a real SQLite file AND a
real PostgreSQL (a schema of the test's own):

* an empty database is brought to HEAD, and the schema the revisions make is the one the
  store's code describes (``schema.metadata``);
* a store made by each release before migrations (tests/data/store_schemas: the DDL its
  code ran, the rows its calls wrote and the records its own ``get`` returned, captured
  from that commit) is brought to HEAD, and every record reads back the same;
* two processes opening one new store at once both succeed, and one applies the revisions;
* a revision written from the template runs after HEAD, and a store at a revision newer
  than this release is used as it is (a rolling upgrade's older workers).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, inspect, text

from executor.errors import CodeInvalid
from executor.models import CodeJob, CodeResult, Status
from executor.store import JobRecord, SqlRunStore, migrations, open_store, schema, sqlite
from executor.store.sql import normalize_url
from testkit.postgres import CAPTURES, TODAY, made_by_an_older_release
from testkit.processes import in_processes


def _engine_of(url: str) -> Any:
    return create_engine(normalize_url(url))


def _schema_differences(url: str) -> list[Any]:
    """What Alembic's autogenerate would change to make the store match ``schema.metadata``."""
    from alembic.autogenerate import compare_metadata

    engine = _engine_of(url)
    try:
        with engine.connect() as conn:
            return list(compare_metadata(migrations.context(conn), schema.metadata))
    finally:
        engine.dispose()


def _versions(url: str) -> list[str]:
    engine = _engine_of(url)
    try:
        with engine.connect() as conn:
            return list(
                conn.execute(text(f"SELECT version_num FROM {migrations.VERSION_TABLE}")).scalars()
            )
    finally:
        engine.dispose()


def _plain(record: JobRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


# --- an empty database -----------------------------------------------------------------


def test_an_empty_database_is_brought_to_head(store_url: str) -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "executor.store.migrations", "upgrade", "--url", store_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(cli.stdout.splitlines()[-1])
    assert (
        report["steps"] == list(migrations.revisions()) and report["revision"] == migrations.head()
    )
    assert _versions(store_url) == [migrations.head()]
    assert _schema_differences(store_url) == []
    # at HEAD, an open is one SELECT: a fresh interpreter opens it without loading Alembic
    probe = (
        "import sys; from executor.store import SqlRunStore\n"
        f"s = SqlRunStore({store_url!r}); s.close()\n"
        "print(s.schema_steps, 'alembic' in sys.modules)\n"
    )
    fresh = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert fresh.stdout.split() == ["()", "False"], fresh.stdout + fresh.stderr
    with open_store(store_url) as store:
        assert isinstance(store, SqlRunStore)
        assert store.schema_steps == ()  # at HEAD: nothing to do
        job = CodeJob(code="def main(state):\n    return state\n", state_json='{"a": 1}')
        assert store.create(job, code_runtime="docker")
        claimed = store.claim(job.job_id, "w1")
        assert claimed is not None and claimed.code == job.code and claimed.state_json == '{"a": 1}'
    assert _versions(store_url) == [migrations.head()]


def test_the_migration_at_open_holds_the_fork_gate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: a fork while this process holds the write lock leaves the child a store
    that fails "database is locked" (sqlite.ForkGate): the migration at open is a store call
    like the others."""
    depths: list[int] = []
    upgrade = migrations.upgrade

    def watched(conn: Any, *args: Any) -> tuple[str, ...]:
        depths.append(getattr(sqlite.FORK_GATE._mine, "depth", 0))
        return upgrade(conn, *args)

    monkeypatch.setattr(migrations, "upgrade", watched)
    with open_store(f"sqlite:///{tmp_path / 'new.db'}") as store:
        assert isinstance(store, SqlRunStore) and store.schema_steps == migrations.revisions()
    assert depths and depths[0] >= 1


# --- stores made before migrations ----------------------------------------------------------


@pytest.mark.parametrize("capture_file", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_a_store_made_before_migrations_is_brought_to_head_and_reads_the_same(
    store_url: str, capture_file: Path
) -> None:
    capture = json.loads(capture_file.read_text())
    made_by_an_older_release(store_url, capture)
    with open_store(store_url) as store:
        assert isinstance(store, SqlRunStore)
        assert store.schema_steps == (migrations.BASELINE, *migrations.revisions()[1:])
        for job_id, old in capture["records"].items():
            rec = store.get(job_id)
            assert rec is not None
            new = _plain(rec)
            assert {k: new[k] for k in old} == old, job_id
            # fields the older release had no column for: their defaults ("": no tenant, no
            # workflow)
            assert all(new[k] in (None, [], False, 0, "") for k in new.keys() - old.keys()), new
            assert store.get_many([job_id])[job_id] == rec
        assert [e.model_dump(mode="json") for e in store.list_audit()] == capture["audit"]
        kept = capture["rows"].get("code_store")
        assert store.store_id == (kept[0]["value"] if kept else store.store_id)
        assert len(store.store_id) == 32
        # a queued job made before code_job_inputs still runs with its own code and state
        claimed = store.claim("j-queued", "w9")
        old_queued = capture["records"]["j-queued"]
        assert claimed is not None and claimed.code == old_queued["code"]
        assert claimed.state_json == old_queued["state_json"] == '{"n": 1}'
        done = CodeResult(
            job_id="j-queued",
            language="python",
            status=Status.SUCCEEDED,
            output={"n": 2},
            runtime="docker",
            code_runtime="docker",
        )
        assert store.finish(done, worker="w9")
    engine = _engine_of(store_url)
    try:
        with engine.connect() as conn:
            legacy = conn.execute(
                text("SELECT count(*) FROM code_jobs WHERE code <> '' OR state_json <> '{}'")
            ).scalar_one()
            tables = set(inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert legacy == 0, "the code and state were moved to code_job_inputs, once"
    assert migrations.VERSION_TABLE in tables and "alembic_version" not in tables
    assert _versions(store_url) == [migrations.head()]
    assert _schema_differences(store_url) == []
    with open_store(store_url) as again:
        assert isinstance(again, SqlRunStore) and again.schema_steps == ()
        rec = again.get("j-succeeded")
        assert rec is not None and _plain(rec) == {
            **capture["records"]["j-succeeded"],
            **{k: v for k, v in _plain(rec).items() if k not in capture["records"]["j-succeeded"]},
        }


# --- many processes at once ------------------------------------------------------------------


def _open_at_once(url: str, barrier: Any, out: Any) -> None:
    import alembic.operations  # noqa: F401

    import executor.store.migrations.baseline  # noqa: F401 - imports done before the race

    try:
        barrier.wait(timeout=120)
        with SqlRunStore(url) as store:
            out.put((store.schema_steps, store.store_id, None))
    except BaseException as e:  # report, the parent fails the test
        out.put(((), "", f"{type(e).__name__}: {e}"))


@pytest.mark.parametrize("made_by", ["nothing", "the release before migrations"])
def test_two_processes_opening_one_store_at_once_apply_the_migration_once(
    store_url: str, made_by: str
) -> None:
    expected: tuple[str, ...] = tuple(migrations.revisions())
    if made_by != "nothing":
        made_by_an_older_release(store_url, json.loads(TODAY.read_text()))
        expected = (migrations.BASELINE, *migrations.revisions()[1:])
    reports = in_processes(_open_at_once, [(store_url,), (store_url,)])
    assert [err for _, _, err in reports if err] == []
    assert sorted(steps for steps, _, _ in reports) == sorted([(), expected])
    assert len({store_id for _, store_id, _ in reports}) == 1
    assert _versions(store_url) == [migrations.head()]


# --- the next revision -----------------------------------------------------------------------


def test_revision_files_are_one_line_of_ids_ending_at_head() -> None:
    """The ids this release knows come from the file names (read at open without Alembic):
    they must be the ids Alembic reads from the files, one parent each."""
    script = migrations.scripts()
    assert script.get_heads() == [migrations.head()]
    parent = None
    for revision in migrations.revisions():
        got = script.get_revision(revision)
        assert got is not None and got.revision == revision
        assert got.down_revision == parent, f"{revision} must come after {parent}"
        parent = revision


def test_a_revision_from_the_template_runs_after_head_and_older_code_keeps_working(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    head = migrations.head()
    nxt = f"{int(head) + 1:04d}"
    location = tmp_path / "migrations"
    shutil.copytree(
        migrations.LOCATION, location, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    new = subprocess.run(
        [sys.executable, "-m", "executor.store.migrations", "new", "a note on each run"]
        + ["--location", str(location)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    path = location / "versions" / f"{nxt}_a_note_on_each_run.py"
    assert new.stdout.splitlines()[-1] == str(path)
    source = path.read_text()
    assert f'revision = "{nxt}"\ndown_revision = "{head}"\n' in source
    path.write_text(
        source.replace(
            "    pass\n",
            '    op.add_column("code_jobs", sa.Column("note", sa.Text, nullable=True))\n',
        )
    )

    with open_store(store_url) as store:  # this release: HEAD is head
        assert isinstance(store, SqlRunStore)
        before = CodeJob(code="def main(state):\n    return state\n")
        store.create(before, code_runtime="docker")
        with sqlite.no_fork_inside(), store.engine.begin() as conn:
            assert migrations.upgrade(conn, location) == (nxt,)
        with sqlite.no_fork_inside(), store.engine.begin() as conn:
            assert migrations.upgrade(conn, location) == ()
            assert "note" in {c["name"] for c in inspect(conn).get_columns("code_jobs")}
    assert _versions(store_url) == [nxt]

    # a worker of this release, started after a newer one upgraded the store
    with caplog.at_level(logging.INFO, logger="studio_code.store"):
        older = open_store(store_url)
    with older:
        assert isinstance(older, SqlRunStore) and older.schema_steps == ()
        assert f"newer than this release's {head}" in caplog.text
        job = CodeJob(code="def main(state):\n    return 1\n", state_json='{"b": 2}')
        assert older.create(job, code_runtime="docker")
        claimed = older.claim(job.job_id, "w1")
        assert claimed is not None and claimed.state_json == '{"b": 2}'
        result = CodeResult(
            job_id=job.job_id,
            language="python",
            status=Status.SUCCEEDED,
            output=1,
            runtime="docker",
            code_runtime="docker",
        )
        assert older.finish(result, worker="w1")
        rec = older.get(job.job_id)
        assert rec is not None and rec.output == 1 and rec.status is Status.SUCCEEDED
        assert older.get(before.job_id) is not None
    assert _versions(store_url) == [nxt]


# --- 0006: a run's concurrency keys ------------------------------------------------------


def test_a_store_at_0005_gets_the_keys_and_a_run_keeps_its_keys(
    store_url: str, tmp_path: Path
) -> None:
    """A store at the previous head (0005, made by this release's revisions up to it, with a
    queued run of that release in it) is brought to 0006; the run reads no keys, and a run
    created now keeps its tenant and workflow through every read a message sent again is
    made from (``list_queued``: the lost-message sweep; ``due_retries``: the retry sweep),
    its claim and ``get``, on both stores."""
    from sqlalchemy import insert

    location = tmp_path / "migrations"
    shutil.copytree(
        migrations.LOCATION,
        location,
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "0006_*.py"),
    )
    old = CodeJob(code="def main(state):\n    return 1\n", user="ann")
    values, inputs = SqlRunStore._new_rows(old, "docker")
    engine = _engine_of(store_url)
    try:
        with engine.begin() as conn:
            assert migrations.upgrade(conn, location)[-1] == "0005"
            assert not {"tenant", "workflow"} & {
                c["name"] for c in inspect(conn).get_columns("code_jobs")
            }
            # the row as the release before wrote it: no key columns
            del values["tenant"], values["workflow"]
            conn.execute(insert(schema.jobs).values(**values))
            conn.execute(insert(schema.job_inputs).values(**inputs))
    finally:
        engine.dispose()
    assert _versions(store_url) == ["0005"]

    with open_store(store_url) as store:
        assert isinstance(store, SqlRunStore) and store.schema_steps == ("0006",)
        before = store.get(old.job_id)
        assert before is not None and (before.tenant, before.workflow) == ("", "")
        assert before.problems == [] and before.to_job().tenant == ""

        keyed = CodeJob(code="def main(state):\n    return 2\n", user="bob", tenant="acme")
        keyed = keyed.model_copy(update={"workflow": "nightly:7"})
        plain = CodeJob(code="def main(state):\n    return 3\n", user="bob")
        assert store.create(keyed, code_runtime="docker")
        assert store.create(plain, code_runtime="docker")
        rec = store.get(keyed.job_id)
        assert rec is not None and (rec.tenant, rec.workflow) == ("acme", "nightly:7")
        assert rec.to_job().tenant == "acme" and rec.to_job().workflow == "nightly:7"
        assert store.get_many([keyed.job_id], inputs=False)[keyed.job_id] == rec.model_copy(
            update={"code": "", "state_json": "{}"}
        )
        queued = {q.job_id: q for q in store.list_queued(0)}
        assert (queued[keyed.job_id].tenant, queued[keyed.job_id].workflow) == (
            "acme",
            "nightly:7",
        )
        assert (queued[old.job_id].tenant, queued[old.job_id].workflow) == ("", "")
        with store.engine.begin() as conn:
            # no key: NULL, as the release before's rows; the keyed run as a retry now due
            raw = dict(
                conn.execute(
                    text("SELECT job_id, tenant FROM code_jobs WHERE workflow IS NULL")
                ).all()
            )
            assert raw == {old.job_id: None, plain.job_id: None}
            conn.execute(
                text("UPDATE code_jobs SET not_before_ts = 0 WHERE job_id = :j"),
                {"j": keyed.job_id},
            )
        due = store.due_retries()
        assert [(d.job_id, d.user, d.tenant, d.workflow) for d in due] == [
            (keyed.job_id, "bob", "acme", "nightly:7")
        ]
        claimed = store.claim(keyed.job_id, "w1")
        assert claimed is not None and (claimed.tenant, claimed.workflow) == ("acme", "nightly:7")

        # a row holding what is not a key (written by hand) reads as none, not as a problem
        with store.engine.begin() as conn:
            conn.execute(
                text("UPDATE code_jobs SET tenant = :t WHERE job_id = :j"),
                {"t": "not a key!", "j": plain.job_id},
            )
        odd = store.get(plain.job_id)
        assert odd is not None and odd.tenant == "" and odd.problems == []
        # and a job whose key is not one is never stored
        with pytest.raises(CodeInvalid):
            store.create(CodeJob(code="x", tenant="a b"), code_runtime="docker")
    assert _versions(store_url) == [migrations.head()]
