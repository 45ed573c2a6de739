"""``tokenize_chat``: render conversations with a chat template and train on the assistant turns only.

A record's ``messages`` field (a list of ``{"role": ..., "content": ...}``) is rendered with a Hugging
Face-style Jinja chat template (the same sandboxed Jinja environment and globals ``transformers`` uses:
``messages``, ``bos_token``, ``eos_token``, ``add_generation_prompt``, ``raise_exception``), then
tokenized as one text. The output document has ``input_ids`` and a per-token ``loss_mask``: 1 at
position ``i`` when the label there (token ``i+1``) is part of an assistant turn, so that the batch's
``labels`` are -100 everywhere else.

Which characters are assistant text:

- a template with ``{% generation %} ... {% endgeneration %}`` blocks marks them itself (as for
  ``transformers``' ``return_assistant_tokens_mask``); the tokens from the one holding a block's first
  character to the one holding its last are targets, exactly as ``transformers`` computes
  ``assistant_masks``;
- any other template is rendered prefix by prefix: assistant message ``k`` spans from the end of the
  conversation before it (rendered with the generation prompt) to the end of the conversation through
  it. A template whose renderings are not prefixes of each other is refused: add generation tags.

``loss_on``: ``"assistant"`` (every assistant turn), ``"last_assistant"`` (the last one only) or
``"all"`` (every token, e.g. to pre-train on chat text).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..readers.base import SourceError
from ..records import INPUT_IDS, LOSS_MASK, Chunk, Doc
from ..recipe import TokenizerSpec
from .base import Transform
from .tokenize import file_digest, shared_tokenizer, tokenizer_description

LOSS_ON = ("assistant", "last_assistant", "all")


def _environment() -> Any:
    """A sandboxed Jinja environment with the generation-block tracker, as transformers builds it."""
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

        def _mark(self, caller: Any) -> str:
            text = caller()
            return f"\x00GEN\x01{text}\x00END\x01"

    def raise_exception(message: str) -> None:
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, "jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: \
        __import__("json").dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                 sort_keys=sort_keys)
    return env


_OPEN, _CLOSE = "\x00GEN\x01", "\x00END\x01"


def _strip_marks(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text without generation marks, and the character spans the marks enclosed."""
    out, spans, pos = [], [], 0
    length = 0
    while True:
        a = text.find(_OPEN, pos)
        if a < 0:
            out.append(text[pos:])
            break
        b = text.find(_CLOSE, a)
        out.append(text[pos:a])
        length += a - pos
        inner = text[a + len(_OPEN):b]
        spans.append((length, length + len(inner)))
        out.append(inner)
        length += len(inner)
        pos = b + len(_CLOSE)
    return "".join(out), spans


