"""Shared test configuration.

Real-model tests (marked `real_model`) use the embedded default model and run
by default (CI included); `-m "not real_model"` skips them for a quick loop.
Tests marked `slow` run only with `--run-slow`.

Every test and every subprocess it starts uses a cache of this test run
(`STAGEDSPEC_CACHE` under pytest's temporary folder), never the user's: what
tests need (the converted default model, the native kernels, n-grams, cost
profiles, the joined Qwen GGUFs) is built there once per run, on first use.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch

from _native import ISA_PARAMS

CACHE_ENV = "STAGEDSPEC_CACHE"
_TEST_CACHE: dict[str, Path] = {}  # "root": this run's cache folder, from `pytest_configure` to `pytest_unconfigure`
_CACHE_ENV_BEFORE: dict[str, str | None] = {}  # "value": STAGEDSPEC_CACHE as the run found it, given back at the end

# oneDNN fixes its ISA at its first primitive, from the environment the process started with; tests that
# run the CLI in-process may change the variable later (`--bit-exact` caps AMX), so keep the original.
ONEDNN_ISA_AT_START = os.environ.get("ONEDNN_MAX_CPU_ISA", "")

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.hookimpl(trylast=True)  # after pytest's tmpdir plugin has made its factory
def pytest_configure(config: pytest.Config) -> None:
    """Point `STAGEDSPEC_CACHE` at a folder of this test run before any test module is imported.

    Why here and not in a fixture: test modules and their imports may read the cache root while they are
    collected, before any fixture runs.  `cache_root()` reads the variable at every call, so nothing keeps the
    user's path."""
    root = config._tmp_path_factory.mktemp("stagedspec-cache", numbered=False)  # the run's basetemp/...
    _TEST_CACHE["root"] = root
    _CACHE_ENV_BEFORE["value"] = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(root)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Give the environment back, and delete the run's cache: it holds gigabytes (converted models, joined GGUFs)
    that no later run reads, and pytest keeps its last three temporary folders."""
    root = _TEST_CACHE.pop("root", None)
    if "value" in _CACHE_ENV_BEFORE:
        before = _CACHE_ENV_BEFORE.pop("value")
        if before is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = before
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny-tensor tests.

    Their cost is thread wake-ups and barriers, not arithmetic; on a busy
    machine two threads make them 10-20x slower.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def private_cost_cache(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """`auto`'s cost profiles and learned state go to the test's own folder: nothing measured or learned earlier
    in the run is read, and nothing this test learns is left for later tests."""
    monkeypatch.setattr("stagedspec.costs.profile_path", lambda key: tmp_path / "costs" / f"{key}.json")


@pytest.fixture(scope="session")
def test_cache() -> Path:
    """This test run's `STAGEDSPEC_CACHE` (set by `pytest_configure`, before any test module is imported)."""
    return _TEST_CACHE["root"]


@pytest.fixture(autouse=True)
def _cache_is_the_test_runs():  # noqa: ANN202
    """Fail the test that leaves the cache root anywhere but this run's folder: whatever later tests read or wrote
    would be the user's (or another run's), and their results would depend on its history.  The root is put back,
    so only the test at fault fails."""
    from stagedspec.paths import cache_root

    root = _TEST_CACHE["root"]
    assert cache_root() == root, f"the stagedspec cache is {cache_root()}, not this test run's {root}"
    yield
    if cache_root() != root:
        leaked = cache_root()
        os.environ[CACHE_ENV] = str(root)
        pytest.fail(f"this test left STAGEDSPEC_CACHE at {leaked}, not this test run's {root} "
                    "(change it with monkeypatch.setenv, which is undone)", pytrace=False)


@pytest.fixture(scope="session")
def session_cost_folder(test_cache: Path) -> Path:
    """`auto`'s cost profiles and learned state for the whole run: the test cache's `costs/`.

    Why one folder per run: measuring the default pair's profile takes ~40 s on two busy cores, so each is
    measured at most once per run; and nothing is copied in from the user's cache, so a test never depends on
    what an earlier process measured or learned, nor leaves its measurements (taken under a test run's load)
    to decide a user's later runs."""
    folder = test_cache / "costs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def shared_cost_cache(session_cost_folder: Path) -> Path:
    """A module whose in-process `auto` may read profiles measured earlier in the run (the default location,
    under the test cache, already is the run's folder; the name says what the module relies on)."""
    return session_cost_folder


@pytest.fixture(scope="session")
def kernels():  # noqa: ANN201 - a NativeKernels
    """The native kernels on the path this CPU would use.  A failed build fails every test that needs them, with
    the compiler's first error; they are skipped only where no C++ compiler exists (`_native`)."""
    from _native import native_kernels_or_fail

    return native_kernels_or_fail()


@pytest.fixture(params=ISA_PARAMS)
def isa_kernels(request: pytest.FixtureRequest):  # noqa: ANN201 - a NativeKernels
    """The native kernels forced onto each instruction-set path in turn; a path this CPU lacks is skipped, saying so."""
    from _native import kernels_on

    return kernels_on(request.param)


@pytest.fixture(scope="session")
def isolated_cache_env(session_cost_folder: Path) -> dict[str, str]:
    """Environment for a `stagedspec` subprocess: this process's, whose `STAGEDSPEC_CACHE` is the test cache.

    The default model, its default n-gram (the stdlib tokenised: minutes on two busy cores) and the native
    kernels are built into it first (where they can be), so that a subprocess reuses them instead of spending
    its time limit on them, and in-process tests share the same ones."""
    import importlib.util

    from _native import native_kernels_unless_no_compiler
    from stagedspec.drafters.ngram_files import load_ngram
    from stagedspec.models.default import PACKAGE, default_model_dir
    from stagedspec.tokenizer import Tokenizer

    if importlib.util.find_spec(PACKAGE) is not None:
        load_ngram("default", Tokenizer.from_folder(default_model_dir()))
    native_kernels_unless_no_compiler()
    return dict(os.environ)


@pytest.fixture(autouse=True)
def _keep_onednn_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    """Undo a cap an in-process `--bit-exact` run sets, so it does not leak into later tests' subprocesses."""
    name = "ONEDNN_MAX_CPU_ISA"
    value = os.environ.get(name)
    monkeypatch.setenv(name, value if value is not None else "")
    if value is None:
        monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _unfreeze_the_heap():  # noqa: ANN202
    """A bench run in a test freezes the objects alive then (`stagedspec.heap.freeze_loaded`): hand them back to
    the collector afterwards, so later tests' dropped models are freed."""
    yield
    import gc

    gc.unfreeze()
