"""The one retry loop: how many tries, the waits between them, what is retried, and how it is stopped early."""

import threading
import time

import pytest

from olmo.util import Backoff, call_with_retries


class Flaky:
    """Fails its first ``failures`` calls with ``error``, then returns the number of calls."""

    def __init__(self, failures: int, error: type[Exception] = ConnectionError):
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error(f"call {self.calls} failed")
        return self.calls


def test_a_function_that_fails_twice_succeeds_on_the_third_try_after_growing_waits():
    flaky, retries = Flaky(2), []
    start = time.monotonic()
    result = call_with_retries(
        flaky,
        attempts=5,
        backoff=Backoff(0.05, factor=3.0),
        retry_on=ConnectionError,
        on_retry=lambda n, e, delay: retries.append((n, str(e), delay)),
    )
    assert result == 3 and flaky.calls == 3
    assert retries == [(1, "call 1 failed", pytest.approx(0.05)), (2, "call 2 failed", pytest.approx(0.15))]
    assert time.monotonic() - start >= 0.2  # the waits really happened


def test_the_last_error_propagates_after_every_try():
    flaky, retries = Flaky(10), []
    with pytest.raises(ConnectionError, match="call 3 failed"):
        call_with_retries(
            flaky,
            attempts=3,
            backoff=Backoff(0.0),
            retry_on=ConnectionError,
            on_retry=lambda *a: retries.append(a),
        )
    assert flaky.calls == 3 and len(retries) == 2  # no wait (nor callback) after the last try


def test_an_error_that_is_not_retryable_propagates_at_once():
    flaky = Flaky(1, error=PermissionError)
    with pytest.raises(PermissionError):
        call_with_retries(flaky, attempts=5, backoff=Backoff(0.0), retry_on=(ConnectionError, TimeoutError))
    assert flaky.calls == 1


def test_the_callback_may_end_the_retries_with_its_own_error():
    def give_up_on_the_second(n: int, error: ConnectionError, delay: float) -> None:
        if n == 2:
            raise RuntimeError("two failures in a row: the server is gone")

    flaky = Flaky(10)
    with pytest.raises(RuntimeError, match="the server is gone"):
        call_with_retries(
            flaky, attempts=5, backoff=Backoff(0.0), retry_on=ConnectionError, on_retry=give_up_on_the_second
        )
    assert flaky.calls == 2


def test_a_stop_event_ends_a_long_wait_and_prevents_further_tries():
    stop, flaky = threading.Event(), Flaky(10)
    threading.Timer(0.1, stop.set).start()
    start = time.monotonic()
    with pytest.raises(ConnectionError, match="call 1 failed"):
        call_with_retries(flaky, attempts=3, backoff=Backoff(60.0), retry_on=ConnectionError, stop=stop)
    assert time.monotonic() - start < 30 and flaky.calls == 1

    retries: list = []  # already set: the first failure is the last, without a callback
    with pytest.raises(ConnectionError, match="call 2 failed"):
        call_with_retries(
            flaky,
            attempts=3,
            backoff=Backoff(60.0),
            retry_on=ConnectionError,
            stop=stop,
            on_retry=lambda *a: retries.append(a),
        )
    assert flaky.calls == 2 and retries == []


def test_waits_grow_by_the_factor_up_to_the_maximum_and_jitter_keeps_the_upper_half():
    assert [Backoff(0.5, max_s=3.0).delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert [Backoff(30.0).delay(n) for n in range(1, 4)] == [30.0, 60.0, 120.0]
    jittered = [Backoff(2.0, jitter=True).delay(3) for _ in range(200)]
    assert all(4.0 <= d <= 8.0 for d in jittered) and len(set(jittered)) > 100
