"""Hugging Face ``datasets`` on disk (``format = "hf"``), read with pyarrow alone: no network, ever.

``path`` names one of these folders, and ``split`` (default ``"train"``) and ``config`` pick the files:

- a folder written by ``Dataset.save_to_disk``: its ``state.json`` lists the ``data-*.arrow`` files
  (Arrow IPC streams); its ``_split``, when recorded, must be ``split``;
- a folder written by ``DatasetDict.save_to_disk``: ``dataset_dict.json`` lists the splits, each a
  ``Dataset`` folder of its own;
- a ``datasets`` cache folder (``~/.cache/huggingface/datasets/<owner>___<name>``, or one of its
  ``<config>/<version>/<hash>`` folders): the folders holding a ``dataset_info.json``, its
  ``config_name`` matched against ``config``, and the ``<name>-<split>[-NNNNN-of-NNNNN].arrow`` (or
  ``.parquet``) files of the split;
- a Hub cache folder of a dataset repository (``~/.cache/huggingface/hub/datasets--<owner>--<name>``,
  the snapshot of ``refs/main``, or one ``snapshots/<revision>`` folder): its Parquet and Arrow files,
  those under the folder named ``config`` when it is set, of the split by the Hub's file-naming
  convention (a file or folder named after the split, or with the split between separators,
  ``-._ `` or digits: ``data/train-00000-of-00002.parquet``, ``en/train/0000.parquet``).

The ``datasets`` library is never called (its loading functions may go to the network); the files are
listed here and read by the Arrow IPC and Parquet readers (:mod:`zephon.readers.arrow`,
:mod:`zephon.readers.parquet`): record batches and row groups are the units' groups. A ``datasets``
``Image`` or ``Audio`` column is a struct (``{"bytes", "path"}``) and is read as such.
"""

from __future__ import annotations

import json
import posixpath
import re
from typing import Any, Sequence

import fsspec
import numpy as np

from .arrow import ArrowReader
from .base import DEFAULT_DOC_LIMIT, DocLimit, GroupedReader, RawChunk, path_not_found
from ..errors import SourceError
from .parquet import ParquetReader

DEFAULT_SPLIT = "train"
DATA_EXTENSIONS = (".arrow", ".parquet")
_SEPARATORS = r"[-._ 0-9]"  # what may stand around a split name in a Hub file or folder name
_SHARD = r"(?:-\d{5}-of-\d{5})?"


def _join(root: str, *names: str) -> str:
    return posixpath.join(root.rstrip("/"), *names) if "://" in root else "/".join([root.rstrip("/"), *names])


def _list(values: Sequence[str]) -> str:
    return ", ".join(sorted(values)) or "none"


