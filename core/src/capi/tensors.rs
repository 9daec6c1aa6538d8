//! One call's tensors (`lasp_tensors`), checked once for every family: against the slots the
//! family declares for the direction ([`plan_call`], no GPU needed), then against the driver's
//! record of this GPU's allocations ([`CallPlan::check_device`]), and handed to the family as
//! views it takes by slot ([`CheckedCall`]).

use super::abi::{Call, Dtype, Slot, Tensor, Tensors, SLOT_CAPACITY};
use super::args::{check_reserved, invalid, this_library};
use super::families::Direction;
use super::memory;
use super::spec::{Kind, OpSpec};
use crate::error::Result;
use crate::ops::documents::{DocumentOffsets, Documents};
use crate::ops::gla::{chunk_states_len, CHUNK_STATES_LAYOUT};
use crate::ops::scalar_decay::ForwardShape;
use crate::ops::{bf16, DeviceMut, DeviceRef};
use std::marker::PhantomData;

/// The shape of a slot's tensor, in the call's dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Layout {
    /// `[B, T, H, Dk]`: q, k and their gradients.
    Qk,
    /// `[B, T, H, Dv]`: v, o and their gradients.
    V,
    /// `[B, T, H]`: scalar gates and their gradients.
    Gates,
    /// `[B, T, H, Dk]`: gates per key dimension (GLA).
    KeyGates,
    /// `[B, H, Dk, Dv]`: states and their gradients.
    State,
    /// `[B*H, ceil(T / 64), Dk, Dv]`: the state entering every chunk of 64 tokens, which GLA's
    /// forward saves for its backward.
    ChunkStates,
    /// An mLSTM state, `C [B, H, Dk, Dv]`, `n [B, H, Dk]` and `m [B, H]` back to back.
    MlstmState,
    /// `[2, B, T, H]`: the stabiliser and the denominator of every token, which the mLSTM
    /// forward saves for its backward.
    SavedRows,
    /// fla's `cu_seqlens` of a packed sequence, int32 or int64, at least 2 entries (more than
    /// the documents need where the buffer has room for others, padded with the total).
    Offsets,
    /// `[B, N, H, Dk, Dv]`: one state per packed document, N the entries of the call's
    /// `cu_seqlens` less one.
    DocumentStates,
    /// One mLSTM state per packed document: `C [B, N, H, Dk, Dv]`, `n [B, N, H, Dk]` and
    /// `m [B, N, H]` back to back.
    MlstmDocumentStates,
}

impl Layout {
    /// One state per packed document: its count depends on the offsets'.
    fn is_per_document(self) -> bool {
        matches!(self, Layout::DocumentStates | Layout::MlstmDocumentStates)
    }

    fn dims(self) -> &'static str {
        match self {
            Layout::Qk => "[B, T, H, Dk]",
            Layout::V => "[B, T, H, Dv]",
            Layout::Gates => "[B, T, H]",
            Layout::KeyGates => "[B, T, H, Dk]",
            Layout::State => "[B, H, Dk, Dv]",
            Layout::ChunkStates => CHUNK_STATES_LAYOUT,
            Layout::MlstmState => "[B, H, Dk, Dv] + [B, H, Dk] + [B, H]",
            Layout::SavedRows => "[2, B, T, H]",
            Layout::Offsets => "[N + 1] int32 or int64",
            Layout::DocumentStates => "[B, N, H, Dk, Dv] (N + 1 = LASP_SLOT_CU_SEQLENS's numel)",
            Layout::MlstmDocumentStates => {
                "[B, N, H, Dk, Dv] + [B, N, H, Dk] + [B, N, H] (N + 1 = LASP_SLOT_CU_SEQLENS's numel)"
            }
        }
    }

    /// Elements of the layout (the shape is validated, so the products do not overflow).
    fn numel(self, s: &ForwardShape) -> usize {
        match self {
            Layout::Qk | Layout::KeyGates => s.qk_len(),
            Layout::V => s.v_len(),
            Layout::Gates => s.gate_len(),
            Layout::State => s.state_len(),
            Layout::ChunkStates => chunk_states_len(s),
            Layout::MlstmState => s.state_len() + s.b * s.h * (s.dk + 1),
            Layout::SavedRows => 2 * s.gate_len(),
            Layout::Offsets | Layout::DocumentStates | Layout::MlstmDocumentStates => {
                unreachable!("the documents' tensors have no element count of the shape's")
            }
        }
    }
}

