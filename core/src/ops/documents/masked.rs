//! Packed documents (fla's `cu_seqlens`) for the families whose kernels mask at the starts
//! instead of forgetting through a gate (GLA, mLSTM; `kernels/docs/packed.md`): GLA's gates are
//! per key, so a start cannot be written into them as the log-decay families' is (a copy of
//! `[B, T, H, Dk]` gates costs as much traffic as q); mLSTM's stabilised weights admit no finite
//! mark. Their kernels read one start word per chunk of 64 tokens that each call writes into its
//! workspace, and have twins for packed documents whose loops mask at the starts.

use super::{DocumentStarts, Documents, LoopOrder};
use crate::error::{Error, Result};
use crate::ops::WORKSPACE_PART_ALIGN;
use crate::runtime::Runtime;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use std::sync::Arc;

/// The start words of an operation's calls.
pub(crate) struct StartWords {
    starts: DocumentStarts,
}

impl StartWords {
    pub(crate) fn new(runtime: &Runtime) -> Result<Self> {
        Ok(StartWords {
            starts: DocumentStarts::new(runtime)?,
        })
    }

    /// Workspace bytes the words of a shard of `t` tokens take when `docs` is given (0 without
    /// documents), a whole number of 256-byte parts.
    fn bytes(docs: Option<&Documents<'_>>, t: usize) -> u64 {
        docs.map_or(0, |_| {
            let bytes = (DocumentStarts::words_len(t) * std::mem::size_of::<u64>()) as u64;
            bytes.div_ceil(WORKSPACE_PART_ALIGN) * WORKSPACE_PART_ALIGN
        })
    }

    /// Writes the words of `docs` for this shard's `t` tokens, in the loop's `order`, at `words`
    /// and returns the address the kernels take (`starts`); 0 (no documents) where `docs` is
    /// `None`.
    ///
    /// # Safety
    /// Where `docs` is given, `words` is the device address of [`StartWords::bytes`] bytes,
    /// 8-byte aligned, in the runtime's context, live and written by nothing else until the work
    /// on `stream` completes; `stream` is ordered after the offsets' buffer.
    unsafe fn enqueue(
        &self,
        stream: &Arc<CudaStream>,
        docs: Option<Documents<'_>>,
        t: usize,
        words: u64,
        order: LoopOrder,
    ) -> Result<u64> {
        let Some(docs) = docs else { return Ok(0) };
        // SAFETY: the caller's contract.
        unsafe { self.starts.chunk_words(stream, docs, t, words, order) }?;
        Ok(words)
    }

    /// Grows `workspace` to `parts` bytes of the operation's own parts and, with `docs`, one
    /// array of start words per loop order in `orders` after them (each a whole number of
    /// 256-byte parts), and writes the words of this shard's `t` tokens on `stream`. Returns the
    /// workspace's address and each array's (0 without documents). `workspace` is the operation's
    /// own, freed only after a context synchronisation (`crate::ops::ensure_workspace`); the
    /// caller orders `stream` after the offsets' buffer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn workspace<const N: usize>(
        &self,
        ctx: &CudaContext,
        stream: &Arc<CudaStream>,
        workspace: &mut Option<CudaSlice<u8>>,
        parts: u64,
        docs: Option<Documents<'_>>,
        t: usize,
        orders: [LoopOrder; N],
        op: &str,
    ) -> Result<(u64, [u64; N])> {
        let words_at = parts.next_multiple_of(WORKSPACE_PART_ALIGN);
        let per_order = Self::bytes(docs.as_ref(), t);
        let bytes = words_at + N as u64 * per_order;
        let base = crate::ops::ensure_workspace(ctx, stream, workspace, bytes, op)?;
        ctx.bind_to_thread()?;
        let mut starts = [0; N];
        for ((at, order), k) in starts.iter_mut().zip(orders).zip(0u64..) {
            // SAFETY: the array lies inside the workspace just sized (`bytes`), which the
            // operation owns and frees only after a context synchronisation; nothing else writes
            // it until the work on `stream` completes.
            *at = unsafe { self.enqueue(stream, docs, t, base + words_at + k * per_order, order) }?;
        }
        Ok((base, starts))
    }
}

/// The states a call over documents cannot take: every document starts from a zero state
/// (per-document initial states are not supported yet), and one final state for the whole
/// sequence has no meaning over documents (each document's comes from the operation's
/// per-document final states). `given` names the ones the call passes.
pub(crate) fn refuse_states(
    op: &str,
    docs: Option<&Documents<'_>>,
    given: &[(&str, bool)],
) -> Result<()> {
    if docs.is_none() {
        return Ok(());
    }
    match given.iter().find(|(_, is_given)| *is_given) {
        None => Ok(()),
        Some((name, _)) => Err(Error::InvalidArgument(format!(
            "{op}: {name} was given with packed documents (cu_seqlens); every document starts from \
             a zero state (per-document initial states are not supported yet) and each document's \
             final state comes from the per-document final states (document_ht, \
             document_final_states): pass {name} = None"
        ))),
    }
}

/// An operation's kernels and their twins for packed documents (the `_PACKED` instances of
/// `kernels/instances.rs`, whose chunk loops mask at the starts): the loops of a call without
/// documents are compiled with no mask in them.
pub(crate) struct Twins<T> {
    plain: T,
    packed: T,
}

impl<T> Twins<T> {
    /// Both tables, `make` given the plain instances' names, then the packed ones'.
    pub(crate) fn new<N>(names: [N; 2], make: impl Fn(N) -> Result<T>) -> Result<Self> {
        let [plain, packed] = names;
        Ok(Twins {
            plain: make(plain)?,
            packed: make(packed)?,
        })
    }

    /// The table for a call with documents (`packed`) or without.
    pub(crate) fn get(&self, packed: bool) -> &T {
        if packed {
            &self.packed
        } else {
            &self.plain
        }
    }
}
