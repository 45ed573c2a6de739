"""Batches with images: flat and fixed pixel tensors, the image-to-row index, mrope positions equal to
transformers' Qwen2-VL ``get_rope_index``, and elastic determinism with the pixels in the hash.

The data are real pictures (scikit-image's sample photographs, cropped and encoded by Pillow) in Parquet:
image-caption pairs and interleaved documents long enough to be split between rows.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.optional import require

import zephon as z
from zephon.batches.packed import global_digest
from zephon.batches.images import mrope_positions, normalize, unpatchify
from zephon.imaging import patchify
from zephon.verify import global_hashes

from .vision_data import crop, encode, pictures

PIL = require("PIL")
IDS = dict(image_start="<|vision_start|>", image_pad="<|image_pad|>", image_end="<|vision_end|>")


@pytest.fixture(scope="module")
def vl_tok(tmp_path_factory, corpus_texts):
    from zephon.demo.vl import train_vl_tokenizer

    path = train_vl_tokenizer(tmp_path_factory.mktemp("vltok") / "tok.model", corpus_texts, vocab_size=600)
    return z.tokenizer(str(path))


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus_texts) -> dict[str, Path]:
    """``caps/``: 48 pairs (image, caption) in 2 files; ``docs/``: 24 interleaved documents of 2-4 images and
    paragraphs, some longer than a row."""
    loaded = pictures()
    root = tmp_path_factory.mktemp("vlb")
    texts = [t.strip().replace("\n", " ") for t in corpus_texts if len(t.strip()) > 40]
    out = {"caps": root / "caps", "docs": root / "docs"}
    for p in out.values():
        p.mkdir()
    k = 0
    for f in range(2):
        images, caps = [], []
        for i in range(24):
            images.append(encode(crop(loaded, k, 30 + (k * 17) % 70, 40 + (k * 29) % 90), quality=75 + k % 20))
            caps.append(texts[k % len(texts)][:40 + (k * 37) % 260])
            k += 1
        pq.write_table(pa.table({"image": images, "caption": caps}), out["caps"] / f"part-{f}.parquet", row_group_size=6)
    for f in range(2):
        all_t, all_i = [], []
        for d in range(12):
            ts, ims = [], []
            for j in range(2 + (d + f) % 3):
                ts.append(texts[(k + j) % len(texts)][:30 + (k * 13) % 200])
                ims.append(None)
                ts.append(None)
                ims.append(encode(crop(loaded, k + j, 40 + (k * 7) % 60, 36 + (k * 5) % 80)))
            k += 3
            all_t.append(ts)
            all_i.append(ims)
        pq.write_table(pa.table({"texts": pa.array(all_t, pa.list_(pa.string())),
                                 "images": pa.array(all_i, pa.list_(pa.binary()))}),
                       out["docs"] / f"part-{f}.parquet", row_group_size=4)
    return out


def pipeline(data, tok, lanes: int = 32, pixels: str = "flat", positions: str = "mrope", size: int | None = None,
             max_images: int | None = 3, max_patches: int | None = 60, seq_len: int = 96, algorithm: str = "best_fit"
             ) -> z.Pipeline:
    sizing = dict(size=size) if size else dict(max_pixels=56 * 84)
    return (z.Pipeline(seed=7, lanes=lanes, flush_every=1)
            .source("caps", z.read.parquet(str(data["caps"]), columns=["image", "caption"], chunk_rows=3), weight=0.5)
            .source("docs", z.read.parquet(str(data["docs"]), columns=["texts", "images"], chunk_rows=2), weight=0.5)
            .decode_images("image", sources=["caps"], merge=2, **sizing)
            .decode_images("images", sources=["docs"], merge=2, **sizing)
            .tokenize_images(tok, "caption", sources=["caps"], **IDS)
            .tokenize_images(tok, "texts", sources=["docs"], **IDS)
            .mix(by="tokens")
            .shuffle(buffer=4)
            .pack(seq_len=seq_len, algorithm=algorithm, max_images_per_row=max_images, max_patches_per_row=max_patches)
            .batch(rows_per_lane=1, pixels=pixels, positions=positions))


def first_batches(pipe: z.Pipeline, steps: int) -> list[dict]:
    loader = pipe.build(rank=0, world_size=1)
    try:
        return [next(loader) for _ in range(steps)]
    finally:
        loader.close()


def token_ids(tok) -> tuple[int, int, int]:
    t = z.load_tokenizer(tok)
    return tuple(t.token_id(IDS[k]) for k in ("image_start", "image_pad", "image_end"))  # type: ignore[return-value]


# -- the flat layout ------------------------------------------------------------------------------------
def test_flat_pixels_sit_where_their_tokens_are(data, vl_tok):
    start, pad, end = token_ids(vl_tok)
    flat = first_batches(pipeline(data, vl_tok, lanes=4), 6)
    lists = first_batches(pipeline(data, vl_tok, lanes=4, pixels="lists", positions="1d"), 6)
    images = 0
    for b, ref in zip(flat, lists):
        ids, grid, rows, starts = b["input_ids"], b["image_grid_thw"], b["image_row"], b["image_token_start"]
        assert b["pixel_values"].dtype == torch.uint8 and b["pixel_values"].shape[1] == 14 * 14 * 3
        assert int(grid.prod(1).sum()) == b["pixel_values"].shape[0]
        assert torch.equal(rows, rows.sort().values)  # row order
        n_tokens = grid.prod(1) // 4
        for k in range(len(grid)):  # each image's pads are where the batch says, between its delimiters
            r, s, n = int(rows[k]), int(starts[k]), int(n_tokens[k])
            assert ids[r, s - 1] == start and torch.all(ids[r, s:s + n] == pad) and ids[r, s + n] == end
        assert int((ids == pad).sum()) == int(n_tokens.sum())  # and there is no other pad token
        for r in range(ids.shape[0]):  # the images of each row are its documents' images, in order
            assert int((ids[r] == pad).sum()) == int(n_tokens[rows == r].sum())
            mine = [img for doc in ref["images"][r] for img in (doc or [])]
            got = b["pixel_values"][torch.repeat_interleave(rows == r, grid.prod(1))]
            assert np.array_equal(np.concatenate(mine) if mine else np.zeros((0, 588), np.uint8), got.numpy())
            images += len(mine)
        assert torch.equal(b["input_ids"], ref["input_ids"]) and torch.equal(b["labels"], ref["labels"])
        labels_on_images = torch.isin(b["labels"], torch.tensor([start, pad, end]))
        assert not (labels_on_images & (b["loss_mask"] > 0)).any()
    assert images > 20


def test_limits_hold_in_every_row_and_documents_are_split_between_images(data, vl_tok):
    loader = pipeline(data, vl_tok, lanes=4, max_images=2, max_patches=40).build()
    try:
        batches = [next(loader) for _ in range(8)]
        assert loader.metrics()["pieces_split"] > 5  # documents were cut (between images) to fit
    finally:
        loader.close()
    full = 0
    for b in batches:
        for r in range(b["input_ids"].shape[0]):
            mine = b["image_row"] == r
            assert int(mine.sum()) <= 2 and int(b["image_grid_thw"][mine].prod(1).sum()) <= 40
            full += int(mine.sum()) == 2
    assert full > 3  # the limit is reached, so it is what holds the rows back
    with pytest.raises(z.PipelineError, match="max_patches_per_row"):
        pipeline(data, vl_tok, max_patches=20).compile()
    with pytest.raises(z.PipelineError, match="seq_len"):
        pipeline(data, vl_tok, seq_len=4, max_patches=None).compile()


# -- mrope -----------------------------------------------------------------------------------------------
def hf_rope_index(input_ids: torch.Tensor, token_type: torch.Tensor, grids: torch.Tensor, merge: int) -> torch.Tensor:
    """transformers' own ``Qwen2VLModel.get_rope_index`` on one sequence (the model's config gives it the merge;
    no weights are needed, so it runs on a stand-in that has that config)."""
    qwen = require("transformers.models.qwen2_vl.modeling_qwen2_vl")
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=merge)),
                            get_vision_position_ids=partial(qwen.Qwen2VLModel.get_vision_position_ids, None))
    pos, _ = qwen.Qwen2VLModel.get_rope_index(model, input_ids[None], token_type[None].int(),
                                              image_grid_thw=grids if len(grids) else None)
    return pos[:, 0]


def test_mrope_positions_equal_transformers_get_rope_index_document_by_document(data, vl_tok):
    _, pad, _ = token_ids(vl_tok)
    checked = with_images = 0
    for b in first_batches(pipeline(data, vl_tok, lanes=4), 10):
        pos, ids, seg = b["position_ids"], b["input_ids"], b["segment_ids"]
        assert pos.shape == (3,) + tuple(ids.shape)
        for r in range(ids.shape[0]):
            grids = b["image_grid_thw"][b["image_row"] == r]
            starts = b["image_token_start"][b["image_row"] == r]
            for d in range(1, int(seg[r].max()) + 1):
                where = torch.nonzero(seg[r] == d).flatten()
                a, e = int(where[0]), int(where[-1]) + 1
                mine = grids[(starts >= a) & (starts < e)]
                expected = hf_rope_index(ids[r, a:e], ids[r, a:e] == pad, mine, 2)
                assert torch.equal(pos[:, r, a:e], expected), (r, d)
                checked += 1
                with_images += len(mine) > 0
            assert torch.all(pos[:, r, seg[r] == 0] == 0)  # padding, as in 1-D
    assert checked > 30 and with_images > 15


def test_mrope_worked_example_and_merge_one():
    """The module docstring's row, and images of merge 1 next to each other, against transformers."""
    from zephon.batches.images import _Placed

    ids = torch.tensor([[9, 1, 5, 5, 5, 5, 2, 9]])
    placed = _Placed(np.array([0]), np.array([2]), np.array([4]), np.array([[1, 4, 4]]), [])
    got = torch.from_numpy(mrope_positions(np.arange(8)[None], placed))
    assert got[:, 0].tolist() == [[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]]
    assert torch.equal(got[:, 0], hf_rope_index(ids[0], ids[0] == 5, torch.tensor([[1, 4, 4]]), 2))
    # two documents in one row, the second with two images (grids 2 x 3 and 3 x 1, merge 1), then padding
    ids = torch.tensor([7, 7, 7, 8, 5, 5, 5, 5, 5, 5, 8, 5, 5, 5, 8, 0])
    pos1d = np.array([[0, 1, 2, *range(12), 0]])
    placed = _Placed(np.array([0, 0]), np.array([4, 11]), np.array([6, 3]), np.array([[1, 2, 3], [1, 3, 1]]), [])
    got = torch.from_numpy(mrope_positions(pos1d, placed))[:, 0]
    assert torch.equal(got[:, 3:15], hf_rope_index(ids[3:15], ids[3:15] == 5, torch.tensor([[1, 2, 3], [1, 3, 1]]), 1))
    assert got[:, :3].tolist() == [[0, 1, 2]] * 3 and got[:, 15:].tolist() == [[0]] * 3