/// Whether a call reads or writes a slot, and whether the slot may be empty.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Role {
    Input,
    /// Empty stands for zero.
    OptionalInput,
    Output,
    /// Empty: not wanted.
    OptionalOutput,
}

/// One slot a family's call uses.
#[derive(Clone, Copy, Debug)]
pub(super) struct SlotUse {
    pub(super) slot: Slot,
    pub(super) dtype: Dtype,
    pub(super) layout: Layout,
    pub(super) role: Role,
}

impl SlotUse {
    pub(super) const fn new(slot: Slot, role: Role, dtype: Dtype, layout: Layout) -> SlotUse {
        SlotUse {
            slot,
            dtype,
            layout,
            role,
        }
    }

    fn required(&self) -> bool {
        matches!(self.role, Role::Input | Role::Output)
    }

    /// "[B, T, H, Dk] bf16".
    fn describe(&self) -> String {
        match self.layout {
            Layout::Offsets => self.layout.dims().to_string(),
            _ => format!("{} {}", self.layout.dims(), self.dtype.short_name()),
        }
    }

    /// Whether a tensor of `dtype` fills the slot: its own dtype, or either integer width for
    /// offsets.
    fn takes(&self, dtype: Dtype) -> bool {
        match self.layout {
            Layout::Offsets => matches!(dtype, Dtype::I32 | Dtype::I64),
            _ => dtype == self.dtype,
        }
    }
}

/// How messages name an operation: "lasp_op_forward of scalar decay (LASP-2)".
fn operation(spec: &OpSpec, direction: Direction) -> String {
    let kind = match spec.kind {
        Kind::SingleGpu => "one GPU",
        Kind::Lasp2 { .. } => "LASP-2",
    };
    format!(
        "{} of {} ({kind})",
        direction.entry_point(),
        spec.family.name()
    )
}

/// A given tensor, checked against its slot's use and the call's shape.
#[derive(Clone, Copy, Debug)]
struct SlotTensor {
    addr: u64,
    numel: usize,
    /// The tensor's own element type (one of the use's, [`SlotUse::takes`]).
    dtype: Dtype,
    use_: SlotUse,
}

/// One call checked up to the device pointers and the stream.
#[derive(Debug)]
pub(super) struct CallPlan {
    shape: ForwardShape,
    scale: Option<f32>,
    shard_start: usize,
    tensors: Vec<SlotTensor>,
}

/// Checks one call's scalars and tensors against `spec` for `direction`: the slots the family
/// reads are given (or optional) with their dtype and element count, every other slot is empty.
pub(super) fn plan_call(
    spec: &OpSpec,
    direction: Direction,
    call: &Call,
    tensors: &Tensors,
) -> Result<CallPlan> {
    if direction == Direction::Backward && !spec.with_backward {
        return Err(invalid(
            "lasp_op_backward: the op was created without LASP_OP_WITH_BACKWARD; create it with \
             that flag in desc.flags (which allocates the backward's resources at creation)"
                .into(),
        ));
    }
    check_reserved("tensors.reserved", &[tensors.reserved])?;
    let (shape, scale) = spec.call_shape(call)?;
    let uses = spec.family.slots(spec, direction);
    let mut given = Vec::with_capacity(uses.len());
    for (index, tensor) in tensors.slot.iter().enumerate() {
        let Some(&slot) = Slot::ALL.get(index) else {
            if *tensor != Tensor::default() {
                return Err(invalid(format!(
                    "tensors.slot[{index}] is filled but {} knows slots 0 to {} \
                     (LASP_SLOT_COUNT = {}); leave the slots from LASP_SLOT_COUNT on empty, or \
                     load the library of the header that defines slot {index}",
                    this_library(),
                    Slot::ALL.len() - 1,
                    Slot::ALL.len()
                )));
            }
            continue;
        };
        let use_ = uses.iter().find(|u| u.slot == slot);
        if *tensor == Tensor::default() {
            match use_ {
                Some(u) if u.required() => {
                    return Err(invalid(format!(
                        "{} is empty but {} needs it: {}",
                        slot.name(),
                        operation(spec, direction),
                        u.describe()
                    )))
                }
                _ => continue,
            }
        }
        let Some(&use_) = use_ else {
            let other = direction.other();
            let elsewhere = if spec
                .family
                .slots(spec, other)
                .iter()
                .any(|u| u.slot == slot)
            {
                format!(" ({} reads it)", other.entry_point())
            } else {
                String::new()
            };
            return Err(invalid(format!(
                "{} is filled but {} does not use it{elsewhere}; leave it empty (all zero)",
                slot.name(),
                operation(spec, direction)
            )));
        };
        given.push(slot_tensor(slot, tensor, use_, &shape)?);
    }
    let offsets = given
        .iter()
        .find(|t| t.use_.slot == Slot::CuSeqlens)
        .map(|t| t.numel);
    check_document_states(&given, offsets, &shape)?;
    let documents = offsets.is_some();
    let shard_start = match usize::try_from(call.shard_start) {
        Ok(0) => 0,
        Ok(start) if documents => start,
        _ => {
            return Err(invalid(format!(
                "call.shard_start is {} but {}; set it to the packed sequence's index of this \
                 call's first token with LASP_SLOT_CU_SEQLENS, else to 0",
                call.shard_start,
                if documents {
                    "an index is at least 0"
                } else {
                    "LASP_SLOT_CU_SEQLENS is empty (no packed documents)"
                }
            )))
        }
    };
    Ok(CallPlan {
        shape,
        scale,
        shard_start,
        tensors: given,
    })
}

