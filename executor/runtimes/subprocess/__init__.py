"""The subprocess runtime: rlimited child processes (``runtime``), pre-started runners
(``prestarted``), and what isolates them: a uid (``uids``), a cgroup (``cgroups``) or, under a
non-root server, namespaces (``namespaces``) per run."""
