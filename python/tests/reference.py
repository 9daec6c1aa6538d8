"""The float64 reference for the tests: the recurrence itself, token by token, forwards and
backwards (scalar decay, GLA's per-key decay, and Gated DeltaNet's delta rule), and the mLSTM's
stabilised recurrence."""

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


def mlstm_gate_grad_scale(q, k, dq, dk, tokens=slice(None)):
    """The size of the terms the mLSTM's gate gradients are differences of: ||reverse cumsum over
    T of sum_d |q dq| + |k dk|||, per (b, h) (`MlstmGrads::gate_grad_scale` of the Rust
    reference). `tokens`: the positions measured (a rank's shard)."""
    terms = ((q.double() * dq.double()).abs() + (k.double() * dk.double()).abs()).sum(-1)
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


def mlstm_recurrent(q, k, v, i, f, state=None, scale=None, eps=1e-6, tfla=False):
    """h [B, T, H, Dv] and the final state (C [B, H, Dk, Dv], n [B, H, Dk], m [B, H]) of
    mlstm_kernels' mLSTMexp in float64 (inputs that are float64 already are used as they are,
    so gradients reach them): m_t = max(lf_t + m_{t-1}, i_t), C_t = e^{lf_t + m_{t-1} - m_t}
    C_{t-1} + e^{i_t - m_t} k_t^T v_t (n alike with k_t), h_t = scale q_t C_t /
    (max(|scale q_t . n_t|, e^{-m_t}) + eps), lf = logsigmoid(f), from `state` or (0, 0, 0).
    `tfla`: the stabilisers and denominators are held constant (autograd then gives
    `mlstm_gradients`, but for the final state's term it drops: see there)."""
    h, final, _, _ = _mlstm_scan(q, k, v, i, f, state, scale, eps, tfla)
    return h, final


def _mlstm_scan(q, k, v, i, f, state, scale, eps, tfla=False):
    """`mlstm_recurrent`, and every token's stabiliser m_t and denominator [B, T, H]."""
    q, k, v, i, f = (x.double() for x in (q, k, v, i, f))
    b, t, h, dk = q.shape
    scale = dk ** -0.5 if scale is None else scale
    if state is None:
        c, n, m = q.new_zeros(b, h, dk, v.shape[-1]), q.new_zeros(b, h, dk), q.new_zeros(b, h)
    else:
        c, n, m = (x.double() for x in state)
    lf = torch.nn.functional.logsigmoid(f)
    outputs, ms, dens = [], [], []
    for s in range(t):
        m_new = torch.maximum(lf[:, s] + m, i[:, s])
        if tfla:
            m_new = m_new.detach()
        decay, write = (lf[:, s] + m - m_new).exp(), (i[:, s] - m_new).exp()
        c = decay[..., None, None] * c + write[..., None, None] * k[:, s, :, :, None] * v[:, s, :, None, :]
        n = decay[..., None] * n + write[..., None] * k[:, s]
        m = m_new
        qn = scale * (q[:, s] * n).sum(-1)
        den = torch.maximum(qn.abs(), (-m).exp()) + eps
        if tfla:
            den = den.detach()
        outputs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, s], c) / den[..., None])
        ms.append(m)
        dens.append(den)
    return torch.stack(outputs, 1), (c, n, m), torch.stack(ms, 1), torch.stack(dens, 1)


def mlstm_gradients(q, k, v, i, f, state, grad_h, grad_c=None, scale=None, eps=1e-6):
    """dq, dk, dv, di, df and dC_0 of <h, grad_h> + <C_T, grad_c> through `mlstm_recurrent`
    under mlstm_kernels' gradient (the library's), in float64, in closed form (no autograd, so
    that it can stand in for a kernel). With the forward's m_t and den_t constants, dO' = grad_h /
    den, F the inclusive cumsum of lf and w_rj = e^{F_r - F_j + i_j - m_r} (j <= r):
    dq_r = s sum_j w_rj (dO'_r . v_j) k_j + s e^{F_r + m_0 - m_r} dO'_r C_0^T,
    dk_j = s sum_r w_rj (dO'_r . v_j) q_r + e^{F_T - F_j + i_j - m_T} dC_T v_j, dv_j alike,
    di_j = k_j . dk_j, df_t = sigmoid(-f_t) sum_{s >= t} (q_s . dq_s - k_s . dk_s),
    dC_0 = s sum_r e^{F_r + m_0 - m_r} q_r^T dO'_r + e^{F_T + m_0 - m_T} dC_T. Autograd of
    `mlstm_recurrent(tfla=True)` gives the same but for <dC_T, C_T> more in every dlf_t, which
    this rule drops."""
    _, final, m, den = _mlstm_scan(q, k, v, i, f, state, scale, eps)
    q, k, v, i, f, do = (x.double() for x in (q, k, v, i, f, grad_h))
    b, t, h, dk = q.shape
    dv_ = v.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    c0 = q.new_zeros(b, h, dk, dv_) if state is None else state[0].double()
    m0 = q.new_zeros(b, h) if state is None else state[2].double()
    # Heads first: [B, H, T, ...].
    q, k, v, do = (x.transpose(1, 2) for x in (q, k, v, do))
    i, f, m, den = (x.transpose(1, 2) for x in (i, f, m, den))
    dop = do / den[..., None]
    big_f = torch.nn.functional.logsigmoid(f).cumsum(-1)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    log_w = big_f[..., :, None] - big_f[..., None, :] + i[..., None, :] - m[..., :, None]
    w = torch.where(causal, log_w, float("-inf")).exp()
    a = w * (dop @ v.transpose(-1, -2))  # [r, j]: w_rj dO'_r . v_j
    dq = scale * (a @ k) + scale * (big_f + m0[..., None] - m).exp()[..., None] * (
        dop @ c0.transpose(-1, -2))
    dk_ = scale * (a.transpose(-1, -2) @ q)
    dv = (w * (scale * q @ k.transpose(-1, -2))).transpose(-1, -2) @ dop
    dc0 = scale * torch.einsum("bhr,bhrk,bhrv->bhkv", (big_f + m0[..., None] - m).exp(), q, dop)
    if grad_c is not None:
        dct = grad_c.double()
        to_end = (big_f[..., -1:] - big_f + i - final[2][..., None]).exp()[..., None]
        dk_ = dk_ + to_end * (v @ dct.transpose(-1, -2))
        dv = dv + to_end * (k @ dct)
        dc0 = dc0 + (big_f[..., -1] + m0 - final[2]).exp()[..., None, None] * dct
    di = (k * dk_).sum(-1)
    x = (q * dq).sum(-1) - di
    dlf = x.flip(-1).cumsum(-1).flip(-1)
    df = dlf * torch.sigmoid(-f)
    heads_second = (lambda y: y.transpose(1, 2).contiguous())
    return (*(heads_second(y) for y in (dq, dk_, dv, di, df)), dc0)


def mlstm_inputs(b, t, h, dk, dv, device, seed):
    """q, k, v (bf16 in [-1, 1)), input gates around 0, forget gates around 3 (sigmoid 0.95, as
    mlstm_kernels' benchmark) and an initial state (C, n, m) (fp32; m in [-1, 1))."""
    q, k, v, _, c0 = inputs(b, t, h, dk, dv, device, seed)
    gen = torch.Generator(device=device).manual_seed(seed + 2)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    i, f = 2 * rand(b, t, h) - 1, 2 + 2 * rand(b, t, h)
    state = (c0, rand(b, h, dk) - 0.5, 2 * rand(b, h) - 1)
    return q, k, v, i, f, state

