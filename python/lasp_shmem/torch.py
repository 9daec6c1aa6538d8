"""lasp-shmem from PyTorch: the runtime on a torch.distributed process group (`init`,
`shutdown`, `synchronize`), fla's `chunk_simple_gla` (linear attention with one log-decay per
token and head), fla's `chunk_gla` (a log-decay per key dimension), fla's
`chunk_gated_delta_rule` (Gated DeltaNet) and `mlstm` (xLSTM's matrix LSTM, mlstm_kernels'
mLSTMexp), each on one GPU or, with `cp_group`, sequence parallel across the group's ranks
(LASP-2).

The forwards and backwards are torch.library custom ops (`torch.ops.lasp_shmem.
chunk_simple_gla_fwd` and `chunk_simple_gla_bwd`, `chunk_gla_fwd` and `chunk_gla_bwd`,
`chunk_gated_delta_rule_fwd` and `chunk_gated_delta_rule_bwd`, `mlstm_fwd` and `mlstm_bwd`,
each pair linked by
`register_autograd`, with fake implementations), so torch.compile traces them without a
graph break and CUDA graphs capture them (LASP-2's in the overlapped exchange mode, below); they
run on torch's current stream.

Each layout (B, H, Dk, Dv, one GPU or LASP-2) is one `lasp_op` of the library, made by the first
call of that layout and kept until `shutdown`. Making a LASP-2 op is collective: every rank of the
group makes the same layouts in the same order, which SPMD training does by itself (every rank
runs the same layers on its shard). LASP-2 calls are ordered across the ranks the same way: every
rank calls the forward, and later the backward, of the same layers in the same order. The first
call of a layout must not be captured into a CUDA graph (it makes the op and sizes its
workspaces): run one step before capturing, as torch.compile's "reduce-overhead" mode does.

LASP-2 moves the states between the ranks in one of three exchange modes, which give bitwise the
same outputs and gradients: "overlapped" (the default: device puts with signals, hidden behind the
compute), "sequential_nccl" and "sequential_nvshmem" (the same kernels around NCCL's all-gather, on
a symmetric NCCL window where NCCL 2.27+ registers one, or NVSHMEM's fcollect: the baseline the
overlapped mode is measured against, and a fallback).
`set_exchange_mode` switches every LASP-2 op, collectively; `exchange_mode` says which is in use.
The sequential modes pick each call's buffer half on the host, so their calls refuse to be
captured into a CUDA graph. `set_exchange_mode("planned")` lets the library's planner choose per
op and direction, by timing the modes on the op's first call (`planned_modes` says what it chose).
"""

import ctypes
from typing import Optional

import torch
import torch.distributed as dist

from . import _abi

__all__ = ["init", "shutdown", "synchronize", "set_exchange_mode", "exchange_mode",
           "planned_modes", "chunk_simple_gla", "chunk_gla", "chunk_gated_delta_rule", "mlstm",
           "LaspError"]

LaspError = _abi.LaspError
SUPPORTED_DIMS = (64, 128)
# LASP-2's exchange modes by the names set_exchange_mode takes (LASP_MODE_* of the C ABI). The
# ABI's fourth, LASP_MODE_NO_COMM, skips the exchange, so each rank folds whatever states its
# buffers hold: it times the compute alone for the benchmarks and computes nothing a trainer
# could use, so it is not offered here.
EXCHANGE_MODES = {"overlapped": _abi.MODE_OVERLAPPED,
                  "sequential_nccl": _abi.MODE_SEQUENTIAL_NCCL,
                  "sequential_nvshmem": _abi.MODE_SEQUENTIAL_NVSHMEM}
# set_exchange_mode's fourth name: each LASP-2 op's mode chosen by the library's planner.
PLANNED = "planned"
# The modes whose calls a CUDA graph captures: those that exchange from the device only.
_CAPTURABLE = ("overlapped", "pipelined_chain")
# The planner may also choose the pipelined chain for an op whose family has one (scalar decay,
# GLA, mLSTM); it is not offered to set_exchange_mode, which switches every family's ops alike.
_MODE_NAMES = {**{code: name for name, code in EXCHANGE_MODES.items()},
               _abi.MODE_PIPELINED_CHAIN: "pipelined_chain"}


class _Runtime:
    """lasp-shmem's runtime on this process: the group it spans (the process group and its global
    ranks, or None twice without torch.distributed), this rank's place in it, its GPU, the ops
    made so far by layout and the exchange mode of its LASP-2 ops."""

    def __init__(self, handle, group, ranks, rank, world, device):
        self.handle, self.group, self.ranks = handle, group, ranks
        self.rank, self.world, self.device = rank, world, device
        # In the order they were made (a dict keeps it), which is the same on every rank for the
        # LASP-2 ops: set_exchange_mode and shutdown make one collective call per op in it.
        self.ops = {}
        self.mode = "overlapped"
        # In the planned mode, the mode the planner chose per (op layout, backward).
        self.planned = {}


_runtime: Optional[_Runtime] = None
_stopped = False  # NVSHMEM starts once per process: after shutdown() it cannot start again


def _group_place(group):
    """(the group or None, its global ranks or None, this process's rank in it, its size)."""
    if not dist.is_initialized():
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return None, None, 0, 1
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the group passed to init()")
    ranks = tuple(dist.get_process_group_ranks(group))
    return group, ranks, rank, len(ranks)


def init(group=None, *, symmetric_heap_bytes=0):
    """Starts lasp-shmem's runtime (NVSHMEM) on the ranks of `group` (torch.distributed's default
    group if None; a runtime of this process alone if torch.distributed is not initialised), on
    this process's current CUDA device. Collective over the group: rank 0 makes NVSHMEM's unique
    id and the group broadcasts it (no second rendezvous). Calling it again with the same group
    does nothing; the runtime starts once per process (not again after `shutdown`).

    NVSHMEM reads its settings from the environment once (the library never writes it): start
    the processes with `NVSHMEM_DISABLE_NVLS=1`, `NVSHMEM_REMOTE_TRANSPORT=none` on one node, and
    `NVSHMEM_SYMMETRIC_SIZE` if `symmetric_heap_bytes` (0: the library's 256 MiB; LASP-2 ops
    take their room from it) plus 256 MiB exceeds NVSHMEM's 1 GiB default.

    Guest mode: where another library of this process already initialised NVSHMEM (PyTorch's
    SymmetricMemory NVSHMEM backend), the runtime joins it instead, never initialising or
    finalizing it: NVSHMEM's PEs must be the group's ranks, its settings and symmetric heap are
    that library's, and it must be the NVSHMEM release lasp-shmem's kernels were built with
    (the error names both otherwise).
    """
    global _runtime
    group, ranks, rank, world = _group_place(group)
    if _runtime is not None:
        if _runtime.ranks != ranks:
            raise RuntimeError(f"lasp-shmem already runs on the ranks {_runtime.ranks}, not "
                               f"{ranks}, and NVSHMEM starts once per process: pass the same "
                               "group to every init()")
        return
    if _stopped:
        raise RuntimeError("lasp-shmem was shut down in this process, and NVSHMEM starts once "
                           "per process: call shutdown() only when the process is done with it")
    if not torch.cuda.is_available():
        raise RuntimeError("lasp-shmem needs a CUDA GPU, and torch sees none")
    device = torch.cuda.current_device()
    if _abi.nvshmem_initialized():
        _runtime = _attach(group, ranks, rank, world, device, symmetric_heap_bytes)
        return
    # The library opens GPU `local_rank`, and uses the local world size only to check the place.
    local_world = min(world, torch.cuda.device_count())
    if device >= local_world:
        raise ValueError(
            f"this process runs on cuda:{device}, but lasp-shmem's runtime selects the GPU by "
            f"local rank, which must be below the group's size on this node ({local_world}); "
            "give the group's ranks the GPUs cuda:0, cuda:1, ... of each node "
            "(torch.cuda.set_device(LOCAL_RANK) under torchrun)")
    lib = _abi.library()
    options = _abi.RuntimeOptions(abi_version=_abi.ABI_VERSION,
                                  symmetric_heap_bytes=symmetric_heap_bytes)
    place = _abi.Place(rank, world, device, local_world)
    uid = _abi.UniqueId()
    error, message = None, None
    if rank == 0:
        try:
            lib.unique_id_create(ctypes.byref(options), ctypes.byref(place), ctypes.byref(uid))
            message = bytes(uid.bytes)
        except LaspError as e:
            error, message = e, str(e)
    if world > 1:
        # Rank 0's failure travels too, so that no rank waits for an id that never comes.
        sent = [message]
        dist.broadcast_object_list(sent, group_src=0, group=group)
        message = sent[0]
    if error is not None:
        raise error
    if isinstance(message, str):
        raise RuntimeError(f"rank 0 of the group could not start lasp-shmem: {message}")
    uid.bytes[:] = message
    handle = ctypes.c_void_p()
    lib.runtime_init(ctypes.byref(options), ctypes.byref(place), ctypes.byref(uid),
                     ctypes.byref(handle))
    _runtime = _Runtime(handle, group, ranks, rank, world, device)


