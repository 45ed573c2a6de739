"""The pipelines compared by text_pipeline.py: Parquet -> tokenize (+EOS) -> pack -> [B, S] int64.

Each ``build_*`` returns ``(iterable of batches, close, info)``; a batch is a dict with ``input_ids``
(``torch.int64 [B, S]``) and, where the pipeline has it, ``segment_ids`` (0 on padding). Everything
here is importable by name so that spawned worker processes (Grain) can unpickle the transforms.

Shared by all non-Zephon pipelines: :class:`_common.RowGroupReader` (pyarrow, ``text`` column only,
one row group at a time) and :class:`_common.EncodeWithEos` (``encode_batch_fast`` + EOS). Documents
longer than ``seq_len`` are cut into pieces of at most ``seq_len`` before the packers that need it (as
Zephon does with ``split.max_doc_tokens = seq_len``).
"""

from __future__ import annotations

import collections
import itertools
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from _common import EncodeWithEos, RowGroupReader, parquet_row_groups

EOS = "<|endoftext|>"


def _tokenizer_path(data: Path) -> str:
    return str(Path(data) / "tokenizer.json")


# -- tokenizer alone ---------------------------------------------------------------------------------
def load_texts(data: Path, min_chars: int) -> list[str]:
    """The corpus's documents in file / row-group order, until at least ``min_chars`` characters."""
    read = RowGroupReader()
    texts: list[str] = []
    chars = 0
    for item in parquet_row_groups(data):
        part = read(item)
        texts.extend(part)
        chars += sum(map(len, part))
        if chars >= min_chars:
            break
    return texts


def tokenizer_alone_counts(data: Path, texts: list[str], threads: int = 0, per_call: int = 256,
                           in_flight: int | None = None) -> Iterator[int]:
    """Endless token counts of ``encode_batch_fast`` calls on ``texts`` (cycled), ``per_call`` documents
    a call, each count = the call's ids plus one EOS per document.

    ``threads=0``: calls on the calling thread. ``threads=1``: every call on one helper thread that the
    caller waits for (no parallelism): glibc gives that thread its own malloc arena, while on a main thread
    the tokenizer's allocations use the main arena, which is measurably slower (BENCHMARKS.md section 6);
    Zephon computes inline chunks this way. ``threads=N``: N threads sharing one tokenizer (as Zephon's and
    torchdata's thread workers do), 2N calls in flight, counts in call order: the ceiling of N cores.
    ``in_flight`` overrides the number of calls in flight (1 for ``threads=1``, else ``2 * threads``): one
    helper thread with 2 calls queued never waits for the caller between calls, as a loader's worker
    with tasks queued does not.
    """
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(_tokenizer_path(data))

    def count(batch: list[str]) -> int:
        ids = [e.ids for e in tok.encode_batch_fast(batch, add_special_tokens=False)]
        return sum(map(len, ids)) + len(ids)

    def calls() -> Iterator[list[str]]:
        while True:
            for a in range(0, len(texts), per_call):
                yield texts[a:a + per_call]

    if threads == 0:
        yield from map(count, calls())
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenizer-alone")
    depth = in_flight or (1 if threads == 1 else 2 * threads)
    pending: deque = deque()
    for batch in calls():
        pending.append(pool.submit(count, batch))
        if len(pending) >= depth:
            yield pending.popleft().result()


# -- plain loop --------------------------------------------------------------------------------------
def plain_loop(data: Path, batch: int, seq_len: int) -> Iterator[dict]:
    """One process, no framework: read a row group, encode it, concat-then-split into batches."""
    import torch

    read = RowGroupReader()
    encode = EncodeWithEos(_tokenizer_path(data), EOS)
    need = batch * seq_len
    pending: list[np.ndarray] = []
    have = 0
    for item in itertools.cycle(parquet_row_groups(data)):
        flat, _ = encode(read(item))
        pending.append(flat)
        have += len(flat)
        while have >= need:
            cat = np.concatenate(pending) if len(pending) > 1 else pending[0]
            out = cat[:need].reshape(batch, seq_len).astype(np.int64)
            rest = cat[need:]
            pending, have = [rest], len(rest)
            yield {"input_ids": torch.from_numpy(out)}


