"""Serving: a request's text as its tokens arrive, and ``stop`` strings found across token boundaries.

The output is decoded whole after each token (a byte-level token may end inside a UTF-8 character, so only the
decoded text is reliable, not per-token pieces). Text is handed out once it cannot change: a trailing replacement
character (an unfinished UTF-8 sequence) and the last ``len(longest stop) - 1`` characters (which could begin a stop
string) are held back until more tokens come or the request ends. The generation stops at the token whose text
completes a stop string, as Hugging Face's ``stop_strings`` does; the returned text ends before the stop string
(the OpenAI API's rule).
"""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the decoded output so far (cut at a stop string once one is found)
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False  # a stop string was found

    def feed(self, token_ids) -> str:
        """Take new tokens (after a stop string: none); returns the text that became final."""
        for token in token_ids:
            if self.stopped:
                break
            self.ids.append(token)
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self._find_stop()
        if self.stopped:
            return self._take(len(self.text))
        end = len(self.text) - self.hold
        while end > self.sent and self.text[end - 1] == "\ufffd":
            end -= 1
        return self._take(end)

    def flush(self) -> str:
        """The rest of the text, when the request has ended."""
        return self._take(len(self.text))

    def _find_stop(self) -> None:
        # Only a stop string that ends in the newest token's text can be new; search from where it could start.
        start = max(0, self.sent - self.hold)
        cuts = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped = self.text[:min(cuts)], True

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.text[self.sent:end], end
        return piece

    @property
    def num_tokens(self) -> int:
        return len(self.ids)