def _attach(group, ranks, rank, world, device, symmetric_heap_bytes):
    """Guest mode: joins the NVSHMEM another library of this process initialised (PyTorch's
    SymmetricMemory NVSHMEM backend); its PEs must be the group's ranks in order."""
    lib = _abi.library()
    options = _abi.RuntimeOptions(abi_version=_abi.ABI_VERSION,
                                  symmetric_heap_bytes=symmetric_heap_bytes)
    handle = ctypes.c_void_p()
    lib.runtime_attach(ctypes.byref(options), device, ctypes.byref(handle))
    place = _abi.Place()
    lib.runtime_place(handle, ctypes.byref(place))
    if (place.rank, place.world_size) != (rank, world):
        lib.runtime_shutdown(handle)
        raise RuntimeError(
            f"NVSHMEM, initialised in this process by another library, made it PE {place.rank} "
            f"of {place.world_size}, but this is rank {rank} of {world} in the group passed to "
            "init(); pass the group NVSHMEM spans (the one its SymmetricMemory rendezvous used)")
    return _Runtime(handle, group, ranks, rank, world, device)


def shutdown():
    """Frees every op (collective for LASP-2 ops) and stops the runtime (collective), for good:
    it does not start again in this process. Nothing if it is not running. Call it on every rank
    before destroying the process group."""
    global _runtime, _stopped
    if _runtime is None:
        return
    lib = _abi.library()
    while _runtime.ops:
        layout = next(iter(_runtime.ops))
        lib.op_free(_runtime.ops[layout])
        del _runtime.ops[layout]
    lib.runtime_shutdown(_runtime.handle)
    _runtime, _stopped = None, True


def synchronize():
    """Waits for torch's current stream, and raises LaspError if a wait on another GPU of an
    earlier LASP-2 call expired (every such wait is bounded, LASP_WAIT_TIMEOUT_MS, and reported
    here, naming the rank that never sent)."""
    runtime = _running()
    stream = ctypes.c_void_p(torch.cuda.current_stream(runtime.device).cuda_stream)
    for op in runtime.ops.values():
        _abi.library().op_finish(op, stream)


def set_exchange_mode(mode):
    """Switches LASP-2's exchange between the ranks to `mode`: "overlapped" (the default),
    "sequential_nccl" or "sequential_nvshmem" (the module's docstring says what each does), or
    "planned". Outputs and gradients are bitwise the same in every mode. (The C ABI's
    LASP_MODE_NO_COMM is left out: it skips the exchange, so its results are wrong by design; it
    only times the compute.)

    "planned": each LASP-2 op starts overlapped, and its first forward and its first backward call
    run the library's planner (lasp_op_plan), which times the modes on that call, in turns, takes
    the slowest rank's median and switches the op's direction to the fastest, the same on every
    rank (`planned_modes` lists the choices). It makes about 30 calls per mode, once per op and
    direction; every rank reaches those first calls together, as every rank runs the same layers.
    Those first calls must not be captured into a CUDA graph; a later call captures where its
    planned mode is the overlapped one. Setting the mode again forgets the choices.

    Collective over the runtime's group: every rank calls it with the same mode, at the same point
    of its LASP-2 calls, outside any CUDA graph capture. It waits for the GPU (calls already
    enqueued finish in the mode they were enqueued in), checks that the ranks agree, switches every
    LASP-2 op made so far (forward and backward, every family and layout) in the order they were
    made, and makes later LASP-2 ops start in `mode`. An op sets up its NCCL communicator when it
    first enters "sequential_nccl". CUDA graphs captured before a switch replay the old mode's
    calls: capture them again after it.

    The sequential modes pick each call's half of the exchange buffers on the host, which a
    replayed CUDA graph would not update: their calls refuse to be captured (capture in the
    overlapped mode). A LaspError part way through (e.g. NCCL failing to start) leaves the ops
    before the failing one switched: call set_exchange_mode again on every rank, with either mode,
    to bring them all to one (ops already in it are skipped).
    """
    if mode not in EXCHANGE_MODES and mode != PLANNED:
        raise ValueError(f"set_exchange_mode: mode must be one of "
                         f"{', '.join(map(repr, [*EXCHANGE_MODES, PLANNED]))}, not {mode!r}")
    runtime = _running()
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("set_exchange_mode: a CUDA graph is being captured on this stream, and "
                           "switching waits for the GPU and talks to every rank, which a capture "
                           "cannot hold; call it outside the captured region (between steps)")
    if runtime.world > 1:
        # The library checks that the ranks agree only on an op whose mode changes: a rank whose
        # ops are in its mode already would skip that collective and leave the others waiting.
        modes = [None] * runtime.world
        dist.all_gather_object(modes, mode, group=runtime.group)
        if len(set(modes)) > 1:
            raise ValueError(f"set_exchange_mode: the ranks of the group asked for the modes "
                             f"{modes} (by rank); call it with the same mode on every rank")
    lib = _abi.library()
    for (*_, lasp2), op in runtime.ops.items():
        if lasp2:  # an op of one GPU exchanges nothing, so it has no mode
            lib.op_set_mode(op, EXCHANGE_MODES[_created_in(mode)])
    runtime.mode = mode
    runtime.planned = {}


def exchange_mode():
    """The exchange mode LASP-2 ops run in: one of set_exchange_mode's names, "overlapped"
    unless switched."""
    return _running().mode


def planned_modes():
    """In the planned mode, what the planner chose so far: {(family, B, H, Dk, Dv, direction):
    mode name}, direction "forward" or "backward"; empty in the other modes."""
    return {(*layout[:5], "backward" if backward else "forward"): mode
            for (layout, backward), mode in _running().planned.items()}


def _created_in(mode):
    """The mode a LASP-2 op starts in: `mode`, or the overlapped one until the planner runs."""
    return "overlapped" if mode == PLANNED else mode


def _running():
    if _runtime is None:
        raise RuntimeError("lasp-shmem is not initialised: call lasp_shmem.torch.init() first "
                           "(after torch.distributed.init_process_group, if the job has one)")
    return _runtime


