"""Tokenizers behind one batched call: texts in, one flat int32 array plus offsets out.

Every backend is called once per chunk of documents (``encode_batch_fast`` for Hugging Face
``tokenizers``, a list call for SentencePiece, ``encode_ordinary_batch`` for tiktoken); EOS (and
optionally BOS) is added with numpy, not per token in Python.

A tokenizer file is checked before a backend reads it: a missing file, a folder, a file of another
kind than ``tokenizer.kind`` (recognised by its content) or one no backend can read is a
:class:`~zephon.recipe.RecipeError` that names ``tokenizer.path``, ``tokenizer.kind`` and what the file
looks like, not a backend's traceback.

A ``.tiktoken`` file holds only the BPE ranks; the split regex and the special tokens live in code. A file
that is one of tiktoken's own encodings (its SHA-256 is the ``expected_hash`` one of the constructors in
``tiktoken_ext.openai_public`` passes to ``load_tiktoken_bpe``) gets that constructor's pattern, special
tokens and vocabulary size, so its ids equal ``tiktoken.get_encoding(name)``'s. Any other file needs
``tokenizer.pat_str`` (always: it decides every id) and ``tokenizer.special_tokens`` (whenever a special
token is written, i.e. ``add_eos`` or ``add_bos``); without them it is refused, not given a guess.
``eos_token``/``bos_token`` pick among the special tokens by name (default EOS: ``<|endoftext|>``).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import re
import types
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

import numpy as np

from .errors import RecipeError
from .specs import KIND_FILES, TokenizerSpec, tokenizer_file, validate_special_tokens

_EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>", "[SEP]")
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]")
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
    tokenizer_file(spec)
    try:
        looks = sniff_tokenizer_kind(path)
    except OSError as exc:
        raise RecipeError(f"{where} cannot be read ({type(exc).__name__}: {exc}).") from exc
    if looks is not None and looks != kind:
        raise RecipeError(f"{where}: the file looks like {KIND_FILES[looks]}, not {KIND_FILES[kind]}. Set "
                          f"tokenizer.kind = '{looks}', or point tokenizer.path at {KIND_FILES[kind]}.")
    return path, looks


class Tokenizer:
    """A loaded tokenizer with its special ids. Build with :func:`load_tokenizer`.

    Args:
        spec: which tokenizer, and how it frames documents (:func:`zephon.tokenizer` makes one).

    Raises:
        RecipeError: the file cannot be read as its kind, or the spec asks for a special token (EOS, BOS, a
            pad id) the tokenizer does not have.
        RecipeFileError: no file at the spec's path.
        ImportError: the backend's library is not installed.
    """

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        """What was loaded."""
        validate_special_tokens(spec, f"tokenizer {spec.path}")  # a spec built in Python: not checked yet
        path, looks = _check_file(spec)
        self._encode = None
        self.tiktoken_encoding: str | None = None
        """tiktoken: which of tiktoken's own encodings the file is (None: none, or another kind)."""
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
        """The id written on padding positions: the spec's, else EOS (else 0)."""

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

        spec = self.spec
        data = path.read_bytes()
        ranks = tiktoken_ranks(data)
        digest = _content_sha256(data)
        own = tiktoken_own_encodings(digest, ranks)
        given = dict(spec.special_tokens) if spec.special_tokens is not None else None
        free = max(ranks.values(), default=-1) + 1  # the first id above the file's ranks
        if len(own) == 1:
            definition = dict(own[0])
            if spec.pat_str is not None:
                definition["pat_str"] = spec.pat_str
            if given is not None:  # the user's mapping replaces tiktoken's, so its size check no longer holds
                definition["special_tokens"] = given
                definition.pop("explicit_n_vocab", None)
        else:
            _refuse_ambiguous_tiktoken(spec, digest, free, [d["name"] for d in own])
            definition = {"name": path.stem, "pat_str": spec.pat_str, "mergeable_ranks": ranks,
                          "special_tokens": given or {}}
        specials: dict[str, int] = definition["special_tokens"]
        if given is not None:  # tiktoken does not check this: such an id would decode as two tokens
            by_rank = {rank: tok for tok, rank in ranks.items()}
            clash = sorted((tid, name) for name, tid in given.items() if tid in by_rank)
            if clash:
                tid, name = clash[0]
                raise RecipeError(f"tokenizer.special_tokens of {spec.path}: '{name}' = {tid} is also the id of the "
                                  f"file's token {by_rank[tid]!r}; give special tokens ids from {free} up "
                                  f"(above the file's ranks).")
        try:
            enc = tiktoken.Encoding(**definition)
        except ValueError as exc:  # tiktoken compiles pat_str here
            raise RecipeError(f"tokenizer.pat_str of {spec.path} is not a regular expression tiktoken accepts "
                              f"({str(exc)[:300]}); fix tokenizer.pat_str.") from exc
        self.vocab_size = enc.n_vocab
        self.eos_id = _special_id(specials, spec.eos_token, ("<|endoftext|>", *_EOS_NAMES), "eos_token", spec)
        self.bos_id = _special_id(specials, spec.bos_token, _BOS_NAMES, "bos_token", spec)
        self.tiktoken_encoding = own[0]["name"] if len(own) == 1 else None
        # encode_ordinary: special-token strings in a document are ordinary text (no injection of EOS).
        self._encode = lambda texts: enc.encode_ordinary_batch(list(texts), num_threads=1)
        self._backend = enc

    # -- one rendered chat text, as transformers encodes it (chat templates: which tokens are the assistant's) --
    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(ids, starts, ends)`` of one rendered chat text, without BOS/EOS framing, as ``transformers``'
        tokenizer built from the same file gives them in ``apply_chat_template``.

        The special tokens written in the text (by the template or in a message) become their ids, as
        ``transformers`` splits added tokens off before encoding: ``tokenizers`` does it itself for a
        ``tokenizer.json``; for tiktoken the Encoding's special tokens are allowed; for SentencePiece the text is
        cut at its control and unknown pieces (``<s>``, ``</s>``, ``<unk>``, ``<pad>``...) and each piece of text
        is encoded alone (with its own dummy prefix, as the converted tokenizer does). ``starts``/``ends`` are each
        token's character range in the convention of ``tokenizers``' offsets, which ``transformers`` computes
        ``assistant_masks`` from: a byte-level token covers the characters its bytes belong to; a SentencePiece
        token covers the characters its normalized text comes from, where the one space left of a run of
        whitespace stands on the run's last character and the dummy prefix on the first character after it.

        Args:
            text: the rendered conversation.

        Returns:
            ``(ids int32 [n], starts int64 [n], ends int64 [n])``.
        """
        kind, b = self.spec.kind, self._backend
        if kind == "huggingface":
            enc = b.encode(text, add_special_tokens=False)
            spans = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            return np.asarray(enc.ids, dtype=np.int32), spans[:, 0], spans[:, 1]
        if kind == "tiktoken":
            ids_list = b.encode(text, allowed_special="all", disallowed_special=())
            lengths = np.fromiter(map(len, b.decode_tokens_bytes(ids_list)), dtype=np.int64, count=len(ids_list))
            char_of_byte = _char_of_byte(text)
            ends_b = np.cumsum(lengths)
            return (np.asarray(ids_list, dtype=np.int32), char_of_byte[ends_b - lengths],
                    char_of_byte[ends_b - 1] + 1 if len(ids_list) else ends_b)
        parts, pos = [], 0
        for m in (self._sp_specials().finditer(text) if self._sp_specials() is not None else ()):
            if m.start() > pos:
                parts.append(self._sp_offsets(text[pos:m.start()], pos))
            parts.append((np.array([b.piece_to_id(m.group())], dtype=np.int32), np.array([m.start()], dtype=np.int64),
                          np.array([m.end()], dtype=np.int64)))
            pos = m.end()
        if pos < len(text):
            parts.append(self._sp_offsets(text[pos:], pos))
        if not parts:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        return tuple(np.concatenate(x) for x in zip(*parts))  # type: ignore[return-value]

    def _sp_specials(self) -> "re.Pattern[str] | None":
        """The control and unknown pieces of a SentencePiece model as one pattern, longest first (the added
        tokens of ``transformers``' converted tokenizer, matched leftmost-longest); built once."""
        if not hasattr(self, "_sp_special_re"):
            b = self._backend
            names = {b.id_to_piece(i) for i in range(b.get_piece_size()) if b.is_control(i) or b.is_unknown(i)}
            names.discard("")
            self._sp_special_re = re.compile("|".join(map(re.escape, sorted(names, key=lambda n: (-len(n), n))))) \
                if names else None
        return self._sp_special_re

    def _sp_offsets(self, chunk: str, base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One run of text between special tokens, through SentencePiece (ids) and its normalizer (offsets)."""
        b = self._backend
        try:
            norm, origin = b.normalize(chunk, with_offsets=True)
        except TypeError as exc:  # sentencepiece < 0.2 has no normalizer offsets
            raise ImportError("tokenize_chat with a SentencePiece tokenizer needs sentencepiece >= 0.2 "
                              "(SentencePieceProcessor.normalize(with_offsets=True)); upgrade it") from exc
        pieces = b.encode(chunk, out_type="proto").pieces
        n = len(pieces)
        if not n or not norm:
            return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int64)
        ids = np.fromiter((p.id for p in pieces), dtype=np.int32, count=n)
        # Pieces tile the normalized text: a byte-fallback piece is one UTF-8 byte of it, any other its text.
        nbytes = np.fromiter((1 if b.is_byte(p.id) else len(p.piece.encode("utf-8")) for p in pieces),
                             dtype=np.int64, count=n)
        char_of_byte = _char_of_byte(norm)
        ends_b = np.cumsum(nbytes)
        first, last = char_of_byte[ends_b - nbytes], char_of_byte[ends_b - 1]
        # The one original character each normalized character stands on, as tokenizers' converted normalizer
        # aligns it: where it comes from (the first character of what it replaces); the space kept of a run of
        # whitespace on the run's last character ("\r\n" counts as one, being one grapheme), because the
        # collapsing Replace aligns the space it writes with the last one it removes; the dummy prefix on the
        # character after it. A token covers its characters' range.
        origin = np.asarray(origin, dtype=np.int64)
        start = origin[:-1].copy()
        space = np.frombuffer(norm.encode("utf-32-le"), dtype=np.uint32) == 0x2581  # "▁"
        lead = 1 if self._sp_dummy_prefix() and space[0] and len(norm) > 1 else 0
        space[:lead] = False
        jumps = np.diff(origin)[lead:][~space[lead:]]
        if _DELETABLE.search(chunk) or (jumps > 1).any():
            # A character the normalizer deleted (or merged into another): tokenizers' alignment next to it has
            # quirks of its own (e.g. a deletion at the start shifts the chunk), so ask tokenizers itself.
            exact = self._sp_exact_alignment(chunk, norm)
            if exact is not None:
                return (ids, np.minimum.reduceat(exact[:, 0], first) + base,
                        np.maximum.reduceat(exact[:, 1], first) + base)
        if space.any():
            at = origin[1:][space] - 1  # the last character of the run (it ends where the next character starts)
            if "\r\n" in chunk:
                cp = np.frombuffer(chunk.encode("utf-32-le"), dtype=np.uint32)
                at -= (at > 0) & (cp[at] == 10) & (cp[np.maximum(at - 1, 0)] == 13)
            start[space] = at
        if lead:
            start[0] = start[1]
        return ids, start[first] + base, start[last] + 1 + base

    def _sp_dummy_prefix(self) -> bool:
        """Whether the SentencePiece model puts a dummy "▁" before each text it encodes."""
        if not hasattr(self, "_sp_dummy"):
            self._sp_dummy = self._backend.normalize("a").startswith("\u2581")
        return self._sp_dummy

    def _sp_exact_alignment(self, chunk: str, norm: str) -> np.ndarray | None:
        """``[len(norm), 2]``: the original character range of each normalized character, from the normalizer
        ``transformers`` builds for this model (``SpmConverter.build_tokenizer_from_spm_proto``, legacy mode:
        the model's precompiled character map, SentencePiece's whitespace handling, a dummy prefix on each
        chunk), run by ``tokenizers``; None when its normalized text differs from SentencePiece's."""
        if not hasattr(self, "_sp_aligner"):
            from tokenizers import Regex, normalizers, pre_tokenizers

            spec = _sp_normalizer_spec(Path(self.spec.path).read_bytes())
            steps = [normalizers.Precompiled(spec["charsmap"])] if spec["charsmap"] else []
            if spec["remove_extra_whitespaces"]:
                steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
            if spec["escape_whitespaces"]:
                steps.append(normalizers.Replace(" ", "\u2581"))
            pre = [pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")]  # one split per character
            if spec["add_dummy_prefix"]:
                steps.append(normalizers.Replace(Regex("\\A\u2581"), "\u2581\u2581"))
                pre.insert(0, pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=False))
            self._sp_aligner = (normalizers.Sequence(steps), pre_tokenizers.Sequence(pre))
        from tokenizers import PreTokenizedString

        normalizer, pre_tokenizer = self._sp_aligner
        text = PreTokenizedString(chunk)
        text.normalize(normalizer.normalize)
        pre_tokenizer.pre_tokenize(text)
        splits = text.get_splits(offset_referential="original", offset_type="char")
        if "".join(s for s, _, _ in splits) != norm:
            return None
        return np.asarray([o for _, o, _ in splits], dtype=np.int64).reshape(-1, 2)

    def special_tokens(self) -> dict[str, str]:
        """The named special tokens as text, as a chat template sees them (``bos_token``, ``eos_token``,
        ``unk_token``, ``pad_token``): only those the tokenizer has, as ``transformers`` passes only the set ones.

        BOS and EOS are the recipe's (``tokenizer.bos_token``/``eos_token``, else found by name or in the
        SentencePiece model); UNK is SentencePiece's unknown piece or the ``tokenizer.json`` model's
        ``unk_token``; PAD is ``tokenizer.pad_id``'s token when the recipe sets it, else SentencePiece's pad piece
        or the ``tokenizer.json``'s padding token. A tiktoken file has no UNK and no PAD of its own.

        Returns:
            ``{"bos_token": "<s>", ...}``.
        """
        kind, b = self.spec.kind, self._backend
        out = {}
        for name, tid in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            if tid is not None:
                out[name] = self.token_text(tid)
        if kind == "sentencepiece":
            unk, pad = b.unk_id(), b.pad_id()
            unk = b.id_to_piece(unk) if unk >= 0 else None
            pad = b.id_to_piece(pad) if pad >= 0 else None
        elif kind == "huggingface":
            unk = getattr(b.model, "unk_token", None)
            unk = unk if unk is not None and b.token_to_id(unk) is not None else None
            pad = (b.padding or {}).get("pad_token")
        else:
            unk = pad = None
        if self.spec.pad_id is not None:
            pad = self.token_text(self.spec.pad_id)
        out.update({k: v for k, v in (("unk_token", unk), ("pad_token", pad)) if v})
        return out

    def token_text(self, token_id: int | None) -> str:
        """The text of one token id (e.g. the EOS token's name for a chat template).

        Args:
            token_id: a token id, or None.

        Returns:
            The token's text; ``""`` for None.
        """
        if token_id is None:
            return ""
        kind, b = self.spec.kind, self._backend
        if kind == "huggingface":
            return b.id_to_token(token_id) or ""
        if kind == "sentencepiece":
            return b.id_to_piece(token_id)
        return b.decode([token_id])

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a sequence of token ids, special tokens written out (for people: ``zephon trace``).

        Args:
            ids: token ids of this tokenizer (a piece of a document may start or end inside a character:
                its bytes are shown as the replacement character).

        Returns:
            The decoded text.
        """
        ids = [int(i) for i in ids]
        kind, b = self.spec.kind, self._backend
        if kind == "huggingface":
            return b.decode(ids, skip_special_tokens=False)
        if kind == "sentencepiece":  # sentencepiece drops control tokens (BOS, EOS) from text: write their names
            parts: list[str] = []
            run: list[int] = []
            for i in ids:
                if b.is_control(i):
                    parts += [b.decode(run), b.id_to_piece(i)]
                    run = []
                else:
                    run.append(i)
            return "".join(parts + [b.decode(run)])
        return b.decode_bytes(ids).decode("utf-8", "replace")

    # -- the batched call -----------------------------------------------------------------------
    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize texts, one batched backend call, each framed with the spec's BOS/EOS.

        Args:
            texts: the documents' texts.

        Returns:
            ``(tokens, offsets)``: every document's ids, concatenated (int32 ``[T]``), and where each starts and
            the last ends (int64 ``[n + 1]``).
        """
        ids = self._encode(texts)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
        return self.frame(flat, lengths)

    def encode_plain(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize texts without BOS/EOS (pieces of one document, framed later by the caller): one batched
        backend call.

        Args:
            texts: the pieces' texts.

        Returns:
            ``(tokens, lengths)``: the ids concatenated (int32 ``[T]``) and each piece's count (int64 ``[n]``).
        """
        ids = self._encode(texts) if texts else []
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum())), lengths

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry by its text (e.g. a special token ``<|image_pad|>``).

        Args:
            token: the entry's text.

        Returns:
            Its id, or None when the vocabulary has no such entry.
        """
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
        """Frame documents given as ids with the spec's BOS/EOS (pre-tokenized sources come in here).

        Args:
            flat: the documents' ids, concatenated (int32 ``[T]``).
            lengths: each document's count (int64 ``[n]``).

        Returns:
            ``(tokens, offsets)`` as :meth:`encode` returns them.
        """
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


# Characters a SentencePiece normalizer may delete (controls, default-ignorable format characters): next to one,
# tokenizers' alignment departs from the plain rule (Tokenizer._sp_offsets), so such text is aligned by tokenizers.
_DELETABLE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\xad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180b-\u180f"
                        "\u200b-\u200f\u202a-\u202e\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff0-\ufffb"
                        "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0000-\U000e0fff]")


def _sp_normalizer_spec(model: bytes) -> dict:
    """The normalizer settings of a SentencePiece model file (``ModelProto`` field 3, ``NormalizerSpec``: 2 the
    precompiled character map, 3 add_dummy_prefix, 4 remove_extra_whitespaces, 5 escape_whitespaces), read
    without protobuf, whose generated modules pin the protobuf runtime's version."""
    def fields(buf: bytes):
        i = 0
        while i < len(buf):
            key, i = _varint(buf, i)
            wire = key & 7
            if wire == 0:
                value, i = _varint(buf, i)
            elif wire == 2:
                size, i = _varint(buf, i)
                value, i = buf[i:i + size], i + size
            elif wire in (1, 5):
                value, i = None, i + (8 if wire == 1 else 4)
            else:
                raise ValueError(f"unexpected protobuf wire type {wire}")
            yield key >> 3, value

    spec = {"charsmap": b"", "add_dummy_prefix": True, "remove_extra_whitespaces": True, "escape_whitespaces": True}
    names = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}
    for number, value in fields(model):
        if number == 3 and isinstance(value, bytes):
            for inner, v in fields(value):
                if inner == 2:
                    spec["charsmap"] = bytes(v)
                elif inner in names:
                    spec[names[inner]] = bool(v)
    return spec


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _char_of_byte(text: str) -> np.ndarray:
    """For each UTF-8 byte of ``text``, the index of the character it belongs to."""
    raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    return np.cumsum((raw & 0xC0) != 0x80) - 1


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


# -- tiktoken: the file's ranks, and tiktoken's own definitions of its encodings ----------------------------
class _NotThisFile(Exception):
    """Raised by the stand-in loaders below: this constructor wants another file than the one at hand."""


def tiktoken_ranks(data: bytes) -> dict[bytes, int]:
    """The BPE ranks of a ``.tiktoken`` file's content, parsed as ``tiktoken.load.load_tiktoken_bpe`` does
    (which cannot be called on a local path without copying the file into tiktoken's download cache).

    Args:
        data: the file's bytes: lines of ``base64-token rank``.

    Returns:
        token bytes -> rank.
    """
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def _content_sha256(data: bytes) -> str:
    """The SHA-256 (hex) that tiktoken checks a file against (its ``expected_hash``); a seam for the tests."""
    return hashlib.sha256(data).hexdigest()


def tiktoken_own_encodings(sha256: str, ranks: dict[bytes, int]) -> list[dict[str, Any]]:
    """tiktoken's own definition of the encoding whose BPE file has this SHA-256, from tiktoken's own code.

    Each constructor of ``tiktoken_ext.openai_public.ENCODING_CONSTRUCTORS`` is called with its BPE loader
    replaced by one that returns ``ranks`` only when the constructor's ``expected_hash`` is ``sha256`` and
    refuses everything else, so nothing is ever read or downloaded. The constructors are called as copies
    bound to a copy of their module's globals (the loaders replaced there, and every function of the module
    rebound, so that ``o200k_harmony`` calling ``o200k_base`` stays in the copy): unlike patching the module,
    this cannot be seen by another thread calling ``tiktoken.get_encoding`` at the same time, so no lock.
    ``gpt2`` loads its ranks with ``data_gym_to_mergeable_bpe_ranks`` from two data_gym files, not one
    ``.tiktoken`` file: it is skipped (``r50k_base`` is its ``.tiktoken`` form, with the same ranks,
    pattern and special tokens).

    Args:
        sha256: the file's SHA-256, hex.
        ranks: the file's ranks, returned by the stand-in loader to the constructor that asks for this file.

    Returns:
        The constructors' dicts (``name``, ``pat_str``, ``mergeable_ranks`` = ``ranks``, ``special_tokens``
        and maybe ``explicit_n_vocab``: ``tiktoken.Encoding``'s arguments) for this file. Where several
        constructors load it (``p50k_base`` and ``p50k_edit``; ``o200k_base`` and ``o200k_harmony``), only
        the one named after the file it loads (``.../p50k_base.tiktoken``), its base encoding, is kept.
        Empty for a file that is none of tiktoken's.
    """
    try:
        from tiktoken_ext import openai_public
    except ImportError:  # a tiktoken without its OpenAI definitions: no file is one of them
        return []
    loaded: list[str] = []

    def load_tiktoken_bpe(tiktoken_bpe_file: str, expected_hash: str | None = None) -> dict[bytes, int]:
        if expected_hash != sha256:  # never read the blob: this constructor is not this file's
            raise _NotThisFile
        loaded.append(tiktoken_bpe_file)
        return ranks

    def data_gym_to_mergeable_bpe_ranks(*args: Any, **kwargs: Any) -> dict[bytes, int]:
        raise _NotThisFile  # gpt2's data_gym files (see above)

    module_globals = vars(openai_public)
    copies: dict[str, Any] = dict(module_globals)
    for name, value in module_globals.items():
        if isinstance(value, types.FunctionType) and value.__module__ == openai_public.__name__:
            copies[name] = _rebound(value, copies)
    copies["load_tiktoken_bpe"] = load_tiktoken_bpe
    copies["data_gym_to_mergeable_bpe_ranks"] = data_gym_to_mergeable_bpe_ranks
    found: list[tuple[dict[str, Any], str]] = []
    for constructor in getattr(openai_public, "ENCODING_CONSTRUCTORS", {}).values():
        if not isinstance(constructor, types.FunctionType):
            continue
        del loaded[:]
        try:
            definition = _rebound(constructor, copies)()
        except _NotThisFile:
            continue
        if loaded and definition.get("mergeable_ranks") is ranks:
            found.append((definition, PurePosixPath(loaded[-1]).stem))
    named_after = [d for d, stem in found if d.get("name") == stem]
    return named_after if named_after else [d for d, _ in found]


def _rebound(fn: types.FunctionType, module_globals: dict[str, Any]) -> types.FunctionType:
    """``fn``'s code bound to other globals (the same function, looking its names up there)."""
    copy = types.FunctionType(fn.__code__, module_globals, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy


def _refuse_ambiguous_tiktoken(spec: TokenizerSpec, sha256: str, free: int, matches: list[str]) -> None:
    """A file that is not (exactly) one of tiktoken's encodings must name what tiktoken would take from code:
    ``pat_str`` always, ``special_tokens`` when one is written (EOS or BOS). Raises a RecipeError if not;
    ``free`` is the first id above the file's ranks, for the example."""
    missing = []
    if spec.special_tokens is None and (spec.add_eos or spec.add_bos):
        missing.append(f'special_tokens = {{ "<|endoftext|>" = {free} }} (its special tokens, name = id; '
                       f"ids from {free} up are free)")
    if spec.pat_str is None:
        missing.append("pat_str = '...' (the split regex the file was trained with, e.g. the pat_str of "
                       "cl100k_base or o200k_base in tiktoken_ext/openai_public.py)")
    if not missing:
        return
    what = (f"matches several of tiktoken's encodings ({', '.join(matches)})" if matches else
            "is not one of tiktoken's encodings")
    raise RecipeError(f"tokenizer.path = {spec.path}: this .tiktoken file {what} (sha256 {sha256}), so Zephon "
                      f"cannot take its split regex and special tokens from tiktoken. Add to [tokenizer]: "
                      f"{'; and '.join(missing)}. In Python: zephon.tokenizer(path, special_tokens={{...}}, "
                      f"pat_str=...).")


def _special_id(specials: dict[str, int], name: str | None, candidates: Sequence[str], key: str,
                spec: TokenizerSpec) -> int | None:
    """The id of the special token ``name`` (or of the first of ``candidates`` present, None if none is)."""
    if name is None:
        return next((specials[c] for c in candidates if c in specials), None)
    if name not in specials:
        names = sorted(specials, key=specials.__getitem__)
        have = (", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")) or "none"
        raise RecipeError(f"tokenizer {spec.path} has no special token '{name}' (tokenizer.{key}); its special "
                          f"tokens are: {have}. Name one of them, or add '{name}' to tokenizer.special_tokens.")
    return specials[name]


def load_tokenizer(spec: TokenizerSpec) -> Tokenizer:
    """Load the tokenizer a spec names.

    Args:
        spec: a :class:`zephon.TokenizerSpec` (:func:`zephon.tokenizer`, or a recipe's ``[tokenizer]``).

    Returns:
        The loaded :class:`Tokenizer`.

    Raises:
        RecipeError: the file cannot be read as its kind, or lacks a special token the spec asks for.
    """
    return Tokenizer(spec)
