"""The CUDA device layer: CuPy, compiled kernels and launchers, and the device limits the
kernel choice depends on.

The lowest layer of the CUDA path (it imports no op module): :mod:`kvblocks.ops.cuda_backend`
and :class:`~kvblocks.ops.decode_attention.DecodeAttention` take their launchers and
limits from here and pass them down to the driver. CuPy is imported on first use only, so
CPU installs never import it. Kernels run on torch's current stream, take the tensors'
memory zero-copy (raw device addresses), and each template instantiation is compiled on
first use into the disk cache of :mod:`kvblocks.ops.kernel_cache` (a cubin per
instantiation and architecture, reused by every later process;
:func:`kvblocks.ops.precompile` fills it ahead of time).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from kvblocks.errors import KVBlocksError
from kvblocks.ops import kernel_cache
from kvblocks.ops.cuda_sources import nvrtc_options, read_source
from kvblocks.ops.launch_plan import CTAS_PER_SM, KernelLaunch, Launcher

__all__ = [
    "decode_launcher",
    "decode_target_ctas",
    "device_index",
    "smem_optin",
    "split_k_target_ctas",
    "stream_launcher",
]


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise KVBlocksError(
            "CUDA tensors need CuPy: install kvblocks[cuda12] or kvblocks[cuda13]"
        ) from exc
    return cupy


@functools.cache
def _nvrtc_available() -> bool:
    try:
        from cuda.bindings import nvrtc  # noqa: F401
    except ImportError:
        warnings.warn(
            "cuda-bindings is not installed: kvblocks compiles its kernels through CuPy in "
            "every process (no disk cache); pip install cuda-bindings to cache them",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


@functools.cache
def _arch(device: int) -> str:
    from kvblocks.ops.nvrtc_build import supported_archs

    major, minor = torch.cuda.get_device_capability(device)
    return kernel_cache.arch_for_capability(major, minor, supported_archs())


@functools.cache
def _function(device: int, name: str) -> Any:
    """Load (once per device) the module holding kernel ``name``, from the disk cache
    (:mod:`kvblocks.ops.kernel_cache`), compiling it there on a miss."""
    cupy = _cupy()
    with cupy.cuda.Device(device):
        if _nvrtc_available():
            entry = kernel_cache.get_kernel(name, _arch(device))
            return cupy.RawModule(path=str(entry.path)).get_function(entry.lowered_name)
        # Without cuda-bindings: CuPy's NVRTC, with the headers of CuPy's CUDA version.
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        templated = "<" in name
        module = cupy.RawModule(
            code=read_source(kernel_cache.source_of(name)),
            options=tuple(nvrtc_options(cuda_major=major)),
            name_expressions=[name] if templated else None,
        )
        return module.get_function(name)


@functools.cache
def split_k_target_ctas(device: int) -> int:
    """CTAs that fill ``device`` for the split-K kernel: SMs x ``CTAS_PER_SM``."""
    return torch.cuda.get_device_properties(device).multi_processor_count * CTAS_PER_SM


@functools.cache
def smem_optin(device: int) -> int:
    """Dynamic shared memory one CTA may use on ``device`` after opting in
    (``sharedMemPerBlockOptin``: 227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86/sm_89),
    from torch's device properties, else CuPy's."""
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)
    if not optin:
        optin = _cupy().cuda.runtime.getDeviceProperties(device)["sharedMemPerBlockOptin"]
    return int(optin)


@functools.cache
def decode_target_ctas(device: int, smem_bytes: int) -> int:
    """CTAs of ``decode_attention_kernel`` that fill ``device`` once: SMs x the CTAs whose
    ``smem_bytes`` of shared memory fit an SM (1 KiB reserved per CTA), at most
    ``CTAS_PER_SM`` (2 on H100/A100 at head 128, 1 at head 256)."""
    props = torch.cuda.get_device_properties(device)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 0)
    resident = min(CTAS_PER_SM, per_sm // (smem_bytes + 1024)) if per_sm else CTAS_PER_SM
    return props.multi_processor_count * max(1, resident)


def stream_launcher(device: torch.device) -> Launcher:
    """A launcher on torch's stream current now for ``device`` (one call's launches)."""
    cupy = _cupy()
    index = device_index(device)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream, index)

    def launch(item: KernelLaunch) -> None:
        # RawKernel launches on CuPy's current stream: make it torch's for the call.
        with cupy.cuda.Device(index), stream:
            _function(index, item.name)(
                item.grid, item.block, item.args, shared_mem=item.smem_bytes
            )

    return launch


_STATIC_SMEM_LIMIT = 48 * 1024


def _current_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


@functools.cache
def decode_launcher(index: int) -> Launcher:
    """A launcher for device ``index`` that stays valid across calls (the attention ops
    and :class:`~kvblocks.ops.decode_attention.DecodeAttention` keep it): the stream is
    torch's current one at each launch (so CUDA-graph capture on a side stream works), its
    CuPy wrapper is made once per stream, and a kernel is opted into more than 48 KiB of
    dynamic shared memory once, never past the device's limit."""
    cupy = _cupy()
    device = cupy.cuda.Device(index)
    streams: dict[int, Any] = {}
    opted_in: dict[str, int] = {}

    def launch(item: KernelLaunch) -> None:
        ptr = _current_stream(index)
        stream = streams.get(ptr)
        if stream is None:
            if len(streams) > 64:
                streams.clear()
            stream = streams[ptr] = cupy.cuda.ExternalStream(ptr, index)
        function = _function(index, item.name)
        with device:
            if item.smem_bytes > opted_in.get(item.name, _STATIC_SMEM_LIMIT):
                # Above 48 KiB of dynamic shared memory a kernel must opt in, once, and
                # never past the device's limit (the planner picks a variant that fits).
                if item.smem_bytes > smem_optin(index):
                    raise KVBlocksError(
                        f"{item.name} needs {item.smem_bytes} bytes of shared memory per "
                        f"CTA; device {index} allows {smem_optin(index)}"
                    )
                function.max_dynamic_shared_size_bytes = item.smem_bytes
                opted_in[item.name] = item.smem_bytes
            function(item.grid, item.block, item.args, shared_mem=item.smem_bytes, stream=stream)

    return launch


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of ``device`` (the current device when it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()
