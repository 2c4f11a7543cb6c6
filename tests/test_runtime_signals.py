"""How rank 0 learns of Slurm's time-limit warning (libra_hpc/runtime/signals.py): the
batch shell's ``STOP`` note in the log folder (read at most every POLL_S, on an injected
clock), or the signal itself on a rank that receives it."""

from __future__ import annotations

import os
import signal

from libra_hpc.runtime.signals import POLL_S, STOP_FILE, StopRequest


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_batch_shells_note_stops_the_run_and_says_what_and_when(tmp_path):
    clock = Clock()
    stop = StopRequest(clock).watch(tmp_path, batch_shell=True)
    assert not stop
    (tmp_path / STOP_FILE).write_text("SIGUSR2 (the time-limit warning, to the batch shell at 2026-11-27T07:00:00)\n")
    assert not stop  # looked at 100.0 already: the next look is due POLL_S later
    clock.now += POLL_S
    assert stop and stop.signal == "SIGUSR2 (the time-limit warning, to the batch shell at 2026-11-27T07:00:00)"
    assert stop.at == 100.0 + POLL_S
    (tmp_path / STOP_FILE).unlink()
    clock.now += 10
    assert stop and stop.at == 100.0 + POLL_S  # once asked, the stop stands


def test_an_earlier_runs_note_is_removed_by_a_local_run_and_left_to_the_batch_shell(tmp_path):
    (tmp_path / STOP_FILE).write_text("SIGUSR2 (an earlier run)\n")
    assert StopRequest(Clock()).watch(tmp_path, batch_shell=True)  # the shell removed its own before the step
    assert (tmp_path / STOP_FILE).exists()
    assert not StopRequest(Clock()).watch(tmp_path, batch_shell=False)  # launch.py --resume of that folder
    assert not (tmp_path / STOP_FILE).exists()


def test_a_rank_that_receives_the_signal_notes_it_instead_of_dying(tmp_path):
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        clock = Clock()
        stop = StopRequest(clock).install()
        assert not stop  # not watching a folder: the signal alone
        clock.now = 7.0
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop and stop.signal == "SIGUSR2" and stop.at == 7.0
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_hang_fault_is_installed_only_for_soak_runs():
    from libra_hpc.runtime.signals import HANG_SIGNAL, install_fault_signals

    previous = signal.getsignal(HANG_SIGNAL)
    try:
        assert not install_fault_signals({}) and signal.getsignal(HANG_SIGNAL) == previous
        assert install_fault_signals({"LIBRA_FAULTS": "1"}) and signal.getsignal(HANG_SIGNAL) != previous
    finally:
        signal.signal(HANG_SIGNAL, previous)