class TokenizeChat(Transform):
    """Render and tokenize conversations with a loss mask on assistant turns (see the module docstring)."""

    kind = "tokenize_chat"
    token_fields = {LOSS_MASK: (np.uint8, 1)}

    def __init__(self, tokenizer: TokenizerSpec, template: str | None, field: str = "messages",
                 loss_on: str = "assistant", add_eos: bool = False, name: str | None = None,
                 sources: Sequence[str] | None = None, executor: str | None = None) -> None:
        if loss_on not in LOSS_ON:
            raise ValueError(f"tokenize_chat(loss_on={loss_on!r}): use one of {LOSS_ON}")
        if template is None:
            raise ValueError("tokenize_chat(template=...): pass a chat template (a .jinja file or the template text)")
        super().__init__(name, sources, executor)
        self.spec = tokenizer
        self.field, self.loss_on, self.add_eos = field, loss_on, add_eos
        looks_like_path = "{" not in template and len(template) < 4096
        self.template_text = Path(template).read_text(encoding="utf-8") if looks_like_path else template
        self.template_id = file_digest(template) if looks_like_path else \
            __import__("hashlib").sha256(template.encode()).hexdigest()[:16]
        self._tok: Any = None
        self._template: Any = None

    def describe(self) -> dict[str, Any]:
        spec = tokenizer_description(self.spec)
        return {**super().describe(), "field": self.field, "tokenizer": spec, "template_sha256": self.template_id,
                "loss_on": self.loss_on, "add_eos": self.add_eos}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None, "_template": None}

    def setup(self) -> None:
        if self._tok is None:
            self._tok = shared_tokenizer(self.spec)
            self._template = _environment().from_string(self.template_text)

    @property
    def tokenizer(self) -> Any:
        self.setup()
        return self._tok

    # -- one conversation ---------------------------------------------------------------------------
    def _render(self, messages: list, generation_prompt: bool = False) -> str:
        tok = self._tok
        return self._template.render(messages=messages, add_generation_prompt=generation_prompt,
                                     bos_token=tok.token_text(tok.bos_id), eos_token=tok.token_text(tok.eos_id))

    def spans(self, messages: list) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans of the assistant turns that carry loss."""
        marked = self._render(messages)
        text, spans = _strip_marks(marked)
        if spans or self.loss_on == "all":
            pass
        else:  # no generation tags: render prefix by prefix
            for k, m in enumerate(messages):
                if m.get("role") != "assistant":
                    continue
                before = _strip_marks(self._render(messages[:k], generation_prompt=True))[0]
                through = _strip_marks(self._render(messages[:k + 1]))[0]
                if not text.startswith(through) or not through.startswith(before):
                    raise ValueError("the chat template does not render conversations as prefixes of each other, so "
                                     "assistant turns cannot be located: mark them with {% generation %} ... "
                                     "{% endgeneration %} in the template")
                spans.append((len(before), len(through)))
        if self.loss_on == "last_assistant":
            spans = spans[-1:]
        if self.loss_on == "all":
            spans = [(0, len(text))]
        return text, spans

    def targets(self, messages: list) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, target uint8)``: 1 on the tokens of the turns that carry loss (what
        ``transformers`` calls ``assistant_masks``)."""
        self.setup()
        text, spans = self.spans(messages)
        ids, starts, ends = self._tok.encode_offsets(text)
        target = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            if b <= a:
                continue
            first = int(np.searchsorted(ends, a, side="right"))  # the token holding character a
            last = int(np.searchsorted(ends, b - 1, side="right"))  # the token holding character b-1
            target[first:min(last, len(ids) - 1) + 1] = 1
        return ids, target

    def encode(self, messages: list) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, loss_mask uint8)`` of one conversation: ``loss_mask[i]`` says whether the
        label at ``i`` (token ``i+1``) is a target."""
        ids, target = self.targets(messages)
        if self.add_eos and self._tok.eos_id is not None:
            ids = np.append(ids, np.int32(self._tok.eos_id))
            target = np.append(target, target[-1] if len(target) else 0)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[:-1] = target[1:]  # the label at i is token i+1
        return ids.astype(np.int32), mask

    # -- chunks ----------------------------------------------------------------------------------------
    def apply(self, chunk: Chunk) -> Chunk:
        self.setup()
        conversations = chunk.columns.get(self.field)
        if conversations is None:
            raise SourceError(f"operator '{self.name}': records of {chunk.path} have no field '{self.field}' "
                              f"(fields: {', '.join(chunk.columns) or 'none'}). Read the messages column, or set "
                              f"tokenize_chat(field=...).")
        ids, masks, keep = [], [], []
        for j, messages in enumerate(conversations):
            if not messages:
                continue
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise SourceError(f"operator '{self.name}': field '{self.field}' of {chunk.where(j)} must be a list of "
                                  f"{{role, content}} messages, got {type(messages).__name__}")
            try:
                a, m = self.encode(messages)
            except Exception as exc:
                raise SourceError(f"operator '{self.name}': cannot render the conversation of {chunk.where(j)}: "
                                  f"{type(exc).__name__}: {exc}") from exc
            if len(a):
                ids.append(a)
                masks.append(m)
                keep.append(j)
        chunk.count("blank_records", chunk.n - len(keep))
        out = chunk.select(np.asarray(keep, dtype=np.int64))
        out.columns = {k: v for k, v in out.columns.items() if k != self.field}
        lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
        out.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out.token_fields = {INPUT_IDS: np.concatenate(ids) if ids else np.zeros(0, np.int32),
                            LOSS_MASK: np.concatenate(masks) if masks else np.zeros(0, np.uint8)}
        return out

    def apply_records(self, records: list[Any]) -> list[Any]:
        self.setup()
        out = []
        for rec in records:
            messages = rec.get(self.field)
            if messages:
                a, m = self.encode(messages)
                doc = Doc({k: v for k, v in rec.items() if k != self.field}, getattr(rec, "tail", -100),
                          getattr(rec, "source", -1))
                doc[INPUT_IDS], doc[LOSS_MASK] = a, m
                out.append(doc)
        return out
