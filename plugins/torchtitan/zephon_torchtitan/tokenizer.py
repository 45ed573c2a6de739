"""``ZephonTokenizer``: the trainer's tokenizer slot when a Zephon recipe tokenizes the data.

Torchtitan 0.3 always builds ``config.tokenizer`` from ``--hf_assets_path`` and hands it to the
dataloader. With Zephon the recipe names the tokenizer (SentencePiece, tiktoken or a Hugging Face
``tokenizer.json``) and the text is tokenized on Zephon's workers, so the trainer's tokenizer is only
needed when the recipe says ``[tokenizer] path = "@hf_assets_path"``. This class loads the Hugging Face
tokenizer in ``--hf_assets_path`` when that folder has one (and then behaves exactly like
Torchtitan's ``HuggingFaceTokenizer``), and otherwise only remembers the folder, so a recipe with its
own tokenizer does not need Hugging Face assets at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torchtitan.components.tokenizer import BaseTokenizer, HuggingFaceTokenizer

_HF_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


class ZephonTokenizer(BaseTokenizer):
    """The trainer's tokenizer: Torchtitan's ``HuggingFaceTokenizer`` of ``--hf_assets_path`` when that folder
    has one, else a placeholder that only remembers the folder (see the module docstring).

    Args:
        config: Torchtitan's tokenizer config (it has no fields of its own).
        tokenizer_path: ``--hf_assets_path``: the folder of the Hugging Face tokenizer, if any.
        **kwargs: what Torchtitan passes to every tokenizer, unused.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        """The tokenizer's config: no fields of its own (``tokenizer_path``, ``--hf_assets_path``, is passed at
        build time, as for ``HuggingFaceTokenizer``)."""

    def __init__(self, config: Config | None = None, *, tokenizer_path: str, **kwargs: Any) -> None:
        super().__init__()
        self.tokenizer_path = tokenizer_path
        """The folder it was given (``--hf_assets_path``)."""
        self.hf: HuggingFaceTokenizer | None = None
        """The Hugging Face tokenizer of that folder (None: the folder has none)."""
        if tokenizer_path and any(os.path.isfile(os.path.join(tokenizer_path, f)) for f in _HF_FILES):
            self.hf = HuggingFaceTokenizer(tokenizer_path=tokenizer_path)
            self.eos_id = self.hf.eos_id
            """The EOS id of the Hugging Face tokenizer (set only when there is one)."""
            for name in ("bos_id", "bos_token", "eos_token"):
                if hasattr(self.hf, name):
                    setattr(self, name, getattr(self.hf, name))

    def _need_hf(self) -> HuggingFaceTokenizer:
        if self.hf is None:
            raise RuntimeError(f"no Hugging Face tokenizer in --hf_assets_path={self.tokenizer_path!r}: the data is "
                               f"tokenized by the Zephon recipe's tokenizer. Point --hf_assets_path at a folder "
                               f"with tokenizer.json to use one here.")
        return self.hf

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        """Encode text with the Hugging Face tokenizer (``HuggingFaceTokenizer.encode``).

        Args:
            *args: ``HuggingFaceTokenizer.encode``'s: the text.
            **kwargs: ``HuggingFaceTokenizer.encode``'s: ``text``, ``add_bos``, ``add_eos``.

        Returns:
            The token ids.

        Raises:
            RuntimeError: ``--hf_assets_path`` has no Hugging Face tokenizer.
        """
        return self._need_hf().encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        """Decode token ids with the Hugging Face tokenizer (``HuggingFaceTokenizer.decode``).

        Args:
            *args: ``HuggingFaceTokenizer.decode``'s: the ids.
            **kwargs: ``HuggingFaceTokenizer.decode``'s.

        Returns:
            The text.

        Raises:
            RuntimeError: ``--hf_assets_path`` has no Hugging Face tokenizer.
        """
        return self._need_hf().decode(*args, **kwargs)

    def get_vocab_size(self) -> int:
        """The Hugging Face tokenizer's vocabulary size.

        Returns:
            The number of ids.

        Raises:
            RuntimeError: ``--hf_assets_path`` has no Hugging Face tokenizer.
        """
        return self._need_hf().get_vocab_size()
