"""kvtc.progress: the stage timer and the progress bar every module shares."""

from __future__ import annotations

import time

from kvtc.progress import StageTimer, bar


def test_stage_timer_sums_repeats_into_the_given_dict() -> None:
    sink: dict[str, float] = {"before": 1.0}
    timer = StageTimer(sink)
    for _ in range(2):
        with timer("sleep"):
            time.sleep(0.02)
    timer.add("before", 0.5)
    assert sink["before"] == 1.5
    assert 0.04 <= sink["sleep"] < 1.0
    assert list(timer.rounded(1)) == ["before", "sleep"] and timer.elapsed() >= sink["sleep"]


def test_disabled_timer_records_nothing() -> None:
    timer = StageTimer(enabled=False)
    with timer("x"):
        pass
    assert list(timer.iterate([1, 2], "y")) == [1, 2]
    assert timer.seconds == {}


def test_iterate_charges_the_producer_not_the_consumer() -> None:
    def slow_items():
        for i in range(3):
            time.sleep(0.02)
            yield i

    timer = StageTimer()
    got = []
    for item in timer.iterate(slow_items(), "produce"):
        time.sleep(0.05)  # the consumer's time is not the producer's
        got.append(item)
    assert got == [0, 1, 2]
    assert 0.06 <= timer.seconds["produce"] < 0.15
    empty = StageTimer()
    assert list(empty.iterate([], "none")) == [] and empty.seconds == {"none": 0.0}


def test_disabled_bar_is_a_silent_callback(capsys) -> None:
    with bar(3, "quiet", enabled=False) as progress:
        progress(1)
        progress.update(2)
    assert capsys.readouterr() == ("", "")
