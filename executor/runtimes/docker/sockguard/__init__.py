"""The socket guard: what a worker may ask of the Docker engine (``studio-code sockguard``).

Whoever reaches the Docker socket is root on the host. A worker needs only a few of the
engine's calls, so the guard listens on a unix socket of its own and gives the real socket
only those; everything else gets HTTP 403 with a JSON ``{"message": "sockguard: ..."}`` body
(the Docker SDK shows it as the error) and a WARNING in the guard's log naming what was
refused.

Rebuilt, never forwarded: the guard never passes the client's bytes on. It reads each
request strictly, decides on what it read, and sends the engine a request it writes itself;
the only client bytes that reach the engine as written are a create's validated body
(re-serialised JSON) and, after an allowed attach is upgraded, the stream. Five parts, each
small enough to read whole:

* ``grammar``: a request's bytes read strictly (HTTP 400 for any head the engine might read
  otherwise), no I/O;
* ``routes``: ONE table of the calls passed on (``ROUTES``, printed by ``studio-code
  sockguard --print-policy`` and held equal to docs/security.md) and the pure ``decide``;
* ``create``: the create policy (a sandbox exactly as ``sandbox_policy`` makes it), no I/O;
* ``upstream``: the call written to the engine, its answer read whole and framed again, the
  attach stream;
* ``server``: the event loop, its bounds (connections in total and per peer, a request's
  time, an idle connection's), the container lookups.

The labels, the name prefix and the paths are the runtime's own
(executor/sandbox_names.py). What it does not stop: a client of the guard can
attach to, start, wait on, rename and remove any labelled sandbox on this engine, other
jobs' included. docs/security.md "The socket guard".
"""

from executor.runtimes.docker.sockguard.create import MIN_NANO_CPUS, Policy, parent_shape
from executor.runtimes.docker.sockguard.grammar import Refused, Request
from executor.runtimes.docker.sockguard.routes import ROUTES, Route, decide, policy_table
from executor.runtimes.docker.sockguard.server import Bounds, SockGuard, raise_nofile

__all__ = [
    "MIN_NANO_CPUS",
    "ROUTES",
    "Bounds",
    "Policy",
    "Refused",
    "Request",
    "Route",
    "SockGuard",
    "decide",
    "parent_shape",
    "policy_table",
    "raise_nofile",
]
