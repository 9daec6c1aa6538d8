//! Packed documents (fla's `cu_seqlens`) for the families whose state forgets through a per-token
//! log-decay: scalar decay ([`crate::ops::scalar_decay`]) and Gated DeltaNet
//! ([`crate::ops::gated_delta`]), on one GPU and on LASP-2 shards: [`DocumentStarts`].
//!
//! Pretraining packs documents into one sequence; the state must not carry from one document into
//! the next. In `S_t = e^{a_t} (...) S_{t-1} + ...` a document start is a token whose log-decay is
//! minus infinity, so documents need no kernel of their own: [`DocumentStarts::forgetting_gates`]
//! copies the caller's log-decays and gives every start in this shard
//! `LASP_DOCUMENT_START_LOG_DECAY` (-128: finite, as the kernels' cumsums need, and `e^{-128}` is
//! exactly 0 in fp32; `lasp/documents/documents_params.h` says why). The copy goes to the family's
//! forward and backward as `g`, unchanged otherwise; then [`DocumentStarts::clear_start_gradients`]
//! writes 0 into `dg` at the starts (the layer never reads a start's own gate). Within a shard the
//! chunk loops forget at each start; across shards a shard holding a start sends a summary whose
//! carry is exactly zero, so the fold is unchanged in form and every exchange mode and schedule
//! stays bitwise equal. The marks kernel's grid is fixed by the capacity of `cu_seqlens`, not by
//! the documents: a captured CUDA graph replays with other documents written into the same buffer
//! (pad it with the total length).
//!
//! The short convolution ([`crate::ops::short_conv`]) takes the same documents through a flag
//! per token (`DocumentStarts::start_flags`), which its kernels read. GLA ([`crate::ops::gla`]),
//! whose gates are per key, and mLSTM ([`crate::ops::mlstm`]), whose stabilised weights admit no
//! finite mark, mask at the starts instead, from one word per chunk of 64 tokens
//! (`DocumentStarts::chunk_words`; the operations' side: `masked`).
//!
//! A call over documents takes no initial state (the first document starts at token 0, which
//! forgets it). Scalar decay and Gated DeltaNet give every document's final state (`final_states`;
//! [`crate::ops::scalar_decay::ScalarDecayDocumentStates`],
//! [`crate::ops::gated_delta::GatedDeltaDocumentStates`]); per-document initial states and the
//! other families' final states are not here yet. Design: `kernels/docs/packed.md`.

pub(crate) mod final_states;
pub(crate) mod masked;

pub use final_states::document_states_len;
#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
use crate::kernel::{Kernel, LaunchShape};
use crate::ops::scalar_decay::TensorChecks;
use crate::ops::{copy_to_host, require_runtime_stream, DeviceMut, DeviceRef, StreamOrder};
use crate::runtime::Runtime;
use cudarc::driver::CudaStream;
use lasp_shmem_kernels::params::{
    lasp_document_entry_slots_params, lasp_document_marks_params, lasp_document_words_params,
    LASP_DOCUMENTS_THREADS, LASP_DOCUMENT_START_LOG_DECAY, LASP_DOCUMENT_WORD_TOKENS,
};
use std::sync::Arc;

const OP: &str = "packed documents";
/// The grid's y dimension (batch rows) stays within CUDA's limit.
const MAX_BATCH: usize = 65_535;

