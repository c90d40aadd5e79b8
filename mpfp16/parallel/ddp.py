"""DistributedDataParallel with an mpfp16 communication hook (:func:`wrap`), the rules
on its options (:func:`check_options`, also the training configuration's), and the
hook state a checkpoint keeps for an exact resume (:func:`comm_state_dict`)."""

from __future__ import annotations

import inspect
import weakref

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState
from torch.nn.parallel import DistributedDataParallel

from ..errors import dtype_name, library_words
from .ranks import group_ranks, is_initialized
from .handles import Handle, handle_of, register
from .hooks import HOOKS, STRATEGIES, TORCH_STRATEGIES, HookState
from .powersgd import RANDOM_SEED, PowerSGDMemory
from .quantize import check_format
from .wires import (DEFAULT_FP8_FORMAT, DEFAULT_TOPK_MOMENTUM, DEFAULT_TOPK_RATIO, WIRE_STRATEGIES, WireMemory,
                    WireOptions)
from .setup import close_at_teardown

__all__ = ["wrap", "attach", "check_options", "comm_state_dict", "load_comm_state_dict", "WIRE_DTYPES"]

WIRE_DTYPES = (None, torch.float16, torch.bfloat16, torch.float32)  # allreduce_dtype's choices; None: the gradients'


def check_options(*, strategy: str, allreduce_dtype: torch.dtype | None, predivide_factor: float, bucket_mb: float,
                  powersgd_rank: int, powersgd_start_iter: int, grads_16bit: bool | None,
                  grad_dtypes: tuple[str, ...] = (), say=library_words, fp8_format: str = DEFAULT_FP8_FORMAT,
                  error_feedback: bool = False, topk_ratio: float = DEFAULT_TOPK_RATIO,
                  topk_momentum: float = DEFAULT_TOPK_MOMENTUM) -> None:
    """Refuse, in one line, DDP options that :func:`wrap` cannot honour.

    torch's compression hooks (``fp16_compress``, ``bf16_compress``, ``powersgd``) are
    baselines for an fp32 model, with their own wire dtype and division: with 16-bit
    gradients they would cast nothing or compress what is already compressed, and
    they would ignore ``allreduce_dtype`` and ``predivide_factor``.

    The 8-bit and top-k wires (:mod:`mpfp16.parallel.wires`) take any gradient dtype,
    but their state between steps (error feedback's residual, top-k's momentum and
    accumulation) is in the gradients' units, which the loss scale of fp16 gradients
    changes from step to step: with fp16 gradients they refuse it.

    Args:
        strategy, allreduce_dtype, predivide_factor, bucket_mb, powersgd_rank,
        powersgd_start_iter, fp8_format, error_feedback, topk_ratio, topk_momentum: as
        :func:`wrap` takes them.
        grads_16bit: whether the model's trainable parameters (so its gradients) are
            16-bit; None when not known yet (that rule is then not checked).
        grad_dtypes: the names of those 16-bit dtypes (``("float16",)``), for the
            message; optional.
        say: ``say(name, value)`` words an option as the caller spells it (default
            ``name=value``; the scripts say ``--allreduce-strategy powersgd``).

    Raises:
        ValueError: naming the first option refused.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown {say('strategy', strategy)}; choose one of {', '.join(STRATEGIES)}")
    if allreduce_dtype not in WIRE_DTYPES:
        raise ValueError(f"{say('allreduce_dtype', allreduce_dtype)} must be None, float16, bfloat16 or float32")
    if strategy == "fp32_accumulate" and allreduce_dtype is not None:
        raise ValueError(f"{say('strategy', strategy)} sends the gradients' own 16-bit dtype; leave "
                         f"{say('allreduce_dtype', None)}")
    if not predivide_factor > 0:
        raise ValueError(f"{say('predivide_factor', predivide_factor)} must be positive")
    if not bucket_mb > 0:
        raise ValueError(f"{say('bucket_mb', bucket_mb)} must be positive")
    powersgd = (("powersgd_rank", powersgd_rank, 1, ""),
                ("powersgd_start_iter", powersgd_start_iter, 2,
                 " (torch's minimum with error feedback and warm start)"))
    for name, value, minimum, why in powersgd:
        if not (isinstance(value, int) and value >= minimum):
            raise ValueError(f"{say(name, value)} must be an integer >= {minimum}{why}")
    _only_for("powersgd", strategy, [(name, value, default) for name, value, default, _ in powersgd], say)
    _check_wire_options(strategy=strategy, grad_dtypes=grad_dtypes, fp8_format=fp8_format,
                        error_feedback=error_feedback, topk_ratio=topk_ratio, topk_momentum=topk_momentum, say=say)
    if strategy in TORCH_STRATEGIES and grads_16bit:
        which = f" ({', '.join(grad_dtypes)})" if grad_dtypes else ""
        raise ValueError(f"{say('strategy', strategy)} is torch's compression hook for an fp32 model, and this "
                         f"model's gradients are already 16-bit{which}: use {say('strategy', 'allreduce')} or "
                         f"{say('strategy', 'fp32_accumulate')}")
    if strategy in TORCH_STRATEGIES + WIRE_STRATEGIES:  # hooks that choose their wire and divide themselves
        if allreduce_dtype is not None:
            raise ValueError(f"{say('strategy', strategy)} decides its own wire dtype; leave "
                             f"{say('allreduce_dtype', None)}")
        if predivide_factor != 1:
            raise ValueError(f"{say('strategy', strategy)} divides by the world size itself; leave "
                             f"{say('predivide_factor', 1.0)}")


def _only_for(owner: str, strategy: str, options, say) -> None:
    """Refuse any of ``options`` ((name, value, default) each) set away from its default
    under a strategy other than ``owner``, the one strategy it applies to."""
    for name, value, default in options:
        if strategy != owner and value != default:
            raise ValueError(f"{say(name, value)} applies to {say('strategy', owner)} only, not "
                             f"{say('strategy', strategy)}")


def _check_wire_options(*, strategy: str, grad_dtypes: tuple[str, ...], fp8_format: str, error_feedback: bool,
                        topk_ratio: float, topk_momentum: float, say) -> None:
    """The 8-bit and top-k wires' own rules (see :func:`check_options`)."""
    check_format(fp8_format, say=say)
    _only_for("fp8_compress", strategy, [("fp8_format", fp8_format, DEFAULT_FP8_FORMAT)], say)
    if not isinstance(error_feedback, bool):
        raise ValueError(f"{say('error_feedback', error_feedback)} must be True or False")
    if error_feedback and strategy not in ("fp8_compress", "int8_compress"):
        why = {"topk": "keeps what it does not send always (DGC's residual)",
               "powersgd": "feeds its error back always (torch's use_error_feedback)"}.get(
            strategy, "drops nothing to feed back")
        raise ValueError(f"{say('error_feedback', True)} applies to {say('strategy', 'fp8_compress')} and "
                         f"{say('strategy', 'int8_compress')}; {say('strategy', strategy)} {why}")
    for name, value, zero_allowed in (("topk_ratio", topk_ratio, False), ("topk_momentum", topk_momentum, True)):
        if not (isinstance(value, (int, float)) and (0 <= value if zero_allowed else 0 < value) and value < 1):
            raise ValueError(f"{say(name, value)} must be in {'[' if zero_allowed else '('}0, 1)")
    _only_for("topk", strategy, [("topk_ratio", topk_ratio, DEFAULT_TOPK_RATIO),
                                 ("topk_momentum", topk_momentum, DEFAULT_TOPK_MOMENTUM)], say)
    keeps_state = strategy == "topk" or error_feedback
    if keeps_state and any(d in ("float16", say("precision", "fp16")) for d in grad_dtypes):
        what = say("strategy", strategy) if strategy == "topk" else say("error_feedback", True)
        raise ValueError(f"{what} keeps gradients from step to step, and fp16 gradients are scaled by a loss scale "
                         "that changes between steps, so they would come back in the wrong units: use it with a "
                         "bf16 or fp32 model")


