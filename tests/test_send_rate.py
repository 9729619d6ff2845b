"""The send rate a peer reports (its uplink): bytes in each whole second, their mean over the last 10 s and the peak
second, against a reference computed here from the same sends (a clock the test moves)."""

from __future__ import annotations

import threading

from potluck.protos.net.transport import RATE_WINDOWS, Traffic


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def reference_kinds(sends: list[tuple[float, int, str]], now: float) -> dict[str, int]:
    """The first of the largest whole seconds before ``now``'s, its bytes by kind."""
    per: dict[int, dict[str, int]] = {}
    for t, n, kind in sends:
        if int(t) < int(now):
            per.setdefault(int(t), {}).setdefault(kind, 0)
            per[int(t)][kind] += n
    best = max(sorted(per), key=lambda s: sum(per[s].values()), default=None)
    return per[best] if best is not None else {}


def reference(sends: list[tuple[float, int]], now: float) -> tuple[float, float]:
    """From the sends themselves: bytes of each whole second before ``now``'s, mean of the last 10 (fewer since the
    first second), and the largest."""
    start, end = int(sends[0][0]) if sends else int(now), int(now)
    per = {s: 0 for s in range(start, end)}
    for t, n in sends:
        if int(t) < end:
            per[int(t)] += n
    whole = [per[s] for s in sorted(per)][-RATE_WINDOWS:]
    return (sum(whole) / len(whole) if whole else 0.0), float(max(per.values(), default=0))


def test_the_rate_is_the_mean_of_the_last_whole_seconds_and_the_peak_their_largest() -> None:
    clock = Clock()
    traffic = Traffic(clock)
    assert traffic.send_rate() == (0.0, 0.0)
    assert traffic.peak_second() == (0.0, {})
    sends, kinds = [], []
    plan = [(0.1, 1000, "outer"), (0.5, 500, "probe"), (1.2, 2000, "outer"), (1.9, 1, "state"), (4.0, 300, "outer"),
            (4.99, 7000, "activations"), (7.1, 6000, "audit"), (7.2, 1300, "outer"), (30.0, 50, "outer"),
            (30.5, 60, "outer")]
    for dt, n, kind in plan:
        clock.t = 100.0 + dt
        traffic.add_sent(kind, n)
        sends.append((clock.t, n))
        kinds.append((clock.t, n, kind))
        got, want = traffic.send_rate(), reference(sends, clock.t)
        assert got[0] == want[0] and got[1] == want[1], (dt, got, want)
        assert traffic.peak_second() == (reference(sends, clock.t)[1], reference_kinds(kinds, clock.t)), dt
    clock.t = 131.0  # (the second of the last two sends is whole now: it counts)
    assert traffic.send_rate() == reference(sends, clock.t)
    assert traffic.send_rate()[1] == 7300.0, "the peak second: 4.0 and 4.99 s"
    assert traffic.peak_second() == (7300.0, {"outer": 300, "activations": 7000}), "the first of two peaks of 7300"
    assert traffic.snapshot()[0] == {"outer": 4710, "probe": 500, "state": 1, "activations": 7000, "audit": 6000}


def test_a_long_silence_leaves_a_rate_of_zero_and_the_peak() -> None:
    clock = Clock()
    traffic = Traffic(clock)
    traffic.add_sent("outer", 10_000_000)
    clock.t += 3600
    assert traffic.send_rate() == (0.0, 10_000_000.0)
    assert traffic.peak_second() == (10_000_000.0, {"outer": 10_000_000})


def test_sends_from_many_threads_are_all_counted() -> None:
    clock = Clock()
    traffic = Traffic(clock)

    def send() -> None:
        for _ in range(1000):
            traffic.add_sent("outer", 3)

    threads = [threading.Thread(target=send) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    clock.t += 1
    assert traffic.send_rate() == (24_000.0, 24_000.0)
