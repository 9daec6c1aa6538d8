"""lasp_shmem.torch on one GPU (skipped with a notice without one): forward and backward against
the float64 reference (scalar decay, GLA, Gated DeltaNet and mLSTM), torch.compile without a graph break,
a CUDA graph of a training step, and the library's errors. Run it in a plain pytest process
(torchrun runs test_lasp2.py), started with NVSHMEM_DISABLE_NVLS=1 and
NVSHMEM_REMOTE_TRANSPORT=none."""

import os

import pytest
import torch
from reference import (bits, delta_inputs, delta_recurrent, gate_grad_scale, gla_inputs,
                       gradients, inputs, mlstm_gate_grad_scale, mlstm_gradients, mlstm_inputs,
                       mlstm_recurrent, recurrent, rel_err)

import lasp_shmem.torch as lt

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="NOTICE: GPU tests skipped: torch sees no CUDA GPU"),
    pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1,
                       reason="NOTICE: the one-GPU tests run in a plain pytest process, not under "
                              "torchrun"),
]
TOL = 5e-3


@pytest.fixture(scope="module", autouse=True)
def runtime():
    torch.cuda.set_device(0)
    lt.init()
    lt.init()  # idempotent
    yield
    lt.shutdown()


def step(q, k, v, g, h0, grad_o, grad_ht, **kwargs):
    """o, the final state and the gradients of <o, grad_o> + <ht, grad_ht>."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, h0)]
    o, ht = lt.chunk_simple_gla(*leaves[:4], initial_state=leaves[4], output_final_state=True,
                                **kwargs)
    grads = torch.autograd.grad((o, ht), leaves, (grad_o, grad_ht))
    return (o, ht, *grads)


@pytest.mark.parametrize("dk, dv, t, scale", [(64, 128, 200, None), (128, 64, 77, 0.3)])
def test_forward_and_backward_match_the_float64_reference(dk, dv, t, scale):
    b, h = 2, 3
    q, k, v, g, h0 = inputs(b, t, h, dk, dv, "cuda", seed=5)
    grad_o = (2 * torch.rand(b, t, h, dv, device="cuda") - 1).bfloat16()
    grad_ht = torch.rand(b, h, dk, dv, device="cuda") - 0.5
    got = step(q, k, v, g, h0, grad_o, grad_ht, scale=scale)
    want = (*recurrent(q, k, v, g, h0, scale), *gradients(q, k, v, g, h0, grad_o, grad_ht, scale))
    names = ("o", "ht", "dq", "dk", "dv", "dg", "dh0")
    errors = {name: rel_err(x, y) for name, x, y in zip(names, got, want)}
    assert [x.dtype for x in got] == [torch.bfloat16, torch.float32, *(x.dtype for x in
                                                                      (q, k, v, g, h0))]
    assert max(errors.values()) <= TOL, errors
    lt.synchronize()


def test_without_initial_state_or_final_state():
    q, k, v, g, _ = inputs(1, 130, 2, 64, 64, "cuda", seed=6)
    grad_o = (2 * torch.rand(1, 130, 2, 64, device="cuda") - 1).bfloat16()
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, ht = lt.chunk_simple_gla(*leaves)
    assert ht is None
    got = (o, *torch.autograd.grad(o, leaves, grad_o))
    want = (recurrent(q, k, v, g)[0], *gradients(q, k, v, g, None, grad_o)[:4])
    errors = {name: rel_err(x, y) for name, x, y in zip(("o", "dq", "dk", "dv", "dg"), got, want)}
    assert max(errors.values()) <= TOL, errors


def test_compiled_block_has_no_graph_break_and_the_eager_results():
    b, t, h, d = 2, 100, 2, 64
    q, k, v, g, h0 = inputs(b, t, h, d, d, "cuda", seed=7)
    # Weights that bf16 holds exactly: the gradients reaching the ops are the same bits in both.
    w_o = (2 * torch.rand(b, t, h, d, device="cuda") - 1).bfloat16().float()
    w_ht = torch.rand(b, h, d, d, device="cuda")

    def block(q, k, v, g, h0):
        o, ht = lt.chunk_simple_gla(q, k, v, g, initial_state=h0, output_final_state=True)
        return (o.float() * w_o).sum() + (ht * w_ht).sum()

    explained = torch._dynamo.explain(block)(q, k, v, g, h0)
    assert explained.graph_break_count == 0, explained.break_reasons

    def run(fn):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
        loss = fn(*leaves)
        loss.backward()
        return [loss] + [x.grad for x in leaves]

    eager = run(block)
    compiled = run(torch.compile(block, fullgraph=True))
    assert rel_err(compiled[0], eager[0]) <= 1e-5
    for x, y in zip(compiled[1:], eager[1:]):
        assert torch.equal(bits(x), bits(y))


def test_a_captured_training_step_replays_bitwise():
    """Forward and backward captured in one torch.cuda.graph (after one uncaptured step of the
    layout, which makes the op and sizes its workspaces) and replayed: every output and gradient
    as the uncaptured step's, bit for bit."""
    b, t, h, dk, dv = 2, 150, 2, 128, 128
    q, k, v, g, h0 = inputs(b, t, h, dk, dv, "cuda", seed=8)
    grad_o = (2 * torch.rand(b, t, h, dv, device="cuda") - 1).bfloat16()
    grad_ht = torch.rand(b, h, dk, dv, device="cuda") - 0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]

    def training_step():
        o, ht = lt.chunk_simple_gla(*leaves[:4], initial_state=leaves[4],
                                    output_final_state=True)
        return (o, ht, *torch.autograd.grad((o, ht), leaves, (grad_o, grad_ht)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        want = [x.clone() for x in training_step()]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = training_step()
    for _ in range(20):
        for x in captured:
            x.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(captured, want):
            assert torch.equal(bits(x), bits(y))
    lt.synchronize()


def test_the_library_refuses_a_misaligned_tensor_with_its_message():
    q, k, v, g, _ = inputs(1, 64, 2, 64, 64, "cuda", seed=9)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device="cuda")[1:].view(q.shape)
    shifted.copy_(q)
    with pytest.raises(lt.LaspError, match="not 16-byte aligned") as e:
        lt.chunk_simple_gla(shifted, k, v, g)
    assert e.value.status == 1  # LASP_ERROR_INVALID_ARGUMENT


def test_a_tensor_on_another_gpu_is_refused():
    if torch.cuda.device_count() < 2:
        pytest.skip("NOTICE: needs a second GPU")
    q, k, v, g, _ = inputs(1, 64, 2, 64, 64, "cuda", seed=10)
    with pytest.raises(ValueError, match="k is on cuda:1, but lasp-shmem runs on cuda:0"):
        lt.chunk_simple_gla(q, k.to("cuda:1"), v, g)


@pytest.mark.parametrize("dk, dv, t", [(64, 128, 200), (128, 128, 1000), (128, 64, 77)])
def test_gla_forward_matches_the_float64_reference(dk, dv, t):
    b, h = 2, 3
    q, k, v, g, h0 = inputs(b, t, h, dk, dv, "cuda", seed=8)
    # Per-key gates: the scalar ones spread over the key dimensions (some stay exactly 0).
    g = (g[..., None] * torch.linspace(0.0, 2.0, dk, device="cuda")).contiguous()
    with torch.no_grad():
        o, ht = lt.chunk_gla(q, k, v, g, initial_state=h0, output_final_state=True)
        again, _ = lt.chunk_gla(q, k, v, g, initial_state=h0)
    want_o, want_ht = recurrent(q, k, v, g, h0)
    errors = {"o": rel_err(o, want_o), "ht": rel_err(ht, want_ht)}
    assert max(errors.values()) <= TOL, errors
    assert torch.equal(bits(o), bits(again))


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 100, 300])
@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("with_dht", [False, True])
def test_gla_forward_and_backward_match_the_float64_reference(d, t, with_h0, with_dht):
    """chunk_gla on one GPU, forward and backward, against float64 autograd through the
    recurrence: ||x - ref|| / ||ref|| <= 5e-3 for o, ht, dq, dk, dv and dh0; dg to within 5e-3
    of its scale, the larger of ||ref dg|| and `gate_grad_scale` (the size of the terms dg is
    the difference of, which cancel under strong decays)."""
    b, h = 2, 2
    q, k, v, g, h0 = gla_inputs(b, t, h, d, d, "cuda", seed=11)
    h0 = h0 if with_h0 else None
    grad_o = (2 * torch.rand(b, t, h, d, device="cuda") - 1).bfloat16()
    grad_ht = torch.rand(b, h, d, d, device="cuda") - 0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0) if x is not None]
    o, ht = lt.chunk_gla(*leaves[:4], initial_state=leaves[4] if with_h0 else None,
                         output_final_state=with_dht)
    outputs, cotangents = ((o, ht), (grad_o, grad_ht)) if with_dht else ((o,), (grad_o,))
    got = dict(zip(("dq", "dk", "dv", "dg", "dh0"),
                   torch.autograd.grad(outputs, leaves, cotangents)))
    wide = [x.double().requires_grad_() for x in (q, k, v, g, h0) if x is not None]
    o64, ht64 = recurrent(*wide[:4], wide[4] if with_h0 else None)
    want = dict(zip(("dq", "dk", "dv", "dg", "dh0"), torch.autograd.grad(
        (o64, ht64) if with_dht else (o64,), wide,
        tuple(x.double() for x in cotangents))))
    assert [got[n].dtype for n in got] == [x.dtype for x in leaves]
    errors = {"o": rel_err(o, o64)}
    if with_dht:
        errors["ht"] = rel_err(ht, ht64)
    errors |= {n: rel_err(got[n], want[n]) for n in ("dq", "dk", "dv", "dh0") if n in got}
    dg_scale = max(want["dg"].norm().item(),
                   gate_grad_scale(q, k, want["dq"], want["dk"]))
    errors["dg"] = (got["dg"].double() - want["dg"]).norm().item() / dg_scale
    assert max(errors.values()) <= TOL, errors
    lt.synchronize()


