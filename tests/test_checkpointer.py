"""Which checkpoint files a training step writes: saves_at, a pure function, at its edges."""

from __future__ import annotations

import pytest

from gptforge.train.checkpointer import Save, saves_at

BASE = dict(
    start_step=0,
    max_iters=100,
    eval_only=False,
    always_save=True,
    ckpt_interval=0,
    evaluated=False,
    improved=False,
    stop=False,
)


def at(step: int, **changes) -> Save | None:
    return saves_at(step, **{**BASE, **changes})


def test_an_evaluation_writes_ckpt_pt_and_the_best_when_it_improved():
    assert at(10, evaluated=True, improved=True) == Save(True, True, None, "val loss improved")
    assert at(10, evaluated=True) == Save(True, False, None, "always_save_checkpoint")
    assert at(10, evaluated=True, always_save=False) is None  # nanoGPT: only improvements, when asked
    assert at(10, evaluated=True, improved=True, always_save=False) == Save(True, True, None, "val loss improved")
    assert at(10) is None  # no evaluation at this step, no interval: nothing


def test_step_checkpoints_every_interval_and_at_the_last_step_named_for_the_iteration_they_hold():
    assert at(50, ckpt_interval=25) == Save(False, False, 50, "ckpt_interval")
    assert at(60, ckpt_interval=25) is None
    assert at(100, ckpt_interval=25, evaluated=True) == Save(True, False, 100, "always_save_checkpoint")
    assert at(100, ckpt_interval=30) == Save(False, False, 100, "ckpt_interval")  # 100 is no multiple of 30
    assert at(0, ckpt_interval=25) is None  # step 0 is the start: nothing trained yet
    assert at(100, ckpt_interval=0, evaluated=True, always_save=False) is None


def test_the_state_a_run_resumed_from_is_not_written_again():
    assert at(40, start_step=40, evaluated=True, improved=True, ckpt_interval=20) is None
    assert at(41, start_step=40, ckpt_interval=1) == Save(False, False, 41, "ckpt_interval")


def test_eval_only_writes_nothing_even_when_stopped():
    for stop in (False, True):
        assert at(100, eval_only=True, evaluated=True, improved=True, ckpt_interval=10, stop=stop) is None


@pytest.mark.parametrize("step, start", [(37, 0), (40, 40), (100, 0)])
def test_a_stop_request_writes_ckpt_pt_only(step, start):
    """Also at the resume step (a resume stopped at once keeps its place) and at the last step, where the run would
    otherwise end without its last updates on disk."""
    assert at(step, start_step=start, stop=True, ckpt_interval=10) == Save(True, False, None, "stop requested")
