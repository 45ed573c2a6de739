"""In-memory sources (``z.read.records``, ``z.read.table``): the same global batches as the same table in a
Parquet file (at every world size, across a resume, with worker processes and whole-lane processes, which
receive the spec pickled), a fingerprint that is a digest of the content, and records turned into one
Arrow table with errors that name the field."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import zephon as z
from zephon.verify import global_hashes

from .test_sources import STEPS, pipeline, shards, tok, units  # noqa: F401 - fixtures


# -- in-memory sources -------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_in_memory_sources_give_the_parquet_file_batches(shards, tok, tmp_path):
    rows = [r for s in shards for r in s]
    table = pa.table({"text": [t for t, _ in rows], "n": list(range(len(rows)))})
    pq.write_table(table, tmp_path / "all.parquet")  # pyarrow's default row groups, as the memory plan has
    ref = pipeline(z.read.parquet(str(tmp_path / "all.parquet"), chunk_rows=4), tok)
    expected = global_hashes(ref, 1, STEPS)
    as_table = pipeline(z.read.table(table, chunk_rows=4), tok)
    as_records = pipeline(z.read.records([{"text": t, "n": i} for i, (t, _) in enumerate(rows)], chunk_rows=4), tok)
    assert units(as_table) == units(ref) == units(as_records)
    assert global_hashes(as_records, 1, STEPS) == expected
    assert global_hashes(as_table, 4, STEPS, resume_at=3, resume_world_size=16) == expected
    assert global_hashes(as_table, 1, STEPS, num_workers=2, runner="pool") == expected  # the spec pickled to workers
    assert global_hashes(as_records, 1, 4, num_workers=1, runner="process") == expected[:4]


def test_a_large_in_memory_table_is_planned_like_its_parquet_file(tmp_path):
    """Past pyarrow's default row group size (2**20 rows) the table has several groups, as the file has."""
    table = pa.table({"text": pa.array(np.arange(1_100_000) % 997).cast(pa.string())})
    pq.write_table(table, tmp_path / "big.parquet")
    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_row_groups == 2

    def plan(spec: z.read.ReadSpec) -> list[tuple[int, int, int]]:
        return units(z.Pipeline(seed=1, lanes=8).source("d", spec))

    assert plan(z.read.table(table)) == plan(z.read.parquet(str(tmp_path / "big.parquet")))


def test_in_memory_fingerprint_is_a_content_digest(tok):
    texts = [f"document number {i} " * 8 for i in range(40)]
    table = pa.table({"text": texts})
    rechunked = pa.Table.from_batches(table.to_batches(max_chunksize=7))
    assert rechunked.column(0).num_chunks > 1
    fp = pipeline(z.read.table(table), tok).fingerprint
    assert pipeline(z.read.table(rechunked), tok).fingerprint == fp
    assert pipeline(z.read.records([{"text": t} for t in texts]), tok).fingerprint == fp
    changed = texts[:17] + [texts[17] + "!"] + texts[18:]
    assert pipeline(z.read.records([{"text": t} for t in changed]), tok).fingerprint != fp
    spec = z.read.table(table)
    assert len(spec.payload) > 0 and isinstance(spec.payload, bytes)
    with pytest.raises(ValueError, match="in-memory source"):
        pipeline(spec, tok).to_recipe()


def test_records_become_one_arrow_table():
    from zephon.readers.memory import records_table

    t = records_table([{"text": "a", "meta": {"lang": "en"}}, {"text": "b", "ids": [1, 2]}])
    assert t.column_names == ["text", "meta", "ids"] and t.column("ids").to_pylist() == [None, [1, 2]]
    with pytest.raises(ValueError, match="field 'n' cannot be one Arrow column"):
        z.read.records([{"text": "a", "n": 1}, {"text": "b", "n": "two"}])
    with pytest.raises(ValueError, match="record 1 is a str"):
        z.read.records([{"text": "a"}, "b"])
    with pytest.raises(ValueError, match="empty"):
        z.read.records([])
    with pytest.raises(ValueError, match="pyarrow.Table is needed"):
        z.read.table({"text": ["a"]})
