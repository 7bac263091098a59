"""SessionTails: which prompts continue one routed to the same instance before."""

from __future__ import annotations

from mooncake_vllm.proxy.kv_hashes import PromptHasher
from mooncake_vllm.proxy.kv_sessions import SessionTails

BS = 4
HASHER = PromptHasher("sha256", "vllm-none-hash")


def _hashes(tokens: list[int]) -> list[int]:
    return HASHER.block_hashes(tokens, BS)


DOC = list(range(100, 140))
TURN1 = DOC + [1, 2, 3, 4, 5, 6]  # 11 full blocks and 2 tokens
TURN2 = TURN1 + [7, 8, 9, 10, 11]


def test_a_next_turn_continues_its_session_where_it_was_routed_and_only_there() -> None:
    tails = SessionTails()
    tails.record("a", _hashes(TURN1))
    assert tails.continues("a", _hashes(TURN2), len(TURN1) // BS)
    assert not tails.continues("b", _hashes(TURN2), len(TURN1) // BS)
    # the turn's own hit must reach the earlier prompt's last full block
    assert not tails.continues("a", _hashes(TURN2), len(DOC) // BS)


def test_a_new_prompt_on_the_same_document_continues_nothing() -> None:
    tails = SessionTails()
    tails.record("a", _hashes(TURN1))
    other = DOC + [50, 51, 52, 53, 54, 55, 56]
    assert not tails.continues("a", _hashes(other), len(DOC) // BS)
    tails.record("a", _hashes(DOC))  # a prompt that was the document alone: every prompt on it continues it
    assert tails.continues("a", _hashes(other), len(DOC) // BS)


def test_sessions_are_bounded_oldest_first_and_forgotten_with_their_instance() -> None:
    tails = SessionTails(per_instance=2)
    prompts = [DOC + [k] * 4 for k in range(3)]
    for p in prompts:
        tails.record("a", _hashes(p))
    tails.record("a", _hashes(prompts[1]))  # used again: the newest
    assert not tails.continues("a", _hashes(prompts[0] + [9] * 4), 11)
    assert tails.continues("a", _hashes(prompts[1] + [9] * 4), 11)
    assert tails.continues("a", _hashes(prompts[2] + [9] * 4), 11)
    tails.record("a", [])  # a prompt without a full block: nothing to remember
    tails.forget("a")
    assert not tails.continues("a", _hashes(prompts[2] + [9] * 4), 11)