# -- the fixed layout ------------------------------------------------------------------------------------
def test_fixed_pixels_are_the_images_in_slots_of_each_row(data, vl_tok):
    fixed = first_batches(pipeline(data, vl_tok, lanes=4, pixels="fixed", positions="1d", size=56), 4)
    lists = first_batches(pipeline(data, vl_tok, lanes=4, pixels="lists", positions="1d", size=56), 4)
    seen = 0
    for b, ref in zip(fixed, lists):
        assert b["pixel_values"].shape == (4 * 3, 3, 56, 56) and b["pixel_values"].dtype == torch.uint8
        for r in range(4):
            mine = [(img, g) for doc_imgs, doc_grids in zip(ref["images"][r], ref["image_grid_thw"][r])
                    for img, g in zip(doc_imgs or [], doc_grids or [])]
            assert b["image_mask"][r * 3:(r + 1) * 3].tolist() == [True] * len(mine) + [False] * (3 - len(mine))
            for j, (patches, grid) in enumerate(mine):
                hwc = b["pixel_values"][r * 3 + j].permute(1, 2, 0).numpy()
                assert np.array_equal(patchify(hwc, 14, 2), patches) and tuple(b["image_grid_thw"][r * 3 + j]) == grid
                assert np.array_equal(unpatchify(patches, grid, 2), hwc)
                seen += 1
            assert not b["pixel_values"][r * 3 + len(mine):(r + 1) * 3].any()
    assert seen > 10
    with pytest.raises(z.PipelineError, match="size="):
        pipeline(data, vl_tok, pixels="fixed").compile()
    with pytest.raises(z.PipelineError, match="max_images_per_row"):
        pipeline(data, vl_tok, pixels="fixed", size=56, max_images=None).compile()