/// fla's `cu_seqlens` on the device, int32 or int64.
#[derive(Clone, Copy, Debug)]
pub enum DocumentOffsets<'a> {
    I32(DeviceRef<'a, i32>),
    I64(DeviceRef<'a, i64>),
}

impl<'a> DocumentOffsets<'a> {
    pub(crate) fn len(&self) -> usize {
        match self {
            DocumentOffsets::I32(o) => o.len(),
            DocumentOffsets::I64(o) => o.len(),
        }
    }

    pub(crate) fn addr(&self) -> u64 {
        match self {
            DocumentOffsets::I32(o) => o.addr(),
            DocumentOffsets::I64(o) => o.addr(),
        }
    }

    pub(crate) fn home(&self) -> Option<&'a Arc<CudaStream>> {
        match self {
            DocumentOffsets::I32(o) => o.home(),
            DocumentOffsets::I64(o) => o.home(),
        }
    }

    pub(crate) fn is_int64(&self) -> bool {
        matches!(self, DocumentOffsets::I64(_))
    }

    /// The offsets on the host (synchronises `stream`).
    fn to_host(self, stream: &Arc<CudaStream>) -> Result<Vec<i64>> {
        let ctx = stream.context();
        Ok(match self {
            DocumentOffsets::I32(o) => copy_to_host(ctx, stream, o)?
                .into_iter()
                .map(i64::from)
                .collect(),
            DocumentOffsets::I64(o) => copy_to_host(ctx, stream, o)?,
        })
    }
}

/// Where the documents of the packed sequence start, and where this shard sits in it.
#[derive(Clone, Copy, Debug)]
pub struct Documents<'a> {
    /// fla's `cu_seqlens` of the whole packed sequence, `[0, l_1, l_1 + l_2, ..., total]`, on the
    /// device; entries after the last may repeat the total (a buffer of fixed capacity, which a
    /// captured CUDA graph replays with other documents). Every batch row is packed alike (fla
    /// packs with B = 1).
    pub cu_seqlens: DocumentOffsets<'a>,
    /// The packed sequence's index of this shard's first token: the sum of the earlier PEs' shard
    /// lengths (0 on one GPU).
    pub shard_start: usize,
}

/// The order in which a chunk loop walks a shard, which its start words follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoopOrder {
    /// From the shard's first token up (every forward, GLA's backward, mLSTM's dq pass).
    InOrder,
    /// From the shard's last token down (mLSTM's dv and dk passes and its gate gradient).
    Reversed,
}

/// The log-decays `[B, T, H]` of one call: B batch rows of this shard's T tokens, H heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GateShape {
    pub b: usize,
    pub t: usize,
    pub h: usize,
}

impl GateShape {
    fn len(&self) -> usize {
        self.b * self.t * self.h
    }
}

/// Document starts for the log-decay families (see the module documentation).
pub struct DocumentStarts {
    runtime: Runtime,
    marks: Kernel,
    words: Kernel,
    entries: Kernel,
}

impl DocumentStarts {
    pub fn new(runtime: &Runtime) -> Result<Self> {
        Ok(DocumentStarts {
            runtime: runtime.clone(),
            marks: runtime.module().kernel("lasp_document_marks")?,
            words: runtime.module().kernel("lasp_document_chunk_words")?,
            entries: runtime.module().kernel("lasp_document_entry_slots")?,
        })
    }

