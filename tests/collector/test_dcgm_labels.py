"""Which device a dcgm-exporter series belongs to, from its labels alone."""

from __future__ import annotations

from collector.importers.dcgm_labels import MIG_INDEX_BASE, DeviceKey, as_written, device_of


def test_gpus_known_by_uuid_alone_are_apart_from_each_other_and_from_indexed_gpus():
    # these two UUIDs fell on one index (404) when the hash was taken modulo 900
    a = device_of({"hostname": "h", "UUID": "GPU-00000012"})
    b = device_of({"hostname": "h", "UUID": "GPU-0000001a"})
    assert isinstance(a, DeviceKey) and isinstance(b, DeviceKey)
    assert a.index != b.index
    indexed = [device_of({"hostname": "h", "gpu": str(g), "UUID": f"GPU-{g}"}) for g in range(MIG_INDEX_BASE - 1)]
    migs = [device_of({"hostname": "h", "gpu": str(g), "UUID": f"GPU-{g}", "GPU_I_ID": "13"}) for g in range(998)]
    taken = {d.index for d in indexed + migs if isinstance(d, DeviceKey)}
    assert a.index not in taken and b.index not in taken
    # the same UUID is the same device in every window and run
    again = device_of(as_written({"Hostname": "h", "uuid": "GPU-00000012"}))
    assert again == DeviceKey("h", a.index, "GPU-00000012", a.name)
    mig = device_of({"hostname": "h", "UUID": "GPU-00000012", "GPU_I_ID": "6"})
    assert isinstance(mig, DeviceKey) and mig.index < 2**31 and mig.index not in taken
