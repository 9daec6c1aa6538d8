"""lasp_shmem.torch without a GPU: the argument checks, init's refusals, the custom ops'
registration and fake implementations (torch.library.opcheck, torch.compile), the calls the ops
make, checked by the library itself (lasp_op_check_call), and the exchange mode switch against a
stand-in library.

The ops' CUDA kernels need a GPU; here the float64 reference stands in as their CPU kernel
(registered by this module only), so that opcheck and torch.compile run every other part."""

import ctypes
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from reference import (delta_gradients, delta_inputs, delta_recurrent, gradients, inputs,
                       mlstm_gradients, mlstm_inputs, mlstm_recurrent, recurrent)

import lasp_shmem.torch as lt
from lasp_shmem import _abi

B, T, H, DK, DV = 2, 9, 2, 64, 128
FWD, BWD = torch.ops.lasp_shmem.chunk_simple_gla_fwd, torch.ops.lasp_shmem.chunk_simple_gla_bwd
GLA_FWD, GLA_BWD = torch.ops.lasp_shmem.chunk_gla_fwd, torch.ops.lasp_shmem.chunk_gla_bwd
GDN_FWD = torch.ops.lasp_shmem.chunk_gated_delta_rule_fwd
GDN_BWD = torch.ops.lasp_shmem.chunk_gated_delta_rule_bwd
MLSTM_FWD, MLSTM_BWD = torch.ops.lasp_shmem.mlstm_fwd, torch.ops.lasp_shmem.mlstm_bwd
# The save_states argument of every call of GLA's forward kernel below, in order.
GLA_SAVES = []
# The lasp2 argument of every call of GLA's backward kernel below, in order.
GLA_BACKWARDS = []


def documents(cu_seqlens, shard_start, t):
    """The token ranges of the documents (or their parts) in a call's t tokens."""
    if cu_seqlens is None:
        return [(0, t)]
    starts = sorted({min(max(int(s) - shard_start, 0), t) for s in cu_seqlens} | {0, t})
    return list(zip(starts[:-1], starts[1:]))


def per_document(fn, cu_seqlens, shard_start, *tensors):
    """fn over each document of [B, T, ...] tensors on its own (from the zero state), its
    results concatenated along T: the packed reference."""
    pieces = [fn(*(x[:, a:b] for x in tensors))
              for a, b in documents(cu_seqlens, shard_start, tensors[0].shape[1])]
    return [torch.cat(parts, dim=1) for parts in zip(*pieces)]


def document_finals(step, ht, cu_seqlens, shard_start, *tensors):
    """Fills the per-document final states ht [B * N, H, Dk, Dv] as the ops' stand-ins: each
    document that ends in the call from its first token in the call (`step`, the family's float64
    recurrence), zeros for the others."""
    docs, t = cu_seqlens.shape[0] - 1, tensors[0].shape[1]
    finals = ht.view(tensors[0].shape[0], docs, *ht.shape[1:])
    finals.zero_()
    for n in range(docs):
        a, z = (int(cu_seqlens[n + j]) - shard_start for j in (0, 1))
        if z > a and 1 <= z <= t:
            finals[:, n] = step(*(x[:, max(a, 0):z] for x in tensors), None, 0.125)[1]


@torch.library.register_kernel("lasp_shmem::chunk_simple_gla_fwd", "cpu")
def _forward_on_cpu(q, k, v, g, h0, scale, want_ht, lasp2, cu_seqlens=None, shard_start=0):
    o, ht, start = lt._forward_outputs(q, v, want_ht, lasp2, cu_seqlens)
    if cu_seqlens is not None:  # the public function refuses h0 with documents
        o.copy_(per_document(lambda *x: recurrent(*x, None, scale)[:1], cu_seqlens, shard_start,
                             q, k, v, g)[0])
        if want_ht:
            document_finals(recurrent, ht, cu_seqlens, shard_start, q, k, v, g)
        if lasp2:
            start.zero_()
        return o, ht, start
    want_o, want_ht_ = recurrent(q, k, v, g, h0, scale)
    o.copy_(want_o)
    if want_ht:
        ht.copy_(want_ht_)
    if lasp2:  # one rank: the shard starts from the sequence's initial state
        start.copy_(torch.zeros_like(start) if h0 is None else h0)
    return o, ht, start


def packed_gradients(outputs, q, k, v, g, do, scale, cu_seqlens, shard_start):
    """Fills a backward's dq, dk, dv, dg with the reference's gradients of each document alone."""
    grads = per_document(lambda q, k, v, g, do: gradients(q, k, v, g, None, do, None, scale)[:4],
                         cu_seqlens, shard_start, q, k, v, g, do)
    for out, grad in zip(outputs, grads):
        out.copy_(grad)
    return outputs


@torch.library.register_kernel("lasp_shmem::chunk_simple_gla_bwd", "cpu")
def _backward_on_cpu(q, k, v, g, state, do, dht, scale, want_dh0, lasp2, cu_seqlens=None,
                     shard_start=0):
    outputs = lt._backward_outputs(q, k, v, g, want_dh0)
    if cu_seqlens is not None:
        return packed_gradients(outputs, q, k, v, g, do, scale, cu_seqlens, shard_start)
    for out, grad in zip(outputs, gradients(q, k, v, g, state, do, dht, scale)):
        if out.numel():  # not dh0 unless wanted
            out.copy_(grad)
    return outputs


@torch.library.register_kernel("lasp_shmem::chunk_gla_fwd", "cpu")
def _gla_forward_on_cpu(q, k, v, g, h0, scale, want_ht, lasp2, save_states, cu_seqlens=None,
                        shard_start=0):
    GLA_SAVES.append(save_states)
    o, ht, states = lt._gla_forward_outputs(q, v, want_ht, save_states, cu_seqlens)
    if cu_seqlens is not None:  # the public function refuses h0 with documents
        o.copy_(per_document(lambda *x: recurrent(*x, None, scale)[:1], cu_seqlens, shard_start,
                             q, k, v, g)[0])
        if want_ht:
            document_finals(recurrent, ht, cu_seqlens, shard_start, q, k, v, g)
        states.zero_()  # the reference backward below reads none of them
        return o, ht, states
    want_o, want_ht_ = recurrent(q, k, v, g, h0, scale)
    o.copy_(want_o)
    if want_ht:
        ht.copy_(want_ht_)
    if save_states:
        # The state entering each chunk (the kernels scale it their own way; the reference
        # backward below recomputes what it needs and reads none of it).
        b, _, h, dk = q.shape
        state = torch.zeros(b, h, dk, v.shape[-1]) if h0 is None else h0
        for n in range(states.shape[1]):
            if n:
                chunk = slice((n - 1) * lt.GLA_CHUNK, n * lt.GLA_CHUNK)
                state = recurrent(q[:, chunk], k[:, chunk], v[:, chunk], g[:, chunk], state)[1]
            states[:, n] = state.reshape(b * h, dk, -1)
    return o, ht, states


@torch.library.register_kernel("lasp_shmem::chunk_gla_bwd", "cpu")
def _gla_backward_on_cpu(q, k, v, g, h0, states, do, dht, scale, want_dh0, lasp2,
                         cu_seqlens=None, shard_start=0):
    # One rank: with LASP-2 too its shard is the whole sequence.
    GLA_BACKWARDS.append(lasp2)
    outputs = lt._backward_outputs(q, k, v, g, want_dh0)
    if cu_seqlens is not None:
        return packed_gradients(outputs, q, k, v, g, do, scale, cu_seqlens, shard_start)
    for out, grad in zip(outputs, gradients(q, k, v, g, h0, do, dht, scale)):
        if out.numel():  # not dh0 unless wanted
            out.copy_(grad)
    return outputs


@torch.library.register_kernel("lasp_shmem::chunk_gated_delta_rule_fwd", "cpu")
def _gdn_forward_on_cpu(q, k, v, g, beta, h0, scale, want_ht, lasp2, cu_seqlens=None,
                        shard_start=0):
    o, ht, start = lt._forward_outputs(q, v, want_ht, lasp2, cu_seqlens)
    if cu_seqlens is not None:  # the public function refuses h0 with documents
        o.copy_(per_document(lambda *x: delta_recurrent(*x, None, scale)[:1], cu_seqlens,
                             shard_start, q, k, v, g, beta)[0])
        if want_ht:
            document_finals(delta_recurrent, ht, cu_seqlens, shard_start, q, k, v, g, beta)
        if lasp2:
            start.zero_()
        return o, ht, start
    want_o, want_ht_ = delta_recurrent(q, k, v, g, beta, h0, scale)
    o.copy_(want_o)
    if want_ht:
        ht.copy_(want_ht_)
    if lasp2:  # one rank: the shard starts from the sequence's initial state
        start.copy_(torch.zeros_like(start) if h0 is None else h0)
    return o, ht, start


@torch.library.register_kernel("lasp_shmem::chunk_gated_delta_rule_bwd", "cpu")
def _gdn_backward_on_cpu(q, k, v, g, beta, state, do, dht, scale, want_dh0, lasp2,
                         cu_seqlens=None, shard_start=0):
    outputs = lt._gdn_backward_outputs(q, k, v, g, beta, want_dh0)
    if cu_seqlens is not None:
        grads = per_document(
            lambda q, k, v, g, beta, do: delta_gradients(q, k, v, g, beta, None, do, None,
                                                         scale)[:5],
            cu_seqlens, shard_start, q, k, v, g, beta, do)
        for out, grad in zip(outputs, grads):
            out.copy_(grad)
        return outputs
    for out, grad in zip(outputs, delta_gradients(q, k, v, g, beta, state, do, dht, scale)):
        if out.numel():  # not dh0 unless wanted
            out.copy_(grad)
    return outputs


