//! The header's ABI version, codes and the structs a caller fills, laid out as `lasp_shmem.h`
//! declares them (core/tests/c_abi.rs compiles the header and compares sizes, offsets and
//! values).

use crate::rendezvous::ID_BYTES;
use std::ffi::c_char;

/// `LASP_SHMEM_ABI_VERSION`: bumped whenever a struct or a signature of the header changes.
pub const ABI_VERSION: u32 = 3;

/// `LASP_FAMILY_*`.
pub const LASP_FAMILY_SCALAR_DECAY: i32 = 1;
pub const LASP_FAMILY_GLA: i32 = 2;
pub const LASP_FAMILY_GATED_DELTA: i32 = 3;
pub const LASP_FAMILY_MLSTM: i32 = 4;

/// `LASP_KIND_*`.
pub const LASP_KIND_SINGLE_GPU: i32 = 1;
pub const LASP_KIND_LASP2: i32 = 2;

/// `LASP_SCHEDULE_*`.
pub const LASP_SCHEDULE_AUTO: i32 = 0;
pub const LASP_SCHEDULE_ALL_GATHER: i32 = 1;
pub const LASP_SCHEDULE_PIPELINED_CHAIN: i32 = 2;

/// `LASP_MODE_*`.
pub const LASP_MODE_OVERLAPPED: i32 = 0;
pub const LASP_MODE_SEQUENTIAL_NCCL: i32 = 1;
pub const LASP_MODE_SEQUENTIAL_NVSHMEM: i32 = 2;
pub const LASP_MODE_NO_COMM: i32 = 3;
pub const LASP_MODE_PIPELINED_CHAIN: i32 = 4;

/// `LASP_OP_WITH_BACKWARD`: the descriptor's only flag.
pub const LASP_OP_WITH_BACKWARD: u64 = 1;

/// `LASP_DIRECTION_*` of `lasp_op_check_call`.
pub const LASP_DIRECTION_FORWARD: i32 = 0;
pub const LASP_DIRECTION_BACKWARD: i32 = 1;

/// `LASP_SLOT_CAPACITY`: entries of `lasp_tensors.slot`.
pub const SLOT_CAPACITY: usize = 32;

/// `LASP_SLOT_*`: where a call's tensor sits in `lasp_tensors.slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Slot {
    Q = 0,
    K = 1,
    V = 2,
    G = 3,
    Beta = 4,
    H0 = 5,
    O = 6,
    Ht = 7,
    StartState = 8,
    DO = 9,
    Dht = 10,
    Dq = 11,
    Dk = 12,
    Dv = 13,
    Dg = 14,
    Dbeta = 15,
    Dh0 = 16,
    CuSeqlens = 17,
    ChunkStates = 18,
    IGate = 19,
    DIGate = 20,
    SavedRows = 21,
    ExitState = 22,
    DocumentHt = 23,
}

impl Slot {
    /// Every slot this build knows, by index (`LASP_SLOT_COUNT` of them).
    pub const ALL: [Slot; 24] = [
        Slot::Q,
        Slot::K,
        Slot::V,
        Slot::G,
        Slot::Beta,
        Slot::H0,
        Slot::O,
        Slot::Ht,
        Slot::StartState,
        Slot::DO,
        Slot::Dht,
        Slot::Dq,
        Slot::Dk,
        Slot::Dv,
        Slot::Dg,
        Slot::Dbeta,
        Slot::Dh0,
        Slot::CuSeqlens,
        Slot::ChunkStates,
        Slot::IGate,
        Slot::DIGate,
        Slot::SavedRows,
        Slot::ExitState,
        Slot::DocumentHt,
    ];

