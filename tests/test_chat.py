"""Chat / SFT: ``tokenize_chat`` against transformers' ``apply_chat_template``, and chat pipelines.

The tokenizers are the suite's three (``tokenizer.json`` with the chat templates' control tokens added as
special tokens, the SentencePiece model, the tiktoken file), each loaded by Zephon and by transformers from
the same file (transformers converts the ``.model`` and ``.tiktoken`` files itself; nothing is downloaded).
The templates are written here, in the styles of Llama 3, ChatML/Qwen (tools, documents) and Mistral (BOS,
EOS, UNK, PAD, ``raise_exception``). On a few hundred generated conversations (system prompts, several
turns, empty turns, tool calls, reasoning, unicode, turns longer than a 64-token row, messages with null
keys as Parquet gives them, user text that looks like markers, Jinja or special tokens), ``tokenize_chat``
must give the ``input_ids`` and the assistant tokens of ``return_assistant_tokens_mask`` exactly; packed
into batches, ``labels`` must be -100 exactly where no assistant token is predicted; a malformed record is an
error naming the file, the record and the field, or is skipped and counted; and a pipeline mixing chat data
with plain text must stay elastic.
"""

from __future__ import annotations

import datetime
import importlib
import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zephon as z
from zephon.ops.tokenize_chat import DEFAULT_DATE, SKIP_REASON, TokenizeChat, assistant_tokens
from zephon.ops.tokenize import shared_tokenizer
from zephon.errors import SourceError
from zephon.verify import global_hashes

from .conftest import tiktoken_options
from .optional import require

TAGGED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}"
          "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
UNTAGGED = TAGGED.replace("{% generation %}", "").replace("{% endgeneration %}", "")

CONVERSATIONS = [
    [{"role": "user", "content": "What does os.path.join do?"},
     {"role": "assistant", "content": "It joins path components with the separator."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "Six, of course: ünïcode ✓."}],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def hf(transformers, hf_tokenizer):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(hf_tokenizer))
    tok.chat_template = TAGGED
    return tok


@pytest.fixture(scope="module")
def spec(hf_tokenizer):
    return z.tokenizer(str(hf_tokenizer))


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_ids_and_assistant_tokens_equal_transformers(hf, spec, k):
    messages = CONVERSATIONS[k]
    want = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, target = TokenizeChat(spec, TAGGED).targets(messages)
    assert ids.tolist() == list(want["input_ids"])
    assert target.tolist() == list(want["assistant_masks"])
    if any(m["role"] == "assistant" and m["content"] for m in messages):
        assert target.sum() > 0  # the comparison is not vacuous


@pytest.mark.parametrize("k", range(len(CONVERSATIONS)))
def test_a_template_without_generation_tags_finds_the_same_turns(spec, k):
    """Rendered prefix by prefix, an assistant turn spans from the end of the prompt before it to the end
    of the conversation through it: the same tokens the tagged template marks."""
    tagged = TokenizeChat(spec, TAGGED).targets(CONVERSATIONS[k])
    untagged = TokenizeChat(spec, UNTAGGED).targets(CONVERSATIONS[k])
    assert [a.tolist() for a in tagged] == [a.tolist() for a in untagged]


def test_loss_on_the_last_turn_or_everything(spec):
    messages = CONVERSATIONS[1]
    every = TokenizeChat(spec, TAGGED).targets(messages)[1]
    last = TokenizeChat(spec, TAGGED, loss_on="last_assistant").targets(messages)[1]
    whole = TokenizeChat(spec, TAGGED, loss_on="all").targets(messages)[1]
    assert 0 < last.sum() < every.sum() and whole.all()
    assert np.all(last <= every) and last[-1] == every[-1]


def test_the_loss_mask_is_the_target_of_the_next_position(spec):
    ids, target = TokenizeChat(spec, TAGGED).targets(CONVERSATIONS[0])
    _, mask = TokenizeChat(spec, TAGGED).encode(CONVERSATIONS[0])
    assert mask[:-1].tolist() == target[1:].tolist() and mask[-1] == 0


def test_a_template_that_is_not_prefix_stable_is_refused(spec):
    odd = "{{ messages | length }}:{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    with pytest.raises(ValueError, match="generation"):
        TokenizeChat(spec, odd).targets(CONVERSATIONS[0])


# -- transformers, and the suite's three tokenizers as both load them --------------------------------------
TRANSFORMERS_VERSION = "5.24"  # whose assistant_masks rule (token offsets overlapping a block) Zephon follows
DAY = datetime.datetime(2026, 1, 1)
assert DAY.date().isoformat() == DEFAULT_DATE
# The templates' control tokens, special tokens of the tokenizer.json (as in the models they imitate).
CHAT_SPECIALS = ["<|begin_of_text|>", "<unk>", "<pad>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
                 "<|end_header_id|>", "<|eot_id|>", "[INST]", "[/INST]", "[SYS]", "[/SYS]"]