class _Finder:
    """Lists the data files of one ``path`` of an ``hf`` source (see the module docstring)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, split: str, config: str | None) -> None:
        self.fs, self.source, self.split, self.config = fs, source, split, config

    def fail(self, what: str) -> SourceError:
        return SourceError(f"source '{self.source}': {what}")

    def json(self, path: str) -> Any:
        try:
            data = json.loads(self.fs.cat_file(path))
        except (ValueError, UnicodeDecodeError) as exc:
            raise self.fail(f"{path} is not valid JSON ({exc}). The dataset folder is damaged: save it again "
                            f"(save_to_disk) or download it again.") from exc
        if not isinstance(data, dict):
            raise self.fail(f"{path} is not a JSON object. The dataset folder is damaged: save it again.")
        return data

    def files(self, root: str) -> list[str]:
        if any(c in root for c in "*?["):
            raise self.fail(f"path '{root}': a format = \"hf\" path is one dataset folder, not a glob (list several "
                            f"sources, or use format = \"arrow\" or \"parquet\" for loose files).")
        if self.fs.isfile(root):
            raise self.fail(f"path '{root}' is a file: point path at the dataset folder (save_to_disk output or a "
                            f"cache folder), or read loose files with format = \"arrow\" or \"parquet\".")
        if self.fs.exists(_join(root, "dataset_dict.json")):
            return self.dataset_dict(root)
        if self.fs.exists(_join(root, "state.json")):
            return self.saved_dataset(root, None)
        if self.fs.isdir(_join(root, "snapshots")) or posixpath.basename(posixpath.dirname(root.rstrip("/"))) \
                == "snapshots":
            return self.hub_snapshot(root)
        infos = [p for depth in range(5) for p in self.fs.glob(_join(root, *["*"] * depth, "dataset_info.json"))
                 if ".incomplete" not in p]
        if infos:
            return self.prepared(root, sorted(infos))
        raise self.fail(f"path '{root}' is not a Hugging Face dataset folder: it has no dataset_dict.json or "
                        f"state.json (save_to_disk), no dataset_info.json below it (a datasets cache folder) and "
                        f"no snapshots/ folder (a Hub cache folder). Point path at one of those.")

    # -- save_to_disk ----------------------------------------------------------------------------------
    def dataset_dict(self, root: str) -> list[str]:
        index = _join(root, "dataset_dict.json")
        splits = self.json(index).get("splits")
        if not isinstance(splits, list) or not all(isinstance(s, str) and s and "/" not in s and s not in (".", "..")
                                                   for s in splits):
            raise self.fail(f"{index}: 'splits' must be a list of split names. The folder is damaged: save it again.")
        if self.config is not None:
            raise self.fail(f"{root} is a DatasetDict saved with save_to_disk, which has no configs: remove config "
                            f"= \"{self.config}\" from the source (splits: {_list(splits)}).")
        if self.split not in splits:
            raise self.fail(f"{root} has no split '{self.split}' (its dataset_dict.json lists {_list(splits)}). Set "
                            f"split to one of them.")
        return self.saved_dataset(_join(root, self.split), self.split)

    def saved_dataset(self, folder: str, split_of_dict: str | None) -> list[str]:
        state_path = _join(folder, "state.json")
        state = self.json(state_path)
        recorded = state.get("_split")
        if recorded is not None and recorded != (split_of_dict or self.split):
            raise self.fail(f"{folder} holds split '{recorded}' (state.json), not '{self.split}': set split = "
                            f"\"{recorded}\", or point path at the folder of split '{self.split}'.")
        if self.config is not None and split_of_dict is None:
            info_path = _join(folder, "dataset_info.json")
            name = self.json(info_path).get("config_name") if self.fs.exists(info_path) else None
            if name != self.config:
                raise self.fail(f"{folder} (saved with save_to_disk) records config {name!r}, not '{self.config}': "
                                f"remove config from the source, or point path at that config's folder.")
        entries = state.get("_data_files")
        names = [e.get("filename") for e in entries] if isinstance(entries, list) and all(
            isinstance(e, dict) for e in entries) else None
        if not names or not all(isinstance(n, str) and n.endswith(".arrow") and "/" not in n and "\\" not in n
                                and not n.startswith(".") for n in names):
            raise self.fail(f"{state_path}: '_data_files' must list the folder's .arrow files by name "
                            f"([{{\"filename\": \"data-00000-of-00001.arrow\"}}, ...]). The folder is damaged: save it "
                            f"again with save_to_disk.")
        files = [_join(folder, n) for n in names]
        missing = [f for f in files if not self.fs.isfile(f)]
        if missing:
            raise self.fail(f"{missing[0]} is listed in {state_path} but missing. Restore it, or save the dataset "
                            f"again with save_to_disk.")
        return files

    # -- a datasets cache (download_and_prepare) ----------------------------------------------------------
    def prepared(self, root: str, infos: list[str]) -> list[str]:
        found: dict[str, str] = {}  # folder -> config name
        for info_path in infos:
            folder = posixpath.dirname(info_path)
            name = self.json(info_path).get("config_name")
            found[folder] = name if isinstance(name, str) else posixpath.basename(
                posixpath.dirname(posixpath.dirname(folder)))
        configs = sorted(set(found.values()))
        if self.config is not None:
            found = {f: c for f, c in found.items() if c == self.config}
            if not found:
                raise self.fail(f"{root} has no config '{self.config}' (its dataset_info.json files name "
                                f"{_list(configs)}). Set config to one of them.")
        elif len(configs) > 1:
            raise self.fail(f"{root} holds several configs ({_list(configs)}): set config to one of them.")
        if len(found) > 1:
            raise self.fail(f"{root} holds {len(found)} prepared copies of config '{next(iter(found.values()))}' "
                            f"({_list(found)}): point path at one of them.")
        folder = next(iter(found))
        pattern = re.compile(rf".+-{re.escape(self.split)}{_SHARD}\.(?:arrow|parquet)$")
        files = [p for p in self.fs.ls(folder, detail=False) if pattern.match(posixpath.basename(p))]
        if not files:
            splits = self.json(_join(folder, "dataset_info.json")).get("splits")
            names = list(splits) if isinstance(splits, dict) else []
            raise self.fail(f"{folder} has no files of split '{self.split}' (<name>-{self.split}.arrow; its "
                            f"dataset_info.json lists the splits {_list(names)}). Set split to one of them.")
        return files

    # -- a Hub cache (huggingface_hub snapshot) -------------------------------------------------------------
    def hub_snapshot(self, root: str) -> list[str]:
        snapshot = root
        if self.fs.isdir(_join(root, "snapshots")):
            ref = _join(root, "refs", "main")
            if self.fs.isfile(ref):
                revision = self.fs.cat_file(ref).decode("utf-8", "replace").strip()
                if not re.fullmatch(r"[0-9a-fA-F]{7,64}", revision):
                    raise self.fail(f"{ref} does not hold a commit hash. Point path at a snapshots/<revision> folder.")
                snapshot = _join(root, "snapshots", revision)
                if not self.fs.isdir(snapshot):
                    raise self.fail(f"{ref} names revision {revision}, but {snapshot} is missing. Point path at a "
                                    f"snapshots/<revision> folder, or download the dataset again.")
            else:
                listed = self.fs.ls(_join(root, "snapshots"), detail=False)
                revisions = [posixpath.basename(p.rstrip("/")) for p in listed]
                if len(revisions) != 1:
                    raise self.fail(f"{root} has no refs/main and {len(revisions)} snapshots ({_list(revisions)}): "
                                    f"point path at one snapshots/<revision> folder.")
                snapshot = _join(root, "snapshots", revisions[0])
        data = sorted(p for p in self.fs.find(snapshot) if p.endswith(DATA_EXTENSIONS))
        rel = {p: posixpath.relpath(p, snapshot).split("/") if "://" not in p else
               p[len(snapshot.rstrip("/")) + 1:].split("/") for p in data}
        rel = {p: parts for p, parts in rel.items() if not any(part.startswith(".") for part in parts)}
        if not rel:
            raise self.fail(f"{snapshot} holds no Parquet or Arrow files. Download the dataset's data files "
                            f"(huggingface_hub.snapshot_download) or point path at another folder.")
        split = re.compile(rf"(?:^|{_SEPARATORS}){re.escape(self.split)}(?:{_SEPARATORS}|$)")
        folders = sorted({parts[0] for parts in rel.values() if len(parts) > 1})
        if self.config is not None:
            under = {p: parts[1:] for p, parts in rel.items() if len(parts) > 1 and parts[0] == self.config}
            if not under and not (self.config == "default" and self.config not in folders):
                raise self.fail(f"{snapshot} has no folder for config '{self.config}' (its folders with data files: "
                                f"{_list(folders)}). Set config to one of them, or remove it.")
            rel = under or rel
        files = sorted(p for p, parts in rel.items() if any(split.search(part) for part in parts))
        if not files:
            names = sorted({"/".join(parts) for parts in rel.values()})[:8]
            raise self.fail(f"{snapshot} has no files of split '{self.split}' (a file or folder named after the "
                            f"split, e.g. {self.split}-00000-of-00001.parquet; its data files: {', '.join(names)}). "
                            f"Set split to the right name.")
        if self.config is None:
            groups = {rel[p][0] for p in files if len(rel[p]) > 1 and not split.search(rel[p][0])}
            top = [p for p in files if len(rel[p]) == 1 or split.search(rel[p][0])]
            if len(groups) + (1 if top else 0) > 1:
                raise self.fail(f"{snapshot} has files of split '{self.split}' in several folders ({_list(groups)}"
                                f"{', and at its top' if top else ''}): set config to the folder to read.")
        return files


def list_files(fs: fsspec.AbstractFileSystem, root: str, source: str, pattern: str, origin: str,
               split: str | None, config: str | None) -> list[str]:
    """The data files of the ``hf`` dataset folder ``root`` (``pattern`` as written) for ``split`` and ``config``."""
    if not any(c in root for c in "*?[") and not fs.exists(root):
        raise path_not_found(origin, source, pattern)
    return _Finder(fs, source, split or DEFAULT_SPLIT, config).files(root)


class HfReader(GroupedReader):
    """Reads the files of an ``hf`` source: Arrow IPC files with :class:`ArrowReader`, Parquet files with
    :class:`ParquetReader` (record batches / row groups as groups, the same units as either format)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, source: str, text_field: str, chunk_rows: int,
                 cache_bytes: int = 1 << 30, tokens_field: str | None = None,
                 doc_limit: DocLimit = DEFAULT_DOC_LIMIT, columns: Sequence[str] | None = None) -> None:
        self.text_field = tokens_field or text_field  # the record field of a one-column source
        self.chunk_rows = chunk_rows
        self.arrow = ArrowReader(fs, source, text_field, chunk_rows, cache_bytes, tokens_field, doc_limit, columns)
        self.parquet = ParquetReader(fs, source, text_field, chunk_rows, cache_bytes, tokens_field, doc_limit, columns)

    def _reader(self, path: str) -> Any:
        return self.parquet if path.endswith(".parquet") else self.arrow

    def group_starts(self, path: str) -> np.ndarray:
        return self._reader(path).group_starts(path)

    def column_names(self, path: str) -> list[str]:
        return self._reader(path).column_names(path)

    def read(self, path: str, start: int, end: int) -> RawChunk:
        return self._reader(path).read(path, start, end)