    /// The header's name, which messages use.
    pub fn name(self) -> &'static str {
        match self {
            Slot::Q => "LASP_SLOT_Q",
            Slot::K => "LASP_SLOT_K",
            Slot::V => "LASP_SLOT_V",
            Slot::G => "LASP_SLOT_G",
            Slot::Beta => "LASP_SLOT_BETA",
            Slot::H0 => "LASP_SLOT_H0",
            Slot::O => "LASP_SLOT_O",
            Slot::Ht => "LASP_SLOT_HT",
            Slot::StartState => "LASP_SLOT_START_STATE",
            Slot::DO => "LASP_SLOT_DO",
            Slot::Dht => "LASP_SLOT_DHT",
            Slot::Dq => "LASP_SLOT_DQ",
            Slot::Dk => "LASP_SLOT_DK",
            Slot::Dv => "LASP_SLOT_DV",
            Slot::Dg => "LASP_SLOT_DG",
            Slot::Dbeta => "LASP_SLOT_DBETA",
            Slot::Dh0 => "LASP_SLOT_DH0",
            Slot::CuSeqlens => "LASP_SLOT_CU_SEQLENS",
            Slot::ChunkStates => "LASP_SLOT_CHUNK_STATES",
            Slot::IGate => "LASP_SLOT_I_GATE",
            Slot::DIGate => "LASP_SLOT_DI_GATE",
            Slot::SavedRows => "LASP_SLOT_SAVED_ROWS",
            Slot::ExitState => "LASP_SLOT_EXIT_STATE",
            Slot::DocumentHt => "LASP_SLOT_DOCUMENT_HT",
        }
    }
}

/// `LASP_DTYPE_*`: a tensor's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bf16 = 1,
    F16 = 2,
    F32 = 3,
    I32 = 4,
    I64 = 5,
}

impl Dtype {
    /// Every element type this build knows.
    pub const ALL: [Dtype; 5] = [Dtype::Bf16, Dtype::F16, Dtype::F32, Dtype::I32, Dtype::I64];

    /// The type of a `lasp_tensor.dtype` code, if it is one.
    pub fn from_code(code: i32) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| *d as i32 == code)
    }

    /// The header's name, which messages use.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "LASP_DTYPE_BF16",
            Dtype::F16 => "LASP_DTYPE_F16",
            Dtype::F32 => "LASP_DTYPE_F32",
            Dtype::I32 => "LASP_DTYPE_I32",
            Dtype::I64 => "LASP_DTYPE_I64",
        }
    }

    /// The element type as a layout comment names it ("bf16").
    pub fn short_name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "fp16",
            Dtype::F32 => "fp32",
            Dtype::I32 => "int32",
            Dtype::I64 => "int64",
        }
    }

    /// How a PyTorch caller converts a tensor to this type.
    pub fn torch_conversion(self) -> &'static str {
        match self {
            Dtype::Bf16 => ".bfloat16()",
            Dtype::F16 => ".half()",
            Dtype::F32 => ".float()",
            Dtype::I32 => ".int()",
            Dtype::I64 => ".long()",
        }
    }

    /// Bytes of one element.
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::I64 => 8,
        }
    }
}

/// A struct of the header that begins with `uint32_t struct_size`.
///
/// # Safety
/// The implementor is `#[repr(C)]` and its first field is a `u32` holding `struct_size`.
pub unsafe trait SizedStruct {
    /// The header's name of the struct, which messages use.
    const C_NAME: &'static str;
}

/// `lasp_runtime_options`.
#[repr(C)]
#[derive(Debug)]
pub struct RuntimeOptions {
    /// `sizeof(lasp_runtime_options)` of the caller's header.
    pub struct_size: u32,
    /// `LASP_SHMEM_ABI_VERSION` of the header the caller was compiled with.
    pub abi_version: u32,
    /// Symmetric memory the program will allocate (0: 256 MiB); see
    /// [`lasp_op_symmetric_bytes`].
    ///
    /// [`lasp_op_symmetric_bytes`]: super::lasp_op_symmetric_bytes
    pub symmetric_heap_bytes: u64,
    /// Bound on every wait on another GPU (0: `LASP_WAIT_TIMEOUT_MS`, else 10 s).
    pub wait_timeout_ms: u64,
    /// An explicit `libnvshmem_host.so.3` (NULL: `NVSHMEM_HOME`, else the usual places).
    pub nvshmem_library: *const c_char,
}

