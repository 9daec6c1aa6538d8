//! The chunkwise mLSTM forward in the arithmetic of the scalar-decay chunk loop (module doc,
//! "In the scalar-decay loop's form"): what its kernels compute, so that the gate transform and
//! every exponent's sign are checked here, against [`chunkwise_forward`](super::chunkwise_forward).
//!
//! Over packed documents ([`packed_loop_form_forward`]) the chunk is cut into segments at the
//! tokens that start a document, as the kernels will (`kernels/docs/packed.md`, "mLSTM"): the
//! cumsum and the running maximum restart at each start, a document entering from the zero state
//! (`m = 0`, decayed by its first token's own forget gate), each segment with its own shift, and
//! every weight whose row and column lie in different documents is dropped. The forget gates
//! stay as they are.

use super::super::error::ReferenceError;
use super::super::gates::chunk_local_cumsum;
use super::super::linalg::{axpy, dot, outer_add, vec_mat_add};
use super::super::tensor::Tensor;
use super::super::validate::check_chunk;
use super::head::{forward_heads, HeadState, MlstmHead};
use super::inputs::{MlstmForward, MlstmInputs};
use super::packed::MlstmPackedInputs;

/// One chunk's gates as the scalar-decay loop takes them, for a state with stabiliser `m_prev`:
/// the intra-chunk weight of token j in row r is `e^{row_r - col_j}` (j <= r), the carried state's
/// in row r `e^{row_r}`, and the state leaving the chunk is `e^{gamma} S + sum_j e^{gamma - col_j}
/// k_j^T v_j` at the stabiliser `m_next`. Every exponent is <= 0.
#[derive(Clone, Debug, PartialEq)]
pub struct LoopGates {
    pub row: Vec<f64>,
    pub col: Vec<f64>,
    pub gamma: f64,
    /// Each row's stabiliser `m_r` (the denominator's floor is `e^{-m_r}`).
    pub m_rows: Vec<f64>,
    /// The stabiliser of the state leaving the chunk.
    pub m_next: f64,
}

/// The gates of a chunk with input-gate pre-activations `input_gate` and log forget gates
/// `log_forget` (one per token), entered with stabiliser `m_prev` (`-inf`: the empty state).
///
/// With `b` the chunk-local inclusive cumsum of `log_forget` and the running maximum
/// `M_r = max(m_prev, max_{j<=r} (i_j - b_j))`, the row stabiliser is `m_r = b_r + M_r`, and
/// relative to a shift `c` (`m_prev`, or `i_0 - b_0` from the empty state, whose state is zero):
/// `row_r = c - M_r`, `col_j = c - i_j + b_j`, `gamma = row_last`, `m_next = b_last + M_last`.
pub fn loop_gates(input_gate: &[f64], log_forget: &[f64], m_prev: f64) -> LoopGates {
    let b = chunk_local_cumsum(log_forget, 1);
    let shift = if m_prev.is_finite() {
        m_prev
    } else {
        input_gate[0] - b[0]
    };
    let mut running = m_prev;
    let mut row = Vec::with_capacity(b.len());
    let mut m_rows = Vec::with_capacity(b.len());
    for (i, bj) in input_gate.iter().zip(&b) {
        running = running.max(i - bj);
        row.push(shift - running);
        m_rows.push(bj + running);
    }
    let col = input_gate
        .iter()
        .zip(&b)
        .map(|(i, bj)| shift - i + bj)
        .collect();
    LoopGates {
        gamma: row[row.len() - 1],
        m_next: b[b.len() - 1] + running,
        row,
        col,
        m_rows,
    }
}

