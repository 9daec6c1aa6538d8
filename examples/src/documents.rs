//! Packed documents (fla's `cu_seqlens`) for the programs that check and time them: the offsets
//! on the device in either width, the checks' document layouts, where documents start in a
//! shard, and the cost of a packed training step against the same tokens unpacked.

use crate::{round, time_call, ModeCall};
use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::documents::DocumentOffsets;
use lasp_shmem::ops::scalar_decay::ForwardShape;
use lasp_shmem::ops::DeviceRef;
use lasp_shmem::reference::SplitMix64;
use lasp_shmem::{Result, Runtime};
use serde::Serialize;
use std::sync::Arc;

/// fla's offsets on the device, in either width.
pub enum Offsets {
    I32(CudaSlice<i32>),
    I64(CudaSlice<i64>),
}

impl Offsets {
    pub fn upload(stream: &Arc<CudaStream>, offsets: &[usize], int64: bool) -> Result<Self> {
        Ok(if int64 {
            Offsets::I64(stream.clone_htod(&offsets.iter().map(|&o| o as i64).collect::<Vec<_>>())?)
        } else {
            Offsets::I32(stream.clone_htod(&offsets.iter().map(|&o| o as i32).collect::<Vec<_>>())?)
        })
    }

    /// Overwrites the buffer with `offsets` (as many entries as it holds).
    pub fn write(&mut self, stream: &Arc<CudaStream>, offsets: &[usize]) -> Result<()> {
        match self {
            Offsets::I32(d) => {
                stream.memcpy_htod(&offsets.iter().map(|&o| o as i32).collect::<Vec<_>>(), d)?
            }
            Offsets::I64(d) => {
                stream.memcpy_htod(&offsets.iter().map(|&o| o as i64).collect::<Vec<_>>(), d)?
            }
        }
        Ok(())
    }

    pub fn view(&self) -> DocumentOffsets<'_> {
        match self {
            Offsets::I32(d) => DocumentOffsets::I32(DeviceRef::new(d)),
            Offsets::I64(d) => DocumentOffsets::I64(DeviceRef::new(d)),
        }
    }
}

/// Documents of 1, 63, 64, 65 tokens, then one ending on the first shard boundary, one of a whole
/// shard (W = 3) or one spanning three shards (W >= 4), then the rest.
pub fn boundary_documents(lengths: &[usize]) -> Vec<usize> {
    let total: usize = lengths.iter().sum();
    let boundary = |w: usize| -> usize { lengths[..w].iter().sum() };
    let mut starts = vec![0, 1, 64, 128];
    let mut at = 193;
    let npes = lengths.len();
    if npes >= 2 {
        starts.push(at);
        at = boundary(1);
        if npes == 3 {
            starts.push(at);
            at = boundary(2);
        } else if npes >= 4 {
            starts.push(at);
            at = boundary(3) + 5;
        }
    }
    starts.push(at);
    starts.push(total);
    starts
}

/// The shard's tokens (0-based in the shard) that start a document.
pub fn starts_in_shard(
    cu_seqlens: &[usize],
    start: usize,
    len: usize,
) -> impl Iterator<Item = usize> + '_ {
    cu_seqlens[..cu_seqlens.len() - 1]
        .iter()
        .filter(move |&&s| s >= start && s < start + len)
        .map(move |&s| s - start)
}

/// Documents of mixed lengths over `total` tokens: log-uniform in [64, 8192], the last cut at
/// the end.
pub fn mixed_documents(total: usize, rng: &mut SplitMix64) -> Vec<usize> {
    let mut out = vec![0];
    while *out.last().unwrap() < total {
        let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let len = (64.0 * 128f64.powf(u)) as usize;
        out.push((out.last().unwrap() + len).min(total));
    }
    out
}

/// Offsets a check's buffer holds past its documents' (padded with the total), so that a graph
/// replayed from the same buffer can take other documents.
pub const SPARE_OFFSETS: usize = 2;

/// fla's offsets `[0, ..., total]` as a check's device buffer holds them: padded with the total.
pub fn padded_offsets(cu_seqlens: &[usize]) -> Vec<usize> {
    let total = *cu_seqlens.last().expect("offsets end with the total");
    let mut out = cu_seqlens.to_vec();
    out.extend([total; SPARE_OFFSETS]);
    out
}

