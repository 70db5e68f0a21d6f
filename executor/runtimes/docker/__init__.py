"""The docker runtime: the process's client of the engine (``client``), a new locked-down
container per call (``runtime``), pre-started ones (``pool``), the attach stream of one run
(``attached``), the sandbox's seccomp profile (``seccomp``), the engine's posture
(``engine``, ``escapes``) and the socket guard (``sockguard``)."""

from executor.runtimes.docker.client import import_sdk

import_sdk()  # before any module of this package imports it
