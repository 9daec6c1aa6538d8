//! The chunkwise mLSTM backward: reverse mode through the stabilised chunk form (module doc,
//! "Chunkwise backward"), chunk by chunk from recomputed entry states.

use std::ops::Range;

use super::super::error::ReferenceError;
use super::super::gates::chunk_local_cumsum;
use super::super::linalg::{axpy, dot, mat_vec_add, outer_add, vec_mat_add};
use super::super::validate::check_chunk;
use super::chunkwise::advance;
use super::gradient::MlstmGradient;
use super::head::{backward_heads, HeadGrads, HeadState, MlstmHead};
use super::inputs::{MlstmCotangents, MlstmGrads, MlstmInputs};

/// Chunkwise backward with chunk size `chunk` (>= 1; it need not divide T): `gradient`'s
/// gradients of [`MlstmForward::loss`](super::MlstmForward::loss) through the chunk form of
/// [`chunkwise_forward`](super::chunkwise_forward). The check for it is
/// [`recurrent_backward`](super::recurrent_backward) with the same `gradient`.
pub fn chunkwise_backward(
    inputs: &MlstmInputs,
    chunk: usize,
    cot: &MlstmCotangents,
    gradient: MlstmGradient,
) -> Result<MlstmGrads, ReferenceError> {
    check_chunk("chunk", chunk)?;
    backward_heads(inputs, cot, |head, initial, d_h, d_final| {
        backward_from(head, initial, chunk, Some(d_h), d_final, gradient)
    })
}

/// One head's chunkwise backward from the entry state `initial`, with `d_exit` the cotangent of
/// the state after the last token. `d_h = None` differentiates that state alone (a LASP-2 shard's
/// summary, which has no outputs). The result's `d_state` is the gradient of `initial`. With
/// [`MlstmGradient::Tfla`] it is what one call of mlstm_kernels' backward over these tokens
/// computes.
pub(crate) fn backward_from(
    head: &MlstmHead,
    initial: HeadState,
    chunk: usize,
    d_h: Option<&[f64]>,
    d_exit: HeadState,
    gradient: MlstmGradient,
) -> HeadGrads {
    // Chunk-entry states, recomputed as the forward carries them.
    let mut entries = Vec::new();
    let mut state = initial;
    for (c0, len) in head.chunks(chunk) {
        entries.push(state.clone());
        advance(head, &mut state, c0, len);
    }
    let exit = state;
    let d_exit = gradient.exit_cotangent(d_exit);
    let mut grads = HeadGrads::zeros(head, HeadState::zero(head.dk, head.dv));
    // The cotangent of the state leaving the chunk being processed; after chunk 0, of `initial`.
    let mut d_state = d_exit.clone();
    for ((c0, len), entry) in head.chunks(chunk).zip(&entries).rev() {
        let recomputed = Chunk::recompute(head, c0, len, entry);
        let mut acc = ChunkCotangents {
            grads: &mut grads,
            c0,
            d_entry: HeadState::zero(head.dk, head.dv),
            gradient,
        };
        if let Some(d_h) = d_h {
            for r in 0..len {
                let t = c0 + r;
                recomputed.output_backward(r, &d_h[t * head.dv..(t + 1) * head.dv], &mut acc);
            }
        }
        recomputed.transition_backward(&d_state, &mut acc);
        d_state = acc.d_entry;
    }
    gradient.drop_exit_decay(&mut grads, &exit, &d_exit);
    grads.d_state = d_state;
    grads
}

/// Whose log-weight a term of a chunk carries: the entry state's (`m + b_r` in row r) or token
/// j's write (`i_j + b_r - b_j`; j is chunk-local).
#[derive(Clone, Copy, PartialEq)]
enum Source {
    Carried,
    Token(usize),
}

impl Source {
    /// The first chunk-local token whose log forget gate the log-weight holds: in row r it holds
    /// `lf` over `[after, r]`.
    fn after(self) -> usize {
        match self {
            Source::Carried => 0,
            Source::Token(j) => j + 1,
        }
    }
}

/// One chunk's forward quantities, recomputed from its entry state.
struct Chunk<'a> {
    head: &'a MlstmHead,
    c0: usize,
    len: usize,
    entry: &'a HeadState,
    /// The chunk-local inclusive cumsum of the log forget gates.
    b: Vec<f64>,
}

/// Where one chunk's backward accumulates: the head's token gradients and the gradient of the
/// chunk's entry state, as `gradient` defines them.
struct ChunkCotangents<'g> {
    grads: &'g mut HeadGrads,
    c0: usize,
    d_entry: HeadState,
    gradient: MlstmGradient,
}

