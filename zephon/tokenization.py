"""Tokenizers behind one batched call: texts in, one flat int32 array plus offsets out.

Every backend is called once per chunk of documents (``encode_batch_fast`` for Hugging Face
``tokenizers``, a list call for SentencePiece, ``encode_ordinary_batch`` for tiktoken); EOS (and
optionally BOS) is added with numpy, not per token in Python.

A tokenizer file is checked before a backend reads it: a missing file, a folder, a file of another
kind than ``tokenizer.kind`` (recognised by its content) or one no backend can read is a
:class:`~zephon.recipe.RecipeError` that names ``tokenizer.path``, ``tokenizer.kind`` and what the file
looks like, not a backend's traceback.
"""

from __future__ import annotations

import base64
import itertools
import re
from pathlib import Path
from typing import Sequence

import numpy as np

from .recipe import RecipeError, RecipeFileError, TokenizerSpec

# The split regex of OpenAI's cl100k encoding, the usual choice for a .tiktoken BPE file.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s+"""
)
_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
# What each kind's file is, for the messages.
KIND_FILES = {
    "sentencepiece": "a SentencePiece model (binary protobuf, usually *.model)",
    "huggingface": "a Hugging Face tokenizer.json (a JSON object with a \"model\")",
    "tiktoken": "a tiktoken BPE file (lines of `base64-token rank`, usually *.tiktoken)",
}
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]+={0,2} [0-9]+\r?")
_SNIFF_BYTES = 4096


