"""A keyed digest of GPU memory, computed by a kernel where the bytes are (no copy to the host, no torch).

Why a kernel of our own: an engine that holds an arena's VMM handle can map it read-write
(the driver cannot share an allocation read-only), so the agent re-reads its arenas on a
schedule, and that must cost well under 1% of the GPU. A keyed hash that reads each byte once
runs at a good fraction of HBM bandwidth; torch's elementwise ops would read and write
temporaries several times over, and the agent serves arenas without importing torch.

The hash, per segment of `CUDA_SEGMENT_BYTES` (s = the segment's index), over p = 2^61 - 1:
- `GRID * BLOCK` threads, each reading the segment's 8-byte words t, t + T, t + 2T, ...
  (coalesced) and feeding both 32-bit halves of each into a polynomial in a secret point r_t
  by Horner's rule: h_t = sum of m_j * r_t^(n-1-j) mod p;
- the segment's value is sum over t of c_t * h_t mod p, with secret coefficients c_t;
- r_t (non-zero) and c_t come from the agent's 256-bit key by splitmix64 over (key word,
  segment, thread): a keyed PRNG, not a cryptographic PRF.
For two different contents of a segment, the values collide for at most (n + 1) / p of the
keys (n: words per thread, 2 * 512 for a 1 GiB segment): about 2^-51, provided the key is
unknown to whoever chose the change. The key never leaves the agent (its 0600 state files
and its own memory), the digests are never sent to a client, and a mismatch replaces the
arena; so an attacker learns at most one bit (caught or not) per attempt. The grid is a
constant, not the device's SM count, so that the same bytes digest the same on any GPU (a
restarted agent checks an arena it did not fill).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

from .digest import ArenaDigest, segment_count, segment_range

CUDA_SEGMENT_BYTES = 1 << 30
CUDA_ALGORITHM = "poly61-keyed-gpu/v1"
GRID = 1024
BLOCK = 256

_SOURCE = r"""
typedef unsigned long long u64;
#define P 0x1FFFFFFFFFFFFFFFULL  /* 2^61 - 1 */

