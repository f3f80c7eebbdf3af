"""vitkit.timing: arguments that cannot give a timing are refused where they are given, naming the argument."""

from __future__ import annotations

import pytest
import torch

from vitkit.timing import Timing, time_alternating

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"repeats": 0}, "repeats"),
        ({"repeats": -3}, "repeats"),
        ({"threads": 0}, "threads"),
        ({"settle_s": -0.1}, "settle_s"),
        ({"settle_s": float("nan")}, "settle_s"),
    ],
)
def test_time_alternating_refuses_arguments_that_give_no_timing(kwargs: dict[str, float], named: str) -> None:
    calls: list[str] = []
    args: dict[str, float] = {"repeats": 2, "threads": 1, "settle_s": 0.0, **kwargs}
    with pytest.raises(ValueError, match=named):
        time_alternating({"a": lambda: calls.append("a")}, device=CPU, **args)  # type: ignore[arg-type]
    assert calls == []  # refused before anything ran, not later in the statistics


def test_one_repeat_is_enough_and_runners_alternate() -> None:
    calls: list[str] = []
    out = time_alternating({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 2, CPU, 1)
    assert calls == ["a", "b", "a", "b"]
    assert [len(t.times) for t in out.values()] == [2, 2]
    one = time_alternating({"a": lambda: calls.append("a")}, 1, CPU, 1)["a"]
    assert one.median == one.times[0] and one.iqr == (one.times[0], one.times[0])


def test_a_timing_of_no_calls_is_refused() -> None:
    with pytest.raises(ValueError, match="times"):
        Timing([], cpu_util=1.0)
