"""What the machine computes natively: ISA flags, bf16 support, and a description that keys calibration caches.

CPUs of one cloud machine kind differ (AVX-512 with native bf16 on one, AVX2 only on another), and what wins on one
loses on the other. The environment variables that limit the ISA (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS) are honoured, so an AVX-512 machine told to behave like an AVX2 one is described as one
(fbgemm, w8a8's kernel there, reads only its own: FBGEMM_ENABLE_INSTRUCTIONS=AVX2).
"""

from __future__ import annotations

import functools
import os
import platform

import torch

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
AMX_FLAGS = frozenset({"amx_bf16", "amx_tile"})  # tile units that multiply bf16
# oneDNN ISA names below AVX-512, and below its first ISA with native bf16 (AVX512_CORE_BF16): a limit to one of these
# turns those off.
ONEDNN_BELOW_AVX512 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2")
ONEDNN_BELOW_BF16 = ONEDNN_BELOW_AVX512 + ("AVX512_CORE", "AVX512_CORE_VNNI")
ONEDNN_BELOW_AMX = ONEDNN_BELOW_BF16 + ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset]:
    """(model name, flags) from /proc/cpuinfo; ('', {}) where there is none (macOS, Windows)."""
    name, flags = platform.processor() or platform.machine(), frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name in ("", platform.machine()):
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = frozenset(value.split())
    except OSError:
        pass
    return name, flags


def cpu_flags() -> frozenset:
    """The ISA flags this process may use: the CPU's, less what the environment turns off."""
    flags = set(_cpuinfo()[1]) & set(ISA_FLAGS)
    capability = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    if capability in ("avx2", "default") or onednn in ONEDNN_BELOW_AVX512:
        flags -= {f for f in flags if f.startswith(("avx512", "amx"))}
    if onednn in ONEDNN_BELOW_BF16:
        flags -= set(BF16_FLAGS) | {"amx_tile"}
    if onednn in ONEDNN_BELOW_AMX:
        flags -= AMX_FLAGS
    if capability == "default":
        flags -= {"avx2", "fma"}
    return frozenset(flags)


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """bf16 matmuls at hardware speed: any CUDA GPU from Ampere on; a CPU with AVX512-BF16 or AMX. Elsewhere bf16 is
    emulated and slower than fp32 (an AVX2 CPU: a 16-node verify in bf16 cost 6-7 one-token steps)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(cpu_flags() & set(BF16_FLAGS))


def amx(device: torch.device | str = "cpu") -> bool:
    """A CPU with tile units for bf16 (AMX), usable here: inductor's C++ GEMM template multiplies bf16 and int8 on
    them (weight-only int8 and int4 one-token steps are faster without them: docs/engines.md)."""
    return torch.device(device).type == "cpu" and AMX_FLAGS <= cpu_flags()


def amx_held_back() -> bool:
    """A CPU with AMX whose environment turns it off (ONEDNN_MAX_CPU_ISA below AMX, torch's AVX2 kernels): oneDNN and
    medusa honour the limit, but inductor's C++ GEMM template reads the CPU itself and would still multiply on the
    tile units, so what is compiled would not be what such a CPU without AMX runs."""
    return AMX_FLAGS <= _cpuinfo()[1] and not amx("cpu")


def vector_int4(device: torch.device | str = "cpu") -> bool:
    """aten's int4 weight-only kernel at vector speed: on bf16 activations (a CPU with native bf16) under torch's
    AVX-512 kernels. Under its AVX2 ones, or on fp32 activations, it is a reference loop (docs/engines.md)."""
    device = torch.device(device)
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX512" and native_bf16(device)


def vector_int8_gemm(device: torch.device | str = "cpu") -> bool:
    """inductor's int8 x int8 GEMM template (w8a8's compiled verify) at vector speed: it is written for AVX512-VNNI,
    under torch's AVX-512 kernels; elsewhere inductor hands each GEMM to oneDNN, which costs tens of microseconds a
    call (docs/engines.md)."""
    device = torch.device(device)
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() == "AVX512" and "avx512_vnni" in cpu_flags()


def w8a8_kernel(device: torch.device | str = "cpu") -> str | None:
    """What computes w8a8's integer sums here: "template" (inductor's, AVX512-VNNI), "fbgemm" (torch's quantized
    linear, an x86 CPU without it: AVX2), or None (no int8 GEMM worth running)."""
    if vector_int8_gemm(device):
        return "template"
    return "fbgemm" if fbgemm_available(device) else None


def fbgemm_available(device: torch.device | str = "cpu") -> bool:
    """Whether torch's fbgemm (its x86 int8 GEMM library) runs on `device`."""
    return torch.device(device).type == "cpu" and "fbgemm" in torch.backends.quantized.supported_engines


def describe(device: torch.device | str = "cpu") -> dict:
    """What a latency measurement depends on: the processor, its usable ISA, threads and torch's version."""
    device = torch.device(device)
    info = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info.update(
            cpu=_cpuinfo()[0],
            isa=sorted(cpu_flags()),
            threads=torch.get_num_threads(),
            capability=torch.backends.cpu.get_cpu_capability(),
        )
    info["native_bf16"] = native_bf16(device)
    return info
