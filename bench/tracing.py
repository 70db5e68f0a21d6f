"""Benchmark of OpenTelemetry tracing, per job, on vs off, in ONE run: two prefork workers
(pooled Docker sandboxes, 1 slot each) on their own redis-servers and SQLite stores, one
exporting its spans over OTLP/HTTP to a receiver on loopback (testkit/otlp.py), one
with no OTEL_* variable; the client in this process traces the "on" jobs (submit and wait
with a caller's traceparent) and not the "off" ones. Jobs alternate between the two, one at
a time, so both see the same machine noise. No assertions.

    python -m bench.tracing [--n 40]
"""

from __future__ import annotations

import argparse
import os
import secrets
import time
from typing import Any

from bench.common import bench_stack, end_stack, pct
from bench.queue import SETTLE_S, TRIVIAL
from executor import tracing
from testkit.otlp import Receiver


def sample(client: Any, traced: bool) -> tuple[float, float] | None:
    """One job, submit -> result in the caller: (e2e ms, e2e - executor duration_ms)."""
    tracing.set_enabled(traced)
    tp = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01" if traced else None
    t0 = time.perf_counter()
    job_id = client.submit(TRIVIAL, "python", {}, traceparent=tp)
    rec = client.wait(job_id, 60, submitted=True, traceparent=tp)
    took = (time.perf_counter() - t0) * 1000
    if rec.status != "succeeded":
        return None
    return took, took - (rec.duration_ms or 0)


class _Raw:
    exit_code, start_ms, run_ms, pooled = 0, 5.0, 10.0, True


def hooks_ms(traced: bool, result: Any, rec: Any) -> float:
    """Every hook one job passes, in this process (no queue, no sandbox): the API's submit
    and headers, the main process's queue_wait, the pool process's job, sandbox and store
    spans, the caller's wait; ms. Export is the SDK's background thread, as in a worker."""
    tracing.set_enabled(traced)
    tp = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01" if traced else None
    t0 = time.perf_counter()
    headers: dict[str, Any] = {}
    with tracing.submitting(tp, None):
        tracing.message_headers(headers, rec, "docker")
    if traced:  # the worker connects its received hook only when it traces
        tracing.queue_wait(headers, result.job_id, "code.run", True)
    with tracing.job(headers.get("traceparent"), None, result.job_id):
        tracing.sandbox(result, _Raw, time.time_ns())
        with tracing.result_store(result):
            pass
    with tracing.waiting(result.job_id, tp, None) as span:
        tracing.waited(span, rec)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=40)
    args = p.parse_args()

    receiver = Receiver().__enter__()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint  # this process's exporter
    stacks: list[Any] = []
    try:
        clients: dict[bool, Any] = {}
        for traced in (True, False):
            # a stack each; the workers' environment has no OTEL_ but the traced one's
            stack = bench_stack(
                "tracing-on" if traced else "tracing-off",
                code_concurrency=1,
                queue_test_slots=0,
                env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint} if traced else {},
            )
            stacks.append(stack)
            stack.start_worker(concurrency=1, stop_timeout=30)
            clients[traced] = stack.client
        for _ in range(5):  # warm-up: the pool process, the engine, the store, the exporter
            for traced, client in clients.items():
                sample(client, traced)
        out: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        while min(len(v) for v in out.values()) < args.n:
            for traced, client in clients.items():
                time.sleep(SETTLE_S)
                got = sample(client, traced)
                if got is not None:
                    out[traced].append(got)
        # the hooks alone, in this process, interleaved (a job's own CPU on its path)
        job_id = clients[True].submit(TRIVIAL, "python", {})
        rec = clients[True].wait(job_id, 60, submitted=True)
        result = rec.to_result()
        hooks: dict[bool, list[float]] = {True: [], False: []}
        # 250 traced jobs: 1,750 spans, under the SDK's queue of 2,048 between two exports
        for i in range(250):
            for traced in (True, False):
                took = hooks_ms(traced, result, rec)
                if i >= 50:  # warm-up
                    hooks[traced].append(took)
        time.sleep(6)  # the workers' batch exporter sends every 5 s (OTEL_BSP_SCHEDULE_DELAY)
        tracing.set_enabled(None)

        def ms(xs: list[float], q: float) -> str:
            return f"{pct(xs, q):.1f} ms"

        on_e2e, on_ov = [a for a, _ in out[True]], [b for _, b in out[True]]
        off_e2e, off_ov = [a for a, _ in out[False]], [b for _, b in out[False]]
        print(
            f"# bench.tracing: n={args.n} per side, alternating one at a time, {SETTLE_S} s "
            "apart; 1 prefork worker each (1 slot, pooled Docker sandboxes); 'on' exports to "
            "an OTLP/HTTP receiver on loopback"
        )
        print("| what | tracing on p50 / p95 | off p50 / p95 | delta at p50 |")
        print("|---|---|---|---|")
        print(
            f"| pooled trivial node, submit→result in the caller | {ms(on_e2e, 50)} / "
            f"{ms(on_e2e, 95)} | {ms(off_e2e, 50)} / {ms(off_e2e, 95)} | "
            f"{pct(on_e2e, 50) - pct(off_e2e, 50):+.1f} ms |"
        )
        print(
            f"| … minus the executor's duration_ms (the queue's part) | {ms(on_ov, 50)} / "
            f"{ms(on_ov, 95)} | {ms(off_ov, 50)} / {ms(off_ov, 95)} | "
            f"{pct(on_ov, 50) - pct(off_ov, 50):+.1f} ms |"
        )
        on_h, off_h = hooks[True], hooks[False]
        print(
            f"| the hooks of one job alone, in one process (submit, headers, queue_wait, job, "
            f"sandbox_start, code_run, result_store, wait; n={len(on_h)}) | "
            f"{pct(on_h, 50) * 1000:.0f} µs / {pct(on_h, 95) * 1000:.0f} µs | "
            f"{pct(off_h, 50) * 1000:.1f} µs / {pct(off_h, 95) * 1000:.1f} µs | "
            f"{(pct(on_h, 50) - pct(off_h, 50)) * 1000:+.0f} µs |"
        )
        names: dict[str, int] = {}
        for s in receiver.spans:
            names[s.name] = names.get(s.name, 0) + 1
        print(f"\nspans received by the receiver ({receiver.requests} OTLP requests): {names}")
    finally:
        for stack in stacks:
            end_stack(stack)
        receiver.__exit__(None, None, None)


if __name__ == "__main__":
    main()