def _half_dtypes(model: torch.nn.Module) -> list[str]:
    """The 16-bit dtypes of ``model``'s trainable parameters, by name."""
    return sorted({dtype_name(p.dtype) for p in model.parameters()
                   if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)})


def wrap(model: torch.nn.Module, allreduce_dtype: torch.dtype | None = None, predivide_factor: float = 1.0,
         bucket_mb: float = 25, strategy: str = "allreduce", *, powersgd_rank: int = 1, powersgd_start_iter: int = 2,
         fp8_format: str = DEFAULT_FP8_FORMAT, error_feedback: bool = False, topk_ratio: float = DEFAULT_TOPK_RATIO,
         topk_momentum: float = DEFAULT_TOPK_MOMENTUM, device_ids=None, process_group=None,
         broadcast_buffers: bool = True, find_unused_parameters: bool = False,
         static_graph: bool = False) -> DistributedDataParallel:
    """Wrap ``model`` in DistributedDataParallel with an mpfp16 communication hook.

    Args:
        model: the (16-bit) model, already on its device.
        allreduce_dtype: the dtype on the wire for ``strategy="allreduce"``; default
            the gradients' own (fp16 for an fp16 model). ``torch.float32`` upcasts.
        predivide_factor: divide by f before the sum and by world_size/f after it
            (apex's ``gradient_predivide_factor``). 1 sums first; world_size divides
            first, as DDP's default hook does.
        bucket_mb: DDP bucket size in MiB (apex's ``message_size``).
        strategy: ``"allreduce"`` or ``"fp32_accumulate"`` (16-bit wire, fp32 sums);
            ``"fp8_compress"``, ``"int8_compress"`` (8-bit codes, a scale per 256
            elements, fp32 sums) or ``"topk"`` (Deep Gradient Compression), for any
            model (:mod:`mpfp16.parallel.wires`); or, for an fp32 model, one of
            torch's compression hooks as a baseline: ``"fp16_compress"``,
            ``"bf16_compress"``, ``"powersgd"`` (see :mod:`mpfp16.parallel.hooks`).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank``.
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: optimizer steps of
            plain allreduce before compression starts; at least 2, torch's minimum with
            error feedback and warm start (both on).
        fp8_format: ``"e4m3"`` (default) or ``"e5m2"``, for ``"fp8_compress"``.
        error_feedback: for the 8-bit wires: keep what the encoding dropped and add
            it back next step (not with fp16 gradients: see :func:`check_options`).
        topk_ratio: for ``"topk"``: the share of each parameter's entries sent, in
            (0, 1).
        topk_momentum: for ``"topk"``: DGC's momentum correction factor, in [0, 1);
            the optimizer must then apply no momentum of its own.
        device_ids, process_group, broadcast_buffers, find_unused_parameters,
        static_graph: passed to DDP. BatchNorm buffers are broadcast from rank 0 at
            each forward when ``broadcast_buffers`` is True, as DDP does.

    Returns:
        The DDP module; its per-step communication figures are
        ``comm_stats(ddp).pop_step()``, and the state a checkpoint must keep for an
        exact resume (PowerSGD's) is ``comm_state_dict(ddp)``.

    Raises:
        ValueError: in one line, for the options :func:`check_options` refuses.
    """
    if not is_initialized():
        raise RuntimeError("wrap() needs torch.distributed: call mpfp16.distributed.init() under torchrun")
    half = _half_dtypes(model)
    check_options(strategy=strategy, allreduce_dtype=allreduce_dtype, predivide_factor=predivide_factor,
                  bucket_mb=bucket_mb, powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter,
                  grads_16bit=bool(half), grad_dtypes=tuple(half), fp8_format=fp8_format,
                  error_feedback=error_feedback, topk_ratio=topk_ratio, topk_momentum=topk_momentum)
    param = next(model.parameters(), None)
    if device_ids is None and param is not None and param.device.type == "cuda":
        device_ids = [param.device.index]
    # torch 2.14 renamed broadcast_buffers to forward_sync_buffers.
    sync_kw = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
               else "broadcast_buffers")
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        process_group=process_group,
        bucket_cap_mb=bucket_mb,
        find_unused_parameters=find_unused_parameters,
        static_graph=static_graph,
        # The gradients must stay views of FP16Optimizer's flat buffers, so DDP copies
        # bucket results into them instead of re-pointing them at its buckets.
        gradient_as_bucket_view=False,
        **{sync_kw: broadcast_buffers},
    )
    wire = WireOptions(strategy, fp8_format=fp8_format, error_feedback=error_feedback, topk_ratio=topk_ratio,
                       topk_momentum=topk_momentum) if strategy in WIRE_STRATEGIES else None
    return _hook(ddp, model, strategy=strategy, allreduce_dtype=allreduce_dtype, predivide_factor=predivide_factor,
                 powersgd_rank=powersgd_rank, powersgd_start_iter=powersgd_start_iter, process_group=process_group,
                 rebuilds=static_graph or not find_unused_parameters, wire=wire)


