//! Per-(batch, head) views of the mLSTM inputs, state and gradients, and the runners that
//! validate, gather every head, run the maths on contiguous buffers and scatter the results back.

use super::super::error::ReferenceError;
use super::super::generate::logsigmoid;
use super::super::inputs::Shape;
use super::super::linalg::{axpy, dot, vec_mat_add};
use super::super::tensor::Tensor;
use super::inputs::{MlstmCotangents, MlstmForward, MlstmGrads, MlstmInputs, MlstmState};

/// One head: rows `[T, Dk]` of q and k, `[T, Dv]` of v, `[T]` of the input-gate pre-activations
/// and of the log forget gates `logsigmoid(f_t)`.
pub(crate) struct MlstmHead {
    pub(crate) t: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) q: Vec<f64>,
    pub(crate) k: Vec<f64>,
    pub(crate) v: Vec<f64>,
    pub(crate) input_gate: Vec<f64>,
    pub(crate) log_forget: Vec<f64>,
    pub(crate) scale: f64,
    pub(crate) eps: f64,
}

/// One head's stabilised state: `C [Dk, Dv]`, `n [Dk]`, `m`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct HeadState {
    pub(crate) c: Vec<f64>,
    pub(crate) n: Vec<f64>,
    pub(crate) m: f64,
}

impl HeadState {
    /// `C = 0, n = 0, m = 0`: mlstm_kernels' default initial state.
    pub(crate) fn zero(dk: usize, dv: usize) -> HeadState {
        HeadState {
            c: vec![0.0; dk * dv],
            n: vec![0.0; dk],
            m: 0.0,
        }
    }

    /// The empty state, `m = -inf`: no contribution at all, so the first token sets `m` to its
    /// own `i_t` (a shard's summary starts here; `e^{-inf} = 0` keeps every update finite).
    pub(crate) fn empty(dk: usize, dv: usize) -> HeadState {
        HeadState {
            m: f64::NEG_INFINITY,
            ..HeadState::zero(dk, dv)
        }
    }

    /// In place, `self <- e^{a - m_new} self + e^{b - m_new} (c, n)` with `m_new = max(a, b)`: the
    /// sum of two stabilised contributions with log-weights `a` (self, before the weight) and `b`,
    /// rescaled to the larger stabiliser. Both factors are `<= 1`.
    pub(crate) fn combine(&mut self, a: f64, other: &HeadState, b: f64) {
        let m = a.max(b);
        let (fa, fb) = ((a - m).exp(), (b - m).exp());
        self.c
            .iter_mut()
            .zip(&other.c)
            .for_each(|(x, y)| *x = fa * *x + fb * y);
        self.n
            .iter_mut()
            .zip(&other.n)
            .for_each(|(x, y)| *x = fa * *x + fb * y);
        self.m = m;
    }

    /// The transpose of [`combine`](Self::combine) at the same arguments (`self` before the
    /// combine): from the cotangent `d` of the result (`d.m`: of its stabiliser `max(a, b)`), the
    /// cotangents of `self` and `other`, each with `m` holding that of its log-weight, `a` or `b`.
    /// Each side's term `e^{x - max(a, b)} (c, n)` passes its share `g` of `<d, result>` to its own
    /// log-weight and `-g` to the larger one, so the larger side's own share drops out; `d.m` goes
    /// to the larger side (`self` on ties, as `combine`'s max).
    pub(crate) fn combine_backward(
        &self,
        a: f64,
        other: &HeadState,
        b: f64,
        d: &HeadState,
    ) -> (HeadState, HeadState) {
        let m = a.max(b);
        let (fa, fb) = ((a - m).exp(), (b - m).exp());
        let share = |f: f64, x: &HeadState| f * (dot(&d.c, &x.c) + dot(&d.n, &x.n));
        let (da, db) = if a >= b {
            (d.m - share(fb, other), share(fb, other))
        } else {
            (share(fa, self), d.m - share(fa, self))
        };
        let scaled = |f: f64, m: f64| HeadState {
            c: d.c.iter().map(|x| f * x).collect(),
            n: d.n.iter().map(|x| f * x).collect(),
            m,
        };
        (scaled(fa, da), scaled(fb, db))
    }
}

impl MlstmHead {
    /// Gathers head `(b, h)` of validated inputs.
    pub(crate) fn gather(inputs: &MlstmInputs, b: usize, h: usize) -> MlstmHead {
        let s = inputs.shape;
        MlstmHead {
            t: s.t,
            dk: s.dk,
            dv: s.dv,
            q: inputs.q.head_rows(b, h),
            k: inputs.k.head_rows(b, h),
            v: inputs.v.head_rows(b, h),
            input_gate: inputs.input_gate.head_rows(b, h),
            log_forget: inputs
                .forget_gate
                .head_rows(b, h)
                .into_iter()
                .map(logsigmoid)
                .collect(),
            scale: inputs.scale,
            eps: inputs.eps,
        }
    }

