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
    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass  # tokenizer_path (--hf_assets_path) is passed at build time, as for HuggingFaceTokenizer

    def __init__(self, config: Config | None = None, *, tokenizer_path: str, **kwargs: Any) -> None:
        super().__init__()
        self.tokenizer_path = tokenizer_path
        self.hf: HuggingFaceTokenizer | None = None
        if tokenizer_path and any(os.path.isfile(os.path.join(tokenizer_path, f)) for f in _HF_FILES):
            self.hf = HuggingFaceTokenizer(tokenizer_path=tokenizer_path)
            self.eos_id = self.hf.eos_id
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
        return self._need_hf().encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self._need_hf().decode(*args, **kwargs)

    def get_vocab_size(self) -> int:
        return self._need_hf().get_vocab_size()
