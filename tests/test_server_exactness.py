"""What the server says about its exactness under batching: at start, in /v1/models, and that it is right.

A quantised oracle on the native kernels computes each row alone, so batching keeps every output; a dense
one does not, and the server must say so rather than let the README's guarantee mislead.  The native kernels come
from the `kernels` fixture: a failed build fails these tests rather than skipping them."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from _server import local_client, tiny_engine, tiny_model_folder  # noqa: E402
from stagedspec.models.quant import row_exact  # noqa: E402
from stagedspec.pipeline import Pipeline, SpeculationConfig  # noqa: E402
from stagedspec.server.app import create_app  # noqa: E402
from stagedspec.server.exactness import batch_exactness  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_model_folder(tmp_path_factory.mktemp("exactness"))


def loaded(folder, dtype: str, quant: str):  # noqa: ANN001, ANN201
    return Pipeline.load(str(folder), "layers:1", speculation=SpeculationConfig(method="tree"), dtype=dtype,
                         quant=quant)


def test_a_dense_oracle_is_not_exact_under_batched_passes_and_says_what_fixes_it(folder):
    pipe = loaded(folder, "fp32", "none")
    assert not row_exact(pipe.model)
    got = batch_exactness(pipe.model, pipe.draft_models, batch_passes=True, bit_exact=False)
    assert (got.greedy, got.seeded) == (False, False)
    notice = got.notice()
    assert notice is not None and "float32 oracle" in notice and "--quant" in notice and "--no-batch-passes" in notice
    assert "\n" not in notice


def test_interleaved_steps_are_exact_in_any_dtype(folder):
    pipe = loaded(folder, "fp32", "none")
    got = batch_exactness(pipe.model, pipe.draft_models, batch_passes=False, bit_exact=False)
    assert (got.greedy, got.seeded, got.notice()) == (True, True, None)


def test_bit_exact_bf16_is_exact_on_the_cpu(folder):
    pipe = loaded(folder, "bf16", "none")
    assert not batch_exactness(pipe.model, pipe.draft_models, batch_passes=True, bit_exact=False).greedy
    got = batch_exactness(pipe.model, pipe.draft_models, batch_passes=True, bit_exact=True)
    assert (got.greedy, got.seeded) == (True, True)


@pytest.mark.parametrize("quant", ["int4", "int8"])
def test_a_quantised_oracle_on_the_native_kernels_is_exact(folder, quant, kernels):  # noqa: ANN001
    pipe = loaded(folder, "fp32", quant)
    assert row_exact(pipe.model) and all(row_exact(d) for d in pipe.draft_models)
    got = batch_exactness(pipe.model, pipe.draft_models, batch_passes=True, bit_exact=False)
    assert (got.greedy, got.seeded, got.notice()) == (True, True, None)


def test_a_dense_draft_under_a_native_oracle_keeps_greedy_but_not_seeded(folder, kernels):  # noqa: ANN001
    oracle = loaded(folder, "fp32", "int8").model
    dense = loaded(folder, "fp32", "none").model
    got = batch_exactness(oracle, [dense], batch_passes=True, bit_exact=False)
    assert (got.greedy, got.seeded) == (True, False)
    assert "seeded" in got.notice()


def test_models_endpoint_and_start_line_report_it(tmp_path):
    lines: list[str] = []
    engine = tiny_engine(tmp_path)  # fp32, dense
    with local_client(create_app(engine, log=lines.append)) as c:
        card = c.get("/v1/models").json()["data"][0]
        one = c.get("/v1/models/tiny").json()
    assert card["stagedspec"]["exact_under_batching"] == {"greedy": False, "seeded": False}
    assert "not row-exact" in card["stagedspec"]["note"] and one["stagedspec"] == card["stagedspec"]
    assert sum("stagedspec serve: note: batched passes of this float32 oracle" in line for line in lines) == 1
    with local_client(create_app(engine, log=lines.append, batch_passes=False)) as c:
        card = c.get("/v1/models").json()["data"][0]
    assert card["stagedspec"] == {"exact_under_batching": {"greedy": True, "seeded": True}, "note": ""}
