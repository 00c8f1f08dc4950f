//! Sequence and LoRA ids.

use pyo3::prelude::*;

use super::{convert, names};

named_arg! {
    /// A sequence id (`[0, 2**63)`); `N` names the parameter (`seq_id` by default).
    SeqId<N = names::SeqId>(u64) = convert::seq_id
}

named_arg! {
    /// The sequence ids of a batch call: a 1-D integer array or a sequence of ints.
    SeqIds<N = names::SeqIds>(Vec<u64>) = convert::seq_ids
}

named_arg! {
    /// A LoRA id (any `uint64`).
    LoraId<N = names::LoraId>(u64) = convert::lora_id
}

/// The operand of `seq_id in manager`: a sequence id, or `None` for any value that
/// cannot name a sequence (membership tests answer `False` rather than raise).
pub(crate) struct SeqKey(pub(crate) Option<u64>);

impl<'a, 'py> FromPyObject<'a, 'py> for SeqKey {
    type Error = PyErr;

    #[inline]
    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(SeqKey(convert::seq_id(&obj, "seq_id").ok()))
    }
}