    pub(crate) fn q(&self, t: usize) -> &[f64] {
        &self.q[t * self.dk..(t + 1) * self.dk]
    }

    pub(crate) fn k(&self, t: usize) -> &[f64] {
        &self.k[t * self.dk..(t + 1) * self.dk]
    }

    pub(crate) fn v(&self, t: usize) -> &[f64] {
        &self.v[t * self.dv..(t + 1) * self.dv]
    }

    /// The chunks `(start, len)` of size `chunk`, the last one short where `chunk` does not divide
    /// T.
    pub(crate) fn chunks(
        &self,
        chunk: usize,
    ) -> impl DoubleEndedIterator<Item = (usize, usize)> + ExactSizeIterator {
        let t = self.t;
        (0..t.div_ceil(chunk)).map(move |c| (c * chunk, chunk.min(t - c * chunk)))
    }

    /// Tokens `[start, start + len)` as a head of their own (one LASP-2 shard).
    pub(crate) fn tokens(&self, start: usize, len: usize) -> MlstmHead {
        let (dk, dv, end) = (self.dk, self.dv, start + len);
        MlstmHead {
            t: len,
            dk,
            dv,
            q: self.q[start * dk..end * dk].to_vec(),
            k: self.k[start * dk..end * dk].to_vec(),
            v: self.v[start * dv..end * dv].to_vec(),
            input_gate: self.input_gate[start..end].to_vec(),
            log_forget: self.log_forget[start..end].to_vec(),
            scale: self.scale,
            eps: self.eps,
        }
    }

    /// Writes `h_t` into `out [Dv]` from the stabilised numerator `sigma q_t C` (`num`) and
    /// `sigma q_t . n` (`qn`) at stabiliser `m_t`: `h_t = num / (max(|qn|, e^{-m_t}) + eps)`.
    pub(crate) fn normalise(&self, out: &mut [f64], num: &[f64], qn: f64, m: f64) {
        let denominator = qn.abs().max((-m).exp()) + self.eps;
        out.iter_mut()
            .zip(num)
            .for_each(|(o, x)| *o = x / denominator);
    }

    /// `(sigma q_t C, sigma q_t . n)` of a stabilised state.
    pub(crate) fn read(&self, t: usize, state: &HeadState) -> (Vec<f64>, f64) {
        let mut num = vec![0.0; self.dv];
        vec_mat_add(&mut num, self.scale, self.q(t), &state.c);
        (num, self.scale * dot(self.q(t), &state.n))
    }
}

/// One head's gradients: `[T, ...]` rows of q, k, v, the input gates and the log forget gates
/// `lf = logsigmoid(f)` (the runner turns `dL/dlf` into `dL/df`), and the entry state's.
pub(crate) struct HeadGrads {
    pub(crate) dq: Vec<f64>,
    pub(crate) dk: Vec<f64>,
    pub(crate) dv: Vec<f64>,
    pub(crate) di: Vec<f64>,
    pub(crate) d_log_forget: Vec<f64>,
    pub(crate) d_state: HeadState,
}

impl HeadGrads {
    /// Zero token gradients for `head`, and `d_state` as the entry state's.
    pub(crate) fn zeros(head: &MlstmHead, d_state: HeadState) -> HeadGrads {
        HeadGrads {
            dq: vec![0.0; head.t * head.dk],
            dk: vec![0.0; head.t * head.dk],
            dv: vec![0.0; head.t * head.dv],
            di: vec![0.0; head.t],
            d_log_forget: vec![0.0; head.t],
            d_state,
        }
    }

    /// Adds the token gradients of `tokens`, a pass over this head's tokens from `start` on (its
    /// `d_state` is the gradient of another state and is left out).
    pub(crate) fn add_tokens(&mut self, start: usize, tokens: &HeadGrads) {
        let len = tokens.di.len();
        let (dk, dv) = (tokens.dq.len() / len, tokens.dv.len() / len);
        axpy(
            &mut self.dq[start * dk..(start + len) * dk],
            1.0,
            &tokens.dq,
        );
        axpy(
            &mut self.dk[start * dk..(start + len) * dk],
            1.0,
            &tokens.dk,
        );
        axpy(
            &mut self.dv[start * dv..(start + len) * dv],
            1.0,
            &tokens.dv,
        );
        axpy(&mut self.di[start..start + len], 1.0, &tokens.di);
        axpy(
            &mut self.d_log_forget[start..start + len],
            1.0,
            &tokens.d_log_forget,
        );
    }
}

