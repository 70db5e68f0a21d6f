"""What runs in the worker's MAIN process as threads: the janitor (reaper, revoke backstop,
sweep of queued jobs, retention), the heartbeat, the gate's probe, the parked-result flush and
the broker watch (each consumer's round trips to Redis, the watchdog)."""