@torch.library.register_kernel("lasp_shmem::mlstm_fwd", "cpu")
def _mlstm_forward_on_cpu(q, k, v, i, f, h0, scale, want_ht, lasp2, save, cu_seqlens=None,
                          shard_start=0):
    b, _, h, dk = q.shape
    dv = v.shape[-1]
    out, ht, rows, start, exit_ = lt._mlstm_forward_outputs(q, v, want_ht, lasp2, save,
                                                            cu_seqlens)
    if cu_seqlens is not None:
        out.copy_(per_document(lambda *x: mlstm_recurrent(*x, None, scale)[:1], cu_seqlens,
                               shard_start, q, k, v, i, f)[0])
        if want_ht:  # C, n and m of every document, packed as the ABI's tensor
            docs = cu_seqlens.shape[0] - 1
            finals = [torch.zeros(b, docs, h, dk, dv), torch.zeros(b, docs, h, dk),
                      torch.zeros(b, docs, h)]
            for n in range(docs):
                a, z = (int(cu_seqlens[n + j]) - shard_start for j in (0, 1))
                if z > a and 1 <= z <= q.shape[1]:
                    state = mlstm_recurrent(*(x[:, max(a, 0):z] for x in (q, k, v, i, f)), None,
                                            scale)[1]
                    for part, x in zip(finals, state):
                        part[:, n] = x
            ht.copy_(lt._pack_mlstm_state(finals))
        rows.zero_()
        start.zero_()
        exit_.zero_()
        return out, ht, rows, start, exit_
    state = None if h0 is None else lt._unpack_mlstm_state(h0, b, h, dk, dv)
    want_h, final = mlstm_recurrent(q, k, v, i, f, state, scale)
    out.copy_(want_h)
    final = lt._pack_mlstm_state(final)
    if want_ht:
        ht.copy_(final)
    rows.zero_()  # the stand-in backward recomputes the rows
    if start.numel():  # one rank: the shard is the whole sequences
        start.copy_(torch.zeros_like(start) if h0 is None else h0)
        exit_.copy_(final)
    return out, ht, rows, start, exit_


@torch.library.register_kernel("lasp_shmem::mlstm_bwd", "cpu")
def _mlstm_backward_on_cpu(q, k, v, i, f, entry, exit_, rows, do, dct, scale, want_dh0, lasp2,
                           cu_seqlens=None, shard_start=0):
    b, _, h, dk = q.shape
    state = None if entry is None else lt._unpack_mlstm_state(entry, b, h, dk, v.shape[-1])
    outputs = lt._mlstm_backward_outputs(q, k, v, i, want_dh0)
    if cu_seqlens is not None:  # each document from the zero state; f's gradient 0 at a start
        grads = per_document(lambda *x: mlstm_gradients(*x[:5], None, x[5], None, scale)[:5],
                             cu_seqlens, shard_start, q, k, v, i, f, do)
        for out, grad in zip(outputs, grads):
            out.copy_(grad)
        firsts = [a for a, _ in documents(cu_seqlens, shard_start, q.shape[1])
                  if a + shard_start in {int(s) for s in cu_seqlens}]
        outputs[4][:, firsts] = 0
        return outputs
    for out, grad in zip(outputs, mlstm_gradients(q, k, v, i, f, state, do, dct, scale)):
        if out.numel():  # not dC_0 unless wanted
            out.copy_(grad)
    return outputs


