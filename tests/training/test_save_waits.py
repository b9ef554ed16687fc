"""A save that waits for the previous one to finish writing says so as a warning only where the wait is
material (`inflight.material`: a second, and a twentieth of the time between the saves), at DEBUG
otherwise: a first run's back-to-back saves (`stagerd demo`) wait milliseconds. One process."""

from __future__ import annotations

import logging

import torch

from stagerd.training.inflight import material


def test_a_short_wait_for_the_previous_save_is_said_at_debug_only(tmp_path, caplog):
    from stagerd import Stager

    sd = {"w": torch.zeros(1 << 20)}  # 4 MiB: still being written when the next save starts
    with caplog.at_level(logging.DEBUG, logger="stagerd.stage"), Stager(tmp_path) as stager:
        for step in (1, 2, 3):
            stager.save(sd, step)
        stager.wait()
    waits = [r for r in caplog.records if "to finish writing" in r.getMessage()]
    assert waits and all(r.levelno == logging.DEBUG for r in waits), [r.getMessage() for r in waits]


def test_a_wait_is_material_from_a_second_and_a_twentieth_of_the_time_between_saves():
    assert not material(0.02, 0.05)  # a toy run's saves, back to back
    assert not material(0.9, 1.0)
    assert not material(2.0, 100.0)  # 2 % of the training's time
    assert material(2.0, 30.0)
    assert material(1.0, 1.0)
