"""What runs in the worker's MAIN process as threads: the janitor (reaper, revoke backstop,
sweep of queued jobs, retention), the heartbeat, the gate's probe and the parked-result flush."""
