"""What the consolidation figures are measured against: re-packing from scratch by per-job shares or by combined
memory, and the whole-device bound for fractional pods."""

from __future__ import annotations

import pytest

from enforcer.consolidation_sizing import ConsolidateParams
from enforcer.sim.bounds import integral_device_hours, repack_by_combined_memory, repack_every_cycle
from enforcer.sim.model import ReadReport
from enforcer.sim.readers.demand import DemandJob, DemandTrace
from store.errors import InvalidInput
from tests.sim.test_replay import GIB, P, devices, series_job, trace

CAP = 80 * GIB


def test_repack_every_cycle_uses_the_planners_sizing_without_move_caps():
    # a and b fit one device once seen for min_history (cycle at 900 s); c's 50 GiB lane fits beside neither
    tr = trace(series_job("a", [20] * 60), series_job("b", [20] * 60), series_job("c", [50] * 60))
    assert repack_every_cycle(tr, devices(3), P, 900.0) == pytest.approx((3 * 900 + 2 * 2700) / 3600)
    # the compute cap keeps two busy jobs apart; without it they share
    busy = trace(series_job("a", [20] * 60, util=0.7), series_job("b", [20] * 60, util=0.7))
    assert repack_every_cycle(busy, devices(2), P, 900.0) == pytest.approx(2.0)
    free = ConsolidateParams(window_s=3600.0, min_history_s=600.0, util_cap=float("inf"))
    assert repack_every_cycle(busy, devices(2), free, 900.0) == pytest.approx((2 * 900 + 2700) / 3600)
    # 37 + 37 GiB: Salus's headroom keeps them apart on 80 GiB; shares of exactly their peaks fit together
    big = trace(series_job("a", [37] * 60), series_job("b", [37] * 60))
    assert repack_every_cycle(big, devices(2), P, 900.0) == pytest.approx(2.0)
    assert repack_every_cycle(big, devices(2), P, 900.0, headroom=False) == pytest.approx((2 * 900 + 2700) / 3600)


def test_combined_memory_lets_jobs_whose_peaks_alternate_share_what_per_job_shares_keep_apart():
    # a peaks while b idles and the other way round: each peaks at 50 GiB, together they never pass 60
    a = series_job("a", ([50] * 10 + [10] * 10) * 3)
    b = series_job("b", ([10] * 10 + [50] * 10) * 3)
    tr = trace(a, b)
    # alone while their history is short (the cycle at 0), one device from the cycle at 900 s on
    r = repack_by_combined_memory(tr, CAP, 8 * GIB, P, 900.0)
    assert r.mean_devices == pytest.approx((15 * 2 + 45 * 1) / 60)
    assert r.overcommit_device_minutes == 0
    # per-job shares hold both peaks: 2 x 50 GiB does not fit 80
    assert repack_every_cycle(tr, devices(2), P, 900.0, headroom=False) == pytest.approx(2.0)
    # 60 GiB together plus a 25 GiB slack does not fit either
    assert repack_by_combined_memory(tr, CAP, 25 * GIB, P, 900.0).mean_devices == pytest.approx(2.0)


def test_combined_memory_counts_the_overcommit_of_a_rise_it_could_not_see_coming():
    # together at the cycles of 900 and 1800 s (40 GiB); b rises to 70 GiB at minute 40: five minutes over 80 GiB
    # until the cycle at 2700 s sees it and keeps them apart
    tr = trace(series_job("a", [20] * 60), series_job("b", [20] * 40 + [70] * 20))
    r = repack_by_combined_memory(tr, CAP, 8 * GIB, P, 900.0)
    assert r.overcommit_device_minutes == pytest.approx(5.0)
    assert r.mean_devices == pytest.approx((15 * 2 + 30 * 1 + 15 * 2) / 60)


def test_combined_memory_gives_a_job_arriving_between_cycles_a_device_until_the_next():
    tr = trace(series_job("a", [20] * 60), series_job("c", [5] * 30, start=1200.0))
    r = repack_by_combined_memory(tr, CAP, 8 * GIB, P, 900.0)
    # c alone from minute 20; trusted (600 s of history) at the cycle of 1800 s, beside a
    assert r.mean_devices == pytest.approx((20 * 1 + 10 * 2 + 30 * 1) / 60)


def test_combined_memory_refuses_a_trace_without_readings():
    empty = DemandTrace("hand", [DemandJob("p", 0.0, 60.0, declared_mem=GIB, declared_util=0.5)],
                        ReadReport("hand"), None)
    with pytest.raises(InvalidInput, match="no memory readings"):
        repack_by_combined_memory(empty, CAP, 0, ConsolidateParams())


def test_integral_bound_rounds_fractional_pods_up_to_whole_devices_at_every_instant():
    tr = DemandTrace("hand", [
        DemandJob("half1", 0.0, 3600.0, declared_util=0.5), DemandJob("half2", 0.0, 3600.0, declared_util=0.5),
        DemandJob("six", 3600.0, 7200.0, declared_util=0.6), DemandJob("pair", 0.0, 3600.0, gpus=2),
        DemandJob("open", 0.0, None, declared_util=0.3),  # no departure: not counted
    ], ReadReport("hand"), None)
    # first hour: 0.5 + 0.5 -> 1 device, plus the pair's 2; second hour: 0.6 -> 1 device
    assert integral_device_hours(tr) == pytest.approx(3.0 + 1.0)