class _Clock(datetime.datetime):
    """transformers' ``strftime_now`` reads the clock: here the clock reads ``_Clock.day``."""

    day = DAY

    @classmethod
    def now(cls, tz: Any = None) -> datetime.datetime:
        return cls.day


@pytest.fixture(scope="module")
def transformers():
    tf = require("transformers")
    have = tuple(int(x) for x in tf.__version__.split(".")[:2])
    if have < tuple(int(x) for x in TRANSFORMERS_VERSION.split(".")):
        pytest.skip(f"transformers {tf.__version__}: its assistant_masks rule predates {TRANSFORMERS_VERSION}, "
                    f"the one tokenize_chat follows (.ci/constraints.txt pins it)")
    convert = importlib.import_module("transformers.convert_slow_tokenizer")
    chat_template_utils = importlib.import_module("transformers.utils.chat_template_utils")

    with pytest.MonkeyPatch.context() as mp:
        try:  # sentencepiece's generated protobuf module refuses a protobuf runtime older than its gencode
            from sentencepiece import sentencepiece_model_pb2  # noqa: F401
        except Exception:  # noqa: BLE001 - then transformers' converter reads the .model with its own copy
            from transformers.utils import sentencepiece_model_pb2_new

            mp.setattr(convert, "import_protobuf", lambda error_message="": sentencepiece_model_pb2_new)
        mp.setattr(chat_template_utils, "datetime", _Clock)
        yield tf


@dataclass
class Pair:
    """One tokenizer file, loaded by Zephon (``spec``) and by transformers (``hf``)."""

    kind: str
    spec: Any
    hf: Any


@pytest.fixture(scope="module", params=["huggingface", "sentencepiece", "tiktoken"])
def pair(request, transformers, tmp_path_factory, hf_tokenizer, sp_model, tiktoken_file) -> Pair:
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind, folder = request.param, tmp_path_factory.mktemp(request.param)
    if kind == "huggingface":
        tok = Tokenizer.from_file(str(hf_tokenizer))
        tok.add_special_tokens(CHAT_SPECIALS)
        tok.model.unk_token = "<unk>"
        tok.save(str(folder / "tokenizer.json"))
        spec = z.tokenizer(str(folder / "tokenizer.json"), pad_id=tok.token_to_id("<pad>"))
        hf = TokenizersBackend.from_pretrained(str(folder), bos_token="<|begin_of_text|>", eos_token="<|endoftext|>",
                                               unk_token="<unk>", pad_token="<pad>")
    elif kind == "sentencepiece":  # converted by transformers from the .model (tokenizer.model in a folder)
        shutil.copy(sp_model, folder / "tokenizer.model")
        spec = z.tokenizer(str(sp_model))
        hf = TokenizersBackend.from_pretrained(str(folder), pad_token="<pad>")  # the model's own pad piece
    else:  # converted by transformers from the .tiktoken file, its special tokens after the ranks as Zephon's
        shutil.copy(tiktoken_file, folder / "tokenizer.model")
        options = tiktoken_options(tiktoken_file)
        eos = options["special_tokens"]["<|endoftext|>"]
        spec = z.tokenizer(str(tiktoken_file), bos_token="<|begin_of_text|>", pad_id=eos, pat_str=options["pat_str"],
                           special_tokens={**options["special_tokens"], "<|begin_of_text|>": eos + 1})
        hf = TokenizersBackend.from_pretrained(str(folder), extra_special_tokens=["<|endoftext|>", "<|begin_of_text|>"],
                                               bos_token="<|begin_of_text|>", eos_token="<|endoftext|>",
                                               pad_token="<|endoftext|>")
    return Pair(kind, spec, hf)


def test_the_special_tokens_a_template_sees_are_the_same(pair):
    assert shared_tokenizer(pair.spec).special_tokens() == pair.hf.special_tokens_map
    assert {"bos_token", "eos_token", "pad_token"} <= set(pair.hf.special_tokens_map)


# -- templates written here, in the styles of the models' own ---------------------------------------------
LLAMA3 = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + strftime_now('%d %b %Y') + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'assistant' %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- generation %}"
    "{%- if message.thinking is defined %}{{- '<think>' + message.thinking + '</think>\\n' }}{%- endif %}"
    "{%- if message.tool_calls is defined %}{{- message.tool_calls | tojson }}"
    "{%- else %}{{- message['content'] | trim }}{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endgeneration %}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + ('ipython' if message['role'] == 'tool' else message['role']) }}"
    "{{- '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
