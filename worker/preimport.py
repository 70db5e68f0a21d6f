"""What the pool processes measured of their pre-started sandboxes (the memory their
pre-imports hold, executor/runtimes/docker/preimport_memory.py), handed to the worker's MAIN
process, which announces it in its heartbeat; and how the API sums up the workers'.

* **Pool process -> main** (``report``, ``announcement``): on the worker's shared page
  (worker.shared_page, the one protocol between its processes): one slot per pool process
  index (Celery's, 0..N-1; a process replaced gets its predecessor's index), written by that
  process only, as JSON. The pool hands its ``stats()`` (with ``preimport_memory``) to its
  observer at each change and every couple of seconds; the observer calls ``report``.
  Nothing is sent while nothing changed, no lock is shared, no Redis round trip is added.
* **Main -> Redis** (``announcement``): read by the heartbeat at each beat (a field of its
  entry, worker/upkeep/heartbeat.py), with what the worker's settings say: whether it keeps
  pre-started sandboxes at all, and what they pre-import.
* **Redis -> the API** (``summary``): meta's ``preimport``: per language, the median and the
  largest figure of the live workers that measured it, how many they are, and each
  worker's announcement. Where nothing is pre-imported (no pre-started sandboxes, an empty
  STUDIO_CODE_PREIMPORT, a language without pre-import) it says so in ``note``, with null
  figures rather than 0.
"""

from __future__ import annotations

import json
import logging
import statistics
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from executor.languages import get_language
from executor.runtimes.constants import PREIMPORT_NOT_YET
from worker.shared_page import SharedPage

if TYPE_CHECKING:
    from executor.settings import Settings
    from worker.registry import WorkerInfo

log = logging.getLogger("studio_code.worker")

#: pool process indexes with a slot (a larger index is not announced; said once in its log)
SLOTS = 128
SLOT_BYTES = 2048
_page = SharedPage(SLOTS, SLOT_BYTES)
#: this process's last report (a pool process writes only what changed)
_last: bytes | None = None

#: the figures of one language a worker announces, summed up across workers
FIGURES = ("idle_memory_bytes", "without_preimport_bytes", "preimport_bytes")


# --- a pool process ------------------------------------------------------------------------


def _index() -> int:
    from celery.utils.log import current_process_index

    return current_process_index(base=0) or 0  # None: not a pool process (tests, solo)


def report(stats: dict[str, Any] | None, index: int | None = None) -> None:
    """In a pool process: its pool's ``stats()`` (its ``preimport_memory``) into its slot
    (``index``: its pool process index, Celery's by default)."""
    try:
        _write(stats, index)
    except Exception as e:  # noqa: BLE001 - a figure is never worth a pool
        log.debug("pre-import memory not reported: %s", e)


def _write(stats: dict[str, Any] | None, index: int | None) -> None:
    global _last
    figures = (stats or {}).get("preimport_memory")
    if figures is None:
        return  # a pool that measures nothing (the subprocess runtime's)
    data = json.dumps(figures, sort_keys=True).encode()
    if data == _last:
        return
    index = _index() if index is None else index
    if not _page.write(index, data):
        if _last is None or _last != b"":
            log.warning("pool process %d: pre-import memory not announced (no slot)", index)
        _last = b""
        return
    _last = data


# --- the main process: what its heartbeat announces ------------------------------------------


def _slot(index: int) -> dict[str, Any] | None:
    data = _page.read(index)
    if data is None:
        return None
    try:
        got = json.loads(data)
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def reports() -> list[dict[str, Any]]:
    """What each pool process reported last: per language, its pool's figures."""
    return [got for i in range(SLOTS) if (got := _slot(i)) is not None]


