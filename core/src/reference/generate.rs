//! Seeded test inputs, shared by the CPU reference tests and the GPU tests so both compare on
//! identical values.
//!
//! Every tensor draws from its own SplitMix64 stream derived from `(seed, tensor)`, so changing the
//! regime changes only the gates (and, for [`Regime::LargeNorm`], a scale factor) while q, k and v
//! stay the same. The streams are part of the test contract: changing them changes every GPU
//! test's inputs.

use super::error::ReferenceError;
use super::inputs::{Cotangents, Family, Inputs, Shape};
use super::rng::SplitMix64;
use super::tensor::Tensor;
use super::validate::check_dims;

/// Named input regimes; each stresses a different part of the numerics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Regime {
    /// q, k, v ~ N(0, 1); gates `logsigmoid(x) / 16`, x ~ N(0, 1) (fla's benchmark gates).
    Typical,
    /// Gates exactly 0: plain causal linear attention, states only grow.
    NoDecay,
    /// Gates exactly -30: every token nearly resets the state; cumulative log-decays reach
    /// -30 T, so any `e^{G_i} e^{-G_j}` factorisation overflows.
    StrongDecay,
    /// Each gate independently one of: 0, -30, `logsigmoid(x)` or `logsigmoid(x) / 16`.
    Mixed,
    /// Typical gates with q and k scaled by 16 (delta rule: q and v, since its keys are unit norm).
    LargeNorm,
}

impl Regime {
    /// Every regime, for tests that sweep them.
    pub const ALL: [Regime; 5] = [
        Regime::Typical,
        Regime::NoDecay,
        Regime::StrongDecay,
        Regime::Mixed,
        Regime::LargeNorm,
    ];
}

/// What [`Inputs::generate`] should produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputSpec {
    /// The dimensions.
    pub shape: Shape,
    /// The family decides the gate shape, whether `beta` exists and whether q, k are unit-norm.
    pub family: Family,
    /// The value regime.
    pub regime: Regime,
    /// The seed; equal specs give bit-identical inputs.
    pub seed: u64,
    /// Round q, k, v to bf16-representable values and g, beta, h0 and the scale to
    /// f32-representable ones, so device copies (bf16 activations, fp32 gates and states) hold
    /// exactly the values the reference computes with.
    pub round_to_bf16: bool,
    /// Whether to draw an initial state h0 ~ N(0, 1) (otherwise `h0 = None`, i.e. zero).
    pub initial_state: bool,
}

/// Scale factor of q and k (delta rule: q and v) under [`Regime::LargeNorm`].
const LARGE_NORM: f64 = 16.0;
/// The log-decay of [`Regime::StrongDecay`].
const STRONG_DECAY: f64 = -30.0;

/// One independent stream per tensor, so regimes and optional tensors never shift other tensors.
#[derive(Clone, Copy)]
enum Stream {
    Q = 1,
    K,
    V,
    G,
    Beta,
    H0,
    DO,
    DHt,
}

impl Stream {
    /// This tensor's generator for `seed`.
    fn rng(self, seed: u64) -> SplitMix64 {
        SplitMix64::new(seed ^ (self as u64).wrapping_mul(0xD1B5_4A32_D192_ED03))
    }
}