@pytest.mark.parametrize("per_key_gates", [False, True])
def test_the_reference_backward_is_autograds(per_key_gates):
    q, k, v, g, h0 = (x.double().requires_grad_()
                      for x in (gla_inputs(t=6) if per_key_gates else cpu_inputs(t=6)))
    do, dht = torch.rand(B, 6, H, DV, dtype=torch.float64), torch.rand(B, H, DK, DV).double()
    o, ht = recurrent(q, k, v, g, h0, 0.3)
    want = torch.autograd.grad((o, ht), (q, k, v, g, h0), (do, dht))
    for got, expected in zip(gradients(q, k, v, g, h0, do, dht, 0.3), want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.fixture
def runtime(monkeypatch):
    """A runtime of one process on cuda:0 as the torch layer sees it, with no library behind it:
    enough for the checks that come before any call."""
    monkeypatch.setattr(lt, "_runtime", lt._Runtime(None, None, None, 0, 1, 0))


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def cpu_inputs(**shape):
    dims = dict(b=B, t=T, h=H, dk=DK, dv=DV) | shape
    return inputs(**dims, device="cpu", seed=1)


def bad_arguments():
    q, k, v, g, h0 = cpu_inputs()
    return [
        ("q 3-D", dict(q=q[0]), ValueError, r"q must be \[B, T, H, Dk\]"),
        ("k shape", dict(k=k[:, :-1]), ValueError,
         r"k has the shape \(2, 8, 2, 64\).*make it \(2, 9, 2, 64\)"),
        ("v shape", dict(v=v[:1]), ValueError, "v has the shape"),
        ("v 3-D", dict(v=v[0]), ValueError, r"v must be \[B, T, H, Dv\]"),
        ("g shape", dict(g=g[..., None]), ValueError, "g has the shape"),
        ("h0 shape", dict(initial_state=h0[:, :, :32]), ValueError, "initial_state has the shape"),
        ("T 0", dict(q=q[:, :0], k=k[:, :0], v=v[:, :0], g=g[:, :0]), ValueError,
         "must be at least 1"),
        ("Dk 32", dict(q=q[..., :32].contiguous(), k=k[..., :32].contiguous(), initial_state=None),
         ValueError, "Dk = 32 and Dv = 128 must each be 64 or 128"),
        ("q fp16", dict(q=q.half()), TypeError, "q must be torch.bfloat16, not torch.float16"),
        ("g bf16", dict(g=g.bfloat16()), TypeError, "g must be torch.float32"),
        ("h0 fp64", dict(initial_state=h0.double()), TypeError,
         "initial_state must be torch.float32"),
        ("v not a tensor", dict(v=v.tolist()), TypeError, "v must be a torch.Tensor, not list"),
        ("k strided", dict(k=k.transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
         r"k \(strides .*\) is not contiguous; call .contiguous\(\)"),
        ("on the CPU", {}, ValueError, "q is on cpu, but lasp-shmem runs on cuda:0"),
        ("scale 0", dict(scale=0.0), ValueError, "scale must not be 0"),
    ]


BAD_ARGUMENTS = bad_arguments()


@pytest.mark.parametrize("name, change, error, message", BAD_ARGUMENTS,
                         ids=[case[0] for case in BAD_ARGUMENTS])
def test_bad_arguments_are_refused_before_any_call(runtime, name, change, error, message):
    q, k, v, g, h0 = cpu_inputs()
    args = dict(q=q, k=k, v=v, g=g, initial_state=h0) | change
    with pytest.raises(error, match=message):
        lt.chunk_simple_gla(**args)


def packed_bad_arguments():
    q, k, v, g, h0 = cpu_inputs()
    cu = torch.tensor([0, 4, T], dtype=torch.int32)
    return [
        ("offsets fp32", dict(cu_seqlens=cu.float()), TypeError,
         "cu_seqlens must be torch.int32 or torch.int64, not torch.float32"),
        ("offsets 2-D", dict(cu_seqlens=cu[None]), ValueError, "1-D offsets"),
        ("one offset", dict(cu_seqlens=cu[:1]), ValueError, "at least 2 entries"),
        ("offsets list", dict(cu_seqlens=[0, T]), TypeError, "cu_seqlens must be a torch.Tensor"),
        ("initial state", dict(cu_seqlens=cu, initial_state=h0), NotImplementedError,
         "per-document initial states are not supported yet"),
        ("shard start alone", dict(shard_start=4), ValueError,
         "read only with cu_seqlens; pass shard_start=None"),
        ("shard start < 0", dict(cu_seqlens=cu, shard_start=-1), ValueError,
         "must be an int >= 0"),
    ]


@pytest.mark.parametrize("name, change, error, message", packed_bad_arguments(),
                         ids=[case[0] for case in packed_bad_arguments()])
def test_bad_documents_are_refused_before_any_call(cpu_runtime, name, change, error, message):
    q, k, v, g, _ = cpu_inputs()
    with pytest.raises(error, match=message):
        lt.chunk_simple_gla(q, k, v, g, **change)
    beta = torch.rand(B, T, H)
    with pytest.raises(error, match=message):
        lt.chunk_gated_delta_rule(q, k, v, g, beta, **change)
    with pytest.raises(error, match=message):
        lt.chunk_gla(*gla_inputs()[:4], **change)


@pytest.mark.parametrize("family", ["simple_gla", "gla", "gated_delta_rule", "mlstm"])
@pytest.mark.parametrize("dtype, shard_start", [(torch.int32, None), (torch.int64, 3)])
def test_per_document_final_states(cpu_runtime, family, dtype, shard_start):
    """output_final_state with cu_seqlens gives [B * N, H, Dk, Dv] (the mLSTM's C, n and m:
    [B * N, H, ...] each), row b * N + n: each document's state after its last token where that
    token is in the call, zeros elsewhere (the padding's empty documents too); the backward
    through the output alone runs, and one that reaches these states raises."""
    t = 40
    if family == "mlstm":
        inputs_ = mlstm_cpu_inputs(t=t)[:5]
    elif family == "gla":
        inputs_ = gla_inputs(t=t)[:4]
    else:
        inputs_ = cpu_inputs(t=t)[:4]
    if family == "gated_delta_rule":
        inputs_ = (*inputs_, torch.rand(B, t, H))
    steps = {"gated_delta_rule": delta_recurrent, "mlstm": mlstm_recurrent}
    step = steps.get(family, recurrent)
    cu = torch.tensor([0, 1, 17, 30, t, t] if shard_start is None else [0, 4, 20, 33, 43, 50, 50],
                      dtype=dtype)
    first = shard_start or 0
    leaves = [x.clone().requires_grad_() for x in inputs_]
    call = lt.mlstm if family == "mlstm" else getattr(lt, f"chunk_{family}")
    o, ht = call(*leaves, scale=0.125, cu_seqlens=cu, shard_start=shard_start,
                 output_final_state=True)
    docs = cu.numel() - 1
    parts = ht if family == "mlstm" else (ht,)
    shapes = [(DK, DV), (DK,), ()] if family == "mlstm" else [(DK, DV)]
    for part, shape in zip(parts, shapes, strict=True):
        assert part.shape == (B * docs, H, *shape) and part.dtype == torch.float32
    finals = [part.view(B, docs, *part.shape[1:]) for part in parts]
    for n in range(docs):
        a, z = int(cu[n]) - first, int(cu[n + 1]) - first
        if z > a and 1 <= z <= t:
            want = step(*(x[:, max(a, 0):z].double() for x in inputs_), None, 0.125)[1]
            for part, x in zip(finals, want if family == "mlstm" else (want,), strict=True):
                torch.testing.assert_close(part[:, n].double(), x, rtol=2e-2, atol=2e-2)
        else:
            assert max(part[:, n].abs().max() for part in finals) == 0
    do = torch.rand(*o.shape).bfloat16()
    torch.autograd.grad(o, leaves, do, retain_graph=True)
    with pytest.raises(NotImplementedError, match="carry none yet; detach them"):
        torch.autograd.grad((o.float() * do.float()).sum() + parts[0].sum(), leaves)


@pytest.mark.parametrize("family", ["simple_gla", "gla", "gated_delta_rule"])
@pytest.mark.parametrize("dtype, shard_start", [(torch.int32, None), (torch.int64, 3)])
def test_packed_documents_flow_through_the_ops(cpu_runtime, family, dtype, shard_start):
    """cu_seqlens and shard_start reach both custom ops (the CPU stand-ins run each document on
    its own), and the gradients are float64 autograd's through each document's recurrence: g's
    is 0 at every document start."""
    t = 40
    q, k, v, g, _ = gla_inputs(t=t) if family == "gla" else cpu_inputs(t=t)
    beta = torch.rand(B, t, H)
    # Padded with the total; with shard_start = 3 the call's tokens are 3 to 43 of the packed
    # sequence, so its documents begin at the same places of the call.
    cu = torch.tensor([0, 1, 17, 30, t, t] if shard_start is None else [0, 4, 20, 33, 43, 43],
                      dtype=dtype)
    delta_rule = family == "gated_delta_rule"
    leaves = [x.clone().requires_grad_() for x in ((q, k, v, g, beta) if delta_rule
                                                   else (q, k, v, g))]
    attention = getattr(lt, f"chunk_{family}")
    o, ht = attention(*leaves, scale=0.125, cu_seqlens=cu, shard_start=shard_start)
    assert ht is None
    do = torch.rand(B, t, H, DV).bfloat16()
    got = torch.autograd.grad(o, leaves, do)
    wide = [x.detach().double().requires_grad_() for x in leaves]
    step = delta_recurrent if delta_rule else recurrent
    o64 = torch.cat([step(*(x[:, a:b] for x in wide), None, 0.125)[0]
                     for a, b in documents(cu, shard_start or 0, t)], dim=1)
    want = torch.autograd.grad(o64, wide, do.double())
    torch.testing.assert_close(o.double(), o64, rtol=2e-2, atol=2e-2)
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=2e-2, atol=2e-2)
    dg = got[3]
    assert dg[:, [0, 1, 17, 30]].abs().max() == 0


@pytest.mark.parametrize("family", ["simple_gla", "gla", "gated_delta_rule", "mlstm"])
def test_the_library_accepts_packed_calls(library, family):
    """The ops' packed calls fill LASP_SLOT_CU_SEQLENS and call.shard_start as the library's
    lasp_op_check_call wants them, in both directions, on one GPU and with LASP-2."""
    q, k, v, g, _ = gla_inputs() if family == "gla" else cpu_inputs()
    beta = torch.rand(B, T, H)
    cu = torch.tensor([0, 4, 7, 30], dtype=torch.int64)
    for lasp2 in (False, True):
        if family == "mlstm":
            q, k, v, i, f, _ = mlstm_cpu_inputs()
            (h, _, rows, start, exit_), forward = lt._mlstm_forward_call(
                q, k, v, i, f, None, 0.125, False, lasp2, True, cu, 21)
            entry, leaving = (start, exit_) if lasp2 else (None, None)
            _, backward = lt._mlstm_backward_call(q, k, v, i, f, entry, leaving, rows, h, None,
                                                  0.125, False, lasp2, False, cu, 21)
        elif family == "gla":
            (o, _, states), forward = lt._gla_forward_call(q, k, v, g, None, 0.125, False,
                                                           lasp2, True, cu, 21)
            _, backward = lt._gla_backward_call(q, k, v, g, None, states, o, None, 0.125, False,
                                                lasp2, False, cu, 21)
        elif family == "gated_delta_rule":
            (o, _, start), forward = lt._gdn_forward_call(q, k, v, g, beta, None, 0.125, False,
                                                          lasp2, cu, 21)
            _, backward = lt._gdn_backward_call(q, k, v, g, beta, start if lasp2 else None, o,
                                                None, 0.125, False, lasp2, False, cu, 21)
            _, with_states = lt._gdn_forward_call(q, k, v, g, beta, None, 0.125, True, lasp2, cu,
                                                  21)
            assert with_states.tensors.slot[_abi.SLOT_HT].data == 0
            call_is_accepted(library, with_states, _abi.DIRECTION_FORWARD)
        else:
            (o, _, start), forward = lt._forward_call(q, k, v, g, None, 0.125, False, lasp2, cu,
                                                      21)
            _, backward = lt._backward_call(q, k, v, g, start if lasp2 else None, o, None, 0.125,
                                            False, lasp2, False, cu, 21)
            # With the documents' final states: one per entry of cu_seqlens but the last.
            (_, ht, _), with_states = lt._forward_call(q, k, v, g, None, 0.125, True, lasp2, cu,
                                                       21)
            assert ht.shape == (B * (cu.numel() - 1), H, DK, DV)
            assert with_states.tensors.slot[_abi.SLOT_HT].data == 0
            call_is_accepted(library, with_states, _abi.DIRECTION_FORWARD)
        assert forward.call.shard_start == 21
        assert forward.tensors.slot[_abi.SLOT_CU_SEQLENS].dtype == _abi.DTYPES["torch.int64"]
        call_is_accepted(library, forward, _abi.DIRECTION_FORWARD)
        call_is_accepted(library, backward, _abi.DIRECTION_BACKWARD)


def test_a_call_before_init_says_to_call_init():
    q, k, v, g, _ = cpu_inputs()
    with pytest.raises(RuntimeError, match=r"call lasp_shmem.torch.init\(\) first"):
        lt.chunk_simple_gla(q, k, v, g)


def test_lasp2_spans_the_group_of_init(runtime, one_rank_group):
    q, k, v, g, _ = cpu_inputs()
    with pytest.raises(ValueError, match=r"cp_group has the ranks \[0\].*LASP-2 spans the group"):
        lt.chunk_simple_gla(q, k, v, g, cp_group=one_rank_group)


@pytest.fixture
def fresh_process(monkeypatch):
    """The torch layer as in a process where no test ran the runtime."""
    monkeypatch.setattr(lt, "_runtime", None)
    monkeypatch.setattr(lt, "_stopped", False)


def test_init_needs_a_gpu(fresh_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        lt.init()
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        lt.init(group=object())


class FakeGuestLibrary:
    """The library's entry points that guest mode uses, recording the calls; NVSHMEM makes this
    process PE `pe` of `npes`."""

    def __init__(self, pe, npes):
        self.pe, self.npes, self.calls = pe, npes, []

    def runtime_attach(self, options, device, handle):
        self.calls.append(("attach", device))
        handle._obj.value = 1234

    def runtime_place(self, handle, place):
        place._obj.rank, place._obj.world_size = self.pe, self.npes

    def runtime_shutdown(self, handle):
        self.calls.append(("shutdown", handle.value))

    def __getattr__(self, name):
        raise AssertionError(f"guest mode must not call {name}")


def test_init_joins_an_nvshmem_it_did_not_start(fresh_process, monkeypatch):
    """Guest mode: PyTorch's SymmetricMemory NVSHMEM backend started NVSHMEM in this process;
    init attaches instead of initialising (no unique id, no runtime_init)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_abi, "nvshmem_initialized", lambda: True)
    fake = FakeGuestLibrary(pe=0, npes=1)
    monkeypatch.setattr(_abi, "library", lambda: fake)
    lt.init()
    assert fake.calls == [("attach", 0)]
    assert lt._runtime is not None and lt._runtime.handle.value == 1234
    monkeypatch.setattr(lt, "_runtime", None)


def test_guest_mode_refuses_an_nvshmem_of_other_pes(fresh_process, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_abi, "nvshmem_initialized", lambda: True)
    fake = FakeGuestLibrary(pe=1, npes=2)
    monkeypatch.setattr(_abi, "library", lambda: fake)
    with pytest.raises(RuntimeError, match="made it PE 1 of 2, but this is rank 0 of 1"):
        lt.init()
    assert fake.calls == [("attach", 0), ("shutdown", 1234)]
    assert lt._runtime is None


def test_the_runtime_does_not_start_again_after_shutdown(fresh_process, monkeypatch):
    monkeypatch.setattr(lt, "_stopped", True)
    with pytest.raises(RuntimeError, match="was shut down in this process"):
        lt.init()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU test may have started NVSHMEM")
def test_without_a_gpu_nobody_started_nvshmem():
    assert not _abi.nvshmem_initialized()


@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_fake_outputs_have_the_real_shapes(want_ht, lasp2):
    q, k, v, g, h0 = (x.to("meta") for x in cpu_inputs())
    o, ht, start = FWD(q, k, v, g, h0, 0.125, want_ht, lasp2)
    state = (B, H, DK, DV)
    assert (o.shape, o.dtype) == ((B, T, H, DV), torch.bfloat16)
    assert (ht.shape, ht.dtype) == (state if want_ht else (0,), torch.float32)
    assert (start.shape, start.dtype) == (state if lasp2 else (0,), torch.float32)
    grads = BWD(q, k, v, g, start if lasp2 else h0, o, ht if want_ht else None, 0.125, True,
                lasp2)
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, g.shape, state]
    assert [x.dtype for x in grads] == [q.dtype, k.dtype, v.dtype, g.dtype, torch.float32]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_opcheck(with_h0, lasp2):
    """Schema, fake implementation against the kernel, autograd registration, and tracing with
    AOTAutograd (dynamic shapes), forward and backward."""
    q, k, v, g, h0 = (x.requires_grad_() for x in cpu_inputs(dk=64, dv=64, t=5))
    torch.library.opcheck(FWD, (q, k, v, g, h0 if with_h0 else None, 0.125, True, lasp2))
    do = torch.rand(B, 5, H, 64).bfloat16()
    torch.library.opcheck(BWD, (q.detach(), k.detach(), v.detach(), g.detach(),
                                h0.detach() if with_h0 else None, do, None, 0.125, with_h0,
                                lasp2))


def expect_one_graph_and_the_eager_gradients(block, inputs):
    """`block` traces to one graph with no break, and its compiled gradients are eager's, bit for bit."""
    explained = torch._dynamo.explain(block)(*inputs)
    assert explained.graph_break_count == 0 and explained.graph_count == 1

    def grads(fn):
        leaves = [x.clone().requires_grad_() for x in inputs]
        fn(*leaves).backward()
        return [x.grad for x in leaves]

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for got, want in zip(grads(compiled), grads(block)):
        assert torch.equal(got, want)


def test_a_compiled_block_has_no_graph_break_and_the_eager_gradients():
    def block(q, k, v, g, h0):
        o, ht, _ = FWD(q, k, v, g, h0, 0.125, True, False)
        return (o.float() ** 2).sum() + ht.sum()

    expect_one_graph_and_the_eager_gradients(block, cpu_inputs(dk=64, dv=64, t=5))


def call_is_accepted(library, call, direction, mode="overlapped"):
    library.op_check_call(ctypes.byref(call.desc(mode)), direction, ctypes.byref(call.call),
                          ctypes.byref(call.tensors))


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_the_library_accepts_the_calls_of_the_ops(library, with_h0, want_ht, lasp2):
    """The slots, dtypes, element counts and scalars the ops pass, checked by the library's own
    lasp_op_check_call (everything but the device pointers and the stream)."""
    q, k, v, g, h0 = cpu_inputs()
    h0 = h0 if with_h0 else None
    (o, ht, start), forward = lt._forward_call(q, k, v, g, h0, 0.125, want_ht, lasp2)
    call_is_accepted(library, forward, _abi.DIRECTION_FORWARD)
    for writes_dh0 in (False, True):
        _, backward = lt._backward_call(q, k, v, g, start if lasp2 else h0, o,
                                        ht if want_ht else None, 0.125, with_h0, lasp2,
                                        writes_dh0)
        call_is_accepted(library, backward, _abi.DIRECTION_BACKWARD)


def test_the_library_would_catch_a_wrong_slot(library):
    """The check above can fail: the single-GPU backward does not read a start state."""
    q, k, v, g, h0 = cpu_inputs()
    (o, _, start), _ = lt._forward_call(q, k, v, g, h0, 0.125, False, True)
    _, backward = lt._backward_call(q, k, v, g, start, o, None, 0.125, False, True, False)
    backward.layout = backward.layout[:5] + (False,)
    with pytest.raises(_abi.LaspError, match="LASP_SLOT_START_STATE"):
        call_is_accepted(library, backward, _abi.DIRECTION_BACKWARD)


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
@pytest.mark.parametrize("save_states", [False, True])
def test_the_library_accepts_the_gla_forward_calls(library, with_h0, want_ht, lasp2,
                                                   save_states):
    q, k, v, g, h0 = gla_inputs()
    (o, ht, states), call = lt._gla_forward_call(q, k, v, g, h0 if with_h0 else None, 0.125,
                                                 want_ht, lasp2, save_states)
    assert (o.shape, ht.shape) == ((B, T, H, DV), (B, H, DK, DV) if want_ht else (0,))
    assert states.shape == ((B * H, 1, DK, DV) if save_states else (0,))
    call_is_accepted(library, call, _abi.DIRECTION_FORWARD)
    # The check can fail: scalar decay's [B, T, H] gates are not GLA's.
    _, wrong = lt._gla_forward_call(q, k, v, g[..., 0].contiguous(), None, 0.125, False, lasp2,
                                    save_states)
    with pytest.raises(_abi.LaspError, match=r"\[B, T, H, Dk\]"):
        call_is_accepted(library, wrong, _abi.DIRECTION_FORWARD)


@pytest.mark.parametrize("t", [1, 64, 130])
@pytest.mark.parametrize("with_h0, with_dht", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("lasp2", [False, True])
def test_the_library_accepts_the_gla_backward_calls(library, t, with_h0, with_dht, lasp2):
    """On one GPU and across the ranks (where dh0 is written on rank 0 only: elsewhere its slot
    stays empty and the gradient is zero)."""
    q, k, v, g, h0 = gla_inputs(t=t)
    h0 = h0 if with_h0 else None
    (o, ht, states), _ = lt._gla_forward_call(q, k, v, g, h0, 0.125, with_dht, lasp2, True)
    assert states.shape == (B * H, (t + 63) // 64, DK, DV)
    for writes_dh0 in (False, True) if lasp2 else (True,):
        (dq, dk, dv, dg, dh0), call = lt._gla_backward_call(
            q, k, v, g, h0, states, o, ht if with_dht else None, 0.125, with_h0, lasp2,
            writes_dh0)
        assert (dg.shape, dg.dtype) == (g.shape, torch.float32)
        assert dh0.shape == ((B, H, DK, DV) if with_h0 else (0,))
        if with_h0 and not writes_dh0:
            assert torch.count_nonzero(dh0) == 0
        call_is_accepted(library, call, _abi.DIRECTION_BACKWARD)
    # The check can fail: chunk states of another length.
    _, wrong = lt._gla_backward_call(q, k, v, g, h0, states.flatten()[1:], o, None, 0.125,
                                     with_h0, lasp2, True)
    with pytest.raises(_abi.LaspError, match=r"LASP_SLOT_CHUNK_STATES .*\[B\*H, ceil\(T / 64\)"):
        call_is_accepted(library, wrong, _abi.DIRECTION_BACKWARD)


def test_the_library_would_catch_a_gla_start_state(library):
    """GLA's LASP-2 backward reads the chunk states, not scalar decay's start state."""
    q, k, v, g, h0 = gla_inputs()
    (o, _, states), _ = lt._gla_forward_call(q, k, v, g, h0, 0.125, False, True, True)
    _, backward = lt._gla_backward_call(q, k, v, g, None, states, o, None, 0.125, False, True,
                                        True)
    backward.tensors.slot[_abi.SLOT_START_STATE] = backward.tensors.slot[_abi.SLOT_DO]
    with pytest.raises(_abi.LaspError, match="LASP_SLOT_START_STATE is filled"):
        call_is_accepted(library, backward, _abi.DIRECTION_BACKWARD)


def gla_inputs(t=T):
    """cpu_inputs with GLA's gates, one per key dimension."""
    q, k, v, g, h0 = cpu_inputs(t=t)
    return q, k, v, (g[..., None] * torch.linspace(0.5, 1.5, DK)).contiguous(), h0


def test_gla_refuses_scalar_gates(runtime):
    q, k, v, g, h0 = gla_inputs()
    with pytest.raises(ValueError, match=r"g has the shape \(2, 9, 2\).*\[B, T, H, Dk\] g"):
        lt.chunk_gla(q, k, v, g[..., 0].contiguous())
    with pytest.raises(ValueError, match="q is on cpu"):
        lt.chunk_gla(q, k, v, g)


@pytest.fixture
def cpu_runtime(runtime, monkeypatch):
    """The runtime fixture, with the CPU tensors let through to the ops (whose CPU kernels are
    this module's float64 reference)."""
    monkeypatch.setattr(lt, "_check_device", lambda *args, **kwargs: None)
    GLA_SAVES.clear()
    GLA_BACKWARDS.clear()


@pytest.mark.parametrize("with_h0, with_ht", [(False, False), (True, True), (True, False)])
def test_gla_gradients_flow_through_the_ops(cpu_runtime, with_h0, with_ht):
    """chunk_gla's autograd on the CPU stand-ins: the gradients of every input (g's fp32, like
    g) are float64 autograd's through the recurrence, and the forward saves the chunk states
    because a gradient is needed."""
    q, k, v, g, h0 = gla_inputs(t=70)
    h0 = h0 if with_h0 else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0) if x is not None]
    o, ht = lt.chunk_gla(*leaves[:4], scale=0.125, initial_state=leaves[4] if with_h0 else None,
                         output_final_state=with_ht)
    assert GLA_SAVES == [True] and (ht is not None) == with_ht
    do = torch.rand(B, 70, H, DV).bfloat16()
    dht = torch.rand(B, H, DK, DV)
    outputs, cotangents = ((o, ht), (do, dht)) if with_ht else ((o,), (do,))
    got = torch.autograd.grad(outputs, leaves, cotangents)
    assert [x.dtype for x in got] == [x.dtype for x in leaves]
    wide = [x.detach().double().requires_grad_() for x in leaves]
    o64, ht64 = recurrent(*wide[:4], wide[4] if with_h0 else None, 0.125)
    want = torch.autograd.grad((o64, ht64) if with_ht else (o64,), wide,
                               (do.double(), dht.double()) if with_ht else (do.double(),))
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=1e-2, atol=1e-2)
    assert GLA_BACKWARDS == [False]


@pytest.mark.parametrize("with_h0", [False, True])
def test_gla_gradients_flow_across_the_ranks(cpu_runtime, one_rank_group, monkeypatch, with_h0):
    """chunk_gla with cp_group (one rank, which holds the whole sequences): the forward saves
    the chunk states because a gradient is needed, the LASP-2 backward runs, and every input's
    gradient is float64 autograd's."""
    monkeypatch.setattr(lt, "_runtime", lt._Runtime(None, one_rank_group, (0,), 0, 1, 0))
    q, k, v, g, h0 = gla_inputs(t=70)
    h0 = h0 if with_h0 else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, h0) if x is not None]
    o, ht = lt.chunk_gla(*leaves[:4], scale=0.125, initial_state=leaves[4] if with_h0 else None,
                         output_final_state=True, cp_group=one_rank_group)
    assert GLA_SAVES == [True] and ht is not None  # the last rank holds the final state
    do, dht = torch.rand(B, 70, H, DV).bfloat16(), torch.rand(B, H, DK, DV)
    got = torch.autograd.grad((o, ht), leaves, (do, dht))
    assert GLA_BACKWARDS == [True]
    wide = [x.detach().double().requires_grad_() for x in leaves]
    want = torch.autograd.grad(recurrent(*wide[:4], wide[4] if with_h0 else None, 0.125), wide,
                               (do.double(), dht.double()))
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=1e-2, atol=1e-2)


