"""Batch memory reused once released (zephon.batches.buffers): never while anything can still see it.

The pool decides from a reference count that nobody holds a buffer. These tests hold batch memory every
way a trainer can (numpy views, tensors and their views, ``Tensor.numpy()``, memoryviews, lists of
batches) and check that it is never handed out again while held; and, through whole vision-language
loaders whose pixel and stacked tensors are all pooled and poisoned (every array handed out starts as
0xA5 bytes), that batches are byte for byte those of the same loader without the pool
(``reuse_batch_memory=False``) whether the trainer drops each batch (memory reused) or keeps them all
(reuse impossible). ``tests/test_golden_vl.py`` pins the default loader's (pooled) batches to the golden
hashes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import zephon as z
from zephon.batches.buffers import BatchBuffers
from zephon.batches.records import collate_records
from zephon.ops.batch import RecordRow

from .test_golden_vl import STEPS, pipelines, vl_inputs  # noqa: F401  (fixtures)


class PoisonedBuffers(BatchBuffers):
    """Every array it hands out starts as ``poison`` bytes (0xA5), fresh or reused: a byte that collation
    forgets to write changes the batch's hash, whatever earlier batches left there."""

    def __init__(self, keep: int = 4, min_bytes: int = 4 << 20, poison: int = 0xA5) -> None:
        super().__init__(keep, min_bytes)
        self.poison = poison

    def empty(self, shape, dtype):
        out = super().empty(shape, dtype)
        out.view(np.uint8).fill(self.poison)
        return out


def _autograd_saved(a):
    x = torch.from_numpy(a).requires_grad_()
    return (x * x).sum()  # the graph saves x; nothing else refers to it


HOLDERS = {
    "tensor": torch.from_numpy,
    "tensor view": lambda a: torch.from_numpy(a)[1:],
    "Tensor.numpy()": lambda a: torch.from_numpy(a).numpy(),
    "numpy view": lambda a: a.reshape(-1)[2:],
    "memoryview": memoryview,
    "list of batches": lambda a: [{"pixel_values": torch.from_numpy(a)}],
    "untyped_storage()": lambda a: torch.from_numpy(a).untyped_storage(),
    "DLPack capsule": lambda a: torch.utils.dlpack.to_dlpack(torch.from_numpy(a)),
    "np.from_dlpack": lambda a: np.from_dlpack(torch.from_numpy(a)),
}


def _contents(held) -> np.ndarray:
    if isinstance(held, list):
        return np.asarray(held[0]["pixel_values"])
    if isinstance(held, torch.UntypedStorage):
        return np.frombuffer(bytes(held), np.uint8)
    if type(held).__name__ == "PyCapsule":
        return torch.utils.dlpack.from_dlpack(held).numpy()
    return np.asarray(held)


@pytest.mark.parametrize("holder", list(HOLDERS))
def test_held_memory_is_never_handed_out_again(holder):
    pool = BatchBuffers(keep=4, min_bytes=0)
    a = pool.empty((64, 12), np.uint8)
    a.fill(7)
    held = HOLDERS[holder](a)
    del a
    for _ in range(6):  # more requests than the pool keeps buffers
        b = pool.empty((64, 12), np.uint8)
        b.fill(9)
    assert (_contents(held) == 7).all(), f"memory held through a {holder} was written over"


def test_memory_held_by_an_autograd_graph_is_never_handed_out_again():
    pool = BatchBuffers(keep=4, min_bytes=0)
    a = pool.empty((64,), np.float32)
    a.fill(3.0)
    loss = _autograd_saved(a)
    del a
    for _ in range(6):
        pool.empty((64,), np.float32).fill(-1.0)
    saved = loss.grad_fn.next_functions[0][0]._saved_self  # MulBackward0's saved x
    assert (saved == 3.0).all(), "memory saved by autograd was written over"


def test_memory_moved_to_shared_memory_is_free_again():
    """share_memory_() (torch.multiprocessing, DataLoader workers) moves the bytes out: the buffer is free."""
    pool = BatchBuffers(keep=1, min_bytes=0)
    a = pool.empty((64, 12), np.uint8)
    a.fill(7)
    t = torch.from_numpy(a).share_memory_()
    del a
    b = pool.empty((64, 12), np.uint8)
    b.fill(9)
    assert pool.reused == 1 and (t == 7).all()


