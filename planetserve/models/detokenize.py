"""Turning generated token ids into text as a model node streams it, cut at stop strings: shared by the
node, which serves the text, and the verifier, which checks that a challenge's answer ended where its
stop strings say."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Decoder(Protocol):
    """The part of a tokenizer detokenisation needs."""

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class TextAssembler:
    """Turns generated token ids into text deltas, one token at a time, the way vLLM does: a token's
    text is released once it is stable (not a partial UTF-8 sequence), and text that could still
    become a stop string is held back. On a stop string the text ends before it and `stopped` is set;
    `consumed` then says how many of the pushed tokens were needed to reach it."""

    def __init__(
        self, tokenizer: Decoder, stop: Sequence[str] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._released = 0
        self.stopped = False
        self.consumed = 0

    def push(self, token_ids: Sequence[int]) -> str:
        for token in token_ids:
            if self.stopped:
                break
            self.consumed += 1
            self._ids.append(token)
            self._append(self._decode_step(final=False))
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back, once generation has ended."""
        if not self.stopped:
            self._append(self._decode_step(final=True))
        return self._release(final=True)

    def _decode_step(self, final: bool) -> str:
        prefix = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset],
                                        skip_special_tokens=self._skip)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def _append(self, delta: str) -> None:
        if not delta:
            return
        start = max(0, len(self.text) - self._holdback)
        self.text += delta
        hits = [at for at in (self.text.find(s, start) for s in self._stop) if at >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not (final or self.stopped):
            end = max(self._released, end - self._holdback)
        out = self.text[self._released : end]
        self._released = end
        return out