def test_gla_without_gradients_saves_no_chunk_states(cpu_runtime):
    q, k, v, g, h0 = gla_inputs()
    lt.chunk_gla(q, k, v, g, initial_state=h0)
    with torch.no_grad():
        lt.chunk_gla(q.requires_grad_(), k, v, g, initial_state=h0)
    assert GLA_SAVES == [False, False]


def test_gla_direct_op_calls_without_saved_states_say_what_to_do():
    q, k, v, g, h0 = gla_inputs()
    o, _, _ = GLA_FWD(q.requires_grad_(), k, v, g, h0, 0.125, False, False, False)
    with pytest.raises(RuntimeError, match="save_states=False.*call lasp_shmem.torch.chunk_gla"):
        o.float().sum().backward()


@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("save_states", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_gla_fake_outputs_have_the_real_shapes(want_ht, save_states, lasp2):
    q, k, v, g, h0 = (x.to("meta") for x in gla_inputs(t=130))
    o, ht, states = GLA_FWD(q, k, v, g, h0, 0.125, want_ht, lasp2, save_states)
    assert (o.shape, o.dtype) == ((B, 130, H, DV), torch.bfloat16)
    assert (ht.shape, ht.dtype) == ((B, H, DK, DV) if want_ht else (0,), torch.float32)
    assert (states.shape, states.dtype) == (
        (B * H, 3, DK, DV) if save_states else (0,), torch.bfloat16)
    grads = GLA_BWD(q, k, v, g, h0, states, o, ht if want_ht else None, 0.125, True, lasp2)
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, g.shape, (B, H, DK, DV)]
    assert [x.dtype for x in grads] == [q.dtype, k.dtype, v.dtype, torch.float32, torch.float32]


