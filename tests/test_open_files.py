"""Local files kept open between reads (``zephon.readers.open_files``), and the WebDataset reader over them:
one open per shard visit, the index of the file a descriptor reads, nothing closed under a reader, and
nothing left open."""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tarfile
import threading

import numpy as np
import pytest

from zephon.readers import open_files
from zephon.readers import webdataset as wdsr
from zephon.readers.open_files import OpenFiles

from .test_vision_webdataset import local, members_of, shards  # noqa: F401 - fixtures
from .vision_data import write_shard


class FdLedger:
    """``os`` as ``zephon.readers.open_files`` sees it, recording its opens and closes: which of the test's
    files are open now. (A set of ``/proc/self/fd`` would count descriptors of other tests' threads.)"""

    def __init__(self, root: str) -> None:
        self.root, self.events, self._lock = root, [], threading.Lock()

    def open(self, path, *args, **kwargs):
        with self._lock:  # the system call and its record together: a descriptor number is reused at once
            fd = os.open(path, *args, **kwargs)
            self.events.append(("open", fd, str(path)))
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            os.close(fd)
            self.events.append(("close", fd, ""))

    def __getattr__(self, name: str):
        return getattr(os, name)

    def still_open(self) -> set[int]:
        """The descriptors of files under the test's folder that were opened and not closed since."""
        now: dict[int, str] = {}
        for kind, fd, path in self.events:
            if kind == "open" and path.startswith(self.root):
                now[fd] = path
            else:
                now.pop(fd, None)
        return set(now)


@pytest.fixture
def ledger(tmp_path, monkeypatch) -> FdLedger:
    spy = FdLedger(str(tmp_path))
    monkeypatch.setattr(open_files, "os", spy)
    return spy


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(6):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(bytes([i]) * (1000 + i))
        paths.append(str(path))
    return paths


def size_of(path: str, fd: int, st: os.stat_result) -> int:
    size_of.calls.append(path)
    return st.st_size


def test_a_file_is_opened_once_and_read_through_its_descriptor(files):
    size_of.calls = []
    cache: OpenFiles[int] = OpenFiles(limit=4)
    for _ in range(3):
        with cache.lease(files[0], size_of) as (fd, size):
            assert size == 1000 and os.pread(fd, 3, 10) == b"\0\0\0"
    assert size_of.calls == [files[0]] and len(cache) == 1
    cache.close()


def test_the_least_recently_used_file_is_closed_past_the_limit(files, ledger):
    size_of.calls = []
    cache: OpenFiles[int] = OpenFiles(limit=2)
    fds = []
    for path in files[:3]:
        with cache.lease(path, size_of) as (fd, _):
            fds.append(fd)
    assert len(cache) == 2 and ledger.still_open() == set(fds[1:])  # the first one is closed
    with cache.lease(files[0], size_of):  # opened again, and derived again
        pass
    assert size_of.calls == files[:3] + files[:1]
    cache.close()
    assert not ledger.still_open()


def test_a_file_evicted_while_leased_is_closed_when_the_lease_ends(files, ledger):
    cache: OpenFiles[int] = OpenFiles(limit=1)
    with cache.lease(files[0], size_of) as (fd, _):
        with cache.lease(files[1], size_of):  # evicts files[0], which is being read
            pass
        assert os.pread(fd, 4, 0) == b"\0\0\0\0"  # still open under its reader
    assert fd not in ledger.still_open()
    cache.close()
    assert not ledger.still_open()


def test_errors_leave_nothing_open(files, tmp_path, ledger):
    cache: OpenFiles[int] = OpenFiles(limit=2)
    with pytest.raises(FileNotFoundError):
        with cache.lease(str(tmp_path / "missing"), size_of):
            pass

    def refuse(path, fd, st):
        raise ValueError("not a shard")

    with pytest.raises(ValueError, match="not a shard"):
        with cache.lease(files[0], refuse):
            pass
    assert len(cache) == 0 and not ledger.still_open() and ledger.events
    with pytest.raises(ValueError, match="limit >= 1"):
        OpenFiles(limit=0)


def test_threads_share_the_files_and_never_read_a_closed_descriptor(files, ledger):
    """Eight threads lease six files through a cache of two: evictions happen under readers all the time."""
    cache: OpenFiles[int] = OpenFiles(limit=2)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                i = int(rng.integers(len(files)))
                with cache.lease(files[i], size_of) as (fd, size):
                    assert size == 1000 + i and os.pread(fd, size + 10, 0) == bytes([i]) * size
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)

    size_of.calls = []
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(cache) <= 2
    cache.close()
    assert not ledger.still_open()


