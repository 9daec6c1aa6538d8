"""The float64 reference for the tests: the recurrence itself, token by token, forwards and
backwards (scalar decay, GLA's per-key decay, and Gated DeltaNet's delta rule)."""

import torch


def recurrent(q, k, v, g, h0=None, scale=None):
    """o [B, T, H, Dv] and the final state [B, H, Dk, Dv] of S_t = e^{g_t} S_{t-1} + k_t^T v_t,
    o_t = scale q_t S_t, in float64 (inputs that are float64 already are used as they are, so
    gradients reach them). g [B, T, H] decays the state as a whole (scalar decay), g [B, T, H, Dk]
    row by row (GLA: diag(e^{g_t}) S_{t-1})."""
    q, k, v, g = (x.double() for x in (q, k, v, g))
    b, t, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    s = q.new_zeros(b, h, dk, v.shape[-1]) if h0 is None else h0.double()
    outputs = []
    for i in range(t):
        s = _decay(g, i) * s + k[:, i, :, :, None] * v[:, i, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, i], s))
    return torch.stack(outputs, 1), s


def _decay(g, i):
    """e^{g_i}, shaped to multiply states [B, H, Dk, Dv]: the whole state (g [B, T, H]) or row by
    row (g [B, T, H, Dk])."""
    return (g[:, i, :, None, None] if g.dim() == 3 else g[:, i, :, :, None]).exp()


def gradients(q, k, v, g, h0, grad_o, grad_ht=None, scale=None):
    """dq, dk, dv, dg and dh0 (None without h0) of <o, grad_o> + <ht, grad_ht> through
    `recurrent`, in float64, by the recurrence run backwards (no torch.autograd, so that it can
    stand in for a kernel): dS_t = scale q_t^T do_t + e^{g_{t+1}} dS_{t+1}, dS_T also takes
    grad_ht; dq_t = scale S_t do_t, dk_t = dS_t v_t, dv_t = k_t dS_t, dh0 = e^{g_1} dS_1, and
    dg_t = e^{g_t} <dS_t, S_{t-1}> over the whole state (scalar decay) or per row (GLA)."""
    q, k, v, g, do = (x.double() for x in (q, k, v, g, grad_o))
    b, t, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    states = [q.new_zeros(b, h, dk, v.shape[-1]) if h0 is None else h0.double()]
    for i in range(t):
        states.append(_decay(g, i) * states[-1] + k[:, i, :, :, None] * v[:, i, :, None, :])
    dq, dk_, dv, dg = (torch.zeros_like(x) for x in (q, k, v, g))
    ds = torch.zeros_like(states[0]) if grad_ht is None else grad_ht.double()
    for i in reversed(range(t)):
        ds = ds + scale * q[:, i, :, :, None] * do[:, i, :, None, :]
        dq[:, i] = scale * torch.einsum("bhkv,bhv->bhk", states[i + 1], do[:, i])
        dk_[:, i] = torch.einsum("bhkv,bhv->bhk", ds, v[:, i])
        dv[:, i] = torch.einsum("bhk,bhkv->bhv", k[:, i], ds)
        decay = _decay(g, i)
        terms = decay * ds * states[i]
        dg[:, i] = terms.sum((-2, -1)) if g.dim() == 3 else terms.sum(-1)
        ds = decay * ds
    return dq, dk_, dv, dg, None if h0 is None else ds


