"""The one place that decides which device a process computes on and how its process group talks.

    resolve_device("auto")   the accelerator torch.accelerator reports (CUDA, XPU, any backend PyTorch
                             exposes the same way), this process's one by LOCAL_RANK; else the CPU
    dist_backend(device)     "cpu:gloo,cuda:nccl": one process group whose CPU tensors go through gloo and
                             device tensors through the device's own collective library
    synchronize(device)      wait for the device's queued work (timing)
    bf16_matmul(device)      whether the device multiplies bf16 matrices in hardware (trainer.precision=auto)
    set_tf32(device, on)     TF32 for fp32 matrix products on CUDA (trainer.tf32)

The CPU is one device among others, not the assumption: everything else asks here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lmforge.config import closest
from lmforge.errors import UserError


def accelerator() -> torch.device | None:
    """The accelerator type this torch build and machine have (index-less), or None."""
    if hasattr(torch, "accelerator") and torch.accelerator.is_available():
        return torch.accelerator.current_accelerator()
    return None


def resolve_device(name: str = "auto", local_rank: int = 0, key: str = "--device") -> torch.device:
    """`name` ("auto", "cpu", "cuda", "cuda:1", ...) as a torch.device this process can use; an
    accelerator given without an index is the LOCAL_RANK-th one. A UserError naming `key` for
    anything else."""
    if name == "auto":
        found = accelerator()
        device = found if found is not None else torch.device("cpu")
    else:
        try:
            device = torch.device(name)
        except (RuntimeError, ValueError) as e:
            hint = closest(str(name), ("auto", "cpu", "cuda"))
            raise UserError(
                f"{key}={name}: unknown device ({str(e).splitlines()[0]}){hint}: use auto, cpu or an "
                "accelerator such as cuda"
            ) from None
        found = accelerator()
        if device.type != "cpu" and (found is None or found.type != device.type):
            have = (
                f"this machine's accelerator is {found.type}"
                if found is not None
                else "there is no accelerator"
            )
            raise UserError(
                f"{key}={name}: {device.type} is not available here ({have} in this torch build): use "
                f"{key}=auto or {key}=cpu"
            )
    if device.type == "cpu" or device.index is not None:
        return device
    count = torch.accelerator.device_count()
    if local_rank >= count:
        raise UserError(
            f"process {local_rank} on this node has no {device.type} device of its own (the node has "
            f"{count}): start at most {count} processes per node"
        )
    return torch.device(device.type, local_rank)


def dist_backend(device: torch.device, override: str | None = None) -> str:
    """The process-group backend for processes computing on `device`: gloo for CPU tensors and,
    for an accelerator, the device's own collective library for its tensors, in one group (so a
    CPU tensor in a collective still works, and a device tensor never takes the slow path).
    `override`: as given."""
    if override:
        return override
    if device.type == "cpu":
        return "gloo"
    own = dist.Backend.default_device_backend_map.get(device.type)
    if own is None:
        raise UserError(
            f"torch knows no collective backend for {device.type}: set trainer.dist_backend (e.g. "
            f"'cpu:gloo,{device.type}:NAME')"
        )
    return f"cpu:gloo,{device.type}:{own}"


def set_device(device: torch.device) -> None:
    """Make `device` this process's current accelerator (collectives and kernels use it)."""
    if device.type == "cpu":
        return
    # 2.6
    setter = (
        getattr(torch.accelerator, "set_device_index", None) or torch.accelerator.set_device_idx
    )
    setter(device.index)


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start max_memory_allocated's count afresh (where the device counts it)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    # torch >= 2.8
    elif device.type != "cpu" and hasattr(torch.accelerator, "reset_peak_memory_stats"):
        torch.accelerator.reset_peak_memory_stats(device)


def memory_allocated(device: torch.device) -> int | None:
    """Bytes the caching allocator holds for tensors on `device` now, None where torch does not
    count them."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type != "cpu" and hasattr(torch.accelerator, "memory_allocated"):  # torch >= 2.8
        return torch.accelerator.memory_allocated(device)
    return None


def max_memory_allocated(device: torch.device) -> int | None:
    """Peak bytes the caching allocator handed out on `device`, None where torch does not count
    them."""
    memory = getattr(torch.accelerator, "max_memory_allocated", None)  # torch >= 2.8
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if memory is not None and device.type != "cpu":
        return memory(device)
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (x86 `flags`, Arm `Features`); empty where
    there is none."""
    try:
        text = open("/proc/cpuinfo").read()  # noqa: SIM115 (a tiny pseudo-file)
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return flags


def bf16_matmul(device: torch.device) -> tuple[bool, str]:
    """(whether `device` multiplies bf16 matrices in hardware, what says so). On a CPU: AMX or
    avx512_bf16 (x86), the bf16 extension (Arm); without them oneDNN runs bf16 GEMMs on a scalar
    path, ~100x slower than fp32 (seen on an AVX2-only EPYC). On CUDA: tensor cores with bf16
    (compute capability 8.0 and up)."""
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
            return True, "this CPU has AMX"
        if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
            return True, "this CPU has avx512_bf16"
        flags = cpu_flags()
        found = sorted({"amx_bf16", "avx512_bf16", "bf16"} & flags)
        if found:
            return True, f"this CPU has {found[0]}"
        return False, (
            f"this CPU has no bf16 matrix instructions ({torch.backends.cpu.get_cpu_capability()}, no "
            "AMX or avx512_bf16)"
        )
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"{name} has bf16 tensor cores"
        return False, f"{name} has no bf16 tensor cores (compute capability below 8.0)"
    if device.type == "mps":
        return (
            False,
            "auto does not use bf16 on Apple GPUs (its support depends on the macOS version)",
        )
    module = getattr(torch, device.type, None)
    check = getattr(module, "is_bf16_supported", None)
    if check is not None and not check():
        return False, f"torch.{device.type} reports no bf16 support"
    return True, f"{device.type} accelerators multiply bf16 matrices in hardware"


def set_tf32(device: torch.device, enabled: bool) -> bool:
    """On CUDA, let fp32 matrix products and cuDNN convolutions run on TF32 tensor cores (10-bit
    mantissa, fp32 range; up to ~7x the fp32 rate on Ampere and later) or not. Returns whether it
    set anything: other devices keep their own defaults.

    Through torch.set_float32_matmul_precision and cudnn.allow_tf32, which every torch from 2.6
    on has: on 2.9+ setting the per-backend `fp32_precision` attributes instead leaves
    torch.get_float32_matmul_precision and cudnn.allow_tf32 (which Inductor reads) raising "a mix
    of the legacy and new APIs" (torch 2.13)."""
    if device.type != "cuda":
        return False
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    return True


def device_label(device: torch.device) -> str:
    """What a run computes on, for its log: "cuda:0 (NVIDIA H100 80GB HBM3)", "cpu (2 threads)";
    a cluster job that asked for no GPU trains on the CPU, and this line says so."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({torch.get_num_threads()} thread{'s' * (torch.get_num_threads() > 1)})"
    return str(device)