def build_plain_loop(data: Path, batch: int, seq_len: int, **_: Any):
    return plain_loop(data, batch, seq_len), (lambda: None), {}


# -- torchdata.nodes ---------------------------------------------------------------------------------
class EndlessRowGroups:
    """An iterable of (file, row group) references, forever, in file order."""

    def __init__(self, data: Path) -> None:
        self.items = parquet_row_groups(data)

    def __iter__(self) -> Iterator[tuple[str, int]]:
        return itertools.cycle(self.items)


class ReadAndEncode:
    """The map function of the parallel stage: read one row group's texts, encode them with EOS."""

    def __init__(self, data: Path) -> None:
        self.read = RowGroupReader()
        self.encode = EncodeWithEos(_tokenizer_path(data), EOS)

    def __call__(self, item: tuple[str, int]) -> np.ndarray:
        return self.encode(self.read(item))[0]


def stack_rows(rows: list[np.ndarray]) -> dict:
    import torch

    return {"input_ids": torch.from_numpy(np.stack(rows).astype(np.int64))}


def build_torchdata(data: Path, batch: int, seq_len: int, workers: int = 0, method: str = "thread", **_: Any):
    from torchdata.nodes import BaseNode, Batcher, IterableWrapper, Loader, Mapper, ParallelMapper

    class ConcatSplit(BaseNode):
        """Packer node: concatenates token arrays and cuts rows of ``seq_len`` (no padding)."""

        def __init__(self, source: BaseNode, seq_len: int) -> None:
            super().__init__()
            self.source, self.seq_len = source, seq_len

        def reset(self, initial_state: dict | None = None) -> None:
            super().reset(initial_state)
            self.source.reset(initial_state["source"] if initial_state else None)
            self._rows: collections.deque = collections.deque()
            self._rest = np.zeros(0, dtype=np.int32)

        def next(self) -> np.ndarray:
            while not self._rows:
                flat = next(self.source)
                cat = np.concatenate([self._rest, flat])
                n = len(cat) // self.seq_len
                self._rows.extend(cat[:n * self.seq_len].reshape(n, self.seq_len))
                self._rest = cat[n * self.seq_len:]
            return self._rows.popleft()

        def get_state(self) -> dict:
            return {"source": self.source.state_dict()}

    node = IterableWrapper(EndlessRowGroups(data))
    mapper = node = ParallelMapper(node, map_fn=ReadAndEncode(data), num_workers=workers, method=method,
                                   in_order=True)
    node = ConcatSplit(node, seq_len)
    node = Batcher(node, batch_size=batch, drop_last=True)
    node = Mapper(node, stack_rows)
    loader = Loader(node)
    return loader, (lambda: shutdown_parallel_mapper(mapper)), {"method": method}


def shutdown_parallel_mapper(mapper: Any) -> None:
    """Stop a ParallelMapper's threads / processes now (torchdata only does it on garbage collection)."""
    impl = getattr(mapper, "_it", None)
    for obj in (impl, getattr(impl, "_it", None)):
        fn = getattr(obj, "_shutdown", None)
        if callable(fn):
            fn()


# -- Grain -------------------------------------------------------------------------------------------
class RowGroupSource:
    """A Grain random-access data source: element ``i`` is the texts of the ``i``-th row group."""

    def __init__(self, data: str) -> None:
        self.data = data
        self.items = parquet_row_groups(Path(data))
        self.read = RowGroupReader()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> list[str]:
        return self.read(self.items[index % len(self.items)])

    def __getstate__(self) -> dict:
        return {"data": self.data, "items": self.items}

    def __setstate__(self, state: dict) -> None:
        self.data, self.items, self.read = state["data"], state["items"], RowGroupReader()


class GrainEncode:
    """MapDataset transform on a row group: batched encode + EOS -> (flat tokens, offsets)."""

    def __init__(self, tokenizer_path: str) -> None:
        self.encode = EncodeWithEos(tokenizer_path, EOS)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        return self.encode(texts)


