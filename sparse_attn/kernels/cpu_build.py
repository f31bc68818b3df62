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

from sparse_attn import settings

SOURCE = Path(__file__).resolve().parent / "csrc" / "skip_attn_cpu.cpp"
#: Headers the source includes (part of the cache key).
HEADERS = ("sa_simd.h", "sa_kernels.h", "sa_bf16.h", "sa_amx.h")
#: The C ABI (``kAbiVersion`` in the source); :class:`SaCall` and the tile sizes are checked
#: against the library's own ``sa_layout`` when it is opened.
ABI_VERSION = 7
#: Seconds one compile may take before it is abandoned (measured: ~7 s of CPU time with g++ 12).
COMPILE_TIMEOUT_S = 600
# -O2, not -O3: the micro-kernels carry their own unroll pragmas, so -O3 bought nothing
# (prefill 2k, 9/3/64 heads: 78 ms at -O2 vs 83 ms at -O3) and cost 9.3 s of CPU time to
# compile instead of 7.1 s (g++ 12.2; the portable build: 13.8 s vs 7.2 s).
_BASE_FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-fno-math-errno", "-Wno-psabi")


class SaCall(ctypes.Structure):
    """Mirror of ``struct SaCall`` in csrc/skip_attn_cpu.cpp (same order, same C types); :func:`_open`
    compares its size and every field offset with the library's ``sa_layout``."""

    _fields_ = [
        ("abi", ctypes.c_int32), ("dtype", ctypes.c_int32), ("kv_dtype", ctypes.c_int32),
        ("num_seqs", ctypes.c_int32), ("num_q_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32), ("page_size", ctypes.c_int32),
        ("causal", ctypes.c_int32), ("window", ctypes.c_int32), ("split_tiles", ctypes.c_int32),
        ("num_threads", ctypes.c_int32), ("num_counts", ctypes.c_int32), ("bt_is64", ctypes.c_int32),
        ("sl_is64", ctypes.c_int32), ("qsl_is64", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32), ("bt_cols", ctypes.c_int32),
        ("scale", ctypes.c_float), ("soft_cap", ctypes.c_float), ("v_scale", ctypes.c_float),
        ("q", ctypes.c_void_p), ("q_st", ctypes.c_int64), ("q_sh", ctypes.c_int64), ("q_sd", ctypes.c_int64),
        ("out", ctypes.c_void_p), ("o_st", ctypes.c_int64), ("o_sh", ctypes.c_int64), ("o_sd", ctypes.c_int64),
        ("k", ctypes.c_void_p), ("k_sb", ctypes.c_int64), ("k_st", ctypes.c_int64), ("k_sh", ctypes.c_int64),
        ("k_sd", ctypes.c_int64),
        ("v", ctypes.c_void_p), ("v_sb", ctypes.c_int64), ("v_st", ctypes.c_int64), ("v_sh", ctypes.c_int64),
        ("v_sd", ctypes.c_int64),
        ("bt", ctypes.c_void_p), ("bt_s0", ctypes.c_int64), ("bt_s1", ctypes.c_int64),
        ("seq_lens", ctypes.c_void_p), ("qsl", ctypes.c_void_p), ("sl_s", ctypes.c_int64), ("qsl_s", ctypes.c_int64),
        ("lam", ctypes.c_void_p), ("count_lam", ctypes.c_void_p),
        ("sink_logits", ctypes.c_void_p), ("skipped", ctypes.c_void_p), ("visited", ctypes.c_void_p),
        ("counters", ctypes.c_void_p),
    ]


#: ``sa_forward``'s return codes (``kOk`` .. in the source) -> what went wrong.
RETURN_CODES = {1: "the CPU lacks the ISA the library was built for", 2: "bad call (ABI, dtype, head or page size)",
                3: "out of memory", 4: "a block id outside the cache", 5: "a block table too narrow for a sequence"}
BAD_BLOCK_ID, BAD_BLOCK_TABLE = 4, 5


class CpuKernelUnavailable(RuntimeError):
    """The compiled CPU kernel cannot be built or loaded here; the message says why and how to fix it."""


@dataclass(frozen=True)
class Built:
    """A loaded kernel library: the ctypes handle, its target ISA (one of :data:`ISAS`),
    where it lives, and whether this process compiled it (``build_s`` seconds) or found it in
    the cache (``build_s`` None)."""

    lib: ctypes.CDLL
    target: str
    path: Path
    build_s: float | None


#: Build targets, widest first: ``amx`` (``avx512bf16`` plus AMX-BF16 tiles for the pair products, where the OS
#: grants them: csrc/sa_amx.h), ``avx512bf16`` (``avx512`` plus AVX512-BF16 dot products for the Q.K^T and P.V
#: of a bf16 cache's items of 16 rows or more, i.e. prefill: csrc/sa_bf16.h; every other item is the ``avx512``
#: code), ``avx512`` (AVX2 + FMA + F16C + AVX-512F: 512-bit matrix micro-kernels, outputs bit-identical to
#: ``avx2``), ``avx2``, ``generic`` (the same code on GCC/Clang vector types the compiler lowers).
#: The names are ``SPARSE_ATTN_CPU_ISA``'s choices less ``auto``: one list, which the setting owns.
ISAS: tuple[str, ...] = tuple(choice for choice in settings.CPU_ISA_CHOICES if choice != "auto")
_BF16_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16"}
_ISA_CPU_FLAGS = {"amx": _BF16_FLAGS | {"amx_tile", "amx_bf16"}, "avx512bf16": _BF16_FLAGS,
                  "avx512": {"avx2", "fma", "f16c", "avx512f"}, "avx2": {"avx2", "fma", "f16c"}, "generic": set()}


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty off Linux x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    try:
        return set(next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")), []))
    except OSError:
        return set()


def supported_isas() -> list[str]:
    """The build targets this CPU runs, widest first (``generic`` always)."""
    flags = cpu_flags()
    return [isa for isa in ISAS if _ISA_CPU_FLAGS[isa] <= flags]


def cpu_isa() -> str:
    """The target the compiled kernel is built for: ``SPARSE_ATTN_CPU_ISA`` where set (``auto`` or unset: the
    widest this CPU runs, :func:`supported_isas`). A pinned ISA this CPU lacks is refused here, with the ones it
    has, rather than at the first call."""
    pinned = settings.get("SPARSE_ATTN_CPU_ISA")
    have = supported_isas()
    if pinned in (None, "", "auto"):
        return have[0]
    if pinned not in have:
        raise CpuKernelUnavailable(f"SPARSE_ATTN_CPU_ISA={pinned}: this CPU runs {', '.join(have)}, not {pinned}. Fix: "
                                   f"set SPARSE_ATTN_CPU_ISA to one of those, or unset it (auto: {have[0]})")
    return pinned


def isa_flags(isa: str, profile: bool = False) -> tuple[str, ...]:
    """The compiler flags of build target ``isa`` (one of :data:`ISAS`; any other name is a KeyError, so that a
    target added to the setting cannot silently compile as ``generic``)."""
    bf16 = ("-DSA_AVX2", "-DSA_AVX512", "-DSA_BF16DP", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw",
            "-mavx512bf16")
    flags = {"amx": bf16 + ("-DSA_AMX", "-mamx-tile", "-mamx-bf16"), "avx512bf16": bf16,
             "avx512": ("-DSA_AVX2", "-DSA_AVX512", "-mavx2", "-mfma", "-mf16c", "-mavx512f"),
             "avx2": ("-DSA_AVX2", "-mavx2", "-mfma", "-mf16c"), "generic": ()}[isa]
    return flags + (("-DSA_PROFILE",) if profile else ())


def cache_dir() -> Path:
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


#: The order in which ``sa_layout`` reports the slots of ``SaCall.counters`` (``kernels.batch.COUNTER_SLOTS``).
COUNTER_SLOT_ORDER = ("skipped", "visited", "launches", "dense_launches", "v_tested", "v_skipped")


def expected_layout() -> list[int]:
    """What ``sa_layout`` must report: ABI, ``sizeof(SaCall)``, field count, TILE_Q, TILE_K,
    every field's offset, then the counters' slots, all from this side (:class:`SaCall`, ``_common``,
    ``COUNTER_SLOTS``)."""
    from ._common import TILE_K, TILE_Q
    from .batch import COUNTER_SLOTS

    offsets = [getattr(SaCall, name).offset for name, _ in SaCall._fields_]
    return [ABI_VERSION, ctypes.sizeof(SaCall), len(SaCall._fields_), TILE_Q, TILE_K, *offsets,
            *(COUNTER_SLOTS[name] for name in COUNTER_SLOT_ORDER)]


def check_layout(lib: ctypes.CDLL, path: Path) -> None:
    """Refuse a library whose ABI, ``SaCall`` layout or tile sizes differ from this package's."""
    if not hasattr(lib, "sa_layout"):
        raise CpuKernelUnavailable(f"{path} predates sa_layout (ABI < 4), expected ABI {ABI_VERSION}. Fix: delete it; "
                                   f"the next use rebuilds it")
    lib.sa_layout.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.sa_layout.restype = ctypes.c_int
    want = expected_layout()
    buf = (ctypes.c_int64 * (len(want) + 8))()
    n = lib.sa_layout(buf, len(buf))
    got = list(buf[:min(n, len(buf))])
    if got == want:
        return
    names = ["ABI", "sizeof(SaCall)", "SaCall field count", "TILE_Q", "TILE_K"] \
        + [f"offset of SaCall.{name}" for name, _ in SaCall._fields_] \
        + [f"the counters' {name!r} slot (kernels.batch.COUNTER_SLOTS)" for name in COUNTER_SLOT_ORDER]
    diff = next((i for i in range(max(len(got), len(want))) if i >= len(got) or i >= len(want) or got[i] != want[i]))
    what = names[diff] if diff < len(names) else "an extra layout value"
    seen = got[diff] if diff < len(got) else "nothing"
    expected = want[diff] if diff < len(want) else "nothing"
    raise CpuKernelUnavailable(
        f"{path} does not match this package's C contract: {what} is {seen} in the library, {expected} in "
        f"cpu_build.SaCall / kernels._common. Fix: keep csrc/skip_attn_cpu.cpp's struct SaCall, cpu_build.SaCall "
        f"and the tile sizes in step (bump ABI_VERSION and kAbiVersion together), then delete {path} so it rebuilds")


def _open(path: Path, isa: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    if lib.sa_abi_version() != ABI_VERSION:
        raise CpuKernelUnavailable(f"{path} has ABI {lib.sa_abi_version()}, expected {ABI_VERSION}. Fix: delete it; "
                                   f"the next use rebuilds it")
    check_layout(lib, path)
    lib.sa_isa.restype = ctypes.c_char_p
    if lib.sa_isa().decode() != isa:
        raise CpuKernelUnavailable(f"{path} was built for {lib.sa_isa().decode()}, expected {isa}; delete it")
    lib.sa_tiles.argtypes = []
    lib.sa_tiles.restype = ctypes.c_int
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