def test_normalize_on_the_device_side():
    flat = torch.tensor([[0, 255, 51] * 2], dtype=torch.uint8)
    out = normalize(flat, (0.5, 0.5, 0.2), (0.5, 0.25, 0.1))
    assert torch.allclose(out, torch.tensor([[-1.0, 2.0, 0.0] * 2]))
    fixed = torch.zeros(1, 3, 2, 2, dtype=torch.uint8)
    assert torch.allclose(normalize(fixed, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)), -torch.ones(1, 3, 2, 2))


# -- the digest ------------------------------------------------------------------------------------------
def test_global_digest_of_rank_batches_is_the_one_rank_digest():
    """Pixels concatenate in rank order, ``image_row`` is hashed as global rows, mrope positions row by row;
    and the digest is not blind to them."""
    rng = np.random.default_rng(0)
    B, S = 4, 8
    one = {"input_ids": torch.from_numpy(rng.integers(0, 9, (B, S))), "labels": torch.zeros(B, S, dtype=torch.long),
           "position_ids": torch.from_numpy(rng.integers(0, 9, (3, B, S))),
           "segment_ids": torch.ones(B, S, dtype=torch.int32), "loss_mask": torch.ones(B, S),
           "pixel_values": torch.from_numpy(rng.integers(0, 255, (10, 6), dtype=np.uint8)),
           "image_grid_thw": torch.tensor([[1, 2, 2], [1, 1, 2], [1, 1, 2], [1, 1, 2]]),
           "image_row": torch.tensor([0, 1, 3, 3]), "image_token_start": torch.tensor([1, 2, 3, 4])}
    patches_of = [4, 2, 0, 4]  # per row

    def ranks(w: int) -> list[dict]:
        per = B // w
        out = []
        for r in range(w):
            rows = slice(r * per, (r + 1) * per)
            imgs = (one["image_row"] >= r * per) & (one["image_row"] < (r + 1) * per)
            p0, p1 = sum(patches_of[:r * per]), sum(patches_of[:(r + 1) * per])
            out.append({"input_ids": one["input_ids"][rows], "labels": one["labels"][rows],
                        "position_ids": one["position_ids"][:, rows], "segment_ids": one["segment_ids"][rows],
                        "loss_mask": one["loss_mask"][rows], "pixel_values": one["pixel_values"][p0:p1],
                        "image_grid_thw": one["image_grid_thw"][imgs], "image_row": one["image_row"][imgs] - r * per,
                        "image_token_start": one["image_token_start"][imgs]})
        return out

    ref = global_digest([one])
    for w in (2, 4):
        assert global_digest(ranks(w)) == ref
    swapped = ranks(2)
    swapped[1]["image_row"] = swapped[1]["image_row"] + 2  # rank-global rows where rank-local ones belong
    assert global_digest(swapped) != ref
    moved = ranks(2)
    moved[0]["pixel_values"] = moved[0]["pixel_values"].flip(0)
    assert global_digest(moved) != ref