def announcement(settings: Settings) -> dict[str, Any]:
    """The heartbeat's ``preimport``: whether this worker keeps pre-started sandboxes
    (``pooled``: a runtime that measures them, ``Runtime.preimport_measured``, with
    STUDIO_CODE_PREWARM > 0) and, per offered language, what they pre-import and hold when
    idle: the largest figure its pool processes measured (their sandboxes are made alike),
    and how many measured it."""
    from executor.service import runtime_class

    runtime = runtime_class(settings)
    pooled = runtime is not None and runtime.preimport_measured and settings.code_prewarm > 0
    languages: dict[str, Any] = {}
    if pooled:
        got = reports()
        for name in settings.languages:
            mine = [r[name] for r in got if isinstance(r.get(name), dict)]
            done = [m for m in mine if m.get("idle_memory_bytes")]
            if done:
                best = max(done, key=lambda m: int(m["idle_memory_bytes"]))
                entry = {**best, "processes": len(done)}
            else:  # none yet, or its processes cannot read the cgroups (the sentence says)
                entry = {
                    "idle_memory_bytes": None,
                    "without_preimport_bytes": None,
                    "memory_limit_bytes": None,
                    "source": mine[0]["source"] if mine else PREIMPORT_NOT_YET,
                    "processes": 0,
                }
            modules = get_language(name).preimport_modules(settings)
            languages[name] = {"modules": modules, **entry}
    return {"pooled": pooled, "languages": languages}


# --- the API: the live workers' announcements, summed up -------------------------------------

NO_WORKER = (
    "no live worker announces its pre-started sandboxes (none is running, or it predates "
    "this report): nothing is known to be pre-imported"
)


def _no_pool(language: str) -> str:
    return (
        f"nothing is pre-imported: no live worker keeps pre-started {language} sandboxes "
        f"(STUDIO_CODE_PREWARM=0, not the docker runtime, or {language} not in its "
        "STUDIO_CODE_LANGUAGES), so each run starts cold and imports what it needs"
    )


def _nothing(language: str) -> str:
    why = (
        "STUDIO_CODE_PREIMPORT is empty on the workers"
        if language == "python"
        else f"{language} sandboxes have no pre-import"
    )
    return (
        f"nothing is pre-imported: the workers' pre-started {language} sandboxes import "
        f"nothing while they wait ({why})"
    )


def _spread(values: list[int]) -> dict[str, int] | None:
    return {"median": int(statistics.median(values)), "max": max(values)} if values else None


def summary(live: dict[str, list[WorkerInfo]], languages: Iterable[str]) -> dict[str, Any]:
    """Meta's ``preimport`` from the live workers (``WorkerRegistry.live``): per language,
    the figures of the workers that measured it (median and largest), how many they are,
    the modules, and a ``note`` when there is no figure to show (saying why); ``workers``:
    each worker's announcement (null: it announces none); ``error``: null (the API's
    sentence when Redis cannot be read)."""
    workers: dict[str, dict[str, Any] | None] = {}
    for infos in live.values():
        for info in infos:
            workers[info.nodename] = info.preimport
    announced = [w for w in workers.values() if w is not None]
    pools = [w for w in announced if w.get("pooled")]
    out: dict[str, Any] = {}
    for name in languages:
        # Redis's cjson writes an empty list back as {}: ``or []``
        entries = [e for w in pools if isinstance(e := (w.get("languages") or {}).get(name), dict)]
        modules: list[str] = []
        for e in entries:
            modules += [m for m in e.get("modules") or [] if m not in modules]
        done = [e for e in entries if e.get("idle_memory_bytes")]
        figures: dict[str, list[int]] = {k: [] for k in FIGURES}
        for e in done:
            idle, without = e["idle_memory_bytes"], e.get("without_preimport_bytes")
            figures["idle_memory_bytes"].append(int(idle))
            if without:
                figures["without_preimport_bytes"].append(int(without))
                if e.get("modules"):
                    figures["preimport_bytes"].append(int(idle) - int(without))
        limits = [int(e["memory_limit_bytes"]) for e in done if e.get("memory_limit_bytes")]
        if not announced:
            note: str | None = NO_WORKER
        elif not entries:
            note = _no_pool(name)
        elif not modules:
            note = _nothing(name)
        elif not done:
            note = str(entries[0].get("source") or PREIMPORT_NOT_YET)
        else:
            note = None
        out[name] = {
            "modules": modules,
            "workers": len(done),
            **{k: _spread(v) for k, v in figures.items()},
            "memory_limit_bytes": max(limits) if limits else None,
            "note": note,
        }
    return {"languages": out, "workers": workers, "error": None}
