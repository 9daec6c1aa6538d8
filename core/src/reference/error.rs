//! The one error type of the reference: every rejection says what is wrong and what to do about it.

use std::fmt;

/// Why the reference refused its inputs. Every check runs before any arithmetic, so an error never
/// leaves a half-computed result behind.
#[derive(Clone, Debug, PartialEq)]
pub enum ReferenceError {
    /// A problem dimension (B, T, H, Dk or Dv) is zero.
    ZeroDimension {
        /// The dimension's name, e.g. `"T"`.
        name: &'static str,
    },
    /// A tensor's shape differs from the one the problem's [`Shape`](super::Shape) implies.
    ShapeMismatch {
        /// The tensor's name, e.g. `"k"` or `"d_o"`.
        tensor: &'static str,
        /// The layout the tensor must have, e.g. `"[B, T, H, Dk]"`.
        layout: &'static str,
        /// The shape implied by the problem.
        expected: Vec<usize>,
        /// The shape the tensor has.
        got: Vec<usize>,
    },
    /// A tensor has the wrong number of axes for its layout.
    WrongRank {
        /// The tensor's name.
        tensor: &'static str,
        /// The layout it must have.
        layout: &'static str,
        /// The shape it has.
        got: Vec<usize>,
    },
    /// A buffer handed to [`Tensor::from_vec`](super::Tensor::from_vec) has the wrong element count.
    DataLength {
        /// The requested shape.
        shape: Vec<usize>,
        /// The element count of that shape.
        expected: usize,
        /// The length of the buffer.
        got: usize,
    },
    /// A gate (log-decay) is positive, which would make the state grow without bound.
    PositiveGate {
        /// Index of the first positive gate, `[b, t, h]` or `[b, t, h, d]`.
        index: Vec<usize>,
        /// Its value.
        value: f64,
    },
    /// An input value is NaN or infinite.
    NonFinite {
        /// The tensor's name.
        tensor: &'static str,
        /// Index of the first such value.
        index: Vec<usize>,
        /// The value.
        value: f64,
    },
    /// The attention scale is NaN or infinite.
    InvalidScale {
        /// The scale.
        value: f64,
    },
    /// The mLSTM's denominator epsilon is negative or not finite.
    InvalidEpsilon {
        /// The epsilon.
        value: f64,
    },
    /// The delta rule was asked to run without `beta`.
    MissingBeta,
    /// A chunk size is zero.
    ZeroChunk {
        /// `"chunk"` or `"sub_chunk"`.
        parameter: &'static str,
    },
    /// No shard lengths were given to a LASP-2 function.
    NoShards,
    /// A shard (rank) owns no tokens.
    ZeroLengthShard {
        /// The rank whose length is zero.
        rank: usize,
    },
    /// A per-rank list (summaries, `dM_w`) has the wrong number of entries.
    RankCount {
        /// What the list holds, e.g. `"d_m"`.
        what: &'static str,
        /// The number of ranks.
        expected: usize,
        /// The number of entries.
        got: usize,
    },
    /// The shard lengths do not add up to the sequence length.
    ShardLengthSum {
        /// The sum of the shard lengths.
        sum: usize,
        /// The sequence length T.
        t: usize,
    },
    /// `cu_seqlens` has fewer than two entries, so it describes no document.
    CuSeqlensTooShort {
        /// Its length.
        len: usize,
    },
    /// `cu_seqlens` does not start at 0.
    CuSeqlensFirst {
        /// Its first entry.
        first: usize,
    },
    /// `cu_seqlens` does not end at T.
    CuSeqlensLast {
        /// Its last entry.
        last: usize,
        /// The packed sequence length T.
        t: usize,
    },
    /// `cu_seqlens` is not strictly increasing: a document would be empty or run backwards.
    CuSeqlensNotIncreasing {
        /// The position of the offending entry.
        index: usize,
        /// The entry before it.
        previous: usize,
        /// The entry.
        value: usize,
    },
    /// A packed problem was given an unpacked initial state (`Inputs::h0`).
    InitialStateNotPerDocument,
    /// A packed problem was given another number of per-document initial states than documents.
    DocumentStateCount {
        /// The states given.
        got: usize,
        /// The documents `cu_seqlens` lists.
        documents: usize,
    },
    /// A dimension of the short convolution (B, T, C or the kernel size K) is zero.
    ZeroConvDimension {
        /// The dimension's name, e.g. `"K"`.
        name: &'static str,
    },
}