def chunk_simple_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, cp_group=None, shard_start=None):
    """Linear attention with scalar decay, as fla's `chunk_simple_gla`:
    S_t = exp(g_t) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t.

    q, k: [B, T, H, Dk] bf16; v: [B, T, H, Dv] bf16; g: [B, T, H] fp32 log-decays, finite and
    <= 0 (not checked on the host, which would wait for the GPU); Dk and Dv 64 or 128; every
    tensor contiguous, on the runtime's GPU. scale: None for Dk ** -0.5. initial_state:
    [B, H, Dk, Dv] fp32 or None for zero. Returns (o [B, T, H, Dv] bf16, the final state
    [B, H, Dk, Dv] fp32 if output_final_state else None). Differentiable in q, k, v, g and
    initial_state.

    cp_group: None runs whole sequences on this GPU. A process group (the one `init` was given)
    runs LASP-2 across its ranks: every rank of the group calls with its own slice of every
    sequence, the group-rank-th contiguous one (slices may differ in length), and the same
    initial_state; o is that slice of the output, and the final state is returned on the
    group's last rank only (None on the others). initial_state's gradient lands on the group's
    rank 0 (zeros on the others: their sum is the gradient).

    cu_seqlens: packed documents, as fla's: the documents' offsets in the whole packed sequence
    [0, l_1, l_1 + l_2, ..., total], a 1-D int32 or int64 tensor on the GPU (entries past the
    last may repeat the total: a buffer of fixed capacity, so a captured CUDA graph replays with
    other documents copied into it). The state forgets at every document start, on one GPU and
    across the ranks (a document may start, end or span any number of ranks' slices), and g's
    gradient is 0 there. Every batch row is packed alike (fla packs with B = 1). shard_start:
    the packed sequence's index of this call's first token; None gives 0 on one GPU and
    group-rank x T with cp_group (equal slices; pass it where the slices differ). With cu_seqlens,
    output_final_state gives one state per document, [B * N, H, Dk, Dv] fp32 (N = entries of
    cu_seqlens less one; row b * N + n; fla's [N, H, Dk, Dv] at B = 1): each document's state
    after its last token where that token is in this call's slice, zeros for the others, on
    every rank of cp_group (their sum holds every document's). No gradient flows from these
    states yet: a backward that reaches them raises. initial_state must be None with cu_seqlens
    (every document starts from the zero state).
    """
    if scale == 0:
        raise ValueError("chunk_simple_gla: scale must not be 0 (None gives Dk ** -0.5)")
    _check_inputs("chunk_simple_gla", q, k, v, g, initial_state, per_key_gates=False)
    runtime, lasp2 = _placement("chunk_simple_gla", cp_group)
    _check_device("chunk_simple_gla", runtime.device, q=q, k=k, v=v, g=g,
                  initial_state=initial_state)
    cu_seqlens, shard_start = _documents("chunk_simple_gla", cu_seqlens, shard_start, runtime,
                                         lasp2, q.shape[1], initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # Per-document final states are every rank's; the sequence's final state the last rank's.
    want_ht = output_final_state and (cu_seqlens is not None or not lasp2
                                      or runtime.rank == runtime.world - 1)
    o, ht, _ = torch.ops.lasp_shmem.chunk_simple_gla_fwd(q, k, v, g, initial_state,
                                                         float(scale), want_ht, lasp2,
                                                         cu_seqlens, shard_start)
    return o, ht if want_ht else None


def chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, cp_group=None, shard_start=None):
    """Gated linear attention with a log-decay per key dimension, as fla's `chunk_gla`:
    S_t = diag(exp(g_t)) S_{t-1} + k_t^T v_t, o_t = scale q_t S_t.

    q, k: [B, T, H, Dk] bf16; v: [B, T, H, Dv] bf16; g: [B, T, H, Dk] fp32 log-decays, finite
    and <= 0 (e.g. logsigmoid(x) / 16 as fla's GLA layer makes them); Dk and Dv 64 or 128; every
    tensor contiguous, on the runtime's GPU. scale, initial_state, output_final_state and
    cp_group as for `chunk_simple_gla` (LASP-2 across the group's ranks with cp_group: the final
    state on the group's last rank only, initial_state's gradient on its rank 0, zeros on the
    others). Returns (o, the final state or None).

    Differentiable in q, k, v, g and initial_state (g's gradient is fp32, like g), on one GPU and
    with cp_group. Where an input requires gradients the forward also keeps the state entering
    every chunk of 64 tokens (of this rank's shard with cp_group) for the backward
    ([B*H, ceil(T/64), Dk, Dv] bf16); without gradients (torch.no_grad(), or no input requiring
    them) it keeps nothing. cu_seqlens and shard_start (packed documents), and
    output_final_state with them (one state per document), as for `chunk_simple_gla`.
    """
    if scale == 0:
        raise ValueError("chunk_gla: scale must not be 0 (None gives Dk ** -0.5)")
    _check_inputs("chunk_gla", q, k, v, g, initial_state, per_key_gates=True)
    # The chunk states cost a write of B*H*ceil(T/64)*Dk*Dv bf16: only for a backward.
    save_states = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, initial_state))
    runtime, lasp2 = _placement("chunk_gla", cp_group)
    _check_device("chunk_gla", runtime.device, q=q, k=k, v=v, g=g, initial_state=initial_state)
    cu_seqlens, shard_start = _documents("chunk_gla", cu_seqlens, shard_start, runtime, lasp2,
                                         q.shape[1], initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    want_ht = output_final_state and (cu_seqlens is not None or not lasp2
                                      or runtime.rank == runtime.world - 1)
    o, ht, _ = torch.ops.lasp_shmem.chunk_gla_fwd(q, k, v, g, initial_state, float(scale),
                                                  want_ht, lasp2, save_states, cu_seqlens,
                                                  shard_start)
    return o, ht if want_ht else None


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                           output_final_state=False, cu_seqlens=None,
                           use_qk_l2norm_in_kernel=False, cp_group=None, shard_start=None):
    """Gated DeltaNet, as fla's `chunk_gated_delta_rule`: the delta rule with a scalar decay,
    S_t = exp(g_t) (I - beta_t k_t^T k_t) S_{t-1} + beta_t k_t^T v_t, o_t = scale q_t S_t.

    q, k: [B, T, H, Dk] bf16, Dk 64 or 128; v: [B, T, H, Dv] bf16, Dv a multiple of 64; g:
    [B, T, H] fp32 log-decays, finite and <= 0; beta: [B, T, H] write strengths (usually a
    sigmoid's output), fp32 or bf16 (taken as fp32); every tensor contiguous, on the runtime's
    GPU. The keys are used as given: l2-normalise them (the delta rule's state stays bounded for
    unit keys and beta in [0, 2)), or pass use_qk_l2norm_in_kernel=True to have q and k
    normalised here as fla's option does (x / sqrt(sum x^2 + 1e-6) in fp32, through torch, so
    gradients flow through it). scale, initial_state, output_final_state and cp_group as for
    `chunk_simple_gla` (LASP-2 across the group's ranks with cp_group: the final state on the
    group's last rank only, initial_state's gradient on its rank 0, zeros on the others). Returns
    (o [B, T, H, Dv] bf16, the final state [B, H, Dk, Dv] fp32 or None).

    Differentiable in q, k, v, g, beta and initial_state (g's and beta's gradients in fp32). With
    cp_group the forward keeps the state this rank's shard starts from ([B, H, Dk, Dv] fp32) for
    the backward. cu_seqlens and shard_start (packed documents), and output_final_state with
    them (one state per document), as for `chunk_simple_gla`.
    """
    op = "chunk_gated_delta_rule"
    if scale == 0:
        raise ValueError(f"{op}: scale must not be 0 (None gives Dk ** -0.5)")
    if isinstance(beta, torch.Tensor) and beta.dtype == torch.bfloat16:
        beta = beta.float()
    _check_inputs(op, q, k, v, g, initial_state, per_key_gates=False, delta_rule=True, beta=beta)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    runtime, lasp2 = _placement(op, cp_group)
    _check_device(op, runtime.device, q=q, k=k, v=v, g=g, beta=beta,
                  initial_state=initial_state)
    cu_seqlens, shard_start = _documents(op, cu_seqlens, shard_start, runtime, lasp2, q.shape[1],
                                         initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    want_ht = output_final_state and (cu_seqlens is not None or not lasp2
                                      or runtime.rank == runtime.world - 1)
    o, ht, _ = torch.ops.lasp_shmem.chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state,
                                                               float(scale), want_ht, lasp2,
                                                               cu_seqlens, shard_start)
    return o, ht if want_ht else None


def _l2norm(x):
    """fla's l2 normalisation of the last dimension, x / sqrt(sum x^2 + 1e-6), in fp32, returned
    in x's dtype."""
    y = x.float()
    return (y * torch.rsqrt(y.square().sum(-1, keepdim=True) + 1e-6)).to(x.dtype)


