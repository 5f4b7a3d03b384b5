"""How a signed prompt's text becomes the token ids its answer is computed from, shared by the model
node, which computes the answer, and the verifier, which scores it: a text that already begins with the
BOS token (a rendered chat template, or a completion written so) is tokenised as it is, any other with
the tokenizer's special tokens, so that BOS is neither missing nor doubled. A node that gave every
completion its special tokens read one beginning with BOS with two where verifiers read one: a member
could ask honest nodes prompts whose honest answers deviated."""

from __future__ import annotations

from typing import Any


def adds_special_tokens(text: str, tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and text.startswith(bos))
