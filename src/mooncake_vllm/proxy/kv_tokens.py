"""Reuse of recent prompts' encodings (``kv_aware``'s own tokenizer, :mod:`.kv_prompt`).

A conversation's next turn is the turn before, its answer and a new question: the proxy
encoded all but the tail already. :class:`PrefixEncodings` keeps recent prompts' tokens and
character offsets; a prompt that extends one of them keeps its tokens up to a word boundary
near the end of the earlier prompt and encodes only the rest. Why: the proxy's CPU is what
every request waits for on a loaded host; on issue 29's 2-core bench a ~1.4 ms encode of a
2k-token prompt took 15-33 ms of wall time (``tokenize_local_microseconds``), added to every
request's time to first token, where prefix routing spends microseconds.

Tokenizers need not split alike at every boundary (special tokens a post-processor adds at
the end, pre-tokenizers that read across a space): the first ``verify`` reuses are checked
against a whole encode, and one mismatch turns reuse off for good (counted in ``mismatches``,
logged once). A wrong token would only cost a worse route, never wrong KV.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

__all__ = ["Encoding", "PrefixEncodings"]

log = logging.getLogger(__name__)

#: a prompt's tokens and each token's (start, end) characters
Encoding = tuple[list[int], Sequence[tuple[int, int]]]


class PrefixEncodings:
    """``encode(prompt, add_special_tokens)`` with recent prompts' encodings reused for the prompts
    that extend them. ``whole(text, add_special_tokens)`` is the tokenizer's own encode."""

    def __init__(self, whole: Callable[[str, bool], Encoding], heads: int = 128, per_head: int = 8,
                 head_chars: int = 64, back: int = 8, keep: int = 64, verify: int = 16) -> None:
        self.whole = whole
        self.heads, self.per_head, self.head_chars = heads, per_head, head_chars  # bounded: ~25 KB a prompt
        self.back = back  # re-encode at least this many of the earlier prompt's last tokens
        self.keep = keep  # offsets kept of each prompt's last tokens, where the cut is looked for
        self.verify = verify  # reuses checked against a whole encode before reuse is trusted
        #: (first characters, special tokens) -> [(prompt, its ids, its last ``keep`` tokens' offsets)]
        self._recent: OrderedDict[tuple[str, bool], list[tuple[str, array[int], list[tuple[int, int]]]]] = \
            OrderedDict()
        self.reused = 0
        self.mismatches = 0

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """The prompt's tokens, as ``whole`` makes them."""
        got = self._extend(prompt, add_special_tokens) if not self.mismatches else None
        if got is not None:
            self.reused += 1
            if self.reused <= self.verify:
                whole = self.whole(prompt, add_special_tokens)
                if list(whole[0]) != got[0]:
                    self.mismatches += 1
                    log.warning("kv_aware: a prompt encoded from an earlier one's tokens differs from its "
                                "whole encode; every prompt is encoded whole from now on")
                got = whole
        if got is None:
            got = self.whole(prompt, add_special_tokens)
        self._remember(prompt, add_special_tokens, got)
        return list(got[0])

    def _extend(self, prompt: str, special: bool) -> Encoding | None:
        entries = self._recent.get((prompt[: self.head_chars], special))
        if not entries:
            return None
        best = max((e for e in entries if prompt.startswith(e[0])), key=lambda e: len(e[0]), default=None)
        if best is None:
            return None
        text, ids, last = best
        cut = self._cut(text, len(ids), last)
        if cut is None:
            return None
        j, c = cut
        tail_ids, tail_offsets = self.whole(prompt[c:], False)
        return [*ids[:j], *tail_ids], [(a + c, b + c) for a, b in tail_offsets]

    def _cut(self, text: str, n: int, last: list[tuple[int, int]]) -> tuple[int, int] | None:
        """(tokens kept, character to encode from): the start of a run of whitespace in ``text`` at or
        before its ``back``-th last token (of ``n``; ``last``: the last tokens' offsets), no token across it."""
        base = n - len(last)
        for j in range(n - self.back, max(base, 0), -1):
            c = last[j - base][0]
            while c > 0 and text[c - 1].isspace():
                c -= 1
            # tokens before j end by c, token j starts at or after it, and c starts a whitespace run
            if 0 < c < len(text) and text[c].isspace() and (j - 1 < base or last[j - 1 - base][1] <= c):
                return j, c
        return None

    def _remember(self, prompt: str, special: bool, enc: Encoding) -> None:
        key = (prompt[: self.head_chars], special)
        entries = self._recent.setdefault(key, [])
        self._recent.move_to_end(key)
        entries.append((prompt, array("q", enc[0]), list(enc[1][-self.keep:])))
        del entries[: -self.per_head]
        while len(self._recent) > self.heads:
            self._recent.popitem(last=False)
