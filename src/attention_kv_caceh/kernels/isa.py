"""Which SIMD instruction set the compiled kernels are built for, and so which variant of them runs.

Numba compiles every kernel for one LLVM target per process: the host CPU, or the CPU that the
environment variables `NUMBA_CPU_NAME` and `NUMBA_CPU_FEATURES` name (read when Numba is imported; an
empty `NUMBA_CPU_FEATURES` means "that CPU's own features"). The linear-layer kernels (`gemm`,
`block_gemm`) come in one variant per vector width, with a register tile sized for that instruction set:

    variant  float32 lanes  vector     CPUs
             per vector     registers
    avx512   16             32         x86-64 with AVX-512F (Intel Xeon since Skylake-SP, AMD Zen 4 and later)
    avx2     8              16         x86-64 with AVX2 and FMA (Intel since Haswell, AMD since Zen)
    neon     4              32         AArch64 (Apple silicon, Graviton, Ampere, Raspberry Pi 4 and later)

`compiled_variant` finds the variant by asking LLVM itself: it compiles a 16-lane float32 FMA for the
same CPU name and feature string that Numba uses and reads the instructions that come out (512-bit
`zmm` registers, 256-bit `ymm` FMAs, or AArch64 `fmla` on 128-bit vectors). So the answer is what
the kernels will be compiled into, whatever the environment variables say. A target with none of the
three (an x86-64 CPU without AVX2, `NUMBA_CPU_NAME=generic`) gets no variant: the engine then keeps
NumPy for its linear layers.

To run the AVX2 variant on an AVX-512 machine, compile everything for an AVX2 CPU, for example AMD
Zen 3: `NUMBA_CPU_NAME=znver3 NUMBA_CPU_FEATURES= attention-kv-caceh bench-engine ...`. Numba's disk
cache keeps one entry per target, so both builds stay cached side by side.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from typing import cast

__all__ = ["ISAS", "SimdVariant", "compiled_variant", "numba_cpu"]

ISAS: dict[str, tuple[int, int]] = {"avx512": (16, 32), "avx2": (8, 16), "neon": (4, 32)}
"""Variant name -> (float32 lanes per vector, vector registers)."""

_PROBE_IR = """
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
define void @probe(ptr %p) {
  %a = load <16 x float>, ptr %p, align 4
  %r = call <16 x float> @llvm.fma.v16f32(<16 x float> %a, <16 x float> %a, <16 x float> %a)
  store <16 x float> %r, ptr %p, align 4
  ret void
}
"""


@dataclass(frozen=True)
class SimdVariant:
    """The kernel variant of the CPU Numba compiles for.

    isa: "avx512", "avx2" or "neon" (a key of ISAS); lanes and registers from ISAS; bf16_dot: the CPU
    has AVX-512 BF16 (`vdpbf16ps`, a dot product of bfloat16 pairs into float32), named in its feature
    string; cpu: the LLVM CPU name compiled for.
    """

    isa: str
    lanes: int
    registers: int
    bf16_dot: bool
    cpu: str

    def describe(self) -> str:
        """One phrase for a note, e.g. "avx2: 8 float32 lanes, 16 vector registers, compiled for znver3"."""
        dot = ", avx512_bf16" if self.bf16_dot else ""
        return f"{self.isa}: {self.lanes} float32 lanes, {self.registers} vector registers{dot}, compiled for {self.cpu}"


def numba_cpu() -> tuple[str, str]:
    """(CPU name, LLVM feature string) that Numba compiles for: its NUMBA_CPU_NAME / NUMBA_CPU_FEATURES
    settings where given, the host's otherwise (the rule of Numba's JIT codegen)."""
    from llvmlite import binding
    from numba.core import config

    name = cast(str | None, getattr(config, "CPU_NAME", None)) or str(binding.get_host_cpu_name())
    features = cast(str | None, getattr(config, "CPU_FEATURES", None))
    if features is None:
        features = str(binding.get_host_cpu_features().flatten())
    return name, features


def _classify(asm: str, machine: str) -> str | None:
    if machine in ("aarch64", "arm64"):
        return "neon" if "fmla" in asm and ".4s" in asm else None
    if "vfmadd" not in asm:
        return None
    if "zmm" in asm:
        return "avx512"
    return "avx2" if "ymm" in asm else None


@functools.cache
def compiled_variant() -> SimdVariant | None:
    """The variant the compiled kernels are built for in this process (module docstring), or None where
    none applies or LLVM cannot be asked (then the engine keeps NumPy)."""
    try:
        from llvmlite import binding

        binding.initialize_native_target()
        binding.initialize_native_asmprinter()
        name, features = numba_cpu()
        machine = binding.Target.from_default_triple().create_target_machine(cpu=name, features=features)
        module = binding.parse_assembly(_PROBE_IR)
        asm = str(machine.emit_assembly(module))
    except Exception:  # no LLVM target for this host: nothing compiles
        return None
    isa = _classify(asm, platform.machine().lower())
    if isa is None:
        return None
    lanes, registers = ISAS[isa]
    bf16 = isa == "avx512" and "+avx512bf16" in features.split(",")
    return SimdVariant(isa, lanes, registers, bf16, name)
