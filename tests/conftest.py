"""Shared test configuration.

Real-model tests (marked `real_model`) use the embedded default model and run
by default (CI included); `-m "not real_model"` skips them for a quick loop.
Tests marked `slow` run only with `--run-slow`.
"""

import os

import pytest
import torch

# oneDNN fixes its ISA at its first primitive, from the environment the process started with; tests that
# run the CLI in-process may change the variable later (`--bit-exact` caps AMX), so keep the original.
ONEDNN_ISA_AT_START = os.environ.get("ONEDNN_MAX_CPU_ISA", "")

torch.set_num_threads(min(2, os.cpu_count() or 1))


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
    """`auto`'s cost profiles and learned state go to a temporary folder, not the user's cache."""
    monkeypatch.setattr("stagedspec.costs.profile_path", lambda key: tmp_path / "costs" / f"{key}.json")


@pytest.fixture(scope="session")
def session_cost_folder(tmp_path_factory):  # noqa: ANN001, ANN201
    """One folder per test run for `auto`'s cost profiles and learned state (real-model tests).

    Why: a test must not read what an earlier process learned (its arm choices would depend on history), nor
    leave profiles measured under a test run's load to decide a user's later runs.  Why per session and
    seeded: measuring the default pair's profile takes ~40 s on two busy cores, so each is measured at most
    once per run, and profiles this machine already measured (`<cache>/costs/*.v<version>.json`, the
    machine's pass costs, not learned state) are copied in read-only, as are the fp32 kernel-plan and
    draft-weight timings a subprocess would otherwise re-take.  Nothing is written back.
    """
    import shutil

    from stagedspec.costs import PROFILE_VERSION
    from stagedspec.models.default import cache_root

    folder = tmp_path_factory.mktemp("session-costs")
    user = cache_root() / "costs"
    if user.is_dir():
        # profiles only: learned state (`<key>.<method>.json`) stays behind
        for f in [*user.glob(f"*.v{PROFILE_VERSION}.json"), user / "matmul-plan.json", user / "draft-weights.json"]:
            if f.is_file():
                shutil.copyfile(f, folder / f.name)
    return folder


@pytest.fixture(scope="module")
def shared_cost_cache(session_cost_folder):  # noqa: ANN001, ANN201
    """A module's in-process `auto` reads and writes profiles and learned state in the session's folder."""
    from stagedspec.costs import PROFILE_VERSION

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("stagedspec.costs.profile_path",
                   lambda key: session_cost_folder / f"{key}.v{PROFILE_VERSION}.json")
        yield session_cost_folder


@pytest.fixture(scope="session")
def isolated_cache_env(session_cost_folder, tmp_path_factory):  # noqa: ANN001, ANN201
    """Environment for a `stagedspec` subprocess: `STAGEDSPEC_CACHE` at a session folder whose `costs/` is
    `session_cost_folder` and whose other entries link to the user's cache.

    Why links: the converted default model (a one-time GGUF conversion) and the compiled kernels live there
    too; a subprocess must reuse them, not rebuild them per run.  The default model is converted into the
    user's cache first if it is missing there (any real-model test in the run would do so anyway), so that
    the subprocess and the in-process tests share one conversion.
    """
    import importlib.util

    from stagedspec.models.default import PACKAGE, cache_root, default_model_dir

    real = cache_root()
    if importlib.util.find_spec(PACKAGE) is not None:
        default_model_dir()
    for shared in ("kernels", "ngram", "gguf"):  # folders of keyed entries: written through the link
        (real / shared).mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("cache")
    for entry in real.iterdir():
        if entry.name != "costs" and not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (root / "costs").symlink_to(session_cost_folder, target_is_directory=True)
    return {**os.environ, "STAGEDSPEC_CACHE": str(root)}


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


@pytest.fixture(scope="session", autouse=True)
def _private_draft_weight_choices(tmp_path_factory):  # noqa: ANN001, ANN202
    """`--draft-weights auto`'s timed choices go to a session folder: timings taken under a test run's load
    must not decide a user's later runs (`stagedspec.draft_weights`)."""
    import stagedspec.draft_weights as dw

    path = tmp_path_factory.mktemp("draft-weights") / "draft-weights.json"
    original = dw._cache_file
    dw._cache_file = lambda: path
    yield
    dw._cache_file = original


@pytest.fixture(scope="session", autouse=True)
def _private_matmul_plans(tmp_path_factory):  # noqa: ANN001, ANN202
    """The fp32 kernel timings of a test run go to a session folder too (`stagedspec.models.matmul_plan`)."""
    import stagedspec.models.matmul_plan as mp

    path = tmp_path_factory.mktemp("matmul-plan") / "matmul-plan.json"
    original = mp._cache_file
    mp._cache_file = lambda: path
    yield
    mp._cache_file = original