def test_gla_training_repeats_bitwise_and_inference_agrees():
    """Two training steps of one layout give the same bits; a forward without gradients (which
    keeps no chunk states) gives the training forward's o."""
    q, k, v, g, h0 = gla_inputs(2, 200, 2, 64, 128, "cuda", seed=12)
    grad_o = (2 * torch.rand(2, 200, 2, 128, device="cuda") - 1).bfloat16()

    def train():
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0)]
        o, _ = lt.chunk_gla(*leaves[:4], initial_state=leaves[4])
        return (o, *torch.autograd.grad(o, leaves, grad_o))

    first, second = train(), train()
    for x, y in zip(first, second):
        assert torch.equal(bits(x), bits(y))
    with torch.no_grad():
        o, _ = lt.chunk_gla(q, k, v, g, initial_state=h0)
    assert rel_err(o, first[0]) <= TOL


@pytest.mark.parametrize("dk, dv", [(64, 64), (128, 128), (64, 192)])
@pytest.mark.parametrize("t", [63, 100, 300])
@pytest.mark.parametrize("with_h0", [False, True])
def test_gated_delta_forward_and_backward_match_the_float64_reference(dk, dv, t, with_h0):
    """chunk_gated_delta_rule on one GPU, forward and backward (beta given in bf16), against
    float64 autograd through the recurrence: ||x - ref|| / ||ref|| <= 5e-3 for o, ht, dq, dk, dv
    and dh0; dg and dbeta, sums whose terms cancel, within 1e-2 of their scale (the Rust GPU test
    holds them to their products' l2 norm). Sequences of one token are the Rust GPU test's: there
    a row of dq is one scalar times k, whose few bf16 roundings are not averaged over tokens."""
    b, h = 2, 2
    q, k, v, g, beta, h0 = delta_inputs(b, t, h, dk, dv, "cuda", seed=13)
    beta = beta.bfloat16()
    h0 = h0 if with_h0 else None
    grad_o = (2 * torch.rand(b, t, h, dv, device="cuda") - 1).bfloat16()
    grad_ht = torch.rand(b, h, dk, dv, device="cuda") - 0.5
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
    o, ht = lt.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5] if with_h0 else None,
                                      output_final_state=True)
    got = dict(zip(names, torch.autograd.grad((o, ht), leaves, (grad_o, grad_ht))))
    wide = [x.double().requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
    o64, ht64 = delta_recurrent(*wide[:5], wide[5] if with_h0 else None)
    want = dict(zip(names, torch.autograd.grad((o64, ht64), wide,
                                               (grad_o.double(), grad_ht.double()))))
    assert [got[n].dtype for n in got] == [x.dtype for x in leaves]
    errors = {"o": rel_err(o, o64), "ht": rel_err(ht, ht64)}
    errors |= {n: rel_err(got[n], want[n]) for n in ("dq", "dk", "dv", "dh0") if n in got}
    assert max(errors.values()) <= TOL, errors
    # dg to the larger of its norm and the size of the terms it is the difference of (zero at
    # T = 1 from a zero state, where those terms are not); dbeta to its norm.
    dg_scale = max(want["dg"].norm().item(), gate_grad_scale(q, k, want["dq"], want["dk"]))
    gates = {"dg": (got["dg"].double() - want["dg"]).norm().item() / dg_scale,
             "dbeta": rel_err(got["dbeta"], want["dbeta"])}
    assert max(gates.values()) <= 1e-2, gates
    lt.synchronize()


@pytest.mark.parametrize("family", ["simple_gla", "gla", "gated_delta_rule"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_documents_match_each_document_alone(family, dtype):
    """cu_seqlens on one GPU (documents of 1 to 200 tokens, the offsets padded with the total):
    o, dq, dk, dv against float64 autograd through each document's own recurrence (5e-3), dg
    (and dbeta) within 1e-2 of their scale, dg exactly 0 at every document start (GLA's in every
    key dimension)."""
    lengths = [1, 63, 64, 65, 200, 7]
    t, b, h, d = sum(lengths), 2, 2, 128
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    cu = torch.tensor(starts + [t, t, t], dtype=dtype, device="cuda")
    delta_rule = family == "gated_delta_rule"
    q, k, v, g, beta, _ = delta_inputs(b, t, h, d, d, "cuda", seed=17)
    if family == "simple_gla":
        q, k, v, g, _ = inputs(b, t, h, d, d, "cuda", seed=17)
    elif family == "gla":
        q, k, v, g, _ = gla_inputs(b, t, h, d, d, "cuda", seed=17)
    grad_o = (2 * torch.rand(b, t, h, d, device="cuda") - 1).bfloat16()
    leaves = [x.clone().requires_grad_() for x in ((q, k, v, g, beta) if delta_rule
                                                   else (q, k, v, g))]
    attention = getattr(lt, f"chunk_{family}")
    o, ht = attention(*leaves, cu_seqlens=cu)
    got = torch.autograd.grad(o, leaves, grad_o)
    wide = [x.double().requires_grad_() for x in leaves]
    step = delta_recurrent if delta_rule else recurrent
    bounds = list(zip(starts, starts[1:] + [t]))
    o64 = torch.cat([step(*(x[:, a:z] for x in wide), None)[0] for a, z in bounds], dim=1)
    want = torch.autograd.grad(o64, wide, grad_o.double())
    assert ht is None
    errors = {"o": rel_err(o, o64)}
    errors |= {n: rel_err(x, y) for n, x, y in zip(("dq", "dk", "dv"), got, want)}
    assert max(errors.values()) <= TOL, errors
    dg_scale = max(want[3].norm().item(), gate_grad_scale(q, k, want[0], want[1]))
    gates = {"dg": (got[3].double() - want[3]).norm().item() / dg_scale}
    if delta_rule:
        gates["dbeta"] = rel_err(got[4], want[4])
    assert max(gates.values()) <= 1e-2, gates
    assert got[3][:, starts].abs().max().item() == 0
    lt.synchronize()


@pytest.mark.parametrize("family", ["simple_gla", "gla", "gated_delta_rule", "mlstm"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_per_document_final_states_match_each_document_alone(family, dtype):
    """output_final_state with cu_seqlens on one GPU (documents of 1 to 300 tokens, some across
    chunk boundaries, the offsets padded with the total): every document's final state (the
    mLSTM's C, n and m) against float64 through its own recurrence (5e-3), the padding's empty
    documents exactly 0, the output bitwise the same as without the states, and a backward that
    reaches the states refused."""
    lengths = [1, 63, 64, 65, 200, 300, 7, 180]
    t, b, h, d = sum(lengths), 2, 2, 128
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    cu = torch.tensor(starts + [t, t, t], dtype=dtype, device="cuda")
    if family == "gated_delta_rule":
        tensors = delta_inputs(b, t, h, d, d, "cuda", seed=19)[:5]
    elif family == "gla":
        tensors = gla_inputs(b, t, h, d, d, "cuda", seed=19)[:4]
    elif family == "mlstm":
        tensors = mlstm_inputs(b, t, h, d, d, "cuda", seed=19)[:5]
    else:
        tensors = inputs(b, t, h, d, d, "cuda", seed=19)[:4]
    steps = {"gated_delta_rule": delta_recurrent, "mlstm": mlstm_recurrent}
    step = steps.get(family, recurrent)
    attention = lt.mlstm if family == "mlstm" else getattr(lt, f"chunk_{family}")
    leaves = [x.clone().requires_grad_() for x in tensors]
    o, ht = attention(*leaves, cu_seqlens=cu, output_final_state=True)
    plain, _ = attention(*tensors, cu_seqlens=cu)
    docs = cu.numel() - 1
    parts = ht if family == "mlstm" else (ht,)
    shapes = [(d, d), (d,), ()] if family == "mlstm" else [(d, d)]
    bounds = list(zip(starts, starts[1:] + [t]))
    wants = [step(*(x[:, a:z].double() for x in tensors), None)[1] for a, z in bounds]
    if family != "mlstm":
        wants = [(want,) for want in wants]
    for j, (part, shape) in enumerate(zip(parts, shapes, strict=True)):
        assert part.shape == (b * docs, h, *shape)
        finals = part.view(b, docs, h, *shape)
        want = torch.stack([w[j] for w in wants], dim=1)
        assert rel_err(finals[:, :len(lengths)], want) <= TOL, j
        assert finals[:, len(lengths):].abs().max().item() == 0
    assert torch.equal(o, plain)
    with pytest.raises(NotImplementedError, match="carry none yet"):
        torch.autograd.grad(o.float().sum() + parts[0].sum(), leaves)
    lt.synchronize()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_mlstm_packed_documents_match_each_document_alone(dtype):
    """mlstm with cu_seqlens on one GPU (documents of 1 to 200 tokens, the offsets padded with
    the total): h and dq, dk, dv against each document's own float64 recurrence and mlstm_kernels'
    gradient (5e-3), di and df within 5e-3 of their terms' scale, df exactly 0 at every start,
    a second step bitwise equal."""
    lengths = [1, 63, 64, 65, 200, 7]
    t, b, h, d = sum(lengths), 2, 2, 128
    starts = [sum(lengths[:n]) for n in range(len(lengths))]
    cu = torch.tensor(starts + [t, t, t], dtype=dtype, device="cuda")
    q, k, v, i, f, _ = mlstm_inputs(b, t, h, d, d, "cuda", seed=29)
    grad_h = (2 * torch.rand(b, t, h, d, device="cuda") - 1).bfloat16()

    def step():
        leaves = [x.clone().requires_grad_() for x in (q, k, v, i, f)]
        out, ht = lt.mlstm(*leaves, scale=0.1, cu_seqlens=cu)
        assert ht is None
        return (out, *torch.autograd.grad(out, leaves, grad_h))

    got, again = step(), step()
    bounds = list(zip(starts, starts[1:] + [t]))
    piece = [(mlstm_recurrent(*(x[:, a:z] for x in (q, k, v, i, f)), None, 0.1)[0],
              *mlstm_gradients(*(x[:, a:z] for x in (q, k, v, i, f)), None, grad_h[:, a:z],
                               None, 0.1)[:5]) for a, z in bounds]
    want = [torch.cat(parts, dim=1) for parts in zip(*piece)]
    errors = {n: rel_err(x, y) for n, x, y in zip(("h", "dq", "dk", "dv"), got[:4], want[:4])}
    scale = mlstm_gate_grad_scale(q, k, want[1], want[2])
    for n, x, y in (("di", got[4], want[4]), ("df", got[5], want[5])):
        errors[n] = (x.double() - y).norm().item() / scale
    assert max(errors.values()) <= TOL, errors
    assert got[5][:, starts].abs().max().item() == 0
    for x, y in zip(got, again):
        assert torch.equal(bits(x), bits(y))
    lt.synchronize()


def test_gated_delta_normalises_q_and_k_as_fla_does():
    """use_qk_l2norm_in_kernel=True on unnormalised q and k gives the outputs of their fla-style
    l2-normalised copies, bit for bit."""
    q, k, v, g, beta, _ = delta_inputs(1, 70, 2, 128, 128, "cuda", seed=14)
    q, k = (3 * q.float()).bfloat16(), (0.25 * k.float()).bfloat16()
    o, _ = lt.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    want, _ = lt.chunk_gated_delta_rule(lt._l2norm(q), lt._l2norm(k), v, g, beta)
    assert torch.equal(bits(o), bits(want))


def mlstm_step(q, k, v, i, f, state, grad_h, grad_c, **kwargs):
    """h, the final state's C and the gradients of <h, grad_h> + <C_T, grad_c> (the initial
    state's C's where `state` is given)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, i, f)]
    c0 = None if state is None else state[0].clone().requires_grad_()
    out, ht = lt.mlstm(*leaves, initial_state=None if c0 is None else (c0, *state[1:]),
                       output_final_state=True, **kwargs)
    wrt = leaves + ([] if c0 is None else [c0])
    return (out, ht[0], *torch.autograd.grad((out, ht[0]), wrt, (grad_h, grad_c)))


@pytest.mark.parametrize("dk, dv", [(64, 64), (128, 128), (64, 128)])
@pytest.mark.parametrize("t", [63, 300])
@pytest.mark.parametrize("with_state", [False, True])
def test_mlstm_forward_and_backward_match_the_float64_reference(dk, dv, t, with_state):
    """h and the final state's C against the stabilised recurrence, every gradient against
    mlstm_kernels' rule in closed form (reference.mlstm_gradients): 5e-3 relative, the gates'
    to 5e-3 of the terms they are differences of; a second step gives the same bits."""
    b, h = 2, 3
    q, k, v, i, f, state = mlstm_inputs(b, t, h, dk, dv, "cuda", seed=71)
    state = state if with_state else None
    grad_h = (2 * torch.rand(b, t, h, dv, device="cuda") - 1).bfloat16()
    grad_c = torch.rand(b, h, dk, dv, device="cuda") - 0.5
    got = mlstm_step(q, k, v, i, f, state, grad_h, grad_c, scale=0.1)
    again = mlstm_step(q, k, v, i, f, state, grad_h, grad_c, scale=0.1)
    want_h, (want_c, _, _) = mlstm_recurrent(q, k, v, i, f, state, 0.1)
    want = mlstm_gradients(q, k, v, i, f, state, grad_h, grad_c, 0.1)
    names = ["h", "C_T", "dq", "dk", "dv"] + (["dC0"] if with_state else [])
    pairs = list(zip(got[:5], (want_h, want_c, *want[:3]))) + (
        [(got[7], want[5])] if with_state else [])
    errors = {name: rel_err(x, y) for name, (x, y) in zip(names, pairs)}
    scale = mlstm_gate_grad_scale(q, k, want[0], want[1])
    for name, x, y in (("di", got[5], want[3]), ("df", got[6], want[4])):
        errors[name] = (x.double() - y).norm().item() / scale
    assert max(errors.values()) <= TOL, errors
    for x, y in zip(got, again):
        assert torch.equal(bits(x), bits(y))
    lt.synchronize()