/// [`loop_gates`] over a chunk cut into documents: `starts[j]` when token j starts a document.
/// Segment 0 (the tokens before the chunk's first start) continues the state entering with
/// stabiliser `m_prev`, as [`loop_gates`]; a segment that starts a document enters from the zero
/// state, `m = 0`, with shift 0: its cumsum `b` and running maximum `M` restart at its start
/// (`M` from 0), so `m_r = b_r + M_r` is the document's own stabiliser. `first[r]` is the start
/// of row r's segment (`None` for segment 0); row r keeps token j's weight for `first[r] <= j <=
/// r` only, the carried state only where `first[r]` is `None`, and the state leaving the chunk is
/// the last segment's.
pub fn packed_loop_gates(
    input_gate: &[f64],
    log_forget: &[f64],
    starts: &[bool],
    m_prev: f64,
) -> (LoopGates, Vec<Option<usize>>) {
    let first: Vec<Option<usize>> = starts
        .iter()
        .enumerate()
        .scan(None, |first, (j, &start)| {
            if start {
                *first = Some(j);
            }
            Some(*first)
        })
        .collect();
    let mut gates = LoopGates {
        row: Vec::with_capacity(starts.len()),
        col: Vec::with_capacity(starts.len()),
        gamma: 0.0,
        m_rows: Vec::with_capacity(starts.len()),
        m_next: 0.0,
    };
    let mut begin = 0;
    while begin < starts.len() {
        let end = (begin + 1..starts.len())
            .find(|&j| starts[j])
            .unwrap_or(starts.len());
        // A document's first segment enters from the zero state (m = 0), segment 0 from m_prev.
        let entering = if first[begin].is_some() { 0.0 } else { m_prev };
        let segment = loop_gates(&input_gate[begin..end], &log_forget[begin..end], entering);
        gates.row.extend(&segment.row);
        gates.col.extend(&segment.col);
        gates.m_rows.extend(&segment.m_rows);
        gates.gamma = segment.gamma;
        gates.m_next = segment.m_next;
        begin = end;
    }
    (gates, first)
}

/// The hidden states of packed documents, each chunk of `chunk` tokens in the kernels' segmented
/// form ([`packed_loop_gates`]), every document from the zero state (the documents' own initial
/// states are not taken: `packed.initial_states` must be `None`). Equal to
/// [`packed_recurrent_forward`](super::packed_recurrent_forward)'s.
pub fn packed_loop_form_forward(
    packed: &MlstmPackedInputs,
    chunk: usize,
) -> Result<Tensor, ReferenceError> {
    check_chunk("chunk", chunk)?;
    packed.validate()?;
    if packed.initial_states.is_some() {
        return Err(ReferenceError::InitialStateNotPerDocument);
    }
    let mut starts = vec![false; packed.inputs.shape.t];
    for &s in &packed.cu_seqlens[..packed.cu_seqlens.len() - 1] {
        starts[s] = true;
    }
    let heads = forward_heads(&packed.inputs, |head, state| {
        packed_forward_from(head, state, &starts, chunk)
    })?;
    Ok(heads.h)
}

fn packed_forward_from(
    head: &MlstmHead,
    mut state: HeadState,
    starts: &[bool],
    chunk: usize,
) -> (Vec<f64>, HeadState) {
    let mut out = vec![0.0; head.t * head.dv];
    for (c0, len) in head.chunks(chunk) {
        let (g, first) = packed_loop_gates(
            &head.input_gate[c0..c0 + len],
            &head.log_forget[c0..c0 + len],
            &starts[c0..c0 + len],
            state.m,
        );
        // From the empty state (no contribution) the carried terms are zero, whatever the shift.
        let carried = if state.m.is_finite() { 1.0 } else { 0.0 };
        for (r, row_first) in first.iter().enumerate() {
            let t = c0 + r;
            // The carried state reaches only the rows of the document it belongs to.
            let inter = if row_first.is_none() {
                carried * g.row[r].exp()
            } else {
                0.0
            };
            let mut num = vec![0.0; head.dv];
            vec_mat_add(&mut num, inter * head.scale, head.q(t), &state.c);
            let mut qn = inter * head.scale * dot(head.q(t), &state.n);
            for j in row_first.unwrap_or(0)..=r {
                let score =
                    (g.row[r] - g.col[j]).exp() * head.scale * dot(head.q(t), head.k(c0 + j));
                axpy(&mut num, score, head.v(c0 + j));
                qn += score;
            }
            head.normalise(
                &mut out[t * head.dv..(t + 1) * head.dv],
                &num,
                qn,
                g.m_rows[r],
            );
        }
        let last = first[len - 1];
        let decay = if last.is_none() {
            carried * g.gamma.exp()
        } else {
            0.0
        };
        state.c.iter_mut().for_each(|x| *x *= decay);
        state.n.iter_mut().for_each(|x| *x *= decay);
        for j in last.unwrap_or(0)..len {
            let weight = (g.gamma - g.col[j]).exp();
            outer_add(&mut state.c, weight, head.k(c0 + j), head.v(c0 + j));
            axpy(&mut state.n, weight, head.k(c0 + j));
        }
        state.m = g.m_next;
    }
    (out, state)
}

