//! The mLSTM's inputs, state, outputs, cotangents and gradients, their validation, and the seeded
//! generator.

use super::super::error::ReferenceError;
use super::super::gates::{gate_grad_terms, reverse_cumsum};
use super::super::generate::logsigmoid;
use super::super::inputs::Shape;
use super::super::linalg::dot;
use super::super::rng::SplitMix64;
use super::super::tensor::Tensor;
use super::super::validate::{check_dims, check_finite, check_shape};

/// mlstm_kernels' default denominator epsilon.
pub const MLSTM_EPS: f64 = 1e-6;

/// A stabilised mLSTM state `(C, n, m)` for every (batch, head); it stands for the unstabilised
/// `(e^m C, e^m n)`.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmState {
    /// The matrix memory `C [B, H, Dk, Dv]`.
    pub c: Tensor,
    /// The normaliser `n [B, H, Dk]`.
    pub n: Tensor,
    /// The stabiliser `m [B, H]`.
    pub m: Tensor,
}

impl MlstmState {
    /// The same state with stabiliser 0, i.e. the unstabilised `(e^m C, e^m n, 0)` (overflows
    /// where `m > ~709`).
    pub fn unstabilised(&self) -> MlstmState {
        let (heads, dk) = (self.m.len(), self.n.len() / self.m.len());
        let rescale = |t: &Tensor, width: usize| {
            let data = t
                .data()
                .chunks(width)
                .zip(self.m.data())
                .flat_map(|(block, m)| block.iter().map(move |x| x * m.exp()))
                .collect();
            Tensor::from_vec(t.shape(), data).expect("same length")
        };
        MlstmState {
            c: rescale(&self.c, self.c.len() / heads),
            n: rescale(&self.n, dk),
            m: self.m.map(|_| 0.0),
        }
    }
}

/// The inputs of one mLSTM layer, in fla's `[B, T, H, D]` layout.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmInputs {
    /// The dimensions every tensor below must agree with.
    pub shape: Shape,
    /// Queries `[B, T, H, Dk]`.
    pub q: Tensor,
    /// Keys `[B, T, H, Dk]`.
    pub k: Tensor,
    /// Values `[B, T, H, Dv]`.
    pub v: Tensor,
    /// Input-gate pre-activations `i_t [B, T, H]` (any real; the gate is `e^{i_t}`).
    pub input_gate: Tensor,
    /// Forget-gate pre-activations `f_t [B, T, H]` (any real; the gate is `sigmoid(f_t)`).
    pub forget_gate: Tensor,
    /// Initial state; `None` means `C_0 = 0, n_0 = 0, m_0 = 0`.
    pub initial_state: Option<MlstmState>,
    /// The query scale `sigma`, [`Shape::default_scale`] (`Dk^-1/2`) unless a test says otherwise.
    pub scale: f64,
    /// The denominator epsilon, [`MLSTM_EPS`] unless a test says otherwise.
    pub eps: f64,
}

/// The result of an mLSTM forward.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmForward {
    /// The hidden states `h [B, T, H, Dv]`.
    pub h: Tensor,
    /// The state after the last token.
    pub final_state: MlstmState,
}

/// Upstream gradients: `d_h = dL/dh [B, T, H, Dv]` and the final-state cotangent
/// `(dL/dC_T, dL/dn_T, dL/dm_T)` (`None` means zero).
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmCotangents {
    /// Gradient with respect to the hidden states, `[B, T, H, Dv]`.
    pub d_h: Tensor,
    /// Gradient with respect to the final state, or `None` for zero.
    pub d_final_state: Option<MlstmState>,
}

/// Gradients of `L = sum(h * d_h) + <C_T, dC_T> + <n_T, dn_T> + sum(m_T * dm_T)`
/// ([`MlstmForward::loss`]) with respect to every input, each shaped like its input.
#[derive(Clone, Debug, PartialEq)]
pub struct MlstmGrads {
    /// `dL/dq [B, T, H, Dk]`.
    pub dq: Tensor,
    /// `dL/dk [B, T, H, Dk]`.
    pub dk: Tensor,
    /// `dL/dv [B, T, H, Dv]`.
    pub dv: Tensor,
    /// `dL/di [B, T, H]` (input-gate pre-activations).
    pub d_input_gate: Tensor,
    /// `dL/df [B, T, H]` (forget-gate pre-activations).
    pub d_forget_gate: Tensor,
    /// `dL/d(C_0, n_0, m_0)`, returned even when the initial state is `None` (zero).
    pub d_initial_state: MlstmState,
}

impl MlstmForward {
    /// `L = sum(h * d_h) + <C_T, dC_T> + <n_T, dn_T> + sum(m_T * dm_T)`: the scalar the backwards
    /// differentiate (finite-difference tests differentiate it too).
    pub fn loss(&self, cot: &MlstmCotangents) -> f64 {
        let dot = |a: &Tensor, b: &Tensor| -> f64 { dot(a.data(), b.data()) };
        dot(&self.h, &cot.d_h)
            + cot.d_final_state.as_ref().map_or(0.0, |d| {
                let s = &self.final_state;
                dot(&s.c, &d.c) + dot(&s.n, &d.n) + dot(&s.m, &d.m)
            })
    }
}

