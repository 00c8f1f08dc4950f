//! Conversion of Python arguments (ints, lists, 1-D NumPy integer arrays) to Rust values.
//!
//! Every conversion failure is an `InvalidArgumentError` that names the argument and
//! says what was expected, so bad input never surfaces as a bare `TypeError` or
//! `OverflowError` from PyO3.
//!
//! Methods take typed arguments: newtypes implementing `FromPyObject` ([`SeqId`],
//! [`SeqIds`], [`TokenIds`], [`Count`], ...). PyO3 does not tell a conversion which
//! parameter it fills, so a newtype that serves several parameters carries a
//! zero-sized marker from [`names`] whose [`ArgName::NAME`] is the parameter's name
//! (`SeqId<names::ParentId>`), which keeps every message naming its argument.

/// The Python name of the parameter a marker type stands for.
pub(crate) trait ArgName {
    /// The parameter's name, as error messages print it.
    const NAME: &'static str;
}

/// Zero-sized markers naming the parameters that share a newtype.
pub(crate) mod names {
    use super::ArgName;

    macro_rules! arg_names {
        ($($marker:ident = $name:literal,)*) => {$(
            #[doc = concat!("The `", $name, "` parameter.")]
            pub(crate) enum $marker {}

            impl ArgName for $marker {
                const NAME: &'static str = $name;
            }
        )*};
    }

    arg_names! {
        BlockSize = "block_size",
        CheckpointEveryBlocks = "checkpoint_every_blocks",
        Counts = "counts",
        ChildId = "child_id",
        Chunk = "chunk",
        EnablePrefixCaching = "enable_prefix_caching",
        Full = "full",
        Group = "group",
        HashAlgo = "hash_algo",
        HashSeed = "hash_seed",
        HostCacheBlocks = "host_cache_blocks",
        HostOffload = "host_offload",
        LoraId = "lora_id",
        LoraName = "lora_name",
        LoraPath = "lora_path",
        MaxBlocks = "max_blocks",
        MaxLoads = "max_loads",
        MaxRows = "max_rows",
        NewTokenIds = "new_token_ids",
        NumBlocks = "num_blocks",
        NumCpuBlocks = "num_cpu_blocks",
        NumLookaheadTokens = "num_lookahead_tokens",
        NumNewComputedTokens = "num_new_computed_tokens",
        NumNewTokens = "num_new_tokens",
        NumTokens = "num_tokens",
        ParentId = "parent_id",
        Position = "position",
        Positions = "positions",
        Priority = "priority",
        RecordEvents = "record_events",
        RetentionPriority = "retention_priority",
        Rows = "rows",
        SeqId = "seq_id",
        SeqIds = "seq_ids",
        SlidingWindow = "sliding_window",
        TokenIds = "token_ids",
        Watermark = "watermark",
        Window = "window",
    }
}

/// Define a newtype `$ty<N>` over `$value`, converted by `$convert(obj, N::NAME)`.
///
/// (Defined before the `mod` items below: they see it by textual scope.)
macro_rules! named_arg {
    ($(#[$doc:meta])* $ty:ident $(<N = $default:ty>)? ($value:ty) = $convert:path) => {
        $(#[$doc])*
        pub(crate) struct $ty<N: $crate::args::ArgName $(= $default)?>(
            pub(crate) $value,
            ::std::marker::PhantomData<N>,
        );

        impl<'a, 'py, N: $crate::args::ArgName> ::pyo3::FromPyObject<'a, 'py> for $ty<N> {
            type Error = ::pyo3::PyErr;

            #[inline]
            fn extract(obj: ::pyo3::Borrowed<'a, 'py, ::pyo3::PyAny>) -> ::pyo3::PyResult<Self> {
                $convert(&obj, N::NAME).map(|value| $ty(value, ::std::marker::PhantomData))
            }
        }
    };
}

mod convert;
mod hashes;
mod ids;
mod numbers;
mod table;
mod tokens;

pub(crate) use hashes::{BlockHashes, CacheSalt, SlotIds};
pub(crate) use ids::{LoraId, SeqId, SeqIds, SeqKey};
pub(crate) use numbers::{
    Count, Flag, Indices, Parsed, PerSeqCounts, Real, RetentionPriorityArg, Text,
};
pub(crate) use table::{IntTable, RowIndices, WritableTable, WritableTables};
pub(crate) use tokens::{PerSeqTokens, TokenIds};
