"""The cuda backend: an arena is one CUDA VMM allocation, shared by a POSIX fd.

Agent side (`CudaArena`): `cuMemCreate` with the POSIX-fd handle type, sized to the
allocation granularity; reserve + map + read-write access for loading; export the fd
once. After loading, `seal()` drops the agent's own mapping, so not even the agent can
scribble on served weights; the allocation lives on through its handle and the fd.

Engine side (`map_readonly_cuda`): import the fd, reserve, map, set access PROT_READ (on
the process's granter thread, while the engine checks its manifest rows), and wrap the
pointer as a uint8 torch tensor through `__cuda_array_interface__` -- no copy. The
`_Mapping` object is what torch keeps alive for as long as any view of the arena exists;
when the last view goes, it unmaps and releases the imported handle.
Memory stays valid after the exporting process exits (the handle counts), which is
why an engine keeps serving when the agent dies, and why an engine holding the fd can
hand the arena back to a restarted agent.

The agent side talks to the driver alone: it makes the device's primary context current
itself (the one torch's runtime uses too), so an agent that re-adopts an arena from an
engine serves it without importing torch. The engine side runs after torch has made the
primary context current; torch is what wraps the mapping as a tensor.
"""
from __future__ import annotations

import logging
import os
import queue
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import OutOfMemory, WeightCacheError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_contexts: dict[int, Any] = {}  # ordinal -> the retained primary context
_contexts_lock = threading.Lock()
_torch_ready: set[int] = set()  # ordinals where torch has made its context (engine side)


class CudaError(WeightCacheError):
    """A CUDA driver call failed."""


_cu: Any = None


def driver() -> Any:
    """cuda-bindings' driver module (imported on first use: the cpu backend never needs it)."""
    global _cu
    if _cu is None:
        try:
            from cuda.bindings import driver as bindings
        except ImportError as e:
            raise CudaError("the cuda backend needs cuda-bindings: pip install 'weightcache[cuda]'") from e
        _cu = bindings
    return _cu


def checked(result: tuple, what: str) -> Any:
    """The value(s) of a driver call's result; `CudaError` naming `what` when it failed."""
    cu = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return values[0] if len(values) == 1 else values


