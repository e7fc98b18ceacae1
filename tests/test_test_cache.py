"""Tests never touch the user's cache: the cache root, in process and in subprocesses, is this test run's folder.

Why it matters: a test that read the user's cache would pass or fail by what an
earlier process built, measured or learned there (cost profiles decide which
arms `auto` runs), and one that wrote there would leave measurements taken under
a test run's load to decide the user's later runs.  `conftest.py` points
`STAGEDSPEC_CACHE` at a folder under pytest's temporary folder before any test
module is imported, and checks before every test that it still does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stagedspec.paths import cache_root


def _users_cache() -> Path:
    return Path.home() / ".cache" / "stagedspec"


def test_the_cache_root_is_this_runs_folder_not_the_users(test_cache: Path,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    assert cache_root() == test_cache
    assert test_cache.is_relative_to(tmp_path_factory.getbasetemp())
    assert not test_cache.resolve().is_relative_to(_users_cache().resolve())


def test_everything_the_library_caches_goes_under_the_test_cache(test_cache: Path) -> None:
    """The cache files of every module that keeps one: kernels, cost profiles, timed choices, n-grams, models."""
    import stagedspec.draft_weights as draft_weights
    import stagedspec.models.matmul_plan as matmul_plan
    from stagedspec.costs import profile_path
    from stagedspec.drafters.ngram_files import default_ngram_path
    from stagedspec.kernels.native import build_dir
    from stagedspec.models import default, named

    class Vocab:  # what `default_ngram_path` reads of a tokenizer
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    paths = [build_dir(), profile_path("key"), matmul_plan._cache_file(), draft_weights._cache_file(),
             default_ngram_path(Vocab()), default.gguf_cache_dir(Path(__file__)),
             cache_root() / default.FOLDER_NAME, cache_root() / named.NAMED_MODELS["gemma3-270m"].folder]
    outside = [p for p in paths if not p.is_relative_to(test_cache)]
    assert not outside, outside


def test_a_subprocess_gets_the_test_cache(test_cache: Path) -> None:
    """Servers and CLI runs started by tests inherit the environment (`tests/_server.py` adds to it)."""
    out = subprocess.run([sys.executable, "-c", "from stagedspec.paths import cache_root; print(cache_root())"],
                         capture_output=True, text=True, env=dict(os.environ), check=True, timeout=60)
    assert Path(out.stdout.strip()) == test_cache


def test_a_test_may_point_the_cache_elsewhere_for_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`monkeypatch.setenv` is undone after the test; the next test's check (`conftest.py`) would fail otherwise."""
    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    assert cache_root() == tmp_path


def test_tune_reset_forgets_every_learned_file_in_the_one_store(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Cost profiles, learned policies, matmul plans and draft weight formats live in one folder
    (`paths.learned_store`), which `stagedspec tune --reset` empties; built kernels beside it stay."""
    from stagedspec import draft_weights
    from stagedspec.learned_state import auto_state_path, forget_everything
    from stagedspec.models import matmul_plan
    from stagedspec.paths import learned_store

    monkeypatch.setenv("STAGEDSPEC_CACHE", str(tmp_path))
    store = learned_store()
    assert store.parent == tmp_path
    learned = [store / "k.v5.json", auto_state_path("k"), matmul_plan._cache_file(), draft_weights._cache_file()]
    assert all(p.parent == store for p in learned)
    kernel = tmp_path / "kernels" / "k.so"
    for path in [*learned, kernel]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    removed = forget_everything()
    assert not any(p.exists() for p in learned) and kernel.exists()
    assert len(removed) == len(learned)