def test_the_default_pool_reuses_batches_of_4_mib_and_more():
    pool = BatchBuffers()
    assert pool.keep == 4, "this interpreter's reference counts do not see a second reference: reuse is off"
    small = pool.empty((1 << 20,), np.uint8)
    assert small.base is None  # under min_bytes: a plain allocation
    big = torch.from_numpy(pool.empty((8 << 20,), np.uint8))
    address = big.data_ptr()
    del big
    assert pool.empty((5 << 20,), np.uint8).ctypes.data == address and pool.reused == 1


def test_released_memory_is_reused():
    pool = BatchBuffers(keep=2, min_bytes=0)
    t = torch.from_numpy(pool.empty((100, 10), np.uint8))
    address = t.data_ptr()
    del t
    again = pool.empty((50, 20), np.float32)  # another shape and dtype, more bytes: capacities have slack
    assert again.ctypes.data == address and pool.reused == 1 and pool.allocated == 1
    held = again
    other = pool.empty((10, 10), np.uint8)  # the first buffer is held (as ``held``): a second one
    assert other.ctypes.data != address and pool.allocated == 2 and held.base is not None


def test_the_pool_keeps_at_most_keep_buffers_and_replaces_too_small_ones():
    pool = BatchBuffers(keep=2, min_bytes=0)
    held = [pool.empty((3 << 20,), np.uint8) for _ in range(3)]  # the third is not kept
    assert len(pool._buffers) == 2 and pool.allocated == 3
    assert not any(np.shares_memory(held[i], held[j]) for i in range(3) for j in range(i))
    del held
    big = pool.empty((16 << 20,), np.uint8)  # both free buffers are too small: one makes room
    assert len(pool._buffers) == 2 and any(np.shares_memory(big, b) for b in pool._buffers)
    assert pool.empty((1 << 20,), np.uint8).base is not None and pool.reused == 1


def test_small_requests_and_keep_zero_are_plain_allocations():
    assert BatchBuffers(min_bytes=1 << 20).empty((10,), np.uint8).base is None
    assert BatchBuffers(keep=0, min_bytes=0).empty((10 << 20,), np.uint8).base is None
    with pytest.raises(ValueError, match="keep"):
        BatchBuffers(keep=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("take"), st.integers(1, 5000)), st.tuples(st.just("drop"),
                                                                                    st.integers(0, 10))),
                max_size=40),
       st.integers(0, 4))
def test_no_held_array_changes_or_overlaps_another_property(ops, keep):
    """Any interleaving of requests and releases: every array still held keeps its bytes, and no two
    held arrays share memory."""
    pool = BatchBuffers(keep=keep, min_bytes=0)
    held: list[tuple[object, int]] = []
    for n, (op, arg) in enumerate(ops):
        if op == "take":
            a = pool.empty((arg,), np.uint8)
            a.fill(n % 251)
            held.append((torch.from_numpy(a) if n % 2 else a, n % 251))
            del a
        elif held:
            held.pop(arg % len(held))
        for k, (x, mark) in enumerate(held):
            arr = np.asarray(x)
            assert (arr == mark).all()
            assert not any(np.shares_memory(arr, np.asarray(y)) for y, _ in held[:k])


def test_padding_rows_and_empty_slots_are_zeros_in_reused_memory():
    pool = BatchBuffers(keep=1, min_bytes=0)
    full = [RecordRow({"images": np.full((4, 4, 3), 200, np.uint8)}) for _ in range(3)]
    collate_records(full, ["images"], pool)  # dropped at once: its memory is free again, holding 200s
    batch = collate_records([full[0], RecordRow(None), full[1]], ["images"], pool)
    assert pool.reused == 1
    assert (batch["images"][1] == 0).all() and (batch["images"][0] == 200).all()
    assert batch["valid"].tolist() == [True, False, True]


@pytest.mark.parametrize("name", ["wds_fit_flat_pillow", "hf_crop_fixed_simplejpeg", "interleaved_mixed_pillow",
                                  "wds_decode_and_batch_pillow"])
