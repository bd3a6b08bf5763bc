"""AdamWSR's update as one compiled pass over each tensor, like torch's fused AdamW: a C++ loop on a
CPU, a torch.compile'd (Triton) kernel on a GPU.

The eager update (lmforge.train.optim) makes ~30 passes per element through fp32 work buffers. This
loop reads each bf16 weight, gradient and moment once, does the same fp32 arithmetic, rounds the
results with the same counter-hash noise and writes them back: the same bits as the eager update
(tests/train/test_optim_kernel.py). It mirrors torch's CPU kernels op for op: lerp_ and addcmul_ end
in a fused multiply-add (their vectorised kernels do), addcdiv_ multiplies by the scalar before it
divides, and the scalars are rounded to fp32 first.

Why a hand-written loop and not torch.compile of the same update: Inductor writes one vectorised C++
loop for it, but its C++ backend has no vector form of a bitcast (fp32 <-> int32, which the rounding
needs six times per element) nor of an int32 arange, and spills each through a stack buffer: ~4x
fused AdamW on one thread (BENCHMARKS.md). This loop goes through Inductor's own C++ toolchain (its
compiler, flags, vector ISA and on-disk cache), with GCC's loop vectoriser on (Inductor turns it off
for its generated code) and without errno for sqrt, so the loop vectorises whole.

On a GPU Inductor has none of those gaps: the same update written in torch ops (`torch_update`)
compiles to one Triton kernel per tensor shape class (dynamic shapes: one compile for all of a
model's tensors), where the eager update launches ~23 kernels per 16M-element chunk and moves each
value through fp32 work buffers ~30 times. With Triton, lmforge.train.optim_triton's multi-tensor
kernel goes first: one launch per group, not a compiled call per tensor; this one takes what it
cannot (after a failure, or with AdamWSR(multi_tensor=False)).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# The stochastic rounding's noise hash (lmforge.train.optim explains it): (((counter + k0) * C1) ^
# k) * C2.
HASH_C1 = -1640531535  # 0x9E3779B1 as a signed int32
HASH_C2 = -2048144777  # 0x85EBCA77
# Device types whose AdamWSR update torch.compile makes one kernel of (Triton): the CPU has its own
# loop.
COMPILED_DEVICES = ("cuda", "xpu")

SOURCE = r"""
#include <algorithm>
#include <cstdint>
#include <cstring>

static inline float as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
static inline uint32_t as_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
// bf16 is the top half of fp32: the fp32 value as bits, rounded to nearest even (NaN stays a NaN).
static inline uint16_t nearest(float x) {
    const uint32_t b = as_bits(x);
    return x != x ? uint16_t(0x7FC0) : uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}
// Stochastic rounding: 16 bits of noise added below the bf16 part, then truncation.
static inline uint16_t stochastic(float x, uint32_t noise) { return uint16_t((as_bits(x) + noise) >> 16); }
static inline uint32_t hash_noise(uint32_t base, uint32_t key) { return ((base ^ key) * 0x85EBCA77u) >> 16; }

static void update(uint16_t* __restrict w, const uint16_t* __restrict g, uint16_t* __restrict m,
                   uint16_t* __restrict v, const float* s, const uint32_t* k, int64_t begin, int64_t end,
                   bool sr) {
    const float coef = s[0], beta2 = s[1], one_minus_beta2 = s[2], decay = s[3], bias2 = s[4], eps = s[5],
                step = s[6];
    const bool from_grad = s[7] != 0.0f;  // lerp with a weight >= 0.5 starts from the end point
    const uint32_t base0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
    for (int64_t i = begin; i < end; ++i) {
        const float g32 = as_float(uint32_t(g[i]) << 16), m32 = as_float(uint32_t(m[i]) << 16);
        const float v32 = as_float(uint32_t(v[i]) << 16), w32 = as_float(uint32_t(w[i]) << 16);
        const float m_new = __builtin_fmaf(coef, g32 - m32, from_grad ? g32 : m32);             // lerp_
        const float v_new = __builtin_fmaf(one_minus_beta2 * g32, g32, v32 * beta2);            // mul_, addcmul_
        const float denom = __builtin_sqrtf(v_new) / bias2 + eps;                               // sqrt, div_, add_
        const float w_new = w32 * decay + (step * m_new) / denom;                               // mul_, addcdiv_
        if (sr) {
            const uint32_t base = uint32_t(i) * 0x9E3779B1u + base0;  // (counter + k0) * C1, mod 2^32
            m[i] = stochastic(m_new, hash_noise(base, k1));
            v[i] = stochastic(v_new, hash_noise(base, k2));
            w[i] = stochastic(w_new, hash_noise(base, k3));
        } else {
            m[i] = nearest(m_new);
            v[i] = nearest(v_new);
            w[i] = nearest(w_new);
        }
    }
}

