"""The thread governor (`stagedspec.threads`): fewer threads while other processes keep CPUs busy, back after.

Timing-free: the machine's busy time, this process's CPU time and the clock are injected.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from stagedspec.cli.args import threads_value
from stagedspec.threads import ThreadGovernor, allowed_cpus, governor_for, read_busy_seconds


class FakeMachine:
    """Two CPUs; `others` CPUs' worth of other processes' work and `ours` of this process's, per second."""

    def __init__(self) -> None:
        self.t, self.busy, self.own, self.others, self.ours = 0.0, 0.0, 0.0, 0.0, 1.9

    def advance(self, seconds: float) -> None:
        self.t += seconds
        self.busy += (self.others + self.ours) * seconds
        self.own += self.ours * seconds


@pytest.fixture()
def machine(monkeypatch: pytest.MonkeyPatch) -> FakeMachine:
    monkeypatch.setattr("stagedspec.threads.allowed_cpus", lambda: [0, 1])
    return FakeMachine()


def test_a_busy_core_takes_a_thread_away_and_an_idle_one_gives_it_back(machine: FakeMachine) -> None:
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(busy=lambda cpus: machine.busy, clock=lambda: machine.t, own_cpu=lambda: machine.own)
        assert gov.threads == 2
        machine.advance(0.1)
        assert gov.tick() == 2  # not a whole interval yet
        machine.advance(0.3)
        assert gov.tick() == 2  # idle machine
        machine.others, machine.ours = 1.0, 1.0  # another process takes a core
        machine.advance(0.3)
        assert gov.tick() == 1 and torch.get_num_threads() == 1
        machine.others = 0.02  # it ended
        machine.advance(0.3)
        assert gov.tick() == 2 and torch.get_num_threads() == 2
        assert gov.changes == 2
    finally:
        torch.set_num_threads(before)


def test_no_load_reading_keeps_the_count(machine: FakeMachine) -> None:
    before = torch.get_num_threads()
    try:
        gov = ThreadGovernor(busy=lambda cpus: None, clock=lambda: machine.t)
        machine.advance(5)
        assert gov.tick() == 2
    finally:
        torch.set_num_threads(before)


def test_proc_stat_is_read_for_the_allowed_cpus_only(tmp_path) -> None:  # noqa: ANN001
    stat = tmp_path / "stat"
    stat.write_text("cpu  999 0 999 999 0 0 0 0 0 0\ncpu0 100 0 50 1000 7 0 0 0 0 0\ncpu1 300 0 0 10 0 0 0 0 0 0\n")
    import os

    tick = os.sysconf("SC_CLK_TCK")
    assert read_busy_seconds([0], str(stat)) == pytest.approx(150 / tick)
    assert read_busy_seconds([0, 1], str(stat)) == pytest.approx(450 / tick)
    assert read_busy_seconds([0], str(tmp_path / "missing")) is None
    assert allowed_cpus()


def test_a_fixed_count_and_unquantised_models_are_not_governed() -> None:
    from stagedspec.models.config import ModelConfig
    from stagedspec.models.transformer import Transformer, init_random

    before = torch.get_num_threads()
    try:
        cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=2,
                          intermediate_size=64, max_position=32, norm_eps=1e-5, rope_theta=1e4, tie_embeddings=True)
        model = init_random(Transformer(cfg), seed=0)
        assert governor_for(model, 1) is None and torch.get_num_threads() == 1
        assert governor_for(model, "auto") is None and torch.get_num_threads() == 1  # left as the caller set it
    finally:
        torch.set_num_threads(before)


def test_threads_flag_values() -> None:
    assert threads_value("auto") == "auto" and threads_value("3") == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            threads_value(bad)


def test_a_cost_profile_measured_beside_a_busy_process_is_not_cached(monkeypatch, tmp_path, capsys) -> None:  # noqa: ANN001
    from stagedspec import costs, profiling

    busy = iter([0.0, 10.0])  # 10 CPU-seconds of others' work over the measurement
    monkeypatch.setattr("stagedspec.threads.read_busy_seconds", lambda cpus: next(busy))
    monkeypatch.setattr(profiling, "profile_key", lambda o, d, dev: "k")
    monkeypatch.setattr(costs, "profile_path", lambda key: tmp_path / f"{key}.json")

    def measure(oracle, drafts, device, quiet=False):  # noqa: ANN001, ANN202
        load = profiling.OthersLoad()
        load._start = (load._start[0] - 5.0, load._start[1], load._start[2])  # 5 s of wall time
        return costs.CostProfile({1: 0.01}, others_load=load.since_start())

    monkeypatch.setattr(profiling, "measure_profile", measure)
    profile = profiling.load_or_measure(None, [], "cpu")  # type: ignore[arg-type]
    assert profile.others_load >= 1.0
    assert not (tmp_path / "k.json").exists()
    assert "measured again next time" in capsys.readouterr().err


def test_a_thread_can_stop_opening_parallel_regions_without_changing_the_others() -> None:
    """`no_parallel_regions_here` (a server lane's start): that thread runs on itself, every other keeps its count."""
    import threading

    from stagedspec.server.batching import Lane, PassBatcher
    from stagedspec.threads import no_parallel_regions_here

    before = torch.get_num_threads()
    seen: dict[str, object] = {}

    def worker() -> None:
        seen["took"] = no_parallel_regions_here()
        seen["threads"] = torch.get_num_threads()
        seen["sum"] = torch.arange(100_000, dtype=torch.float64).sum().item()  # still computes

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert torch.get_num_threads() == before
    assert seen["sum"] == sum(range(100_000))
    if seen["took"]:  # libgomp's OpenMP (PyTorch's Linux wheels)
        assert seen["threads"] == 1
    lane = Lane(PassBatcher(), "lane-test")  # a lane sets it on its own thread, at its start
    ran = threading.Event()
    threads: list[int] = []
    lane.assign(lambda: (threads.append(torch.get_num_threads()), ran.set()), "running")
    lane.wake()
    assert ran.wait(10)
    lane.close()
    assert torch.get_num_threads() == before and threads == [1 if seen["took"] else before]
