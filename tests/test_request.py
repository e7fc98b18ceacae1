"""`start_request` builds a request one way for a solo run and a served one: stepping it by hand gives what
`Pipeline.generate` gives, and the scheduler holds the same `Request`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _exactness import assert_drafts_used
from _tiny_models import save_tiny_hf
from stagedspec.runner import RequestPasses
from stagedspec.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread", "shared_cost_cache")


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("request") / "tiny-llama"
    save_tiny_hf("llama_gqa", folder)
    return folder


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0)], ids=["greedy", "seeded"])
def test_a_request_stepped_by_hand_is_the_pipeline_s_run(tiny_folder: Path, sampling: SamplingParams) -> None:
    from stagedspec.request import context_budget
    from stagedspec.models.draft_formats import truncated_copy
    from stagedspec.models.loading import load_model
    from stagedspec.pipeline import Pipeline, SpeculationConfig
    from stagedspec.request import start_request
    from stagedspec.request_plan import plan_request

    model, tok = load_model(tiny_folder, dtype=torch.float32)
    pipe = Pipeline(model, tok, [truncated_copy(model, 1)], SpeculationConfig(method="tree", tree_budget=4))
    ids = tok.encode("the cat sat on the mat and the cat")
    solo = pipe.generate(ids, max_new_tokens=24, sampling=sampling, seed=7)
    if sampling.greedy:  # a random tiny model's T=1 draws rarely match its draft's: nothing may be accepted
        assert_drafts_used(solo, "tree on a one-layer draft")
    passes = RequestPasses()
    try:
        max_len = context_budget(model, len(ids), 24, pipe.speculation.max_tree_budget)
        plan = plan_request(ids, max_new_tokens=24, context=model.config.max_position, speculation=pipe.speculation,
                            temperature=sampling.temperature, seed=7)
        request = start_request(pipe, plan, max_len, processor=None, passes=passes)
        text = []
        while not request.over and (step := request.step()) is not None:
            text.append(request.text.push(step))
        text.append(request.text.finish())
    finally:
        passes.release()
    assert request.token_ids == solo.token_ids
    assert "".join(text) == solo.text
    stats = request.finish_stats()
    assert stats.new_tokens == len(solo.token_ids) and stats.accepted_lengths == solo.stats.accepted_lengths
    request.close()  # its caches go; what it produced stays
    assert request.token_ids == solo.token_ids and not hasattr(request, "oracle")
