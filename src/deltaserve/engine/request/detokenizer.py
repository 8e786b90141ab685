"""Incremental detokenization with stop strings, working on bytes.

Invariants (ids = the tokens appended so far, L = the longest stop string):
- Before a stop, `text + <decoder's held-back bytes decoded>` == `tokenizer.decode(shown)`,
  `shown` = ids less the special ones if `skip_special_tokens`, but for those in
  `keep_special_token_ids` (a chat parser's control markers): `text` holds complete UTF-8 only;
  a trailing incomplete multi-byte sequence is held (an incremental UTF-8 decoder,
  errors="replace") until completed, replaced by U+FFFD once it cannot be, and flushed by
  `delta(final=True)`.
- Stop strings are searched only in the window `last L-1 chars + new text`, from the append at
  which `min_tokens` tokens exist (vLLM's StopChecker order); the match that ends first (then
  starts first) wins. `text` is then cut before it, or after it with
  `include_stop_str_in_output`, and later appends are ignored.
- `delta()` returns text no later event can change: without `include_stop_str_in_output` it
  holds back the longest suffix that is a proper prefix of a stop string. The concatenation of
  all `delta()` results equals the final `text`.
- Cost per append: O(new bytes + L) (plus the stop search over that window); `delta()` is
  O(returned text + L^2); `text` joins its pieces lazily.
"""

from __future__ import annotations

import codecs

from deltaserve.engine.request.sampling_params import SamplingParams
from deltaserve.model.tokenizer import Tokenizer


def _drop_tail(pieces: list[str], n: int) -> None:
    """Remove the last `n` characters from a list of string pieces."""
    while n > 0:
        last = pieces.pop()
        if len(last) > n:
            pieces.append(last[:-n])
        n -= min(n, len(last))


class IncrementalDetokenizer:
    """Output text of one sequence, token by token; see the module docstring."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.stop_reason: str | None = None
        self.num_tokens = 0
        self._stops = list(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []  # all of `text`
        self._unsent: list[str] = []  # the suffix of `text` not yet returned by delta()
        self._unsent_len = 0
        self._tail = ""  # the last L-1 characters of `text`
        self._finished = False

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def append(self, token_id: int) -> bool:
        """Add one generated token; True when a stop string has matched (now or before)."""
        if self._finished or self.stopped:
            return self.stopped
        self.num_tokens += 1
        tok = self.tokenizer
        if (
            self.params.skip_special_tokens
            and tok.is_special(token_id)
            and token_id not in self.params.keep_special_token_ids
        ):
            return False
        self._add(self._decoder.decode(tok.token_bytes(token_id)))
        return self.stopped

    def _add(self, new: str) -> None:
        if not new:
            return
        if self._stops and self.num_tokens >= self.params.min_tokens:
            window = self._tail + new
            match = self._find_stop(window, len(self._tail))
            if match is not None:
                start, stop = match
                end = start + len(stop) if self.params.include_stop_str_in_output else start
                self.stop_reason = stop
                if end < len(self._tail):
                    self._drop(len(self._tail) - end)
                else:
                    self._push(new[: end - len(self._tail)])
                return
        self._push(new)
        if self._max_stop > 1:
            self._tail = (self._tail + new)[-(self._max_stop - 1) :]

    def _find_stop(self, window: str, old: int) -> tuple[int, str] | None:
        """(start in window, stop string) of the match ending first; every match must end
        in the new part `window[old:]`, since earlier text was already searched."""
        best = None
        for s in self._stops:
            i = window.find(s, max(0, old - len(s) + 1))
            if i >= 0:
                key = (i + len(s), i)
                if best is None or key < best[0]:
                    best = (key, i, s)
        return None if best is None else (best[1], best[2])

    def _push(self, s: str) -> None:
        if s:
            self._pieces.append(s)
            self._unsent.append(s)
            self._unsent_len += len(s)

    def _drop(self, n: int) -> None:
        if n > self._unsent_len:
            raise AssertionError("a stop string reached into text already returned by delta()")
        _drop_tail(self._pieces, n)
        _drop_tail(self._unsent, n)
        self._unsent_len -= n

    def _holdback(self, s: str) -> int:
        """Length of the longest suffix of `s` that is a proper prefix of a stop string."""
        if self.params.include_stop_str_in_output or self._max_stop <= 1:
            return 0
        for n in range(min(len(s), self._max_stop - 1), 0, -1):
            suffix = s[-n:]
            if any(len(stop) > n and stop.startswith(suffix) for stop in self._stops):
                return n
        return 0

    def delta(self, final: bool = False) -> str:
        """Text that became final since the previous call; with `final=True` (the sequence
        ended) or after a stop, everything that is left, incomplete UTF-8 flushed as U+FFFD."""
        if final and not self._finished and not self.stopped:
            self._add(self._decoder.decode(b"", final=True))
        if final:
            self._finished = True
        s = "".join(self._unsent)
        keep = 0 if (self.stopped or self._finished) else self._holdback(s)
        out, rest = s[: len(s) - keep], s[len(s) - keep :]
        self._unsent = [rest] if rest else []
        self._unsent_len = len(rest)
        return out
