"""Writes ``<date>-<commit>.json`` here: a run store as the code at ``commit`` made it, for
tests/test_store_migrations.py. Run it with that commit's ``executor`` first on the path:

    git archive 6c02a8e executor | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python tests/data/store_schemas/capture.py 6c02a8e 2026-11-30

The file holds the DDL its ``create_all`` ran (compiled for SQLite and PostgreSQL), the rows
of every table after that code created, claimed, finished and cancelled a few jobs (read
back raw, as stored), and the records its own ``get`` returned for them: a newer release
that reads these rows must return the same records.
"""

from __future__ import annotations

import json
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

from executor.errors import ErrorCode
from executor.models import CodeErrorInfo, CodeJob, CodeResult, Status, TraceRow
from executor.store import sql

try:
    from executor.store.schema import metadata
except ImportError:  # a release before sql.py was split (issue 32)
    metadata = sql.metadata  # type: ignore[attr-defined]

HERE = Path(__file__).resolve().parent
PYTHON_CODE = "def main(state):\n    return {'n': state['n'] + 1}\n"


def ddl(dialect: Any) -> list[str]:
    out = []
    for table in metadata.sorted_tables:
        out.append(str(CreateTable(table).compile(dialect=dialect)).strip())
        out += [
            str(CreateIndex(i).compile(dialect=dialect)).strip()
            for i in sorted(table.indexes, key=lambda i: i.name or "")
        ]
    return out


def job(job_id: str, **kw: Any) -> CodeJob:
    if "memory_bytes" in CodeJob.model_fields:  # asked for by a node, once releases had it
        kw.setdefault("memory_bytes", 64 * 1024**2)
        kw.setdefault("cpus", 0.5)
    return CodeJob(job_id=job_id, code=PYTHON_CODE, state_json='{"n": 1}', **kw)


def result(job_id: str, status: Status, **kw: Any) -> CodeResult:
    return CodeResult(
        job_id=job_id,
        language="python",
        status=status,
        runtime="docker",
        code_runtime="docker",
        duration_ms=12.5,
        **kw,
    )


def write(store: sql.SqlRunStore) -> list[str]:
    """The same calls for every commit; returns the job ids."""
    store.create(job("j-queued", user="ann", timeout_s=20.0), code_runtime="docker")
    store.create(job("j-running", user="bob"), code_runtime="docker")
    store.claim("j-running", "w1@host:1")
    store.create(job("j-succeeded", user="ann", kind="test"), code_runtime="docker")
    store.claim("j-succeeded", "w1@host:1")
    store.finish(
        result(
            "j-succeeded",
            Status.SUCCEEDED,
            output={"n": 2, "text": "é ✓"},
            logs="printed\n",
            exit_code=0,
            warnings=["a warning"],
            trace=[TraceRow(step="run", runtime="docker", duration_ms=12.5, detail="ok")],
        ),
        worker="w1@host:1",
    )
    store.create(job("j-failed"), code_runtime="docker")
    store.claim("j-failed", "w2@host:2")
    store.finish(
        result(
            "j-failed",
            Status.FAILED,
            error=CodeErrorInfo(code=ErrorCode.CODE_ERROR, message="ValueError: no"),
            logs="Traceback ...\n",
            logs_truncated=True,
            exit_code=1,
        ),
        worker="w2@host:2",
    )
    store.create(job("j-cancelled"), code_runtime="subprocess")
    store.request_cancel("j-cancelled")
    store.audit("system.capture", {"host": "h", "n": 1}, actor="capture")
    return ["j-queued", "j-running", "j-succeeded", "j-failed", "j-cancelled"]


def plain(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def main() -> None:
    commit, date = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as tmp:
        store = sql.SqlRunStore(f"sqlite:///{tmp}/s.db")
        job_ids = write(store)
        with store.engine.connect() as conn:
            rows = {
                t.name: [
                    {k: plain(v) for k, v in r._mapping.items()} for r in conn.execute(select(t))
                ]
                for t in metadata.sorted_tables
            }
        records = {j: store.get(j).model_dump(mode="json") for j in job_ids}
        audit = [e.model_dump(mode="json") for e in store.list_audit()]
        store.close()
    out = {
        "commit": commit,
        "ddl": {"sqlite": ddl(sqlite.dialect()), "postgresql": ddl(postgresql.dialect())},
        "rows": rows,
        "records": records,
        "audit": audit,
    }
    (HERE / f"{date}-{commit}.json").write_text(
        json.dumps(out, indent=1, ensure_ascii=False) + "\n"
    )


if __name__ == "__main__":
    main()