def _documents(op, cu_seqlens, shard_start, runtime, lasp2, tokens, initial_state):
    """The packed documents a call names, (cu_seqlens, shard_start), or (None, 0) for none;
    checked before anything is enqueued."""
    if cu_seqlens is None:
        if shard_start is not None:
            raise ValueError(f"{op}: shard_start places this call in a packed sequence and is "
                             "read only with cu_seqlens; pass shard_start=None")
        return None, 0
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{op}: cu_seqlens must be a torch.Tensor, not "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: cu_seqlens must be fla's 1-D offsets [0, l_1, ..., total] (at "
                         f"least 2 entries), not of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: cu_seqlens must be torch.int32 or torch.int64, not "
                        f"{cu_seqlens.dtype}")
    if not cu_seqlens.is_contiguous():
        raise ValueError(f"{op}: cu_seqlens (strides {cu_seqlens.stride()}) is not contiguous; "
                         "call .contiguous() on it")
    _check_device(op, runtime.device, cu_seqlens=cu_seqlens)
    if initial_state is not None:
        raise NotImplementedError(
            f"{op}: per-document initial states are not supported yet with cu_seqlens (every "
            "document starts from the zero state); pass initial_state=None")
    if shard_start is None:
        shard_start = runtime.rank * tokens if lasp2 else 0
    if not isinstance(shard_start, int) or shard_start < 0:
        raise ValueError(f"{op}: shard_start = {shard_start!r} must be an int >= 0: the packed "
                         "sequence's index of this call's first token")
    return cu_seqlens, shard_start


def _placement(op, cp_group):
    """The runtime, and whether the call runs LASP-2 (a cp_group, which must be init's)."""
    runtime = _running()
    lasp2 = cp_group is not None
    if lasp2 and tuple(dist.get_process_group_ranks(cp_group)) != runtime.ranks:
        raise ValueError(f"{op}: cp_group has the ranks {dist.get_process_group_ranks(cp_group)}, "
                         f"but lasp-shmem runs on {runtime.ranks}: LASP-2 spans the group given "
                         "to init()")
    return runtime, lasp2


def _check_inputs(op, q, k, v, g, h0, per_key_gates, delta_rule=False, beta=None, gate="g"):
    """The library's contract on the arguments' types, shapes, dtypes and strides, checked before
    anything is enqueued (and while torch.compile traces). `per_key_gates`: g is [B, T, H, Dk]
    (GLA), else [B, T, H]. `delta_rule` (Gated DeltaNet): `beta` too, its write strengths
    [B, T, H] fp32, and Dv any multiple of 64. `gate`: how messages name g (mLSTM's forget gate
    is f)."""
    named = {"q": q, "k": k, "v": v, gate: g, "initial_state": h0}
    if delta_rule:
        named["beta"] = beta
    for name, x in named.items():
        if not (isinstance(x, torch.Tensor) or (name == "initial_state" and x is None)):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, not {type(x).__name__}")
    for name, x, width in (("q", q, "Dk"), ("v", v, "Dv")):
        if x.dim() != 4:
            raise ValueError(f"{op}: {name} must be [B, T, H, {width}], not of shape "
                             f"{tuple(x.shape)}")
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    gates, gates_dims = ((b, t, h, dk), "[B, T, H, Dk]") if per_key_gates else ((b, t, h), "[B, T, H]")
    shapes = {"k": (b, t, h, dk), "v": (b, t, h, dv), gate: gates,
              "initial_state": (b, h, dk, dv), "beta": (b, t, h)}
    for name, want in shapes.items():
        x = named.get(name)
        if x is not None and tuple(x.shape) != want:
            raise ValueError(f"{op}: {name} has the shape {tuple(x.shape)}, but q "
                             f"{tuple(q.shape)} and v {tuple(v.shape)} make it {want} "
                             f"([B, T, H, Dk] q and k, [B, T, H, Dv] v, {gates_dims} {gate}"
                             f"{', [B, T, H] beta' if delta_rule else ''}, "
                             "[B, H, Dk, Dv] initial_state)")
    if min(b, t, h) < 1:
        raise ValueError(f"{op}: B, T and H must be at least 1 (q has the shape "
                         f"{tuple(q.shape)}); skip the call when there is nothing to compute")
    if delta_rule and (dk not in SUPPORTED_DIMS or dv % 64):
        raise ValueError(f"{op}: Dk = {dk} must be 64 or 128 and Dv = {dv} a multiple of 64 "
                         "(the kernels' widths); pad the heads with zero columns (and pass the "
                         "unpadded Dk's scale) or split them")
    if not delta_rule and (dk not in SUPPORTED_DIMS or dv not in SUPPORTED_DIMS):
        raise ValueError(f"{op}: Dk = {dk} and Dv = {dv} must each be 64 or 128 "
                         "(the kernels' widths); pad the heads with zero columns (and pass the "
                         "unpadded Dk's scale) or split them")
    for name, x in named.items():
        want = torch.float32 if name in (gate, "initial_state", "beta") else torch.bfloat16
        if x is not None and x.dtype != want:
            raise TypeError(f"{op}: {name} must be {want}, not {x.dtype}")
    for name, x in named.items():
        if x is not None and not x.is_contiguous():
            raise ValueError(f"{op}: {name} (strides {x.stride()}) is not "
                             "contiguous; call .contiguous() on it")


def _check_device(op, device, **named):
    for name, x in named.items():
        if x is not None and (x.device.type != "cuda" or x.device.index != device):
            raise ValueError(f"{op}: {name} is on {x.device}, but lasp-shmem runs "
                             f"on cuda:{device}")


# The custom ops: the library's forward and backward on torch's current stream.

def _forward_outputs(q, v, want_ht, lasp2, cu_seqlens=None):
    """o, the final state (shape (0,) unless asked for; with cu_seqlens one per document,
    [B * N, H, Dk, Dv]) and the state this rank's shard starts from (LASP-2 only, else shape
    (0,)): what the forward returns, real or fake."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    state = (b, h, dk, dv)
    o = v.new_empty(b, t, h, dv)
    finals = state if cu_seqlens is None else (b * (cu_seqlens.shape[0] - 1), h, dk, dv)
    ht = q.new_empty(finals if want_ht else (0,), dtype=torch.float32)
    start = q.new_empty(state if lasp2 else (0,), dtype=torch.float32)
    return o, ht, start


def _backward_outputs(q, k, v, g, want_dh0):
    dh0 = q.new_empty((q.shape[0], q.shape[2], q.shape[3], v.shape[3]) if want_dh0 else (0,),
                      dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g), dh0


class _OpCall:
    """One call of a lasp_op: its layout (the op's key), scalars and tensors by slot."""

    def __init__(self, q, v, lasp2, scale, slots, family=_abi.FAMILY_SCALAR_DECAY,
                 shard_start=0):
        b, t, h, dk = q.shape
        self.layout = (family, b, h, dk, v.shape[-1], lasp2)
        self.call = _abi.Call(scale=scale, tokens=t, shard_start=shard_start)
        self.tensors = _abi.tensors({
            slot: None if x is None else (x.data_ptr(), x.numel(), str(x.dtype))
            for slot, x in slots.items()})

    def desc(self, mode):
        """The op's descriptor, LASP-2's in the exchange mode `mode` (a name of EXCHANGE_MODES)."""
        family, b, h, dk, dv, lasp2 = self.layout
        # Every op carries the backward, so that one op per layout serves training and inference:
        # a forward that saves nothing costs the same either way.
        return _abi.op_desc(family, _abi.KIND_LASP2 if lasp2 else _abi.KIND_SINGLE_GPU, b, h, dk,
                            dv, with_backward=True, mode=EXCHANGE_MODES[mode] if lasp2 else 0)

    def enqueue(self, backward, device):
        runtime = _running()
        lasp2 = self.layout[-1]
        mode = runtime.planned.get((self.layout, backward), runtime.mode)
        if lasp2 and mode not in _CAPTURABLE and torch.cuda.is_current_stream_capturing():
            if mode == PLANNED:
                raise RuntimeError(
                    "lasp-shmem: the planner chooses a LASP-2 op's exchange mode on its first "
                    "call, which times the modes and waits for the GPU, and a CUDA graph capture "
                    "cannot hold that; run one step before capturing (as torch.compile's "
                    "'reduce-overhead' mode does)")
            raise RuntimeError(
                f"lasp-shmem: a LASP-2 call in the {mode!r} exchange mode cannot be "
                "captured into a CUDA graph: the host picks each call's half of the exchange "
                "buffers, and a replay would reuse the captured half; capture in the "
                "'overlapped' mode (set_exchange_mode('overlapped') before capturing) or run "
                "this mode without CUDA graphs")
        lib = _abi.library()
        op = runtime.ops.get(self.layout)
        if op is None:
            op = ctypes.c_void_p()
            lib.op_create(runtime.handle, ctypes.byref(self.desc(_created_in(runtime.mode))),
                          ctypes.byref(op))
            runtime.ops[self.layout] = op
        stream = ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)
        if lasp2 and mode == PLANNED:
            # Every rank reaches an op's first call of a direction at the same point of its
            # layers, so every rank plans it there, together.
            chosen = ctypes.c_int32()
            direction = _abi.DIRECTION_BACKWARD if backward else _abi.DIRECTION_FORWARD
            lib.op_plan(op, stream, direction, ctypes.byref(self.call),
                        ctypes.byref(self.tensors), ctypes.byref(chosen))
            runtime.planned[(self.layout, backward)] = _MODE_NAMES[chosen.value]
        run = lib.op_backward if backward else lib.op_forward
        run(op, stream, ctypes.byref(self.call), ctypes.byref(self.tensors))


