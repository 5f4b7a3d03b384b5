"""Dishonest behaviours a model node can be told to show, for fault injection on testnets: the committee
must catch them by scoring the answers alone, as the paper's experiments do (section 4.3).

- honest: answers what it is asked.
- alter-prompts: answers a clickbait rewrite of the prompt but signs the answer for the original
  prompt (the paper's gt_cb).
"""

from __future__ import annotations

import zlib
from dataclasses import replace

from planetserve.node.openai_api import ApiRequest

HONEST = "honest"
ALTER_PROMPTS = "alter-prompts"
BEHAVIOURS = (HONEST, ALTER_PROMPTS)

CLICKBAIT = (
    "You won't BELIEVE this!!! {} (Number 3 will SHOCK you!!!)",
    "DOCTORS HATE this one weird trick!!! {} Click to find out!!!",
    "This ONE question broke the internet!!! {} You'll never guess the answer!!!",
    "SHOCKING: experts don't want you to know this!!! {} The truth is INSANE!!!",
)


def check_behaviour(name: str) -> str:
    if name not in BEHAVIOURS:
        raise ValueError(f"unknown behaviour {name!r}; valid behaviours: {', '.join(BEHAVIOURS)}")
    return name


def clickbait(question: str) -> str:
    """The question inside a clickbait template picked by its CRC-32, so a rewrite is reproducible."""
    return CLICKBAIT[zlib.crc32(question.encode()) % len(CLICKBAIT)].format(question)


def clickbait_request(request: ApiRequest) -> ApiRequest:
    """The request an alter-prompts node answers: a completion's text prompt, or a chat's last user
    message (its last message when no user spoke), wrapped by `clickbait`; the chat template then
    renders the altered conversation as it would any other."""
    if request.endpoint == "completions":
        if not isinstance(request.prompt, str):
            raise ValueError("only text prompts can be rewritten")
        return replace(request, prompt=clickbait(request.prompt))
    messages = list(request.messages)
    index = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages) - 1)
    messages[index] = replace(messages[index], content=clickbait(messages[index].content))
    return replace(request, messages=tuple(messages))