class SplitDocs:
    """Grain flat-map transform (the ``FlatMapTransform`` interface, duck-typed so that importing this
    module does not import Grain): one row group's (flat, offsets) -> one record per document piece of at
    most ``seq_len`` tokens."""

    max_fan_out = 1 << 20  # only used by the MapDataset flat map; required by the interface

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def flat_map(self, element):
        flat, offsets = element
        S = self.seq_len
        out = []
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            for s in range(a, b, S):
                out.append({"tokens": flat[s:min(b, s + S)]})
        return out


def to_int64(batch: dict) -> dict:
    return {k: v.astype(np.int64) if v.dtype != np.int64 else v for k, v in batch.items()}


def build_grain(data: Path, batch: int, seq_len: int, workers: int = 0, packing: str = "concat",
                read_threads: int = 0, **_: Any):
    import grain
    import torch

    ds = grain.MapDataset.source(RowGroupSource(str(data))).repeat()
    ds = ds.map(GrainEncode(_tokenizer_path(data)))
    it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(1, read_threads)))
    it_ds = grain.experimental.FlatMapIterDataset(it_ds, SplitDocs(seq_len))
    if packing == "concat":
        it_ds = grain.experimental.ConcatThenSplitIterDataset(it_ds, length_struct={"tokens": seq_len})
    elif packing == "firstfit":
        it_ds = grain.experimental.FirstFitPackIterDataset(
            it_ds, length_struct={"tokens": seq_len}, num_packing_bins=batch, shuffle_bins=False)
    else:
        raise ValueError(packing)
    it_ds = it_ds.batch(batch, drop_remainder=True).map(to_int64)
    if workers:
        it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    it = iter(it_ds)

    def gen() -> Iterator[dict]:
        for b in it:
            out = {"input_ids": torch.from_numpy(b["tokens"])}
            if "tokens_segment_ids" in b:
                out["segment_ids"] = torch.from_numpy(b["tokens_segment_ids"])
            yield out

    def close() -> None:
        c = getattr(it, "close", None)
        if callable(c):
            c()

    return gen(), close, {"read_threads": read_threads}


# -- Zephon ------------------------------------------------------------------------------------------
def zephon_recipe(data: Path, algorithm: str | None = None, **changes: Any):
    import zephon

    recipe = zephon.load_recipe(Path(data) / "recipe.toml")
    if algorithm is not None and algorithm != recipe.pack.algorithm:
        changes["pack"] = zephon.PackSpec(algorithm=algorithm, max_open_bins=recipe.pack.max_open_bins)
    return recipe.replace(**changes) if changes else recipe


def build_zephon(data: Path, batch: int, seq_len: int, workers: int = 0, runner: str = "thread",
                 algorithm: str = "best_fit", holder: dict | None = None, prefetch: int | None = None,
                 flush_by: str | None = None, provenance: bool = False, **_: Any):
    import zephon

    changes: dict[str, Any] = {"flush_by": flush_by} if flush_by else {}
    if provenance:
        changes["provenance"] = True
    recipe = zephon_recipe(data, algorithm, **changes)
    if recipe.global_batch_size != batch or recipe.seq_len != seq_len:
        raise ValueError(f"the recipe makes [{recipe.global_batch_size}, {recipe.seq_len}] batches, "
                         f"the benchmark expects [{batch}, {seq_len}]")
    loader = zephon.build_loader(recipe, rank=0, world_size=1, num_workers=workers, runner=runner, prefetch=prefetch)
    if holder is not None:
        holder["loader"] = loader
    if provenance:  # built and timed with the batch; left out of the batch hash, which the others are compared on
        return (_without(b, "provenance") for b in loader), loader.close, {}
    return iter(loader), loader.close, {}


def _without(batch: dict, key: str) -> dict:
    assert key in batch
    return {k: v for k, v in batch.items() if k != key}


BUILDERS: dict[str, Callable] = {
    "plain_loop": build_plain_loop,
    "torchdata": build_torchdata,
    "grain": build_grain,
    "zephon": build_zephon,
}