@pytest.mark.parametrize("with_h0, packed", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("lasp2", [False, True])
def test_gla_opcheck(with_h0, packed, lasp2):
    """Schema, fake implementations against the kernels, autograd registration, and tracing
    with AOTAutograd (dynamic shapes), forward and backward; packed documents with neither
    initial nor final state, as chunk_gla calls the ops with them."""
    q, k, v, g, h0 = (x.requires_grad_() for x in gla_inputs(t=5))
    h0 = h0 if with_h0 else None
    packing = (torch.tensor([0, 2, 5], dtype=torch.int32), 0) if packed else (None, 0)
    torch.library.opcheck(GLA_FWD, (q, k, v, g, h0, 0.125, not packed, lasp2, True, *packing))
    detached = [None if x is None else x.detach() for x in (q, k, v, g, h0)]
    _, _, states = GLA_FWD(*detached, 0.125, False, lasp2, True, *packing)
    do = torch.rand(B, 5, H, DV).bfloat16()
    torch.library.opcheck(GLA_BWD, (*detached, states, do, None, 0.125, with_h0, lasp2,
                                    *packing))


def test_a_compiled_gla_block_has_no_graph_break_and_the_eager_gradients():
    def block(q, k, v, g, h0):
        o, ht, _ = GLA_FWD(q, k, v, g, h0, 0.125, True, False, True)
        return (o.float() ** 2).sum() + ht.sum()

    expect_one_graph_and_the_eager_gradients(block, gla_inputs(t=5))


@pytest.mark.parametrize("mode", lt.EXCHANGE_MODES)
def test_the_library_accepts_every_exchange_mode(library, mode):
    """A LASP-2 op's descriptor carries the mode's LASP_MODE_* code, an op of one GPU none."""
    q, k, v, g, h0 = gla_inputs()
    for lasp2 in (False, True):
        _, call = lt._gla_forward_call(q, k, v, g, h0, 0.125, False, lasp2, False)
        assert call.desc(mode).mode == (lt.EXCHANGE_MODES[mode] if lasp2 else 0)
        call_is_accepted(library, call, _abi.DIRECTION_FORWARD, mode)


class FakeOpLibrary:
    """The entry points that the ops and set_exchange_mode use, recording the mode of every op
    made (numbered from 1 in creation order), every switch and every forward call; `capturing`
    stands in for torch.cuda.is_current_stream_capturing()."""

    def __init__(self):
        self.created, self.switched, self.forwards, self.capturing = [], [], [], False
        self.backwards, self.planned, self.plan_choice = [], [], _abi.MODE_SEQUENTIAL_NCCL

    def op_create(self, runtime, desc, op):
        self.created.append(desc._obj.mode)
        op._obj.value = len(self.created)

    def op_forward(self, op, stream, call, tensors):
        self.forwards.append(op.value)

    def op_backward(self, op, stream, call, tensors):
        self.backwards.append(op.value)

    def op_set_mode(self, op, mode):
        self.switched.append((op.value, mode))

    def op_plan(self, op, stream, direction, call, tensors, mode):
        self.planned.append((op.value, direction))
        mode._obj.value = self.plan_choice

    def __getattr__(self, name):
        raise AssertionError(f"the torch layer must not call {name} here")


@pytest.fixture
def fake_ops(runtime, monkeypatch):
    """The runtime fixture with FakeOpLibrary behind it, and torch's current stream and capture
    state without a GPU."""
    fake = FakeOpLibrary()
    monkeypatch.setattr(_abi, "library", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: fake.capturing)
    return fake


def enqueue_forward(lasp2, gla=False, b=B):
    """One forward call through the ops' path to the library (the op of its layout is made on
    its first call)."""
    q, k, v, g, h0 = cpu_inputs(b=b)
    if gla:
        g = (g[..., None] * torch.linspace(0.5, 1.5, DK)).contiguous()
        _, call = lt._gla_forward_call(q, k, v, g, h0, 0.125, False, lasp2, False)
    else:
        _, call = lt._forward_call(q, k, v, g, h0, 0.125, False, lasp2)
    call.enqueue(backward=False, device=0)


OVERLAPPED, NCCL, NVSHMEM = lt.EXCHANGE_MODES.values()


def test_set_exchange_mode_switches_every_lasp2_op_in_creation_order(fake_ops):
    """Every LASP-2 op made so far (of every family and layout) is switched, in the order they
    were made; ops of one GPU have no mode; later LASP-2 ops are made in the new mode."""
    assert lt.exchange_mode() == "overlapped"
    enqueue_forward(lasp2=True)  # op 1
    enqueue_forward(lasp2=False)  # op 2: one GPU
    enqueue_forward(lasp2=True, gla=True)  # op 3
    enqueue_forward(lasp2=True)  # op 1 again
    assert fake_ops.created == [OVERLAPPED, 0, OVERLAPPED] and fake_ops.forwards == [1, 2, 3, 1]
    lt.set_exchange_mode("sequential_nccl")
    assert lt.exchange_mode() == "sequential_nccl"
    assert fake_ops.switched == [(1, NCCL), (3, NCCL)]
    enqueue_forward(lasp2=True, b=1)  # op 4
    enqueue_forward(lasp2=False, gla=True)  # op 5: one GPU
    assert fake_ops.created == [OVERLAPPED, 0, OVERLAPPED, NCCL, 0]
    lt.set_exchange_mode("sequential_nvshmem")
    assert fake_ops.switched[2:] == [(1, NVSHMEM), (3, NVSHMEM), (4, NVSHMEM)]
    lt.set_exchange_mode("overlapped")
    assert fake_ops.switched[5:] == [(1, OVERLAPPED), (3, OVERLAPPED), (4, OVERLAPPED)]
    assert lt.exchange_mode() == "overlapped"


@pytest.mark.parametrize("mode", ["no_comm", "NCCL", "", 1, None])
def test_set_exchange_mode_names_the_modes_before_anything_else(fresh_process, mode):
    """The argument is checked first: here no runtime runs, and the error is still the mode's."""
    with pytest.raises(ValueError, match="mode must be one of 'overlapped', 'sequential_nccl', "
                                         "'sequential_nvshmem', 'planned', not"):
        lt.set_exchange_mode(mode)
    with pytest.raises(RuntimeError, match=r"call lasp_shmem.torch.init\(\) first"):
        lt.set_exchange_mode("overlapped")
    with pytest.raises(RuntimeError, match=r"call lasp_shmem.torch.init\(\) first"):
        lt.exchange_mode()


def test_set_exchange_mode_refuses_a_graph_capture(fake_ops):
    enqueue_forward(lasp2=True)
    fake_ops.capturing = True
    with pytest.raises(RuntimeError, match="CUDA graph is being captured.*outside the captured"):
        lt.set_exchange_mode("sequential_nccl")
    assert fake_ops.switched == [] and lt.exchange_mode() == "overlapped"


def test_sequential_calls_refuse_a_graph_capture(fake_ops):
    """The sequential modes pick each call's buffer half on the host, which a graph replay would
    not update; overlapped calls and calls of one GPU capture."""
    enqueue_forward(lasp2=True)
    lt.set_exchange_mode("sequential_nvshmem")
    fake_ops.capturing = True
    with pytest.raises(RuntimeError, match="'sequential_nvshmem' exchange mode cannot be "
                                           "captured.*capture in the 'overlapped' mode"):
        enqueue_forward(lasp2=True)
    enqueue_forward(lasp2=False)  # op 2
    fake_ops.capturing = False
    lt.set_exchange_mode("overlapped")
    fake_ops.capturing = True
    enqueue_forward(lasp2=True)
    assert fake_ops.forwards == [1, 2, 1]


def test_ranks_that_ask_for_different_modes_are_told_before_any_switch(fake_ops, monkeypatch):
    """The ranks' modes are compared first: the library would compare them only on an op whose
    mode changes, and a rank whose ops need no change would not wait for the others."""
    enqueue_forward(lasp2=True)
    lt._runtime.group, lt._runtime.world = "the group", 2
    gathered = []

    def all_gather_object(out, mode, group):
        gathered.append(group)
        out[:] = [mode, "overlapped"]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    with pytest.raises(ValueError, match=r"asked for the modes \['sequential_nccl', "
                                         r"'overlapped'\] \(by rank\); call it with the same"):
        lt.set_exchange_mode("sequential_nccl")
    assert gathered == ["the group"]
    assert fake_ops.switched == [] and lt.exchange_mode() == "overlapped"


def enqueue_backward(lasp2, b=B):
    """One backward call of the scalar-decay op through the ops' path to the library."""
    q, k, v, g, h0 = cpu_inputs(b=b)
    do = torch.rand_like(v)
    state = torch.zeros(b, H, DK, DV)
    _, call = lt._backward_call(q, k, v, g, state, do, None, 0.125, False, lasp2, False)
    call.enqueue(backward=True, device=0)


def test_the_planned_mode_plans_each_op_and_direction_once_on_its_first_call(fake_ops):
    """Ops start overlapped; the first forward and the first backward of each LASP-2 op run the
    planner and then the call; later calls only call; ops of one GPU are never planned; setting a
    mode again forgets the choices."""
    lt.set_exchange_mode("planned")
    assert lt.exchange_mode() == "planned" and lt.planned_modes() == {}
    enqueue_forward(lasp2=True)  # op 1, planned
    enqueue_forward(lasp2=True)
    enqueue_forward(lasp2=False)  # op 2: one GPU
    fake_ops.plan_choice = _abi.MODE_OVERLAPPED
    enqueue_backward(lasp2=True)  # op 1's backward, planned
    enqueue_backward(lasp2=True)
    assert fake_ops.created == [OVERLAPPED, 0]
    assert fake_ops.planned == [(1, _abi.DIRECTION_FORWARD), (1, _abi.DIRECTION_BACKWARD)]
    assert fake_ops.forwards == [1, 1, 2] and fake_ops.backwards == [1, 1]
    layout = (_abi.FAMILY_SCALAR_DECAY, B, H, DK, DV)
    assert lt.planned_modes() == {(*layout, "forward"): "sequential_nccl",
                                  (*layout, "backward"): "overlapped"}
    lt.set_exchange_mode("overlapped")
    assert lt.planned_modes() == {} and fake_ops.switched == [(1, OVERLAPPED)]


def test_the_planned_mode_refuses_to_plan_or_run_sequentially_inside_a_capture(fake_ops):
    lt.set_exchange_mode("planned")
    fake_ops.capturing = True
    with pytest.raises(RuntimeError, match="planner chooses .* first call.*run one step before "
                                           "capturing"):
        enqueue_forward(lasp2=True)
    assert fake_ops.planned == [] and fake_ops.forwards == []
    fake_ops.capturing = False
    enqueue_forward(lasp2=True)  # planned: sequential NCCL
    fake_ops.capturing = True
    with pytest.raises(RuntimeError, match="'sequential_nccl' exchange mode cannot be captured"):
        enqueue_forward(lasp2=True)
    enqueue_forward(lasp2=False)  # one GPU: captures
    assert fake_ops.forwards == [1, 2]


def test_a_planned_pipelined_chain_is_named_and_captures(fake_ops):
    """The planner may choose the pipelined chain (scalar decay, GLA): planned_modes names it, and
    its calls capture into a CUDA graph, as the overlapped mode's do (it exchanges from the device)."""
    fake_ops.plan_choice = _abi.MODE_PIPELINED_CHAIN
    lt.set_exchange_mode("planned")
    enqueue_forward(lasp2=True)  # planned: the chain
    assert set(lt.planned_modes().values()) == {"pipelined_chain"}
    fake_ops.capturing = True
    enqueue_forward(lasp2=True)
    assert fake_ops.forwards == [1, 1]


# Gated DeltaNet.

def gdn_inputs(**shape):
    dims = dict(b=B, t=T, h=H, dk=DK, dv=DV) | shape
    return delta_inputs(**dims, device="cpu", seed=3)


def test_the_delta_reference_backward_is_autograds():
    q, k, v, g, beta, h0 = (x.double().requires_grad_() for x in gdn_inputs(t=6))
    do, dht = torch.rand(B, 6, H, DV, dtype=torch.float64), torch.rand(B, H, DK, DV).double()
    o, ht = delta_recurrent(q, k, v, g, beta, h0, 0.3)
    want = torch.autograd.grad((o, ht), (q, k, v, g, beta, h0), (do, dht))
    for got, expected in zip(delta_gradients(q, k, v, g, beta, h0, do, dht, 0.3), want):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_gdn_fake_outputs_have_the_real_shapes(want_ht, lasp2):
    q, k, v, g, beta, h0 = (x.to("meta") for x in gdn_inputs())
    o, ht, start = GDN_FWD(q, k, v, g, beta, h0, 0.125, want_ht, lasp2)
    state = (B, H, DK, DV)
    assert (o.shape, o.dtype) == ((B, T, H, DV), torch.bfloat16)
    assert (ht.shape, ht.dtype) == (state if want_ht else (0,), torch.float32)
    assert (start.shape, start.dtype) == (state if lasp2 else (0,), torch.float32)
    grads = GDN_BWD(q, k, v, g, beta, start if lasp2 else h0, o, ht if want_ht else None, 0.125,
                    True, lasp2)
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, g.shape, beta.shape, state]
    assert [x.dtype for x in grads] == [q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype,
                                        torch.float32]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_gdn_opcheck(with_h0, lasp2):
    q, k, v, g, beta, h0 = (x.requires_grad_() for x in gdn_inputs(dk=64, dv=64, t=5))
    torch.library.opcheck(GDN_FWD, (q, k, v, g, beta, h0 if with_h0 else None, 0.125, True,
                                    lasp2))
    do = torch.rand(B, 5, H, 64).bfloat16()
    torch.library.opcheck(GDN_BWD, (q.detach(), k.detach(), v.detach(), g.detach(),
                                    beta.detach(), h0.detach() if with_h0 else None, do, None,
                                    0.125, with_h0, lasp2))