def test_a_dropped_cache_closes_its_files(files, ledger):
    import gc

    cache: OpenFiles[int] = OpenFiles(limit=4)
    for path in files[:3]:
        with cache.lease(path, size_of):
            pass
    assert len(ledger.still_open()) == 3
    del cache
    gc.collect()
    assert not ledger.still_open()


# -- the WebDataset reader over it ------------------------------------------------------------------------
def chunk_values(reader, path: str, start: int, end: int) -> dict:
    return reader.read(path, start, end).columns


def test_a_lane_reading_a_shard_chunk_by_chunk_opens_it_once(shards, monkeypatch):  # noqa: F811 - fixture
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))  # none of the shards open from other tests
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    path = str(shards[0])
    planned = reader.index(path)  # what planning indexed, by the path's stat
    opened, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: opened.append(p) or real(p, *a, **k))
    monkeypatch.setattr(os, "stat", lambda *a, **k: pytest.fail("a chunk read stat'ed the shard"))
    whole = reader.read(path, 0, len(planned)).columns
    chunks = [reader.read(path, a, min(a + 4, len(planned))).columns for a in range(0, len(planned), 4)]
    assert opened == [path]
    for field in ("jpg", "txt"):
        assert [v for c in chunks for v in c[field]] == whole[field]
    with wdsr._OPEN.lease(path, reader._index_of_open) as (_, index):
        assert index is planned  # the same file, so the same cached index: not scanned again


def test_a_shard_replaced_while_open_is_read_as_it_was_opened(shards, tmp_path, monkeypatch):  # noqa: F811
    """A new file renamed over an open shard: the descriptor reads the file its index describes, so the
    lane's chunks stay the planned samples (not the new file's bytes under the old file's offsets)."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))  # before the reader: it marks this set
    path = tmp_path / "s.tar"
    shutil.copy(shards[0], path)
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    expected = reader.read(str(path), 0, -1).columns
    first = reader.read(str(path), 0, 4).columns
    replacement = tmp_path / "new.tar"
    shutil.copy(shards[1], replacement)
    os.replace(replacement, path)
    rest = reader.read(str(path), 4, -1).columns
    assert first["txt"] + rest["txt"] == expected["txt"] and first["jpg"] + rest["jpg"] == expected["jpg"]
    wdsr._OPEN.close()  # once closed (evicted), the path is opened and indexed afresh: the new file
    assert reader.read(str(path), 0, -1).columns["txt"] != expected["txt"]


def test_readers_share_the_process_s_open_shards(shards, monkeypatch):  # noqa: F811 - fixture
    """Every reader of the process uses one set of open shards, so that many loaders (zephon verify runs
    several world sizes in one process) never hold more than its limit; a pickled reader works as well."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=2))
    readers = [wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4) for _ in range(3)]
    readers.append(pickle.loads(pickle.dumps(readers[0])))
    got = [r.read(str(path), 0, 4).columns for r in readers for path in shards]
    assert len(wdsr._OPEN) == 2
    assert all(g == got[k % len(shards)] for k, g in enumerate(got))


def test_a_missing_shard_is_named(shards, tmp_path):  # noqa: F811 - fixture
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    with pytest.raises(wdsr.SourceError, match="is missing; it was listed"):
        reader.read(str(tmp_path / "gone.tar"), 0, 4)


def test_a_lease_since_a_mark_opens_what_was_open_before_it_afresh(files, ledger):
    size_of.calls = []
    cache: OpenFiles[int] = OpenFiles(limit=4)
    with cache.lease(files[0], size_of) as (first, _):
        pass
    with cache.lease(files[0], size_of, since=0) as (fd, _):  # open since the beginning: the same
        assert fd == first
    mark = cache.mark()
    with cache.lease(files[0], size_of, since=mark) as (fd, _):  # opened before the mark: afresh
        again = fd
    with cache.lease(files[0], size_of, since=mark) as (fd, _):  # and now open since the mark
        assert fd == again
    assert size_of.calls == [files[0], files[0]] and len(cache) == 1
    cache.close()
    assert not ledger.still_open()


