//! Per-(batch, head) views. Every family computes one head at a time on contiguous row-major
//! buffers; these helpers gather a head out of the `[B, T, H, ...]` tensors and scatter results
//! back, so the maths code never deals with the 4-D layout.
//!
//! The runners ([`forward_heads`], [`chunk_states_heads`], [`backward_heads`]) validate what they
//! are given before gathering anything, so every family's entry points check their inputs before
//! any arithmetic by construction.

use super::error::ReferenceError;
use super::inputs::{Family, Inputs};
use super::outputs::{Forward, Grads};
use super::tensor::Tensor;
use super::validate::{check_chunk, check_cotangents};

/// One head of one sequence: rows `[T, Dk]` of q and k, `[T, Dv]` of v, `[T, gate_dim]` of g,
/// `[T]` of beta (empty when absent), the `[Dk, Dv]` initial state (zeros when absent).
pub(crate) struct Head {
    pub(crate) t: usize,
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    /// 1 for scalar gates, Dk for vector gates.
    pub(crate) gate_dim: usize,
    pub(crate) q: Vec<f64>,
    pub(crate) k: Vec<f64>,
    pub(crate) v: Vec<f64>,
    pub(crate) g: Vec<f64>,
    pub(crate) beta: Vec<f64>,
    pub(crate) h0: Vec<f64>,
    pub(crate) scale: f64,
}

