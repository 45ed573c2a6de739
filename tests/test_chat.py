"""Chat / SFT: ``tokenize_chat`` against transformers' ``apply_chat_template``, and chat pipelines.

The tokenizer is the suite's byte-level BPE ``tokenizer.json`` (trained locally), the template a
ChatML-style Jinja template written here; transformers loads both from disk (nothing is downloaded).
``tokenize_chat`` must give the same ``input_ids`` and the same assistant tokens as transformers'
``return_assistant_tokens_mask``; packed into batches, ``labels`` must be -100 exactly where no assistant
token is predicted; and a pipeline mixing chat data with plain text must stay elastic.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import zephon as z
from zephon.ops.chat import TokenizeChat
from zephon.verify import global_hashes

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
def hf(hf_tokenizer):
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