/// A buffer of `len` offsets holding one document of `total` tokens (padded with the total):
/// what a check's graph is captured with before its documents are written.
pub fn one_document(len: usize, total: usize) -> Vec<usize> {
    (0..len).map(|i| if i == 0 { 0 } else { total }).collect()
}

/// The largest of each PE's value (all PEs call it).
pub fn max_over_pes(rt: &Runtime, value: f64) -> Result<f64> {
    Ok(rt
        .all_gather_u64(value.to_bits())?
        .into_iter()
        .map(f64::from_bits)
        .fold(f64::NEG_INFINITY, f64::max))
}

/// The cost's schedule: ROUNDS rounds, each giving the unpacked and the packed forward, then the
/// unpacked and the packed step, in turn WARM_CALLS untimed and CALLS_PER_VISIT timed calls.
const ROUNDS: usize = 6;
const WARM_CALLS: usize = 2;
const CALLS_PER_VISIT: usize = 5;

/// A training step on packed documents against the same tokens unpacked, at one shape per GPU:
/// the slowest PE's medians.
#[derive(Serialize)]
pub struct PackedCost {
    pub w: usize,
    pub b: usize,
    pub t_local: usize,
    pub h: usize,
    pub d: usize,
    pub documents: usize,
    pub unpacked_ms: f64,
    pub packed_ms: f64,
    pub packed_over_unpacked: f64,
    /// The forward alone.
    pub forward_unpacked_ms: f64,
    pub forward_packed_ms: f64,
}

impl PackedCost {
    /// Times `step` (overlapped mode) at `shape` over `documents` documents, in turns:
    /// `turn(step, packed, forward_only)` sets what its next calls run.
    pub fn measure<S: ModeCall>(
        rt: &Runtime,
        shape: ForwardShape,
        documents: usize,
        step: &mut S,
        mut turn: impl FnMut(&mut S, bool, bool),
    ) -> Result<Self> {
        let stream = rt.stream().clone();
        // [forward unpacked, forward packed, step unpacked, step packed]
        let mut samples = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            for (i, times) in samples.iter_mut().enumerate() {
                turn(step, i % 2 == 1, i < 2);
                for call in 0..WARM_CALLS + CALLS_PER_VISIT {
                    let ms = time_call(rt, step)?;
                    if call >= WARM_CALLS {
                        times.push(ms);
                    }
                }
                step.finish(&stream)?;
            }
        }
        let mut medians = [0.0; 4];
        for (m, times) in medians.iter_mut().zip(&mut samples) {
            times.sort_by(f64::total_cmp);
            *m = max_over_pes(rt, times[times.len() / 2])?;
        }
        let [forward_unpacked_ms, forward_packed_ms, unpacked_ms, packed_ms] = medians;
        Ok(PackedCost {
            w: rt.npes(),
            b: shape.b,
            t_local: shape.t,
            h: shape.h,
            d: shape.dk,
            documents,
            unpacked_ms: round(unpacked_ms, 4),
            packed_ms: round(packed_ms, 4),
            packed_over_unpacked: round(packed_ms / unpacked_ms, 4),
            forward_unpacked_ms: round(forward_unpacked_ms, 4),
            forward_packed_ms: round(forward_packed_ms, 4),
        })
    }

    /// The line rank 0 prints for `family`.
    pub fn line(&self, family: &str) -> String {
        format!(
            "{family} W={} B={} T_local={} H={} D={}, {} documents: training step unpacked \
             {:.4} ms, packed {:.4} ms ({:.3}x); forward unpacked {:.4} ms, packed {:.4} ms",
            self.w,
            self.b,
            self.t_local,
            self.h,
            self.d,
            self.documents,
            self.unpacked_ms,
            self.packed_ms,
            self.packed_over_unpacked,
            self.forward_unpacked_ms,
            self.forward_packed_ms
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_check_buffer_pads_with_the_total_and_a_capture_holds_one_document() {
        assert_eq!(padded_offsets(&[0, 3, 5]), [0, 3, 5, 5, 5]);
        assert_eq!(one_document(5, 5), [0, 5, 5, 5, 5]);
        assert_eq!(one_document(padded_offsets(&[0, 7]).len(), 7), [0, 7, 7, 7]);
    }
}