/// The initial state of head `(b, h)` of validated inputs.
pub(crate) fn initial_head_state(inputs: &MlstmInputs, b: usize, h: usize) -> HeadState {
    let s = inputs.shape;
    inputs
        .initial_state
        .as_ref()
        .map_or_else(|| HeadState::zero(s.dk, s.dv), |st| head_state(st, b, h))
}

/// Head `(b, h)` of a state.
pub(crate) fn head_state(state: &MlstmState, b: usize, h: usize) -> HeadState {
    HeadState {
        c: state.c.block(b, h).to_vec(),
        n: state.n.block(b, h).to_vec(),
        m: state.m.block(b, h)[0],
    }
}

/// A state of shape `[B, H, ...]` from per-head states in `(b, h)` order.
pub(crate) fn assemble_state(s: &Shape, heads: &[HeadState]) -> MlstmState {
    let mut state = MlstmState {
        c: Tensor::zeros(&s.state()),
        n: Tensor::zeros(&[s.b, s.h, s.dk]),
        m: Tensor::zeros(&[s.b, s.h]),
    };
    for (index, head) in heads.iter().enumerate() {
        let (b, h) = (index / s.h, index % s.h);
        state.c.block_mut(b, h).copy_from_slice(&head.c);
        state.n.block_mut(b, h).copy_from_slice(&head.n);
        state.m.block_mut(b, h)[0] = head.m;
    }
    state
}

/// Validates `inputs`, runs `per_head(head, initial state)` -> `(h rows [T, Dv], final state)`
/// on every head and assembles the forward.
pub(crate) fn forward_heads(
    inputs: &MlstmInputs,
    per_head: impl Fn(&MlstmHead, HeadState) -> (Vec<f64>, HeadState),
) -> Result<MlstmForward, ReferenceError> {
    inputs.validate()?;
    let s = inputs.shape;
    let mut out = Tensor::zeros(&s.v());
    let mut finals = Vec::with_capacity(s.b * s.h);
    for b in 0..s.b {
        for h in 0..s.h {
            let head = MlstmHead::gather(inputs, b, h);
            let (rows, state) = per_head(&head, initial_head_state(inputs, b, h));
            out.set_head_rows(b, h, &rows);
            finals.push(state);
        }
    }
    Ok(MlstmForward {
        h: out,
        final_state: assemble_state(&s, &finals),
    })
}

/// Validates `inputs` and `cot`, runs `per_head(head, initial state, d_h rows [T, Dv], final-state
/// cotangent)` on every head in `(b, h)` order and assembles the gradients, `dL/df = dL/dlf sigmoid(-f)` (the
/// derivative of `lf = logsigmoid(f)`).
pub(crate) fn backward_heads(
    inputs: &MlstmInputs,
    cot: &MlstmCotangents,
    mut per_head: impl FnMut(&MlstmHead, HeadState, &[f64], HeadState) -> HeadGrads,
) -> Result<MlstmGrads, ReferenceError> {
    inputs.validate()?;
    let s = inputs.shape;
    cot.validate(&s)?;
    let (mut dq, mut dk, mut dv) = (
        Tensor::zeros(&s.qk()),
        Tensor::zeros(&s.qk()),
        Tensor::zeros(&s.v()),
    );
    let (mut di, mut df) = (Tensor::zeros(&s.per_token()), Tensor::zeros(&s.per_token()));
    let mut d_initial = Vec::with_capacity(s.b * s.h);
    for b in 0..s.b {
        for h in 0..s.h {
            let head = MlstmHead::gather(inputs, b, h);
            let d_final = cot
                .d_final_state
                .as_ref()
                .map_or_else(|| HeadState::zero(s.dk, s.dv), |d| head_state(d, b, h));
            let g = per_head(
                &head,
                initial_head_state(inputs, b, h),
                &cot.d_h.head_rows(b, h),
                d_final,
            );
            let d_forget: Vec<f64> = g
                .d_log_forget
                .iter()
                .zip(inputs.forget_gate.head_rows(b, h))
                .map(|(d, f)| d / (1.0 + f.exp()))
                .collect();
            dq.set_head_rows(b, h, &g.dq);
            dk.set_head_rows(b, h, &g.dk);
            dv.set_head_rows(b, h, &g.dv);
            di.set_head_rows(b, h, &g.di);
            df.set_head_rows(b, h, &d_forget);
            d_initial.push(g.d_state);
        }
    }
    Ok(MlstmGrads {
        dq,
        dk,
        dv,
        d_input_gate: di,
        d_forget_gate: df,
        d_initial_state: assemble_state(&s, &d_initial),
    })
}
