"""Memory a worker's main process shares with its pool processes: the one protocol between
them (the gate, worker.gate; the pre-import figures, worker.preimport).

A page is made at import, in the main process, before the pool forks: an anonymous mmap is
MAP_SHARED, so every pool process (a replaced one too) sees the same memory. It is cut into
``slots`` slots of ``slot_bytes``; each slot is written by one process only (its owner: a
pool process's index, or the main process for its own fields) and read by any:

    [sequence: u64, odd while written, 0 never][length: u32][payload]

A writer makes the sequence odd, writes the payload, makes it even again (a seqlock). A
reader takes a payload only when the sequence was even and the same before and after its
copy, so it never takes half a write; it retries a few times while a write is under way and
then gives up (None). No lock is shared: a writer killed mid-write leaves its slot odd (read
as None) until it, or its successor, writes it again. Nothing is sent anywhere: a read is a
copy of a few bytes.
"""

from __future__ import annotations

import mmap
import struct
import threading
import time

_HEAD = struct.Struct("<QI")
_SEQ, _LEN = struct.Struct("<Q"), struct.Struct("<I")
#: a payload of one double (``write_float``, ``read_float``)
_FLOAT = struct.Struct("<d")
READ_TRIES = 20


class SharedPage:
    """``slots`` slots of ``slot_bytes`` each (the head included), shared across a fork."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        if slot_bytes <= _HEAD.size:
            raise ValueError(f"a slot holds its {_HEAD.size}-byte head and a payload")
        self.slots = slots
        self.slot_bytes = slot_bytes
        size = max(mmap.PAGESIZE, slots * slot_bytes)
        self._mem = mmap.mmap(-1, size)
        #: a process's threads may write one slot at once (a pool's two reporters)
        self._writing = threading.Lock()

    def capacity(self) -> int:
        """The longest payload a slot holds."""
        return self.slot_bytes - _HEAD.size

    def write(self, index: int, payload: bytes) -> bool:
        """``payload`` into slot ``index``: False (nothing written) when there is no such
        slot or it does not fit."""
        if not 0 <= index < self.slots or len(payload) > self.capacity():
            return False
        at = index * self.slot_bytes
        with self._writing:
            seq = _HEAD.unpack_from(self._mem, at)[0]
            begin = seq + 1 if seq % 2 == 0 else seq + 2  # odd: being written
            # Each field copied in as bytes, never with struct.pack_into: CPython's pack_into
            # zero-fills the whole struct before it writes the fields, so a reader could
            # take (an even sequence, length 0) in between and return an empty payload.
            self._mem[at : at + _SEQ.size] = _SEQ.pack(begin)
            self._mem[at + _SEQ.size : at + _HEAD.size] = _LEN.pack(len(payload))
            self._mem[at + _HEAD.size : at + _HEAD.size + len(payload)] = payload
            self._mem[at : at + _SEQ.size] = _SEQ.pack(begin + 1)
        return True

    def read(self, index: int) -> bytes | None:
        """Slot ``index``'s last whole payload; None when never written, or while a write
        is under way (READ_TRIES a millisecond apart), or a writer died mid-write."""
        at = index * self.slot_bytes
        for attempt in range(READ_TRIES):
            seq, size = _HEAD.unpack_from(self._mem, at)
            if seq == 0:
                return None
            if seq % 2 == 0 and size <= self.capacity():
                data = bytes(self._mem[at + _HEAD.size : at + _HEAD.size + size])
                if _HEAD.unpack_from(self._mem, at)[0] == seq:
                    return data
            if attempt < READ_TRIES - 1:
                time.sleep(0.001)
        return None

    def untouched(self, first: int, count: int) -> bool:
        """Slots ``first`` .. ``first + count - 1`` were never written (every byte still
        zero): one comparison instead of ``count`` reads."""
        at, end = first * self.slot_bytes, (first + count) * self.slot_bytes
        return self._mem[at:end] == bytes(end - at)

    def write_float(self, index: int, value: float) -> None:
        self.write(index, _FLOAT.pack(value))

    def read_float(self, index: int) -> float:
        """Slot ``index`` as a double: 0.0 when never written (or unreadable now)."""
        data = self.read(index)
        return _FLOAT.unpack(data)[0] if data is not None and len(data) == _FLOAT.size else 0.0