/// `log(sigmoid(x))`, computed without overflow for either sign of x.
pub(crate) fn logsigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        -(-x).exp().ln_1p()
    } else {
        x - x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Normalises every row of width `d` to unit L2 norm (GDN's `use_qk_l2norm`).
fn l2_normalise_rows(t: &mut Tensor, d: usize) {
    for row in t.data_mut().chunks_mut(d) {
        let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt();
        row.iter_mut().for_each(|x| *x /= norm);
    }
}

fn gates(rng: &mut SplitMix64, shape: &[usize], regime: Regime) -> Tensor {
    let n = shape.iter().product();
    let data = (0..n)
        .map(|_| match regime {
            Regime::Typical | Regime::LargeNorm => logsigmoid(rng.normal()) / 16.0,
            Regime::NoDecay => 0.0,
            Regime::StrongDecay => STRONG_DECAY,
            Regime::Mixed => {
                let (u, x) = (rng.uniform(), rng.normal());
                match (u * 4.0) as usize {
                    0 => 0.0,
                    1 => STRONG_DECAY,
                    2 => logsigmoid(x),
                    _ => logsigmoid(x) / 16.0,
                }
            }
        })
        .collect();
    Tensor::from_vec(shape, data).expect("length matches shape by construction")
}

impl Inputs {
    /// Draws the inputs of `spec`: q, k, v ~ N(0, 1) (unit-norm rows for the delta rule, whose
    /// state is only contractive when `beta ||k||^2 < 2`), gates by regime, `beta = sigmoid(x)` in
    /// (0, 1) for the delta rule, optional h0 ~ N(0, 1), scale `Dk^-1/2`.
    pub fn generate(spec: &InputSpec) -> Result<Inputs, ReferenceError> {
        let shape = spec.shape;
        check_dims(&shape)?;
        let seed = spec.seed;
        let delta = spec.family == Family::DeltaRule;
        let large = spec.regime == Regime::LargeNorm;
        let mut q = Stream::Q.rng(seed).normal_tensor(&shape.qk(), 1.0);
        let mut k = Stream::K.rng(seed).normal_tensor(&shape.qk(), 1.0);
        let mut v = Stream::V.rng(seed).normal_tensor(&shape.v(), 1.0);
        if delta {
            l2_normalise_rows(&mut q, shape.dk);
            l2_normalise_rows(&mut k, shape.dk);
        }
        if large {
            q = q.map(|x| x * LARGE_NORM);
            if delta {
                v = v.map(|x| x * LARGE_NORM);
            } else {
                k = k.map(|x| x * LARGE_NORM);
            }
        }
        let g = gates(
            &mut Stream::G.rng(seed),
            &shape.gate(spec.family.gate_kind()),
            spec.regime,
        );
        let beta = delta.then(|| {
            Stream::Beta
                .rng(seed)
                .normal_tensor(&shape.per_token(), 1.0)
                .map(sigmoid)
        });
        let h0 = spec
            .initial_state
            .then(|| Stream::H0.rng(seed).normal_tensor(&shape.state(), 1.0));
        let mut inputs = Inputs {
            shape,
            q,
            k,
            v,
            g,
            beta,
            h0,
            scale: shape.default_scale(),
        };
        if spec.round_to_bf16 {
            inputs.q = inputs.q.round_to_bf16();
            inputs.k = inputs.k.round_to_bf16();
            inputs.v = inputs.v.round_to_bf16();
            inputs.g = inputs.g.round_to_f32();
            inputs.beta = inputs.beta.map(|b| b.round_to_f32());
            inputs.h0 = inputs.h0.map(|h| h.round_to_f32());
            inputs.scale = f64::from(inputs.scale as f32);
        }
        Ok(inputs)
    }
}

impl Cotangents {
    /// Draws `d_o ~ N(0, 1)` and, when `final_state_grad`, `d_ht ~ N(0, 1)`; with
    /// `round_to_bf16`, d_o is bf16-representable and d_ht f32-representable.
    pub fn generate(
        shape: Shape,
        seed: u64,
        final_state_grad: bool,
        round_to_bf16: bool,
    ) -> Result<Cotangents, ReferenceError> {
        check_dims(&shape)?;
        let mut d_o = Stream::DO.rng(seed).normal_tensor(&shape.v(), 1.0);
        let mut d_ht =
            final_state_grad.then(|| Stream::DHt.rng(seed).normal_tensor(&shape.state(), 1.0));
        if round_to_bf16 {
            d_o = d_o.round_to_bf16();
            d_ht = d_ht.map(|d| d.round_to_f32());
        }
        Ok(Cotangents { d_o, d_ht })
    }
}