impl ChunkCotangents<'_> {
    /// Adds `x` to the gradient of the log-weight's own input: `m` or `i_j`.
    fn add_base(&mut self, source: Source, x: f64) {
        match source {
            Source::Carried => self.d_entry.m += x,
            Source::Token(j) => self.grads.di[self.c0 + j] += x,
        }
    }

    /// Adds `x` to the log forget gates of the chunk-local `tokens`.
    fn add_log_forget(&mut self, tokens: Range<usize>, x: f64) {
        let range = self.c0 + tokens.start..self.c0 + tokens.end;
        self.grads.d_log_forget[range]
            .iter_mut()
            .for_each(|d| *d += x);
    }

    /// Adds `x` times the derivative of `source`'s log-weight in row `r`.
    fn add_log_weight(&mut self, source: Source, r: usize, x: f64) {
        self.add_base(source, x);
        self.add_log_forget(source.after()..r + 1, x);
    }

    /// Adds `x` times the derivative of `l_source - l_winner`, the exponent of a term stabilised
    /// by the winner's log-weight. Both hold `lf` up to the same row, so the difference is
    /// `base_source - base_winner` plus the gates between their starts, and a term never enters a
    /// gradient as `+x - x` (in particular the winner's own term adds nothing).
    fn add_log_ratio(&mut self, source: Source, winner: Source, x: f64) {
        if source == winner {
            return;
        }
        self.add_base(source, x);
        self.add_base(winner, -x);
        let (from, to) = (source.after(), winner.after());
        if from < to {
            self.add_log_forget(from..to, x);
        } else {
            self.add_log_forget(to..from, -x);
        }
    }

    /// Adds `x` times the derivative of the exponent of a term of row `r` with `source`'s
    /// log-weight, stabilised by `winner`'s. The full derivative differentiates
    /// `l_source - l_winner`; TFLA's holds every stabiliser constant, so only the gates and input
    /// gate in `l_source` (the carried state's `m` is a stabiliser too).
    fn add_term_exponent(&mut self, source: Source, winner: Source, r: usize, x: f64) {
        match self.gradient {
            MlstmGradient::Full => self.add_log_ratio(source, winner, x),
            MlstmGradient::Tfla => {
                if let Source::Token(_) = source {
                    self.add_base(source, x);
                }
                self.add_log_forget(source.after()..r + 1, x);
            }
        }
    }
}