# -- elastic determinism with pixels -------------------------------------------------------------------------
def test_pixel_batches_are_elastic_across_world_sizes_and_resumes(data, vl_tok):
    pipe = pipeline(data, vl_tok)
    ref = global_hashes(pipe, 1, 4)
    assert len(set(ref)) == 4
    for w in (2, 8, 32):
        assert global_hashes(pipe, w, 4) == ref, w
    assert global_hashes(pipe, 32, 4, resume_at=2, resume_world_size=2) == ref
    assert global_hashes(pipe, 4, 4, num_workers=2, runner="thread") == ref


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("pixels", ["flat", "fixed"])
def test_pixel_batches_are_elastic_everywhere(data, vl_tok, pixels):
    pipe = pipeline(data, vl_tok, pixels=pixels, size=56 if pixels == "fixed" else None, algorithm="best_fit")
    ref = global_hashes(pipe, 1, 5)
    for w in (4, 16):
        assert global_hashes(pipe, w, 5) == ref, w
    assert global_hashes(pipe, 16, 5, resume_at=3, resume_world_size=1) == ref
    assert global_hashes(pipe, 1, 5, resume_at=1, resume_world_size=8) == ref
    if pixels == "flat":  # the runners move rows between processes: pixels included (the same for fixed)
        assert global_hashes(pipe, 2, 5, num_workers=2, runner="pool") == ref
        assert global_hashes(pipe, 8, 5, num_workers=2, runner="process", resume_at=2, resume_world_size=4) == ref
    wrap = pipeline(data, vl_tok, pixels=pixels, size=56 if pixels == "fixed" else None, algorithm="wrap")
    assert global_hashes(wrap, 32, 4) == global_hashes(wrap, 1, 4)