def attach(ddp: DistributedDataParallel, allreduce_dtype: torch.dtype | None = None, predivide_factor: float = 1.0,
           strategy: str = "allreduce") -> DistributedDataParallel:
    """Give a DistributedDataParallel module that someone else built (Lightning's
    ``DDPStrategy``) what :func:`wrap` gives its own: mpfp16's communication hook, its
    per-step accounting (``comm_stats``), the fp32-sum carry of
    ``accumulate_dtype=torch.float32``, and the refusal of a layer unfrozen since.
    Call it before the first backward pass.

    Raises:
        ValueError: in one line: an option :func:`check_options` refuses, a module
            that already has a communication hook, or gradients that are views of
            DDP's buckets (``gradient_as_bucket_view=True``: the gradients must stay
            in the optimizer's flat buffers).
    """
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"attach() takes a DistributedDataParallel module, got {type(ddp).__name__}")
    if handle_of(ddp) is not None:
        raise ValueError("this DDP module already has mpfp16's hook")
    if ddp._comm_hooks:  # torch allows one hook per module
        raise ValueError("this DDP module already has a communication hook; mpfp16 registers its own "
                         "(leave the DDP strategy's ddp_comm_hook unset)")
    if ddp.gradient_as_bucket_view:
        raise ValueError("gradient_as_bucket_view=True makes the gradients views of DDP's buckets; mpfp16 keeps them "
                         "in the optimizer's flat buffers: leave it False")
    model = ddp.module
    half = _half_dtypes(model)
    check_options(strategy=strategy, allreduce_dtype=allreduce_dtype, predivide_factor=predivide_factor,
                  bucket_mb=1, powersgd_rank=1, powersgd_start_iter=2, grads_16bit=bool(half),
                  grad_dtypes=tuple(half))
    if strategy not in ("allreduce", "fp32_accumulate"):
        raise ValueError(f"attach() takes strategy='allreduce' or 'fp32_accumulate', not {strategy!r} (use wrap(), "
                         "which records the parameters that its state is kept by)")
    return _hook(ddp, model, strategy=strategy, allreduce_dtype=allreduce_dtype, predivide_factor=predivide_factor,
                 powersgd_rank=1, powersgd_start_iter=2, process_group=ddp.process_group, rebuilds=True)


