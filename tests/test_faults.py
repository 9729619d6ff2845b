"""POTLUCK_FAULTS: what a spec may say, refused with the reason when it cannot act (a test must not
believe it injected a fault that never fires, or crash the process it meant to perturb)."""

from __future__ import annotations

import pytest

from potluck.protos.testkit.faults import FaultSpecError, matches, parse


def test_specs_parse_into_point_step_action() -> None:
    assert parse("allreduce.reduced@3:stop, inner.mid@4+:sleep=0.5,outer.delta@*:scale=1000") == [
        ("allreduce.reduced", 3, False, "stop"), ("inner.mid", 4, True, "sleep=0.5"), ("outer.delta", None, False, "scale=1000")]
    assert parse("") == []
    assert parse("placement.search@*:spin=30") == [("placement.search", None, False, "spin=30")]


def test_spin_keeps_the_thread_busy_for_its_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from potluck.protos.testkit import faults

    monkeypatch.setattr(faults, "_pending", parse("placement.search@*:spin=0.2"))
    t0, c0 = time.monotonic(), time.thread_time()
    faults.fault("placement.search")
    assert time.thread_time() - c0 >= 0.2 and time.monotonic() - t0 >= 0.2  # busy, not asleep (its CPU time: any load)
    assert faults._pending == []


@pytest.mark.parametrize("spec,message", [
    ("inner.mid@3:flip", "'flip' cannot act at 'inner.mid'"),
    ("outer.start@3:scale=10", "'scale=10' cannot act at 'outer.start'"),
    ("outer.delta@3:kill", "'kill' cannot act at 'outer.delta'"),
    ("inner.mid@3:sleep=soon", "needs a number after '='"),
    ("placement.search@*:spin=", "needs a number after '='"),
    ("inner.mid@3:explode", "unknown action 'explode'"),
    ("nowhere@3:kill", "unknown point 'nowhere'"),
    ("inner.mid@x:kill", "step 'x' is not a number"),
    ("inner.mid:kill", "is not point@step:action"),
])
def test_specs_that_cannot_act_are_refused(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message):
        parse(spec)


def test_steps_match_exactly_any_or_from_n_on() -> None:
    exact, later, anywhere = parse("inner.mid@3:kill,inner.mid@3+:kill,inner.mid@*:kill")
    assert [matches(exact, "inner.mid", s) for s in (2, 3, 4)] == [False, True, False]
    assert [matches(later, "inner.mid", s) for s in (2, 3, 4, None)] == [False, True, True, False]
    assert [matches(anywhere, "inner.mid", s) for s in (0, 9, None)] == [True, True, True]
    assert not matches(exact, "outer.start", 3)
