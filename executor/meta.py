"""Runtime meta: what GET /api/meta/runtime returns and the admin's Code nodes card shows."""

from __future__ import annotations

import os
from typing import Any

from executor.package_lists import packages_warning, shown_packages
from executor.runtimes.base import MetaSection
from executor.runtimes.constants import TMPFS_SIZE
from executor.service import Executor
from executor.settings import KNOWN_LANGUAGES, sandbox_ids


def runtime_meta(executor: Executor, *, fresh: bool = False) -> dict[str, Any]:
    """Enabled, runtime, each language's readiness (proven by its test program) and
    packages, the limits in force and the sandbox's uid:gid. What is one runtime's own
    (its seccomp profile, its isolation, its pool's pre-import memory...) the runtime says
    (``Runtime.meta_section``): nothing here asks which runtime it is."""
    s = executor.settings
    runtime = executor.runtime
    reason = executor.disabled_reason()
    languages = []
    for name in KNOWN_LANGUAGES:
        offered = name in s.languages
        entry: dict[str, Any] = {"name": name, "offered": offered}
        if offered:
            lang = executor.language(name)
            ready = executor.readiness(lang, fresh=fresh)
            # the image's own list at its versions (its studio.packages label, modules.json)
            found = executor.image_facts(lang).packages()
            entry.update(
                ready=ready.ready,
                reason=ready.reason,
                image=runtime.image(lang) if runtime is not None else None,
                packages=shown_packages(s, name, found),
                versions=dict(found.versions) if found is not None else {},
                packages_warning=packages_warning(s, name, found),
            )
        else:
            entry.update(
                ready=False,
                reason=f"{name} is not in STUDIO_CODE_LANGUAGES.",
                image=None,
                packages=[],
                versions={},
                packages_warning=None,
            )
        languages.append(entry)
    uid, gid = sandbox_ids()
    posture = runtime.engine_posture(fresh=fresh) if runtime is not None else None
    section = (
        runtime.meta_section(posture, fresh=fresh, probe=executor.run)
        if runtime is not None
        else MetaSection()
    )
    warnings = [*(runtime.warnings if runtime is not None else ()), *section.warnings]
    engine_warning = posture.warning() if posture is not None else None
    if engine_warning is not None:
        warnings.append(engine_warning)
    from executor.store.sql import describe_url  # SQLAlchemy's URL parser; no driver

    return {
        # the run store this process uses (no password); the API adds its id
        "store": {"url": describe_url(s.sqlalchemy_url), "id": None},
        "enabled": reason is None,
        "reason": reason,
        "code_runtime": s.code_runtime,
        "isolated": runtime is not None and runtime.isolated,
        "languages": languages,
        "limits": {
            "memory": s.code_memory,
            "memory_bytes": s.memory_bytes,
            "cpus": s.code_cpus,
            "pids": s.code_pids,
            "max_seconds": s.code_max_seconds,
            "concurrency": s.code_concurrency,
            "test_per_minute": s.code_test_per_minute,
            "tmp_size": TMPFS_SIZE,
            "log_max_bytes": s.code_log_max_bytes,
            "output_max_bytes": s.code_output_max_bytes,
        },
        "sandbox_user": {
            "uid": uid,
            "gid": gid,
            "note": (
                section.root_note
                if os.getuid() == 0
                else "Sandboxes run as the server's own uid and gid."
            ),
        },
        "seccomp": section.seccomp,
        "warnings": warnings,
        # The Docker engine under the sandboxes and its known escapes, as this process sees
        # it (None: no engine here, e.g. the API under Compose has no socket); the API adds
        # each worker's own, from its heartbeat (docs/security.md, "The engine posture")
        "engine": {
            "this_process": posture.model_dump(mode="json") if posture is not None else None,
            "refuse_vulnerable": s.code_engine_refuse_vulnerable,
            "workers": None,
            # asked fresh (studio-code meta): what the kernel says from inside one sandbox
            # (no_new_privs, a seccomp filter, capabilities, uid); None otherwise
            "sandbox": section.sandbox,
        },
        "subprocess_isolation": section.isolation,
        # Pre-started sandboxes: the setting, and this process's own pool when it keeps one
        # (a worker's pool process; the API's process starts sandboxes cold).
        "pool": {
            "prewarm": s.code_prewarm,
            # what a pre-started sandbox imports while it waits (STUDIO_CODE_PREIMPORT)
            "preimport": s.code_preimport or None,
            # per language: what an idle pre-started sandbox holds once its pre-imports are
            # done and without them, measured by the host from its cgroup (null until the
            # pool of this process measured it; counted against the sandbox's own limit)
            "preimport_memory": section.preimport_memory,
            "max_idle_s": s.code_prewarm_max_idle_s,
            "this_process": runtime.pool_stats() if runtime is not None else None,
        },
    }
