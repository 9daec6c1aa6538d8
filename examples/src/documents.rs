//! Packed documents (fla's `cu_seqlens`) for the programs that check them: the offsets on the
//! device in either width, the checks' document layouts, and where documents start in a shard.

use cudarc::driver::{CudaSlice, CudaStream};
use lasp_shmem::ops::documents::DocumentOffsets;
use lasp_shmem::ops::DeviceRef;
use lasp_shmem::reference::SplitMix64;
use lasp_shmem::Result;
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
