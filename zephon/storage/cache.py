"""The node-local block cache: aligned blocks of remote objects as checksummed files shared by a node."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
import time
from pathlib import Path

from ..errors import SourceError
from .stats import _count


# -- the node-local block cache -----------------------------------------------------------------------
_BLOCK_MAGIC = b"ZPHBLK2\n"  # a block file: magic | blake2b-256 of (key, block, length, data) | data
_BLOCK_HEADER = len(_BLOCK_MAGIC) + 32
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _NOFOLLOW
_STALE_TMP_S = 3600  # a temporary file older than this was left by a crashed writer


def _block_digest(key: str, block: int, data: bytes) -> bytes:
    """Checksum of a cached block, bound to its key and number: a block copied under another name fails."""
    h = hashlib.blake2b(digest_size=32, person=b"zephon-block")
    h.update(f"{key}\n{block}\n{len(data)}\n".encode())
    h.update(data)
    return h.digest()


class BlockCache:
    """Aligned blocks of remote objects as files under ``root``, shared by every process on a node.

    A block file is written under a temporary name in the same folder and renamed into place
    (``os.replace`` is atomic), so a reader sees a complete block or none; two writers of the same
    block write the same bytes. A hit refreshes the file's mtime; when this process has written more
    than 1/16 of ``max_bytes`` since its last sweep, it deletes the least recently used blocks until
    the folder holds at most ``max_bytes`` (the limit is therefore exceeded by at most 1/16 of it per
    writing process between sweeps). A block deleted under a reader is simply fetched again.

    The folder may be shared and writable by others, so nothing in it is trusted: each block carries a
    checksum over its key, number and bytes, verified on every read (a bad block is counted as
    ``cache_corrupt``, deleted and fetched again, never used); folders and files are opened relative
    to the cache's own folder without following symbolic links, and eviction deletes only regular
    files directly inside the cache's own block folders (a link is neither followed nor counted).
    """

    def __init__(self, root: str, max_bytes: int) -> None:
        base = Path(root)
        base.mkdir(parents=True, exist_ok=True)
        self.root = base / "zephon-blocks-v2"
        try:
            self.root.mkdir()
        except FileExistsError:
            pass
        if self.root.is_symlink() or not self.root.is_dir():
            raise SourceError(f"[storage] cache_dir: {self.root} is a symbolic link or not a folder; the block "
                              f"cache only uses a real folder of its own (eviction deletes files in it). Remove "
                              f"it, or set cache_dir to another folder.")
        self.max_bytes = max_bytes
        self._written = 0
        self._lock = threading.Lock()

    def _open_dir(self, sub: str | None = None, create: bool = False) -> int | None:
        """A descriptor of the cache folder (``sub`` None) or of its block folder ``sub``, opened without
        following a link; None when it is missing or is not a real folder."""
        try:
            root_fd = os.open(self.root, _DIR_FLAGS)
        except OSError:
            return None
        if sub is None:
            return root_fd
        try:
            if create:
                try:
                    os.mkdir(sub, dir_fd=root_fd)
                except FileExistsError:
                    pass
            return os.open(sub, _DIR_FLAGS, dir_fd=root_fd)
        except OSError:  # ELOOP / ENOTDIR: something else sits there; it is left alone
            return None
        finally:
            os.close(root_fd)

    def get(self, key: str, block: int, length: int) -> bytes | None:
        """Block ``block`` of ``key`` (``length`` bytes) if a verified copy is cached, else None."""
        sub_fd = self._open_dir(key[:2])
        if sub_fd is None:
            return None
        name = f"{key}.{block}"
        try:
            try:  # O_NONBLOCK: a FIFO planted under a block's name must not hang the reader
                fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=sub_fd)
            except OSError:  # missing, or a link (ELOOP): never followed
                return None
            with open(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):
                    return None
                raw = f.read(_BLOCK_HEADER + length + 1)
                payload, digest = raw[_BLOCK_HEADER:], raw[len(_BLOCK_MAGIC):_BLOCK_HEADER]
                if len(payload) != length or not raw.startswith(_BLOCK_MAGIC) or \
                        not hmac.compare_digest(digest, _block_digest(key, block, payload)):
                    _count(cache_corrupt=1)
                    _unlink_at(sub_fd, name, st)
                    return None
                try:
                    os.utime(fd)
                except OSError:
                    pass
                return payload
        finally:
            os.close(sub_fd)

    def put(self, key: str, block: int, data: bytes) -> None:
        """Store a block (with its checksum). A failure to write only means it is not cached."""
        if len(data) + _BLOCK_HEADER > self.max_bytes:
            return
        sub_fd = self._open_dir(key[:2], create=True)
        if sub_fd is None:
            return
        tmp = f".tmp-{os.urandom(8).hex()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=sub_fd)
            try:
                with open(fd, "wb") as f:
                    f.write(_BLOCK_MAGIC + _block_digest(key, block, data))
                    f.write(data)
                os.replace(tmp, f"{key}.{block}", src_dir_fd=sub_fd, dst_dir_fd=sub_fd)
            except BaseException:
                _unlink_at(sub_fd, tmp)
                raise
        except OSError:  # full disk, a folder where the block should go...: the read goes on uncached
            return
        finally:
            os.close(sub_fd)
        with self._lock:
            self._written += len(data) + _BLOCK_HEADER
            sweep = self._written > self.max_bytes // 16
            if sweep:
                self._written = 0
        if sweep:
            self.evict()

    def evict(self) -> int:
        """Delete least recently used blocks until at most ``max_bytes`` remain; returns bytes kept.

        Only regular files directly inside the cache's block folders are counted or deleted, through
        descriptors of those folders opened without following links: a link (to a folder or a file)
        under the cache is never followed, so nothing outside the cache is ever deleted."""
        root_fd = self._open_dir()
        if root_fd is None:
            return 0
        subs: dict[str, int] = {}
        entries, total, evicted, now = [], 0, 0, time.time()
        try:
            with os.scandir(root_fd) as it:
                names = [e.name for e in it if e.is_dir(follow_symlinks=False)]
            for sub in names:
                try:
                    subs[sub] = sub_fd = os.open(sub, _DIR_FLAGS, dir_fd=root_fd)
                except OSError:  # replaced by a link meanwhile, or gone
                    continue
                with os.scandir(sub_fd) as it:
                    for e in it:
                        try:
                            if not e.is_file(follow_symlinks=False):
                                continue
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if e.name.startswith(".tmp-"):
                            if now - st.st_mtime > _STALE_TMP_S:
                                _unlink_at(sub_fd, e.name)
                            continue
                        entries.append((st.st_mtime, sub, e.name, st.st_size))
                        total += st.st_size
            entries.sort()
            for _, sub, name, size in entries:
                if total <= self.max_bytes:
                    break
                if _unlink_at(subs[sub], name):
                    evicted += 1
                total -= size
        finally:
            for fd in subs.values():
                os.close(fd)
            os.close(root_fd)
        if evicted:
            _count(cache_evictions=evicted)
        return total


def _unlink_at(dir_fd: int, name: str, expect: os.stat_result | None = None) -> bool:
    """Delete the entry ``name`` of the folder ``dir_fd`` (a link itself, never its target); with
    ``expect``, only if it is still that file (not a good block another process just put there)."""
    try:
        if expect is not None:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if (now.st_ino, now.st_dev) != (expect.st_ino, expect.st_dev):
                return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