def test_a_compiled_gdn_block_has_no_graph_break_and_the_eager_gradients():
    def block(q, k, v, g, beta, h0):
        o, ht, _ = GDN_FWD(q, k, v, g, beta, h0, 0.125, True, False)
        return (o.float() ** 2).sum() + ht.sum()

    expect_one_graph_and_the_eager_gradients(block, gdn_inputs(dk=64, dv=64, t=5))


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_the_library_accepts_the_gdn_calls(library, with_h0, want_ht, lasp2):
    q, k, v, g, beta, h0 = gdn_inputs()
    h0 = h0 if with_h0 else None
    (o, ht, start), forward = lt._gdn_forward_call(q, k, v, g, beta, h0, 0.125, want_ht, lasp2)
    call_is_accepted(library, forward, _abi.DIRECTION_FORWARD)
    for writes_dh0 in (False, True):
        _, backward = lt._gdn_backward_call(q, k, v, g, beta, start if lasp2 else h0, o,
                                            ht if want_ht else None, 0.125, with_h0, lasp2,
                                            writes_dh0)
        call_is_accepted(library, backward, _abi.DIRECTION_BACKWARD)


def test_the_library_would_catch_a_gdn_call_without_beta(library):
    q, k, v, g, beta, h0 = gdn_inputs()
    _, forward = lt._gdn_forward_call(q, k, v, g, beta, h0, 0.125, False, False)
    forward.tensors.slot[_abi.SLOT_BETA] = _abi.Tensor()
    with pytest.raises(_abi.LaspError, match="LASP_SLOT_BETA is empty"):
        call_is_accepted(library, forward, _abi.DIRECTION_FORWARD)


