"""Dishonest behaviours a model node can be told to show, for fault injection on testnets: the committee
must catch them by scoring the answers alone, as the paper's experiments do (section 4.3).

- honest: answers what it is asked.
- alter-prompts: answers a clickbait rewrite of the prompt but signs the answer for the original
  prompt (the paper's gt_cb).

Only the names and the text rewrite live here (a node's configuration checks the names); the model
node applies a rewrite to an API request (`model_node.clickbait_request`).
"""

from __future__ import annotations

import zlib

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