def _forward_call(q, k, v, g, h0, scale, want_ht, lasp2, cu_seqlens=None, shard_start=0):
    """The forward's outputs and its call."""
    o, ht, start = _forward_outputs(q, v, want_ht, lasp2, cu_seqlens)
    documents = cu_seqlens is not None
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_G: g, _abi.SLOT_H0: h0,
        _abi.SLOT_O: o, _abi.SLOT_HT: ht if want_ht and not documents else None,
        _abi.SLOT_DOCUMENT_HT: ht if want_ht and documents else None,
        _abi.SLOT_START_STATE: start if lasp2 else None, _abi.SLOT_CU_SEQLENS: cu_seqlens},
        shard_start=shard_start)
    return (o, ht, start), call


def _backward_call(q, k, v, g, state, do, dht, scale, want_dh0, lasp2, writes_dh0,
                   cu_seqlens=None, shard_start=0):
    """The backward's outputs and its call; `state` is the forward's h0 on one GPU, the start
    state it saved with LASP-2. dh0 is written where `writes_dh0` (LASP-2: rank 0), else zero."""
    dq, dk, dv, dg, dh0 = _backward_outputs(q, k, v, g, want_dh0)
    if want_dh0 and not writes_dh0:
        dh0.zero_()
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_G: g,
        _abi.SLOT_START_STATE if lasp2 else _abi.SLOT_H0: state, _abi.SLOT_DO: do,
        _abi.SLOT_DHT: dht, _abi.SLOT_DQ: dq, _abi.SLOT_DK: dk, _abi.SLOT_DV: dv,
        _abi.SLOT_DG: dg, _abi.SLOT_DH0: dh0 if want_dh0 and writes_dh0 else None,
        _abi.SLOT_CU_SEQLENS: cu_seqlens}, shard_start=shard_start)
    return (dq, dk, dv, dg, dh0), call


@torch.library.custom_op("lasp_shmem::chunk_simple_gla_fwd", mutates_args=(),
                         device_types="cuda")
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
             h0: Optional[torch.Tensor], scale: float, want_ht: bool, lasp2: bool,
             cu_seqlens: Optional[torch.Tensor] = None, shard_start: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    outputs, call = _forward_call(q, k, v, g, h0, scale, want_ht, lasp2, cu_seqlens, shard_start)
    call.enqueue(backward=False, device=q.device)
    return outputs


@torch.library.custom_op("lasp_shmem::chunk_simple_gla_bwd", mutates_args=(),
                         device_types="cuda")
def _backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              state: Optional[torch.Tensor], do: torch.Tensor, dht: Optional[torch.Tensor],
              scale: float, want_dh0: bool, lasp2: bool,
              cu_seqlens: Optional[torch.Tensor] = None, shard_start: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    writes_dh0 = not lasp2 or _running().rank == 0
    outputs, call = _backward_call(q, k, v, g, state, do, dht, scale, want_dh0, lasp2,
                                   writes_dh0, cu_seqlens, shard_start)
    call.enqueue(backward=True, device=q.device)
    return outputs


@_forward.register_fake
def _(q, k, v, g, h0, scale, want_ht, lasp2, cu_seqlens=None, shard_start=0):
    return _forward_outputs(q, v, want_ht, lasp2, cu_seqlens)


@_backward.register_fake
def _(q, k, v, g, state, do, dht, scale, want_dh0, lasp2, cu_seqlens=None, shard_start=0):
    return _backward_outputs(q, k, v, g, want_dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, h0, scale, want_ht, lasp2, cu_seqlens, shard_start = inputs
    start = output[2]
    ctx.mark_non_differentiable(start)
    # The backward starts from the sequence's initial state on one GPU, from the state the
    # forward found at this rank's shard with LASP-2, over the same documents.
    ctx.save_for_backward(q, k, v, g, start if lasp2 else h0, cu_seqlens)
    ctx.scale, ctx.want_ht, ctx.lasp2, ctx.shard_start = scale, want_ht, lasp2, shard_start
    ctx.set_materialize_grads(False)  # _document_states_carry_no_gradient


def _document_states_carry_no_gradient(op, ctx, cu_seqlens, grad_o, grad_ht, v):
    """The output's gradient, zeros where the loss does not reach the output; an error where a
    gradient reached the per-document final states (output_final_state with cu_seqlens), which
    carry none yet. The forwards' contexts set_materialize_grads(False), so that an output the
    loss does not reach gets None, not zeros, and a gradient that arrives can be told apart."""
    if ctx.want_ht and cu_seqlens is not None and grad_ht is not None:
        raise NotImplementedError(
            f"{op}: a gradient reached the per-document final states (output_final_state with "
            "cu_seqlens), which carry none yet; detach them (ht.detach()) where they enter the "
            "loss")
    return torch.zeros_like(v) if grad_o is None else grad_o  # o is shaped as v


def _differentiate(ctx, grad_o, grad_ht, _grad_start):
    q, k, v, g, state, cu_seqlens = ctx.saved_tensors
    grad_o = _document_states_carry_no_gradient("chunk_simple_gla", ctx, cu_seqlens, grad_o,
                                                grad_ht, v)
    dht = grad_ht.contiguous() if ctx.want_ht and grad_ht is not None else None
    want_dh0 = ctx.needs_input_grad[4]
    dq, dk, dv, dg, dh0 = torch.ops.lasp_shmem.chunk_simple_gla_bwd(
        q, k, v, g, state, grad_o.contiguous(), dht, ctx.scale, want_dh0, ctx.lasp2, cu_seqlens,
        ctx.shard_start)
    return dq, dk, dv, dg, dh0 if want_dh0 else None, None, None, None, None, None


_forward.register_autograd(_differentiate, setup_context=_setup_context)


# GLA's forward keeps the state entering every chunk of this many tokens for the backward.
GLA_CHUNK = 64


def _gla_forward_outputs(q, v, want_ht, save_states, cu_seqlens=None):
    """GLA's o, final state (shape (0,) unless asked for; with cu_seqlens one per document,
    [B * N, H, Dk, Dv]) and the states entering every chunk, [B*H, ceil(T/64), Dk, Dv] bf16
    (shape (0,) unless saved): what the forward returns, real or fake."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    states = (b * h, (t + GLA_CHUNK - 1) // GLA_CHUNK, dk, dv)
    o, ht, _ = _forward_outputs(q, v, want_ht, False, cu_seqlens)
    return o, ht, q.new_empty(states if save_states else (0,), dtype=torch.bfloat16)


def _gla_forward_call(q, k, v, g, h0, scale, want_ht, lasp2, save_states, cu_seqlens=None,
                      shard_start=0):
    """GLA's forward outputs and its call."""
    o, ht, states = _gla_forward_outputs(q, v, want_ht, save_states, cu_seqlens)
    documents = cu_seqlens is not None
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_G: g, _abi.SLOT_H0: h0,
        _abi.SLOT_O: o, _abi.SLOT_HT: ht if want_ht and not documents else None,
        _abi.SLOT_DOCUMENT_HT: ht if want_ht and documents else None,
        _abi.SLOT_CHUNK_STATES: states if save_states else None,
        _abi.SLOT_CU_SEQLENS: cu_seqlens}, family=_abi.FAMILY_GLA, shard_start=shard_start)
    return (o, ht, states), call


