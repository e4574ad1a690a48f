"""Service logs under a size cap (lorarl/client/launch/log_files.py): copy-then-truncate rotation while a real
process appends, the copies shifted and dropped as set, and the Ray launcher's stream reading across rotations."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from lorarl.client.launch.log_files import LogRetention, LogRotator, backup_path, read_since, rotate, rotate_if_full

WRITER = """
import sys, time
for i in range(int(sys.argv[1])):
    sys.stdout.write(f"line {i:06d} " + "x" * 80 + "\\n")
    sys.stdout.flush()
    if i % 50 == 0:
        time.sleep(0.002)
"""


def test_rotation_shifts_the_copies_and_drops_the_oldest(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    for generation in range(4):
        log.write_text(f"generation {generation}\n")
        rotate(log, backups=2)
        assert log.read_bytes() == b""
    assert backup_path(log, 1).read_text() == "generation 3\n"
    assert backup_path(log, 2).read_text() == "generation 2\n"
    assert not backup_path(log, 3).exists()


def test_no_backups_drops_the_old_content_and_no_cap_never_rotates(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    log.write_bytes(b"a" * 100)
    assert rotate_if_full(log, LogRetention(max_bytes=100, backups=0))
    assert log.read_bytes() == b"" and not backup_path(log, 1).exists()
    log.write_bytes(b"a" * 100)
    assert not rotate_if_full(log, LogRetention(max_bytes=101, backups=1))
    assert not rotate_if_full(log, LogRetention(max_bytes=0, backups=1))
    assert not rotate_if_full(tmp_path / "never-written.log", LogRetention(max_bytes=1, backups=1))
    assert log.stat().st_size == 100


def test_a_process_appending_to_its_log_keeps_writing_at_the_start_after_each_rotation(tmp_path: Path) -> None:
    """As a service does: stdout is the log opened for append. After each truncate its next line lands at offset
    0 (no hole of NULs where the old content was), every kept line is whole, lines only move forward, and the
    files stay under the cap plus what a check interval lets through."""
    log = tmp_path / "svc.log"
    retention = LogRetention(max_bytes=8 << 10, backups=2)
    rotator = LogRotator(lambda: [log], retention, interval_s=0.01)
    lines = 6000
    with log.open("ab") as out:
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(lines)], stdout=out)
    rotator.start()
    try:
        assert writer.wait(timeout=120) == 0
        time.sleep(0.05)
    finally:
        rotator.stop()
    assert rotator.rotations >= 10
    assert rotator.generations == {log: rotator.rotations}
    kept: list[int] = []
    for path in (backup_path(log, 2), backup_path(log, 1), log):
        data = path.read_bytes()
        assert b"\0" not in data, f"{path.name}: a hole where truncated content was"
        assert len(data) <= retention.max_bytes + (64 << 10), f"{path.name}: {len(data)} bytes"
        for text in data.decode().splitlines():
            word, number, filler = text.split(" ")
            assert word == "line" and filler == "x" * 80, text
            kept.append(int(number))
    assert not backup_path(log, 3).exists()
    assert kept == sorted(kept) and len(set(kept)) == len(kept)
    assert kept[-1] == lines - 1  # the newest line is kept
    # the three files hold an unbroken tail, but for what slipped in at a boundary as a copy ended (none in
    # practice: the copy runs until the size stops moving)
    assert kept[-1] - kept[0] + 1 - len(kept) <= 2


@pytest.mark.parametrize("limit", [7, 1 << 20])
def test_a_stream_reads_every_byte_across_rotations(tmp_path: Path, limit: int) -> None:
    """A reader that takes a bite mid-file and catches up after each rotation gets every byte once, in order,
    whether a bite takes a whole file or a few bytes of it."""
    log = tmp_path / "svc.log"
    written, streamed = b"", b""
    generation = offset = current = 0

    def catch_up() -> bytes:
        nonlocal generation, offset
        out = b""
        while True:
            got, generation, offset = read_since(log, generation, offset, current, 2, limit)
            if not got and generation == current:
                return out
            out += got

    for round_ in range(5):
        for part in range(3):
            chunk = f"round {round_} part {part}\n".encode()
            with log.open("ab") as f:
                f.write(chunk)
            written += chunk
            if part == 1:
                got, generation, offset = read_since(log, generation, offset, current, 2, limit)
                streamed += got
        rotate(log, backups=2)
        current += 1
        if round_ % 2:  # every other round: one rotation behind when it catches up, two the next time
            streamed += catch_up()
    streamed += catch_up()
    assert streamed == written


def test_a_stream_behind_by_more_than_the_copies_skips_to_the_oldest_kept(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    for round_ in range(4):
        log.write_text(f"round {round_}\n")
        rotate(log, backups=1)
    log.write_text("live\n")
    got, generation, offset = read_since(log, 0, 3, current=4, backups=1, limit=1 << 20)
    assert (got, generation, offset) == (b"round 3\n", 4, 0)
    assert read_since(log, generation, offset, 4, 1, 1 << 20) == (b"live\n", 4, 5)