def test_loaders_with_pooled_batches_give_the_unpooled_batches(vl_inputs, name):  # noqa: F811
    """Pixel and stacked tensors pooled whatever their size (min_bytes=0) and poisoned: a trainer that drops
    each batch gets reused memory, one that keeps every batch gets none; both see the bytes of the same
    loader without the pool (so collation writes every byte), and the kept batches are unchanged at the end
    (nothing written over them). The reference is computed here, not read from the golden file, so that
    this holds on any interpreter. (``zip`` holds the previous batch during ``next()``, as a trainer's
    ``enumerate`` does: one buffer more.)"""
    data, tok_path = vl_inputs
    pipe = pipelines(data, z.tokenizer(str(tok_path)))[name]

    def digests_of(loader, keep_batches: bool) -> tuple[list[str], list]:
        kept, digests = [], []
        try:
            for _, batch in zip(range(STEPS), loader):
                digests.append(z.batch_digest(batch))
                if keep_batches:
                    kept.append(batch)
                del batch
        finally:
            loader.close()
        return digests, kept

    unpooled = pipe.build(rank=0, world_size=1, num_workers=2, runner="thread", reuse_batch_memory=False)
    unpooled._buffers = PoisonedBuffers(keep=0, min_bytes=0, poison=0x5A)  # another poison: no byte left to chance
    want, _ = digests_of(unpooled, False)
    assert unpooled.metrics()["batch_memory"] == {"reused": 0, "allocated": 0}
    assert len(want) == STEPS
    for keep_batches in (False, True):
        loader = pipe.build(rank=0, world_size=1, num_workers=2, runner="thread")
        loader._buffers = PoisonedBuffers(min_bytes=0)
        digests, kept = digests_of(loader, keep_batches)
        pool = loader._buffers
        assert loader.metrics()["batch_memory"] == {"reused": pool.reused, "allocated": pool.allocated}
        first_bad = next((i for i, (a, b) in enumerate(zip(digests, want)) if a != b), None)
        assert digests == want, f"{name}: pooled batch {first_bad} differs from the unpooled one"
        if keep_batches:
            assert pool.reused == 0
            assert [z.batch_digest(b) for b in kept] == digests, f"{name}: a kept batch was written over"
        else:
            assert pool.reused > 0, f"{name}: the pool never reused a buffer, so reuse was not tested"


def test_empty_image_slots_are_zeros_in_reused_memory(vl_inputs):  # noqa: F811
    """pixels="fixed" with more slots than rows fill: the empty slots of pooled (poisoned) memory are zeros,
    as in fresh memory (the golden pipelines fill every slot)."""
    data, tok_path = vl_inputs
    pipe = (z.Pipeline(seed=12, lanes=4)
            .source("hf", z.read.parquet(str(data["hf"]), columns=["image", "caption"], chunk_rows=4))
            .decode_images("image", size=56, merge=2, jpeg_decoder="simplejpeg")
            .tokenize_images(z.tokenizer(str(tok_path)), "caption", image_start="<|vision_start|>",
                             image_pad="<|image_pad|>", image_end="<|vision_end|>")
            .pack(seq_len=96, algorithm="first_fit", max_images_per_row=6)
            .batch(rows_per_lane=1, pixels="fixed"))
    runs = []
    for pooled in (True, False):
        loader = pipe.build(rank=0, world_size=1, num_workers=0)
        loader._buffers = PoisonedBuffers(min_bytes=0) if pooled else BatchBuffers(keep=0)
        empty_slots, digests = 0, []
        with loader:
            for _, batch in zip(range(STEPS), loader):
                empty_slots += int((~batch["image_mask"]).sum())
                assert (batch["pixel_values"][~batch["image_mask"]] == 0).all()
                digests.append(z.batch_digest(batch))
                del batch
            runs.append((digests, loader._buffers.reused))
    assert empty_slots > 0, "no row left a slot empty: the test does not test empty slots"
    assert runs[0][1] > 0 and runs[1][1] == 0
    assert runs[0][0] == runs[1][0]


def test_the_module_docstring_example_runs_as_written():
    import doctest

    import zephon.batches.buffers as module

    result = doctest.testmod(module)
    assert result.attempted >= 8 and result.failed == 0