def _gla_backward_call(q, k, v, g, h0, states, do, dht, scale, want_dh0, lasp2, writes_dh0,
                       cu_seqlens=None, shard_start=0):
    """GLA's backward outputs (dg fp32 [B, T, H, Dk], like g) and its call; `states` are the
    chunk states the forward saved on this rank, h0 the sequence's initial state on every rank.
    dh0 is written where `writes_dh0` (LASP-2: rank 0), else zero."""
    dq, dk, dv, dg, dh0 = _backward_outputs(q, k, v, g, want_dh0)
    if want_dh0 and not writes_dh0:
        dh0.zero_()
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_G: g, _abi.SLOT_H0: h0,
        _abi.SLOT_CHUNK_STATES: states, _abi.SLOT_DO: do, _abi.SLOT_DHT: dht,
        _abi.SLOT_DQ: dq, _abi.SLOT_DK: dk, _abi.SLOT_DV: dv, _abi.SLOT_DG: dg,
        _abi.SLOT_DH0: dh0 if want_dh0 and writes_dh0 else None,
        _abi.SLOT_CU_SEQLENS: cu_seqlens}, family=_abi.FAMILY_GLA, shard_start=shard_start)
    return (dq, dk, dv, dg, dh0), call


@torch.library.custom_op("lasp_shmem::chunk_gla_fwd", mutates_args=(), device_types="cuda")
def _gla_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 h0: Optional[torch.Tensor], scale: float, want_ht: bool, lasp2: bool,
                 save_states: bool, cu_seqlens: Optional[torch.Tensor] = None,
                 shard_start: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    outputs, call = _gla_forward_call(q, k, v, g, h0, scale, want_ht, lasp2, save_states,
                                      cu_seqlens, shard_start)
    call.enqueue(backward=False, device=q.device)
    return outputs


@torch.library.custom_op("lasp_shmem::chunk_gla_bwd", mutates_args=(), device_types="cuda")
def _gla_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  h0: Optional[torch.Tensor], states: torch.Tensor, do: torch.Tensor,
                  dht: Optional[torch.Tensor], scale: float, want_dh0: bool, lasp2: bool,
                  cu_seqlens: Optional[torch.Tensor] = None, shard_start: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    writes_dh0 = not lasp2 or _running().rank == 0
    outputs, call = _gla_backward_call(q, k, v, g, h0, states, do, dht, scale, want_dh0, lasp2,
                                       writes_dh0, cu_seqlens, shard_start)
    call.enqueue(backward=True, device=q.device)
    return outputs


@_gla_forward.register_fake
def _(q, k, v, g, h0, scale, want_ht, lasp2, save_states, cu_seqlens=None, shard_start=0):
    return _gla_forward_outputs(q, v, want_ht, save_states, cu_seqlens)


@_gla_backward.register_fake
def _(q, k, v, g, h0, states, do, dht, scale, want_dh0, lasp2, cu_seqlens=None, shard_start=0):
    return _backward_outputs(q, k, v, g, want_dh0)


def _gla_setup_context(ctx, inputs, output):
    q, k, v, g, h0, scale, want_ht, lasp2, save_states, cu_seqlens, shard_start = inputs
    states = output[2]
    ctx.mark_non_differentiable(states)
    # The backward takes the sequence's h0 on every rank, with LASP-2 too: the chunk states it
    # reads hold the earlier ranks' prefix, so no state the shard starts from is kept. It runs
    # over the same documents.
    ctx.save_for_backward(q, k, v, g, h0, states, cu_seqlens)
    ctx.scale, ctx.want_ht, ctx.lasp2, ctx.saved_states = scale, want_ht, lasp2, save_states
    ctx.shard_start = shard_start
    ctx.set_materialize_grads(False)  # _document_states_carry_no_gradient


def _gla_differentiate(ctx, grad_o, grad_ht, _grad_states):
    if not ctx.saved_states:
        # Only a direct call of the op gets here: chunk_gla saves the states whenever an input
        # requires gradients.
        raise RuntimeError(
            "lasp_shmem::chunk_gla_fwd ran with save_states=False, so it kept no chunk states "
            "for its backward; call lasp_shmem.torch.chunk_gla, or the op with save_states=True")
    q, k, v, g, h0, states, cu_seqlens = ctx.saved_tensors
    grad_o = _document_states_carry_no_gradient("chunk_gla", ctx, cu_seqlens, grad_o, grad_ht, v)
    dht = grad_ht.contiguous() if ctx.want_ht and grad_ht is not None else None
    want_dh0 = ctx.needs_input_grad[4]
    dq, dk, dv, dg, dh0 = torch.ops.lasp_shmem.chunk_gla_bwd(
        q, k, v, g, h0, states, grad_o.contiguous(), dht, ctx.scale, want_dh0, ctx.lasp2,
        cu_seqlens, ctx.shard_start)
    return dq, dk, dv, dg, dh0 if want_dh0 else None, None, None, None, None, None, None


_gla_forward.register_autograd(_gla_differentiate, setup_context=_gla_setup_context)


# Gated DeltaNet's ops: scalar decay's slots and calls with beta and its gradient.

def _gdn_backward_outputs(q, k, v, g, beta, want_dh0):
    """dq, dk, dv, dg, dbeta (fp32, like beta) and dh0 (shape (0,) unless wanted): what the
    backward returns, real or fake."""
    dq, dk, dv, dg, dh0 = _backward_outputs(q, k, v, g, want_dh0)
    return dq, dk, dv, dg, torch.empty_like(beta), dh0


def _gdn_forward_call(q, k, v, g, beta, h0, scale, want_ht, lasp2, cu_seqlens=None,
                      shard_start=0):
    """Gated DeltaNet's forward outputs (o, the final state, the state this rank's shard starts
    from with LASP-2) and its call."""
    o, ht, start = _forward_outputs(q, v, want_ht, lasp2, cu_seqlens)
    documents = cu_seqlens is not None
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_G: g, _abi.SLOT_BETA: beta,
        _abi.SLOT_H0: h0, _abi.SLOT_O: o, _abi.SLOT_HT: ht if want_ht and not documents else None,
        _abi.SLOT_DOCUMENT_HT: ht if want_ht and documents else None,
        _abi.SLOT_START_STATE: start if lasp2 else None, _abi.SLOT_CU_SEQLENS: cu_seqlens},
        family=_abi.FAMILY_GATED_DELTA, shard_start=shard_start)
    return (o, ht, start), call


def _gdn_backward_call(q, k, v, g, beta, state, do, dht, scale, want_dh0, lasp2, writes_dh0,
                      cu_seqlens=None, shard_start=0):
    """Gated DeltaNet's backward outputs and its call; `state` is the forward's h0 on one GPU, the
    start state it saved with LASP-2. dh0 is written where `writes_dh0` (LASP-2: rank 0), else
    zero."""
    dq, dk, dv, dg, dbeta, dh0 = _gdn_backward_outputs(q, k, v, g, beta, want_dh0)
    if want_dh0 and not writes_dh0:
        dh0.zero_()
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_G: g, _abi.SLOT_BETA: beta,
        _abi.SLOT_START_STATE if lasp2 else _abi.SLOT_H0: state, _abi.SLOT_DO: do,
        _abi.SLOT_DHT: dht, _abi.SLOT_DQ: dq, _abi.SLOT_DK: dk, _abi.SLOT_DV: dv,
        _abi.SLOT_DG: dg, _abi.SLOT_DBETA: dbeta,
        _abi.SLOT_DH0: dh0 if want_dh0 and writes_dh0 else None,
        _abi.SLOT_CU_SEQLENS: cu_seqlens}, family=_abi.FAMILY_GATED_DELTA, shard_start=shard_start)
    return (dq, dk, dv, dg, dbeta, dh0), call


@torch.library.custom_op("lasp_shmem::chunk_gated_delta_rule_fwd", mutates_args=(),
                         device_types="cuda")
