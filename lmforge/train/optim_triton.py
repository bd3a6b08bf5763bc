"""AdamWSR's update of a group's bf16 tensors in one Triton kernel launch: multi-tensor, as torch's
fused AdamW is.

The per-tensor compiled update (optim_kernel.torch_update under torch.compile) is one kernel per
tensor, but each call of a compiled function pays its guards and wrappers in Python before the
kernel starts (~40 us a call on this project's 2-core CPU machine): on an H200 bf16-sr's step was
11% slower than bf16-mixed's, ~70 us per tensor by inference from Pythia-1B's 196 tensors. One
torch.compile'd function looping over all of a group's tensors was tried and dropped: ~1.4 s of
compilation per tensor (272 s for 196 here), on every new machine. This kernel takes a table of the
tensors' addresses and sizes: one launch per group, whatever the tensor count (two where some
tensors are not 16-byte aligned), and one pass over each value.

The arithmetic is the C++ loop's (optim_kernel.SOURCE), op for op: the fused multiply-adds written
as such, IEEE square root and division (`sqrt_rn`, `div_rn`: Triton's defaults are approximate) and
no other contraction (`enable_fp_fusion=False`), the same counter-hash noise and the same rounding
on the bits: the CPU loop's results, bit for bit (tests/train/test_optim_triton.py runs it in
Triton's interpreter on the CPU, and compiles it for sm_90 there to check the 16-byte accesses).

Grid: (tensor, slot); a slot strides over its tensor's blocks, so a small tensor's extra slots end
at once and a 100M-element embedding is spread over all of them.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from lmforge.train.optim_kernel import HASH_C1, HASH_C2

try:  # the kernel's source names `tl`; without Triton it is never built (`usable` says so)
    import triton.language as tl
except ImportError:
    tl = None

BLOCK = 1024  # elements per slot per iteration: 8 bf16 (16 bytes) per thread at 4 warps
MAX_SLOTS = 512  # programs per tensor at most (the grid's second axis)


def adamwsr_multi_tensor(
    ptrs,
    sizes,
    keys,
    s,
    C1: tl.constexpr,
    C2: tl.constexpr,
    SR: tl.constexpr,  # noqa: N803
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):  # noqa: N803
    """One (tensor, slot) program: `ptrs` holds each tensor's (w, g, m, v) addresses, `keys` its
    first counter hashed and the three keys, `s` the scalars of optim_kernel.kernel_scalars; C1
    and C2 the hash's constants as unsigned 32-bit values."""
    t = tl.program_id(0)
    n = tl.load(sizes + t)
    w_ptr = tl.load(ptrs + 4 * t).to(tl.pointer_type(tl.uint16))
    g_ptr = tl.load(ptrs + 4 * t + 1).to(tl.pointer_type(tl.uint16))
    m_ptr = tl.load(ptrs + 4 * t + 2).to(tl.pointer_type(tl.uint16))
    v_ptr = tl.load(ptrs + 4 * t + 3).to(tl.pointer_type(tl.uint16))
    # every address 16-byte aligned and every size a multiple of 8 (the host sorts): 16-byte
    # accesses
    if ALIGNED:
        n = tl.multiple_of(n, 8)
        w_ptr = tl.multiple_of(w_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    coef, beta2, one_minus_beta2 = tl.load(s), tl.load(s + 1), tl.load(s + 2)
    decay, bias2, eps, step = tl.load(s + 3), tl.load(s + 4), tl.load(s + 5), tl.load(s + 6)
    from_grad = tl.load(s + 7) != 0.0  # lerp with a weight >= 0.5 starts from the end point
    base0 = tl.load(keys + 4 * t).to(tl.uint32, bitcast=True)
    k1 = tl.load(keys + 4 * t + 1).to(tl.uint32, bitcast=True)
    k2 = tl.load(keys + 4 * t + 2).to(tl.uint32, bitcast=True)
    k3 = tl.load(keys + 4 * t + 3).to(tl.uint32, bitcast=True)
    c1 = tl.full([BLOCK], C1, tl.uint32)
    c2 = tl.full([BLOCK], C2, tl.uint32)
    for start in range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(start, BLOCK) + tl.arange(0, BLOCK), BLOCK)
        mask = offs < n
        w32 = (tl.load(w_ptr + offs, mask=mask, other=0).to(tl.uint32) << 16).to(
            tl.float32, bitcast=True
        )
        g32 = (tl.load(g_ptr + offs, mask=mask, other=0).to(tl.uint32) << 16).to(
            tl.float32, bitcast=True
        )
        m32 = (tl.load(m_ptr + offs, mask=mask, other=0).to(tl.uint32) << 16).to(
            tl.float32, bitcast=True
        )
        v32 = (tl.load(v_ptr + offs, mask=mask, other=0).to(tl.uint32) << 16).to(
            tl.float32, bitcast=True
        )
        m_new = tl.fma(g32 - m32, coef, tl.where(from_grad, g32, m32))  # lerp_
        v_new = tl.fma(one_minus_beta2 * g32, g32, v32 * beta2)  # mul_, addcmul_
        denom = tl.div_rn(tl.sqrt_rn(v_new), bias2) + eps  # sqrt, div_, add_
        w_new = w32 * decay + tl.div_rn(step * m_new, denom)  # mul_, addcdiv_
        mb = m_new.to(tl.uint32, bitcast=True)
        vb = v_new.to(tl.uint32, bitcast=True)
        wb = w_new.to(tl.uint32, bitcast=True)
        if SR:  # 16 bits of noise below the bf16 part, then truncation
            base = offs.to(tl.uint32) * c1 + base0  # (counter + k0) * C1, mod 2^32
            mb = (mb + (((base ^ k1) * c2) >> 16)) >> 16
            vb = (vb + (((base ^ k2) * c2) >> 16)) >> 16
            wb = (wb + (((base ^ k3) * c2) >> 16)) >> 16
        else:  # to nearest even; a NaN stays a NaN
            mb = tl.where(m_new != m_new, 0x7FC0, (mb + 0x7FFF + ((mb >> 16) & 1)) >> 16)
            vb = tl.where(v_new != v_new, 0x7FC0, (vb + 0x7FFF + ((vb >> 16) & 1)) >> 16)
            wb = tl.where(w_new != w_new, 0x7FC0, (wb + 0x7FFF + ((wb >> 16) & 1)) >> 16)
        tl.store(m_ptr + offs, mb.to(tl.uint16), mask=mask)
        tl.store(v_ptr + offs, vb.to(tl.uint16), mask=mask)
        tl.store(w_ptr + offs, wb.to(tl.uint16), mask=mask)


