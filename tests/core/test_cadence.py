"""every="auto": the interval chooser's math against hand-computed cases, its clamp to the time
to durable, its re-choice as the measured costs change, the goodput accounting, and bad input
(issue 34 item 2)."""

from __future__ import annotations

import math
from concurrent.futures import Future

import pytest

import snapkeep
from snapkeep._core.session.cadence import (
    AutoInterval,
    Cadence,
    History,
    check_every,
    checkfreq_interval_s,
    choose,
    daly_interval_s,
    estimate_mtbf_s,
    young_interval_s,
)
from snapkeep._core.session.goodput import RunRecord, summarize
from snapkeep.training import triggers


def test_young_and_daly_against_hand_computed_values() -> None:
    # Young: sqrt(2 * 10 * 3600) = sqrt(72000) = 268.328
    assert young_interval_s(10.0, 3600.0) == pytest.approx(268.328157, rel=1e-6)
    # Daly: x = C / 2M = 10 / 7200 = 0.0013889; sqrt(x) = 0.037268;
    # 268.328 * (1 + 0.037268 / 3 + 0.0013889 / 9) - 10 = 268.328 * 1.0125770 - 10 = 261.703
    assert daly_interval_s(10.0, 3600.0) == pytest.approx(261.702899, rel=1e-6)
    # C = 0.5, M = 400: sqrt(400) = 20; x = 0.000625, sqrt(x) = 0.025;
    # 20 * (1 + 0.0083333 + 0.0000694) - 0.5 = 19.66806
    assert daly_interval_s(0.5, 400.0) == pytest.approx(19.668056, rel=1e-6)
    assert daly_interval_s(900.0, 400.0) == 400.0  # C >= 2M: Daly's T = M
    # CheckFreq: stall / 3.5 %, not below the time to durable
    assert checkfreq_interval_s(0.07, 1.0) == pytest.approx(2.0)
    assert checkfreq_interval_s(0.07, 5.0) == 5.0


def test_choice_in_steps_and_the_clamp_to_time_to_durable() -> None:
    free = choose(cost_s=0.5, durable_s=2.0, step_s=0.5, mtbf_s=400.0)
    assert (free.interval_steps, free.clamped) == (40, False)  # ceil(19.668 / 0.5)
    clamped = choose(cost_s=0.5, durable_s=30.0, step_s=0.5, mtbf_s=400.0)
    assert (clamped.interval_s, clamped.interval_steps, clamped.clamped) == (30.0, 60, True)
    capped = choose(cost_s=0.5, durable_s=2.0, step_s=0.5, mtbf_s=400.0,
                    settings=AutoInterval(max_steps=25))
    assert capped.interval_steps == 25


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _History(History):
    """Three failures in 1200 s of uptime: with the 400 s prior (weighed 0.03 failure),
    M = (0.03 * 400 + 1200) / (0.03 + 3) = 1212 / 3.03 = 400 s."""

    def failures(self) -> int:
        return 3

    def uptime_s(self) -> float:
        return 1200.0


def test_cadence_measures_rechooses_as_costs_change_and_clamps() -> None:
    clock = _Clock()
    cadence = Cadence(AutoInterval(mtbf_s=400.0), history=_History(), clock=clock)
    for step in (1, 2, 3):  # the warm-up: 1 s per step
        assert not cadence.due(step)
        clock.now += 1.0
    assert cadence.due(4)  # 3 steps timed: the first snapshot measures the cost
    first: Future[None] = Future()
    cadence.saved(4, stall_s=0.25, committed=first)
    clock.now += 1.5  # the save's step took 1.5 s: it cost 0.5 s (more than its 0.25 s call)
    assert not cadence.due(5)
    choice = cadence.choice
    assert choice is not None
    assert (choice.cost_s, choice.step_s, choice.failures) == (0.5, 1.0, 3)
    assert choice.mtbf_s == pytest.approx(400.0)
    assert choice.interval_steps == 20  # ceil(19.668 s / 1 s)
    clock.now = 5.0
    first.set_result(None)  # durable 2 s after the save's step began (t = 3 -> 5)
    step = 5
    while not cadence.due(step + 1):
        step += 1
        clock.now += 1.0
    assert step + 1 == 4 + 20
    assert cadence.choice is not None and cadence.choice.durable_s == 2.0
    second: Future[None] = Future()
    cadence.saved(24, stall_s=2.0, committed=second)
    clock.now += 3.0  # this save cost 2 s: median cost (0.5 + 2) / 2 = 1.25 s
    assert not cadence.due(25)
    # Daly(1.25, 400) = sqrt(1000) * (1 + sqrt(0.0015625) / 3 + 0.0015625 / 9) - 1.25 = 30.795
    assert cadence.choice is not None and cadence.choice.cost_s == 1.25
    assert cadence.choice.interval_steps == 31
    clock.now += 40.0  # the second save became durable only 43 s after its step began
    second.set_result(None)
    assert not cadence.due(26)
    assert cadence.choice is not None
    assert (cadence.choice.durable_s, cadence.choice.clamped) == (43.0, True)
    assert cadence.choice.interval_steps == 43  # never shorter than the time to durable