def test_recipe_round_trip_keeps_limits_and_batch_modes(data, vl_tok, tmp_path):
    pipe = pipeline(data, vl_tok, pixels="fixed", size=56, max_images=2, max_patches=48)
    path = tmp_path / "vl.toml"
    path.write_text(pipe.to_recipe())
    text = path.read_text()
    assert 'pixels = "fixed"' in text and 'positions = "mrope"' in text and "max_images_per_row = 2" in text
    again = z.load_recipe(str(path)).to_pipeline()
    assert again.fingerprint == pipe.fingerprint
    others = [pipeline(data, vl_tok, pixels="fixed", size=56, max_images=3, max_patches=48),
              pipeline(data, vl_tok, pixels="fixed", size=56, max_images=2, max_patches=60),
              pipeline(data, vl_tok, pixels="lists", size=56, max_images=2, max_patches=48),
              pipeline(data, vl_tok, pixels="fixed", positions="1d", size=56, max_images=2, max_patches=48)]
    assert len({pipe.fingerprint, *(p.fingerprint for p in others)}) == 5  # each decides bytes: each is fingerprinted


# -- cutting a batch by rows (micro-batches) ------------------------------------------------------------------
def _assert_same_batch(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (where, k)
        else:
            assert got[k] == want[k], (where, k)


def test_select_rows_worked_example_and_a_row_without_images():
    """The module docstring's example, by hand: rows without images, ``cu_seqlens`` through padding."""
    S, D = 4, 6
    seg = torch.tensor([[1, 1, 2, 0], [1, 1, 1, 1], [1, 2, 2, 2], [1, 1, 0, 0]], dtype=torch.int32)
    pixels = torch.arange(8 * D, dtype=torch.uint8).reshape(8, D)
    batch = {"input_ids": torch.arange(16).reshape(4, S), "segment_ids": seg,
             "cu_seqlens": torch.tensor([0, 2, 3, 4, 8, 9, 12, 14, 16], dtype=torch.int32),
             "position_ids": torch.arange(16).reshape(1, 4, S).expand(3, -1, -1),
             "pixel_values": pixels, "image_grid_thw": torch.tensor([[1, 1, 2], [1, 1, 1], [1, 1, 1], [1, 2, 2]]),
             "image_row": torch.tensor([0, 1, 3, 3]), "image_token_start": torch.tensor([0, 1, 0, 2]),
             "meta": [["a", "b"], ["c"], ["d", "e"], ["f"]]}
    tail = z.select_rows(batch, slice(2, 4))
    assert torch.equal(tail["pixel_values"], pixels[3:8]) and tail["image_row"].tolist() == [1, 1]
    assert tail["cu_seqlens"].tolist() == [0, 1, 4, 6, 8] and tail["cu_seqlens"].dtype == torch.int32
    assert tail["meta"] == [["d", "e"], ["f"]] and tail["position_ids"].shape == (3, 2, S)
    empty = z.select_rows(batch, slice(2, 3))  # row 2 has no image
    assert empty["pixel_values"].shape == (0, D) and empty["image_grid_thw"].shape == (0, 3)
    assert empty["image_row"].tolist() == [] and empty["cu_seqlens"].tolist() == [0, 1, 4]
    assert z.select_rows(batch, slice(1, 3))["cu_seqlens"].tolist() == [0, 4, 5, 8]
    assert z.select_rows(batch, slice(3, 3))["cu_seqlens"].tolist() == [0]
    with pytest.raises(ValueError, match="'meta'"):
        z.select_rows({**batch, "meta": 3}, slice(0, 1))


@pytest.mark.parametrize("pixels,positions", [("flat", "mrope"), ("fixed", "1d")])
def test_select_rows_is_the_batch_of_a_rank_owning_those_rows(data, vl_tok, pixels, positions):
    """``select_rows`` of the one-rank batch equals, key by key (``cu_seqlens``, pixels, image rows and mrope
    positions included), the batch each rank of a 4-rank run gets for its rows."""
    pipe = pipeline(data, vl_tok, lanes=8, pixels=pixels, positions=positions, size=56 if pixels == "fixed" else None)
    one = first_batches(pipe, 3)
    assert sum(int(b["image_grid_thw"].shape[0]) for b in one) > 4
    for r in range(4):
        loader = pipe.build(rank=r, world_size=4)
        try:
            for i, b in enumerate(one):
                _assert_same_batch(z.select_rows(b, slice(2 * r, 2 * r + 2)), next(loader), f"step {i} rank {r}")
        finally:
            loader.close()
    halves = [z.select_rows(one[0], slice(0, 5)), z.select_rows(one[0], slice(5, None))]
    assert global_digest(halves) == global_digest(one[:1])
    with pytest.raises(ValueError, match="contiguous ascending"):
        z.select_rows(one[0], slice(0, 8, 2))


def test_megatron_micro_batches_carry_their_images_and_mrope_positions(data, vl_tok, monkeypatch):
    """Megatron micro-batches of a vision-language step: each carries its own rows' images (flat and fixed
    pixels), and megatron-core's own multimodal rotary embedding reads the ``[3, mbs, S]`` positions as (t, h, w)."""
    require("megatron.core")
    if importlib.util.find_spec("zephon_megatron") is None:  # as test_megatron.py: the plugin from the checkout
        monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "plugins" / "megatron"))
    import zephon_megatron

    pipe = pipeline(data, vl_tok, lanes=8)
    ref, loader = pipe.build(rank=1, world_size=2), pipe.build(rank=1, world_size=2)
    micro = zephon_megatron.MegatronBatches(loader, 2, 2, pad_id=0, reset_position_ids=True)
    try:
        for _ in range(3):
            step = next(ref)
            patches = torch.cat([torch.zeros(1, dtype=torch.long), step["image_grid_thw"].prod(dim=1).cumsum(0)])
            mbs = [next(micro) for _ in range(2)]
            for i, mb in enumerate(mbs):  # rows 2i, 2i+1 of the step, sliced here by hand
                mine = torch.nonzero((step["image_row"] >= 2 * i) & (step["image_row"] < 2 * i + 2)).flatten()
                assert torch.equal(mb["position_ids"], step["position_ids"][:, 2 * i:2 * i + 2])
                assert torch.equal(mb["image_row"], step["image_row"][mine] - 2 * i)
                assert torch.equal(mb["image_grid_thw"], step["image_grid_thw"][mine])
                assert torch.equal(mb["image_token_start"], step["image_token_start"][mine])
                lo, hi = (int(patches[mine[0]]), int(patches[mine[-1] + 1])) if len(mine) else (0, 0)
                assert torch.equal(mb["pixel_values"], step["pixel_values"][lo:hi])
            assert torch.equal(torch.cat([m["pixel_values"] for m in mbs]), step["pixel_values"])
    finally:
        ref.close()
        micro.close()

    fixed = pipeline(data, vl_tok, lanes=8, pixels="fixed", positions="1d", size=56, max_images=2)
    ref, loader = fixed.build(rank=0, world_size=1), fixed.build(rank=0, world_size=1)
    micro = zephon_megatron.MegatronBatches(loader, 4, 2, pad_id=0)
    try:
        step = next(ref)
        for i in range(2):  # 4 rows x 2 slots each
            mb = next(micro)
            for k in ("pixel_values", "image_mask", "image_grid_thw", "image_token_start"):
                assert torch.equal(mb[k], step[k][8 * i:8 * i + 8]), k
        assert bool(step["image_mask"].any())
    finally:
        ref.close()
        micro.close()

    others = [pipe.build(rank=0, world_size=2), pipeline(data, vl_tok, lanes=8, pixels="lists").build(rank=0, world_size=1)]
    try:  # refused when built, before any batch
        with pytest.raises(ValueError, match="--reset-position-ids"):
            zephon_megatron.MegatronBatches(others[0], 2, 2, pad_id=0, reset_position_ids=False)
        with pytest.raises(ValueError, match="pixels='lists'.*pixels='flat'"):
            zephon_megatron.MegatronBatches(others[1], 2, 4, pad_id=0)
    finally:
        for other in others:
            other.close()

    # megatron-core's MultimodalRotaryEmbedding, as GPTModel(position_embedding_type="mrope") builds it; its
    # constructor places inv_freq on torch.cuda.current_device(), which this CPU-only host lacks
    from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    section = [2, 3, 3]  # Qwen2-VL's split of a head's rotary channels into (t, h, w), here for 16 channels
    rope = MultimodalRotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    pos = mbs[1]["position_ids"]
    emb = rope(pos, section)
    assert emb.shape == (96, 2, 1, 16)
    inv = torch.cat([rope.inv_freq, rope.inv_freq])
    which = torch.repeat_interleave(torch.tensor([0, 1, 2] * 2), torch.tensor(section * 2))  # channel -> t/h/w
    for c in range(16):
        assert torch.equal((emb[:, :, 0, c] / inv[c]).round().long(), pos[which[c]].T), c
    assert bool((pos[1] != pos[2]).any())  # the image tokens' rows and columns differ: not 1-D positions
