"""What runs in a POOL process: the task, its cancel watch, live logs, the jobs it cannot run,
and the pool processes' side of the gate and of parked results."""