/// Chunkwise forward with chunk size `chunk`, each chunk as the scalar-decay loop computes it
/// from [`loop_gates`]: the normaliser is the loop's output with a column of ones for v (the
/// row sums of the weighted scores, plus the carried `n`).
pub fn loop_form_forward(
    inputs: &MlstmInputs,
    chunk: usize,
) -> Result<MlstmForward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    forward_heads(inputs, |head, state| forward_from(head, state, chunk))
}

/// The loop form over one sequence: the packed form with no document start.
fn forward_from(head: &MlstmHead, state: HeadState, chunk: usize) -> (Vec<f64>, HeadState) {
    packed_forward_from(head, state, &vec![false; head.t], chunk)
}

#[cfg(test)]
mod tests {
    use super::super::chunkwise;
    use super::*;
    use crate::reference::generate::logsigmoid;
    use crate::reference::SplitMix64;

    /// A head of `t` tokens with input gates in [-4, 28) (large enough for the stabiliser to
    /// matter) and forget pre-activations in [-3, 5).
    fn head(t: usize, seed: u64) -> MlstmHead {
        let (dk, dv) = (4, 3);
        let mut rng = SplitMix64::new(seed);
        let mut draw = |n: usize, lo: f64, hi: f64| -> Vec<f64> {
            (0..n).map(|_| lo + (hi - lo) * rng.uniform()).collect()
        };
        MlstmHead {
            t,
            dk,
            dv,
            q: draw(t * dk, -1.0, 1.0),
            k: draw(t * dk, -1.0, 1.0),
            v: draw(t * dv, -1.0, 1.0),
            input_gate: draw(t, -4.0, 28.0),
            log_forget: draw(t, -3.0, 5.0).into_iter().map(logsigmoid).collect(),
            scale: 0.5,
            eps: 1e-6,
        }
    }

    /// Up to the rounding of the differences (the winner's own weight is `e^0` in exact
    /// arithmetic), which the kernels' `exp_nonpos` clamps.
    #[test]
    fn every_exponent_is_at_most_zero_and_the_stabilisers_are_the_recurrence() {
        const ROUNDING: f64 = 1e-12;
        let h = head(23, 5);
        for m_prev in [f64::NEG_INFINITY, -3.5, 0.0, 17.25] {
            let g = loop_gates(&h.input_gate, &h.log_forget, m_prev);
            // The recurrent stabiliser: m_t = max(lf_t + m_{t-1}, i_t).
            let mut m = m_prev;
            for r in 0..h.t {
                m = (h.log_forget[r] + m).max(h.input_gate[r]);
                assert!(
                    (g.m_rows[r] - m).abs() <= 1e-12 * m.abs().max(1.0),
                    "row {r}"
                );
                let bound = ROUNDING * (g.row[r].abs() + g.col[r].abs()).max(1.0);
                assert!(g.row[r] <= bound, "row {r}: {}", g.row[r]);
                for j in 0..=r {
                    assert!(g.row[r] - g.col[j] <= bound, "row {r}, token {j}");
                }
                assert!(g.gamma - g.col[r] <= bound, "token {r}");
            }
            assert_eq!(g.m_next, g.m_rows[h.t - 1]);
            assert_eq!(g.gamma, g.row[h.t - 1]);
        }
    }