impl Head {
    /// Gathers head `(b, h)` of already validated inputs.
    pub(crate) fn gather(inputs: &Inputs, b: usize, h: usize) -> Head {
        let s = inputs.shape;
        Head {
            t: s.t,
            dk: s.dk,
            dv: s.dv,
            gate_dim: inputs.g.len() / (s.b * s.t * s.h),
            q: inputs.q.head_rows(b, h),
            k: inputs.k.head_rows(b, h),
            v: inputs.v.head_rows(b, h),
            g: inputs.g.head_rows(b, h),
            beta: inputs
                .beta
                .as_ref()
                .map_or_else(Vec::new, |beta| beta.head_rows(b, h)),
            h0: inputs
                .h0
                .as_ref()
                .map_or_else(|| vec![0.0; s.dk * s.dv], |h0| h0.block(b, h).to_vec()),
            scale: inputs.scale,
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

    /// The gates of rows `[start, start + n)`, `[n, gate_dim]`.
    pub(crate) fn gates(&self, start: usize, n: usize) -> &[f64] {
        &self.g[start * self.gate_dim..(start + n) * self.gate_dim]
    }

    /// Tokens `range` of this head as a sequence of their own, entered from `h0` (`[Dk, Dv]`): one
    /// packed document.
    pub(crate) fn tokens(&self, range: std::ops::Range<usize>, h0: Vec<f64>) -> Head {
        let (dk, dv, gd) = (self.dk, self.dv, self.gate_dim);
        let (t0, t1) = (range.start, range.end);
        Head {
            t: t1 - t0,
            dk,
            dv,
            gate_dim: gd,
            q: self.q[t0 * dk..t1 * dk].to_vec(),
            k: self.k[t0 * dk..t1 * dk].to_vec(),
            v: self.v[t0 * dv..t1 * dv].to_vec(),
            g: self.g[t0 * gd..t1 * gd].to_vec(),
            beta: self.beta.get(t0..t1).map_or_else(Vec::new, <[f64]>::to_vec),
            h0,
            scale: self.scale,
        }
    }

    /// Chunk starts `0, chunk, 2 chunk, ...` with their lengths (the last may be short).
    pub(crate) fn chunks(
        &self,
        chunk: usize,
    ) -> impl DoubleEndedIterator<Item = (usize, usize)> + ExactSizeIterator {
        let t = self.t;
        (0..t.div_ceil(chunk)).map(move |c| (c * chunk, chunk.min(t - c * chunk)))
    }
}

/// One head's gradients, in the row layouts of [`Head`]. `dbeta` is empty when the family has no
/// beta.
pub(crate) struct HeadGrads {
    pub(crate) dq: Vec<f64>,
    pub(crate) dk: Vec<f64>,
    pub(crate) dv: Vec<f64>,
    pub(crate) dg: Vec<f64>,
    pub(crate) dbeta: Vec<f64>,
    pub(crate) dh0: Vec<f64>,
}

impl HeadGrads {
    /// Zero gradients for a head, ready to accumulate into.
    pub(crate) fn zeros(h: &Head) -> HeadGrads {
        HeadGrads {
            dq: vec![0.0; h.t * h.dk],
            dk: vec![0.0; h.t * h.dk],
            dv: vec![0.0; h.t * h.dv],
            dg: vec![0.0; h.t * h.gate_dim],
            dbeta: vec![0.0; h.beta.len()],
            dh0: vec![0.0; h.dk * h.dv],
        }
    }
}

/// The chunk-state pass: applies `advance(head, S, c0, n)` (state entering chunk `(c0, n)` to the
/// state leaving it) from h0 and returns the states entering each chunk and the final state.
pub(crate) fn entry_states(
    h: &Head,
    chunk: usize,
    advance: impl Fn(&Head, &mut [f64], usize, usize),
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let mut states = Vec::with_capacity(h.t.div_ceil(chunk));
    let mut s = h.h0.clone();
    for (c0, n) in h.chunks(chunk) {
        states.push(s.clone());
        advance(h, &mut s, c0, n);
    }
    (states, s)
}

/// Checks `chunk` and validates the inputs as `family`, then runs the chunk-state pass
/// ([`entry_states`] with `advance`) on every head and lays the states entering each chunk out as
/// `[B, N, H, Dk, Dv]`, `N = ceil(T / chunk)` (fla's layout of `h`).
pub(crate) fn chunk_states_heads(
    inputs: &Inputs,
    family: Family,
    chunk: usize,
    advance: impl Fn(&Head, &mut [f64], usize, usize),
) -> Result<Tensor, ReferenceError> {
    check_chunk("chunk", chunk)?;
    inputs.validate(family)?;
    let s = inputs.shape;
    let n = s.t.div_ceil(chunk);
    let size = s.dk * s.dv;
    let mut out = Tensor::zeros(&[s.b, n, s.h, s.dk, s.dv]);
    for b in 0..s.b {
        for h in 0..s.h {
            let (states, _) = entry_states(&Head::gather(inputs, b, h), chunk, &advance);
            for (c, state) in states.iter().enumerate() {
                let start = ((b * n + c) * s.h + h) * size;
                out.data_mut()[start..start + size].copy_from_slice(state);
            }
        }
    }
    Ok(out)
}

/// Validates the inputs as `family`, then runs `f(head) -> (o rows [T, Dv], final state [Dk, Dv])`
/// on every head.
pub(crate) fn forward_heads(
    inputs: &Inputs,
    family: Family,
    f: impl Fn(&Head) -> (Vec<f64>, Vec<f64>),
) -> Result<Forward, ReferenceError> {
    inputs.validate(family)?;
    let s = inputs.shape;
    let mut o = Tensor::zeros(&s.v());
    let mut final_state = Tensor::zeros(&s.state());
    for b in 0..s.b {
        for h in 0..s.h {
            let (rows, state) = f(&Head::gather(inputs, b, h));
            o.set_head_rows(b, h, &rows);
            final_state.block_mut(b, h).copy_from_slice(&state);
        }
    }
    Ok(Forward { o, final_state })
}

/// Validates the inputs as `family` and the cotangents against them, then runs
/// `f(head, d_o rows [T, Dv], d_ht [Dk, Dv]) -> HeadGrads` on every head (`d_ht = None` is passed
/// as zeros).
pub(crate) fn backward_heads(
    inputs: &Inputs,
    family: Family,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
    f: impl Fn(&Head, &[f64], &[f64]) -> HeadGrads,
) -> Result<Grads, ReferenceError> {
    inputs.validate(family)?;
    check_cotangents(&inputs.shape, d_o, d_ht)?;
    let s = inputs.shape;
    let mut grads = Grads {
        dq: Tensor::zeros(&s.qk()),
        dk: Tensor::zeros(&s.qk()),
        dv: Tensor::zeros(&s.v()),
        dg: Tensor::zeros(&s.gate(family.gate_kind())),
        dbeta: (family == Family::DeltaRule).then(|| Tensor::zeros(&s.per_token())),
        dh0: Tensor::zeros(&s.state()),
    };
    let zero_state = vec![0.0; s.dk * s.dv];
    for b in 0..s.b {
        for h in 0..s.h {
            let head = Head::gather(inputs, b, h);
            let d_ht_head = d_ht.map_or(zero_state.as_slice(), |d| d.block(b, h));
            let hg = f(&head, &d_o.head_rows(b, h), d_ht_head);
            grads.dq.set_head_rows(b, h, &hg.dq);
            grads.dk.set_head_rows(b, h, &hg.dk);
            grads.dv.set_head_rows(b, h, &hg.dv);
            grads.dg.set_head_rows(b, h, &hg.dg);
            if let Some(dbeta) = &mut grads.dbeta {
                dbeta.set_head_rows(b, h, &hg.dbeta);
            }
            grads.dh0.block_mut(b, h).copy_from_slice(&hg.dh0);
        }
    }
    Ok(grads)
}
