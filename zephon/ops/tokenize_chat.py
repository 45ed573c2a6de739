"""``tokenize_chat``: render conversations with a chat template and train on the assistant turns only.

A record's ``messages`` field (a list of ``{"role": ..., "content": ...}``) is rendered with a Hugging
Face-style Jinja chat template and tokenized as one text, as ``transformers``' ``apply_chat_template(...,
tokenize=True, return_assistant_tokens_mask=True)`` does: the output document has ``input_ids`` and a
per-token ``loss_mask``, 1 at position ``i`` when the label there (token ``i+1``) is an assistant target, so
that the batch's ``labels`` are -100 everywhere else. ``docs/guides/chat.md`` is the user's guide; the
contract, kept equal to ``transformers`` (tests/test_chat.py compares both on hundreds of conversations):

- **What the template sees**: the same sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``,
  ``loopcontrols``, the ``tojson`` filter, the ``raise_exception``, ``strftime_now``, ``dict`` and
  ``namespace`` globals) and variables: ``messages``; ``tools`` and ``documents`` (the record's fields of
  those names, else None); ``add_generation_prompt``; the tokenizer's ``bos_token``, ``eos_token``,
  ``unk_token`` and ``pad_token`` (those it has: see ``Tokenizer.special_tokens``). ``strftime_now`` formats
  the pipeline's fixed ``date`` (midnight), never the clock, so that a record renders the same every run.
- **Messages**: keys whose value is null are dropped, as ``transformers`` does (a Parquet source gives every
  message every key), and a message's reasoning is aliased under ``reasoning_content`` and ``thinking``.
  Then each message must have a string ``role`` and a string ``content`` (only an assistant message with
  ``tool_calls`` may go without), and its content must reach the rendered text (else the template cannot
  render its role). A record that breaks this, or that the template refuses (``raise_exception``), is an
  error naming the file, the record and the field, or with ``on_error="skip"`` is skipped and counted
  (``invalid_conversations`` in the loader's ``metrics()["skipped_by_reason"]``).
- **Special tokens**: a special token written in the rendered text (by the template or inside a message)
  becomes its id, for every tokenizer kind (``Tokenizer.encode_offsets``).
- **Which tokens are targets**: a template with ``{% generation %} ... {% endgeneration %}`` blocks marks
  them. The blocks are located by position while rendering (as ``transformers``' ``AssistantTracker``: the
  length of what the template has output so far), so nothing in a message can mark or unmark text. A token
  is a target when its character range overlaps a block, by ``transformers``' own rule (the token's offsets
  in ``tokenizers``' convention: a token ending where a block starts, or starting where it ends, is not).
  Any other template is rendered prefix by prefix: assistant message ``k`` spans from the end of the
  conversation before it (rendered with the generation prompt) to the end of the conversation through it; a
  template whose renderings are not prefixes of each other is refused (add generation tags).

``loss_on``: ``"assistant"`` (every assistant turn), ``"last_assistant"`` (the last one only) or
``"all"`` (every token, e.g. to pre-train on chat text).
"""

from __future__ import annotations

import datetime as _dt
import json
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import PipelineError, RecipeFileError, SourceError
from ..records import INPUT_IDS, LOSS_MASK, Chunk, Doc, doc_origin, doc_source
from ..specs import TokenizerSpec
from .base import BindContext, Transform, choice
from .tokenize import shared_tokenizer

LOSS_ON = ("assistant", "last_assistant", "all")
ON_ERROR = ("raise", "skip")
#: ``strftime_now``'s day unless a pipeline sets ``date=``: a constant, so that templates that print the date
#: render the same bytes in every run (changing it changes the fingerprint).
DEFAULT_DATE = "2026-01-01"


