"""What a pool process lets go of as it starts: the sockets it inherited from the worker's
main process.

Celery's prefork pool forks each pool process from the main process, and forks again
whenever one is replaced (a SIGKILLed or crashed process, ``--max-tasks-per-child``). The
fork copies every open socket of the main process: its broker and Redis connections, the
run store's, the engine's, its /metrics listener. The pool process never uses them (its
Redis and engine clients are its own: redis-py starts a fresh pool in a new pid), but it
keeps them open for its whole life, so a connection the main process closes stays half
open (FIN-WAIT-2, CLOSE-WAIT) in the pool process, and each replacement holds a copy of
whatever the main process had then. Measured in a 20,000-job soak: a replaced pool
process held 14 of its main process's sockets, and a worker's tree grew 79 -> 138 fds
over 5,000 jobs with each pool-process kill.

``release_inherited_sockets`` closes, in a forked pool process only, every Python socket
object alive when it starts (nothing of its own exists yet): closing a copy in the child
leaves the main process's connection as it is (no shutdown is sent: the kernel ends a
connection only when its last descriptor is closed). The objects that held them (a
redis-py connection, a urllib3 one) see a closed socket if they are ever used in this
process, and connect again. The run store's PostgreSQL connections are libpq's own
descriptors, not Python sockets: not touched here.
"""

from __future__ import annotations

import gc
import logging
import os
import socket

log = logging.getLogger("studio_code")

#: the worker's main process (set in it, before any pool process is forked)
_main_pid: int | None = None


def note_main_process() -> None:
    """Called in the worker's main process before its pool starts."""
    global _main_pid
    _main_pid = os.getpid()


def release_inherited_sockets() -> int:
    """In a pool process forked from the noted main process: close the socket objects it
    inherited; returns how many. Anywhere else (the main process, ``--pool solo``): 0."""
    if _main_pid is None or os.getpid() == _main_pid:
        return 0
    closed = 0
    for obj in gc.get_objects():
        if isinstance(obj, socket.socket) and obj.fileno() >= 0:
            try:
                obj.close()
            except OSError:
                continue
            closed += 1
    log.debug(
        "pool process %d closed %d sockets inherited from its main process", os.getpid(), closed
    )
    return closed
