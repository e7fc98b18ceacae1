"""The registry of methods (`stagedspec.methods`) says what each method takes, and every front end asks it."""

from __future__ import annotations

import pytest

from stagedspec.errors import StagedSpecError
from stagedspec.methods import METHOD_NAMES, METHODS, method_named


def test_the_registry_names_every_method_once_with_what_it_takes() -> None:
    assert METHOD_NAMES == ("auto", "ar", "chain", "tree", "lookup", "staged")
    assert [n for n, m in METHODS.items() if not m.speculates] == ["ar"]
    assert [n for n, m in METHODS.items() if m.needs_drafts] == ["chain", "tree", "staged"]
    assert [n for n, m in METHODS.items() if m.sizable and not m.always_measured] == ["tree", "lookup", "staged"]
    assert [n for n, m in METHODS.items() if m.default_ngram] == ["auto", "staged"]
    # `auto` may be switched to any method by a server request: every method's sizes are its own
    assert set(METHODS["auto"].every_size_field) == {f for m in METHODS.values() for f in m.size_fields}


def test_one_error_for_an_unknown_method_and_for_missing_drafts_or_bottom_stage() -> None:
    with pytest.raises(StagedSpecError, match=r"unknown method 'beam': use one of auto, ar, chain"):
        method_named("beam")
    with pytest.raises(StagedSpecError, match="needs exactly one draft"):
        METHODS["tree"].check_drafts([])
    with pytest.raises(StagedSpecError, match="needs at least one draft model stage"):
        METHODS["staged"].check_drafts([])
    METHODS["staged"].check_drafts(["a", "b"])
    with pytest.raises(StagedSpecError, match="needs a bottom stage"):
        METHODS["lookup"].check_bottom(False, False)
    METHODS["auto"].check_bottom(False, False)  # auto runs what exists


def test_no_module_outside_the_registry_compares_a_method_name_with_a_method_s_properties() -> None:
    """Which methods need drafts, read the n-gram or are sized by costs is asked of the registry: the old
    tuples of names (`("chain", "tree", "staged")`, `("ar", "lookup")`, ...) appear nowhere else."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "src" / "stagedspec"
    pattern = re.compile(r"""method\s+(?:not\s+)?in\s+\((?:"(?:auto|ar|chain|tree|lookup|staged)",?\s*)+\)""")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "methods.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found