CHATML = (
    "{%- if tools or documents or messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}{{- '\\n</tools>' }}{%- endif %}"
    "{%- if documents %}{{- '\\n\\n# Documents' }}"
    "{%- for doc in documents %}{{- '\\n[' + loop.index | string + '] ' + doc['title'] + ': ' + doc['text'] }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- generation %}"
    "{{- message['content'] if message['content'] is defined else '' }}"
    "{%- if message.tool_calls is defined %}{%- for call in message.tool_calls %}"
    "{{- '\\n<tool_call>\\n' + call.function | tojson + '\\n</tool_call>' }}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endgeneration %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML_UNTAGGED = CHATML.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
MISTRAL = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'system' %}{{- '[SYS] ' + message['content'] + ' [/SYS]' + pad_token }}"
    "{%- elif message['role'] == 'tool' %}{{- '[TOOL_RESULTS] ' + message['content'] + ' [/TOOL_RESULTS]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- generation %}"
    "{%- if message.tool_calls is defined %}{{- '[TOOL_CALLS] ' + message.tool_calls | tojson }}{%- endif %}"
    "{{- (message['content'] if message['content'] is defined else '') or unk_token }}"
    "{{- eos_token }}"
    "{%- endgeneration %}"
    "{%- else %}{{- raise_exception('Only system, user, assistant and tool roles are supported') }}"
    "{%- endif %}"
    "{%- endfor %}"
)
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL}


# -- conversations ---------------------------------------------------------------------------------------
UNICODE = ["naïve café, déjà vu", "日本語のテキストです。", "emoji 😀🎉 inside", "Ελληνικά και עברית", "ﬁne ligatures ①②③",
           "∑ x² ≤ 10 ✓", "Ünïcödé\u00a0non-breaking", "tab\tand\u3000ideographic space"]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the library's documentation",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}}}}},
]
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name", "reasoning")


