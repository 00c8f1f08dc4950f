//! Block moves, the list the engine applies: [`MemoryOp`] and its [`MemoryOpKind`].

/// Kind of a memory op (see [`MemoryOp`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryOpKind {
    /// GPU block -> CPU swap block (`swap_out`).
    SwapOut,
    /// CPU swap block -> GPU block (`swap_in`).
    SwapIn,
    /// GPU block -> GPU block (copy-on-write).
    Copy,
    /// GPU block -> host-tier slot.
    Offload,
    /// Host-tier slot -> GPU block.
    Load,
}

impl MemoryOpKind {
    /// The name used by the Python API and `SchedulerOutput.memory_ops`.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryOpKind::SwapOut => "swap_out",
            MemoryOpKind::SwapIn => "swap_in",
            MemoryOpKind::Copy => "copy",
            MemoryOpKind::Offload => "offload",
            MemoryOpKind::Load => "load",
        }
    }
}

/// One block move, `src -> dst`, in the id spaces its kind names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryOp {
    /// What moves where.
    pub kind: MemoryOpKind,
    /// Source block (GPU id, CPU id or tier slot).
    pub src: i64,
    /// Destination block (GPU id, CPU id or tier slot).
    pub dst: i64,
}
