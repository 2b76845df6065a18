"""Rule: the CPU waits for the GPU many times per step (stream/device syncs, .item(), .cpu()).

Reported when the syncs cost a material share of step time ([common] material_cost_fraction): the device idle time
after them; on a trace without a device timeline, where that cannot be measured, the CPU time blocked in them. A sync
the device does not run dry in (it still has queued work) costs the device nothing, however often it comes.
"""

from __future__ import annotations

from typing import Any

from analyzer.rules.base import TraceFinding, is_material, steps_location
from analyzer.rules.devices import DeviceApi, device_api

RULE = "trace.sync_heavy"


def check(s: dict[str, Any], th: dict) -> TraceFinding | None:
    sy, t = s["sync"], th["sync_heavy"]
    step_s = s["step_us_mean"] / 1e6
    blocked_s = sy["blocked_us_per_step"] / 1e6
    blocked_fraction = blocked_s / step_s if step_s else 0.0
    if sy["per_step_mean"] < t["calls_per_step_min"] or blocked_fraction < t["blocked_fraction_min"]:
        return None
    idle_s = min((sy.get("idle_after_us_per_step") or 0.0) / 1e6, step_s)  # no device timeline: nothing measured
    if not is_material(idle_s if s["has_gpu"] else blocked_s, step_s, th):
        return None
    tot = sy["totals"]
    evidence = {
        "calls_per_step": round(sy["per_step_mean"], 2),
        "stream_syncs": tot["stream_sync"],
        "device_syncs": tot["device_sync"],
        "event_syncs": tot["event_sync"],
        "item_calls": tot["item"],
        "blocked_ms_per_step": round(blocked_s * 1e3, 3),
        "blocked_fraction": round(blocked_fraction, 4),
        "device_idle_after_ms_per_step": round(idle_s * 1e3, 3),
        "steps": s["n_steps"],
        "threshold_calls_per_step": t["calls_per_step_min"],
    }
    api = device_api(s)
    parts = call_counts(sy)
    first = "; ".join(f"{name} at {', '.join(f'{v:.1f}' for v in ts)} ms" for name, ts in sy["first_calls_ms"].items())
    return TraceFinding(
        rule=RULE, subject=f"rank{s['rank']}", step_s=step_s, cost_s_per_step=idle_s, evidence=evidence,
        title=f"{sy['per_step_mean']:.0f} synchronising calls per step ({', '.join(parts)} in the trace)"
              + (f"; the {api.device} drains its queue in them and waits {idle_s * 1e3:.1f} ms per step for new work"
                 if idle_s >= 5e-5 else ""),
        location=steps_location(s, first),
        fix=advice(api),
    )


# what a summary written before it kept the calls' own names calls each kind: no runtime's call names
KIND_WORDS = (("stream_sync", "stream syncs"), ("device_sync", "device syncs"), ("event_sync", "event syncs"))


def call_counts(sy: dict[str, Any]) -> list[str]:
    """'16 cudaStreamSynchronize', '2 hipDeviceSynchronize', '3 .item()': each kind's calls by the names the trace
    has them under (its runtime's: CUDA, HIP, MTIA), so that no title names a CUDA call on another device."""
    tot, names = sy["totals"], sy.get("names")
    parts = []
    for kind, words in KIND_WORDS:
        if names is None:
            parts += [f"{tot[kind]} {words}"] if tot[kind] else []
        else:
            parts += [f"{count} {name}" for name, count in sorted(names.get(kind, {}).items())]
    return parts + ([f"{tot['item']} .item()"] if tot["item"] else [])


def advice(api: DeviceApi) -> str:
    return (f"Keep the CPU ahead of the {api.device}: drop {api.synchronize} from the loop, read losses/metrics "
            f"with .item()/.cpu() every N steps (accumulate them on the {api.device}), use non_blocking=True copies "
            "from pinned memory, and avoid data-dependent shapes (nonzero, masked_select) that force a sync.")