def inputs(b, t, h, dk, dv, device, seed, requires_grad=False):
    """q, k, v (bf16 in [-1, 1)), g (log-decays in [-0.5, 0], some exactly 0) and h0 (fp32)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    q, k = ((2 * rand(b, t, h, dk) - 1).bfloat16() for _ in range(2))
    v = (2 * rand(b, t, h, dv) - 1).bfloat16()
    g = torch.where(rand(b, t, h) < 0.05, 0.0, -0.5 * rand(b, t, h))
    h0 = rand(b, h, dk, dv) - 0.5
    tensors = (q, k, v, g, h0)
    return tuple(x.requires_grad_() for x in tensors) if requires_grad else tensors


def gla_inputs(b, t, h, dk, dv, device, seed, requires_grad=False):
    """`inputs` with GLA's gates, one per key dimension: logsigmoid(randn) / 16, as fla's GLA
    layer makes them (in [-0.5, 0), mostly near -0.05)."""
    q, k, v, _, h0 = inputs(b, t, h, dk, dv, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    g = torch.nn.functional.logsigmoid(
        torch.randn(b, t, h, dk, generator=gen, device=device)) / 16
    tensors = (q, k, v, g, h0)
    return tuple(x.requires_grad_() for x in tensors) if requires_grad else tensors


def gate_grad_scale(q, k, dq, dk, tokens=slice(None)):
    """The size of the terms GLA's dg is the difference of: ||reverse cumsum over T of
    |q dq| + |k dk|||, per key dimension (dg_t = sum_{s >= t} (q_s dq_s - k_s dk_s) row by row).
    Under strong decays those terms nearly cancel, so dg's own norm is no measure of its error
    (the Rust GPU tests hold dg to the same scale). `tokens`: the positions measured (a rank's
    shard, whose dg takes the terms of every later token of the sequence too)."""
    terms = (q.double() * dq.double()).abs() + (k.double() * dk.double()).abs()
    return terms.flip(1).cumsum(1).flip(1)[:, tokens].norm().item()


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def bits(x):
    """x's bit patterns, so that a comparison tells -0.0 from 0.0 and sees NaNs."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def delta_recurrent(q, k, v, g, beta, h0=None, scale=None):
    """o [B, T, H, Dv] and the final state of Gated DeltaNet, S_t = e^{g_t} (I - beta_t k_t^T k_t)
    S_{t-1} + beta_t k_t^T v_t, o_t = scale q_t S_t, in float64 (float64 inputs are used as they
    are, so gradients reach them). Per token: P = e^{g_t} S_{t-1}, r_t = v_t - k_t P, S_t = P +
    beta_t k_t^T r_t."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, t, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    s = q.new_zeros(b, h, dk, v.shape[-1]) if h0 is None else h0.double()
    outputs = []
    for i in range(t):
        p = _decay(g, i) * s
        r = v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], p)
        s = p + beta[:, i, :, None, None] * k[:, i, :, :, None] * r[:, :, None, :]
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, i], s))
    return torch.stack(outputs, 1), s


def delta_gradients(q, k, v, g, beta, h0, grad_o, grad_ht=None, scale=None):
    """dq, dk, dv, dg, dbeta and dh0 (None without h0) of <o, grad_o> + <ht, grad_ht> through
    `delta_recurrent`, in float64, by the recurrence run backwards (no torch.autograd, so that it
    can stand in for a kernel). With dS_t the gradient of S_t (dS_T takes grad_ht, every dS_t
    scale q_t^T do_t): dq_t = scale S_t do_t; from S_t = P + beta k^T r: dbeta_t = k dS_t r^T,
    dr = beta k dS_t, dk_t = beta dS_t r^T - P dr, dv_t = dr, dP = dS_t - k^T dr; from P = e^g
    S_{t-1}: dg_t = <dP, P> and dS_{t-1} = e^g dP."""
    q, k, v, g, beta, do = (x.double() for x in (q, k, v, g, beta, grad_o))
    b, t, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    states = [q.new_zeros(b, h, dk, v.shape[-1]) if h0 is None else h0.double()]
    decayed, residuals = [], []
    for i in range(t):
        p = _decay(g, i) * states[-1]
        r = v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], p)
        decayed.append(p)
        residuals.append(r)
        states.append(p + beta[:, i, :, None, None] * k[:, i, :, :, None] * r[:, :, None, :])
    dq, dk_, dv, dg, dbeta = (torch.zeros_like(x) for x in (q, k, v, g, beta))
    ds = torch.zeros_like(states[0]) if grad_ht is None else grad_ht.double()
    for i in reversed(range(t)):
        ds = ds + scale * q[:, i, :, :, None] * do[:, i, :, None, :]
        p, r, ki, bi = decayed[i], residuals[i], k[:, i], beta[:, i, :, None]
        dq[:, i] = scale * torch.einsum("bhkv,bhv->bhk", states[i + 1], do[:, i])
        ds_r = torch.einsum("bhkv,bhv->bhk", ds, r)
        dbeta[:, i] = (ki * ds_r).sum(-1)
        dr = bi * torch.einsum("bhk,bhkv->bhv", ki, ds)
        dk_[:, i] = bi * ds_r - torch.einsum("bhkv,bhv->bhk", p, dr)
        dv[:, i] = dr
        dp = ds - ki[:, :, :, None] * dr[:, :, None, :]
        dg[:, i] = (dp * p).sum((-2, -1))
        ds = _decay(g, i) * dp
    return dq, dk_, dv, dg, dbeta, None if h0 is None else ds


def delta_inputs(b, t, h, dk, dv, device, seed, requires_grad=False):
    """`inputs` for Gated DeltaNet: q and k with unit rows (bf16), g = logsigmoid(randn) / 16 and
    beta = sigmoid(randn) (fp32), as fla's layer makes them."""
    q, k, v, _, h0 = inputs(b, t, h, dk, dv, device, seed)
    q, k = (torch.nn.functional.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, h, generator=gen, device=device)) / 16
    beta = torch.sigmoid(torch.randn(b, t, h, generator=gen, device=device))
    tensors = (q, k, v, g, beta, h0)
    return tuple(x.requires_grad_() for x in tensors) if requires_grad else tensors