def _gdn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, h0: Optional[torch.Tensor], scale: float, want_ht: bool,
                 lasp2: bool, cu_seqlens: Optional[torch.Tensor] = None, shard_start: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    outputs, call = _gdn_forward_call(q, k, v, g, beta, h0, scale, want_ht, lasp2, cu_seqlens,
                                      shard_start)
    call.enqueue(backward=False, device=q.device)
    return outputs


@torch.library.custom_op("lasp_shmem::chunk_gated_delta_rule_bwd", mutates_args=(),
                         device_types="cuda")
def _gdn_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: Optional[torch.Tensor], do: torch.Tensor,
                  dht: Optional[torch.Tensor], scale: float, want_dh0: bool, lasp2: bool,
                  cu_seqlens: Optional[torch.Tensor] = None, shard_start: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor]:
    writes_dh0 = not lasp2 or _running().rank == 0
    outputs, call = _gdn_backward_call(q, k, v, g, beta, state, do, dht, scale, want_dh0, lasp2,
                                       writes_dh0, cu_seqlens, shard_start)
    call.enqueue(backward=True, device=q.device)
    return outputs


@_gdn_forward.register_fake
def _(q, k, v, g, beta, h0, scale, want_ht, lasp2, cu_seqlens=None, shard_start=0):
    return _forward_outputs(q, v, want_ht, lasp2, cu_seqlens)


@_gdn_backward.register_fake
def _(q, k, v, g, beta, state, do, dht, scale, want_dh0, lasp2, cu_seqlens=None, shard_start=0):
    return _gdn_backward_outputs(q, k, v, g, beta, want_dh0)


def _gdn_setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, scale, want_ht, lasp2, cu_seqlens, shard_start = inputs
    start = output[2]
    ctx.mark_non_differentiable(start)
    # As scalar decay's: the backward starts from the sequence's initial state on one GPU, from
    # the state the forward found at this rank's shard with LASP-2, over the same documents.
    ctx.save_for_backward(q, k, v, g, beta, start if lasp2 else h0, cu_seqlens)
    ctx.scale, ctx.want_ht, ctx.lasp2, ctx.shard_start = scale, want_ht, lasp2, shard_start
    ctx.set_materialize_grads(False)  # _document_states_carry_no_gradient


def _gdn_differentiate(ctx, grad_o, grad_ht, _grad_start):
    q, k, v, g, beta, state, cu_seqlens = ctx.saved_tensors
    grad_o = _document_states_carry_no_gradient("chunk_gated_delta_rule", ctx, cu_seqlens, grad_o,
                                                grad_ht, v)
    dht = grad_ht.contiguous() if ctx.want_ht and grad_ht is not None else None
    want_dh0 = ctx.needs_input_grad[5]
    dq, dk, dv, dg, dbeta, dh0 = torch.ops.lasp_shmem.chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, state, grad_o.contiguous(), dht, ctx.scale, want_dh0, ctx.lasp2,
        cu_seqlens, ctx.shard_start)
    return dq, dk, dv, dg, dbeta, dh0 if want_dh0 else None, None, None, None, None, None


_gdn_forward.register_autograd(_gdn_differentiate, setup_context=_gdn_setup_context)


def mlstm(q, k, v, i, f, scale=None, initial_state=None, output_final_state=False,
          cu_seqlens=None, cp_group=None, shard_start=None):
    """xLSTM's matrix LSTM, mlstm_kernels' mLSTMexp (exponential input gate, sigmoid forget
    gate, normaliser n and max-state stabiliser m), in fla's layout:
    m_t = max(lf_t + m_{t-1}, i_t), C_t = e^{lf_t + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t}
    k_t^T v_t, n_t alike with k_t, h_t = scale q_t C_t / (max(|scale q_t . n_t|, e^{-m_t}) +
    1e-6), lf = logsigmoid(f).

    q, k: [B, T, H, Dk] bf16; v: [B, T, H, Dv] bf16; i, f: [B, T, H] fp32 input and forget gate
    pre-activations, finite; Dk and Dv 64 or 128; every tensor contiguous, on the runtime's GPU.
    scale: None for Dk ** -0.5. initial_state: (C [B, H, Dk, Dv], n [B, H, Dk], m [B, H]) fp32,
    or None for mlstm_kernels' zero state (0, 0, 0). Returns (h [B, T, H, Dv] bf16, the final
    state (C, n, m) if output_final_state else None). cp_group as for `chunk_simple_gla`
    (LASP-2 across the group's ranks: the final state on the group's last rank only, the initial
    state's gradient on its rank 0, zeros on the others). cu_seqlens and shard_start (packed
    documents) as for `chunk_simple_gla`: every document starts from mlstm_kernels' zero state
    and f's gradient is 0 at every document start. With cu_seqlens, output_final_state gives one
    state per document, (C [B * N, H, Dk, Dv], n [B * N, H, Dk], m [B * N, H]) fp32 (row
    b * N + n): each document's state after its last token where that token is in this call's
    slice, as the document alone ends, zeros (C, n and m) for the others, on every rank of
    cp_group; no gradient flows from them yet (a backward that reaches them raises).

    Differentiable in q, k, v, i, f and initial_state with mlstm_kernels' gradient: the
    stabilisers and denominators are held constant, so n and m of the initial state get no
    gradient and of the final state only C's gradient counts. Where an input requires gradients
    the forward keeps each token's stabiliser and denominator ([2, B, T, H] fp32) and, with
    cp_group, the states entering and leaving this rank's shard, for the backward.
    """
    op = "mlstm"
    if scale == 0:
        raise ValueError(f"{op}: scale must not be 0 (None gives Dk ** -0.5)")
    _check_inputs(op, q, k, v, f, None, per_key_gates=False, gate="f")
    if not isinstance(i, torch.Tensor):
        raise TypeError(f"{op}: i must be a torch.Tensor, not {type(i).__name__}")
    if i.shape != f.shape or i.dtype != torch.float32 or not i.is_contiguous():
        raise ValueError(f"{op}: i must be like f: [B, T, H] {tuple(f.shape)} fp32, contiguous "
                         f"(it is {tuple(i.shape)} {i.dtype})")
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    h0 = None
    if initial_state is not None:
        want = ((b, h, dk, dv), (b, h, dk), (b, h))
        if (not isinstance(initial_state, (tuple, list)) or len(initial_state) != 3
                or any(not isinstance(x, torch.Tensor) or tuple(x.shape) != w
                       or x.dtype != torch.float32 for x, w in zip(initial_state, want))):
            raise ValueError(f"{op}: initial_state must be (C, n, m), fp32 tensors of the shapes "
                             f"{want}")
        h0 = _pack_mlstm_state(initial_state)
    runtime, lasp2 = _placement(op, cp_group)
    _check_device(op, runtime.device, q=q, k=k, v=v, i=i, f=f, initial_state=h0)
    cu_seqlens, shard_start = _documents(op, cu_seqlens, shard_start, runtime, lasp2, q.shape[1],
                                         initial_state)
    save = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, i, f, h0))
    scale = dk ** -0.5 if scale is None else scale
    # Per-document final states are every rank's; the sequence's final state the last rank's.
    want_ht = output_final_state and (cu_seqlens is not None or not lasp2
                                      or runtime.rank == runtime.world - 1)
    out, ht, _, _, _ = torch.ops.lasp_shmem.mlstm_fwd(q, k, v, i, f, h0, float(scale), want_ht,
                                                      lasp2, save, cu_seqlens, shard_start)
    if not want_ht:
        return out, None
    states = b if cu_seqlens is None else b * (cu_seqlens.shape[0] - 1)
    return out, _unpack_mlstm_state(ht, states, h, dk, dv)


# The mLSTM's ops: a state (C, n, m) travels as one fp32 tensor, C then n then m (the ABI's
# layout); the forward saves the rows (every token's stabiliser and denominator) and, with
# LASP-2, the states entering and leaving the rank's shard.

def _pack_mlstm_state(state):
    return torch.cat([x.reshape(-1) for x in state])


def _unpack_mlstm_state(x, b, h, dk, dv):
    c, n, m = x.split([b * h * dk * dv, b * h * dk, b * h])
    return c.view(b, h, dk, dv), n.view(b, h, dk), m.view(b, h)


