//! Model-step inputs: block tables and slot mappings.

use super::{BlockTables, KVCacheManager};
use crate::batch_arg::BatchArg;
use crate::error::{KvError, Result};
use crate::sequence::Sequence;

impl KVCacheManager {
    /// A resident sequence (tables of swapped ones hold CPU ids: never a step input).
    #[inline]
    fn resident(&self, seq_id: u64, op: &str) -> Result<&Sequence> {
        let seq = self.seq(seq_id)?;
        Self::require_resident(seq, op)?;
        Ok(seq)
    }

    /// Resident sequences of a batch, resolved once (duplicates allowed: read only).
    fn resident_batch(&self, seq_ids: &[u64], op: &str) -> Result<Vec<&Sequence>> {
        seq_ids.iter().map(|&id| self.resident(id, op)).collect()
    }

    /// The sequence's block table of group 0 (null entries are released window blocks).
    pub fn block_table(&self, seq_id: u64) -> Result<Vec<i32>> {
        self.group_block_table(seq_id, 0)
    }

    /// The sequence's block table of `group` (null entries: blocks no future query of the
    /// group sees). `InvalidArgument` for a group out of range.
    pub fn group_block_table(&self, seq_id: u64, group: usize) -> Result<Vec<i32>> {
        self.check_group(group)?;
        let seq = self.resident(seq_id, "block_table")?;
        Ok(seq.tables[group].blocks.iter().map(|&b| b as i32).collect())
    }

    /// 2-D block tables of group 0 padded with the null block to the longest (or
    /// `max_blocks`); see [`KVCacheManager::group_block_tables`].
    pub fn block_tables(&self, seq_ids: &[u64], max_blocks: Option<usize>) -> Result<BlockTables> {
        self.group_block_tables(seq_ids, max_blocks, Some(0))
    }

    /// Block tables of `group` (`None`: of every group, one matrix after the other),
    /// padded with the null block to the longest table (or `max_blocks`): every group's
    /// tables of a sequence have the same length, so the matrices have the same shape.
    ///
    /// `InvalidArgument` for a group out of range, if a table is longer than
    /// `max_blocks`, if `max_blocks` exceeds both `num_blocks` and the longest table (no
    /// table can use more columns), or if the matrices cannot be allocated.
    pub fn group_block_tables(
        &self,
        seq_ids: &[u64],
        max_blocks: Option<usize>,
        group: Option<usize>,
    ) -> Result<BlockTables> {
        let groups = match group {
            Some(g) => {
                self.check_group(g)?;
                g..g + 1
            }
            None => 0..self.pools.groups.len(),
        };
        let seqs = self.resident_batch(seq_ids, "block_tables")?;
        let longest = seqs.iter().map(|s| s.table_len()).max().unwrap_or(0);
        // Released window entries can make a table longer than the pool.
        let widest = longest.max(self.config.num_blocks);
        let cols = match max_blocks {
            None => longest,
            Some(m) if m < longest => {
                return Err(KvError::InvalidArgument(format!(
                    "max_blocks is {m} but a block table has {longest} blocks; expected \
                     max_blocks >= the longest table"
                )))
            }
            Some(m) if m > widest => {
                return Err(KvError::InvalidArgument(format!(
                    "max_blocks is {m}; expected at most {widest} (num_blocks, or the longest \
                     table if longer)"
                )))
            }
            Some(m) => m,
        };
        let rows = seq_ids.len();
        let too_large = || {
            KvError::InvalidArgument(format!(
                "block tables of {} x {rows} x {cols} are too large",
                groups.len()
            ))
        };
        let len = rows
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(groups.len()))
            .ok_or_else(too_large)?;
        let mut data = Vec::new();
        data.try_reserve_exact(len).map_err(|_| too_large())?;
        // Row by row, each written once: the table, then its null padding.
        for g in groups.clone() {
            for seq in &seqs {
                let table = &seq.tables[g].blocks;
                data.extend(table.iter().map(|&b| b as i32));
                data.resize(data.len() + cols - table.len(), crate::NULL_BLOCK as i32);
            }
        }
        debug_assert_eq!(data.len(), len);
        Ok(BlockTables {
            data,
            num_groups: groups.len(),
            num_rows: rows,
            num_cols: cols,
        })
    }

    /// Cache slots of group 0; see [`KVCacheManager::group_slot_mapping`].
    pub fn slot_mapping(
        &self,
        seq_ids: &[u64],
        num_tokens: Option<BatchArg<'_>>,
    ) -> Result<Vec<i64>> {
        self.group_slot_mapping(seq_ids, num_tokens, Some(0))
    }

    /// Cache slots (`block * block_size + offset`) of tokens `[computed, computed + n)`
    /// of each sequence in the tables of `group` (`None`: of every group, one mapping
    /// after the other, each of the same length), concatenated; `n` defaults to every
    /// known but uncomputed token.
    ///
    /// Only slots reserved by the pending `allocate_slots` (computed + new + lookahead)
    /// can be mapped: those are the slots no other sequence can read or write. Mapping
    /// past them (or with no pending reservation) is `SequenceState`; a group out of
    /// range is `InvalidArgument`.
    pub fn group_slot_mapping(
        &self,
        seq_ids: &[u64],
        num_tokens: Option<BatchArg<'_>>,
        group: Option<usize>,
    ) -> Result<Vec<i64>> {
        let groups = match group {
            Some(g) => {
                self.check_group(g)?;
                g..g + 1
            }
            None => 0..self.pools.groups.len(),
        };
        if let Some(n) = &num_tokens {
            n.check_len(seq_ids.len(), "num_tokens")?;
        }
        let bs = self.config.block_size;
        let seqs = self.resident_batch(seq_ids, "slot_mapping")?;
        let mut total = 0usize;
        for (i, seq) in seqs.iter().enumerate() {
            let id = seq.id;
            let n = match &num_tokens {
                Some(arg) => Self::count_arg(arg.get(i), "num_tokens")?,
                None => seq.tokens.len() - seq.num_computed,
            };
            let reserved = seq.reserved.unwrap_or(seq.num_computed);
            if seq
                .num_computed
                .checked_add(n)
                .is_none_or(|end| end > reserved)
            {
                return Err(KvError::SequenceState(format!(
                    "slot_mapping: sequence {id} has {} computed tokens and {} reserved slots, \
                     so at most {} tokens can be mapped, got {n}; call allocate_slots for the \
                     tokens of this step first",
                    seq.num_computed,
                    reserved,
                    reserved - seq.num_computed
                )));
            }
            total += n;
        }
        let mut out = Vec::with_capacity(total * groups.len());
        for g in groups {
            for (i, seq) in seqs.iter().enumerate() {
                let n = match &num_tokens {
                    Some(arg) => arg.get(i) as usize,
                    None => seq.tokens.len() - seq.num_computed,
                };
                let table = &seq.tables[g].blocks;
                let (start, end) = (seq.num_computed, seq.num_computed + n);
                let mut pos = start;
                while pos < end {
                    let block = table[pos / bs] as i64;
                    let off = pos % bs;
                    let run = (bs - off).min(end - pos);
                    let base = block * bs as i64 + off as i64;
                    out.extend((0..run as i64).map(|k| base + k));
                    pos += run;
                }
            }
        }
        Ok(out)
    }
}