def read_template(template: str) -> str:
    """A chat template given as a ``.jinja`` file or as its text: the text."""
    if "{" in template or len(template) >= 4096:
        return template
    try:
        return Path(template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeFileError(f"tokenize_chat(template={template!r}): no template text (it has no Jinja tag) and "
                              f"no readable file there ({type(exc).__name__}: {exc}). Pass the template text, or the "
                              f"path to a .jinja file.") from None
#: The skip reason of a record refused with ``on_error="skip"`` (``metrics()["skipped_by_reason"]``).
SKIP_REASON = "invalid_conversations"
# Names a message's reasoning goes under; transformers copies the first set one to the first two.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# The render in progress in this thread/context: how much the template has output, the generation spans.
_TRACKING: ContextVar["_Tracking | None"] = ContextVar("zephon_chat_tracking", default=None)


class ConversationError(ValueError):
    """A conversation that cannot be rendered; the message names the field (``messages[2].content``)."""


class TemplateLayoutError(ValueError):
    """A template without generation blocks whose renderings are not prefixes of each other."""


class _Tracking:
    __slots__ = ("rendered", "spans")

    def __init__(self) -> None:
        self.rendered = 0
        self.spans: list[tuple[int, int]] = []


def _environment(day: _dt.date) -> Any:
    """The sandboxed Jinja environment ``transformers`` compiles chat templates in, with ``strftime_now``
    formatting ``day`` instead of reading the clock."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(Extension):
        """``{% generation %}``: records the character span its body renders to, by position."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_generation", []), [], [], body).set_lineno(lineno)

        def _generation(self, caller: Any) -> str:
            text = caller()
            tracking = _TRACKING.get()
            if tracking is not None:  # the span starts after everything output so far (as AssistantTracker)
                tracking.spans.append((tracking.rendered, tracking.rendered + len(text)))
            return text

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    midnight = _dt.datetime(day.year, day.month, day.day)

    def strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
        return midnight.strftime(format)

    class TemplateDict:
        """``dict(...)`` without the dict type itself (no attribute access to break out of the sandbox)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` refusing underscore attributes (CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, dict(*args, **kwargs))

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store underscore-prefixed attributes "
                                                      f"on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env


def render(template: Any, **variables: Any) -> tuple[str, list[tuple[int, int]]]:
    """Render a compiled chat template, streaming it to locate its ``{% generation %}`` blocks by position.

    Args:
        template: a template compiled in :func:`_environment`'s environment.
        **variables: what the template sees (``messages``, ``add_generation_prompt``...).

    Returns:
        ``(text, spans)``: the rendered text and the ``(start, end)`` character span of each generation block,
        in the order they were rendered.
    """
    tracking = _Tracking()
    token = _TRACKING.set(tracking)
    try:
        parts = []
        for part in template.generate(**variables):
            parts.append(part)
            tracking.rendered += len(part)
    finally:
        _TRACKING.reset(token)
    return "".join(parts), tracking.spans


def assistant_tokens(starts: np.ndarray, ends: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``transformers``' ``assistant_masks`` rule: a token is marked when its character range overlaps a span.

    Spans are visited in order with the tokens: a span is passed once a token starts at or after its end,
    and the token is marked when it ends after the current span's start (``apply_chat_template``'s loop).

    Args:
        starts: each token's first character (int64 [n]).
        ends: each token's end character, exclusive (int64 [n]).
        spans: ``(start, end)`` character spans, in the order they were rendered.

    Returns:
        uint8 [n]: 1 on the marked tokens.
    """
    n = len(starts)
    target = np.zeros(n, dtype=np.uint8)
    if not n or not len(spans):
        return target
    bounds = np.asarray(spans, dtype=np.int64).reshape(-1, 2)
    if (np.diff(bounds[:, 1]) >= 0).all() and (np.diff(starts) >= 0).all():
        k = np.searchsorted(bounds[:, 1], starts, side="right")  # the first span that ends after the token starts
        live = k < len(bounds)
        target[live] = ends[live] > bounds[k[live], 0]
        return target
    k = 0  # spans or offsets out of order (nested blocks): the loop itself
    for t in range(n):
        while k < len(bounds) and starts[t] >= bounds[k, 1]:
            k += 1
        if k == len(bounds):
            break
        target[t] = ends[t] > bounds[k, 0]
    return target


def _day(date: Any) -> _dt.date:
    if isinstance(date, _dt.datetime):
        return date.date()
    if isinstance(date, _dt.date):
        return date
    try:
        return _dt.date.fromisoformat(str(date))
    except ValueError:
        raise ValueError(f"tokenize_chat(date={date!r}): give the day strftime_now formats as 'YYYY-MM-DD' "
                         f"(default {DEFAULT_DATE!r})") from None