    /// In every segment the kept exponents are <= 0 and the row stabilisers are the recurrence's,
    /// a document's from the zero state (m = 0) at its start.
    #[test]
    fn packed_segments_keep_every_exponent_at_most_zero_and_each_documents_stabiliser() {
        const ROUNDING: f64 = 1e-12;
        let h = head(23, 7);
        let mut starts = vec![false; h.t];
        for s in [0, 1, 4, 12, 13, 22] {
            starts[s] = true;
        }
        for (skip_first, m_prev) in [(true, 2.5), (false, f64::NEG_INFINITY), (false, 17.25)] {
            // The chunk's first token continues the document before it where `skip_first`.
            let mut starts = starts.clone();
            starts[0] = !skip_first;
            let (g, first) = packed_loop_gates(&h.input_gate, &h.log_forget, &starts, m_prev);
            let mut m = m_prev;
            for r in 0..h.t {
                let entering = if starts[r] { 0.0 } else { m };
                m = (h.log_forget[r] + entering).max(h.input_gate[r]);
                assert!(
                    (g.m_rows[r] - m).abs() <= 1e-12 * m.abs().max(1.0),
                    "row {r}: {} vs {m}",
                    g.m_rows[r]
                );
                let bound = ROUNDING * (g.row[r].abs() + g.col[r].abs()).max(1.0);
                if first[r].is_none() && m_prev.is_finite() {
                    assert!(g.row[r] <= bound, "row {r}: carried {}", g.row[r]);
                }
                for j in first[r].unwrap_or(0)..=r {
                    assert!(g.row[r] - g.col[j] <= bound, "row {r}, token {j}");
                }
            }
            let last = first[h.t - 1].unwrap_or(0);
            for j in last..h.t {
                assert!(
                    g.gamma - g.col[j] <= 1e-12 * g.col[j].abs().max(1.0),
                    "token {j}"
                );
            }
            assert_eq!(g.m_next, g.m_rows[h.t - 1]);
        }
    }

    /// The packed loop form gives each document's own hidden states, whatever the chunk, with
    /// documents of one and two tokens, starting on and off chunk boundaries, under typical and
    /// very large input gates.
    #[test]
    fn the_packed_loop_form_equals_each_document_run_alone() {
        use super::super::inputs::{MlstmRegime, MlstmSpec};
        use super::super::packed::packed_recurrent_forward;
        use crate::reference::inputs::Shape;
        let cu_seqlens = vec![0, 1, 3, 64, 65, 129, 150, 197];
        for regime in [MlstmRegime::Typical, MlstmRegime::LargeInputGate] {
            let spec = MlstmSpec {
                shape: Shape {
                    b: 1,
                    t: 197,
                    h: 2,
                    dk: 4,
                    dv: 3,
                },
                regime,
                seed: 17,
                round_to_bf16: false,
                initial_state: false,
            };
            let packed = MlstmPackedInputs {
                inputs: MlstmInputs::generate(&spec).unwrap(),
                cu_seqlens: cu_seqlens.clone(),
                initial_states: None,
            };
            let want = packed_recurrent_forward(&packed).unwrap().h;
            for chunk in [1, 5, 16, 64] {
                let got = packed_loop_form_forward(&packed, chunk).unwrap();
                let scale = want.data().iter().fold(0.0f64, |s, x| s.max(x.abs()));
                for (i, (x, y)) in got.data().iter().zip(want.data()).enumerate() {
                    assert!(
                        (x - y).abs() <= 1e-11 * scale,
                        "{regime:?}, chunk {chunk}: h[{i}] {x} vs {y}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_loop_form_equals_the_chunkwise_form_from_any_state() {
        let h = head(70, 9);
        let close = |a: &[f64], b: &[f64], what: &str| {
            let scale = b.iter().fold(0.0f64, |s, x| s.max(x.abs()));
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!((x - y).abs() <= 1e-12 * scale, "{what}[{i}]: {x} vs {y}");
            }
        };
        let given = HeadState {
            c: (0..12).map(|i| 0.1 * i as f64 - 0.5).collect(),
            n: vec![0.3, -0.2, 0.7, 0.1],
            m: 2.5,
        };
        // The empty state (a LASP-2 shard's summary), the zero state and a given one.
        for start in [HeadState::empty(4, 3), HeadState::zero(4, 3), given] {
            for chunk in [1, 5, 16, 64] {
                let (want_h, want) = chunkwise::forward_from(&h, start.clone(), chunk);
                let (got_h, got) = forward_from(&h, start.clone(), chunk);
                let what = format!("start m {}, chunk {chunk}", start.m);
                close(&got_h, &want_h, &format!("{what}: h"));
                close(&got.c, &want.c, &format!("{what}: C"));
                close(&got.n, &want.n, &format!("{what}: n"));
                assert!(
                    (got.m - want.m).abs() <= 1e-12 * want.m.abs().max(1.0),
                    "{what}: m"
                );
            }
        }
    }
}
