"""The CUDA runtime library through ctypes, for what the GPU runners do outside their graphs: copies between state
slots (onnxruntime's and Polygraphy's Python APIs copy whole buffers only), pinned host memory, device attributes.

The library is the one onnxruntime-gpu (or TensorRT) has loaded, so no CUDA toolkit is needed beside them.
"""

from __future__ import annotations

import ctypes
import functools
import weakref

import numpy as np

from mambatrt.errors import BundleError

_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so", "cudart64_13.dll", "cudart64_12.dll")
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: either way, by the pointers
MEMCPY_DEVICE_TO_HOST = 2
MEMCPY_DEVICE_TO_DEVICE = 3

_P, _I, _U, _S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
_SIGNATURES = {
    "cudaMemcpy": [_P, _P, _S, _I],
    "cudaMemset": [_P, _I, _S],
    "cudaMemcpyAsync": [_P, _P, _S, _I, _P],
    "cudaMemcpy2D": [_P, _S, _P, _S, _S, _S, _I],
    "cudaMemset2D": [_P, _S, _I, _S, _S],
    "cudaDeviceSynchronize": [],
    "cudaStreamSynchronize": [_P],
    "cudaHostAlloc": [ctypes.POINTER(_P), _S, _U],
    "cudaFreeHost": [_P],
    "cudaGetDevice": [ctypes.POINTER(_I)],
    "cudaGetDeviceCount": [ctypes.POINTER(_I)],
    "cudaDeviceGetAttribute": [ctypes.POINTER(_I), _I, _I],
    "cudaEventCreateWithFlags": [ctypes.POINTER(_P), _U],
    "cudaEventSynchronize": [_P],
    "cudaEventRecord": [_P, _P],
}


@functools.cache
def cudart():
    """The CUDA runtime library with the signatures of the functions used here; BundleError when none is found."""
    for name in _NAMES:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        for function, argtypes in _SIGNATURES.items():
            getattr(lib, function).argtypes = argtypes
            getattr(lib, function).restype = ctypes.c_int
        return lib
    raise BundleError("running on CUDA needs the CUDA runtime library (libcudart) that onnxruntime-gpu uses; not found")


def check(status: int, what: str) -> None:
    """Raise when a CUDA runtime call failed (a bug or a broken device, not a user's error)."""
    if status != 0:
        raise RuntimeError(f"{what} failed (CUDA error {status})")


def device_count() -> int:
    """GPUs the CUDA runtime sees (0 where there is no runtime library or driver)."""
    try:
        lib = cudart()
    except BundleError:
        return 0
    count = ctypes.c_int(0)
    return count.value if lib.cudaGetDeviceCount(ctypes.byref(count)) == 0 else 0


def device_attribute(attribute: int) -> int:
    """An attribute of the current device (cudaDeviceGetAttribute), 0 when the runtime cannot say."""
    lib = cudart()
    device, value = ctypes.c_int(0), ctypes.c_int(0)
    if lib.cudaGetDevice(ctypes.byref(device)) != 0:
        return 0
    if lib.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device.value) != 0:
        return 0
    return value.value


def compute_major() -> int:
    """The current device's compute capability major (0 when the runtime cannot say)."""
    return device_attribute(75)  # cudaDevAttrComputeCapabilityMajor


def sm_count() -> int:
    """The current device's SMs (0 when the runtime cannot say)."""
    return device_attribute(16)  # cudaDevAttrMultiProcessorCount


def pinned(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 host array in pinned (page-locked) memory: a state copies into it in one DMA, with no page faults;
    freed with the array. Pageable numpy memory when CUDA cannot pin it."""
    n = int(np.prod(shape))
    ptr = ctypes.c_void_p()
    lib = cudart()
    if n == 0 or lib.cudaHostAlloc(ctypes.byref(ptr), 4 * n, 0) != 0:
        return np.empty(shape, np.float32)
    buffer = (ctypes.c_float * n).from_address(ptr.value)
    # freed when the last view of it is gone; not at exit, where the process's memory goes anyway
    weakref.finalize(buffer, lib.cudaFreeHost, ptr.value).atexit = False
    return np.ctypeslib.as_array(buffer).reshape(shape)


def copy(dst: int, src: int, nbytes: int) -> None:
    """A synchronous copy between any two addresses (host or device)."""
    check(cudart().cudaMemcpy(dst, src, nbytes, MEMCPY_DEFAULT), "cudaMemcpy")


def copy2d(dst: tuple[int, int], src: tuple[int, int], width: int, height: int) -> None:
    """A 2-D copy of ``height`` pieces of ``width`` bytes between two (address, pitch) places."""
    check(cudart().cudaMemcpy2D(dst[0], dst[1], src[0], src[1], width, height, MEMCPY_DEFAULT), "cudaMemcpy2D")


def new_event(timing: bool = False) -> ctypes.c_void_p:
    """A new CUDA event (without timing: cheaper to record and wait for)."""
    event = ctypes.c_void_p()
    check(cudart().cudaEventCreateWithFlags(ctypes.byref(event), 0 if timing else 2), "cudaEventCreateWithFlags")
    return event


class DeviceRow:
    """One row of :class:`DeviceRows`: a device address (a cached state that stays on the GPU)."""

    __slots__ = ("address",)

    def __init__(self, address: int) -> None:
        self.address = address


class DeviceRows:
    """Rows of float32 arrays of ``shape`` in one device buffer (kept alive here); ``rows[i]`` is row i's
    :class:`DeviceRow`."""

    def __init__(self, buffer, base: int, shape: tuple[int, ...]) -> None:
        self.buffer = buffer  # keeps the memory
        self.base, self.row_bytes = base, 4 * int(np.prod(shape))

    def __getitem__(self, i: int) -> DeviceRow:
        return DeviceRow(self.base + i * self.row_bytes)