extern "C" void kernel(uint16_t* w, const uint16_t* g, uint16_t* m, uint16_t* v, const float* s,
                       const int32_t* k, int64_t n, int64_t sr) {
    const uint32_t* keys = reinterpret_cast<const uint32_t*>(k);
    constexpr int64_t block = 1 << 15;
    #pragma omp parallel for schedule(static) if (n > 2 * block)
    for (int64_t b = 0; b < n; b += block) {
        update(w, g, m, v, s, keys, b, std::min(n, b + block), sr != 0);
    }
}
"""
ARGTYPES = [
    "uint16_t*",
    "const uint16_t*",
    "uint16_t*",
    "uint16_t*",
    "const float*",
    "const int32_t*",
    "int64_t",
    "int64_t",
]
# After Inductor's own flags: GCC's loop vectoriser back on, and sqrt without errno (else it stays a
# libm call).
FLAGS = ("-ftree-loop-vectorize", "-fno-math-errno")


def build_kernel() -> tuple[Callable | None, float, str]:
    """(the compiled update, seconds it took, why not): the callable is None where it cannot be
    built (no C++ compiler, a compiler without these flags, a torch whose Inductor differs), and
    the reason says why. The first build on a machine compiles (seconds; Inductor caches it on
    disk), later ones load it."""
    start = time.perf_counter()
    try:
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        # torch 2.12+ asks whether the code needs the CPU's vector ISA flags (it does); before, they
        # are always set.
        vec = (
            "needs_vec_isa"
            in inspect.signature(CppPythonBindingsCodeCache.load_pybinding_async).parameters
        )
        kernel = CppPythonBindingsCodeCache.load_pybinding(
            ARGTYPES, SOURCE, extra_flags=FLAGS, **({"needs_vec_isa": True} if vec else {})
        )
    except Exception as e:  # noqa: BLE001 (any failure to build means the eager path, which gives the same bits)
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        return None, time.perf_counter() - start, f"{type(e).__name__}: {reason}"
    return kernel, time.perf_counter() - start, ""


@functools.cache
def cpu_kernel() -> Callable | None:
    """The compiled update, built (or loaded) once per process, its cost logged once; None where
    it cannot be."""
    kernel, seconds, why = build_kernel()
    if kernel is None:
        log.warning(
            "AdamWSR: the compiled CPU update could not be built (%s): the eager update runs instead (the "
            "same results, several times slower)",
            why,
        )
    else:
        log.info(
            "AdamWSR: compiled CPU update ready in %.1f s (built once per machine and cached by Inductor; "
            "later runs load it)",
            seconds,
        )
    return kernel


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c with one rounding, as torch's lerp_/addcmul_ kernels compute it (Inductor's prim
    where it has one)."""
    from torch._inductor import inductor_prims

    fma = getattr(inductor_prims, "fma", None)
    return fma(a, b, c) if fma is not None else torch.addcmul(c, a, b)


def torch_update(
    w: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    s: torch.Tensor,
    k: torch.Tensor,
    sr: bool,
) -> None:
    """AdamWSR's update of one flat bf16 tensor (w, g, m, v) in torch ops, for torch.compile: the
    C++ loop's arithmetic (scalars `s` from kernel_scalars) and noise (`k`: the row's first
    counter hashed, then the three keys), in place. On a CPU Inductor compiles it to the loop's
    bits, several times slower (its bitcasts)."""
    g32, m32, v32, w32 = g.float(), m.float(), v.float(), w.float()
    m_new = _fma(s[0], g32 - m32, torch.where(s[7] != 0, g32, m32))  # lerp_
    v_new = _fma(s[2] * g32, g32, v32 * s[1])  # mul_, addcmul_
    # mul_, sqrt, div_, add_, addcdiv_
    w_new = w32 * s[3] + (s[6] * m_new) / (torch.sqrt(v_new) / s[4] + s[5])
    if not sr:
        for x, new in ((m, m_new), (v, v_new), (w, w_new)):
            x.copy_(new)  # to nearest even
        return
    base = torch.arange(w.numel(), dtype=torch.int32, device=w.device) * HASH_C1 + k[0]
    for x, new, r in ((m, m_new, 1), (v, v_new, 2), (w, w_new, 3)):
        noise = ((base ^ k[r]) * HASH_C2 >> 16) & 0xFFFF
        x.copy_(((new.view(torch.int32) + noise) & -65536).view(torch.float32))  # exact in bf16


@functools.cache
def compiled_update(device_type: str) -> Callable | None:
    """torch.compile(torch_update) for tensors of this device type, or None where its compiler
    (Triton on a GPU) is missing (logged once). On a CPU Inductor compiles it to C++ (the tests:
    the GPU's path on this machine)."""
    from torch.utils._triton import has_triton

    if device_type != "cpu" and not has_triton():
        log.warning(
            "AdamWSR: Triton is not installed, so the update is not compiled: the eager update runs "
            "(the same arithmetic, ~30 passes per value; pip install triton)"
        )
        return None
    return torch.compile(torch_update, dynamic=True)


def kernel_scalars(
    lr: float, betas: tuple[float, float], eps: float, weight_decay: float, step: int
) -> torch.Tensor:
    """The update's scalars as fp32, each rounded from the same Python float the eager ops are
    given."""
    beta1, beta2 = betas
    weight = torch.tensor(1 - beta1, dtype=torch.float32)
    # torch's lerp: end + (weight - 1) * (end - start) for large weights
    from_end = bool(weight.abs() >= 0.5)
    coef = weight - 1 if from_end else weight  # in fp32, as the lerp kernel computes it
    values = [
        beta2,
        1 - beta2,
        1 - lr * weight_decay,
        math.sqrt(1 - beta2**step),
        eps,
        -lr / (1 - beta1**step),
        float(from_end),
    ]
    return torch.cat([coef.view(1), torch.tensor(values, dtype=torch.float32)])


def bf16_rows(rows: list[tuple[torch.Tensor, ...]]) -> list[bool]:
    """Which flat (w, g, m, v) rows a compiled update takes: all four bf16 (others go the eager
    way)."""
    return [all(x.dtype == torch.bfloat16 for x in row) for row in rows]
