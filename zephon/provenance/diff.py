"""``zephon.diff``: where two pipelines' streams part, lane by lane, and what each delivers per source.

Both pipelines run side by side, step by step. Each step's global batch is cut into its lanes' rows and
every lane's rows are hashed (every row tensor, payloads and the lane's images included); the first step
where a lane's hash differs is the first differing step, and the lanes that differ there say where. The
delivered tokens per source and step (from the batches' provenance) show what a change did to the mixture.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..batches.packed import _hash_value, batch_digest
from ..loader import ZephonLoader
from ..origins import PROVENANCE_KEY
from ._run import contiguous, state_of, with_provenance
from .segments import SOURCE, TOKEN_END, TOKEN_START


@dataclass
class DiffReport:
    """Two pipelines compared step by step.

    Attributes:
        steps: how many steps were compared (fewer than asked when a pipeline's data ended).
        first_step: the first global step whose batches differ (None: none of the compared steps).
        lanes: the lanes whose rows differ at ``first_step`` (empty when the two cut their batches into lanes
            differently: then whole batches are compared).
        tokens_a: per source name, the tokens ``a`` delivered at each step (records, for a pipeline without
            ``pack()``), ``int64 [steps]``.
        tokens_b: the same for ``b``.
        first_step_of_lane: per lane, the first step where it differs (lanes that never do are absent).
        ended: ``"a"`` or ``"b"`` when that pipeline's data ended at ``first_step`` while the other's went on
            (the streams differ in length there), None otherwise.
    """

    steps: int
    first_step: int | None
    lanes: list[int]
    tokens_a: dict[str, np.ndarray]
    tokens_b: dict[str, np.ndarray]
    first_step_of_lane: dict[int, int] = field(default_factory=dict)
    ended: str | None = None

    def summary(self) -> str:
        """A few lines for people: the verdict, the lanes, and each source's delivered share in both."""
        if self.first_step is None:
            head = f"identical for all {self.steps} steps compared"
        elif self.ended is not None:
            other = "b" if self.ended == "a" else "a"
            head = f"first differing step: {self.first_step} ({self.ended}'s data ends there, {other}'s goes on)"
        else:
            where = f"lanes {_ranges(self.lanes)}" if self.lanes else "the batches (lane layouts differ)"
            head = f"first differing step: {self.first_step} ({where})"
        lines = [head]
        names = list(dict.fromkeys([*self.tokens_a, *self.tokens_b]))
        tot_a = sum(int(v.sum()) for v in self.tokens_a.values()) or 1
        tot_b = sum(int(v.sum()) for v in self.tokens_b.values()) or 1
        for n in names:
            a = int(self.tokens_a[n].sum()) if n in self.tokens_a else 0
            b = int(self.tokens_b[n].sum()) if n in self.tokens_b else 0
            lines.append(f"  {n}: delivered share a {a / tot_a:.3f}, b {b / tot_b:.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON data."""
        return {"steps": self.steps, "first_step": self.first_step, "lanes": self.lanes, "ended": self.ended,
                "first_step_of_lane": {str(k): v for k, v in self.first_step_of_lane.items()},
                "tokens_a": {k: v.tolist() for k, v in self.tokens_a.items()},
                "tokens_b": {k: v.tolist() for k, v in self.tokens_b.items()}}

    def plot(self, path: str) -> None:
        """Draw the delivered tokens per source and step of both pipelines (a solid, b dashed), and the first
        differing step (needs matplotlib).

        Args:
            path: the PNG file to write.
        """
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4))
        names = list(dict.fromkeys([*self.tokens_a, *self.tokens_b]))
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        x = np.arange(self.steps)
        for k, n in enumerate(names):
            c = colors[k % len(colors)]
            if n in self.tokens_a:
                ax.plot(x, self.tokens_a[n][:self.steps], color=c, label=f"{n} (a)")
            if n in self.tokens_b:
                ax.plot(x, self.tokens_b[n][:self.steps], color=c, linestyle="--", label=f"{n} (b)")
        if self.first_step is not None:
            ax.axvline(self.first_step, color="black", linewidth=0.8)
            ax.annotate(f"first difference: step {self.first_step}", (self.first_step, ax.get_ylim()[1]),
                        textcoords="offset points", xytext=(4, -12), fontsize=8)
        ax.set_xlabel("global step")
        ax.set_ylabel("tokens delivered")
        ax.set_title("delivered tokens per source: a (solid) vs b (dashed)")
        ax.legend(fontsize=8, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def diff(a: Any, b: Any, steps: int, *, state_a: Any = None, state_b: Any = None, num_workers: int = 0,
         runner: str = "thread") -> DiffReport:
    """Compare two pipelines' first ``steps`` global batches (from their states, if given), lane by lane.

    Args:
        a: a :class:`~zephon.Pipeline` or a recipe (provenance is turned on; it changes no byte).
        b: the other one.
        steps: how many global steps to compare.
        state_a: a loader state (dict or path) to start ``a`` from (None: the start).
        state_b: the same for ``b``.
        num_workers: as for :func:`zephon.build_loader`, for both.
        runner: as for :func:`zephon.build_loader`, for both.

    Returns:
        A :class:`DiffReport`. When one pipeline's data ends before the other's, the step where it does is
        the first differing step (``ended`` says which).

    Raises:
        ValueError: ``state_a`` and ``state_b`` were saved at different steps (their batches cannot be paired).
    """
    pa, pb = with_provenance(a), with_provenance(b)
    la = ZephonLoader(pa, 0, 1, num_workers=num_workers, runner=runner, reuse_batch_memory=False)
    lb = ZephonLoader(pb, 0, 1, num_workers=num_workers, runner=runner, reuse_batch_memory=False)
    try:
        for loader, st in ((la, state_of(state_a)), (lb, state_of(state_b))):
            if st is not None:
                loader.load_state_dict(st)
        start = la.step
        if lb.step != start:
            raise ValueError(f"diff: state_a was saved at step {start} and state_b at step {lb.step}; pass states of "
                             f"the same step (or none) so that the two streams are compared step for step")
        same_layout = (pa.lanes, la.program.rows_per_lane) == (pb.lanes, lb.program.rows_per_lane)
        tok_a: dict[str, list[int]] = {n: [] for n in la.program.names}
        tok_b: dict[str, list[int]] = {n: [] for n in lb.program.names}
        first: int | None = None
        lanes: list[int] = []
        first_of_lane: dict[int, int] = {}
        ended: str | None = None
        done = 0
        ia, ib = iter(la), iter(lb)
        for k in range(steps):
            ba, bb = next(ia, None), next(ib, None)
            if ba is None or bb is None:
                if (ba is None) != (bb is None) and first is None:  # one stream is longer: they differ here
                    first, ended = start + k, "a" if ba is None else "b"
                break
            done += 1
            _tokens(ba, la.program.names, tok_a)
            _tokens(bb, lb.program.names, tok_b)
            if same_layout:
                rpl = la.program.rows_per_lane
                da, db = _lane_digests(ba, pa.lanes, rpl), _lane_digests(bb, pb.lanes, rpl)
                differ = [lane for lane in range(pa.lanes) if da[lane] != db[lane]]
                for lane in differ:
                    first_of_lane.setdefault(lane, start + k)
            else:
                differ = [] if _digest(ba) == _digest(bb) else [-1]
            if differ and first is None:
                first, lanes = start + k, [x for x in differ if x >= 0]
        return DiffReport(done, first, lanes, {n: np.asarray(v, dtype=np.int64) for n, v in tok_a.items()},
                          {n: np.asarray(v, dtype=np.int64) for n, v in tok_b.items()}, first_of_lane, ended)
    finally:
        la.close()
        lb.close()


def _tokens(batch: Mapping[str, Any], names: list[str], acc: dict[str, list[int]]) -> None:
    table = batch[PROVENANCE_KEY].numpy()
    counts = np.zeros(len(names), dtype=np.int64)
    known = table[:, SOURCE] >= 0
    if "segment_ids" in batch:
        # a segment's length: its token range (a piece of unknown origin, which an accumulator of yours rebuilt
        # as a plain dict, counts 0: its source is unknown too)
        lengths = np.where(table[:, TOKEN_START] >= 0, table[:, TOKEN_END] - table[:, TOKEN_START], 0)
        np.add.at(counts, table[known, SOURCE], lengths[known])
    else:
        np.add.at(counts, table[known, SOURCE], 1)
    for n, c in zip(names, counts.tolist()):
        acc[n].append(c)


def _row_keys(batch: Mapping[str, Any]) -> list[str]:
    rows = int(batch["input_ids"].shape[0]) if "input_ids" in batch else len(batch["valid"])
    return sorted(k for k, v in batch.items() if k not in (PROVENANCE_KEY, "cu_seqlens")
                  and (isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows and not k.startswith(("pixel", "image"))
                       or isinstance(v, list) and len(v) == rows))


def _lane_digests(batch: Mapping[str, Any], lanes: int, rpl: int) -> list[str]:
    """One SHA-256 per lane over its rows of every row-shaped key (and the pixels of its rows' images)."""
    out = []
    keys = _row_keys(batch)
    image_row = batch["image_row"].numpy() if "image_row" in batch else None
    patches = None
    if image_row is not None and "image_grid_thw" in batch:
        grid = batch["image_grid_thw"].numpy()
        patches = np.concatenate([[0], np.cumsum(grid.prod(axis=1))])
    for lane in range(lanes):
        h = hashlib.sha256()
        a, b = lane * rpl, (lane + 1) * rpl
        for k in keys:
            v = batch[k]
            h.update(k.encode())
            if isinstance(v, torch.Tensor):
                h.update(v[a:b].contiguous().numpy().tobytes())
            else:
                _hash_value(h, v[a:b])
        if image_row is not None and patches is not None and "pixel_values" in batch:  # pixels="flat"
            pix = batch["pixel_values"].numpy()
            mine = np.flatnonzero((image_row >= a) & (image_row < b))
            for k in ("image_row", "image_grid_thw", "image_token_start"):  # each image's row, size and position
                if k in batch:
                    h.update(batch[k].numpy()[mine].tobytes())
            for img in mine.tolist():
                h.update(pix[patches[img]:patches[img + 1]].tobytes())
        elif "image_mask" in batch and "pixel_values" in batch:  # pixels="fixed": M slots per row
            slots = len(batch["image_mask"]) // max(1, lanes * rpl)
            for k in ("pixel_values", "image_mask", "image_grid_thw", "image_token_start"):
                if k in batch:
                    h.update(batch[k][a * slots:b * slots].contiguous().numpy().tobytes())
        out.append(h.hexdigest())
    return out


def _digest(batch: Mapping[str, Any]) -> str:
    return batch_digest({k: v for k, v in batch.items() if k != PROVENANCE_KEY})


def _ranges(lanes: list[int]) -> str:
    return ", ".join(str(r.start) if len(r) == 1 else f"{r.start}-{r[-1]}" for r in contiguous(lanes))