// SAFETY: #[repr(C)], struct_size first.
unsafe impl SizedStruct for RuntimeOptions {
    const C_NAME: &'static str = "lasp_runtime_options";
}

/// `lasp_place`: this process's place in the job, as torchrun's variables give it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Place {
    pub rank: i32,
    pub world_size: i32,
    /// Selects the GPU (the ordinal among the visible GPUs).
    pub local_rank: i32,
    pub local_world_size: i32,
}

/// `lasp_unique_id`: NVSHMEM's bootstrap id, plain bytes to broadcast.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct UniqueId {
    pub bytes: [u8; ID_BYTES],
}

/// `lasp_op_desc`: what an operation is, fixed at creation.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct OpDesc {
    pub struct_size: u32,
    pub abi_version: u32,
    /// `LASP_FAMILY_*`.
    pub family: i32,
    /// `LASP_KIND_*`.
    pub kind: i32,
    /// `LASP_SCHEDULE_*` (LASP-2; 0 on one GPU).
    pub schedule: i32,
    /// `LASP_MODE_*` (LASP-2; 0 on one GPU).
    pub mode: i32,
    pub batch: i64,
    pub heads: i64,
    pub dk: i64,
    pub dv: i64,
    /// T of every call, or 0: given per call.
    pub tokens: i64,
    /// `LASP_OP_*`.
    pub flags: u64,
    pub reserved: [u64; 8],
}

// SAFETY: #[repr(C)], struct_size first.
unsafe impl SizedStruct for OpDesc {
    const C_NAME: &'static str = "lasp_op_desc";
}

impl Default for OpDesc {
    /// This build's `struct_size` and ABI version, every other field 0.
    fn default() -> Self {
        OpDesc {
            struct_size: std::mem::size_of::<OpDesc>() as u32,
            abi_version: ABI_VERSION,
            family: 0,
            kind: 0,
            schedule: 0,
            mode: 0,
            batch: 0,
            heads: 0,
            dk: 0,
            dv: 0,
            tokens: 0,
            flags: 0,
            reserved: [0; 8],
        }
    }
}

/// `lasp_call`: one call's scalars.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub struct_size: u32,
    /// `sigma` in `o_t = sigma q_t S_t`; 0 for `Dk^-1/2`.
    pub scale: f32,
    /// This call's tokens per sequence (LASP-2: this rank's shard); 0: the descriptor's.
    pub tokens: i64,
    /// With `LASP_SLOT_CU_SEQLENS`: the packed sequence's index of this call's first token (the
    /// sum of the earlier ranks' tokens); 0 otherwise.
    pub shard_start: i64,
    pub reserved: [u64; 5],
}

// SAFETY: #[repr(C)], struct_size first.
unsafe impl SizedStruct for Call {
    const C_NAME: &'static str = "lasp_call";
}

impl Default for Call {
    /// This build's `struct_size`, every other field 0.
    fn default() -> Self {
        Call {
            struct_size: std::mem::size_of::<Call>() as u32,
            scale: 0.0,
            tokens: 0,
            shard_start: 0,
            reserved: [0; 5],
        }
    }
}

/// `lasp_tensor`: a device address, its element count and type; all zero when empty.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Tensor {
    pub data: u64,
    pub numel: i64,
    /// `LASP_DTYPE_*`.
    pub dtype: i32,
    pub reserved: i32,
}

/// `lasp_tensors`: one call's tensors, indexed by `LASP_SLOT_*`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Tensors {
    pub struct_size: u32,
    pub reserved: u32,
    pub slot: [Tensor; SLOT_CAPACITY],
}

// SAFETY: #[repr(C)], struct_size first.
unsafe impl SizedStruct for Tensors {
    const C_NAME: &'static str = "lasp_tensors";
}

impl Default for Tensors {
    /// Every slot empty, with this build's `struct_size`.
    fn default() -> Self {
        Tensors {
            struct_size: std::mem::size_of::<Tensors>() as u32,
            reserved: 0,
            slot: [Tensor::default(); SLOT_CAPACITY],
        }
    }
}
