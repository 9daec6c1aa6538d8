//! The problem dimensions of one call ([`ForwardShape`]), the limits the kernels set on them,
//! and the check that the kernels support a shape, whose errors say what to change.

use super::{geometry, invalid};
use crate::error::Result;

/// The largest T accepted: token indices plus a chunk stay within `i32` in the kernels.
pub const MAX_T: usize = (i32::MAX - geometry::CHUNK) as usize;
/// The largest B*H accepted (the kernels' grid z).
pub const MAX_BH: usize = 65_535;

/// Problem dimensions of one call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ForwardShape {
    /// Batch B.
    pub b: usize,
    /// Tokens per sequence T.
    pub t: usize,
    /// Heads H.
    pub h: usize,
    /// Key/query width Dk: 64 or 128.
    pub dk: usize,
    /// Value width Dv: a positive multiple of 64.
    pub dv: usize,
}

impl From<crate::reference::Shape> for ForwardShape {
    fn from(s: crate::reference::Shape) -> Self {
        ForwardShape {
            b: s.b,
            t: s.t,
            h: s.h,
            dk: s.dk,
            dv: s.dv,
        }
    }
}

impl ForwardShape {
    /// The dimensions every PE of a LASP-2 operation agrees on (all but T).
    pub fn layout(&self) -> crate::exchange::Lasp2Layout {
        crate::exchange::Lasp2Layout {
            b: self.b,
            h: self.h,
            dk: self.dk,
            dv: self.dv,
        }
    }

    /// Elements of q and k, `B*T*H*Dk`.
    pub fn qk_len(&self) -> usize {
        self.b * self.t * self.h * self.dk
    }

    /// Elements of v and o, `B*T*H*Dv`.
    pub fn v_len(&self) -> usize {
        self.b * self.t * self.h * self.dv
    }

    /// Elements of g, `B*T*H`.
    pub fn gate_len(&self) -> usize {
        self.b * self.t * self.h
    }

    /// Elements of h0 and ht, `B*H*Dk*Dv`.
    pub fn state_len(&self) -> usize {
        self.b * self.h * self.dk * self.dv
    }

    /// The default scale `Dk^-1/2` (fla's).
    pub fn default_scale(&self) -> f32 {
        (1.0 / (self.dk as f64).sqrt()) as f32
    }

    /// Checks that the kernels support the shape; the error says what to change.
    pub fn validate(&self) -> Result<()> {
        self.validate_as("scalar-decay forward")
    }

    /// [`ForwardShape::validate`] for the chunkwise kernels of any family; `op` names the
    /// operation in errors.
    pub(crate) fn validate_as(&self, op: &str) -> Result<()> {
        let ForwardShape { b, t, h, dk, dv } = *self;
        if b == 0 || t == 0 || h == 0 {
            return Err(invalid(format!(
                "{op}: B, T and H must be at least 1 (got B={b}, T={t}, H={h}); \
                 skip the call when there is nothing to compute"
            )));
        }
        if dk != 64 && dk != 128 {
            let advice = if dk < 128 {
                format!(
                    "pad q and k with zero columns up to {}, which leaves o unchanged (ht gains \
                     zero rows), and pass scale = {dk}^-1/2 explicitly",
                    if dk < 64 { 64 } else { 128 }
                )
            } else {
                "split q and k into blocks of 128 columns, run one call per block with the same \
                 v, g and scale, and add the outputs (in fp32)"
                    .to_string()
            };
            return Err(invalid(format!(
                "{op}: Dk = {dk} is not supported (the kernels are built for Dk 64 \
                 and 128); {advice}"
            )));
        }
        if dv == 0 || dv % 64 != 0 {
            return Err(invalid(format!(
                "{op}: Dv = {dv} is not a positive multiple of 64; pad v with zero \
                 columns to the next multiple of 64 and drop the extra columns of o (and ht)"
            )));
        }
        let bh = b.saturating_mul(h);
        if bh > MAX_BH {
            return Err(invalid(format!(
                "{op}: B*H = {b}*{h} exceeds {MAX_BH} (the kernels' grid limit); \
                 split the batch into calls of at most {} sequences",
                (MAX_BH / h).max(1)
            )));
        }
        if t > MAX_T {
            return Err(invalid(format!(
                "{op}: T = {t} exceeds {MAX_T}; split the sequence and carry the \
                 state between the calls with ht -> h0"
            )));
        }
        // Every index the kernels form in i64 and the host in usize, and the CTA count formula's
        // B*H*Dv/64 in i32, must not overflow.
        let elems = [dk, dv]
            .iter()
            .map(|&d| bh.checked_mul(t).and_then(|x| x.checked_mul(d)))
            .collect::<Option<Vec<usize>>>()
            .filter(|v| v.iter().all(|&x| x <= i64::MAX as usize / 4));
        let ctas_ok = bh
            .checked_mul(dv / 64)
            .is_some_and(|x| x <= i32::MAX as usize);
        if elems.is_none() || !ctas_ok {
            return Err(invalid(format!(
                "{op}: shape B={b}, T={t}, H={h}, Dk={dk}, Dv={dv} is too large \
                 to index; split it into several calls"
            )));
        }
        Ok(())
    }
}
