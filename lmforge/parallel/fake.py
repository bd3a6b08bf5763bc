"""Many ranks on one CPU, on fake tensors: a layout's training step traced before paying for
devices.

    device, standin = trace_device("cuda")      # the stand-in device for an accelerator (no GPU touched)
    with fake_world(device, world_size=64, rank=0):
        mesh = build_mesh(layout, model_cfg, device_type=device.type)
        with FakeTensorMode(allow_non_fake_inputs=True), TraceMode(device) as trace:
            ...                                 # the real code: parallelize, forward, backward, optimizer
        trace.peak                              # the most bytes of tensor storage alive at once

Fake tensors (torch._subclasses.FakeTensorMode) carry shapes, dtypes and devices but no data, so a
step of a 20B-parameter model costs no memory and little time, and an op that mixes devices raises
FakeTensorDeviceMismatchError as on the device. The process group is torch's fake one (FakeStore):
collectives return at once, and a group initialised for the device alone has no CPU backend.

A trace for an accelerator runs on a stand-in, on every machine (see trace_device): PyTorch's
Python-registered PrivateUse1 backend named "fakegpu", with a no-op device guard and streams, an
autocast that casts what CUDA's autocast casts to lower precision (matrix products and attention),
and the fake process group bound to it alone. Everything a CUDA run does with devices (tensors
created on the device, collectives on device tensors, autocast, FSDP2's streams, DTensor
placements) then runs through the same code, on a device that is not the CPU.

TraceMode is the dispatch mode around the traced code:
- it weighs every tensor storage that torch ops hand out (a DTensor counts its local piece) and
  keeps the peak of the bytes alive at once;
- a collective given a tensor that is not on the traced device raises CollectiveDeviceError naming
  the op and the lmforge line that called it: with NCCL that collective fails at step 1;
- data-dependent values get plausible stand-ins instead of data: `x.item()` gives 1 (a loss, a
  norm, a count), `bool(t.any())` False and other booleans True (no anomaly, no padding), and
  `nonzero` every element (an upper bound on what the indexed copy holds);
- it keeps the peak of each phase since reset_peak too (`phase_peaks`), a phase being a stretch of
  forward (or other non-autograd work) or of backward: at a larger depth each phase's peak grows
  with the blocks, while which phase holds the step's peak can change (lmforge.train.plan
  extrapolates them one by one).
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from lmforge.errors import UserError
from lmforge.parallel.mesh import torch_release

STANDIN = "fakegpu"
_LOWER_PRECISION_OPS = (
    "linear",
    "matmul",
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "scaled_dot_product_attention",
)
_registered: list[object] = []  # the stand-in's libraries, alive for the process


class CollectiveDeviceError(RuntimeError):
    """A collective was given a tensor that does not live on the process group's device."""


def trace_device(device_type: str) -> tuple[torch.device, bool]:
    """The device a trace for `device_type` runs on, and whether it is the stand-in: the CPU for
    "cpu", the stand-in for any accelerator, on every machine. A trace needs no device, and one
    on the real device would open its context in every traced rank's process: memory taken from
    the jobs on a busy node's GPUs, and a process that has touched CUDA cannot fork the next
    trace ("Cannot re-initialize CUDA in forked subprocess", lmforge plan on an H200). So a plan
    is also the same on a laptop as on the cluster."""
    if device_type == "cpu":
        return torch.device("cpu"), False
    _register_standin()
    return torch.device(STANDIN, 0), True