def _activate(ordinal: int) -> None:
    """Make the device's primary context current on this thread (retained once per process), through
    the driver alone: the same context torch's runtime uses, without importing torch."""
    cu = driver()
    ctx = _contexts.get(ordinal)
    if ctx is None:
        with _contexts_lock:
            ctx = _contexts.get(ordinal)
            if ctx is None:
                checked(cu.cuInit(0), "cuInit")
                device = checked(cu.cuDeviceGet(ordinal), "cuDeviceGet")
                ctx = _contexts[ordinal] = checked(cu.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
    checked(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def retain_context(ordinal: int) -> None:
    """Make the device's primary context now, through the driver alone: an engine calls it on a
    thread of its own while torch imports, and torch's runtime then finds the context made."""
    _activate(ordinal)


def _activate_torch(ordinal: int) -> None:
    """Engine side: make torch create and bind the device's primary context (the VMM calls use it)."""
    import torch

    torch.cuda.set_device(ordinal)
    if ordinal not in _torch_ready:  # once per device: the context exists from then on
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{ordinal}")
        _torch_ready.add(ordinal)


def device_mark(ordinal: int) -> str:
    """`sm_XY/cuda-<torch's CUDA version>`, the fingerprint's device field, without importing torch."""
    cu = driver()
    _activate(ordinal)
    attr = cu.CUdevice_attribute
    device = checked(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    major = checked(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "cuDeviceGetAttribute")
    minor = checked(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "cuDeviceGetAttribute")
    return f"sm_{major}{minor}/cuda-{torch_cuda_version()}"


def free_memory(ordinal: int) -> int:
    """Bytes free on the device now (cuMemGetInfo in its primary context): what a second arena may take."""
    _activate(ordinal)
    free, _total = checked(driver().cuMemGetInfo(), "cuMemGetInfo")
    return int(free)


def torch_cuda_version() -> str | None:
    """`torch.version.cuda`: from torch once imported, else from the installed torch's version.py
    (a small file read; importing torch takes seconds)."""
    torch = sys.modules.get("torch")
    if torch is None:
        from importlib.util import find_spec

        spec = find_spec("torch")
        for place in (spec.submodule_search_locations or []) if spec is not None else []:
            try:
                with open(os.path.join(place, "version.py")) as f:
                    found = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:'([^']*)'|\"([^\"]*)\"|None)", f.read(), re.M)
            except OSError:
                continue
            if found:
                return found.group(1) or found.group(2)
        import torch
    return torch.version.cuda


def _prop(ordinal: int) -> Any:
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = ordinal
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _access(ordinal: int, writable: bool) -> Any:
    cu = driver()
    desc = cu.CUmemAccessDesc()
    desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = ordinal
    desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                  else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
    return desc


def granularity(ordinal: int) -> int:
    cu = driver()
    _activate(ordinal)
    return int(checked(cu.cuMemGetAllocationGranularity(
        _prop(ordinal), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity"))


class _Grant:
    """One cuMemSetAccess for the granter thread: `done` once the driver answered, `error` what it refused."""

    def __init__(self, ptr: Any, size: int, access: list):
        self.ptr, self.size, self.access = ptr, size, access
        self.calling, self.done = threading.Event(), threading.Event()
        self.error: BaseException | None = None


class _Granter:
    """cuMemSetAccess costs ~1 ms for tens of GiB and lets go of the GIL while the driver works:
    on a thread, it overlaps the caller's bind (torch wraps a mapped range before its access is
    set). One thread per process, started with the first grant (an engine's `prepare()`), because
    starting a thread per attach costs an attach ~0.1 ms. It holds no mapping: a mapping
    waits for its grant before it unmaps, wherever its last reference goes."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Grant] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, grant: _Grant) -> None:
        """Queue `grant`; wait on `grant.calling` for the thread to be in the driver call, which
        hands the GIL back."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # also: a forked child has none
                self._thread = threading.Thread(target=self._run, name="weightcache-map", daemon=True)
                self._thread.start()
        self._jobs.put(grant)

    def _run(self) -> None:
        while True:
            grant = self._jobs.get()
            grant.calling.set()
            try:
                checked(driver().cuMemSetAccess(grant.ptr, grant.size, grant.access, len(grant.access)),
                        "cuMemSetAccess")
            except BaseException as e:
                grant.error = e
            finally:
                grant.done.set()


_granter = _Granter()


class _Mapping:
    """A reserved + mapped VA range over one allocation handle; unmapped and released on drop.

    `ordinal` and every device in `readers` get access (the readers: read-only, over the GPUs'
    peer link). With `access_meanwhile`, the access is granted by the granter thread while the
    caller goes on; `wait_for_access()` before anything reads the memory."""

    _grant: _Grant | None = None

    def __init__(self, handle: Any, size: int, ordinal: int, writable: bool, owns_handle: bool,
                 readers: Sequence[int] = (), access_meanwhile: bool = False):
        cu = driver()
        self.size, self.ordinal, self._handle, self._owns_handle = size, ordinal, handle, owns_handle
        self.ptr = None
        try:
            self.ptr = checked(cu.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve")
            checked(cu.cuMemMap(self.ptr, size, 0, handle, 0), "cuMemMap")
            self._mapped = True
            access = [_access(ordinal, writable)] + [_access(o, False) for o in sorted(set(readers) - {ordinal})]
            if access_meanwhile:
                grant = _Grant(self.ptr, size, access)
                _granter.submit(grant)
                self._grant = grant  # from here on, release() waits for it
                grant.calling.wait()
            else:
                checked(cu.cuMemSetAccess(self.ptr, size, access, len(access)), "cuMemSetAccess")
        except BaseException:
            self.release()
            raise
        self.readonly = not writable

    def wait_for_access(self) -> None:
        """Until the access is granted; what the driver refused, raised here (every call)."""
        grant = self._grant
        if grant is not None:
            grant.done.wait()
            if grant.error is not None:
                raise grant.error

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.size,), "typestr": "|u1", "data": (int(self.ptr), False), "version": 3, "strides": None}

    def tensor(self) -> "torch.Tensor":
        import torch

        # torch keeps `self` alive through the tensor's deleter: the mapping outlives every view.
        return torch.as_tensor(self, device=f"cuda:{self.ordinal}")

    def release(self) -> None:
        cu = driver()
        if self._grant is not None:  # never unmap under a cuMemSetAccess in flight
            self._grant.done.wait()
        if self.ptr is not None:
            if getattr(self, "_mapped", False):
                cu.cuMemUnmap(self.ptr, self.size)
                self._mapped = False
            cu.cuMemAddressFree(self.ptr, self.size)
            self.ptr = None
        if self._owns_handle and self._handle is not None:
            cu.cuMemRelease(self._handle)
            self._handle = None

    def __del__(self) -> None:
        # A tensor still alive at exit (a lease thread finishing, a module global) drops its
        # mapping during finalization, when a driver call -- which releases the GIL -- is a fatal
        # error. The process is ending and the driver reclaims the mapping with it.
        if sys.is_finalizing():
            return
        try:
            self.release()
        except Exception:
            pass


class CudaArena:
    """A VMM allocation owned by the agent, exported once as a POSIX fd."""

    backend = "cuda"

    def __init__(self, size: int, ordinal: int, uuid: str, fd: int | None = None):
        cu = driver()
        _activate(ordinal)
        self.ordinal, self.uuid = ordinal, uuid
        gran = granularity(ordinal)
        self.size = -(-size // gran) * gran
        self._writer: _Mapping | None = None
        self._reader: _Mapping | None = None  # read-only, for digests
        self._digester: Any = None
        if fd is not None:  # re-adopted from an engine: keep its fd (re-exporting an imported handle fails)
            self.fd = fd
            self._handle = checked(cu.cuMemImportFromShareableHandle(
                fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
            return
        free, total = checked(cu.cuMemGetInfo(), "cuMemGetInfo")
        if self.size > free:
            raise OutOfMemory(f"arena of {self.size / 2**30:.2f} GiB does not fit on GPU {uuid}: "
                              f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB")
        self._handle = checked(cu.cuMemCreate(self.size, _prop(ordinal), 0), "cuMemCreate")
        try:
            self.fd = int(checked(cu.cuMemExportToShareableHandle(
                self._handle, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                "cuMemExportToShareableHandle"))
        except BaseException:
            cu.cuMemRelease(self._handle)
            raise

    def writable_ptr(self) -> int:
        """The device address of a writable mapping of the whole arena for the loader, valid until `seal()`."""
        _activate(self.ordinal)
        if self._writer is None:
            self._writer = _Mapping(self._handle, self.size, self.ordinal, writable=True, owns_handle=False)
        return int(self._writer.ptr)

    def device_tensor(self) -> "torch.Tensor":
        """The same writable mapping as a uint8 tensor (the fill's casts and quantization run on it)."""
        import torch

        torch.cuda.set_device(self.ordinal)  # the fill's streams and kernels run on this device
        self.writable_ptr()
        return self._writer.tensor()

    def copy_from(self, source: "PeerView", nbytes: int) -> None:
        """Fill the first `nbytes` from another GPU's arena mapped for this device (`PeerView`):
        one device-to-device copy over the GPUs' link, through the driver alone (no torch)."""
        cu = driver()
        _activate(self.ordinal)
        writer = _Mapping(self._handle, self.size, self.ordinal, writable=True, owns_handle=False)
        try:
            checked(cu.cuMemcpy(writer.ptr, source.ptr, nbytes), "cuMemcpy (peer copy)")
            checked(cu.cuCtxSynchronize(), "cuCtxSynchronize")
        finally:
            writer.release()

    def seal(self) -> None:
        """Finish pending copies (every stream of the context: the driver's and torch's) and drop the
        agent's writable mapping."""
        if self._writer is not None:
            _activate(self.ordinal)
            checked(driver().cuCtxSynchronize(), "cuCtxSynchronize")
            self._writer.release()
            self._writer = None

    @property
    def segment_bytes(self) -> int:
        from .cuda_digest import CUDA_SEGMENT_BYTES

        return CUDA_SEGMENT_BYTES

    def segments(self) -> int:
        from .digest import segment_count

        return segment_count(self.size, self.segment_bytes)

    def _gpu_digester(self) -> Any:
        """A read-only mapping of the whole arena and the kernel that digests it (arena/cuda_digest.py)."""
        if self._digester is None:
            from .cuda_digest import GpuDigester

            _activate(self.ordinal)
            self._reader = _Mapping(self._handle, self.size, self.ordinal, writable=False, owns_handle=False)
            self._digester = GpuDigester(self.ordinal, int(self._reader.ptr), self.size, driver, checked, _activate)
        return self._digester

    def digest_segment(self, key: bytes, index: int) -> str:
        return self._gpu_digester().segment(key, index)

    def digest(self, key: bytes) -> Any:
        from .cuda_digest import digest_gpu

        return digest_gpu(self._gpu_digester(), key)

    def close(self) -> None:
        cu = driver()
        _activate(self.ordinal)
        self.seal()
        if self._digester is not None:
            self._digester.close()
            self._digester = None
        if self._reader is not None:
            self._reader.release()
            self._reader = None
        if self._handle is not None:
            cu.cuMemRelease(self._handle)
            self._handle = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_readonly_cuda(fd: int, size: int, uuid: str) -> "torch.Tensor":
    """Import an arena fd on the GPU with `uuid` and return it as one read-only uint8 tensor."""
    base, granted = map_readonly_cuda_meanwhile(fd, size, uuid)
    granted()
    return base


def map_readonly_cuda_meanwhile(fd: int, size: int, uuid: str) -> "tuple[torch.Tensor, Callable[[], None]]":
    """`map_readonly_cuda`, with the read access granted on a thread while the caller goes on (an
    engine checks its manifest rows against its module meanwhile). Call the returned function
    before anything reads the memory: it waits, and raises `CudaError` where the driver refused."""
    from .devices import local_ordinal

    cu = driver()
    ordinal = local_ordinal(uuid)
    _activate_torch(ordinal)
    handle = checked(cu.cuMemImportFromShareableHandle(
        fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
    # The mapping owns the imported handle from here on, failed or not.
    mapping = _Mapping(handle, size, ordinal, writable=False, owns_handle=True, access_meanwhile=True)
    return mapping.tensor(), mapping.wait_for_access


class PeerView(_Mapping):
    """Another arena's fd (same node, any GPU), mapped read-only for a list of devices.

    What a replica's agent copies its arena from: the source device and the copying device
    both get read access (peer access over NVLink or PCIe; `CudaError` where the GPUs cannot
    reach each other), so the copy engine of either can pull the bytes. `ptr` is valid until
    `release()`.
    """

    def __init__(self, fd: int, size: int, owner_uuid: str, readers: list[int]):
        from .devices import local_ordinal

        cu = driver()
        owner = local_ordinal(owner_uuid)
        _activate(owner)
        handle = checked(cu.cuMemImportFromShareableHandle(
            fd, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR), "cuMemImportFromShareableHandle")
        super().__init__(handle, size, owner, writable=False, owns_handle=True, readers=readers)