class TokenizeChat(Transform):
    """Render and tokenize conversations with a loss mask on assistant turns (see the module docstring).

    Args:
        tokenizer: the tokenizer (``zephon.tokenizer(path)``).
        template: a chat template: a ``.jinja`` file or the template text.
        field: the record field that holds the messages.
        loss_on: ``"assistant"``, ``"last_assistant"`` or ``"all"``.
        add_eos: append the tokenizer's EOS after the rendered text.
        name, sources, executor: as for every transform.
        add_generation_prompt: the template variable (a prompt for the next assistant turn at the end).
        date: the day ``strftime_now`` formats (``"YYYY-MM-DD"``; default :data:`DEFAULT_DATE`).
        on_error: ``"raise"`` (a bad record is an error naming its file, row and field) or ``"skip"`` (it is
            skipped and counted as :data:`SKIP_REASON`).
    """

    _rows_checked = False  # its output fits the packed rows by construction

    op = "tokenize_chat"
    token_fields = {LOSS_MASK: (np.uint8, 1)}

    def __init__(self, tokenizer: TokenizerSpec, template: str | None, field: str = "messages",
                 loss_on: str = "assistant", add_eos: bool = False, name: str | None = None,
                 sources: Sequence[str] | None = None, executor: str | None = None, *,
                 add_generation_prompt: bool = False, date: Any = DEFAULT_DATE, on_error: str = "raise") -> None:
        super().__init__(name, sources, executor)
        if not isinstance(tokenizer, TokenizerSpec):
            raise PipelineError(f"tokenize_chat(tokenizer=...): pass zephon.tokenizer(path), got {tokenizer!r}")
        choice(loss_on, LOSS_ON, "tokenize_chat(loss_on)")
        choice(on_error, ON_ERROR, "tokenize_chat(on_error)")
        if not isinstance(template, str) or not template:
            raise PipelineError("tokenize_chat(template=...): pass a chat template (a .jinja file or the template "
                                "text)")
        self.tokenizer, self.field, self.loss_on, self.add_eos = tokenizer, field, loss_on, bool(add_eos)
        self.add_generation_prompt, self.on_error = bool(add_generation_prompt), on_error
        self.date = _day(DEFAULT_DATE if date is None else date).isoformat()
        # the template's text is the parameter (fingerprinted by its digest), wherever it was read from
        self.template = read_template(template)
        self._tok: Any = None
        self._template: Any = None
        self._specials: dict[str, str] = {}

    @property
    def spec(self) -> TokenizerSpec:
        return self.tokenizer

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tok": None, "_template": None}

    def bind(self, ctx: BindContext) -> TokenizeChat:
        return self._bound(_source_names=ctx.sources)  # to name a lane record's source in messages

    def setup(self) -> None:
        if self._tok is None:
            tok = shared_tokenizer(self.tokenizer)
            self._specials = tok.special_tokens()
            self._template = _environment(_day(self.date)).from_string(self.template)
            self._tok = tok

    @property
    def loaded(self) -> Any:
        """The loaded tokenizer (one per process and spec)."""
        self.setup()
        return self._tok

    # -- one conversation ---------------------------------------------------------------------------
    def _messages(self, messages: Any) -> list[dict]:
        """The messages as the template gets them (null keys dropped, reasoning aliased), checked."""
        if not isinstance(messages, list):
            raise ConversationError(f"field '{self.field}' must be a list of {{role, content}} messages, got "
                                    f"{type(messages).__name__}")
        out = []
        for k, message in enumerate(messages):
            where = f"{self.field}[{k}]"
            if not isinstance(message, dict):
                raise ConversationError(f"{where} must be a {{role, content}} message, got {type(message).__name__}")
            # transformers drops null-valued keys: templates test `'tool_calls' in message`, not its value.
            message = {key: value for key, value in message.items() if value is not None}
            role, content = message.get("role"), message.get("content")
            if not isinstance(role, str) or not role:
                raise ConversationError(f"{where}.role is {'missing' if role is None else repr(role)}: each message "
                                        f"needs a role (a string such as 'user' or 'assistant')")
            if content is None:
                if role != "assistant" or not message.get("tool_calls"):
                    raise ConversationError(f"{where}.content is missing (role {role!r}); only an assistant message "
                                            f"with tool_calls may have no content: an absent reply would train an "
                                            f"empty turn")
            elif not isinstance(content, str):
                raise ConversationError(f"{where}.content must be a string, got {type(content).__name__} "
                                        f"(role {role!r})")
            if any(key in message for key in _REASONING_FIELDS):  # as transformers' _alias_reasoning_fields
                reasoning = next(message[key] for key in _REASONING_FIELDS if key in message)
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            out.append(message)
        return out

    def _variables(self, record: Any) -> dict[str, Any]:
        """``tools`` and ``documents`` of a record (its fields of those names, else None), checked."""
        out = {}
        for key in ("tools", "documents"):
            value = record.get(key) if hasattr(record, "get") else None
            if value is not None and (not isinstance(value, list) or not all(isinstance(x, dict) for x in value)):
                raise ConversationError(f"field '{key}' must be a list of objects (JSON schemas for tools, "
                                        f"{{title, text}} for documents), got {type(value).__name__}"
                                        + (f" of {sorted({type(x).__name__ for x in value})}"
                                           if isinstance(value, list) else ""))
            out[key] = value
        return out

    def _render(self, messages: list, variables: dict, generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        try:
            return render(self._template, messages=messages, add_generation_prompt=generation_prompt,
                          **variables, **self._specials)
        except Exception as exc:  # noqa: BLE001 - the template is user code: raise_exception, undefined names...
            raise ConversationError(f"the chat template failed: {type(exc).__name__}: {exc}") from exc

    def _check_rendered(self, messages: list, text: str, variables: dict) -> None:
        """Each message's text must reach the rendered text, else the template cannot render its role (it
        dropped the message). The plain search settles almost every message; one the template transforms
        (trims, cuts) is rendered again with a placeholder content, which must appear."""
        missing = [k for k, m in enumerate(messages)
                   if isinstance(m.get("content"), str) and m["content"].strip() and m["content"].strip() not in text]
        if not missing:
            return
        # Lowercase ASCII letters and digits: they survive escaping (tojson) and case filters (lower, trim).
        probe = [dict(m, content=f"zephonprobe{k}x") if k in missing else m for k, m in enumerate(messages)]
        try:
            probed, _ = self._render(probe, variables, self.add_generation_prompt)
        except ConversationError:  # the template depends on the content: the real render stands
            return
        for k in missing:
            if f"zephonprobe{k}x" not in probed:
                raise ConversationError(f"{self.field}[{k}] (role {messages[k]['role']!r}) is not rendered by the "
                                        f"chat template: its content appears nowhere in the text. Use a role the "
                                        f"template renders, or a template that renders this one")

    def spans(self, messages: Any, record: Any = None) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text and the character spans that carry loss.

        Args:
            messages: the conversation (a list of messages).
            record: the record it comes from, for its ``tools`` and ``documents`` fields (None: none).

        Returns:
            ``(text, spans)``.
        """
        self.setup()
        messages = self._messages(messages)
        variables = self._variables(record if record is not None else {})
        text, spans = self._render(messages, variables, self.add_generation_prompt)
        self._check_rendered(messages, text, variables)
        if self.loss_on == "all":
            return text, [(0, len(text))]
        if not spans:  # no generation tags: render prefix by prefix
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self._render(messages[:k], variables, True)[0]
                through = self._render(messages[:k + 1], variables, False)[0]
                if not text.startswith(through) or not through.startswith(before):
                    raise TemplateLayoutError("the chat template does not render conversations as prefixes of each "
                                              "other, so assistant turns cannot be located: mark them with "
                                              "{% generation %} ... {% endgeneration %} in the template")
                spans.append((len(before), len(through)))
        if self.loss_on == "last_assistant":
            spans = spans[-1:]
        return text, spans

    def targets(self, messages: Any, record: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, target uint8)`` of one conversation: 1 on the tokens of the turns that carry loss
        (what ``transformers`` calls ``assistant_masks``).

        Args:
            messages: the conversation.
            record: its record, for ``tools`` and ``documents`` (None: none).

        Returns:
            ``(input_ids, target)``.
        """
        text, spans = self.spans(messages, record)
        ids, starts, ends = self._tok.encode_offsets(text)
        if self.loss_on == "all":
            return ids, np.ones(len(ids), dtype=np.uint8)
        return ids, assistant_tokens(starts, ends, spans)

    def encode(self, messages: Any, record: Any = None) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids int32, loss_mask uint8)`` of one conversation: ``loss_mask[i]`` says whether the
        label at ``i`` (token ``i+1``) is a target.

        Args:
            messages: the conversation.
            record: its record, for ``tools`` and ``documents`` (None: none).

        Returns:
            ``(input_ids, loss_mask)``.
        """
        ids, target = self.targets(messages, record)
        if self.add_eos and self._tok.eos_id is not None:
            ids = np.append(ids, np.int32(self._tok.eos_id))
            target = np.append(target, target[-1] if len(target) else 0)
        mask = np.zeros(len(ids), dtype=np.uint8)
        mask[:-1] = target[1:]  # the label at i is token i+1
        return ids.astype(np.int32), mask

    def _source_of(self, rec: Any) -> str:
        """``'web'``: the name of the source a lane record came from (its index if the name is unknown)."""
        s, names = doc_source(rec), getattr(self, "_source_names", ())
        return f"'{names[s]}'" if 0 <= s < len(names) else str(s)

    def _refused(self, exc: ConversationError, where: str) -> SourceError:
        return SourceError(f"operator '{self.name}': {where}: {exc}. Fix the record, or pass "
                           f"tokenize_chat(on_error='skip') to skip and count such records ({SKIP_REASON}).")

    # -- chunks ----------------------------------------------------------------------------------------
    def _apply_chunk(self, chunk: Chunk) -> Chunk:
        self.setup()
        conversations = chunk.columns.get(self.field)
        if conversations is None:
            raise SourceError(f"operator '{self.name}': records of source '{chunk.source_name}' ({chunk.path}) "
                              f"have no field '{self.field}' "
                              f"(fields: {', '.join(chunk.columns) or 'none'}). Read the messages column, or set "
                              f"tokenize_chat(field=...).")
        extra = {key: chunk.columns[key] for key in ("tools", "documents") if key in chunk.columns}
        ids, masks, keep, invalid = [], [], [], 0
        for j, messages in enumerate(conversations):
            if messages is None or (isinstance(messages, list) and not messages):
                continue
            try:
                a, m = self.encode(messages, {key: column[j] for key, column in extra.items()})
            except ConversationError as exc:
                if self.on_error == "skip":
                    invalid += 1
                    continue
                raise self._refused(exc, chunk.where(j)) from exc
            except TemplateLayoutError as exc:  # the template's doing, not the record's: never skipped
                raise SourceError(f"operator '{self.name}': cannot locate the assistant turns of {chunk.where(j)}: "
                                  f"{exc}") from exc
            if len(a):
                ids.append(a)
                masks.append(m)
                keep.append(j)
        chunk.count(SKIP_REASON, invalid)
        chunk.count("blank_records", chunk.n - len(keep) - invalid)
        out = chunk.select(np.asarray(keep, dtype=np.int64))
        out.columns = {k: v for k, v in out.columns.items() if k != self.field and k not in extra}
        lengths = np.fromiter((len(a) for a in ids), dtype=np.int64, count=len(ids))
        out.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        out.token_fields = {INPUT_IDS: np.concatenate(ids) if ids else np.zeros(0, np.int32),
                            LOSS_MASK: np.concatenate(masks) if masks else np.zeros(0, np.uint8)}
        return out

    def _apply_records(self, records: list[Any]) -> list[Any]:
        self.setup()
        out = []
        for rec in records:
            messages = rec.get(self.field)
            if not messages:
                continue
            try:
                a, m = self.encode(messages, rec)
            except ConversationError as exc:
                if self.on_error == "skip":
                    continue
                raise self._refused(exc, f"a record of source {self._source_of(rec)} in the lane") from exc
            if len(a):
                consumed = (self.field, "tools", "documents")
                doc = Doc({k: v for k, v in rec.items() if k not in consumed}, getattr(rec, "tail", -100),
                          getattr(rec, "source", -1), doc_origin(rec))
                doc[INPUT_IDS], doc[LOSS_MASK] = a, m
                out.append(doc)
        return out
