"""The family's byte-level BPE tokenizer and the chat format its models are trained on.

Every corpus document is trained as a two-message chat (a question naming what is documented, the
docstring as the answer), so a model node can serve chat completions with the same template that
`tokenizer.apply_chat_template` renders, and the models learn to close an answer with `<|im_end|>`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from planetserve.models.corpus import Document

if TYPE_CHECKING:
    from tokenizers import Tokenizer

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
"""In this order they get ids 0..4 in every vocabulary the family uses."""
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
STOP_IDS = (EOS_ID, IM_END_ID)
"""Generation ends at the end of a document or of a chat message."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_QUESTIONS = {
    "module": "What is the {} module for?",
    "class": "What is {}?",
    "function": "What does {}() do?",
    "topic": "Explain {} in Python.",
}


def render_chat(messages: Iterable[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """CHAT_TEMPLATE in Python, for rendering the corpus without a tokenizer (tests keep them equal)."""
    text = BOS + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def document_messages(doc: Document) -> list[dict[str, str]]:
    subject = doc.title.removeprefix("topic:")
    return [
        {"role": "user", "content": _QUESTIONS[doc.kind].format(subject)},
        {"role": "assistant", "content": doc.text},
    ]


def render_document(doc: Document) -> str:
    """A training sequence: the chat, then EOS so documents packed back to back stay apart."""
    return render_chat(document_messages(doc)) + EOS


def train_tokenizer(documents: Iterable[Document], vocab_size: int) -> Tokenizer:
    """Train on the documents' plain text (special tokens are added, not learned)."""
    # Rayon reads this once per process; keep the trainer from taking every core of a shared machine.
    os.environ.setdefault("RAYON_NUM_THREADS", "2")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [part for doc in documents for part in (document_messages(doc)[0]["content"], doc.text)]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    return tok


def save_tokenizer(tok: Tokenizer, directory: Path, model_max_length: int) -> None:
    """tokenizer.json plus a tokenizer_config.json in the keys that transformers 4.x and 5.x both read,
    so other serving stacks (vLLM) load the same tokenizer and chat template."""
    tok.save(str(directory / "tokenizer.json"))
    special = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (directory / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")