def gdn_bad_arguments():
    q, k, v, g, beta, h0 = gdn_inputs()
    return [
        ("beta shape", dict(beta=beta[:, :-1]), ValueError,
         r"beta has the shape \(2, 8, 2\).*\[B, T, H\] beta"),
        ("beta fp16", dict(beta=beta.half()), TypeError, "beta must be torch.float32"),
        ("beta missing", dict(beta=None), TypeError, "beta must be a torch.Tensor, not NoneType"),
        ("Dv 96", dict(v=v[..., :96].contiguous(), initial_state=None), ValueError,
         "Dk = 64 must be 64 or 128 and Dv = 96 a multiple of 64"),
        ("Dk 32", dict(q=q[..., :32].contiguous(), k=k[..., :32].contiguous(),
                       initial_state=None), ValueError, "Dk = 32 must be 64 or 128"),
        ("on the CPU", {}, ValueError, "q is on cpu, but lasp-shmem runs on cuda:0"),
    ]


GDN_BAD_ARGUMENTS = gdn_bad_arguments()


@pytest.mark.parametrize("name, change, error, message", GDN_BAD_ARGUMENTS,
                         ids=[case[0] for case in GDN_BAD_ARGUMENTS])
def test_gdn_bad_arguments_are_refused_before_any_call(runtime, name, change, error, message):
    q, k, v, g, beta, h0 = gdn_inputs()
    args = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0) | change
    with pytest.raises(error, match=message):
        lt.chunk_gated_delta_rule(**args)


@pytest.mark.parametrize("with_h0, with_ht", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("lasp2", [False, True])
def test_gdn_gradients_flow_through_the_ops(cpu_runtime, one_rank_group, monkeypatch, with_h0,
                                            with_ht, lasp2):
    """chunk_gated_delta_rule's autograd on the CPU stand-ins, on one GPU and with cp_group (one
    rank, which holds the whole sequences): every input's gradient (beta's in bf16, as passed,
    through the fp32 copy) is float64 autograd's through the recurrence."""
    if lasp2:
        monkeypatch.setattr(lt, "_runtime", lt._Runtime(None, one_rank_group, (0,), 0, 1, 0))
    q, k, v, g, beta, h0 = gdn_inputs(t=20)
    beta = beta.bfloat16()
    h0 = h0 if with_h0 else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0) if x is not None]
    o, ht = lt.chunk_gated_delta_rule(*leaves[:5], scale=0.125,
                                      initial_state=leaves[5] if with_h0 else None,
                                      output_final_state=with_ht,
                                      cp_group=one_rank_group if lasp2 else None)
    assert (ht is not None) == with_ht
    do, dht = torch.rand(B, 20, H, DV).bfloat16(), torch.rand(B, H, DK, DV)
    outputs, cotangents = ((o, ht), (do, dht)) if with_ht else ((o,), (do,))
    got = torch.autograd.grad(outputs, leaves, cotangents)
    assert [x.dtype for x in got] == [x.dtype for x in leaves]
    wide = [x.detach().double().requires_grad_() for x in leaves]
    o64, ht64 = delta_recurrent(*wide[:5], wide[5] if with_h0 else None, 0.125)
    want = torch.autograd.grad((o64, ht64) if with_ht else (o64,), wide,
                               (do.double(), dht.double()) if with_ht else (do.double(),))
    for x, y in zip(got, want):
        torch.testing.assert_close(x.double(), y, rtol=1e-2, atol=1e-2)


def test_gdn_normalises_q_and_k_where_asked(cpu_runtime):
    """use_qk_l2norm_in_kernel=True: the outputs of unnormalised q and k are those of their
    l2-normalised copies, and their gradients flow through the normalisation."""
    q, k, v, g, beta, _ = gdn_inputs(t=7)
    q2, k2 = (3 * q.float()).bfloat16(), (0.5 * k.float()).bfloat16()
    o, _ = lt.chunk_gated_delta_rule(q2, k2, v, g, beta, use_qk_l2norm_in_kernel=True)
    want, _ = lt.chunk_gated_delta_rule(lt._l2norm(q2), lt._l2norm(k2), v, g, beta)
    assert torch.equal(o, want)
    leaf = q2.clone().requires_grad_()
    o, _ = lt.chunk_gated_delta_rule(leaf, k2, v, g, beta, use_qk_l2norm_in_kernel=True)
    (grad,) = torch.autograd.grad(o.float().sum(), leaf)
    # The output does not change along q's own direction, so neither does the loss: each row of
    # the gradient is orthogonal to its row of q, up to the gradient's bf16 rounding.
    grad, row = grad.float(), leaf.detach().float()
    cosine = (grad * row).sum(-1) / (grad.norm(dim=-1) * row.norm(dim=-1))
    assert cosine.abs().max() < 2e-2


# mLSTM.

def mlstm_cpu_inputs(**shape):
    dims = dict(b=B, t=T, h=H, dk=DK, dv=DV) | shape
    return mlstm_inputs(**dims, device="cpu", seed=3)


@pytest.mark.parametrize("with_state, with_dct", [(False, False), (True, False), (True, True)])
def test_the_mlstm_reference_backward_is_autograds_with_constant_stabilisers(with_state, with_dct):
    """The closed-form gradient the CPU stand-in computes is float64 autograd's through the
    recurrence with the stabilisers and denominators held constant, but for <dC_T, C_T> in every
    log forget gate's gradient, which mlstm_kernels' rule drops."""
    q, k, v, i, f, state = mlstm_cpu_inputs(t=6)
    leaves = [x.double().requires_grad_() for x in (q, k, v, i, f, state[0])]
    state64 = (leaves[5], state[1].double(), state[2].double()) if with_state else None
    do = torch.rand(B, 6, H, DV, dtype=torch.float64)
    dct = torch.rand(B, H, DK, DV, dtype=torch.float64) if with_dct else None
    h, (c, _, _) = mlstm_recurrent(*leaves[:5], state64, 0.3, tfla=True)
    outs, cots = ((h, c), (do, dct)) if with_dct else ((h,), (do,))
    want = list(torch.autograd.grad(outs, leaves if with_state else leaves[:5], cots))
    if with_dct:
        want[4] = want[4] - (dct * c.detach()).sum((-2, -1))[:, None] * torch.sigmoid(-f.double())
    got = mlstm_gradients(q, k, v, i, f, state if with_state else None, do, dct, 0.3)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
