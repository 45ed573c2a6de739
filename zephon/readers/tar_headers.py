"""The members of a tar file from its headers alone: ``scan_members``, for the WebDataset reader's index.

Each 512-byte header gives a member's name, type and size; the data is skipped with a seek, so a shard's
index costs one read per member, never its contents. GNU long names and pax headers (``path``, ``size``)
are honoured; sparse members are refused. Every header's checksum is verified, unsigned or signed (old
writers), for many headers at once (numpy): the walk collects them, and a header that fails is reported
before any error that its own or later headers' other fields led to.
"""

from __future__ import annotations

from typing import BinaryIO

import numpy as np

from ..errors import SourceError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)
MAX_META_BYTES = 1 << 20  # a GNU long name or a pax header larger than this is refused
_REGULAR = (b"0", b"\x00", b"7")


def number_field(field: bytes, where: str) -> int:
    """A tar numeric field: octal digits (NUL/space padded) or GNU base-256 (high bit set)."""
    if field[0] & 0x80:
        if field[0] == 0xFF:
            raise SourceError(f"{where}: a negative number in a tar header")
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\x00", 1)[0].strip(b" ")
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise SourceError(f"{where}: a tar header holds {field!r} where a number belongs (not a tar file, or a "
                          f"corrupt one)") from None


CHECK_BATCH = 4096  # headers whose checksums are verified together


def _check_sums(blocks: list[bytes], stored: list[int], at: list[int], where: str) -> None:
    """Each header's checksum: the sum of its bytes with the checksum field as spaces, read unsigned (tar
    writers today) or signed (some old ones). Checked for all headers at once; the first bad one is named."""
    if not blocks:
        return
    raw = np.frombuffer(b"".join(blocks), dtype=np.uint8).reshape(len(blocks), BLOCK)
    blank = 8 * 32  # the checksum field counts as eight spaces
    unsigned = raw.sum(axis=1, dtype=np.int64) - raw[:, 148:156].sum(axis=1, dtype=np.int64) + blank
    want = np.asarray(stored, dtype=np.int64)
    bad = np.flatnonzero(unsigned != want)
    if len(bad):
        signed = raw[bad].view(np.int8)
        sums = signed.sum(axis=1, dtype=np.int64) - signed[:, 148:156].sum(axis=1, dtype=np.int64) + blank
        bad = bad[sums != want[bad]]
    if len(bad):
        raise SourceError(f"{where}, tar header at byte {at[int(bad[0])]}: bad tar header checksum (not a tar "
                          f"file, or a corrupt one)")


def _pax(data: bytes, where: str) -> dict[str, str]:
    """The records ``"<len> key=value\\n"`` of a pax extended header."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos:pos + 1] not in (b"\x00", b""):
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise SourceError(f"{where}: a malformed pax header") from None
        record = data[space + 1:pos + length]
        if space < 0 or length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise SourceError(f"{where}: a malformed pax header")
        key, value = record[:-1].split(b"=", 1)
        out[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _name(field: bytes) -> str:
    return field.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")


def scan_members(f: BinaryIO, size: int, where: str) -> list[tuple[str, int, int]]:
    """``(name, data offset, size)`` of every regular member of the tar file ``f`` of ``size`` bytes, from its
    headers alone (the data is skipped with a seek)."""
    members: list[tuple[str, int, int]] = []
    blocks: list[bytes] = []  # every header read, its stored checksum and where: verified together
    stored: list[int] = []
    at_pos: list[int] = []
    try:
        _walk(f, size, where, members, blocks, stored, at_pos)
    except Exception:
        # the walk read garbage: a header that fails its checksum comes first, as a header-by-header check
        # would have found it before reading that header's fields
        _check_sums(blocks, stored, at_pos, where)
        raise
    _check_sums(blocks, stored, at_pos, where)
    return members


def _walk(f: BinaryIO, size: int, where: str, members: list, blocks: list, stored: list, at_pos: list) -> None:
    pos = 0
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        if pos + BLOCK > size:
            if pos == size:  # no end-of-archive blocks: tolerated, as tarfile does
                break
            raise SourceError(f"{where}: truncated: a partial tar header at byte {pos} of {size}")
        f.seek(pos)
        block = f.read(BLOCK)
        if len(block) != BLOCK:
            raise SourceError(f"{where}: truncated: a partial tar header at byte {pos}")
        if block == ZERO_BLOCK:
            break
        at = f"{where}, tar header at byte {pos}"
        checksum = number_field(block[148:156], at)  # a field that is no number is refused here, as it always was
        blocks.append(block)
        at_pos.append(pos)
        stored.append(checksum)
        if len(blocks) == CHECK_BATCH:  # bounded memory on a shard of very many members
            _check_sums(blocks, stored, at_pos, where)
            del blocks[:], stored[:], at_pos[:]
        kind = block[156:157]
        msize = number_field(block[124:136], at)
        if kind not in (b"L", b"K", b"x", b"g") and "size" in pax:
            if not (pax["size"].isascii() and pax["size"].isdigit() and len(pax["size"]) <= 20):
                raise SourceError(f"{at}: a pax size of {pax['size']!r}")
            msize = int(pax["size"])
        data = pos + BLOCK
        if data + msize > size:
            raise SourceError(f"{at}: truncated: a member of {msize} bytes runs past the end of the file "
                              f"({size} bytes)")
        if kind in (b"L", b"K", b"x", b"g"):  # GNU long name / link, pax header, pax global header
            if msize > MAX_META_BYTES:
                raise SourceError(f"{at}: a {kind.decode()} header of {msize} bytes (more than {MAX_META_BYTES})")
            f.seek(data)
            meta = f.read(msize)
            if kind == b"L":
                long_name = _name(meta)
            elif kind == b"x":
                pax = _pax(meta, at)
                if any(k.startswith("GNU.sparse") for k in pax):
                    raise SourceError(f"{at}: a sparse member; WebDataset shards hold plain files")
        elif kind == b"S":
            raise SourceError(f"{at}: a sparse member; WebDataset shards hold plain files")
        else:
            name = long_name or pax.get("path")
            if name is None:
                name = _name(block[0:100])
                prefix = _name(block[345:500]) if block[257:265] == b"ustar\x0000" else ""
                name = f"{prefix}/{name}" if prefix else name
            if kind in _REGULAR and not (kind == b"\x00" and name.endswith("/")):
                members.append((name, data, msize))
            long_name, pax = None, {}
        pos = data + -(-msize // BLOCK) * BLOCK