def test_goodput_accounting_of_a_killed_and_resumed_job() -> None:
    killed = RunRecord(started_unix_s=90.0, first_unix_s=100.0, last_unix_s=200.0,
                       last_step=100, step_s=1.0, save_s=5.0, saves=3, ended="running")
    resumed = RunRecord(started_unix_s=215.0, first_unix_s=230.0, resumed_step=80,
                        last_unix_s=330.0, last_step=180, step_s=1.0, save_s=3.0, saves=2,
                        ended="finished", interval_steps=20)
    g = summarize([killed, resumed])
    # wall 330 - 100 = 230: restart 230 - 200 = 30, replay (100 - 80) * 1 s = 20, saves 8
    assert (g.wall_s, g.restart_s, g.replay_s, g.save_s) == (230.0, 30.0, 20.0, 8.0)
    assert g.trained_s == 172.0 and math.isclose(g.ratio, 172 / 230)
    assert (g.failures, g.runs, g.restarts, g.interval_steps) == (1, 2, (30.0,), 20)


@pytest.mark.parametrize(("make", "error", "match"), [
    (lambda: check_every("fast"), ValueError, r"every must be .*'auto'.*got 'fast'"),
    (lambda: snapkeep.AutoInterval(mtbf_s=-1.0), ValueError,
     r"mtbf_s must be a number of seconds > 0.*got -1"),
    (lambda: snapkeep.AutoInterval(mtbf_s="1h"), TypeError, r"mtbf_s must be a number"),
    (lambda: snapkeep.AutoInterval(min_steps=0), ValueError, r"min_steps must be an int >= 1"),
    (lambda: triggers.AutoTrigger(mtbf_s=-5), ValueError, r"mtbf_s must be a number of sec"),
    (lambda: triggers.get_trigger("fast"), ValueError, r"trigger must be 'auto'.*got 'fast'"),
])
def test_bad_input_names_the_argument_and_the_accepted_values(make, error, match) -> None:
    with pytest.raises(error, match=match):
        make()


def test_checkpointer_refuses_every_fast_before_creating_anything(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"every must be an int >= 1 \(steps\), 'auto'"):
        snapkeep.Checkpointer(tmp_path / "run", every="fast")
    assert not (tmp_path / "run").exists()


def test_the_mtbf_estimate_grows_no_faster_than_uptime_before_a_failure_then_learns_the_rate(
) -> None:
    """Before any failure the prior counts as one (M = prior + uptime: 33 s without a failure
    moves a 60 s prior to 93 s, not to 396 s as a prior of 0.1 failure did); after failures the
    prior weighs 0.03 of one, so the job's own rate soon dominates."""
    assert estimate_mtbf_s(60.0, uptime_s=33.0, failures=0) == pytest.approx(93.0)
    assert estimate_mtbf_s(86400.0, uptime_s=0.0, failures=0) == pytest.approx(86400.0)
    one = estimate_mtbf_s(86400.0, uptime_s=1200.0, failures=1)
    assert one == pytest.approx((0.03 * 86400.0 + 1200.0) / 1.03)  # 3,682 s, not 8,945 s
    assert estimate_mtbf_s(86400.0, uptime_s=24 * 1200.0, failures=24) == pytest.approx(
        (0.03 * 86400.0 + 24 * 1200.0) / 24.03)  # 1,306 s: within 9 % of the true 1,200 s
    assert estimate_mtbf_s(60.0, uptime_s=-5.0, failures=0) == 60.0  # a clock step back