@pytest.mark.parametrize("save", [False, True])
def test_mlstm_fake_outputs_have_the_real_shapes(want_ht, lasp2, save):
    q, k, v, i, f = (x.to("meta") for x in mlstm_cpu_inputs()[:5])
    h0 = torch.empty(B * H * (DK * DV + DK + 1), device="meta")
    out, ht, rows, start, exit_ = MLSTM_FWD(q, k, v, i, f, h0, 0.125, want_ht, lasp2, save)
    packed = B * H * (DK * DV + DK + 1)
    assert (out.shape, out.dtype) == ((B, T, H, DV), torch.bfloat16)
    assert ht.shape == ((packed,) if want_ht else (0,))
    assert rows.shape == ((2, B, T, H) if save else (0,))
    assert start.shape == exit_.shape == ((packed,) if lasp2 and save else (0,))
    grads = MLSTM_BWD(q, k, v, i, f, start if lasp2 else h0, exit_ if lasp2 else None, rows, out,
                      None, 0.125, True, lasp2)
    assert [x.shape for x in grads] == [q.shape, k.shape, v.shape, i.shape, f.shape,
                                        (B, H, DK, DV)]


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_mlstm_opcheck(with_h0, lasp2):
    q, k, v, i, f, state = mlstm_cpu_inputs(dk=64, dv=64, t=5)
    h0 = lt._pack_mlstm_state(state) if with_h0 else None
    leaves = [x.requires_grad_() for x in (q, k, v, i, f)]
    torch.library.opcheck(MLSTM_FWD, (*leaves, h0, 0.125, True, lasp2, True))
    detached = [x.detach() for x in leaves]
    _, ht, rows, start, exit_ = MLSTM_FWD(*detached, h0, 0.125, True, lasp2, True)
    do = torch.rand(B, 5, H, 64).bfloat16()
    entry, leaving = (start, exit_) if lasp2 else (h0, ht)
    torch.library.opcheck(MLSTM_BWD, (*detached, entry, leaving, rows, do, None, 0.125,
                                      with_h0, lasp2))


@pytest.mark.parametrize("dtype, shard_start", [(torch.int32, None), (torch.int64, 3)])
def test_mlstm_packed_documents_flow_through_the_ops(cpu_runtime, dtype, shard_start):
    """mlstm's cu_seqlens and shard_start reach both custom ops (the CPU stand-ins run each
    document on its own from the zero state), the gradients are each document's own under
    mlstm_kernels' rule, and f's is 0 at every document start (the per-document final states:
    test_per_document_final_states)."""
    t = 40
    q, k, v, i, f, _ = mlstm_cpu_inputs(dk=64, dv=64, t=t)
    cu = torch.tensor([0, 1, 17, 30, t, t] if shard_start is None else [0, 4, 20, 33, 43, 43],
                      dtype=dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, i, f)]
    h, ht = lt.mlstm(*leaves, scale=0.125, cu_seqlens=cu, shard_start=shard_start)
    assert ht is None
    do = torch.rand(B, t, H, 64).bfloat16()
    got = torch.autograd.grad(h, leaves, do)
    first = shard_start or 0
    bounds = documents(cu, first, t)
    want_h = torch.cat([mlstm_recurrent(*(x[:, a:z] for x in (q, k, v, i, f)), None, 0.125)[0]
                        for a, z in bounds], dim=1)
    torch.testing.assert_close(h.double(), want_h, rtol=2e-2, atol=2e-2)
    for a, z in bounds:
        want = mlstm_gradients(*(x[:, a:z] for x in (q, k, v, i, f)), None, do[:, a:z], None,
                               0.125)[:5]
        for n, (x, y) in enumerate(zip(got, want)):
            y = y.clone()
            if n == 4 and a + first in {int(s) for s in cu}:
                y[:, 0] = 0  # f's gradient at a document start
            torch.testing.assert_close(x[:, a:z].double(), y.double(), rtol=2e-2, atol=2e-2)
    starts = sorted({int(s) - first for s in cu if 0 <= int(s) - first < t})
    assert got[4][:, starts].abs().max() == 0


def test_a_compiled_mlstm_block_has_no_graph_break_and_the_eager_gradients():
    def block(q, k, v, i, f):
        out, ht, _, _, _ = MLSTM_FWD(q, k, v, i, f, None, 0.125, True, False, True)
        return (out.float() ** 2).sum() + ht.sum()

    expect_one_graph_and_the_eager_gradients(block, mlstm_cpu_inputs(dk=64, dv=64, t=5)[:5])


@pytest.mark.parametrize("with_h0", [False, True])
@pytest.mark.parametrize("want_ht", [False, True])
@pytest.mark.parametrize("lasp2", [False, True])
def test_the_library_accepts_the_mlstm_calls(library, with_h0, want_ht, lasp2):
    q, k, v, i, f, state = mlstm_cpu_inputs()
    h0 = lt._pack_mlstm_state(state) if with_h0 else None
    (out, ht, rows, start, exit_), forward = lt._mlstm_forward_call(q, k, v, i, f, h0, 0.125,
                                                                   want_ht, lasp2, True)
    call_is_accepted(library, forward, _abi.DIRECTION_FORWARD)
    entry, leaving = (start, exit_) if lasp2 else (h0, ht if want_ht else None)
    dct = torch.rand(B, H, DK, DV) if want_ht else None
    for writes_dh0 in (False, True):
        _, backward = lt._mlstm_backward_call(q, k, v, i, f, entry, leaving, rows, out, dct,
                                              0.125, with_h0, lasp2, writes_dh0)
        call_is_accepted(library, backward, _abi.DIRECTION_BACKWARD)


def test_the_library_would_catch_an_mlstm_call_without_the_input_gate(library):
    q, k, v, i, f, _ = mlstm_cpu_inputs()
    _, forward = lt._mlstm_forward_call(q, k, v, i, f, None, 0.125, False, False, False)
    forward.tensors.slot[_abi.SLOT_I_GATE] = _abi.Tensor()
    with pytest.raises(_abi.LaspError, match="LASP_SLOT_I_GATE is empty"):
        call_is_accepted(library, forward, _abi.DIRECTION_FORWARD)


def mlstm_bad_arguments():
    q, k, v, i, f, state = mlstm_cpu_inputs()
    return [
        ("i shape", dict(i=i[:, :-1]), ValueError, r"i must be like f"),
        ("f shape", dict(f=f[:, :-1]), ValueError, r"f has the shape \(2, 8, 2\).*\[B, T, H\] f\b"),
        ("f fp16", dict(f=f.half()), TypeError, "f must be torch.float32"),
        ("i bf16", dict(i=i.bfloat16()), ValueError, r"i must be like f"),
        ("state of two", dict(initial_state=state[:2]), ValueError,
         r"initial_state must be \(C, n, m\)"),
        ("state n shape", dict(initial_state=(state[0], state[1][..., :-1], state[2])),
         ValueError, r"initial_state must be \(C, n, m\)"),
        ("Dv 96", dict(v=v[..., :96].contiguous(), initial_state=None), ValueError,
         "Dk = 64 and Dv = 96 must each be 64 or 128"),
        ("on the CPU", {}, ValueError, "q is on cpu, but lasp-shmem runs on cuda:0"),
    ]


MLSTM_BAD_ARGUMENTS = mlstm_bad_arguments()


@pytest.mark.parametrize("name, change, error, message", MLSTM_BAD_ARGUMENTS,
                         ids=[case[0] for case in MLSTM_BAD_ARGUMENTS])
def test_mlstm_bad_arguments_are_refused_before_any_call(runtime, name, change, error, message):
    q, k, v, i, f, state = mlstm_cpu_inputs()
    args = dict(q=q, k=k, v=v, i=i, f=f, initial_state=state) | change
    with pytest.raises(error, match=message):
        lt.mlstm(**args)


@pytest.mark.parametrize("with_h0, with_ht", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("lasp2", [False, True])
def test_mlstm_gradients_flow_through_the_ops(cpu_runtime, one_rank_group, monkeypatch, with_h0,
                                              with_ht, lasp2):
    """lt.mlstm's autograd on the CPU stand-ins, on one GPU and with cp_group (one rank, which
    holds the whole sequences): h, the final state and every input's gradient are the closed
    form's (the final state's n and m get no gradient, nor do the initial state's)."""
    if lasp2:
        monkeypatch.setattr(lt, "_runtime", lt._Runtime(None, one_rank_group, (0,), 0, 1, 0))
    q, k, v, i, f, state = mlstm_cpu_inputs(t=20)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, i, f, *state)]
    h0 = tuple(leaves[5:]) if with_h0 else None
    out, ht = lt.mlstm(*leaves[:5], scale=0.125, initial_state=h0, output_final_state=with_ht,
                       cp_group=one_rank_group if lasp2 else None)
    assert (ht is not None) == with_ht
    want_h, want_final = mlstm_recurrent(q, k, v, i, f, state if with_h0 else None, 0.125)
    torch.testing.assert_close(out.double(), want_h.bfloat16().double())
    do, dct = torch.rand(B, 20, H, DV).bfloat16(), torch.rand(B, H, DK, DV)
    outputs, cotangents = ((out, ht[0]), (do, dct)) if with_ht else ((out,), (do,))
    used = leaves if with_h0 else leaves[:5]
    got = torch.autograd.grad(outputs, used, cotangents, allow_unused=True)
    want = mlstm_gradients(q, k, v, i, f, state if with_h0 else None, do,
                           dct if with_ht else None, 0.125)
    for x, y in zip(got[:5], want[:5]):
        torch.testing.assert_close(x.double(), y.to(x.dtype).double())
    if with_h0:
        torch.testing.assert_close(got[5].double(), want[5])
        assert all(g is None or torch.count_nonzero(g) == 0 for g in got[6:])