    /// Writes into `out` the log-decays the family's forward and backward take for this shard:
    /// `g`, with every token that starts a document given `LASP_DOCUMENT_START_LOG_DECAY`.
    pub fn forgetting_gates(
        &self,
        stream: &Arc<CudaStream>,
        docs: Documents<'_>,
        g: DeviceRef<'_, f32>,
        out: DeviceMut<'_, f32>,
        shape: GateShape,
    ) -> Result<()> {
        let op = "packed documents: forgetting gates";
        require_runtime_stream(stream, self.runtime.context(), op)?;
        let checks = check(op, &docs, shape)?;
        checks.tensor("g", "[B, T, H]", (g.len(), shape.len()), g.addr(), 4)?;
        checks.tensor("out", "[B, T, H]", (out.len(), shape.len()), out.addr(), 4)?;
        checks.disjoint(&[("g", g.byte_range())], &[("out", out.byte_range())])?;
        let homes = [docs.cu_seqlens.home(), g.home(), out.home()];
        StreamOrder::around(stream, homes, op, || {
            let bytes = shape.len() * std::mem::size_of::<f32>();
            // SAFETY: both views hold shape.len() f32 (checked above) of this context, kept live
            // and unaliased by their contracts until the work on `stream` completes, which
            // StreamOrder orders after their buffers' streams.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    out.addr(),
                    g.addr(),
                    bytes,
                    stream.cu_stream(),
                )
            }?;
            let first = docs.shard_start as i64;
            let start_log_decay = LASP_DOCUMENT_START_LOG_DECAY as f32;
            self.mark(stream, &docs, first, &out, shape, start_log_decay)
        })
    }

    /// Writes 0 into `dg` `[B, T, H]` at every token of this shard that starts a document: the
    /// gradient of the caller's log-decays there, which the layer never reads (the backward's
    /// value is the gradient with respect to the mark).
    pub fn clear_start_gradients(
        &self,
        stream: &Arc<CudaStream>,
        docs: Documents<'_>,
        dg: DeviceMut<'_, f32>,
        shape: GateShape,
    ) -> Result<()> {
        let op = "packed documents: start gradients";
        require_runtime_stream(stream, self.runtime.context(), op)?;
        let checks = check(op, &docs, shape)?;
        checks.tensor("dg", "[B, T, H]", (dg.len(), shape.len()), dg.addr(), 4)?;
        let homes = [docs.cu_seqlens.home(), dg.home()];
        StreamOrder::around(stream, homes, op, || {
            self.mark(stream, &docs, docs.shard_start as i64, &dg, shape, 0.0)
        })
    }

    /// Writes into `flags` `[before + T]` fp32 1 where a token starts a document and 0
    /// elsewhere: the shard's T tokens and the `before` tokens before them (the short
    /// convolution's halo), from the packed sequence's token `shard_start - before`. The caller
    /// orders `stream` after the offsets' and `flags`' buffers.
    pub(crate) fn start_flags(
        &self,
        stream: &Arc<CudaStream>,
        docs: Documents<'_>,
        before: usize,
        flags: &DeviceMut<'_, f32>,
    ) -> Result<()> {
        let shape = GateShape {
            b: 1,
            t: flags.len(),
            h: 1,
        };
        check("packed documents: start flags", &docs, shape)?;
        let bytes = flags.len() * std::mem::size_of::<f32>();
        // SAFETY: `flags` holds flags.len() fp32 of this context, live until the work on
        // `stream` completes (the view's contract).
        unsafe {
            cudarc::driver::result::memset_d8_async(flags.addr(), 0, bytes, stream.cu_stream())
        }?;
        let first = docs.shard_start as i64 - before as i64;
        self.mark(stream, &docs, first, flags, shape, 1.0)
    }

    /// The u64 start words of a shard of `t` tokens: one per chunk of 64.
    pub(crate) fn words_len(t: usize) -> usize {
        t.div_ceil(LASP_DOCUMENT_WORD_TOKENS as usize)
    }

    /// Writes the start words of this shard's `t` tokens to `words`: bit i of word c set where
    /// token `64 c + i` starts a document (`lasp/documents/chunk_starts.cuh`); for a loop that
    /// walks the shard from its last token down ([`LoopOrder::Reversed`]), where loop token
    /// `64 c + i` is followed by a start (the shard's last token where the next shard opens
    /// with one). The caller orders `stream` after the offsets' buffer.
    ///
    /// # Safety
    /// `words` is the device address of [`DocumentStarts::words_len`]`(t)` u64, 8-byte aligned,
    /// in this runtime's context, live and written by nothing else until the work on `stream`
    /// completes.
    pub(crate) unsafe fn chunk_words(
        &self,
        stream: &Arc<CudaStream>,
        docs: Documents<'_>,
        t: usize,
        words: u64,
        order: LoopOrder,
    ) -> Result<()> {
        let shape = GateShape { b: 1, t, h: 1 };
        check("packed documents: start words", &docs, shape)?;
        let bytes = Self::words_len(t) * std::mem::size_of::<u64>();
        // SAFETY: the caller's contract.
        unsafe { cudarc::driver::result::memset_d8_async(words, 0, bytes, stream.cu_stream()) }?;
        let p = lasp_document_words_params {
            cu_seqlens: docs.cu_seqlens.addr() as _,
            offsets_are_int64: i32::from(docs.cu_seqlens.is_int64()),
            num_offsets: docs.cu_seqlens.len() as i32,
            shard_start: docs.shard_start as i64,
            T: t as i32,
            reversed: i32::from(order == LoopOrder::Reversed),
            words: words as _,
        };
        let launch = LaunchShape {
            grid: (
                docs.cu_seqlens
                    .len()
                    .div_ceil(LASP_DOCUMENTS_THREADS as usize) as u32,
                1,
                1,
            ),
            block: (LASP_DOCUMENTS_THREADS, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: `p` is the kernel's lasp_document_words_params, generated from its header; the
        // offsets hold num_offsets entries of the stated width (checked above, live by the view's
        // contract) and `words` the shard's words (the caller's contract).
        unsafe { self.words.launch(stream, launch, &p) }
    }

    /// Writes to `slots` (int32, one per chunk of 64 of this shard's `t` tokens) the document whose
    /// state entering the chunk the chunk loops store for the documents' final states, or -1
    /// (`lasp_document_entry_slots`): the document that began before the chunk and ends in it. The
    /// caller orders `stream` after the offsets' buffer.
    ///
    /// # Safety
    /// `slots` is the device address of [`DocumentStarts::words_len`]`(t)` i32, 4-byte aligned, in
    /// this runtime's context, live and written by nothing else until the work on `stream`
    /// completes.
    pub(crate) unsafe fn entry_slots(
        &self,
        stream: &Arc<CudaStream>,
        docs: Documents<'_>,
        t: usize,
        slots: u64,
    ) -> Result<()> {
        let shape = GateShape { b: 1, t, h: 1 };
        check("packed documents: entry slots", &docs, shape)?;
        let bytes = Self::words_len(t) * std::mem::size_of::<i32>();
        // SAFETY: the caller's contract; 0xFF bytes make every slot -1.
        unsafe { cudarc::driver::result::memset_d8_async(slots, 0xFF, bytes, stream.cu_stream()) }?;
        let p = lasp_document_entry_slots_params {
            cu_seqlens: docs.cu_seqlens.addr() as _,
            offsets_are_int64: i32::from(docs.cu_seqlens.is_int64()),
            num_offsets: docs.cu_seqlens.len() as i32,
            shard_start: docs.shard_start as i64,
            T: t as i32,
            slots: slots as _,
        };
        let launch = LaunchShape {
            grid: (
                (docs.cu_seqlens.len() - 1).div_ceil(LASP_DOCUMENTS_THREADS as usize) as u32,
                1,
                1,
            ),
            block: (LASP_DOCUMENTS_THREADS, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: `p` is the kernel's lasp_document_entry_slots_params, generated from its header;
        // the offsets hold num_offsets entries of the stated width (checked above, live by the
        // view's contract) and `slots` the shard's slots (the caller's contract).
        unsafe { self.entries.launch(stream, launch, &p) }
    }

    /// Checks `docs.cu_seqlens` on the host against a packed sequence of `total` tokens with this
    /// shard's `tokens` in it: first 0, strictly increasing up to `total`, then only `total`
    /// (padding). Synchronises `stream`; for tests and first calls, since the marks trust the
    /// offsets (an offset out of order marks a token that starts no document).
    pub fn validate(
        &self,
        stream: &Arc<CudaStream>,
        docs: Documents<'_>,
        tokens: usize,
        total: usize,
    ) -> Result<()> {
        require_runtime_stream(stream, self.runtime.context(), OP)?;
        if docs.shard_start + tokens > total {
            return Err(invalid(format!(
                "{OP}: the shard's tokens [{}, {}) end past the packed sequence's {total}; pass \
                 shard_start = the sum of the earlier PEs' shard lengths",
                docs.shard_start,
                docs.shard_start + tokens
            )));
        }
        check_offsets(&docs.cu_seqlens.to_host(stream)?, total)
    }

    /// Writes `value` into the rows of `values` `[B, T, H]` whose token starts a document, row
    /// t being the packed sequence's token `first + t`.
    fn mark(
        &self,
        stream: &Arc<CudaStream>,
        docs: &Documents<'_>,
        first: i64,
        values: &DeviceMut<'_, f32>,
        shape: GateShape,
        value: f32,
    ) -> Result<()> {
        let p = lasp_document_marks_params {
            cu_seqlens: docs.cu_seqlens.addr() as _,
            offsets_are_int64: i32::from(docs.cu_seqlens.is_int64()),
            num_offsets: docs.cu_seqlens.len() as i32,
            shard_start: first,
            B: shape.b as i32,
            T: shape.t as i32,
            row_len: shape.h as i32,
            value,
            values: values.addr() as _,
        };
        let launch = LaunchShape {
            grid: (docs.cu_seqlens.len() as u32, shape.b as u32, 1),
            block: (LASP_DOCUMENTS_THREADS, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: `p` is the kernel's lasp_document_marks_params, generated from its header; the
        // offsets hold num_offsets entries of the stated width and `values` B * T * H fp32 (checked
        // by the callers), live until the work on `stream` completes (the views' contracts).
        unsafe { self.marks.launch(stream, launch, &p) }
    }
}

fn invalid(message: String) -> Error {
    Error::InvalidArgument(message)
}

/// The checks every call makes before it enqueues anything; the tensor checks for `op`.
pub(crate) fn check<'a>(
    op: &'a str,
    docs: &Documents<'_>,
    shape: GateShape,
) -> Result<TensorChecks<'a>> {
    let GateShape { b, t, h } = shape;
    if b == 0 || t == 0 || h == 0 || b > MAX_BATCH || t > i32::MAX as usize || h > i32::MAX as usize
    {
        return Err(invalid(format!(
            "{op}: B = {b}, T = {t}, H = {h}; each must be at least 1 (B at most {MAX_BATCH}, T and \
             H at most {})",
            i32::MAX
        )));
    }
    let offsets = docs.cu_seqlens.len();
    if !(2..=i32::MAX as usize).contains(&offsets) {
        return Err(invalid(format!(
            "{op}: cu_seqlens has {offsets} entries; pass fla's [0, l_1, ..., total] (at least 2 \
             entries, at most {})",
            i32::MAX
        )));
    }
    if docs.shard_start > i64::MAX as usize - t {
        return Err(invalid(format!(
            "{op}: shard_start = {} is past what int64 offsets can address",
            docs.shard_start
        )));
    }
    let checks = TensorChecks::with_dims(op, format!("B={b}, T={t}, H={h}"));
    let width = if docs.cu_seqlens.is_int64() { 8 } else { 4 };
    checks.aligned("cu_seqlens", docs.cu_seqlens.addr(), width)?;
    Ok(checks)
}

/// fla's convention for `total` tokens, with padding: first 0, strictly increasing up to `total`,
/// then only `total`.
fn check_offsets(offsets: &[i64], total: usize) -> Result<()> {
    let total = total as i64;
    let fail = |what: String| {
        Err(invalid(format!(
            "{OP}: cu_seqlens {what}; pass fla's offsets [0, l_1, l_1 + l_2, ..., {total}] of \
             documents of at least one token, padded with {total} if the buffer is longer"
        )))
    };
    if offsets.first() != Some(&0) {
        return fail(format!("starts with {:?}, not 0", offsets.first()));
    }
    if offsets.last() != Some(&total) {
        return fail(format!("ends with {:?}, not the total", offsets.last()));
    }
    for (i, pair) in offsets.windows(2).enumerate() {
        let (a, b) = (pair[0], pair[1]);
        let padding = a == total;
        if b > total || (padding && b != total) || (!padding && b <= a) {
            return fail(format!("has {a} then {b} at entries {i}, {}", i + 1));
        }
    }
    Ok(())
}