def _hook(ddp: DistributedDataParallel, model: torch.nn.Module, *, strategy: str, allreduce_dtype, predivide_factor,
          powersgd_rank: int, powersgd_start_iter: int, process_group, rebuilds: bool,
          wire: WireOptions | None = None) -> DistributedDataParallel:
    """The hook, its state and the module's handle: what wrap() and attach() share."""
    state = HookState(process_group=process_group, allreduce_dtype=allreduce_dtype,
                      predivide_factor=float(predivide_factor))
    own_traffic = strategy == "fp32_accumulate" or wire is not None
    if own_traffic and dist.get_world_size(process_group) > 1:  # a collective: every rank wraps
        state.exchange_group = dist.new_group(group_ranks(process_group))
    if wire is not None:
        state.wire = WireMemory(wire, {name: p for name, p in model.named_parameters() if p.requires_grad})
    if strategy == "powersgd":
        state.powersgd = _powersgd_memory(model, ddp, process_group, powersgd_rank, powersgd_start_iter,
                                          rebuilds=rebuilds)
    ddp.register_comm_hook(state, HOOKS[strategy])
    ddp.register_forward_pre_hook(lambda module, args: state.new_round())
    ddp.register_forward_pre_hook(_ChangedSinceWrapped(model))
    register(ddp, Handle("ddp", stats=state.stats, group=process_group, hook_state=state))
    close_at_teardown(state)
    return ddp


