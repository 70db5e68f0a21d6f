"""The page a worker's main process shares with its pool processes (worker.shared_page):
written in one process, read whole in another across a real fork, never half a write."""

from __future__ import annotations

import os
import signal
import time

from worker.shared_page import SharedPage


def test_a_reader_in_another_process_never_takes_half_a_write() -> None:
    # 1 MiB payloads: a copy takes long enough that, without the sequence check, the
    # reader would take halves of two writes many times a second
    page = SharedPage(4, 1 << 20)
    payloads = [bytes([n]) * page.capacity() for n in (1, 2)]  # two full, different slots
    page.write(1, payloads[0])
    child = os.fork()
    if child == 0:  # the writer: both payloads in turn, a write every millisecond or so
        try:
            n = 0
            while True:
                page.write(1, payloads[n % 2])
                n += 1
                time.sleep(0.001)  # a reader that never gets between two writes reads None
        finally:
            os._exit(0)
    try:
        seen = {payloads[0]: 0, payloads[1]: 0, None: 0}
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            got = page.read(1)
            assert got in seen, f"a torn read: {len(set(got or b''))} byte values"
            seen[got] += 1
        # the reader saw the other process's writes, both of them, each whole
        assert seen[payloads[0]] >= 3 and seen[payloads[1]] >= 3, seen
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    assert page.read(0) is None  # a slot never written
    assert page.read_float(3) == 0.0


def test_a_payload_that_does_not_fit_or_no_slot_is_refused() -> None:
    page = SharedPage(2, 64)
    assert not page.write(0, b"x" * (page.capacity() + 1))
    assert not page.write(2, b"x") and not page.write(-1, b"x")
    assert page.read(0) is None
    assert page.write(0, b"x" * page.capacity()) and page.read(0) == b"x" * page.capacity()
    page.write_float(1, 12.5)
    assert page.read_float(1) == 12.5


def test_a_writer_killed_mid_write_leaves_its_slot_unread_until_written_again() -> None:
    import struct

    page = SharedPage(1, 64)
    page.write(0, b"old")
    struct.pack_into("<Q", page._mem, 0, 3)  # as a writer killed between its two heads
    assert page.read(0) is None
    assert page.write(0, b"new") and page.read(0) == b"new"


def test_untouched_slots_and_the_gates_last_report_across_a_fork() -> None:
    # the pool process's check before each job: slots never written are one comparison,
    # and a report written in another process (a real fork) is seen
    from worker import gate

    # the gate's page is this process's: an earlier test of another module in the same
    # (xdist) process may have reported on it (a fresh-clone CI run saw RUN_STORE's slot
    # set), so it starts as a new worker's page
    gate._page._mem[:] = bytes(len(gate._page._mem))
    page = SharedPage(8, 32)
    assert page.untouched(0, 8)
    page.write_float(5, 1.5)
    assert page.untouched(0, 5) and not page.untouched(0, 8) and page.untouched(6, 2)
    assert gate.last_report(gate.RUNTIME) == 0.0 and not gate.pending_in_child()
    child = os.fork()
    if child == 0:
        try:
            gate.report(gate.RUNTIME, "the engine is away (a test)", index=7)
        finally:
            os._exit(0)
    os.waitpid(child, 0)
    try:
        assert gate.last_report(gate.RUNTIME) > 0.0 and gate.last_report(gate.RUN_STORE) == 0.0
        assert gate.pending_in_child()
    finally:
        gate._page._mem[:] = bytes(len(gate._page._mem))  # as a new worker's page