def sniff_tokenizer_kind(path: Path) -> str | None:
    """The tokenizer kind that the file at ``path`` looks like, from its content, or None.

    ``huggingface``: a JSON object naming a ``"model"``; ``tiktoken``: its first lines are ``base64 rank``;
    ``sentencepiece``: a protobuf ``ModelProto`` (field 1, the pieces, first: ``0x0A``, a length, then the
    first piece's own field 1, ``0x0A``). A cheap look, not a parse: the backend still has the last word."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    if head.lstrip()[:1] == b"{":
        return "huggingface" if b'"model"' in path.read_bytes() else None
    lines = [line for line in head.split(b"\n")[:8] if line]
    complete = lines[:-1] if len(head) == _SNIFF_BYTES else lines  # the last line may be cut by the read
    if complete and all(_TIKTOKEN_LINE.fullmatch(line) for line in complete):
        return "tiktoken"
    if head[:1] == b"\x0a":
        i = 1
        while i < len(head) and head[i] & 0x80:  # skip the varint length of the first piece
            i += 1
        if i + 1 < len(head) and head[i + 1] == 0x0A:
            return "sentencepiece"
    return None


def _check_file(spec: TokenizerSpec) -> tuple[Path, str | None]:
    """``tokenizer.path`` as a file that does not look like another kind than ``tokenizer.kind``, and the
    kind it looks like; or a RecipeError saying what is wrong."""
    path, kind = Path(spec.path), spec.kind
    if kind not in KIND_FILES:  # a TokenizerSpec built by hand (a recipe's is validated already)
        raise RecipeError(f"tokenizer.kind '{kind}' is not one of {', '.join(KIND_FILES)}.")
    where = f"tokenizer.path = {spec.path} (tokenizer.kind = '{kind}')"
    if path.is_dir():
        inside = sorted(q.name for q in path.iterdir()
                        if q.is_file() and (q.name.endswith((".model", ".tiktoken")) or q.name == "tokenizer.json"))
        hint = f"; it holds {', '.join(inside[:5])}: point tokenizer.path at one of them" if inside else \
            f"; point tokenizer.path at {KIND_FILES[kind]}"
        raise RecipeFileError(f"{where} is a directory, not a tokenizer file{hint}.")
    if not path.is_file():
        raise RecipeFileError(f"tokenizer file not found: {where} does not exist. Fix tokenizer.path in the recipe "
                              f"(relative paths resolve against the recipe's folder).")
    try:
        looks = sniff_tokenizer_kind(path)
    except OSError as exc:
        raise RecipeError(f"{where} cannot be read ({type(exc).__name__}: {exc}).") from exc
    if looks is not None and looks != kind:
        raise RecipeError(f"{where}: the file looks like {KIND_FILES[looks]}, not {KIND_FILES[kind]}. Set "
                          f"tokenizer.kind = '{looks}', or point tokenizer.path at {KIND_FILES[kind]}.")
    return path, looks


class Tokenizer:
    """A loaded tokenizer with its special ids. Build with :func:`load_tokenizer`."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        path, looks = _check_file(spec)
        self._encode = None
        try:
            getattr(self, f"_load_{spec.kind}")(path)
        except (RecipeError, ImportError):  # already says what to fix / a library to install
            raise
        except Exception as exc:  # each backend has its own errors for a file it cannot read
            looks_like = "looks like one but is damaged or truncated" if looks == spec.kind else \
                "looks like none of the kinds Zephon reads (sentencepiece, tiktoken, huggingface)"
            raise RecipeError(f"tokenizer.path = {spec.path} cannot be read as tokenizer.kind = '{spec.kind}' "
                              f"({type(exc).__name__}: {str(exc)[:300]}). It should be {KIND_FILES[spec.kind]}; "
                              f"the file {looks_like}: point tokenizer.path at a good file.") from exc
        if spec.add_eos and self.eos_id is None:
            raise RecipeError(f"tokenizer {spec.path} has no EOS token; set tokenizer.eos_token to its name "
                              f"or add_eos = false.")
        if spec.add_bos and self.bos_id is None:
            raise RecipeError(f"tokenizer {spec.path} has no BOS token; set tokenizer.bos_token or "
                              f"add_bos = false.")
        if spec.pad_id is not None and not 0 <= spec.pad_id < self.vocab_size:
            raise RecipeError(f"tokenizer.pad_id = {spec.pad_id} is outside [0, {self.vocab_size}), the ids of "
                              f"tokenizer {spec.path}; use an id of this tokenizer, or leave pad_id out to pad "
                              f"with EOS ({self.eos_id}).")
        self.pad_id = spec.pad_id if spec.pad_id is not None else (self.eos_id or 0)

    # -- backends -------------------------------------------------------------------------------
    def _load_sentencepiece(self, path: Path) -> None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = sp.get_piece_size()
        self.eos_id = _named(sp, self.spec.eos_token, sp.eos_id(), "eos_token")
        self.bos_id = _named(sp, self.spec.bos_token, sp.bos_id(), "bos_token")
        self._encode = lambda texts: sp.encode(list(texts), out_type=int, num_threads=1)
        self._backend = sp

    def _load_huggingface(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(path))
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = _first_id(tok.token_to_id, self.spec.eos_token, _EOS_NAMES, "eos_token")
        self.bos_id = _first_id(tok.token_to_id, self.spec.bos_token, _BOS_NAMES, "bos_token")
        self._encode = lambda texts: [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]
        self._backend = tok

    def _load_tiktoken(self, path: Path) -> None:
        import tiktoken

        ranks = {base64.b64decode(tok): int(rank) for tok, rank in
                 (line.split() for line in path.read_text().splitlines() if line)}
        eos_name = self.spec.eos_token or "<|endoftext|>"
        special = {eos_name: len(ranks)}
        if self.spec.bos_token:
            special[self.spec.bos_token] = len(ranks) + 1
        enc = tiktoken.Encoding(name=path.stem, pat_str=self.spec.pat_str or CL100K_PATTERN,
                                mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = enc.n_vocab
        self.eos_id = special[eos_name]
        self.bos_id = special.get(self.spec.bos_token) if self.spec.bos_token else None
        self._encode = lambda texts: enc.encode_ordinary_batch(list(texts), num_threads=1)
        self._backend = enc

    # -- one text with character offsets (chat templates: which tokens are the assistant's) ------------
    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, starts, ends)`` of one text, without BOS/EOS: each token's character range in ``text``."""
        kind, b = self.spec.kind, self._backend
        if kind == "huggingface":
            enc = b.encode(text, add_special_tokens=False)
            spans = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            return np.asarray(enc.ids, dtype=np.int32), spans[:, 0], spans[:, 1]
        if kind == "sentencepiece":
            proto = b.encode(text, out_type="proto")
            char_of_byte = np.zeros(len(text.encode("utf-8")) + 1, dtype=np.int64)
            pos = 0
            for i, ch in enumerate(text):
                n = len(ch.encode("utf-8"))
                char_of_byte[pos:pos + n] = i
                pos += n
            char_of_byte[pos] = len(text)
            ids = np.fromiter((p.id for p in proto.pieces), dtype=np.int32)
            starts = np.fromiter((char_of_byte[p.begin] for p in proto.pieces), dtype=np.int64, count=len(ids))
            ends = np.fromiter((char_of_byte[p.end] for p in proto.pieces), dtype=np.int64, count=len(ids))
            return ids, starts, ends
        ids_list = b.encode_ordinary(text)
        _, starts_list = b.decode_with_offsets(ids_list)
        starts = np.asarray(starts_list, dtype=np.int64)
        ends = np.append(starts[1:], len(text)) if len(starts) else starts
        return np.asarray(ids_list, dtype=np.int32), starts, ends

    def token_text(self, token_id: int | None) -> str:
        """The text of one token id (e.g. the EOS token's name for a chat template), '' for None."""
        if token_id is None:
            return ""
        kind, b = self.spec.kind, self._backend
        if kind == "huggingface":
            return b.id_to_token(token_id) or ""
        if kind == "sentencepiece":
            return b.id_to_piece(token_id)
        return b.decode([token_id])

    # -- the batched call -----------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize ``texts``; returns ``(tokens int32 [T], offsets int64 [n+1])`` with EOS/BOS added."""
        ids = self._encode(texts)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return self.frame(flat, lengths)

    def encode_plain(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize ``texts`` without BOS/EOS (pieces of one document, framed later by the caller): one
        batched backend call; returns ``(tokens int32 [T], lengths int64 [n])``."""
        ids = self._encode(texts) if texts else []
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())), lengths

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry by its text (e.g. a special token ``<|image_pad|>``), None if absent."""
        kind, b = self.spec.kind, self._backend
        if kind == "huggingface":
            return b.token_to_id(token)
        if kind == "sentencepiece":
            tid = b.piece_to_id(token)
            return tid if b.id_to_piece(tid) == token else None  # an unknown piece maps to <unk>
        try:
            return b.encode_single_token(token)
        except KeyError:
            return None

    def frame(self, flat: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Documents given as ``flat`` ids (int32 [T]) and their ``lengths`` (int64 [n]), framed with the
        recipe's BOS/EOS: ``(tokens int32, offsets int64 [n+1])``. Pre-tokenized sources come in here."""
        extra = int(self.spec.add_bos) + int(self.spec.add_eos)
        if extra:
            out_len = lengths + extra
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(out_len, out=offsets[1:])
            out = np.empty(int(offsets[-1]), dtype=np.int32)
            body = np.ones(len(out), dtype=bool)
            if self.spec.add_bos:
                out[offsets[:-1]] = self.bos_id
                body[offsets[:-1]] = False
            if self.spec.add_eos:
                out[offsets[1:] - 1] = self.eos_id
                body[offsets[1:] - 1] = False
            out[body] = flat
            return out, offsets
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        return flat, offsets


def _named(sp, name: str | None, default: int, key: str) -> int | None:
    if name is not None:
        tid = sp.piece_to_id(name)
        if sp.id_to_piece(tid) != name:  # SentencePiece maps an unknown piece to <unk>
            raise RecipeError(f"tokenizer has no token '{name}' (tokenizer.{key}); set it to a token of the tokenizer.")
        return tid
    return default if default >= 0 else None


def _first_id(token_to_id, name: str | None, candidates: Sequence[str], key: str) -> int | None:
    for cand in ([name] if name else candidates):
        tid = token_to_id(cand)
        if tid is not None:
            return tid
    if name:
        raise RecipeError(f"tokenizer has no token '{name}' (tokenizer.{key}); set it to a token of the tokenizer.")
    return None


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Load the tokenizer a recipe names."""
    return Tokenizer(spec)
