"""The on-disk spool: durable segments, sent in order, oldest dropped (and counted) only past the bound."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from collector.spool import Spool
from store.errors import ConfigError, DatabaseUnavailable


def batch(i: int, size: int = 10) -> dict:
    return {"i": i, "rows": [[i, j, float(j)] for j in range(size)]}


def test_batches_survive_a_new_process_and_go_in_order(tmp_path: Path):
    spool = Spool(tmp_path, 10_000_000)
    for i in range(5):
        spool.put(batch(i), rows=10)
    assert len(spool) == 5 and spool.rows == 50
    reopened = Spool(tmp_path, 10_000_000)  # what a restarted agent sees
    sent = []
    assert reopened.drain(lambda b: sent.append(b["i"])) == 5
    assert sent == [0, 1, 2, 3, 4]
    assert len(reopened) == 0 and list(tmp_path.glob("*.seg")) == []
    reopened.put(batch(9), rows=10)
    assert Spool(tmp_path, 10_000_000).oldest()[1]["i"] == 9  # sequence numbers keep growing after a drain


def test_drain_stops_at_the_first_refusal_and_keeps_order(tmp_path: Path):
    spool = Spool(tmp_path, 10_000_000)
    for i in range(4):
        spool.put(batch(i), rows=10)
    sent = []

    def send(b):
        if b["i"] == 2:
            raise DatabaseUnavailable("down")
        sent.append(b["i"])

    with pytest.raises(DatabaseUnavailable):
        spool.drain(send)
    assert sent == [0, 1] and len(spool) == 2
    assert spool.drain(lambda b: sent.append(b["i"])) == 2
    assert sent == [0, 1, 2, 3]


def test_oldest_dropped_and_counted_only_past_the_bound(tmp_path: Path, caplog):
    probe = Spool(tmp_path / "probe", 10_000_000)
    probe.put(batch(0, 200), rows=200)
    one = probe.size_bytes
    spool = Spool(tmp_path / "s", int(one * 3.5))
    for i in range(3):
        spool.put(batch(i, 200), rows=200)
    assert spool.dropped_batches == 0 and len(spool) == 3  # within the bound nothing goes
    with caplog.at_level(logging.WARNING):
        spool.put(batch(3, 200), rows=200)
        spool.put(batch(4, 200), rows=200)
    assert spool.dropped_batches == 2 and spool.dropped_rows == 400
    assert "200 rows lost" in caplog.text
    sent = []
    spool.drain(lambda b: sent.append(b["i"]))
    assert sent == [2, 3, 4]
    assert spool.size_bytes == 0


def test_a_batch_bigger_than_the_spool_is_dropped_and_counted(tmp_path: Path):
    spool = Spool(tmp_path, 64)
    assert spool.put(batch(0, 1000), rows=1000) is None
    assert spool.dropped_rows == 1000 and len(spool) == 0


def test_a_full_disk_drops_the_batch_counted_and_leaves_no_half_written_file(tmp_path: Path, monkeypatch):
    spool = Spool(tmp_path, 10_000_000)
    spool.put(batch(0), rows=10)
    real_write = os.write
    room = [100]  # bytes the disk still has: the first write takes part of the batch, the next finds it full

    def filling_write(fd: int, data) -> int:
        if room[0] <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        taken = real_write(fd, bytes(data[: room[0]]))
        room[0] -= taken
        return taken

    monkeypatch.setattr(os, "write", filling_write)
    assert spool.put(batch(1, 500), rows=500) is None  # said, not raised into the agent's flush
    monkeypatch.setattr(os, "write", real_write)
    assert spool.dropped_batches == 1 and spool.dropped_rows == 500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000000000000001-10.seg"]  # no .tmp, no torn segment
    spool.put(batch(2), rows=10)  # room again: the spool goes on
    sent = []
    assert Spool(tmp_path, 10_000_000).drain(lambda b: sent.append(b["i"])) == 2
    assert sent == [0, 2]


def test_unreadable_and_interrupted_segments(tmp_path: Path):
    spool = Spool(tmp_path, 10_000_000)
    for i in range(3):
        spool.put(batch(i), rows=10)
    middle = sorted(tmp_path.glob("*.seg"))[1]
    middle.write_bytes(b"not zlib at all")
    (tmp_path / ".0000000000000099.tmp").write_bytes(b"half a write")
    reopened = Spool(tmp_path, 10_000_000)
    assert not list(tmp_path.glob(".*.tmp"))  # an interrupted write was never a batch
    sent = []
    reopened.drain(lambda b: sent.append(b["i"]))
    assert sent == [0, 2]
    assert reopened.dropped_rows == 10 and len(list(tmp_path.glob("*.bad"))) == 1


def test_a_poison_batch_is_set_aside_not_retried_forever(tmp_path: Path):
    spool = Spool(tmp_path, 10_000_000)
    for i in range(3):
        spool.put(batch(i), rows=10)
    poisoned, sent = [], []

    def send(b):
        if b["i"] == 1:
            raise ValueError("foreign key")
        sent.append(b["i"])

    assert spool.drain(send, on_poison=lambda b, exc: poisoned.append((b["i"], str(exc)))) == 2
    assert sent == [0, 2] and poisoned == [(1, "foreign key")] and len(spool) == 0


def test_bad_settings(tmp_path: Path):
    with pytest.raises(ConfigError, match="SPOOL_MAX_BYTES"):
        Spool(tmp_path, 0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="cannot be created"):
        Spool(blocker / "spool", 1000)
