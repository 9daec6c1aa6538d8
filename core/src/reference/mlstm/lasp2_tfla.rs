//! The LASP-2 decomposition of mlstm_kernels' gradient ([`MlstmGradient::Tfla`]; module doc,
//! "LASP-2 backward of TFLA's gradient"): what a sharded backward that keeps every stabiliser
//! constant exchanges and adds, checked against the one-sequence gradient.

use super::super::error::ReferenceError;
use super::super::linalg::{axpy, dot};
use super::super::tensor::Tensor;
use super::super::validate::{check_chunk, check_shard_lengths};
use super::chunk_backward::backward_from;
use super::chunkwise::forward_from;
use super::gradient::MlstmGradient;
use super::head::{backward_heads, HeadGrads, HeadState};
use super::inputs::{MlstmCotangents, MlstmGrads, MlstmInputs};
use super::lasp2::Exchanged;

/// Everything the decomposition computes, per rank.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmLasp2TflaBackward {
    /// `E_w = dL_w/dC_{P_w}` `[B, H, Dk, Dv]`: the gradient of rank w's own outputs with respect
    /// to the matrix memory entering it (stabilised at `m_{P_w}`), from no exit cotangent: what
    /// rank w sends to the ranks before it.
    pub output_state_grads: Vec<Tensor>,
    /// `D_w = dL/dC_{P_{w+1}}` `[B, H, Dk, Dv]`: the cotangent of the state leaving rank w, from
    /// the descending fold `D_{W-1} = dC_T`, `D_{w-1} = e^{F_w + m_{P_w} - m_{P_{w+1}}} D_w + E_w`.
    pub exit_state_grads: Vec<Tensor>,
    /// `<D_w, C_{P_{w+1}}> - <dC_T, C_T>` `[B, H]`: what rank w adds to the gradient of each of its
    /// log forget gates (its own backward drops its exit's decay `<D_w, C_{P_{w+1}}>`; one call
    /// over the whole sequence drops only the last).
    pub log_forget_corrections: Vec<Tensor>,
    /// The gradients of the whole sequence: [`MlstmGradient::Tfla`]'s.
    pub grads: MlstmGrads,
}

/// LASP-2 backward of [`MlstmGradient::Tfla`] on `shard_lengths.len()` ranks (ragged lengths
/// summing to T, none empty; chunk size `chunk`): the forward's exchange gives every rank the
/// state entering it; each rank's outputs give `E_w`; the descending fold gives `D_w`; each rank
/// runs its backward from its entry state with `D_w` as its exit cotangent and adds its log forget
/// correction. Equal to [`recurrent_backward`](super::recurrent_backward) with
/// [`MlstmGradient::Tfla`] over the whole sequence.
pub fn lasp2_backward_tfla(
    inputs: &MlstmInputs,
    shard_lengths: &[usize],
    chunk: usize,
    cot: &MlstmCotangents,
) -> Result<MlstmLasp2TflaBackward, ReferenceError> {
    check_chunk("chunk", chunk)?;
    check_shard_lengths(shard_lengths, inputs.shape.t)?;
    let s = inputs.shape;
    let ranks = shard_lengths.len();
    let per_rank = |dims: &[usize]| vec![Tensor::zeros(dims); ranks];
    let (mut outputs, mut exits) = (per_rank(&s.state()), per_rank(&s.state()));
    let mut corrections = per_rank(&[s.b, s.h]);
    let mut index = 0; // heads come b-major, as backward_heads visits them
    let grads = backward_heads(inputs, cot, |head, initial, d_h, d_final| {
        let Exchanged {
            shards,
            summaries,
            prefixes,
        } = Exchanged::new(head, initial, shard_lengths, chunk);
        let (b, h) = (index / s.h, index % s.h);
        let (dk, dv) = (head.dk, head.dv);
        let zero = HeadState::zero(dk, dv);
        // E_w: each rank's outputs from its prefix, with no exit cotangent.
        let own: Vec<Vec<f64>> = shards
            .iter()
            .zip(&prefixes)
            .map(|((start, shard), prefix)| {
                let rows = &d_h[start * dv..(start + shard.t) * dv];
                let g = backward_from(
                    shard,
                    prefix.clone(),
                    chunk,
                    Some(rows),
                    zero.clone(),
                    MlstmGradient::Tfla,
                );
                g.d_state.c
            })
            .collect();
        // D_w, descending: the stabilisers are constants, so the fold's transpose on C is its
        // prefix factor e^{F_w + m_{P_w} - m_{P_{w+1}}}, the ratio of the two stabilised forms.
        let d_final = MlstmGradient::Tfla.exit_cotangent(d_final);
        let mut d_exit = vec![Vec::new(); shards.len()];
        let mut d = d_final.c.clone();
        for w in (0..shards.len()).rev() {
            d_exit[w] = d.clone();
            let (exit, entry) = (&prefixes[w + 1], &prefixes[w]);
            let factor = (summaries[w].1 + entry.m - exit.m).exp();
            d.iter_mut().for_each(|x| *x *= factor);
            axpy(&mut d, 1.0, &own[w]);
        }
        let final_decay = dot(&d_final.c, &prefixes[shards.len()].c);
        // Each rank's backward from its prefix with D_w at its exit, and its correction.
        let mut grads = HeadGrads::zeros(head, zero.clone());
        for (w, ((start, shard), prefix)) in shards.iter().zip(&prefixes).enumerate() {
            let rows = &d_h[start * dv..(start + shard.t) * dv];
            let exit_cot = HeadState {
                c: d_exit[w].clone(),
                ..zero.clone()
            };
            let g = backward_from(
                shard,
                prefix.clone(),
                chunk,
                Some(rows),
                exit_cot,
                MlstmGradient::Tfla,
            );
            let (_, exit) = forward_from(shard, prefix.clone(), chunk);
            let correction = dot(&d_exit[w], &exit.c) - final_decay;
            grads.add_tokens(*start, &g);
            grads.d_log_forget[*start..start + shard.t]
                .iter_mut()
                .for_each(|x| *x += correction);
            if w == 0 {
                grads.d_state = g.d_state;
            }
            outputs[w].block_mut(b, h).copy_from_slice(&own[w]);
            exits[w].block_mut(b, h).copy_from_slice(&d_exit[w]);
            corrections[w].block_mut(b, h)[0] = correction;
        }
        index += 1;
        grads
    })?;
    Ok(MlstmLasp2TflaBackward {
        output_state_grads: outputs,
        exit_state_grads: exits,
        log_forget_corrections: corrections,
        grads,
    })
}