impl MlstmGrads {
    /// The scale to measure the gate and stabiliser gradients' errors against (`d_input_gate`,
    /// `d_forget_gate`, `dm_0`): `||reverse-cumsum(a)||_2` with
    /// `a_t = sum_i |q_ti dq_ti| + |k_ti dk_ti|`, per head.
    ///
    /// Every term of `h_r` or of a state is `e^{l - m} x` with a log-weight `l`, and its exponent's
    /// gradient is that term's share of `q_r . dq_r` (row r's terms) or `k_j . dk_j` (token j's
    /// writes). The gate gradients sum these with signs, `dlf_t` over every term whose log-weight
    /// spans t, and largely cancel: `h` does not depend on the stabiliser, so the winning term's
    /// share drops out, and where one token dominates a row `h_r` barely depends on any gate
    /// (`||d_input_gate||` ~ 1e-28 from O(1) terms under large input gates). A relative error on
    /// those gradients then measures only the cancellation; compare them with
    /// [`assert_close_to_scale`](crate::reference::assert_close_to_scale) against this scale plus
    /// their own norm (for the floor and `dm_T`, which enter without such a term).
    ///
    /// # Panics
    /// If `self` and `inputs` describe different problems.
    pub fn gate_grad_scale(&self, inputs: &MlstmInputs) -> f64 {
        let s = inputs.shape;
        let mut sum_sq = 0.0;
        for b in 0..s.b {
            for h in 0..s.h {
                let mut a = gate_grad_terms(
                    &inputs.q.head_rows(b, h),
                    &self.dq.head_rows(b, h),
                    &inputs.k.head_rows(b, h),
                    &self.dk.head_rows(b, h),
                    s.dk,
                    1,
                    |qdq, kdk| qdq.abs() + kdk.abs(),
                );
                reverse_cumsum(&mut a, 1);
                sum_sq += a.iter().map(|x| x * x).sum::<f64>();
            }
        }
        sum_sq.sqrt()
    }
}

impl MlstmCotangents {
    /// Checks shapes and finiteness against the problem shape.
    pub(crate) fn validate(&self, s: &Shape) -> Result<(), ReferenceError> {
        check_shape("d_h", "[B, T, H, Dv]", s.v(), &self.d_h)?;
        check_finite("d_h", &self.d_h)?;
        if let Some(d) = &self.d_final_state {
            check_state("d_final_state", s, d)?;
        }
        Ok(())
    }
}

/// Gate regimes of the generator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlstmRegime {
    /// `i ~ N(0, 1)`, `f ~ 3 + N(0, 1)` (forget gates near 1, like xLSTM's forget-gate bias
    /// initialisation): the unstabilised form is still finite.
    Typical,
    /// `i ~ 400 N(0, 1)`, `f` as in `Typical`: `e^{i}` overflows f64 for many tokens, so only the
    /// stabilised forms are finite, and tokens whose `i` is far below the running maximum are
    /// written with weights that underflow to 0.
    LargeInputGate,
    /// `i ~ N(0, 1)`, `f ~ -8 + N(0, 1)` (forget gates near 0): the state nearly resets every
    /// token, `|q . n|` falls below `e^{-m}` and the denominator's floor is active.
    ForgetNearZero,
}

impl MlstmRegime {
    /// Every regime, for tests that sweep them.
    pub const ALL: [MlstmRegime; 3] = [
        MlstmRegime::Typical,
        MlstmRegime::LargeInputGate,
        MlstmRegime::ForgetNearZero,
    ];

    /// `(offset, spread)` of the input and forget pre-activations.
    fn gate_distributions(self) -> ((f64, f64), (f64, f64)) {
        match self {
            MlstmRegime::Typical => ((0.0, 1.0), (3.0, 1.0)),
            MlstmRegime::LargeInputGate => ((0.0, 400.0), (3.0, 1.0)),
            MlstmRegime::ForgetNearZero => ((0.0, 1.0), (-8.0, 1.0)),
        }
    }
}

/// What [`MlstmInputs::generate`] should produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlstmSpec {
    /// The dimensions.
    pub shape: Shape,
    /// The gate regime.
    pub regime: MlstmRegime,
    /// The seed; equal specs give bit-identical inputs.
    pub seed: u64,
    /// Round q, k, v to bf16-representable values and the gate pre-activations, the initial state,
    /// the scale and eps to f32-representable ones, so device copies (bf16 activations, fp32 gates and
    /// states) hold exactly the values the reference computes with.
    pub round_to_bf16: bool,
    /// Whether to draw an initial state (`C_0, n_0 ~ N(0, 1)`, `m_0 ~ N(0, 1)`).
    pub initial_state: bool,
}

/// One independent stream per tensor, so regimes and optional tensors never shift other tensors.
#[derive(Clone, Copy)]
enum Stream {
    Q = 1,
    K,
    V,
    InputGate,
    ForgetGate,
    C0,
    N0,
    M0,
}