def test_a_reader_made_after_a_shard_was_rewritten_in_place_reads_the_new_file(shards, tmp_path,  # noqa: F811
                                                                                 monkeypatch):
    """The same file (inode) rewritten: a descriptor left open by an earlier reader would not notice, so a
    later reader (a new loader) opens and indexes the path afresh."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))
    path = tmp_path / "s.tar"
    shutil.copy(shards[0], path)
    old = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4).read(str(path), 0, -1).columns
    with open(path, "r+b") as f:  # in place: the same inode, new contents
        f.write(open(shards[1], "rb").read())
        f.truncate()
    os.utime(path, ns=(1, 1))  # a version of its own even where the clock's resolution is coarse
    new = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4).read(str(path), 0, -1).columns
    assert new["txt"] != old["txt"]
    assert new == wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4).read(str(shards[1]), 0, -1).columns



def test_a_shard_rewritten_in_place_while_open_is_an_error(shards, tmp_path, monkeypatch):  # noqa: F811
    """The same file (inode) rewritten while a reader holds it open: its descriptor reads the new bytes, so
    the old index would cut them at the wrong places. Each read checks its first and last member's tar
    header against the index: the read is refused, naming the shard, and nothing of it is handed out."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))
    path = tmp_path / "s.tar"
    shutil.copy(shards[0], path)
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    n = len(reader.index(str(path)))
    first = reader.read(str(path), 0, 4).columns
    with open(path, "r+b") as f:  # the same bytes again: nothing changed, the reads go on
        f.write(shards[0].read_bytes())
    assert reader.read(str(path), 0, 4).columns == first
    # truncated and written in place: the same names, other sizes (so other places)
    other = write_shard(tmp_path / "other.tar", [(name, data + b"!" * 600) for name, data in members_of(0)],
                        tarfile.USTAR_FORMAT)
    with open(path, "wb") as f:
        f.write(other.read_bytes())
    for a in range(0, n, 4):
        with pytest.raises(wdsr.SourceError, match=r"s\.tar changed while it was being read .* rewritten in place"):
            reader.read(str(path), a, min(n, a + 4))


def pax_shard_with_zero_header_sizes(path, members: list[tuple[str, bytes]]):
    """A pax shard whose members' sizes are in pax ``size`` records, their own headers' size fields 0 (with
    the headers' checksums made good): legal, and what a writer that always writes pax sizes may do."""
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.pax_headers = len(data), {"size": str(len(data))}
            tf.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tf:
        heads = [m.offset_data - 512 for m in tf.getmembers()]
    raw = bytearray(path.read_bytes())
    for at in heads:
        block = raw[at:at + 512]
        block[124:136] = b"00000000000\0"
        block[148:156] = b" " * 8
        block[148:156] = b"%06o\0 " % sum(block)
        raw[at:at + 512] = block
    path.write_bytes(bytes(raw))
    with tarfile.open(path) as tf:  # as tarfile reads it: the pax sizes win
        assert [tf.extractfile(m).read() for m in tf.getmembers()] == [d for _, d in members]


def test_a_header_whose_size_a_pax_record_overrides_is_not_a_change(tmp_path, monkeypatch):
    """The index follows pax ``size`` records, so a header whose own size field says otherwise disagrees
    with it without any change to the file: the reader scans the shard's headers again, once, finds the
    samples where the index has them, and reads on."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))
    members = [(f"k{i:03d}.{ext}", bytes([i]) * (700 + 37 * i) if ext == "jpg" else f"caption {i}".encode())
               for i in range(10) for ext in ("jpg", "txt")]
    path = tmp_path / "pax.tar"
    pax_shard_with_zero_header_sizes(path, members)
    scans, real = [], wdsr.scan_members
    monkeypatch.setattr(wdsr, "scan_members", lambda *a: scans.append(1) or real(*a))
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    got = [reader.read(str(path), a, min(10, a + 4)).columns for a in (0, 4, 8)]
    assert [v for c in got for v in c["jpg"]] == [d for n, d in members if n.endswith(".jpg")]
    assert [v for c in got for v in c["txt"]] == [f"caption {i}" for i in range(10)]
    assert len(scans) == 2  # the index, then one scan when a header first disagreed


def test_open_shards_are_closed_once_no_reader_is_left(shards, ledger, monkeypatch):  # noqa: F811
    """The process's open shards outlive a loader only while another reader of the process is alive: once
    the last one is collected, nothing stays open (no descriptor, no deleted file's disk space)."""
    import gc

    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=8))
    ledger.root = str(shards[0].parent)  # the ledger watches the shards' folder
    first = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    second = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    for path in shards[:2]:
        first.read(str(path), 0, 4)
    second.read(str(shards[2]), 0, 4)
    assert len(ledger.still_open()) == 3
    del first
    gc.collect()
    assert len(ledger.still_open()) == 3  # the second reader is alive: the set stays as it is
    del second
    gc.collect()
    assert not ledger.still_open() and len(wdsr._OPEN) == 0


