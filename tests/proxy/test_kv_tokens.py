"""proxy/kv_tokens.py: a prompt that extends a recent one is encoded from near the earlier one's end."""

from __future__ import annotations

import re

from mooncake_vllm.proxy.kv_tokens import Encoding, PrefixEncodings

BOS, EOS = 1, 2


class Words:
    """A tokenizer of one token per word (offsets without the spaces), BOS first, EOS last if asked."""

    def __init__(self, eos: bool = False) -> None:
        self.eos = eos
        self.chars = 0  # characters encoded, all calls

    def __call__(self, text: str, special: bool) -> Encoding:
        self.chars += len(text)
        words = [(m.start(), m.end()) for m in re.finditer(r"\S+", text)]
        ids = [10 + sum(map(ord, text[a:b])) % 1000 for a, b in words]
        offsets = list(words)
        if special:
            ids, offsets = [BOS, *ids], [(0, 0), *offsets]
            if self.eos:
                ids, offsets = [*ids, EOS], [*offsets, (0, 0)]
        return ids, offsets


def _turns(n: int) -> list[str]:
    doc = " ".join(f"w{i}" for i in range(300))
    out, history = [], doc
    for t in range(n):
        prompt = f"{history}\nQ: question {t}\nA:"
        out.append(prompt)
        history = prompt + f" answer{t} x y."
    return out


def test_a_prompt_that_extends_a_recent_one_encodes_only_its_tail() -> None:
    tok = Words()
    enc = PrefixEncodings(tok, verify=0)
    turns = _turns(4)
    for prompt in turns:
        before = tok.chars
        assert enc.encode(prompt) == tok(prompt, True)[0]
        tok.chars = before + (tok.chars - before - len(prompt))  # the check's own encode does not count
    assert enc.reused == 3 and enc.mismatches == 0
    # the first prompt whole, then each turn's tail: its new words and the earlier prompt's last few
    assert tok.chars < len(turns[0]) + 3 * 120
    assert enc.encode("another document entirely") == tok("another document entirely", True)[0]
    assert enc.encode(turns[1], False) == tok(turns[1], False)[0]  # without special tokens: its own entries


def test_a_reuse_that_differs_from_the_whole_encode_turns_reuse_off() -> None:
    # EOS last: a prompt's tokens are not a prefix of the next one's, and the checked reuse says so
    tok = Words(eos=True)
    enc = PrefixEncodings(tok, verify=2)
    turns = _turns(3)
    assert [enc.encode(p) for p in turns] == [tok(p, True)[0] for p in turns]
    assert enc.mismatches == 1 and enc.reused == 1
    assert enc.encode(turns[2] + " more") == tok(turns[2] + " more", True)[0]
    assert enc.reused == 1  # off for good


def test_the_first_reuses_are_checked_then_trusted() -> None:
    tok = Words()
    enc = PrefixEncodings(tok, verify=1)
    turns = _turns(3)
    enc.encode(turns[0])
    before = tok.chars
    enc.encode(turns[1])  # reused and checked: its whole encode too
    assert tok.chars - before > len(turns[1])
    before = tok.chars
    assert enc.encode(turns[2]) == tok(turns[2], True)[0]
    assert 0 < tok.chars - before - len(turns[2]) < 120  # trusted: only the tail