@contextlib.contextmanager
def fake_world(device: torch.device, world_size: int, rank: int = 0) -> Iterator[None]:
    """The default process group as torch's fake one, `rank` of `world_size`, bound to `device`
    alone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a process group")
    backend = "fake" if device.type == "cpu" else f"{device.type}:fake"
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
    # torch leaves a device-qualified group's default backend type unset when another plugin came
    # first, and destroying the group then warns "No backend of type 0 found" (C++) on every trace.
    with contextlib.suppress(AttributeError, RuntimeError):
        dist.distributed_c10d._get_default_group()._set_default_backend(
            dist.ProcessGroup.BackendType.CUSTOM
        )
    try:
        yield
    finally:
        dist.destroy_process_group()


def collective_kind(op: str) -> str | None:
    """'all_gather', 'reduce_scatter', 'all_reduce' or 'all_to_all' for a c10d op's name; None
    for the others (barriers, sends, a collective's wait)."""
    name = op.replace("_", "")
    for kind, words in (
        ("reduce_scatter", ("reducescatter",)),
        ("all_gather", ("allgather",)),
        ("all_reduce", ("allreduce",)),
        ("all_to_all", ("alltoall",)),
    ):
        if any(w in name for w in words):
            return kind
    return None


class TraceMode(TorchDispatchMode):
    """The dispatch mode of a fake trace (see the module docstring); enter it inside
    FakeTensorMode."""

    def __init__(self, device: torch.device, fake_mode=None):
        """`fake_mode`: the FakeTensorMode it runs in, which turns real tensors given to device
        ops into fake ones."""
        super().__init__()
        self.device, self.fake_mode = device, fake_mode
        self.refs: dict[int, object] = {}  # StorageWeakRef by the storage's address
        self.live = 0
        self.peak = 0
        # live bytes when the first backward began (saved activations)
        self.at_backward: int | None = None
        # The peak of each phase (a forward or backward stretch) since reset_peak, which
        # lmforge.train.plan extrapolates one by one (see the module docstring).
        self.phase_peaks: list[int] = [0]
        self._in_backward = False
        # Bytes by kind of collective (collective_kind), counted as its largest tensor (nccl-tests'
        # "size"): an all-gather's gathered output, a reduce-scatter's unreduced input.
        self.collective_bytes: dict[str, int] = {}
        self._any: dict[int, bool] = {}

    def __enter__(self):
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_patched_for_fake(self.device))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def reset_peak(self) -> None:
        self._prune()
        self.peak = self.live
        self.phase_peaks, self._in_backward = [self.live], False

    def new_phase(self) -> None:
        """Start a phase here (the optimizer step, after the backward's work)."""
        self._prune()
        self.phase_peaks.append(self.live)

    def _prune(self) -> None:
        """Drop the storages that died and re-weigh the others: FSDP2 frees a gathered parameter
        by resizing its storage to 0 bytes (and back), which no op reports."""
        expired, storage = torch.UntypedStorage._expired, torch.UntypedStorage._new_with_weak_ptr
        live = 0
        for k in list(self.refs):
            if expired(k):
                del self.refs[k]
            else:
                live += storage(k).nbytes()
        self.live = live

    def _weigh(self, out) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        added = False
        for local in (
            held for t in tree_leaves(out) if isinstance(t, torch.Tensor) for held in _held(t)
        ):
            if local.device.type == "meta":
                continue
            ref = StorageWeakRef(local.untyped_storage())
            if ref.cdata not in self.refs:
                self.refs[ref.cdata] = ref
                added = True
        if added:  # the peak can only rise when a storage is added: frees are counted then
            self._prune()
            self.peak = max(self.peak, self.live)
            self.phase_peaks[-1] = max(self.phase_peaks[-1], self.live)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func.namespace in ("c10d", "_c10d_functional"):
            self._check_collective(func, tensors)
            kind = collective_kind(func.overloadpacket.__name__)
            if kind is not None and tensors:
                size = max(t.numel() * t.element_size() for t in tensors)
                self.collective_bytes[kind] = self.collective_bytes.get(kind, 0) + size
        if (
            tensors
            and not any(isinstance(t, FakeTensor) for t in tensors)
            and all(t.device.type == "cpu" for t in tensors)
            and kwargs.get("device") in (None, "cpu", torch.device("cpu"))
        ):
            # Real CPU tensors in, real out: torch's own bookkeeping (a DeviceMesh's rank tensors),
            # which fake tensors would turn into unknown values.
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if self.fake_mode is not None and any(
            t.device.type == "cpu" and not isinstance(t, FakeTensor) for t in tensors
        ):
            # Real tensors into an op that makes device tensors (a CPU tensor moved to the device):
            # as fake ones, never as constants FakeTensorMode would run the op on for real.
            def fake(t):
                real_cpu = (
                    isinstance(t, torch.Tensor)
                    and t.device.type == "cpu"
                    and not isinstance(t, FakeTensor)
                )
                return self.fake_mode.from_tensor(t) if real_cpu else t

            args, kwargs = tree_map(fake, args), tree_map(fake, kwargs)
        backward = torch._C._current_graph_task_id() != -1
        if backward != self._in_backward:
            self._prune()
            self._in_backward = backward
            self.phase_peaks.append(self.live)
            if backward and self.at_backward is None:
                self.at_backward = self.live
        first = args[0] if args else None
        if isinstance(first, FakeTensor):
            if func in (
                torch.ops.aten._local_scalar_dense.default,
                torch.ops.aten.is_nonzero.default,
            ):
                if first.dtype == torch.bool or func is torch.ops.aten.is_nonzero.default:
                    return self._any.get(id(first), True)
                return 1.0 if first.dtype.is_floating_point else 1
            if func is torch.ops.aten.nonzero.default:
                return torch.empty(
                    (first.numel(), first.dim()), dtype=torch.long, device=first.device
                )
        out = func(*args, **kwargs)
        if func.overloadpacket is torch.ops.aten.any and isinstance(out, torch.Tensor):
            self._any[id(out)] = False
        self._weigh(out)
        return out

    def _check_collective(self, func, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            if t.device.type != self.device.type:
                raise CollectiveDeviceError(
                    f"{func} was given a {t.device.type} tensor on a process group for "
                    f"{self.device.type} tensors{_caller()}: with NCCL this fails at "
                    "step 1; create the tensor on the model's device"
                )


def _held(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors whose storage `t` holds on this rank: a DTensor's local piece; a wrapper
    tensor's (torchao's NF4 weight) inner tensors, its own fake storage being the size of the
    dense tensor it stands for, which a device never allocates."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        yield from _held(t._local_tensor)
    elif hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _held(getattr(t, name))
    else:
        yield t


@contextlib.contextmanager
def _patched_for_fake(device: torch.device) -> Iterator[None]:
    """What torch reads real data for, or makes outside the dispatch modes, replaced while a
    trace runs: DDP's start-up check that every rank's parameters have the same shapes and its
    broadcast of rank 0's values (both read tensor data: the ranks are one here, and nothing
    holds values), and, on the stand-in device, `torch.tensor(data, device=...)` (made on the
    CPU, then moved, where the dispatch modes see it)."""
    import torch.nn.parallel.distributed as ddp

    saved = {
        "verify": ddp._verify_param_shape_across_processes,
        "sync": ddp._sync_module_states,
        "tensor": torch.tensor,
        "generator": torch.Generator,
    }
    ddp._verify_param_shape_across_processes = lambda *args, **kwargs: None
    ddp._sync_module_states = lambda *args, **kwargs: None
    if device.type == STANDIN:

        def tensor(data, *args, device=None, **kwargs):
            t = saved["tensor"](data, *args, **kwargs)
            return t.to(device) if device is not None else t

        # the stand-in has no generators: random ops on fake tensors draw nothing
        def generator(device=None):
            return saved["generator"]()

        torch.tensor, torch.Generator = tensor, generator
    try:
        yield
    finally:
        ddp._verify_param_shape_across_processes, ddp._sync_module_states = (
            saved["verify"],
            saved["sync"],
        )
        torch.tensor, torch.Generator = saved["tensor"], saved["generator"]


def _caller() -> str:
    """' (at lmforge/…/file.py:LINE in fn)' for the innermost lmforge frame of the current stack."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/lmforge/" in path and not path.endswith("/parallel/fake.py"):
            return f" (at lmforge/{path.rsplit('/lmforge/', 1)[1]}:{frame.lineno} in {frame.name})"
    return ""


# --- the stand-in device -------------------------------------------------------------------------


class _Stream:
    """A device stream that orders nothing (the fake device runs nothing)."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


class _Event(_Stream):
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _StandinModule:
    """`torch.fakegpu`: what torch's device-generic code (DeviceMesh, FSDP2, autocast) asks of a
    device module."""

    Stream = _Stream
    Event = _Event

    def __init__(self):
        self.index = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return 1 << 16  # any local rank has a device

    def current_device(self) -> int:
        return self.index

    def set_device(self, index) -> None:
        self.index = index.index if isinstance(index, torch.device) else int(index)

    def current_stream(self, device=None) -> _Stream:
        return _Stream()

    def default_stream(self, device=None) -> _Stream:
        return _Stream()

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def synchronize(self, device=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        pass

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16]

    def is_bf16_supported(self, *args, **kwargs) -> bool:
        return True


def _register_standin() -> None:
    """Register the stand-in device once per process (PrivateUse1 can be named only once)."""
    if _registered:
        return
    name = torch._C._get_privateuse1_backend_name()
    if name not in ("privateuseone", STANDIN):
        raise RuntimeError(
            f"this process's PrivateUse1 backend is already '{name}': a fake device cannot be added; "
            "plan in a process of its own"
        )
    try:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
    except ImportError:  # torch 2.10 added Python device backends
        raise UserError(
            f"tracing a run on a device this machine lacks needs torch 2.10 or later (a Python device "
            f"backend stands in for it); this is torch {torch_release()}: upgrade torch "
            "here (pip install -U torch), or plan with --device cpu"
        ) from None
    if name == "privateuseone":
        _setup_privateuseone_for_python_backend(STANDIN, backend_module=_StandinModule())
    # Autocast on the stand-in: matrix products and attention in the autocast dtype (what CUDA's
    # autocast casts), every other op as it is.
    anything = torch.library.Library("_", "IMPL", "AutocastPrivateUse1")
    anything.fallback(torch.library.fallthrough_kernel)
    aten = torch.library.Library("aten", "IMPL", "AutocastPrivateUse1")
    for op in _LOWER_PRECISION_OPS:
        aten.impl(op, _autocast_kernel(getattr(torch.ops.aten, op).default), "AutocastPrivateUse1")
    # Attention as CUDA trains it: a fused kernel (memory-efficient attention: masks and fp32 too)
    # saving the output and log-sum-exp, not the math path's (query x key) probabilities.
    autograd = torch.library.Library("aten", "IMPL", "AutogradPrivateUse1")
    autograd.impl("scaled_dot_product_attention", _fused_attention, "AutogradPrivateUse1")
    _registered.extend([anything, aten, autograd])


def _fused_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(
            attn_mask.shape, dtype=query.dtype, device=query.device
        ).masked_fill(~attn_mask, float("-inf"))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, grad, dropout_p, is_causal, scale=scale
    )[0]


def _autocast_kernel(op):
    below = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(STANDIN)

        def cast(a):
            return a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a

        args, kwargs = [cast(a) for a in args], {k: cast(v) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(below):
            return op(*args, **kwargs)

    return kernel