class _ChangedSinceWrapped:
    """A forward pre-hook that refuses, in one line, a parameter that DDP no longer
    averages since it was built, so that the replicas would silently diverge:

    - one that requires grad now but did not when DDP was built: DDP fixes the
      parameters it averages at construction (unfreezing a layer under DDP, as
      fine-tuning does);
    - one converted to another dtype or device since (``ddp.half()``, ``.to()``):
      torch gives a parameter whose data changes type a new gradient accumulator,
      and DDP's hooks stay on the old one (plain torch DDP trains on unaveraged
      gradients in silence)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [(name, p, p.requires_grad, p.dtype, p.device) for name, p in model.named_parameters()]

    def __call__(self, module, args) -> None:
        for name, p, trainable, dtype, device in self.params:
            if p.requires_grad and not trainable:
                raise RuntimeError(f"parameter {name} was frozen when the model was wrapped in DDP and requires grad "
                                   "now: DDP never averages its gradient, so the replicas would diverge; wrap the "
                                   "model after unfreezing it (or wrap it with every layer trainable and "
                                   "find_unused_parameters=True)")
            if p.dtype != dtype or p.device != device:
                raise RuntimeError(f"parameter {name} was {str(dtype).replace('torch.', '')} on {device} when the "
                                   f"model was wrapped in DDP and is {str(p.dtype).replace('torch.', '')} on "
                                   f"{p.device} now (.half() or .to() after wrapping): torch gave it a new gradient "
                                   "accumulator, so DDP no longer averages its gradient and the replicas would "
                                   "diverge; convert the model (mpfp16.to_half) first, then wrap it")


def _powersgd_memory(model: torch.nn.Module, ddp: DistributedDataParallel, process_group, rank: int,
                     start_iter: int, rebuilds: bool) -> PowerSGDMemory:
    """torch's PowerSGDState (error feedback and warm start on, a fixed seed), kept
    per parameter by :class:`mpfp16.parallel.powersgd.PowerSGDMemory`. DDP's buckets
    are final once it has rebuilt them (``_has_rebuilt_buckets``, as torch's ZeRO hook
    reads it), or from the start when it never rebuilds (unused parameters, no static
    graph)."""
    torch_state = PowerSGDState(process_group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
                                use_error_feedback=True, warm_start=True, random_seed=RANDOM_SEED)
    ddp_ref = weakref.ref(ddp)  # the hook state must not keep the DDP module alive (teardown)
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    return PowerSGDMemory(torch_state, params,
                          lambda: not rebuilds or bool(getattr(ddp_ref(), "_has_rebuilt_buckets", False)))


def _hook_state(model: torch.nn.Module) -> HookState | None:
    handle = handle_of(model)
    return handle.hook_state if handle is not None and handle.kind == "ddp" else None


def _memory(model: torch.nn.Module):
    """The hook's state between steps: PowerSGD's, or a wire's that keeps some (error
    feedback, top-k); None for any other hook or model."""
    state = _hook_state(model)
    if state is None:
        return None
    if state.powersgd is not None:
        return state.powersgd
    return state.wire if state.wire is not None and state.wire.options.kinds else None


def comm_state_dict(model: torch.nn.Module) -> dict | None:
    """This rank's communication-hook state that a checkpoint must keep for a resume
    to continue bit-identically, as plain tensors (on CPU) and values: PowerSGD's
    error feedback (which differs between ranks), Q memory, step count and random
    state; the 8-bit wires' residuals with error feedback; top-k's momentum and
    accumulation. None when the hook keeps no state (every other strategy) or
    ``model`` was not made by :func:`wrap`. Call it between optimizer steps."""
    memory = _memory(model)
    return memory.state_dict() if memory is not None else None


def load_comm_state_dict(model: torch.nn.Module, saved: dict) -> str | None:
    """Give ``model`` (made by :func:`wrap`) this rank's :func:`comm_state_dict` back,
    before its first step.

    Returns:
        None when the run continues bit-identically; otherwise why not, in a few words
        (another PowerSGD rank; a checkpoint taken after PowerSGD started, by a process
        whose DDP buckets were not yet final, so that their layout is unknown).

    Raises:
        ValueError: one line, when the state is of other parameters or malformed, or
            the model's hook keeps no state.
    """
    memory = _memory(model)
    if memory is None:
        raise ValueError("this model's communication hook keeps no state to load (only strategies 'powersgd', "
                         "'topk', and 'fp8_compress' and 'int8_compress' with error feedback do)")
    return memory.load_state_dict(saved)
