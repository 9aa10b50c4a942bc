"""Progress lines of long work: durations, estimates of the time left, and how often a line is logged."""

import logging

from olmo.util.progress import ProgressLog, estimate_left, format_duration


def test_durations_and_estimates():
    assert [format_duration(s) for s in (0, 59.6, 3599, 3600 * 12, 86_400 * 3 + 3723)] == [
        "0:00:00",
        "0:01:00",
        "0:59:59",
        "12:00:00",
        "3d 01:02:03",
    ]
    assert estimate_left(0, 10, 5.0) is None
    assert estimate_left(4, 10, 8.0) == 12.0
    assert estimate_left(12, 10, 8.0) == 0.0


def test_a_line_every_interval_and_one_at_the_end_of_long_work(caplog):
    now = [0.0]
    log = logging.getLogger("test.progress")
    progress = ProgressLog("Evaluating piqa", 100, "batches", log, every_s=30, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for done in range(101):
            progress.update(done)
            now[0] += 1.0
    assert [r.getMessage() for r in caplog.records] == [
        "Evaluating piqa: 30/100 batches (30%), 0:00:30 elapsed, ~0:01:10 left",
        "Evaluating piqa: 60/100 batches (60%), 0:01:00 elapsed, ~0:00:40 left",
        "Evaluating piqa: 90/100 batches (90%), 0:01:30 elapsed, ~0:00:10 left",
        "Evaluating piqa: 100/100 batches (100%), 0:01:40 elapsed",
    ]
    caplog.clear()
    quick = ProgressLog("Evaluating arc", 5, "batches", log, every_s=30, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for done in range(6):
            quick.update(done)
    assert caplog.records == []  # work shorter than the interval logs nothing
