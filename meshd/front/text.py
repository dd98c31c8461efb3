"""The answer's text as a client may see it, piece by piece: whole UTF-8 characters, cut at the first stop string.

The tail stops a session once a stop string is complete, but the piece that completes it
may carry it and more, and an earlier piece may end with its start; so text that could be
the start of a stop string is held back until the next piece says whether it is.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class AnswerText:
    def __init__(self, stops: Sequence[str] = ()) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.stopped_by: str | None = None
        self.text = ""

    def feed(self, piece: bytes) -> str:
        """The text that may be shown now ("" once a stop string was met)."""
        if self.stopped_by is not None:
            return ""
        return self._emit(self._pending + self._decoder.decode(piece), final=False)

    def finish(self) -> str:
        """The rest, once the answer ended."""
        if self.stopped_by is not None:
            return ""
        return self._emit(self._pending + self._decoder.decode(b"", final=True), final=True)

    def _emit(self, text: str, final: bool) -> str:
        cuts = [(text.find(s), s) for s in self._stops if s in text]
        if cuts:
            cut, stop = min(cuts)
            self.stopped_by = stop
            out, self._pending = text[:cut], ""
        elif final or not self._hold:
            out, self._pending = text, ""
        else:
            keep = self._held(text)
            out, self._pending = text[:len(text) - keep], text[len(text) - keep:]
        self.text += out
        return out

    def _held(self, text: str) -> int:
        """How many trailing characters could begin a stop string."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
