//! Token id arguments.

use super::convert::{self, PerSeq};

named_arg! {
    /// Token ids (`uint32`): a 1-D integer array or a sequence of ints.
    TokenIds(Vec<u32>) = convert::token_ids
}

named_arg! {
    /// One new token per sequence: one int for all, or one each; `< 0` means none.
    PerSeqTokens(PerSeq) = convert::per_seq_token
}