impl Stream {
    fn rng(self, seed: u64) -> SplitMix64 {
        // A different multiplier from the decay families' streams: mLSTM inputs are their own.
        SplitMix64::new(seed ^ (self as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25))
    }

    fn normal(self, seed: u64, shape: &[usize], offset: f64, spread: f64) -> Tensor {
        self.rng(seed)
            .normal_tensor(shape, spread)
            .map(|x| x + offset)
    }
}

impl MlstmInputs {
    /// Draws the inputs of `spec`: q, k, v ~ N(0, 1), gates by regime, scale `Dk^-1/2`,
    /// eps [`MLSTM_EPS`]; rounded after drawing when `spec.round_to_bf16`, so rounding changes no
    /// stream.
    pub fn generate(spec: &MlstmSpec) -> Result<MlstmInputs, ReferenceError> {
        let s = spec.shape;
        check_dims(&s)?;
        let seed = spec.seed;
        let ((i_off, i_spread), (f_off, f_spread)) = spec.regime.gate_distributions();
        let initial_state = spec.initial_state.then(|| MlstmState {
            c: Stream::C0.normal(seed, &s.state(), 0.0, 1.0),
            n: Stream::N0.normal(seed, &[s.b, s.h, s.dk], 0.0, 1.0),
            m: Stream::M0.normal(seed, &[s.b, s.h], 0.0, 1.0),
        });
        let inputs = MlstmInputs {
            shape: s,
            q: Stream::Q.normal(seed, &s.qk(), 0.0, 1.0),
            k: Stream::K.normal(seed, &s.qk(), 0.0, 1.0),
            v: Stream::V.normal(seed, &s.v(), 0.0, 1.0),
            input_gate: Stream::InputGate.normal(seed, &s.per_token(), i_off, i_spread),
            forget_gate: Stream::ForgetGate.normal(seed, &s.per_token(), f_off, f_spread),
            initial_state,
            scale: s.default_scale(),
            eps: MLSTM_EPS,
        };
        Ok(if spec.round_to_bf16 {
            inputs.rounded_for_device()
        } else {
            inputs
        })
    }

    /// q, k, v rounded to bf16; the gates, initial state, scale and eps to f32.
    fn rounded_for_device(self) -> MlstmInputs {
        MlstmInputs {
            q: self.q.round_to_bf16(),
            k: self.k.round_to_bf16(),
            v: self.v.round_to_bf16(),
            input_gate: self.input_gate.round_to_f32(),
            forget_gate: self.forget_gate.round_to_f32(),
            initial_state: self.initial_state.map(|st| MlstmState {
                c: st.c.round_to_f32(),
                n: st.n.round_to_f32(),
                m: st.m.round_to_f32(),
            }),
            scale: f64::from(self.scale as f32),
            eps: f64::from(self.eps as f32),
            ..self
        }
    }

    /// Checks shapes, finiteness (gates included: any finite pre-activation is valid), the scale
    /// and `eps >= 0`. Errors name the first offending tensor and index.
    pub fn validate(&self) -> Result<(), ReferenceError> {
        let s = &self.shape;
        check_dims(s)?;
        check_shape("q", "[B, T, H, Dk]", s.qk(), &self.q)?;
        check_shape("k", "[B, T, H, Dk]", s.qk(), &self.k)?;
        check_shape("v", "[B, T, H, Dv]", s.v(), &self.v)?;
        check_shape("input_gate", "[B, T, H]", s.per_token(), &self.input_gate)?;
        check_shape("forget_gate", "[B, T, H]", s.per_token(), &self.forget_gate)?;
        if let Some(state) = &self.initial_state {
            check_state("initial_state", s, state)?;
        }
        for (name, t) in [
            ("q", &self.q),
            ("k", &self.k),
            ("v", &self.v),
            ("input_gate", &self.input_gate),
            ("forget_gate", &self.forget_gate),
        ] {
            check_finite(name, t)?;
        }
        if !self.scale.is_finite() {
            return Err(ReferenceError::InvalidScale { value: self.scale });
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(ReferenceError::InvalidEpsilon { value: self.eps });
        }
        Ok(())
    }

    /// The log forget gates `logsigmoid(f) [B, T, H]`.
    pub fn log_forget_gate(&self) -> Tensor {
        self.forget_gate.map(logsigmoid)
    }
}

/// Checks a state's three shapes and finiteness against the problem shape.
pub(crate) fn check_state(
    what: &'static str,
    s: &Shape,
    state: &MlstmState,
) -> Result<(), ReferenceError> {
    check_shape(what, "C [B, H, Dk, Dv]", s.state(), &state.c)?;
    check_shape(what, "n [B, H, Dk]", vec![s.b, s.h, s.dk], &state.n)?;
    check_shape(what, "m [B, H]", vec![s.b, s.h], &state.m)?;
    for t in [&state.c, &state.n, &state.m] {
        check_finite(what, t)?;
    }
    Ok(())
}