@functools.cache
def kernel(interpret: bool = False):
    """The jitted kernel (Triton's interpreter with `interpret`: numpy on the CPU, for the
    tests)."""
    import triton

    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(adamwsr_multi_tensor)
    return triton.jit(adamwsr_multi_tensor)


class PartlyDone(RuntimeError):
    """A launch failed after others had stepped some rows: `done` (indices into the rows) must
    not be stepped again."""

    def __init__(self, done: list[int], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.done, self.cause = done, cause


def update_rows(
    rows: list[tuple[torch.Tensor, ...]], scalars: torch.Tensor, keys: torch.Tensor, sr: bool
) -> None:
    """Step flat contiguous bf16 rows (w, g, m, v) of one device: `scalars` from kernel_scalars,
    on that device, and `keys` (len(rows), 4) int32 on the CPU (each row's first counter hashed,
    then the three keys). One launch for the rows whose addresses are 16-byte aligned and sizes
    multiples of 8 (16-byte loads and stores), one for any others. A failing launch raises
    PartlyDone, naming the rows the launches before it stepped."""
    device = rows[0][0].device
    interpret = device.type == "cpu"  # Triton's interpreter: the tests
    aligned = [all(x.data_ptr() % 16 == 0 for x in row) and row[0].numel() % 8 == 0 for row in rows]
    done: list[int] = []
    for want in (True, False):
        take = [i for i, a in enumerate(aligned) if a == want]
        if not take:
            continue
        try:
            _launch(rows, take, scalars, keys, sr, want, device, interpret)
        except Exception as e:
            raise PartlyDone(done, e) from e
        done += take


def _launch(
    rows: list[tuple[torch.Tensor, ...]],
    take: list[int],
    scalars: torch.Tensor,
    keys: torch.Tensor,
    sr: bool,
    aligned: bool,
    device: torch.device,
    interpret: bool,
) -> None:
    """One launch over rows[take], all aligned (16-byte accesses) or not."""
    table = torch.tensor([x.data_ptr() for i in take for x in rows[i]], dtype=torch.int64)
    sizes = torch.tensor([rows[i][0].numel() for i in take], dtype=torch.int64)
    row_keys = keys[take]
    # pinned: asynchronous copies, the buffers held by torch's host allocator until done
    if not interpret:
        table, sizes, row_keys = (
            x.pin_memory().to(device, non_blocking=True) for x in (table, sizes, row_keys)
        )
    slots = min(MAX_SLOTS, -(-max(rows[i][0].numel() for i in take) // BLOCK))
    extra = {} if interpret else {"num_warps": 4, "enable_fp_fusion": False}
    # Triton launches on the current device and stream: the rows' device (a rank may hold more than
    # one).
    with contextlib.nullcontext() if interpret else getattr(torch, device.type).device(device):
        kernel(interpret)[(len(take), slots)](
            table,
            sizes,
            row_keys,
            scalars,
            C1=HASH_C1 & 0xFFFFFFFF,
            C2=HASH_C2 & 0xFFFFFFFF,
            SR=bool(sr),
            ALIGNED=aligned,
            BLOCK=BLOCK,
            **extra,
        )


def usable(device: torch.device) -> bool:
    """Whether the multi-tensor kernel can run on this device (a GPU with Triton;
    LMFORGE_ADAMWSR_MULTI_TENSOR=0 turns it off)."""
    if os.environ.get("LMFORGE_ADAMWSR_MULTI_TENSOR", "1") == "0":
        return False
    return device.type in ("cuda", "xpu") and tl is not None