impl<'a> Chunk<'a> {
    fn recompute(head: &'a MlstmHead, c0: usize, len: usize, entry: &'a HeadState) -> Chunk<'a> {
        let b = chunk_local_cumsum(&head.log_forget[c0..c0 + len], 1);
        Chunk {
            head,
            c0,
            len,
            entry,
            b,
        }
    }

    /// The log-weight of `source` in row `r`, as the forward sums it.
    fn log_weight(&self, source: Source, r: usize) -> f64 {
        match source {
            Source::Carried => self.entry.m + self.b[r],
            Source::Token(j) => self.head.input_gate[self.c0 + j] + (self.b[r] - self.b[j]),
        }
    }

    /// Row r's stabiliser `m_r`, the largest log-weight, and whose it is (the carried state, then
    /// earlier tokens, on ties, as the recurrent step breaks them). The last row's is also the
    /// stabiliser of the state leaving the chunk.
    fn winner(&self, r: usize) -> (Source, f64) {
        (0..=r).map(Source::Token).fold(
            (Source::Carried, self.log_weight(Source::Carried, r)),
            |best, source| {
                let l = self.log_weight(source, r);
                if l > best.1 {
                    (source, l)
                } else {
                    best
                }
            },
        )
    }

    /// Through `h_r = num_r / (max(|qn_r|, e^{-m_r}) + eps)` with
    /// `num_r = e^{m + b_r - m_r} sigma q_r C + sum_{j<=r} e^{D_rj - m_r} s_rj v_j`,
    /// `qn_r = e^{m + b_r - m_r} sigma q_r . n + sum_{j<=r} e^{D_rj - m_r} s_rj`,
    /// `s_rj = sigma q_r . k_j`, given `d_h_r`.
    fn output_backward(&self, r: usize, d_h_r: &[f64], acc: &mut ChunkCotangents) {
        let (head, t, sigma) = (self.head, self.c0 + r, self.head.scale);
        let (dk, dv, q) = (head.dk, head.dv, head.q(t));
        let (winner, m) = self.winner(r);
        // The forward's row, recomputed.
        let carried = (self.log_weight(Source::Carried, r) - m).exp();
        let (read_num, read_qn) = head.read(t, self.entry);
        let weights: Vec<f64> = (0..=r)
            .map(|j| (self.log_weight(Source::Token(j), r) - m).exp())
            .collect();
        let scores: Vec<f64> = (0..=r)
            .map(|j| sigma * dot(q, head.k(self.c0 + j)))
            .collect();
        let mut num: Vec<f64> = read_num.iter().map(|x| carried * x).collect();
        let mut qn = carried * read_qn;
        for (j, (w, s)) in weights.iter().zip(&scores).enumerate() {
            axpy(&mut num, w * s, head.v(self.c0 + j));
            qn += w * s;
        }
        // The normalisation; the floor `e^{-m_r}` is the only place `m_r` enters other than as
        // the stabiliser of the terms.
        let floor = (-m).exp();
        let den = qn.abs().max(floor) + head.eps;
        let d_num: Vec<f64> = d_h_r.iter().map(|x| x / den).collect();
        let d_qn = match acc.gradient {
            // TFLA divides d_h by the forward's denominator and stops there.
            MlstmGradient::Tfla => 0.0,
            MlstmGradient::Full => {
                let d_den = -dot(d_h_r, &num) / (den * den);
                if qn.abs() >= floor {
                    d_den * qn.signum()
                } else {
                    acc.add_log_weight(winner, r, -d_den * floor);
                    0.0
                }
            }
        };
        // The carried term.
        let d_carried = dot(&read_num, &d_num) + read_qn * d_qn;
        acc.add_term_exponent(Source::Carried, winner, r, carried * d_carried);
        let dq = &mut acc.grads.dq[t * dk..(t + 1) * dk];
        mat_vec_add(dq, sigma * carried, &self.entry.c, &d_num);
        axpy(dq, sigma * carried * d_qn, &self.entry.n);
        outer_add(&mut acc.d_entry.c, sigma * carried, q, &d_num);
        axpy(&mut acc.d_entry.n, sigma * carried * d_qn, q);
        // The tokens' terms `w_j s_rj (v_j, 1)`.
        for (j, (w, s)) in weights.iter().zip(&scores).enumerate() {
            let tj = self.c0 + j;
            let d_score = w * (dot(head.v(tj), &d_num) + d_qn);
            acc.add_term_exponent(Source::Token(j), winner, r, s * d_score);
            axpy(
                &mut acc.grads.dq[t * dk..(t + 1) * dk],
                sigma * d_score,
                head.k(tj),
            );
            axpy(
                &mut acc.grads.dk[tj * dk..(tj + 1) * dk],
                sigma * d_score,
                q,
            );
            axpy(&mut acc.grads.dv[tj * dv..(tj + 1) * dv], w * s, &d_num);
        }
    }

    /// Through the state leaving the chunk, `m' = m_last`,
    /// `C' = e^{m + gamma - m'} C + sum_j e^{i_j + gamma - b_j - m'} k_j^T v_j` (`n'` likewise with
    /// `k_j`), given its cotangent `d_exit`.
    fn transition_backward(&self, d_exit: &HeadState, acc: &mut ChunkCotangents) {
        let (head, dk, dv, last) = (self.head, self.head.dk, self.head.dv, self.len - 1);
        let (winner, m) = self.winner(last);
        let carried = (self.log_weight(Source::Carried, last) - m).exp();
        let d_carried = dot(&d_exit.c, &self.entry.c) + dot(&d_exit.n, &self.entry.n);
        acc.add_term_exponent(Source::Carried, winner, last, carried * d_carried);
        axpy(&mut acc.d_entry.c, carried, &d_exit.c);
        axpy(&mut acc.d_entry.n, carried, &d_exit.n);
        for j in 0..self.len {
            let tj = self.c0 + j;
            let w = (self.log_weight(Source::Token(j), last) - m).exp();
            // dC' v_j + dn': the cotangent of the key token j writes.
            let mut d_key = d_exit.n.clone();
            mat_vec_add(&mut d_key, 1.0, &d_exit.c, head.v(tj));
            acc.add_term_exponent(Source::Token(j), winner, last, w * dot(head.k(tj), &d_key));
            axpy(&mut acc.grads.dk[tj * dk..(tj + 1) * dk], w, &d_key);
            vec_mat_add(
                &mut acc.grads.dv[tj * dv..(tj + 1) * dv],
                w,
                head.k(tj),
                &d_exit.c,
            );
        }
        acc.add_log_weight(winner, last, d_exit.m);
    }
}