impl fmt::Display for ReferenceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ZeroDimension { name } => write!(
                f,
                "dimension {name} is 0; B, T, H, Dk and Dv must all be at least 1"
            ),
            Self::ShapeMismatch {
                tensor,
                layout,
                expected,
                got,
            } => write!(
                f,
                "{tensor} has shape {got:?} but must be {layout} = {expected:?}; build it from the \
                 same Shape as q, k and v"
            ),
            Self::WrongRank {
                tensor,
                layout,
                got,
            } => write!(
                f,
                "{tensor} has shape {got:?} but must have layout {layout}"
            ),
            Self::DataLength {
                shape,
                expected,
                got,
            } => write!(
                f,
                "a tensor of shape {shape:?} needs {expected} values but the buffer holds {got}"
            ),
            Self::PositiveGate { index, value } => write!(
                f,
                "gate g{index:?} = {value} is positive; gates are log-decays and must be <= 0 \
                 (pass e.g. logsigmoid(x), not the decay factor or its negation)"
            ),
            Self::NonFinite {
                tensor,
                index,
                value,
            } => write!(
                f,
                "{tensor}{index:?} = {value} is not finite; the reference needs finite inputs \
                 (check the generator or the conversion from device memory)"
            ),
            Self::InvalidScale { value } => write!(
                f,
                "scale = {value} is not finite; use a finite scale such as Dk^-1/2"
            ),
            Self::InvalidEpsilon { value } => write!(
                f,
                "eps = {value} must be finite and >= 0; mlstm_kernels uses 1e-6"
            ),
            Self::MissingBeta => write!(
                f,
                "the delta rule needs beta [B, T, H]; set Inputs::beta (InputSpec with \
                 Family::DeltaRule generates it)"
            ),
            Self::ZeroChunk { parameter } => write!(
                f,
                "{parameter} = 0; chunk sizes must be at least 1 (the kernels use chunk 64 and \
                 sub_chunk 16)"
            ),
            Self::NoShards => write!(
                f,
                "no shard lengths given; pass one length per rank, summing to T"
            ),
            Self::ZeroLengthShard { rank } => write!(
                f,
                "shard {rank} has length 0; every rank must own at least one token (drop the rank \
                 or move a token to it)"
            ),
            Self::RankCount {
                what,
                expected,
                got,
            } => write!(
                f,
                "{what} has {got} entries but there are {expected} ranks; pass one per rank"
            ),
            Self::ShardLengthSum { sum, t } => write!(
                f,
                "shard lengths sum to {sum} but the sequence has T = {t} tokens; they must sum to T"
            ),
            Self::CuSeqlensTooShort { len } => write!(
                f,
                "cu_seqlens has {len} entries; it needs at least two, [0, ..., T], one more than \
                 the number of documents"
            ),
            Self::CuSeqlensFirst { first } => write!(
                f,
                "cu_seqlens starts at {first}; the first document starts at token 0"
            ),
            Self::CuSeqlensLast { last, t } => write!(
                f,
                "cu_seqlens ends at {last} but the packed sequence has T = {t} tokens; the last \
                 entry must be T"
            ),
            Self::CuSeqlensNotIncreasing {
                index,
                previous,
                value,
            } => write!(
                f,
                "cu_seqlens[{index}] = {value} does not exceed the entry before it ({previous}); \
                 offsets must be strictly increasing (drop empty documents)"
            ),
            Self::InitialStateNotPerDocument => write!(
                f,
                "packed inputs take one initial state per document in PackedInputs::h0 \
                 [B, N, H, Dk, Dv]; leave Inputs::h0 unset"
            ),
            Self::DocumentStateCount { got, documents } => write!(
                f,
                "{got} per-document initial states for {documents} documents; give one per \
                 document of cu_seqlens, or none"
            ),
            Self::ZeroConvDimension { name } => write!(
                f,
                "short convolution dimension {name} is 0; B, T, C and the kernel size K must all \
                 be at least 1"
            ),
        }
    }
}

impl std::error::Error for ReferenceError {}
