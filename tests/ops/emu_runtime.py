"""Build and drive the CUDA-emulation library (cuda/emu) from the tests.

The library is g++-compiled once per source hash into ``cuda/emu/build`` (gitignored) and
loaded with ctypes. ``KVB_EMU_FLAVOR=asan`` selects the AddressSanitizer + UBSan build (the
process must then preload libasan; see sanitized_pytest.py). The ``opt`` build instantiates
every kernel, in :data:`SHARDS` units compiled side by side; a sanitizer build only the
attention kernels its tests launch (sanitized_kernels.py), which is most of its compile time
saved.

Why ``opt`` keeps every instantiation: three tests check each one's shared memory against
the host planner's formula, and which ones the other tests launch (110 of 288 attention
kernels when measured, through KVB_EMU_USED_LOG) follows the planner's choices (GQA packing,
pipeline stages, split-K rows, a faked device's limits, an engine's model config), so a
list like the sanitizer builds' would fail on every planner change or new test shape, to
save ~31 of the build's ~61 CPU-s once per source change. Instead, the decode
instantiations no test launches are compiled at -O0 (emu_decode_shards.py: a list that,
stale, costs speed, never a test): 47 -> 32 CPU-s.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import subprocess
import types
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from emu_decode_shards import shard_headers
from sanitized_kernels import entries_header

if TYPE_CHECKING:
    # Annotations only: the background builder (`python emu_runtime.py FLAVOR...`, started
    # by tests/conftest.py in each pytest worker) then never imports kvblocks.ops, and
    # with it torch (about 4 CPU-s a process).
    from kvblocks.ops.launch_plan import KernelLaunch

REPO = Path(__file__).resolve().parents[2]
CUDA_DIR = REPO / "cuda"
EMU_DIR = CUDA_DIR / "emu"
BUILD_DIR = EMU_DIR / "build"

# -g1 (line tables): a sanitizer report names the function, file and line of every frame,
# which is all it uses; full -g (types, variables) nearly doubled the ASan build's CPU time.
# ASan at -O0: the build of its kernels took 27 CPU-s at -O1 and takes 11, and the whole
# ASan test (build and run) 44 -> 30 CPU-s; the instrumentation checks every access at any
# level, and -O0 removes none of them.
# opt's hidden visibility (harness.cpp exports its C API by name): the library's
# thread-locals (the CUDA built-ins, the team and scheduler of the calling OS thread, static
# __shared__ arrays) bind locally, so g++ reaches them by one __tls_get_addr per function
# instead of one per access (a dlopen'ed library cannot use the initial-exec model: its
# __shared__ arrays do not fit the static TLS that is left): the emulation tests ~6% faster.
FLAVOR_FLAGS = {
    "opt": ["-O2", "-fvisibility=hidden"],
    "asan": [
        "-O0",
        "-g1",
        "-fsanitize=address,undefined",
        "-fno-sanitize-recover=undefined",
        "-fno-omit-frame-pointer",
    ],
    "tsan": ["-O1", "-g1", "-fsanitize=thread"],
}


def _sources() -> list[Path]:
    """Every file the harness's g++ units read: the kernels, cuda_emu.h and its parts
    (cuda_emu_*.h), the harness with its self-test kernels (emu/*.cuh), the stand-ins."""
    return sorted(
        [
            *CUDA_DIR.glob("*.cu"),
            *CUDA_DIR.glob("*.cuh"),
            *EMU_DIR.glob("*.h"),
            *EMU_DIR.glob("*.cuh"),
            *EMU_DIR.glob("*.cpp"),
            *(EMU_DIR / "include").glob("*.h"),
        ]
    )


#: Translation units of the full (``opt``) build, compiled in parallel (harness.cpp's
#: KVB_EMU_SHARD): every kernel but the tensor-core decode ones, the decode instantiations
#: the tests launch, and the other decode instantiations (emu_decode_shards.py). One unit
#: took about a minute of one core while both test workers waited for it.
SHARDS = 3
#: Shard 2's optimization level (instead of FLAVOR_FLAGS["opt"]'s -O2): instantiations no
#: test launches, compiled for the shared-memory checks and any launch (which runs slower).
COLD_SHARD_FLAGS = ["-O0"]


def _compile(args: list[str]) -> subprocess.Popen[str]:
    """Start g++ with the harness's common options and ``args``; :func:`_wait` for it."""
    cmd = [
        os.environ.get("CXX", "g++"), "-std=c++17", "-fPIC", "-pthread", "-fno-strict-aliasing",
        "-Wall", "-Wno-unknown-pragmas", "-Werror", f"-I{EMU_DIR / 'include'}", f"-I{EMU_DIR}",
        *args,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(process: subprocess.Popen[str]) -> None:
    """Wait for a :func:`_compile`; a failure raises with g++'s output."""
    output, _ = process.communicate()
    if process.returncode != 0:
        raise subprocess.CalledProcessError(process.returncode, process.args, output)


def _compile_shards(flags: list[str], decode: tuple[str, str], out: Path) -> None:
    """The harness's :data:`SHARDS` units compiled side by side, linked into ``out`` (shard 0
    first: the linker keeps the first copy of an inline function, its -O2 one); ``decode``:
    the entries of the launched and of the other decode instantiations (shard_headers())."""
    objects = [out.with_suffix(f".shard{k}.o") for k in range(SHARDS)]
    hot, cold = decode
    per_shard: list[list[str]] = [flags]
    for k, (header, level) in enumerate([(hot, flags), (cold, COLD_SHARD_FLAGS)], start=1):
        path = out.with_suffix(f".shard{k}.h")
        path.write_text(header)
        per_shard.append([*level, f'-DKVB_EMU_DECODE_ENTRIES="{path}"'])
    units = [
        _compile([*f, f"-DKVB_EMU_SHARD={k}", "-c", str(EMU_DIR / "harness.cpp"), "-o", str(o)])
        for k, (f, o) in enumerate(zip(per_shard, objects, strict=True))
    ]
    try:
        for unit in units:
            _wait(unit)
        _wait(_compile(["-shared", *map(str, objects), "-o", str(out)]))
    finally:
        for unit in units:
            if unit.poll() is None:
                unit.kill()
                unit.wait()
        for o in objects:
            o.unlink(missing_ok=True)
            o.with_suffix(".h").unlink(missing_ok=True)


def build_library(flavor: str) -> Path:
    """Compile the harness (if its sources changed) and return the shared library path."""
    flags = FLAVOR_FLAGS[flavor]
    header = entries_header(flavor)  # None: every instantiation
    digest = hashlib.sha256(f"{' '.join(flags)} shards {SHARDS}".encode())
    for path in _sources():
        digest.update(path.name.encode() + path.read_bytes())
    if header is None:  # the sharded opt build: its decode lists and the cold level too
        decode = shard_headers()
        digest.update(" ".join([*COLD_SHARD_FLAGS, *decode]).encode())
    else:
        digest.update(header.encode())
        entries = BUILD_DIR / f"entries_{flavor}.h"
        flags = [*flags, f'-DKVB_EMU_ENTRIES="{entries}"', f'-DKVB_EMU_SELECTION="{flavor}"']
    target = BUILD_DIR / f"libkvb_emu_{flavor}_{digest.hexdigest()[:16]}.so"
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    # One build per flavor even with concurrent test processes; a lock per flavor, so a
    # test waiting for one flavor never waits behind another's build.
    with open(BUILD_DIR / f".lock-{flavor}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.exists():
            if header is not None:
                entries.write_text(header)
            tmp = target.with_suffix(f".{os.getpid()}.tmp")
            if header is None:
                _compile_shards(flags, decode, tmp)
            else:
                _wait(_compile([*flags, "-shared", str(EMU_DIR / "harness.cpp"), "-o", str(tmp)]))
            tmp.rename(target)
            for stale in BUILD_DIR.glob(f"libkvb_emu_{flavor}_*.so"):
                if stale != target:
                    stale.unlink()  # a loaded copy stays mapped; only the file goes
    return target


@functools.cache
def library(flavor: str | None = None) -> ctypes.CDLL:
    """The loaded emulation library (flavor from ``KVB_EMU_FLAVOR``, default ``opt``)."""
    lib = ctypes.CDLL(str(build_library(flavor or os.environ.get("KVB_EMU_FLAVOR", "opt"))))
    lib.kvb_emu_launch.restype = ctypes.c_int
    lib.kvb_emu_launch.argtypes = [
        ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
        ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_void_p),
    ]  # fmt: skip
    lib.kvb_emu_smem_bytes.restype = ctypes.c_int
    lib.kvb_emu_smem_bytes.argtypes = [ctypes.c_char_p]
    return lib


def emu_launch(launch: KernelLaunch) -> None:
    """Run one planned launch on CPU threads (the arguments' addresses are host memory)."""
    # Imported here: `make test-fast` starts this module's build before pip has installed
    # numpy (Makefile, WARM_EMULATOR).
    import numpy as np

    lib = library()
    # Each argument lives in its own NumPy buffer; the kernel reads it through a pointer.
    holders = [np.array([arg]) for arg in launch.args]
    ptrs = (ctypes.c_void_p * len(holders))(*[h.ctypes.data for h in holders])
    grid = (ctypes.c_uint * 3)(*launch.grid)
    block = (ctypes.c_uint * 3)(*launch.block)
    rc = lib.kvb_emu_launch(launch.name.encode(), grid, block, launch.smem_bytes, ptrs)
    if rc != 0:
        raise LookupError(f"the emulation harness has no kernel {launch.name!r}")


@dataclass(frozen=True)
class DeviceLimits:
    """The limits of one GPU model that the CUDA backend reads (torch's device properties),
    for a stand-in device whose kernels run on the emulator."""

    name: str
    capability: tuple[int, int]
    sms: int
    smem_per_sm: int
    smem_optin: int
    """``sharedMemPerBlockOptin``: dynamic shared memory one CTA may opt into."""

    def properties(self, sms: int | None = None) -> types.SimpleNamespace:
        """What ``torch.cuda.get_device_properties`` returns for it (``sms`` overrides the
        SM count, e.g. 1 to force split-K on small batches)."""
        return types.SimpleNamespace(
            name=self.name,
            major=self.capability[0],
            minor=self.capability[1],
            multi_processor_count=self.sms if sms is None else sms,
            shared_memory_per_multiprocessor=self.smem_per_sm,
            shared_memory_per_block_optin=self.smem_optin,
        )


DEVICES = {
    "8.0": DeviceLimits("NVIDIA A100-SXM4-80GB", (8, 0), 108, 167936, 166912),
    "8.6": DeviceLimits("NVIDIA A10", (8, 6), 72, 102400, 101376),
    "8.9": DeviceLimits("NVIDIA L40S", (8, 9), 142, 102400, 101376),
    "9.0": DeviceLimits("NVIDIA H100 80GB HBM3", (9, 0), 132, 233472, 232448),
}
"""CUDA's per-SM and per-CTA shared-memory limits by compute capability (the CUDA C
Programming Guide's table of technical specifications)."""


def clear_backend_caches() -> None:
    """Forget the CUDA backend's per-device state (compiled launchers, device properties,
    cached decode plans): around a test that fakes a device, so no other test's fake
    device (or none) leaks into it."""
    from kvblocks.ops import cuda_device, kernel_driver

    cuda_device._function.cache_clear()
    cuda_device._arch.cache_clear()
    cuda_device.split_k_target_ctas.cache_clear()
    cuda_device.smem_optin.cache_clear()
    cuda_device.decode_launcher.cache_clear()
    cuda_device.decode_target_ctas.cache_clear()
    kernel_driver._DECODERS.clear()


def recording(launches: list[KernelLaunch]):
    """A launcher that runs each launch at once (workspaces die with the call) and logs it."""

    def launch(item: KernelLaunch) -> None:
        launches.append(item)
        emu_launch(item)

    return launch


if __name__ == "__main__":
    # `python emu_runtime.py asan tsan`: build those flavors (the test session starts this
    # in the background, see tests/conftest.py).
    import sys

    for name in sys.argv[1:]:
        build_library(name)