def test_the_last_owner_collected_while_the_set_is_locked_closes_later(files, ledger):
    """A finalizer runs inside whatever allocation triggers the collector, even in a block that holds the
    set's lock: the files are then closed from another thread once the lock is free, never a deadlock."""
    import gc
    import time

    class Owner:
        pass

    cache: OpenFiles[int] = OpenFiles(limit=4)
    owner = Owner()
    cache.attach(owner)
    with cache.lease(files[0], size_of):
        pass
    assert len(ledger.still_open()) == 1
    with cache._lock:
        del owner
        gc.collect()
        assert len(ledger.still_open()) == 1  # could not close under the held lock
    deadline = time.monotonic() + 10
    while ledger.still_open() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not ledger.still_open() and len(cache) == 0


def test_threads_reading_a_pax_shard_for_the_first_time_at_once(tmp_path, monkeypatch):
    """Two threads meet the disagreeing headers of a pax shard together and both scan it again through the
    descriptor they share: each scan reads from a position of its own (a ``dup`` would share one, and the
    two scans would read each other's blocks and call the shard corrupt)."""
    import threading as th

    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))
    members = [(f"k{i:05d}.{ext}", bytes([i % 251]) * (300 + i % 97) if ext == "jpg" else b"c")
               for i in range(1500) for ext in ("jpg", "txt")]
    path = tmp_path / "pax.tar"
    pax_shard_with_zero_header_sizes(path, members)
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    for _ in range(10):
        wdsr._LAYOUT_CHECKED.clear()  # a first meeting again
        start, errors = th.Barrier(2), []

        def read(a: int) -> None:
            start.wait()
            try:
                assert reader.read(str(path), a, a + 4).columns["txt"] == ["c"] * 4
            except Exception as exc:  # noqa: BLE001 - collected for the assertion below
                errors.append(exc)

        threads = [th.Thread(target=read, args=(a,)) for a in (0, 700)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_a_pax_shard_found_unchanged_is_still_checked_after(tmp_path, monkeypatch):
    """A shard scanned again and found as indexed is remembered with its size and mtime: rewritten in place
    later, it is scanned again and refused."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))
    members = [(f"k{i:03d}.{ext}", bytes([i]) * (700 + 37 * i) if ext == "jpg" else b"caption")
               for i in range(10) for ext in ("jpg", "txt")]
    path = tmp_path / "pax.tar"
    pax_shard_with_zero_header_sizes(path, members)
    reader = wdsr.WebDatasetReader(local(), "w", ["jpg", "txt"], 4)
    reader.read(str(path), 0, 4)
    other = tmp_path / "other.tar"
    pax_shard_with_zero_header_sizes(other, [(n, d + b"!" * 900) for n, d in members])
    data = other.read_bytes()
    with open(path, "wb") as f:  # in place: the reader's descriptor now reads these bytes
        f.write(data)
    os.utime(path, ns=(1, 1))  # another mtime, however coarse the file system's clock
    with pytest.raises(wdsr.SourceError, match="changed while it was being read"):
        reader.read(str(path), 4, 8)


def test_a_large_member_alone_in_its_read_is_handed_out_as_read(tmp_path, monkeypatch):
    """A local member larger than LARGE_MEMBER with no wanted neighbour within LOCAL_READ_GAP is read on
    its own (its header apart, for the check), and the bytes read are the member: no copy."""
    monkeypatch.setattr(wdsr, "_OPEN", OpenFiles(limit=4))
    big = [os.urandom(wdsr.LARGE_MEMBER + 1000 * i + 1) for i in range(3)]
    members = [(f"k{i}.{ext}", big[i] if ext == "bin" else os.urandom(8000)) for i in range(3) for ext in ("bin", "pad")]
    path = write_shard(tmp_path / "big.tar", members, tarfile.USTAR_FORMAT)
    reads = []
    real = wdsr._pread_all
    monkeypatch.setattr(wdsr, "_pread_all", lambda *a: reads.append(real(*a)) or reads[-1])
    got = wdsr.WebDatasetReader(local(), "w", ["bin"], 4).read(str(path), 0, 3).columns["bin"]
    assert got == big
    assert all(any(g is r for r in reads) for g in got)  # each is the very object read
