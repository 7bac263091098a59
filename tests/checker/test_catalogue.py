"""The rule catalogue: stable, complete, and every rule implemented."""

from __future__ import annotations

import re
import string

import pytest

import mooncake_vllm.checker  # noqa: F401 - registers the offline rules
import mooncake_vllm.checker.probe  # noqa: F401 - registers the probes
from mooncake_vllm.checker.catalogue import ERROR, RULES, WARNING, rule
from mooncake_vllm.checker.context import CHECKS


def test_ids_are_stable_and_match_severity() -> None:
    for rule_id, r in RULES.items():
        assert re.fullmatch(r"MCV-[EW]\d{3}", rule_id), rule_id
        assert r.severity == (ERROR if rule_id[4] == "E" else WARNING)
        assert r.probe == (rule_id[5] == "1"), "1xx IDs are exactly the --probe checks"
        assert r.message and r.why and r.fix and r.reference and r.name
    assert len({r.name for r in RULES.values()}) == len(RULES)


def test_every_rule_has_exactly_one_implementation() -> None:
    implemented = [r.id for r, _ in CHECKS]
    assert sorted(implemented) == sorted(RULES)


def test_messages_are_one_line_templates() -> None:
    for r in RULES.values():
        assert "\n" not in r.message
        for text in (r.message, r.fix, r.why):
            list(string.Formatter().parse(text))  # valid str.format templates


def test_lookup() -> None:
    assert rule("MCV-E001").name == "v0-requested-without-v0"
    with pytest.raises(KeyError, match="MCV-E001"):
        rule("MCV-X000")
