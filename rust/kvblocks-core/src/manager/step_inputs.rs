//! Model-step inputs: block tables and slot mappings.

use super::{BlockTables, KVCacheManager};
use crate::batch_arg::BatchArg;
use crate::error::Result;

impl KVCacheManager {
    /// The sequence's block table (null entries are released window blocks).
    pub fn block_table(&self, seq_id: u64) -> Result<Vec<i32>> {
        let _ = seq_id;
        todo!()
    }

    /// 2-D block tables padded with the null block to the longest (or `max_blocks`).
    ///
    /// `InvalidArgument` if a table is longer than `max_blocks`.
    pub fn block_tables(&self, seq_ids: &[u64], max_blocks: Option<usize>) -> Result<BlockTables> {
        let _ = (seq_ids, max_blocks);
        todo!()
    }

    /// Cache slots (`block * block_size + offset`) of tokens `[computed, computed + n)`
    /// of each sequence, concatenated; `n` defaults to every known but uncomputed token.
    ///
    /// `InvalidArgument` if a slot would lie beyond the allocated table.
    pub fn slot_mapping(
        &self,
        seq_ids: &[u64],
        num_tokens: Option<BatchArg<'_>>,
    ) -> Result<Vec<i64>> {
        let _ = (seq_ids, num_tokens);
        todo!()
    }
}