/// The per-document states a call gives (`Layout::DocumentStates`,
/// `Layout::MlstmDocumentStates`): only with `LASP_SLOT_CU_SEQLENS` (`offsets` entries), one
/// state per document.
fn check_document_states(
    given: &[SlotTensor],
    offsets: Option<usize>,
    shape: &ForwardShape,
) -> Result<()> {
    for t in given.iter().filter(|t| t.use_.layout.is_per_document()) {
        let name = t.use_.slot.name();
        let Some(offsets) = offsets else {
            return Err(invalid(format!(
                "{name} is filled but LASP_SLOT_CU_SEQLENS is empty: per-document states need \
                 packed documents; leave {name} empty, or give the documents' cu_seqlens"
            )));
        };
        let ForwardShape { b, h, dk, dv, .. } = *shape;
        let per_state = match t.use_.layout {
            Layout::MlstmDocumentStates => dk * dv + dk + 1,
            _ => dk * dv,
        };
        let want = b * (offsets - 1) * h * per_state;
        if t.numel != want {
            return Err(invalid(format!(
                "{name} has {} elements but {} with B={b}, N={} (the entries of \
                 LASP_SLOT_CU_SEQLENS less one), H={h}, Dk={dk}, Dv={dv} needs {want}; give one \
                 state per entry of cu_seqlens but the last (padding entries too)",
                t.numel,
                t.use_.layout.dims(),
                offsets - 1
            )));
        }
    }
    Ok(())
}

