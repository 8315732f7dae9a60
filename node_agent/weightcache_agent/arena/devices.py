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


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.device_count() > 0
    except Exception:
        return False


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "cuda" if cuda_available() else "cpu"
    if backend == "cuda" and not cuda_available():
        raise ValueError("--backend cuda: no CUDA device is visible to this process")
    return backend


def cuda_uuid(ordinal: int) -> str:
    import torch

    uuid = str(torch.cuda.get_device_properties(ordinal).uuid)
    return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"


def cuda_devices() -> list[Device]:
    import torch

    return [Device("cuda", cuda_uuid(i), i) for i in range(torch.cuda.device_count())]


def local_ordinal(uuid: str) -> int:
    """This process's CUDA ordinal of the GPU with `uuid` (whatever CUDA_VISIBLE_DEVICES says)."""
    for device in cuda_devices():
        if device.uuid == uuid:
            return device.ordinal
    visible = ", ".join(d.uuid for d in cuda_devices()) or "none"
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
                raise ValueError(f"device {item!r} is neither an ordinal below {len(available)} nor a visible GPU UUID")
    if count is not None and len(chosen) < count:
        raise ValueError(f"{count} ranks need {count} GPUs on this node, only {len(chosen)} selected")
    return chosen[:count] if count is not None else chosen
