"""Record what NVML reports about this host, as JSON (for fake-NVML test fixtures of the probe).

Every call is recorded with its answer or the NVML error it raised, so the fake NVML of the tests
(``tests/topology/fake_nvml.py``, ``from_snapshot``) can replay a real host, unsupported queries
included. Run on a GPU host:

    python experiments/nvml_snapshot.py --out nvml_snapshot.json
"""

from __future__ import annotations

import json
import sys
from typing import Any

import study

from core.osutil import atomic_open


def _call(fn, *args) -> dict[str, Any]:
    import pynvml

    try:
        value = fn(*args)
    except pynvml.NVMLError as e:  # unsupported queries are part of the picture
        return {"error": str(e), "code": getattr(e, "value", None)}
    if isinstance(value, bytes):
        value = value.decode()
    return {"value": _plain(value)}


def _plain(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if hasattr(v, "_fields_"):  # a ctypes struct
        return {name: _plain(getattr(v, name)) for name, *_ in v._fields_}
    if hasattr(v, "__len__") and hasattr(v, "__getitem__"):  # a ctypes array (cpu affinity words)
        return [_plain(v[i]) for i in range(len(v))]
    return repr(v)


def _fabric_info(handle: Any) -> Any:
    """The GPU's fabric registration (multi-node NVLink, NVL72-class): the filled struct."""
    import ctypes

    import pynvml

    info = pynvml.c_nvmlGpuFabricInfoV_t()
    pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    return info


def snapshot() -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out: dict[str, Any] = {
            "driver": _call(pynvml.nvmlSystemGetDriverVersion),
            "nvml": _call(pynvml.nvmlSystemGetNVMLVersion),
            "cuda_driver": _call(pynvml.nvmlSystemGetCudaDriverVersion),
            "count": pynvml.nvmlDeviceGetCount(),
            "devices": [],
        }
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(out["count"])]
        for i, h in enumerate(handles):
            dev: dict[str, Any] = {
                "index": i,
                "name": _call(pynvml.nvmlDeviceGetName, h),
                "uuid": _call(pynvml.nvmlDeviceGetUUID, h),
                "memory": _call(pynvml.nvmlDeviceGetMemoryInfo, h),
                "pci": _call(pynvml.nvmlDeviceGetPciInfo, h),
                "numa_node": _call(getattr(pynvml, "nvmlDeviceGetNumaNodeId", lambda h: None), h),
                "cpu_affinity": _call(pynvml.nvmlDeviceGetCpuAffinity, h, 4),
                "pcie_link_gen": _call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "pcie_link_width": _call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                "pcie_max_link_gen": _call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "pcie_max_link_width": _call(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                "nvlink": [],
                "common_ancestor": {},
                "fabric": _call(_fabric_info, h),
            }
            for link in range(getattr(pynvml, "NVML_NVLINK_MAX_LINKS", 18)):
                state = _call(pynvml.nvmlDeviceGetNvLinkState, h, link)
                entry = {"link": link, "state": state}
                if "value" in state:
                    entry["remote_pci"] = _call(pynvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
                    entry["remote_type"] = _call(
                        getattr(pynvml, "nvmlDeviceGetNvLinkRemoteDeviceType", lambda h, link: None), h, link
                    )
                    entry["version"] = _call(pynvml.nvmlDeviceGetNvLinkVersion, h, link)
                dev["nvlink"].append(entry)
            ancestor = pynvml.nvmlDeviceGetTopologyCommonAncestor
            for j, other in enumerate(handles):
                if j != i:
                    dev["common_ancestor"][str(j)] = _call(ancestor, h, other)
            out["devices"].append(dev)
        return out
    finally:
        pynvml.nvmlShutdown()


def main(argv: list[str] | None = None) -> int:
    p = study.arguments(__doc__, write=False)
    p.add_argument("--out", default="-")
    args = p.parse_args(argv)
    text = json.dumps(snapshot(), indent=1)
    if args.out == "-":
        print(text)
    else:
        with atomic_open(args.out, what="--out") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
