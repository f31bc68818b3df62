"""Compile the CPU kernel (``csrc/skip_attn_cpu.cpp``) once, into a cache shared by processes.

The library is plain C++ with a C ABI (no torch headers), compiled with the system C++
compiler (``CXX``, else ``c++`` / ``g++`` / ``clang++`` on ``PATH``) into

    <cache>/sparse_attn_cpu-<key>.so,   key = sha256(source, flags, torch version, ISA, machine)

where ``<cache>`` is ``SPARSE_ATTN_CPU_KERNEL_CACHE`` or ``$XDG_CACHE_HOME/sparse-attn`` (default
``~/.cache/sparse-attn``).  Concurrent first uses (several vLLM workers) are safe: builders
take an ``flock`` on ``<key>.lock`` (released by the kernel if a builder dies), compile into a
private temporary file and ``os.replace`` it into place, so a reader never sees a partial
library and a killed build leaves at most its own ``.tmp`` file, which the next build removes.

:func:`load` returns the loaded library or raises :class:`CpuKernelUnavailable` saying why
(no compiler, compile error, unwritable cache, CPU lacks the ISA); the caller decides whether
that is a warning (``SPARSE_ATTN_CPU_KERNEL=auto``) or an error (``=compiled``).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "skip_attn_cpu.cpp"
#: Headers the source includes (part of the cache key).
HEADERS = ("sa_simd.h", "sa_kernels.h")
ABI_VERSION = 3
#: Seconds one compile may take before it is abandoned (measured: ~7 s of CPU time with g++ 12).
COMPILE_TIMEOUT_S = 600
# -O2, not -O3: the micro-kernels carry their own unroll pragmas, so -O3 bought nothing
# (prefill 2k, 9/3/64 heads: 78 ms at -O2 vs 83 ms at -O3) and cost 9.3 s of CPU time to
# compile instead of 7.1 s (g++ 12.2; the portable build: 13.8 s vs 7.2 s).
_BASE_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wno-psabi")


class CpuKernelUnavailable(RuntimeError):
    """The compiled CPU kernel cannot be built or loaded here; the message says why and how to fix it."""


@dataclass(frozen=True)
class Built:
    """A loaded kernel library: the ctypes handle, its target ISA (``avx2`` / ``generic``),
    where it lives, and whether this process compiled it (``build_s`` seconds) or found it in
    the cache (``build_s`` None)."""

    lib: ctypes.CDLL
    target: str
    path: Path
    build_s: float | None


def cpu_isa() -> str:
    """``avx2`` when this CPU has AVX2 + FMA + F16C (x86-64), else ``generic`` (the same code
    on an 8-float struct the compiler vectorises itself)."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        try:
            flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                          if line.startswith("flags")), [])
        except OSError:
            flags = []
        if {"avx2", "fma", "f16c"} <= set(flags):
            return "avx2"
    return "generic"


def isa_flags(isa: str, profile: bool = False) -> tuple[str, ...]:
    flags = ("-DSA_AVX2", "-mavx2", "-mfma", "-mf16c") if isa == "avx2" else ()
    return flags + (("-DSA_PROFILE",) if profile else ())


def cache_dir() -> Path:
    from sparse_attn import settings

    configured = settings.get("SPARSE_ATTN_CPU_KERNEL_CACHE")
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparse-attn"


def compiler() -> str | None:
    """The compiler command: ``CXX`` when set (used as given, even if it does not exist: the
    build then fails and says so), else the first of ``c++``, ``g++``, ``clang++`` on PATH."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        return cxx
    return next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def cache_key(isa: str, profile: bool = False) -> str:
    h = hashlib.sha256()
    sources = [SOURCE.read_bytes()] + [(SOURCE.parent / name).read_bytes() for name in HEADERS]
    for part in (*sources, " ".join(_BASE_FLAGS + isa_flags(isa, profile)).encode(), torch.__version__.encode(),
                 isa.encode(), platform.machine().encode(), str(ABI_VERSION).encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:16]


def _open(path: Path, isa: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.sa_abi_version() != ABI_VERSION:
        raise CpuKernelUnavailable(f"{path} has ABI {lib.sa_abi_version()}, expected {ABI_VERSION}; delete it")
    lib.sa_isa.restype = ctypes.c_char_p
    if lib.sa_isa().decode() != isa:
        raise CpuKernelUnavailable(f"{path} was built for {lib.sa_isa().decode()}, expected {isa}; delete it")
    lib.sa_forward.argtypes = [ctypes.c_void_p]
    lib.sa_forward.restype = ctypes.c_int
    lib.sa_exp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.sa_exp.restype = None
    lib.sa_tanh.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.sa_tanh.restype = None
    lib.sa_profile.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.sa_profile.restype = None
    return lib


def _compile(cxx: str, isa: str, profile: bool, dest: Path) -> None:
    cmd = [*cxx.split(), *_BASE_FLAGS, *isa_flags(isa, profile), str(SOURCE), "-o", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except FileNotFoundError:
        raise CpuKernelUnavailable(f"C++ compiler {cxx!r} not found") from None
    except subprocess.TimeoutExpired:
        raise CpuKernelUnavailable(f"compiling with {cxx!r} took over {COMPILE_TIMEOUT_S} s") from None
    if proc.returncode:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise CpuKernelUnavailable(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): {' | '.join(tail)}")


_lock = threading.Lock()


def load(isa: str | None = None, profile: bool = False) -> Built:
    """The kernel library for ``isa`` (default: this CPU's), from the cache or compiled now;
    ``profile``: the variant that times its phases (``sa_profile``).  Raises
    :class:`CpuKernelUnavailable`."""
    isa = isa or cpu_isa()
    key = cache_key(isa, profile)
    root = cache_dir()
    final = root / f"sparse_attn_cpu-{key}{'-profile' if profile else ''}.so"
    with _lock:
        if final.exists():
            return Built(_open(final, isa), isa, final, None)
        cxx = compiler()
        if cxx is None:
            raise CpuKernelUnavailable("no C++ compiler found (CXX unset; no c++, g++ or clang++ on PATH)")
        try:
            root.mkdir(parents=True, exist_ok=True)
            lock_fd = os.open(root / f"sparse_attn_cpu-{key}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as exc:
            raise CpuKernelUnavailable(f"cache directory {root} is not writable ({exc})") from None
        try:
            import fcntl

            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another process may be building this key
            if final.exists():
                return Built(_open(final, isa), isa, final, None)
            for stale in glob.glob(str(root / f".sparse_attn_cpu-{key}.*.tmp")):  # a killed build's leftovers
                try:
                    os.unlink(stale)
                except OSError:
                    pass
            fd, tmp = tempfile.mkstemp(prefix=f".sparse_attn_cpu-{key}.", suffix=".tmp", dir=root)
            os.close(fd)
            t0 = time.perf_counter()
            try:
                _compile(cxx, isa, profile, Path(tmp))
                os.replace(tmp, final)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            return Built(_open(final, isa), isa, final, time.perf_counter() - t0)
        finally:
            os.close(lock_fd)  # releases the flock
