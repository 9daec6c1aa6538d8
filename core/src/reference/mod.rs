//! CPU `f64` reference for chunked gated linear attention and the LASP-2 decomposition, forward
//! and backward. It is the oracle every GPU test compares against and pins the maths before (and
//! independently of) the kernels: conventions and formulas are those of
//! `kernels/docs/maths.md`.
//!
//! # Conventions
//! * Layout `[B, T, H, D]` (fla's): `q, k [B, T, H, Dk]`, `v, o [B, T, H, Dv]`, gates `[B, T, H]`
//!   (scalar) or `[B, T, H, Dk]` (vector), `beta [B, T, H]`, states `[B, H, Dk, Dv]`.
//! * Gates are log-decays `a_t <= 0`; decay is applied before the current token is added and the
//!   output reads the updated state: `S_t = e^{a_t} S_{t-1} + k_t^T v_t`, `o_t = sigma q_t S_t`,
//!   with `sigma` defaulting to `Dk^-1/2`, an optional initial state `h0` and the final state `S_T`.
//! * `G_t` is the inclusive cumsum of the gates; cumsums are chunk-local, and every exponent is
//!   arranged to be `<= 0` (`e^{G_i - G_j}` is never factored as `e^{G_i} e^{-G_j}`), so no
//!   regime overflows.
//! * Backward functions return the gradient of `L = sum(o * d_o) + <S_T, d_ht>`
//!   ([`Forward::loss`]), gate gradients included.
//!
//! # Modules
//! * [`scalar_decay`], [`gla`], [`delta_rule`]: recurrent and chunkwise forwards, recurrent and
//!   chunkwise backwards of the three families.
//! * [`lasp2`]: the decomposition over W simulated ranks, with every exchanged intermediate.
//! * [`mlstm`]: xLSTM's matrix LSTM (mlstm_kernels' "mLSTMexp"), with its own inputs (input and
//!   forget gate pre-activations, a stabilised state `(C, n, m)`): recurrent, chunkwise and LASP-2,
//!   forward and backward.
//! * [`packed`]: packed documents (fla's `cu_seqlens`) for the decay families, whose LASP-2
//!   decomposition is [`lasp2::packed_forward`] / [`lasp2::packed_backward`].
//! * [`short_conv`]: the short causal depthwise convolution before the attention (fla's
//!   `ShortConvolution`), on one sequence, on packed documents and on LASP-2 shards with a halo.
//! * [`Inputs`], [`InputSpec`], [`Regime`], [`Cotangents`]: the seeded inputs the GPU tests share.
//! * [`tensor`]: the tensor type and the comparison metric [`rel_err`] / [`assert_rel_close`].
//!
//! # Using it from a GPU test
//! Generate the inputs with `round_to_bf16: true`, upload them, run the kernel, download its
//! output as `f64`, and compare norm-wise against the reference:
//! ```
//! use lasp_shmem::reference::{
//!     assert_rel_close, lasp2, scalar_decay, Cotangents, Family, InputSpec, Inputs, Regime, Shape,
//! };
//!
//! let shape = Shape { b: 1, t: 40, h: 2, dk: 8, dv: 8 };
//! let spec = InputSpec {
//!     shape,
//!     family: Family::ScalarDecay,
//!     regime: Regime::Typical,
//!     seed: 7,
//!     round_to_bf16: true, // q, k, v exactly bf16; g, h0, scale exactly f32
//!     initial_state: true,
//! };
//! let inputs = Inputs::generate(&spec)?;
//! // Upload inputs.q.data() etc. (bf16 / f32 conversions are exact), run the kernel ...
//! let want = scalar_decay::chunkwise_forward(&inputs, 16)?;
//! let got: Vec<f64> = want.o.data().to_vec(); // ... stands in for the kernel's output here.
//! assert_rel_close("o", &got, want.o.data(), 5e-3)?;
//!
//! // LASP-2 on 3 ranks: compare the exchanged (M_w, Lambda_w), the prefixes P_w and outputs.
//! let lasp = lasp2::forward(&inputs, lasp2::Decay::Scalar, &[7, 20, 13], 16)?;
//! assert_rel_close("o", lasp.o.data(), want.o.data(), 1e-12)?;
//! let cot = Cotangents::generate(shape, 8, true, true)?;
//! let grads = scalar_decay::backward(&inputs, 16, &cot.d_o, cot.d_ht.as_ref())?;
//! assert_eq!(grads.dg.shape(), &[1, 40, 2]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//! Suggested GPU tolerances are the test's business; `f64` reference-vs-reference agreement is
//! around `1e-13` relative, so any visible error comes from the kernel's precision.

pub mod delta_rule;
mod error;
mod gates;
mod generate;
pub mod gla;
mod head;
mod inputs;
pub mod lasp2;
mod linalg;
pub mod mlstm;
mod outputs;
pub mod packed;
mod recurrent;
mod rng;
pub mod scalar_decay;
pub mod short_conv;
pub mod tensor;
mod validate;

pub use error::ReferenceError;
pub use generate::{InputSpec, Regime};
pub use inputs::{Cotangents, Family, GateKind, Inputs, Shape};
pub use outputs::{Forward, Grads};
pub use rng::SplitMix64;
pub use tensor::{assert_close_to_scale, assert_rel_close, rel_err, Tensor};
