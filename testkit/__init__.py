"""The real services tests and benches start and stop, each a process (or a thread) of their
own on loopback: one module per service, imported by tests/ and bench/ alike (bench/
imports nothing from tests/).

* ``processes``: a process by pid (``Service``), ``wait_for``, ``require``, ``needs``;
* ``reaper``: what a process started ends with it, on SIGTERM (``stop_on_sigterm``) or
  SIGKILL (a watchdog process stops what it ``own``s);
* ``redis``, ``sentinel``: a redis-server; a primary, a replica and three sentinels;
* ``worker``, ``api``, ``sockguard``: Celery workers, ``studio-code serve``, the socket guard;
* ``postgres``: the shared PostgreSQL (a schema of one's own) and a cluster of one's own;
* ``engine``: a dockerd of one's own; ``sandboxes``: what a worker leaves on an engine;
* ``relay``: loopback relays that can be cut; ``otlp``: an OTLP/HTTP receiver;
* ``imports``: what a fresh interpreter loads after a script (``loaded_after``);
* ``stack``: Redis + run store + workers + API of one test or bench (``Stack``).

Nothing here is imported by the product (executor/, worker/, api_client/)."""
