//! The token-by-token reference over packed documents: the unpacked sweeps of
//! [`crate::reference::recurrent`] run document by document, each from its own initial state,
//! so nothing flows across a document start in either direction.

use super::{document_block, document_block_mut, PackedInputs};
use crate::reference::error::ReferenceError;
use crate::reference::head::{Head, HeadGrads};
use crate::reference::inputs::{Family, GateKind};
use crate::reference::outputs::{Forward, Grads};
use crate::reference::recurrent::{decay_back, decay_step, forward_sweep, reverse_sweep};
use crate::reference::tensor::Tensor;
use crate::reference::validate::{check_cotangents, check_finite, check_shape};

/// The decay family of a gate kind: scalar decay or GLA (the delta rule is not packed here).
fn decay_family(gates: GateKind) -> Family {
    match gates {
        GateKind::Scalar => Family::ScalarDecay,
        GateKind::Vector => Family::Gla,
    }
}

/// Token-by-token forward of scalar-decay attention (`GateKind::Scalar`) or GLA
/// (`GateKind::Vector`) over packed documents. `final_state` holds one state per document,
/// `[B, N, H, Dk, Dv]`: each document's state after its last token.
pub fn recurrent_forward(
    packed: &PackedInputs,
    gates: GateKind,
) -> Result<Forward, ReferenceError> {
    packed.validate(decay_family(gates))?;
    let s = packed.inputs.shape;
    let mut o = Tensor::zeros(&s.v());
    let mut final_state = Tensor::zeros(&packed.document_states_shape());
    for b in 0..s.b {
        for h in 0..s.h {
            let head = Head::gather(&packed.inputs, b, h);
            let mut rows = vec![0.0; s.t * s.dv];
            for n in 0..packed.documents() {
                let range = packed.document(n);
                let doc = head.tokens(range.clone(), initial_state(packed, b, n, h));
                let (doc_rows, end) = forward_sweep(&doc, decay_step);
                rows[range.start * s.dv..range.end * s.dv].copy_from_slice(&doc_rows);
                document_block_mut(&mut final_state, b, n, h).copy_from_slice(&end);
            }
            o.set_head_rows(b, h, &rows);
        }
    }
    Ok(Forward { o, final_state })
}

/// Token-by-token reverse mode of [`recurrent_forward`]: the gradients of
/// `L = sum(o * d_o) + sum_n <S_n, d_ht_n>` (`d_ht [B, N, H, Dk, Dv]`, one per document's final
/// state, `None` for zero). `dh0` is per document, `[B, N, H, Dk, Dv]`, returned even when `h0`
/// is `None`.
pub fn recurrent_backward(
    packed: &PackedInputs,
    gates: GateKind,
    d_o: &Tensor,
    d_ht: Option<&Tensor>,
) -> Result<Grads, ReferenceError> {
    packed.validate(decay_family(gates))?;
    let s = packed.inputs.shape;
    check_cotangents(&s, d_o, None)?;
    if let Some(d_ht) = d_ht {
        let layout = "[B, N, H, Dk, Dv]";
        check_shape("d_ht", layout, packed.document_states_shape(), d_ht)?;
        check_finite("d_ht", d_ht)?;
    }
    let mut grads = Grads {
        dq: Tensor::zeros(&s.qk()),
        dk: Tensor::zeros(&s.qk()),
        dv: Tensor::zeros(&s.v()),
        dg: Tensor::zeros(&s.gate(gates)),
        dbeta: None,
        dh0: Tensor::zeros(&packed.document_states_shape()),
    };
    let zero_state = vec![0.0; s.dk * s.dv];
    for b in 0..s.b {
        for h in 0..s.h {
            let head = Head::gather(&packed.inputs, b, h);
            let d_o_rows = d_o.head_rows(b, h);
            let mut total = HeadGrads::zeros(&head);
            for n in 0..packed.documents() {
                let range = packed.document(n);
                let doc = head.tokens(range.clone(), initial_state(packed, b, n, h));
                let d_end = d_ht.map_or(zero_state.as_slice(), |d| document_block(d, b, n, h));
                let doc_d_o = &d_o_rows[range.start * s.dv..range.end * s.dv];
                let g = reverse_sweep(&doc, doc_d_o, d_end, decay_step, decay_back);
                let (t0, t1, gd) = (range.start, range.end, head.gate_dim);
                total.dq[t0 * s.dk..t1 * s.dk].copy_from_slice(&g.dq);
                total.dk[t0 * s.dk..t1 * s.dk].copy_from_slice(&g.dk);
                total.dv[t0 * s.dv..t1 * s.dv].copy_from_slice(&g.dv);
                total.dg[t0 * gd..t1 * gd].copy_from_slice(&g.dg);
                document_block_mut(&mut grads.dh0, b, n, h).copy_from_slice(&g.dh0);
            }
            grads.dq.set_head_rows(b, h, &total.dq);
            grads.dk.set_head_rows(b, h, &total.dk);
            grads.dv.set_head_rows(b, h, &total.dv);
            grads.dg.set_head_rows(b, h, &total.dg);
        }
    }
    Ok(grads)
}

/// Document n's initial state for batch row b, head h (zeros when there is none).
fn initial_state(packed: &PackedInputs, b: usize, n: usize, h: usize) -> Vec<f64> {
    packed.h0.as_ref().map_or_else(
        || vec![0.0; packed.inputs.shape.dk * packed.inputs.shape.dv],
        |h0| document_block(h0, b, n, h).to_vec(),
    )
}