def make_conversations(texts: list[str], n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` records ``{"messages", "tools", "documents"}``, deterministic in ``seed``: system prompts, one to four
    exchanges, empty turns, tool calls and results, reasoning, unicode, whitespace at the edges, turns cut from
    the corpus (longer than a 64-token row), and every third record with every key on every message, None where
    a message has no such key (as a Parquet source gives them)."""
    rng = random.Random(seed)
    pool = [t for t in texts if t and 20 < len(t)]

    def snippet(long: bool) -> str:
        text = rng.choice(pool)
        size = rng.randint(300, 900) if long else rng.randint(10, 120)
        at = rng.randrange(max(1, len(text) - size))
        return text[at:at + size]

    def content(role: str) -> str:
        r = rng.random()
        if r < 0.08:
            return ""
        if r < 0.2:
            return rng.choice(UNICODE)
        if r < 0.3:
            return rng.choice(["  ", "\n", " \n\n"]) + snippet(False) + rng.choice(["  ", "\n", "\n\n", " \n"])
        return snippet(long=rng.random() < (0.35 if role == "assistant" else 0.15))

    records = []
    for i in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": rng.choice(["You are terse.", "Answer in French.",
                                                                      snippet(False), ""])})
        for t in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": content("user")})
            if rng.random() < 0.15:
                call = f"call_{i}_{t}"
                name = rng.choice(["get_weather", "search"])
                messages.append({"role": "assistant", "content": rng.choice([None, ""]), "tool_calls": [
                    {"id": call, "type": "function",
                     "function": {"name": name, "arguments": {"city": "Zürich"} if name == "get_weather"
                                  else {"query": snippet(False)}}}]})
                messages.append({"role": "tool", "tool_call_id": call, "name": name,
                                 "content": json.dumps({"result": snippet(False)})})
            reply = {"role": "assistant", "content": content("assistant")}
            if rng.random() < 0.1:
                reply["reasoning"] = "Let me think: " + snippet(False)
            messages.append(reply)
        if i % 3 == 0:
            messages = [{key: m.get(key) for key in MESSAGE_KEYS} for m in messages]
        tools = rng.sample(TOOLS, rng.randint(1, 2)) if rng.random() < 0.3 else None
        documents = [{"title": f"Doc {k}", "text": snippet(False)} for k in range(rng.randint(1, 2))] \
            if rng.random() < 0.2 else None
        records.append({"messages": messages, "tools": tools, "documents": documents})
    return records


@pytest.fixture(scope="module")
def conversations(corpus_texts) -> list[dict[str, Any]]:
    return make_conversations(corpus_texts, 300, seed=42)


def want(pair: Pair, template: str, record: dict[str, Any], add_generation_prompt: bool = False) -> dict:
    return pair.hf.apply_chat_template(record["messages"], tools=record["tools"], documents=record["documents"],
                                       chat_template=template, add_generation_prompt=add_generation_prompt,
                                       tokenize=True, return_dict=True, return_assistant_tokens_mask=True)


def compare(pair: Pair, chat: TokenizeChat, template: str, records: list[dict[str, Any]],
            add_generation_prompt: bool = False) -> dict[str, int]:
    """Zephon's ids and targets against transformers' on every record (``template`` for transformers, which
    may differ from ``chat``'s: the tagged twin of an untagged one); returns what the comparison covered."""
    seen = {"records": 0, "targets": 0, "others": 0, "mixed": 0, "longest": 0}
    for k, record in enumerate(records):
        expect = want(pair, template, record, add_generation_prompt)
        ids, target = chat.targets(record["messages"], record)
        assert ids.tolist() == list(expect["input_ids"]), f"record {k}: input_ids differ"
        assert target.tolist() == list(expect["assistant_masks"]), \
            f"record {k}: assistant tokens differ at {np.flatnonzero(target != expect['assistant_masks'])[:8]}"
        seen["records"] += 1
        seen["targets"] += int(target.sum())
        seen["others"] += int(len(target) - target.sum())
        seen["mixed"] += int(0 < target.sum() < len(target))
        seen["longest"] = max(seen["longest"], len(ids))
    return seen


def assert_covered(seen: dict[str, int], records: int) -> None:
    """The comparison is not vacuous: most records have both targets and other tokens, and some are long."""
    assert seen["records"] == records
    assert seen["targets"] > 0 and seen["others"] > 0
    assert seen["mixed"] > 0.8 * records, seen
    assert seen["longest"] > 64, seen


def test_the_conversations_cover_what_they_should(conversations):
    messages = [m for r in conversations for m in r["messages"]]
    assert len(conversations) >= 300
    assert sum(1 for m in messages if "tool_calls" in m and m["tool_calls"]) > 20
    assert sum(1 for m in messages if m.get("content") == "") > 20
    assert sum(1 for m in messages if any(v is None for v in m.values())) > 200  # null keys
    assert sum(1 for m in messages if m.get("content") and len(m["content"]) > 300) > 50
    assert sum(1 for r in conversations if r["tools"]) > 50 and sum(1 for r in conversations if r["documents"]) > 30
    assert sum(1 for r in conversations if r["messages"][0]["role"] == "system") > 80


@pytest.mark.timeout(300)
@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_ids_and_assistant_tokens_equal_transformers_on_generated_conversations(pair, conversations, style):
    """300 conversations, each template, each tokenizer kind: ids and assistant tokens exactly transformers'."""
    chat = TokenizeChat(pair.spec, TEMPLATES[style])
    assert_covered(compare(pair, chat, TEMPLATES[style], conversations), len(conversations))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_with_the_generation_prompt_too(pair, conversations, style):
    chat = TokenizeChat(pair.spec, TEMPLATES[style], add_generation_prompt=True)
    records = conversations[:100]
    assert_covered(compare(pair, chat, TEMPLATES[style], records, add_generation_prompt=True), len(records))
    if style != "mistral":  # the prompt is rendered: the text differs from the one without it
        text = chat.spans(records[0]["messages"], records[0])[0]
        assert text.endswith("\n\n" if style == "llama3" else "<|im_start|>assistant\n")


@pytest.mark.timeout(300)
def test_an_untagged_template_finds_the_tokens_transformers_marks_in_its_tagged_twin(pair, conversations):
    """Rendered prefix by prefix (no generation blocks), ChatML's assistant turns are located exactly where the
    tagged template's blocks are: transformers' masks of the tagged one."""
    chat = TokenizeChat(pair.spec, CHATML_UNTAGGED)
    assert_covered(compare(pair, chat, CHATML, conversations), len(conversations))


def test_the_template_variables_reach_the_text(pair, conversations):
    """What the comparisons above rely on: the templates do print the special tokens, the date, tools and
    documents (so a wrong value would change ids)."""
    specials = shared_tokenizer(pair.spec).special_tokens()
    with_tools = next(r for r in conversations if r["tools"] and r["documents"])
    text = TokenizeChat(pair.spec, CHATML).spans(with_tools["messages"], with_tools)[0]
    assert ('"get_weather"' in text or '"search"' in text) and with_tools["documents"][0]["text"] in text
    text = TokenizeChat(pair.spec, LLAMA3).spans(conversations[0]["messages"])[0]
    assert text.startswith(specials["bos_token"]) and "Today Date: 01 Jan 2026" in text
    system = next(r for r in conversations if r["messages"][0]["role"] == "system")
    text = TokenizeChat(pair.spec, MISTRAL).spans(system["messages"])[0]
    assert specials["pad_token"] in text and text.count(specials["eos_token"]) >= 1


def test_the_date_is_the_pipelines_and_in_its_fingerprint(pair, conversations):
    """strftime_now prints the pipeline's date, never the clock's; transformers with its clock on that day agrees."""
    record = conversations[1]
    default, other = TokenizeChat(pair.spec, LLAMA3), TokenizeChat(pair.spec, LLAMA3, date="2025-03-04")
    assert "Today Date: 04 Mar 2025" in other.spans(record["messages"])[0]
    assert default.describe()["date"] == DEFAULT_DATE and other.describe()["date"] == "2025-03-04"
    _Clock.day = datetime.datetime(2025, 3, 4)
    try:
        expect = want(pair, LLAMA3, record)
    finally:
        _Clock.day = DAY
    ids, target = other.targets(record["messages"], record)
    assert ids.tolist() == list(expect["input_ids"]) and target.tolist() == list(expect["assistant_masks"])
    assert ids.tolist() != default.targets(record["messages"], record)[0].tolist()
    with pytest.raises(ValueError, match="YYYY-MM-DD"):
        TokenizeChat(pair.spec, LLAMA3, date="yesterday")


# -- text in a message cannot touch the mask --------------------------------------------------------------
FORGERIES = ["\x00GEN\x01", "\x00END\x01", "\x00GEN\x01 not a target \x00END\x01", "{% generation %}",
             "{% endgeneration %}", "{{ eos_token }}", "{% generation %}x{% endgeneration %}", "<|im_start|>assistant\n",
             "<|im_end|>", "<|eot_id|>", "</s>", "<s>", "<unk>", "<pad>", "<|endoftext|>", "[INST]", "[/INST]",
             "zephonprobe1x", "\r\n", "\u200b", "\x7f", "\x1b[31m"]


def hostile_text(rng: random.Random, kind: str) -> str:
    """Text with marker bytes, Jinja, the templates' and tokenizers' special tokens, control characters and (for
    byte-level tokenizers, which encode any code point as transformers does) random code points."""
    parts = []
    for _ in range(rng.randint(1, 8)):
        r = rng.random()
        if r < 0.45:
            parts.append(rng.choice(FORGERIES))
        elif r < 0.65 and kind != "sentencepiece":
            # any code point but surrogates (SentencePiece's own normalizer composes some clusters, e.g. conjoining
            # jamo, that transformers' conversion of it leaves apart: docs/guides/chat.md)
            parts.append("".join(chr(rng.choice([rng.randrange(0, 0xD800), rng.randrange(0xE000, 0x110000)]))
                                 for _ in range(rng.randint(1, 6))))
        elif r < 0.8:
            parts.append("".join(chr(rng.randrange(0, 0x80)) for _ in range(rng.randint(1, 6))))
        else:
            parts.append(rng.choice(UNICODE))
    return "".join(parts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("style", ["chatml", "mistral"])
def test_message_text_never_changes_the_mask(pair, style):
    """User text holding any characters (the old marker bytes, Jinja, special tokens...) gives exactly
    transformers' ids and mask, and no token inside the user's text is ever a target."""
    rng = random.Random(7)
    records = []
    for i in range(60):
        messages = [{"role": "user", "content": hostile_text(rng, pair.kind)},
                    {"role": "assistant", "content": rng.choice(["Fine.", "", hostile_text(rng, pair.kind)])},
                    {"role": "user", "content": hostile_text(rng, pair.kind)},
                    {"role": "assistant", "content": "Done."}]
        records.append({"messages": messages, "tools": None, "documents": None})
    chat = TokenizeChat(pair.spec, TEMPLATES[style])
    seen = compare(pair, chat, TEMPLATES[style], records)
    assert seen["targets"] > 0 and seen["others"] > 0 and seen["mixed"] == len(records)
    tok = shared_tokenizer(pair.spec)
    header = {"chatml": "<|im_start|>user\n", "mistral": "[INST] "}[style]
    for record in records:
        messages = record["messages"]
        text, _ = chat.spans(messages)
        ids, target = chat.targets(messages)
        _, starts, ends = tok.encode_offsets(text)
        for k in (0, 2):  # where the user's text is: after the conversation before it and the user header
            before = chat.spans(messages[:k])[0] if k else tok.special_tokens()["bos_token"] * (style == "mistral")
            a = len(before) + len(header)
            b = a + len(messages[k]["content"])
            assert text[:a].endswith(header) and text[a:b] == messages[k]["content"]
            assert not target[(starts >= a) & (ends <= b)].any()


@pytest.mark.timeout(300)
def test_token_offsets_equal_transformers(pair, conversations):
    """What the assistant tokens are computed from: each token's id and character range, exactly transformers'
    (its tokenizer's offset_mapping), on rendered conversations and on text made of whitespace runs, CRLF,
    control characters, special tokens and unicode (SentencePiece: the converted normalizer's alignment)."""
    rng = random.Random(3)
    pieces = FORGERIES + UNICODE + [" ", "  ", "\n", "\n\n", "\t", " \n ", "\r\n", " \r\n\r\n ", "\u00a0", "\u3000",
                                    "e\u0301", "\u00ad", "\x00", "\x00 ", " \x7f", "\ufeff"]
    words = " ".join(m["content"] for r in conversations[:40] for m in r["messages"] if m.get("content")).split()
    texts = [TokenizeChat(pair.spec, CHATML).spans(r["messages"], r)[0] for r in conversations[:60]]
    texts += ["".join(rng.choice(pieces) if rng.random() < 0.5 else rng.choice(words) for _ in range(rng.randint(1, 20)))
              for _ in range(400)]
    tok, differ = shared_tokenizer(pair.spec), []
    for text in texts:
        ids, starts, ends = tok.encode_offsets(text)
        expect = pair.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        if ids.tolist() != expect["input_ids"] or \
                list(zip(starts.tolist(), ends.tolist())) != [tuple(o) for o in expect["offset_mapping"]]:
            differ.append(text)
    assert not differ, f"{len(differ)} of {len(texts)} texts differ, e.g. {differ[:3]!r}"


def test_the_old_marker_bytes_are_plain_text(pair):
    messages = [{"role": "user", "content": "\x00GEN\x01 this is not a target \x00END\x01"},
                {"role": "assistant", "content": "ok"}]
    text, spans = TokenizeChat(pair.spec, CHATML).spans(messages)
    assert "\x00GEN\x01 this is not a target \x00END\x01" in text
    assert [text[a:b] for a, b in spans] == ["ok<|im_end|>\n"]


SPACED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + ' ' }}"
          "{% endgeneration %}{% else %}{{ m['role'] + ': ' + m['content'] | trim + ' ' }}{% endif %}{% endfor %}")


@pytest.mark.timeout(300)
def test_with_offsets_that_skip_whitespace_a_token_after_a_block_is_not_a_target(transformers, tmp_path,
                                                                                 hf_tokenizer, conversations):
    """A tokenizer.json whose offsets leave whitespace out (ByteLevel trim_offsets): a block ending in a space
    that the next turn's first token absorbs (" user") does not make that token a target, because its range
    starts after the block (it was, when the block's last character was looked up among the tokens' ends)."""
    from tokenizers import Tokenizer, processors
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    tok = Tokenizer.from_file(str(hf_tokenizer))
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    trimmed = Pair("huggingface", z.tokenizer(str(tmp_path / "tokenizer.json")),
                   TokenizersBackend.from_pretrained(str(tmp_path), eos_token="<|endoftext|>"))
    records = [r for r in conversations if "tool_calls" not in json.dumps(r["messages"])][:150]
    chat = TokenizeChat(trimmed.spec, SPACED)
    assert_covered(compare(trimmed, chat, SPACED, records), len(records))
    # Not vacuous: after most blocks, the old lookup of the block's last character (a space the next token
    # absorbed and its trimmed range leaves out) lands on a token that starts after the block.
    old_rule_differs = 0
    for record in records:
        text, spans = chat.spans(record["messages"])
        _, starts, ends = shared_tokenizer(trimmed.spec).encode_offsets(text)
        target = chat.targets(record["messages"])[1]
        for _, end in spans[:-1] if spans and spans[-1][1] == len(text) else spans:
            k = int(np.searchsorted(ends, end - 1, side="right"))
            old_rule_differs += bool(starts[k] >= end and not target[k])
    assert old_rule_differs > 100


def test_tools_and_documents_are_none_when_a_record_has_none(hf_tokenizer):
    chat = TokenizeChat(z.tokenizer(str(hf_tokenizer)), "{{ tools is none }} {{ documents is none }} "
                                                         "{{ messages[0]['content'] }}")
    assert chat.spans([HELLO])[0] == "True True hello"
    assert chat.spans([HELLO], {"tools": TOOLS, "documents": None})[0] == "False True hello"


def test_the_assistant_tokens_rule_is_transformers_loop():
    """The vectorised rule against transformers' loop, on offsets that skip whitespace and empty or touching
    blocks: a token is marked when it overlaps a block, never because it merely touches one."""
    starts, ends = np.array([0, 5, 6, 9, 10, 14, 14]), np.array([4, 6, 9, 10, 14, 14, 20])

    def loop(spans):
        mask, k = [0] * len(starts), 0
        for t, (a, b) in enumerate(zip(starts, ends)):
            while k < len(spans) and a >= spans[k][1]:
                k += 1
            if k == len(spans):
                break
            if b > spans[k][0]:
                mask[t] = 1
        return mask

    for spans in ([(5, 9)], [(4, 5)], [(0, 20)], [(6, 6)], [(9, 10), (14, 14)], [(2, 3), (10, 12)], [(5, 9), (3, 4)]):
        assert assistant_tokens(starts, ends, spans).tolist() == loop(spans), spans
    assert assistant_tokens(starts, ends, [(5, 9)]).tolist() == [0, 1, 1, 0, 0, 0, 0]


# -- messages a template cannot render ------------------------------------------------------------------
DROPPING = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ 'U: ' + m['content'] + '\\n' }}"
            "{% elif m['role'] == 'assistant' %}{% generation %}{{ 'A: ' + m['content'] + '\\n' }}{% endgeneration %}"
            "{% endif %}{% endfor %}")
HELLO = {"role": "user", "content": "hello"}


@pytest.mark.parametrize("template,messages,extra,expect", [
    (CHATML, "hello", {}, "field 'messages' must be a list of {role, content} messages, got str"),
    (CHATML, ["hello"], {}, "messages[0] must be a {role, content} message, got str"),
    (CHATML, [{"content": "hello"}], {}, "messages[0].role is missing"),
    (CHATML, [{"role": 3, "content": "hello"}], {}, "messages[0].role is 3"),
    (CHATML, [HELLO, {"role": "assistant"}], {}, "messages[1].content is missing (role 'assistant')"),
    (CHATML, [HELLO, {"role": "assistant", "content": None, "tool_calls": None}], {},
     "messages[1].content is missing (role 'assistant')"),
    (CHATML, [{"role": "user", "content": [{"type": "text", "text": "hello"}]}], {},
     "messages[0].content must be a string, got list"),
    (CHATML, [{"role": "tool", "name": "search"}], {}, "messages[0].content is missing (role 'tool')"),
    (DROPPING, [{"role": "narrator", "content": "Once upon a time"}, HELLO], {},
     "messages[0] (role 'narrator') is not rendered by the chat template"),
    (MISTRAL, [{"role": "developer", "content": "be brief"}, HELLO], {},
     "the chat template failed: TemplateError: Only system, user, assistant and tool roles are supported"),
    (CHATML, [HELLO], {"tools": "get_weather"}, "field 'tools' must be a list of objects"),
    (CHATML, [HELLO], {"documents": ["just text"]}, "field 'documents' must be a list of objects"),
])
def test_a_malformed_record_names_file_record_and_field(tmp_path, sp_model, template, messages, extra, expect):
    path = tmp_path / "chat.jsonl"
    good = [{"messages": [HELLO, {"role": "assistant", "content": f"Hi {k}."}], "tools": None, "documents": None}
            for k in range(30)]
    bad = {"messages": messages, "tools": None, "documents": None, **extra}
    lines = [json.dumps(r, ensure_ascii=False).encode() for r in good[:20] + [bad] + good[20:]]
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = path.read_bytes().index(lines[20])
    pipe = (z.Pipeline(seed=1, lanes=1)
            .source("chat", z.read.jsonl(str(path), columns=["messages", "tools", "documents"]), passes=1)
            .tokenize_chat(z.tokenizer(str(sp_model)), template).pack(seq_len=64).batch(rows_per_lane=2))
    with pytest.raises(SourceError) as info:
        for _ in pipe.build():
            pass
    msg = str(info.value)
    assert str(path) in msg and f"byte {offset}:" in msg and expect in msg, msg
    assert "on_error='skip'" in msg


def test_with_on_error_skip_malformed_records_are_skipped_and_counted(tmp_path, sp_model):
    path = tmp_path / "chat.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for k in range(40):
        reply = {"role": "assistant", "content": f"Reply {k}."}
        if k % 8 == 3:
            reply = {"role": "assistant"}  # no content and no tool calls: would train an empty reply
        rows.append({"messages": [{"role": "user", "content": f"Question {k}?"}, reply]})
    pq.write_table(pa.Table.from_pylist(rows), path)  # Parquet: every message has both keys, None where absent
    assert pq.read_table(path).to_pylist()[3]["messages"][1] == {"role": "assistant", "content": None}
    tok = z.tokenizer(str(sp_model))

    def pipe(on_error: str) -> z.Pipeline:
        return (z.Pipeline(seed=1, lanes=2)
                .source("chat", z.read.parquet(str(path), columns=["messages"], chunk_rows=8), passes=1)
                .tokenize_chat(tok, CHATML, on_error=on_error).pack(seq_len=64).batch(rows_per_lane=2))

    with pytest.raises(SourceError, match=r"chat\.parquet, row (\d+): messages\[1\]\.content is missing") as info:
        for _ in pipe("raise").build():
            pass
    assert int(re.search(r"row (\d+)", str(info.value))[1]) % 8 == 3  # one of the bad rows
    loader = pipe("skip").build()
    rows_out = sum(int((b["segment_ids"] > 0).any(dim=1).sum()) for b in loader)
    assert rows_out > 0
    assert loader.metrics()["skipped_by_reason"][SKIP_REASON] == 5


@pytest.mark.parametrize("template", [
    # Qwen 3 style: the reasoning before </think> is cut out of an assistant's content
    "{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'].split('</think>')[-1] | trim }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
    "{{ '\\n' }}{% endfor %}",
    # contents escaped as JSON strings (non-ASCII as \\u escapes)
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] | tojson(ensure_ascii=True) + '\\n' }}{% endfor %}",
])
def test_a_template_that_transforms_contents_still_renders_them(hf_tokenizer, template):
    """A content that does not appear verbatim is rendered again with a placeholder, which does appear: the
    record is accepted, not taken for a message of a role the template drops."""
    messages = [{"role": "user", "content": "Ünïcode \"quoted\" question"},
                {"role": "assistant", "content": "<think>reasoning</think>\n  The answer.  "}]
    text, _ = TokenizeChat(z.tokenizer(str(hf_tokenizer)), template).spans(messages)
    assert messages[0]["content"] not in text or messages[1]["content"] not in text


def test_null_keys_are_dropped_as_transformers_drops_them(pair):
    """A Parquet source gives every message every key: 'tool_calls' in message must stay False when it is null."""
    messages = [{"role": "user", "content": "Weather?", "tool_calls": None, "reasoning": None},
                {"role": "assistant", "content": "Sunny.", "tool_calls": None, "reasoning": None}]
    chat = TokenizeChat(pair.spec, CHATML)
    text = chat.spans(messages)[0]
    assert "<tool_call>" not in text and "None" not in text
    record = {"messages": messages, "tools": None, "documents": None}
    expect = want(pair, CHATML, record)
    ids, target = chat.targets(messages)
    assert ids.tolist() == list(expect["input_ids"]) and target.tolist() == list(expect["assistant_masks"])


def test_the_new_parameters_round_trip_through_a_recipe(tmp_path, sp_model):
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3, encoding="utf-8")
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [HELLO, {"role": "assistant", "content": "Hi."}]}) + "\n")
    tok = z.tokenizer(str(sp_model))
    pipes = [z.Pipeline(seed=3, lanes=2).source("chat", z.read.jsonl(str(data), columns=["messages"]))
             .tokenize_chat(tok, str(template), **options).pack(seq_len=64).batch()
             for options in ({}, {"date": "2025-03-04", "on_error": "skip", "add_generation_prompt": True})]
    assert pipes[0].fingerprint != pipes[1].fingerprint
    for pipe in pipes:
        recipe = tmp_path / "recipe.toml"
        recipe.write_text(pipe.to_recipe(), encoding="utf-8")
        again = z.load_recipe(str(recipe)).to_pipeline()
        assert again.fingerprint == pipe.fingerprint
        assert again.ops[0].describe() == pipe.ops[0].describe()
    toml = pipes[1].to_recipe()
    assert 'date = "2025-03-04"' in toml and 'on_error = "skip"' in toml and "add_generation_prompt = true" in toml


# -- in a pipeline ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, corpus_texts):
    """JSON Lines of conversations made from the corpus: a user asks about a text, the assistant quotes it."""
    root = tmp_path_factory.mktemp("chat")
    texts = [t for t in corpus_texts if t and 40 < len(t) < 400][:240]
    for f in range(3):
        with open(root / f"chat-{f}.jsonl", "w", encoding="utf-8") as out:
            for k, text in enumerate(texts[f::3]):
                messages = [{"role": "user", "content": f"Quote document {k}."},
                            {"role": "assistant", "content": text[: len(text) // 2]}]
                if k % 3 == 0:
                    messages += [{"role": "user", "content": "More."},
                                 {"role": "assistant", "content": text[len(text) // 2:]}]
                out.write(json.dumps({"id": k, "messages": messages}) + "\n")
    return root


def chat_pipeline(chat_data: Path, corpus: Path, spec, template_path: Path, lanes: int = 8) -> z.Pipeline:
    return (z.Pipeline(seed=11, lanes=lanes, flush_every=1)
            .source("chat", z.read.jsonl(str(chat_data / "*.jsonl"), columns=["messages"], chunk_bytes=2048),
                    weight=0.5)
            .source("web", z.read.parquet(str(corpus / "web"), chunk_rows=4), weight=0.5)
            .tokenize_chat(spec, str(template_path), sources=["chat"])
            .tokenize(spec, sources=["web"])
            .split(max_tokens=256)
            .mix(by="tokens")
            .pack(seq_len=256, algorithm="best_fit", max_open_bins=4)
            .batch(rows_per_lane=2))


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chatml.jinja"
    path.write_text(TAGGED, encoding="utf-8")
    return path


def test_labels_are_ignored_wherever_no_assistant_token_is_predicted(chat_data, corpus, spec, template_file):
    pipe = chat_pipeline(chat_data, corpus, spec, template_file, lanes=1)
    chat = TokenizeChat(spec, str(template_file))
    reference = {}
    for f in sorted(chat_data.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            ids, mask = chat.encode(json.loads(line)["messages"])
            reference[tuple(ids.tolist())] = mask
    loader = pipe.build()
    checked = 0
    for _ in range(12):
        batch = next(loader)
        ids, labels, segs = (batch[k].numpy() for k in ("input_ids", "labels", "segment_ids"))
        for r in range(ids.shape[0]):
            for s in set(segs[r].tolist()) - {0}:
                at = np.flatnonzero(segs[r] == s)
                doc = tuple(ids[r, at].tolist())
                if doc in reference:  # a whole conversation (a chat document, not split)
                    mask = reference[doc]
                    want = np.where(mask[:-1] == 1, ids[r, at[1:]], -100).tolist() + [-100]
                    assert labels[r, at].tolist() == want
                    checked += 1
    assert checked >= 10
    assert loader.metrics()["source_token_share"]["chat"] > 0.2


def test_a_chat_pipeline_is_elastic(chat_data, corpus, spec, template_file):
    pipe = chat_pipeline(chat_data, corpus, spec, template_file)
    reference = global_hashes(pipe, 1, 6)
    assert len(set(reference)) == 6
    assert global_hashes(pipe, 4, 6) == reference
    assert global_hashes(pipe, 8, 6, resume_at=3, resume_world_size=2) == reference
    assert global_hashes(pipe, 2, 6, num_workers=2) == reference