__device__ __forceinline__ u64 reduce(u64 x) {       /* x < 2^62 -> x mod p */
    x = (x & P) + (x >> 61);
    return x >= P ? x - P : x;
}
__device__ __forceinline__ u64 mulmod(u64 a, u64 b) {  /* a, b < p */
    u64 lo = a * b, hi = __umul64hi(a, b);             /* a*b = hi*2^64 + lo < 2^122 */
    return reduce((lo & P) + ((lo >> 61) | (hi << 3))); /* low 61 bits + the rest: 2^61 = 1 mod p */
}
__device__ __forceinline__ u64 mix(u64 z) {            /* splitmix64's finaliser */
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void arena_digest(const u64* __restrict__ words, u64 nwords, u64 segment,
                                        u64 k0, u64 k1, u64 k2, u64 k3, u64* __restrict__ out) {
    __shared__ u64 partial[256];
    const u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    const u64 stream = (segment << 32) | t;
    const u64 r = 1 + mix(mix(k0 ^ stream) ^ k1) % (P - 1);  /* secret point, non-zero */
    const u64 c = mix(mix(k2 ^ stream) ^ k3) % P;            /* secret coefficient */
    u64 h = 0;
    for (u64 i = t; i < nwords; i += stride) {
        const u64 w = words[i];
        h = reduce(mulmod(h, r) + (w & 0xFFFFFFFFULL));
        h = reduce(mulmod(h, r) + (w >> 32));
    }
    partial[threadIdx.x] = mulmod(c, h);
    __syncthreads();
    for (unsigned int half = blockDim.x / 2; half > 0; half >>= 1) {
        if (threadIdx.x < half) partial[threadIdx.x] = reduce(partial[threadIdx.x] + partial[threadIdx.x + half]);
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = partial[0];
}
"""
_P = (1 << 61) - 1

_kernels: dict[int, Any] = {}  # ordinal -> the loaded kernel function
_kernels_lock = threading.Lock()


def _compile(ordinal: int, driver: Callable[[], Any], checked: Callable[..., Any]) -> Any:
    """The kernel for this device: NVRTC to PTX for its compute capability, loaded by the driver."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise RuntimeError("the arena digest needs cuda-bindings' NVRTC: pip install 'weightcache[cuda]'") from e
    cu = driver()
    attr = cu.CUdevice_attribute
    device = checked(cu.cuDeviceGet(ordinal), "cuDeviceGet")
    major = checked(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device), "attr")
    minor = checked(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device), "attr")

    def ok(result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"{what} failed: {err}")
        return values[0] if len(values) == 1 else values

    program = ok(nvrtc.nvrtcCreateProgram(_SOURCE.encode(), b"arena_digest.cu", 0, [], []), "nvrtcCreateProgram")
    options = [f"--gpu-architecture=compute_{major}{minor}".encode(), b"-default-device"]
    try:
        ok(nvrtc.nvrtcCompileProgram(program, len(options), options), "nvrtcCompileProgram")
    except RuntimeError:
        size = ok(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
        text = b" " * size
        ok(nvrtc.nvrtcGetProgramLog(program, text), "nvrtcGetProgramLog")
        raise RuntimeError(f"compiling the arena digest kernel failed: {text.decode(errors='replace')[:2000]}")
    size = ok(nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize")
    ptx = b" " * size
    ok(nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    ok(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
    module = checked(cu.cuModuleLoadData(ptx), "cuModuleLoadData (arena digest)")
    return checked(cu.cuModuleGetFunction(module, b"arena_digest"), "cuModuleGetFunction (arena digest)")


def _kernel(ordinal: int, driver: Callable[[], Any], checked: Callable[..., Any]) -> Any:
    with _kernels_lock:
        if ordinal not in _kernels:
            _kernels[ordinal] = _compile(ordinal, driver, checked)
        return _kernels[ordinal]


class GpuDigester:
    """Digests segments of one device allocation mapped at `ptr` (read access is enough).

    Owns a non-blocking stream and a small device buffer for the per-block sums; one segment per
    call, synchronously (a call is the unit the scrubber paces). `driver`, `checked` and `activate`
    are arena/cuda.py's driver helpers, handed in by it: that module imports this one, not the reverse."""

    def __init__(self, ordinal: int, ptr: int, size: int, driver: Callable[[], Any], checked: Callable[..., Any],
                 activate: Callable[[int], None]):
        self._driver, self._checked, self._activate = driver, checked, activate
        cu = driver()
        activate(ordinal)
        self.ordinal, self.ptr, self.size = ordinal, int(ptr), size
        self._kernel = _kernel(ordinal, driver, checked)
        self._stream = self._checked(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._out = self._checked(cu.cuMemAlloc(GRID * 8), "cuMemAlloc")
        self._host = (ctypes.c_uint64 * GRID)()
        self._lock = threading.Lock()

    def segment(self, key: bytes, index: int) -> str:
        offset, length = segment_range(self.size, CUDA_SEGMENT_BYTES, index)
        k = [int.from_bytes(key[i:i + 8], "little") for i in range(0, 32, 8)]
        cu = self._driver()
        with self._lock:
            self._activate(self.ordinal)  # this thread's current context: the device's primary one
            args = [ctypes.c_uint64(self.ptr + offset), ctypes.c_uint64(length // 8), ctypes.c_uint64(index),
                    *(ctypes.c_uint64(x) for x in k), ctypes.c_uint64(int(self._out))]
            pointers = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
            self._checked(cu.cuLaunchKernel(self._kernel, GRID, 1, 1, BLOCK, 1, 1, 0, self._stream,
                                      ctypes.addressof(pointers), 0), "cuLaunchKernel (arena digest)")
            self._checked(cu.cuMemcpyDtoHAsync(ctypes.addressof(self._host), self._out, GRID * 8, self._stream),
                    "cuMemcpyDtoHAsync")
            self._checked(cu.cuStreamSynchronize(self._stream), "cuStreamSynchronize")
            value = sum(self._host) % _P
        return f"{value:016x}"

    def close(self) -> None:
        cu = self._driver()
        self._activate(self.ordinal)
        cu.cuMemFree(self._out)
        cu.cuStreamDestroy(self._stream)


def digest_gpu(digester: GpuDigester, key: bytes) -> ArenaDigest:
    values = tuple(digester.segment(key, i) for i in range(segment_count(digester.size, CUDA_SEGMENT_BYTES)))
    return ArenaDigest(CUDA_ALGORITHM, digester.size, CUDA_SEGMENT_BYTES, values)