/// A filled slot checked against its use and the call's shape.
fn slot_tensor(
    slot: Slot,
    tensor: &Tensor,
    use_: SlotUse,
    shape: &ForwardShape,
) -> Result<SlotTensor> {
    let name = slot.name();
    if tensor.data == 0 {
        return Err(invalid(format!(
            "{name} has data 0 but numel {} and dtype {}; set data to the tensor's device \
             address (torch: tensor.data_ptr()), or clear the whole slot to leave it empty",
            tensor.numel, tensor.dtype
        )));
    }
    check_reserved(&format!("{name}.reserved"), &[tensor.reserved as u32])?;
    let Some(dtype) = Dtype::from_code(tensor.dtype) else {
        return Err(invalid(format!(
            "{name} has dtype {}, not a LASP_DTYPE_* value; it must be {} ({})",
            tensor.dtype,
            use_.dtype.name(),
            use_.describe()
        )));
    };
    if !use_.takes(dtype) {
        return Err(invalid(format!(
            "{name} is {} but must be {} ({}); convert the tensor (torch: {})",
            dtype.name(),
            use_.dtype.name(),
            use_.describe(),
            use_.dtype.torch_conversion()
        )));
    }
    if use_.layout.is_per_document() {
        // Its count depends on the offsets': check_document_states, once every slot is read.
        return Ok(SlotTensor {
            addr: tensor.data,
            numel: usize::try_from(tensor.numel).unwrap_or(usize::MAX),
            dtype,
            use_,
        });
    }
    if use_.layout == Layout::Offsets {
        return match usize::try_from(tensor.numel) {
            Ok(numel) if numel >= 2 => Ok(SlotTensor {
                addr: tensor.data,
                numel,
                dtype,
                use_,
            }),
            _ => Err(invalid(format!(
                "{name} has {} elements; fla's cu_seqlens [0, l_1, ..., total] has at least 2",
                tensor.numel
            ))),
        };
    }
    let want = use_.layout.numel(shape);
    let ForwardShape { b, t, h, dk, dv } = *shape;
    if usize::try_from(tensor.numel) != Ok(want) {
        return Err(invalid(format!(
            "{name} has {} elements but {} with B={b}, T={t}, H={h}, Dk={dk}, Dv={dv} needs \
             {want}; pass the tensor's numel and check the call's tokens (call.tokens, else \
             desc.tokens) and the descriptor's dimensions against it",
            tensor.numel,
            use_.layout.dims()
        )));
    }
    Ok(SlotTensor {
        addr: tensor.data,
        numel: want,
        dtype,
        use_,
    })
}

impl CallPlan {
    /// Checks every given tensor against the driver's record of device `ordinal`'s allocations
    /// (see [`memory::check_device_range`]) and hands the views out.
    ///
    /// # Safety
    /// The tensors' memory stays valid for `'a`, and the outputs are neither read nor written by
    /// anything else meanwhile (the ABI's contract: until the enqueued kernels complete).
    pub(super) unsafe fn check_device<'a>(self, ordinal: usize) -> Result<CheckedCall<'a>> {
        let mut tensors = [None; Slot::ALL.len()];
        for t in self.tensors {
            let bytes = t.numel as u64 * t.dtype.bytes();
            let (name, what) = (t.use_.slot.name(), t.use_.describe());
            memory::check_device_range(name, &what, t.addr, bytes, ordinal)?;
            tensors[t.use_.slot as usize] = Some(t);
        }
        Ok(CheckedCall {
            shape: self.shape,
            scale: self.scale,
            shard_start: self.shard_start,
            tensors,
            memory: PhantomData,
        })
    }
}

/// The element type of a view, tied to its slot's dtype.
pub(super) trait Element {
    const DTYPE: Dtype;
}

impl Element for bf16 {
    const DTYPE: Dtype = Dtype::Bf16;
}

impl Element for f32 {
    const DTYPE: Dtype = Dtype::F32;
}

/// A call whose tensors passed every check: device memory of this GPU, as long as the shape
/// says, of the dtype the family declared. The family takes each view once, by slot; asking for a
/// slot it did not declare, or for a declared one with another element type, is a bug of ours
/// (a panic, which the entry point reports as `LASP_ERROR_INTERNAL`).
#[derive(Debug)]
pub(super) struct CheckedCall<'a> {
    pub(super) shape: ForwardShape,
    /// `None`: `Dk^-1/2`.
    pub(super) scale: Option<f32>,
    /// `call.shard_start`: 0 unless the call names packed documents.
    shard_start: usize,
    tensors: [Option<SlotTensor>; Slot::ALL.len()],
    memory: PhantomData<&'a ()>,
}

