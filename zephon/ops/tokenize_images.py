"""``tokenize_images``: text with images to ``input_ids``, each image expanded to its token count.

Runs after :class:`~zephon.ops.decode_images.DecodeImages` (which made ``images`` and ``image_grid_thw``). Per
record it lays out *parts* in order, text pieces and images, tokenizes every text piece of the chunk in
one batched call (no BOS/EOS per piece), and writes each image as ``[image_start] + [image_pad] * n +
[image_end]`` (start and end optional), ``n = t * h * w // merge**2`` from the image's grid. The
document is framed with the tokenizer's BOS/EOS like ``tokenize`` does.

The layout of a record (see :mod:`zephon.ops.decode_images` for the data side):

- ``field`` holds a string (or None): a caption. Each ``placeholder`` (``"<image>"``) in it stands for
  the next image of ``images``; images without a placeholder go before the text (``unplaced_images
  ="before"``, the usual image-then-caption order) or after it. A skipped image (``None``) is dropped with
  its placeholder; a placeholder with no image left is dropped too (counted as ``unmatched_placeholders``).
- ``field`` holds a list: an interleaved document (``texts``), read with ``images`` position by position:
  at position ``k`` the text ``texts[k]`` (if any) and then the image ``images[k]`` (if any). Text pieces
  are tokenized separately and concatenated, with nothing added between them.

``loss_mask`` (a per-token field) is label-aligned: position ``i`` is 0 when token ``i+1`` is an image token
(start, pad or end), 1 elsewhere, so ``labels`` is -100 wherever an image token would be predicted; with
``loss_on_images=True`` it is 1 everywhere. ``images`` and ``image_grid_thw`` come out compacted to the
images that were placed, in order, with ``image_spans`` (each image's token offsets): the output contract
of :mod:`zephon.ops.decode_images`. A record with neither
text nor an image is skipped and counted (``blank_records``).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import PipelineError, SourceError
from ..records import INPUT_IDS, LOSS_MASK, Chunk
from ..specs import TokenizerSpec
from .base import choice, positive_int
from .decode_images import IMAGE_GRID, IMAGES
from .image_layout import IMAGE_SPANS
from .tokenize import TokenizingTransform

UNPLACED = ("before", "after")


class TokenizeImages(TokenizingTransform):
    """Tokenize ``field`` with its images expanded into image tokens (see the module docstring).

    ``image_start`` / ``image_end`` / ``image_pad``: token ids, or token texts looked up in the tokenizer's
    vocabulary (``"<|vision_start|>"``); start and end may be None (no delimiters). ``merge``: patches per
    token along each side (the decode operator's ``merge``).
    """

    op = "tokenize_images"
    token_fields = {LOSS_MASK: (np.uint8, 1)}

    def __init__(self, tokenizer: TokenizerSpec, field: str = "text", *, image_pad: int | str,
                 image_start: int | str | None = None, image_end: int | str | None = None, merge: int = 1,
                 placeholder: str = "<image>", unplaced_images: str = "before", loss_on_images: bool = False,
                 add_eos: bool | None = None, add_bos: bool | None = None, keep_field: bool = False,
                 name: str | None = None, sources: Sequence[str] | None = None, executor: str | None = None) -> None:
        super().__init__(name, sources, executor)
        if not isinstance(tokenizer, TokenizerSpec):
            raise PipelineError(f"tokenize_images(tokenizer=...): pass zephon.tokenizer(path), got {tokenizer!r}")
        for what, v in (("image_pad", image_pad), ("image_start", image_start), ("image_end", image_end)):
            ok = v is None and what != "image_pad" or isinstance(v, str) and v or \
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
            if not ok:
                raise PipelineError(f"tokenize_images({what}={v!r}): a token id (int >= 0) or a token's text is "
                                    f"needed")
        positive_int(merge, "tokenize_images(merge=...)")
        if not isinstance(placeholder, str) or not placeholder:
            raise PipelineError(f"tokenize_images(placeholder={placeholder!r}): a non-empty string is needed")
        choice(unplaced_images, UNPLACED, "tokenize_images(unplaced_images)")
        self.tokenizer, self.field, self.placeholder, self.unplaced_images = tokenizer, field, placeholder, \
            unplaced_images
        self.image_pad, self.image_start, self.image_end = image_pad, image_start, image_end
        self.merge, self.loss_on_images, self.keep_field = merge, loss_on_images, keep_field
        self.add_eos, self.add_bos = add_eos, add_bos
        self._ids: tuple[int | None, int, int | None] | None = None

    def setup(self) -> None:
        self.image_ids  # noqa: B018 - load the tokenizer and resolve the ids now, not on the first chunk

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None, "_ids": None}  # workers load their own

    @property
    def image_ids(self) -> tuple[int | None, int, int | None]:
        """``(start, pad, end)`` as ids of the tokenizer (start and end None when not used)."""
        if self._ids is None:
            tok = self.loaded

            def resolve(what: str, v: int | str | None) -> int | None:
                if v is None:
                    return None
                tid = tok.token_id(v) if isinstance(v, str) else v
                if tid is None:
                    raise SourceError(f"operator '{self.name}': {what} = {v!r} is not a token of the tokenizer "
                                      f"{self.spec.path}. Add it to the vocabulary as a special token, or give its id.")
                if not 0 <= tid < tok.vocab_size:
                    raise SourceError(f"operator '{self.name}': {what} = {tid} is outside the tokenizer's vocabulary "
                                      f"[0, {tok.vocab_size}) ({self.spec.path}).")
                return tid
            pad = resolve("image_pad", self.image_pad)
            assert pad is not None
            self._ids = (resolve("image_start", self.image_start), pad, resolve("image_end", self.image_end))
        return self._ids

    # -- layout ------------------------------------------------------------------------------------------
    def _parts(self, chunk: Chunk, j: int, text: Any, images: list, pieces: list[str]) -> list[tuple[int, int]]:
        """The record's parts in order: ``(0, piece index)`` for a text piece (appended to ``pieces``),
        ``(1, image index)`` for an image (indices into the record's ``images``)."""
        parts: list[tuple[int, int]] = []

        def add_text(t: str) -> None:
            if t:
                parts.append((0, len(pieces)))
                pieces.append(t)

        if isinstance(text, (list, tuple)):  # interleaved: texts[k], then images[k]
            for k in range(max(len(text), len(images))):
                t = text[k] if k < len(text) else None
                if t is not None and not isinstance(t, str):
                    raise SourceError(f"operator '{self.name}': {chunk.where(j)}: texts[{k}] of field '{self.field}' "
                                      f"holds {type(t).__name__}, not text")
                add_text(t or "")
                if k < len(images) and images[k] is not None:
                    parts.append((1, k))
            return parts
        if text is not None and not isinstance(text, str):
            raise SourceError(f"operator '{self.name}': field '{self.field}' of {chunk.where(j)} holds "
                              f"{type(text).__name__}, not text (a caption) or a list (interleaved texts)")
        segments = (text or "").split(self.placeholder)
        unmatched = max(0, len(segments) - 1 - len(images))
        if unmatched:
            chunk.count("unmatched_placeholders", unmatched)
        placed = min(len(segments) - 1, len(images))
        rest = [(1, k) for k in range(placed, len(images)) if images[k] is not None]
        if self.unplaced_images == "before":
            parts += rest
        for i, seg in enumerate(segments):
            add_text(seg)
            if i < placed and images[i] is not None:
                parts.append((1, i))
        if self.unplaced_images == "after":
            parts += rest
        return parts

    # -- a chunk -----------------------------------------------------------------------------------------
    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        self._refuse_tokenized(chunk)
        if IMAGES not in chunk.columns or IMAGE_GRID not in chunk.columns:
            raise SourceError(f"operator '{self.name}': records of source '{chunk.source_name}' ({chunk.path}) "
                              f"have no '{IMAGES}' and "
                              f"'{IMAGE_GRID}' fields: put .decode_images(...) before .tokenize_images(...).")
        if self.field not in chunk.columns:
            raise SourceError(f"operator '{self.name}': records of source '{chunk.source_name}' ({chunk.path}) "
                              f"have no field '{self.field}' "
                              f"(fields: {', '.join(chunk.columns) or 'none'}). Set tokenize_images(field=...) to the "
                              f"field that holds the caption or the interleaved texts.")
        texts = chunk.columns[self.field]
        all_images, all_grids = chunk.columns[IMAGES], chunk.columns[IMAGE_GRID]
        tok = self.loaded
        start, pad, end = self.image_ids
        pieces: list[str] = []
        layouts = [self._parts(chunk, j, texts[j], all_images[j] or [], pieces) for j in range(chunk.n)]
        flat, lengths = tok.encode_plain(pieces)
        flat, lengths = self._no_image_ids_in_text(chunk, flat, lengths)
        piece_at = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=piece_at[1:])
        bos = [tok.bos_id] if self.spec.add_bos else []
        eos = [tok.eos_id] if self.spec.add_eos else []
        arrays: list[np.ndarray] = []  # every token of the chunk, part by part
        image_flags: list[np.ndarray] = []
        doc_lengths: list[int] = []
        keep: list[int] = []
        out_images: list[list[np.ndarray]] = []
        out_grids: list[list[tuple[int, int, int]]] = []
        out_spans: list[np.ndarray] = []
        frame_b, frame_e = np.asarray(bos, dtype=np.int32), np.asarray(eos, dtype=np.int32)
        no_b, no_e = np.zeros(len(bos), bool), np.zeros(len(eos), bool)  # BOS/EOS are not image tokens
        for j, parts in enumerate(layouts):
            if not parts:
                continue
            imgs, grids = all_images[j], all_grids[j]
            doc: list[np.ndarray] = [frame_b]
            flags: list[np.ndarray] = [no_b]
            kept_imgs, kept_grids, spans = [], [], []
            pos = len(bos)
            for kind, k in parts:
                if kind == 0:
                    ids = flat[piece_at[k]:piece_at[k + 1]]
                    doc.append(ids)
                    flags.append(np.zeros(len(ids), bool))
                    pos += len(ids)
                    continue
                n = self._tokens_of(chunk, j, grids[k])
                ids = np.full(n + (start is not None) + (end is not None), pad, dtype=np.int32)
                if start is not None:
                    ids[0] = start
                if end is not None:
                    ids[-1] = end
                doc.append(ids)
                flags.append(np.ones(len(ids), bool))
                kept_imgs.append(imgs[k])
                kept_grids.append(tuple(grids[k]))
                first = pos + (start is not None)
                spans.append((pos, first, first + n, pos + len(ids)))  # where the packer may not cut
                pos += len(ids)
            doc.append(frame_e)
            flags.append(no_e)
            length = sum(len(a) for a in doc)
            if length == 0:
                continue
            arrays += doc
            image_flags += flags
            doc_lengths.append(length)
            keep.append(j)
            out_images.append(kept_imgs)
            out_grids.append(kept_grids)
            out_spans.append(np.asarray(spans, dtype=np.int32).reshape(len(spans), 4))
        chunk.count("blank_records", chunk.n - len(keep))
        tokens = np.concatenate(arrays).astype(np.int32, copy=False) if arrays else np.zeros(0, np.int32)
        offsets = np.zeros(len(keep) + 1, dtype=np.int64)
        np.cumsum(np.asarray(doc_lengths, dtype=np.int64), out=offsets[1:])
        mask = np.ones(len(tokens), dtype=np.uint8)
        if not self.loss_on_images and len(tokens):
            is_image = np.concatenate(image_flags)
            mask[:-1] = ~is_image[1:]  # the label at i is token i+1
            mask[offsets[1:] - 1] = 1  # a document's last label is its tail, never an image token
        out = chunk.select(np.asarray(keep, dtype=np.int64))
        columns = {k: v for k, v in out.columns.items() if self.keep_field or k != self.field}
        columns[IMAGES], columns[IMAGE_GRID], columns[IMAGE_SPANS] = out_images, out_grids, out_spans
        out.columns = columns
        out.token_fields = {INPUT_IDS: tokens, LOSS_MASK: mask}
        out.offsets = offsets
        return out

    def _no_image_ids_in_text(self, chunk: Chunk, flat: np.ndarray, lengths: np.ndarray
                              ) -> tuple[np.ndarray, np.ndarray]:
        """The text pieces' tokens without the image ids: a text that spells ``<|image_pad|>`` (the tokenizer
        maps it to the special id) would otherwise add image tokens that no image fills, and a model that
        scatters image features into the pad positions would fail. Dropped and counted (``image_ids_in_text``)."""
        ids = [i for i in self.image_ids if i is not None]
        hit = np.isin(flat, ids)
        if not hit.any():
            return flat, lengths
        chunk.count("image_ids_in_text", int(hit.sum()))
        piece_of = np.repeat(np.arange(len(lengths)), lengths)
        lengths = np.asarray(lengths) - np.bincount(piece_of[hit], minlength=len(lengths))
        return flat[~hit], lengths

    def _tokens_of(self, chunk: Chunk, j: int, grid: Any) -> int:
        t, h, w = (int(v) for v in grid)
        m = self.merge
        if h % m or w % m:
            raise SourceError(f"operator '{self.name}': {chunk.where(j)}: an image grid of {h} x {w} patches is not "
                              f"a whole number of {m} x {m} merge groups: give tokenize_images the merge of "
                              f"decode_images.")
        return t * h * w // (m * m)


__all__ = ["TokenizeImages"]
