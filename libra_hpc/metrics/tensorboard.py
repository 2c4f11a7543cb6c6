"""TensorBoard scalars without tensorboard or tensorflow installed.

A TensorBoard event file is a sequence of TFRecords, each::

    uint64 length (little-endian) | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)

whose data is a serialised ``tensorflow.Event`` protobuf. The first record carries
``file_version = "brain.Event:2"``; each later one a ``Summary`` with one scalar value.
The few protobuf fields needed are encoded by hand:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

Point ``tensorboard --logdir`` at the run's log folder to browse the file.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any, BinaryIO, Mapping


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC32C_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum TFRecord uses."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits plus a constant, so a CRC stored
    inside checksummed data does not checksum to itself."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """``data`` in the TFRecord framing."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# ---------------------------------------------------------------- protobuf by hand

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


def _varint(n: int) -> bytes:
    """Base-128 varint; negative int64 values as their 64-bit two's complement."""
    n &= 0xFFFFFFFFFFFFFFFF
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _bytes_field(field: int, payload: bytes) -> bytes:
    return _key(field, _BYTES) + _varint(len(payload)) + payload


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """A serialised Event holding one scalar."""
    value_msg = _bytes_field(1, tag.encode("utf-8")) + _key(2, _FIXED32) + struct.pack("<f", value)
    summary = _bytes_field(1, value_msg)
    return (_key(1, _FIXED64) + struct.pack("<d", wall_time) + _key(2, _VARINT) + _varint(step)
            + _bytes_field(5, summary))


def version_event(wall_time: float) -> bytes:
    """The serialised Event that opens every event file."""
    return _key(1, _FIXED64) + struct.pack("<d", wall_time) + _bytes_field(3, b"brain.Event:2")


# ---------------------------------------------------------------- writer


def _flatten(mapping: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Numbers of ``mapping`` by tag; nested dicts (gpus per role, queue depth per bucket)
    become ``prefix/key/subkey``; strings, None and bools are skipped."""
    out: dict[str, float] = {}
    for key, value in mapping.items():
        tag = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, tag))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out


class TensorBoardWriter:
    """Appends scalars to ``folder/events.out.tfevents.<unix time>.<hostname>``.

    Records are buffered; ``flush`` (or ``close``) makes them visible to TensorBoard.
    """

    def __init__(self, folder: Path, clock=time.time):
        self._clock = clock
        now = clock()
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
        self._file: BinaryIO = self.path.open("ab")
        self._file.write(tfrecord(version_event(now)))

    def scalar(self, tag: str, value: float, step: int, wall_time: float | None = None) -> None:
        """One point of the ``tag`` curve at ``step``; ``wall_time`` in Unix seconds, now
        by default."""
        wall = self._clock() if wall_time is None else wall_time
        self._file.write(tfrecord(scalar_event(tag, float(value), int(step), float(wall))))

    def scalars(self, step: int, mapping: Mapping[str, Any], prefix: str = "") -> int:
        """Every number of ``mapping`` (a metrics row, say) at ``step``, tagged
        ``prefix/key``; nested dicts flattened, non-numbers skipped. Returns how many."""
        wall = self._clock()
        values = _flatten(mapping, prefix)
        for tag, value in values.items():
            self.scalar(tag, value, step, wall)
        return len(values)

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
