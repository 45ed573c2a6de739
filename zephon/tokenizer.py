"""Tokenizers behind one batched call: texts in, one flat int32 array plus offsets out.

Every backend is called once per chunk of documents (``encode_batch_fast`` for Hugging Face
``tokenizers``, a list call for SentencePiece, ``encode_ordinary_batch`` for tiktoken); EOS (and
optionally BOS) is added with numpy, not per token in Python.
"""

from __future__ import annotations

import base64
import itertools
from pathlib import Path
from typing import Sequence

import numpy as np

from .recipe import RecipeError, TokenizerSpec

# The split regex of OpenAI's cl100k encoding, the usual choice for a .tiktoken BPE file.
CL100K_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"""
    r"""\s+(?!\S)|\s+"""
)
_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")


class Tokenizer:
    """A loaded tokenizer with its special ids. Build with :func:`load_tokenizer`."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        path = Path(spec.path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {spec.path} (tokenizer.path in the recipe)")
        self._encode = None
        getattr(self, f"_load_{spec.kind}")(path)
        if spec.add_eos and self.eos_id is None:
            raise RecipeError(f"tokenizer {spec.path} has no EOS token; set tokenizer.eos_token to its name "
                              f"or add_eos = false.")
        if spec.add_bos and self.bos_id is None:
            raise RecipeError(f"tokenizer {spec.path} has no BOS token; set tokenizer.bos_token or "
                              f"add_bos = false.")
        self.pad_id = spec.pad_id if spec.pad_id is not None else (self.eos_id or 0)

    # -- backends -------------------------------------------------------------------------------
    def _load_sentencepiece(self, path: Path) -> None:
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = sp.get_piece_size()
        self.eos_id = _named(sp, self.spec.eos_token, sp.eos_id())
        self.bos_id = _named(sp, self.spec.bos_token, sp.bos_id())
        self._encode = lambda texts: sp.encode(list(texts), out_type=int, num_threads=1)

    def _load_huggingface(self, path: Path) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        tok = HFTokenizer.from_file(str(path))
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = _first_id(tok.token_to_id, self.spec.eos_token, _EOS_NAMES)
        self.bos_id = _first_id(tok.token_to_id, self.spec.bos_token, _BOS_NAMES)
        self._encode = lambda texts: [e.ids for e in tok.encode_batch_fast(list(texts), add_special_tokens=False)]

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

    # -- the batched call -----------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize ``texts``; returns ``(tokens int32 [T], offsets int64 [n+1])`` with EOS/BOS added."""
        ids = self._encode(texts)
        lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return self.frame(flat, lengths)

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


def _named(sp, name: str | None, default: int) -> int | None:
    if name is not None:
        tid = sp.piece_to_id(name)
        if sp.id_to_piece(tid) != name:  # SentencePiece maps an unknown piece to <unk>
            raise RecipeError(f"tokenizer has no token '{name}'")
        return tid
    return default if default >= 0 else None


def _first_id(token_to_id, name: str | None, candidates: Sequence[str]) -> int | None:
    for cand in ([name] if name else candidates):
        tid = token_to_id(cand)
        if tid is not None:
            return tid
    if name:
        raise RecipeError(f"tokenizer has no token '{name}'")
    return None


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Load the tokenizer a recipe names."""
    return Tokenizer(spec)