def _mlstm_forward_outputs(q, v, want_ht, lasp2, save, cu_seqlens=None):
    """h, the final state (with cu_seqlens one per document, B * N of them), the saved rows
    and the states entering and leaving the shard (each shape (0,) unless wanted): what the
    forward returns, real or fake."""
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    state = b * h * (dk * dv + dk + 1)
    finals = state if cu_seqlens is None else state * (cu_seqlens.shape[0] - 1)

    def f32(*shape):
        return q.new_empty(shape, dtype=torch.float32)

    boundary = state if lasp2 and save else 0
    return (v.new_empty(b, t, h, dv), f32(finals if want_ht else 0),
            f32(*((2, b, t, h) if save else (0,))), f32(boundary), f32(boundary))


def _mlstm_backward_outputs(q, k, v, i, want_dh0):
    """dq, dk, dv, di, df and dC_0 (shape (0,) unless wanted)."""
    b, _, h, dk = q.shape
    dc0 = q.new_empty((b, h, dk, v.shape[-1]) if want_dh0 else (0,), dtype=torch.float32)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(i),
            torch.empty_like(i), dc0)


def _mlstm_forward_call(q, k, v, i, f, h0, scale, want_ht, lasp2, save, cu_seqlens=None,
                        shard_start=0):
    """The mLSTM forward's outputs and its call."""
    out, ht, rows, start, exit_ = _mlstm_forward_outputs(q, v, want_ht, lasp2, save, cu_seqlens)
    boundary = lasp2 and save
    documents = cu_seqlens is not None
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_I_GATE: i, _abi.SLOT_G: f,
        _abi.SLOT_H0: h0, _abi.SLOT_O: out,
        _abi.SLOT_HT: ht if want_ht and not documents else None,
        _abi.SLOT_DOCUMENT_HT: ht if want_ht and documents else None,
        _abi.SLOT_SAVED_ROWS: rows if save else None,
        _abi.SLOT_START_STATE: start if boundary else None,
        _abi.SLOT_EXIT_STATE: exit_ if boundary else None, _abi.SLOT_CU_SEQLENS: cu_seqlens},
        family=_abi.FAMILY_MLSTM, shard_start=shard_start)
    return (out, ht, rows, start, exit_), call


def _mlstm_backward_call(q, k, v, i, f, entry, exit_, rows, do, dct, scale, want_dh0, lasp2,
                         writes_dh0, cu_seqlens=None, shard_start=0):
    """The mLSTM backward's outputs and its call. One GPU: `entry` is the forward's initial
    state, `exit_` its final state (read where dct is given); LASP-2: the states the forward
    wrote at this rank's shard. dC_0 is written where `writes_dh0` (LASP-2: rank 0), else zero."""
    dq, dk, dv, di, df, dc0 = _mlstm_backward_outputs(q, k, v, i, want_dh0)
    if want_dh0 and not writes_dh0:
        dc0.zero_()
    call = _OpCall(q, v, lasp2, scale, {
        _abi.SLOT_Q: q, _abi.SLOT_K: k, _abi.SLOT_V: v, _abi.SLOT_I_GATE: i, _abi.SLOT_G: f,
        _abi.SLOT_START_STATE if lasp2 else _abi.SLOT_H0: entry,
        _abi.SLOT_EXIT_STATE if lasp2 else _abi.SLOT_HT: exit_,
        _abi.SLOT_SAVED_ROWS: rows, _abi.SLOT_DO: do, _abi.SLOT_DHT: dct, _abi.SLOT_DQ: dq,
        _abi.SLOT_DK: dk, _abi.SLOT_DV: dv, _abi.SLOT_DI_GATE: di, _abi.SLOT_DG: df,
        _abi.SLOT_DH0: dc0 if want_dh0 and writes_dh0 else None,
        _abi.SLOT_CU_SEQLENS: cu_seqlens}, family=_abi.FAMILY_MLSTM, shard_start=shard_start)
    return (dq, dk, dv, di, df, dc0), call


@torch.library.custom_op("lasp_shmem::mlstm_fwd", mutates_args=(), device_types="cuda")
def _mlstm_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor,
                   f: torch.Tensor, h0: Optional[torch.Tensor], scale: float, want_ht: bool,
                   lasp2: bool, save: bool, cu_seqlens: Optional[torch.Tensor] = None,
                   shard_start: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                              torch.Tensor]:
    outputs, call = _mlstm_forward_call(q, k, v, i, f, h0, scale, want_ht, lasp2, save,
                                        cu_seqlens, shard_start)
    call.enqueue(backward=False, device=q.device)
    return outputs


@torch.library.custom_op("lasp_shmem::mlstm_bwd", mutates_args=(), device_types="cuda")
def _mlstm_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: torch.Tensor,
                    f: torch.Tensor, entry: Optional[torch.Tensor], exit_: Optional[torch.Tensor],
                    rows: torch.Tensor, do: torch.Tensor, dct: Optional[torch.Tensor],
                    scale: float, want_dh0: bool, lasp2: bool,
                    cu_seqlens: Optional[torch.Tensor] = None, shard_start: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor, torch.Tensor]:
    if rows.numel() == 0:
        raise RuntimeError("lasp_shmem::mlstm_bwd: the forward saved nothing (it ran without "
                           "gradients); call the forward with save=True")
    writes_dh0 = not lasp2 or _running().rank == 0
    outputs, call = _mlstm_backward_call(q, k, v, i, f, entry, exit_, rows, do, dct, scale,
                                         want_dh0, lasp2, writes_dh0, cu_seqlens, shard_start)
    call.enqueue(backward=True, device=q.device)
    return outputs


@_mlstm_forward.register_fake
def _(q, k, v, i, f, h0, scale, want_ht, lasp2, save, cu_seqlens=None, shard_start=0):
    return _mlstm_forward_outputs(q, v, want_ht, lasp2, save, cu_seqlens)


@_mlstm_backward.register_fake
def _(q, k, v, i, f, entry, exit_, rows, do, dct, scale, want_dh0, lasp2, cu_seqlens=None,
      shard_start=0):
    return _mlstm_backward_outputs(q, k, v, i, want_dh0)


def _mlstm_setup_context(ctx, inputs, output):
    q, k, v, i, f, h0, scale, want_ht, lasp2, save, cu_seqlens, shard_start = inputs
    _, ht, rows, start, exit_ = output
    ctx.mark_non_differentiable(rows, start, exit_)
    # One GPU: the backward starts from the initial state and reads m_T of the final state;
    # LASP-2: the states the forward found entering and leaving this rank's shard.
    final = ht if want_ht and cu_seqlens is None else None
    entry, leaving = (start, exit_) if lasp2 else (h0, final)
    # The backward runs over the same documents.
    ctx.save_for_backward(q, k, v, i, f, entry, leaving, rows, cu_seqlens)
    ctx.scale, ctx.want_ht, ctx.lasp2, ctx.shard_start = scale, want_ht, lasp2, shard_start
    ctx.set_materialize_grads(False)  # _document_states_carry_no_gradient


def _mlstm_differentiate(ctx, grad_h, grad_ht, _grad_rows, _grad_start, _grad_exit):
    q, k, v, i, f, entry, leaving, rows, cu_seqlens = ctx.saved_tensors
    grad_h = _document_states_carry_no_gradient("mlstm", ctx, cu_seqlens, grad_h, grad_ht, v)
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    dct = None
    if ctx.want_ht and grad_ht is not None:
        dct = grad_ht[:b * h * dk * dv].view(b, h, dk, dv).contiguous()
    want_dh0 = ctx.needs_input_grad[5]
    dq, dk_, dv_, di, df, dc0 = torch.ops.lasp_shmem.mlstm_bwd(
        q, k, v, i, f, entry, leaving, rows, grad_h.contiguous(), dct, ctx.scale, want_dh0,
        ctx.lasp2, cu_seqlens, ctx.shard_start)
    dh0 = None
    if want_dh0:  # n and m of the initial state get no gradient under this rule
        dh0 = torch.cat([dc0.reshape(-1), dc0.new_zeros(b * h * (dk + 1))])
    return dq, dk_, dv_, di, df, dh0, None, None, None, None, None, None


_mlstm_forward.register_autograd(_mlstm_differentiate, setup_context=_mlstm_setup_context)

