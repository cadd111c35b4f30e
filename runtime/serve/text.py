"""Token ids to the text a client sees, one token at a time, with stop strings.

Text is sent only once it is final: a partly decoded character (a trailing U+FFFD) and
a tail that may still become a stop string are held back until the next token decides.
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
    sent: str = ""
    stopped: bool = False  # a stop string was seen: the request is over

    def add(self, token_id: int) -> str:
        """The new text that is now final (may be empty)."""
        if token_id not in self.hidden_ids:
            self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._advance(text[:cut])
        return self._advance(text[: len(text) - self._held_back(text)])

    def flush(self) -> str:
        """At the end: whatever was held back (the request ended without a stop string)."""
        if self.tokenizer is None or self.stopped:
            return ""
        return self._advance(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _stop_at(self, text: str) -> int | None:
        # A stop string can only end in the part not yet sent.
        hits = [
            i for s in self.stop if (i := text.find(s, max(0, len(self.sent) - len(s) + 1))) >= 0
        ]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Characters at the end that may change: a partial character, a stop prefix."""
        if text.endswith("\ufffd"):
            return len(text) - len(text.rstrip("\ufffd"))
        for n in range(min(len(text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0

    def _advance(self, final: str) -> str:
        if not final.startswith(self.sent):  # the tokenizer re-spelled the past: send on
            return ""
        delta, self.sent = final[len(self.sent) :], final
        return delta
