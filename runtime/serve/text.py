"""Token ids to the text a client sees, one token at a time, with stop strings.

Text is sent only once it is final: a partly decoded character (a trailing U+FFFD) and
a tail that may still become a stop string are held back until the next token decides.
Each token decodes a window of the last few ids, not the whole output (decoding it all
per token is quadratic in the output length, on the server's event loop): the text of
``ids[prefix:]`` minus that of ``ids[prefix:read]`` is what the new ids add, with the
previous ids as context so that tokenizers which drop a leading space at the start of a
decode still spell it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TextStream:
    tokenizer: Any  # a transformers tokenizer, or None: token ids only, empty text
    stop: tuple[str, ...] = ()
    hidden_ids: frozenset[int] = frozenset()  # stop token ids: ended on, never shown
    ids: list[int] = field(default_factory=list)
    text: str = ""  # the decoded output so far (a trailing partial character excluded)
    sent: str = ""
    stopped: bool = False  # a stop string was seen: the request is over
    _prefix: int = 0  # ids[_prefix:_read] are the context the next decode starts from
    _read: int = 0

    def add(self, token_id: int) -> str:
        """The new text that is now final (may be empty)."""
        if token_id not in self.hidden_ids:
            self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        self._decode_new(final=False)
        cut = self._stop_at(self.text)
        if cut is not None:
            self.stopped = True
            return self._advance(self.text[:cut])
        return self._advance(self.text[: len(self.text) - self._held_back(self.text)])

    def flush(self) -> str:
        """At the end: whatever was held back (the request ended without a stop string)."""
        if self.tokenizer is None or self.stopped:
            return ""
        self._decode_new(final=True)
        return self._advance(self.text)

    def _decode_new(self, final: bool) -> None:
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        context = decode(self.ids[self._prefix : self._read])
        window = decode(self.ids[self._prefix :])
        if len(window) > len(context) and (final or not window.endswith("\ufffd")):
            self.text += window[len(context) :]
            self._prefix, self._read = self._read, len(self.ids)

    def _stop_at(self, text: str) -> int | None:
        # A stop string can only end in the part not yet sent.
        hits = [
            i for s in self.stop if (i := text.find(s, max(0, len(self.sent) - len(s) + 1))) >= 0
        ]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Characters at the end that may still change: a stop string's beginning."""
        for n in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0

    def _advance(self, final: str) -> str:
        delta, self.sent = final[len(self.sent) :], final
        return delta