impl<'a> CheckedCall<'a> {
    /// The same call once more, for the planner, which makes it several times in turn: each
    /// call's views live only while it is enqueued, so no two views of one tensor coexist.
    pub(super) fn again(&self) -> CheckedCall<'a> {
        CheckedCall {
            shape: self.shape,
            scale: self.scale,
            shard_start: self.shard_start,
            tensors: self.tensors,
            memory: PhantomData,
        }
    }

    /// Whether `slot` holds a tensor (not yet taken).
    pub(super) fn is_given(&self, slot: Slot) -> bool {
        self.tensors[slot as usize].is_some()
    }

    /// The packed documents the call names (`LASP_SLOT_CU_SEQLENS` and `call.shard_start`),
    /// taken once; `None` where the slot is empty.
    pub(super) fn documents(&mut self) -> Option<Documents<'a>> {
        let t = self.tensors[Slot::CuSeqlens as usize].take()?;
        // SAFETY: device memory of this GPU holding `numel` elements of the dtype (checked by
        // `check_device`); valid for 'a, the constructor's contract.
        let cu_seqlens = unsafe {
            match t.dtype {
                Dtype::I64 => DocumentOffsets::I64(DeviceRef::from_raw(t.addr, t.numel)),
                _ => DocumentOffsets::I32(DeviceRef::from_raw(t.addr, t.numel)),
            }
        };
        Some(Documents {
            cu_seqlens,
            shard_start: self.shard_start,
        })
    }

    /// Points input `slot` at `addr` instead, with the same element count and type.
    ///
    /// # Safety
    /// `addr` is device memory of this GPU holding as many elements of the slot's type, valid
    /// and unwritten for `'a` (until the call's kernels complete).
    pub(super) unsafe fn redirect_input(&mut self, slot: Slot, addr: u64) {
        let t = self.tensors[slot as usize]
            .as_mut()
            .unwrap_or_else(|| panic!("{} is not given", slot.name()));
        assert!(
            matches!(t.use_.role, Role::Input | Role::OptionalInput),
            "{} is not an input",
            slot.name()
        );
        t.addr = addr;
    }

    /// Output `slot` a second time, after the view that [`CheckedCall::output`] gave was dropped
    /// (a wrapper writes it after the family's kernels, in stream order); `None` where empty.
    ///
    /// # Safety
    /// No other view of the slot is alive.
    pub(super) unsafe fn output_again<T: Element>(&self, slot: Slot) -> Option<DeviceMut<'a, T>> {
        let t = self.tensors[slot as usize].as_ref()?;
        assert_eq!(
            t.use_.dtype,
            T::DTYPE,
            "{} is declared with another element type",
            slot.name()
        );
        // SAFETY: as in `optional_output`; the caller's contract keeps this the only view.
        Some(unsafe { DeviceMut::from_raw(t.addr, t.numel) })
    }

    /// The address and element count of a slot's tensor, once.
    fn take<T: Element>(&mut self, slot: Slot) -> Option<(u64, usize)> {
        let t = self.tensors[slot as usize].take()?;
        assert_eq!(
            t.use_.dtype,
            T::DTYPE,
            "{} is declared with another element type",
            slot.name()
        );
        Some((t.addr, t.numel))
    }

    /// A slot declared [`Role::OptionalInput`]: `None` where empty.
    pub(super) fn optional_input<T: Element>(&mut self, slot: Slot) -> Option<DeviceRef<'a, T>> {
        let (addr, numel) = self.take::<T>(slot)?;
        // SAFETY: device memory of this GPU holding `numel` elements of T (checked by
        // `check_device` against the driver and the dtype); valid for 'a, the constructor's
        // contract.
        Some(unsafe { DeviceRef::from_raw(addr, numel) })
    }

    /// A slot declared [`Role::Input`], which the checks made sure is given.
    pub(super) fn input<T: Element>(&mut self, slot: Slot) -> DeviceRef<'a, T> {
        self.optional_input(slot)
            .unwrap_or_else(|| panic!("{} is not a required input", slot.name()))
    }

    /// A slot declared [`Role::OptionalOutput`]: `None` where empty.
    pub(super) fn optional_output<T: Element>(&mut self, slot: Slot) -> Option<DeviceMut<'a, T>> {
        let (addr, numel) = self.take::<T>(slot)?;
        // SAFETY: as in `optional_input`; taken once, so this is the only view that writes the
        // memory, and nothing outside the call touches it meanwhile (the constructor's contract).
        Some(unsafe { DeviceMut::from_raw(addr, numel) })
    }

    /// A slot declared [`Role::Output`], which the checks made sure is given.
    pub(super) fn output<T: Element>(&mut self, slot: Slot) -> DeviceMut<'a, T> {
        self.optional_output(slot)
            .unwrap_or_else(|| panic!("{} is not a required output", slot.name()))
    }
}

// The known slots fit in `lasp_tensors`; the capacity beyond them must stay empty.
const _: () = assert!(Slot::ALL.len() <= SLOT_CAPACITY);
