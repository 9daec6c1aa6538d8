//! Which gradient an mLSTM backward computes: the full derivative of the stabilised forward, or
//! the one mlstm_kernels' (TFLA's) backward computes (module doc, "TFLA's gradient").

use super::super::linalg::dot;
use super::head::{HeadGrads, HeadState};

/// The gradient a backward computes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MlstmGradient {
    /// The full derivative of the stabilised forward: through the normaliser `n`, the floor
    /// `e^{-m_t}` and the stabiliser `m`, and from every part of the final-state cotangent.
    #[default]
    Full,
    /// mlstm_kernels' chunkwise backward: each row's factor `e^{-m_t} / den_t` and every `m` are
    /// constants, the final state's `dn_T`, `dm_T` are ignored and its total log-decay is not
    /// differentiated; `dn_0 = dm_0 = 0`.
    Tfla,
}

impl MlstmGradient {
    /// The part of the cotangent of the state after the last token that this gradient takes:
    /// mlstm_kernels' backward takes `dC_T` alone (its `vecDeltaN_last`, `scaDeltaM_last` are
    /// unused).
    pub(crate) fn exit_cotangent(self, d_exit: HeadState) -> HeadState {
        match self {
            MlstmGradient::Full => d_exit,
            MlstmGradient::Tfla => HeadState {
                n: vec![0.0; d_exit.n.len()],
                m: 0.0,
                ..d_exit
            },
        }
    }

    /// After a backward with constant stabilisers over the tokens that end in `exit`, with
    /// `d_exit` that state's cotangent: mlstm_kernels' forget-gate gradient, the reverse cumsum
    /// of `q . dq - k . dk`, sees the exit state only through its keys, so it leaves out the
    /// factor `e^{G_T}` by which every log forget gate scales that state, `<dC_T, C_T>` on each.
    pub(crate) fn drop_exit_decay(
        self,
        grads: &mut HeadGrads,
        exit: &HeadState,
        d_exit: &HeadState,
    ) {
        if self == MlstmGradient::Tfla {
            let decay = dot(&d_exit.c, &exit.c);
            grads.d_log_forget.iter_mut().for_each(|d| *d -= decay);
        }
    }
}
