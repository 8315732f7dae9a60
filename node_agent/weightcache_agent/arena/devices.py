"""Which devices an agent serves, named by a stable identity.

Ranks, CUDA ordinals and CUDA_VISIBLE_DEVICES orderings differ between processes and
pods; a GPU UUID does not. Sockets and arenas are keyed by `Device.uuid` (for the cpu
backend a synthetic `cpu-<rank>`), and an engine resolves a UUID to its own local
ordinal with `local_ordinal`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Device:
    backend: str  # "cpu" | "cuda"
    uuid: str  # "GPU-xxxxxxxx-..." or "cpu-<rank>"
    ordinal: int  # index in this process's view (torch.cuda), or the rank for cpu

    @property
    def socket_name(self) -> str:
        return f"{self.uuid}.sock"


def _driver_uuids() -> list[str] | None:
    """GPU UUIDs by ordinal, straight from the driver (no torch import); None without cuda-bindings.

    The driver numbers devices as torch does (both honour CUDA_VISIBLE_DEVICES and
    CUDA_DEVICE_ORDER), so index i is torch's `cuda:i`."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    ok = cu.CUresult.CUDA_SUCCESS
    try:
        if cu.cuInit(0)[0] != ok:
            return []
    except RuntimeError:  # cuda-bindings installed on a machine without the driver (no libcuda.so.1)
        return []
    err, count = cu.cuDeviceGetCount()
    if err != ok:
        return []
    uuids = []
    for ordinal in range(count):
        err, device = cu.cuDeviceGet(ordinal)
        err2, uuid = cu.cuDeviceGetUuid(device) if err == ok else (err, None)
        try:
            value = uuid.bytes if err2 == ok else b""
            raw = (value if isinstance(value, (bytes, bytearray)) else bytes(b & 0xFF for b in value)).hex()
        except (TypeError, ValueError, AttributeError):
            raw = ""
        if len(raw) != 32:
            return None  # let torch answer
        uuids.append(f"GPU-{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:32]}")
    return uuids


def _have_bindings() -> bool:
    from importlib.util import find_spec

    try:
        return find_spec("cuda.bindings") is not None
    except (ImportError, ValueError):
        return False


def cuda_available() -> bool:
    """A GPU the cuda backend can use: visible, and cuda-bindings (which the backend needs) installed."""
    if not _have_bindings():
        return False
    uuids = _driver_uuids()
    if uuids is not None:
        return bool(uuids)
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "cuda" if cuda_available() else "cpu"
    if backend == "cuda" and not cuda_available():
        if not _have_bindings():
            raise ValueError("--backend cuda needs cuda-bindings: pip install 'weightcache[cuda]'")
        raise ValueError("--backend cuda: no CUDA device is visible to this process")
    return backend


def cuda_uuid(ordinal: int) -> str:
    import torch

    uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def cuda_devices() -> list[Device]:
    uuids = _driver_uuids()
    if uuids is not None:
        return [Device("cuda", uuid, i) for i, uuid in enumerate(uuids)]
    import torch

    return [Device("cuda", cuda_uuid(i), i) for i in range(torch.cuda.device_count())]


_ordinals: dict[str, int] = {}  # a process's devices do not change: asked once, then remembered


def local_ordinal(uuid: str) -> int:
    """This process's CUDA ordinal of the GPU with `uuid` (whatever CUDA_VISIBLE_DEVICES says)."""
    if uuid in _ordinals:
        return _ordinals[uuid]
    devices = cuda_devices()
    for device in devices:
        _ordinals[device.uuid] = device.ordinal
    if uuid in _ordinals:
        return _ordinals[uuid]
    visible = ", ".join(d.uuid for d in devices) or "none"
    raise ValueError(f"GPU {uuid} is not visible to this process (visible: {visible})")


def select_devices(backend: str, spec: str, count: int | None = None) -> list[Device]:
    """Devices named by `spec`: "all", or a comma list of ordinals and/or GPU UUIDs.

    For the cpu backend there is no hardware to pick: `count` ranks get `cpu-<rank>`.
    """
    if backend == "cpu":
        n = count if count is not None else (1 if spec == "all" else len(spec.split(",")))
        return [Device("cpu", f"cpu-{rank}", rank) for rank in range(n)]
    available = cuda_devices()
    if spec == "all":
        chosen = available
    else:
        by_uuid = {d.uuid: d for d in available}
        chosen = []
        for item in (s.strip() for s in spec.split(",")):
            if item.isdigit() and int(item) < len(available):
                chosen.append(available[int(item)])
            elif item in by_uuid or f"GPU-{item}" in by_uuid:
                chosen.append(by_uuid.get(item) or by_uuid[f"GPU-{item}"])
            else:
                visible = ", ".join(f"{d.ordinal} ({d.uuid})" for d in available) or "none"
                raise ValueError(f"device {item!r} is neither an ordinal below {len(available)} nor a visible GPU "
                                 f"UUID; the GPUs here: {visible}")
    if count is not None and len(chosen) < count:
        raise ValueError(f"{count} ranks need {count} GPUs on this node, only {len(chosen)} selected")
    return chosen[:count] if count is not None else chosen
