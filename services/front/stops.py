"""Stop strings over a stream of text pieces: emit text as soon as it can no longer be the start
of a stop string, end at the first match (the stop string itself is not emitted, as in OpenAI's
API). `stop_reference` is the plain answer the streaming matcher is tested against."""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""        # text not emitted yet: it may still begin a stop string
        self.matched = False

    def push(self, piece: str) -> str:
        """The text that is safe to emit after `piece`; sets `matched` at a stop string."""
        if self.matched:
            return ""
        text = self.held + piece
        if not self.stops:
            self.held = ""
            return text
        cut = self._first_stop(text)
        keep = self._partial_suffix(text)
        start = len(text) - keep
        # A stop found at `cut` only ends the stream once no longer stop string could still
        # begin before it: "a a" may yet complete at 0 while " " already matched at 1.
        if 0 <= cut <= start:
            self.matched = True
            self.held = ""
            return text[:cut]
        self.held = text[start:]
        return text[:start]

    def _first_stop(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """What is still held back once the stream ended without a match."""
        held, self.held = self.held, ""
        if self.matched:
            return ""
        cut = self._first_stop(held) if self.stops else -1
        if cut >= 0:
            self.matched = True
            return held[:cut]
        return held


def stop_reference(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(text up to the earliest stop string, whether one occurred): the non-streaming answer."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[:min(hits)], True) if hits else (text, False)
