//! Ragged gathers of row prefixes from a dense row-major table.
//!
//! FlashInfer's paged-KV CSR form lists, sequence after sequence, the first
//! `ceil(len / block_size)` entries of each block-table row. With rows of different
//! lengths NumPy can only do this through a boolean mask (one element at a time) or a
//! Python loop over rows; here each row prefix is one `memcpy`.

use crate::error::{KvError, Result};

/// Concatenate `table[rows[i], ..counts[i]]` for every `i` (`rows`: every row in order
/// when `None`).
///
/// `table` is a row-major `[num_rows, num_cols]` matrix, `shape = [num_rows, num_cols]`:
/// the shape is passed, not derived from `table.len()`, because a table without columns
/// still has its rows (each of them empty). Every argument is checked before anything is
/// copied: `table.len()` must be `num_rows * num_cols`, each row must exist, each count may
/// not exceed `num_cols`, and with `rows` the two slices must have the same length.
pub fn gather_row_prefixes(
    table: &[i32],
    shape: [usize; 2],
    rows: Option<&[usize]>,
    counts: &[usize],
) -> Result<Vec<i32>> {
    let [num_rows, num_cols] = shape;
    if num_rows.checked_mul(num_cols) != Some(table.len()) {
        return Err(KvError::InvalidArgument(format!(
            "a table of {} entries is not {num_rows} rows of {num_cols}",
            table.len()
        )));
    }
    if let Some(rows) = rows {
        if rows.len() != counts.len() {
            return Err(KvError::InvalidArgument(format!(
                "rows has {} entries, counts {}",
                rows.len(),
                counts.len()
            )));
        }
        if let Some((i, &r)) = rows.iter().enumerate().find(|(_, &r)| r >= num_rows) {
            return Err(KvError::InvalidArgument(format!(
                "rows[{i}] = {r} is outside the table's {num_rows} rows"
            )));
        }
    } else if counts.len() > num_rows {
        return Err(KvError::InvalidArgument(format!(
            "{} counts for a table of {num_rows} rows",
            counts.len()
        )));
    }
    if let Some((i, &c)) = counts.iter().enumerate().find(|(_, &c)| c > num_cols) {
        return Err(KvError::InvalidArgument(format!(
            "counts[{i}] = {c} is more than the table's {num_cols} columns"
        )));
    }
    // Each count is at most num_cols, so the sum is at most counts.len() * num_cols:
    // bounded by the rows checked above times the table width, no overflow.
    let total: usize = counts.iter().sum();
    let mut out = Vec::new();
    out.try_reserve_exact(total)
        .map_err(|_| KvError::InvalidArgument(format!("{total} entries do not fit in memory")))?;
    for (i, &c) in counts.iter().enumerate() {
        let r = rows.map_or(i, |rows| rows[i]);
        let start = r * num_cols;
        out.extend_from_slice(&table[start..start + c]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::gather_row_prefixes;

    const TABLE: [i32; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

    #[test]
    fn gathers_prefixes_in_order_or_by_row() {
        assert_eq!(
            gather_row_prefixes(&TABLE, [3, 4], None, &[1, 0, 4]).unwrap(),
            vec![1, 9, 10, 11, 12]
        );
        assert_eq!(
            gather_row_prefixes(&TABLE, [3, 4], Some(&[2, 0, 2]), &[2, 3, 0]).unwrap(),
            vec![9, 10, 1, 2, 3]
        );
        assert_eq!(
            gather_row_prefixes(&[], [0, 0], None, &[]).unwrap(),
            Vec::<i32>::new()
        );
    }

    #[test]
    fn a_table_without_columns_has_its_rows() {
        // `[3, 0]`: three rows of no entries, not zero rows.
        assert_eq!(
            gather_row_prefixes(&[], [3, 0], None, &[0, 0, 0]).unwrap(),
            Vec::<i32>::new()
        );
        assert_eq!(
            gather_row_prefixes(&[], [3, 0], Some(&[2, 0]), &[0, 0]).unwrap(),
            Vec::<i32>::new()
        );
        assert!(gather_row_prefixes(&[], [3, 0], None, &[1]).is_err());
        assert!(gather_row_prefixes(&[], [3, 0], None, &[0, 0, 0, 0]).is_err());
        assert!(gather_row_prefixes(&[], [3, 0], Some(&[3]), &[0]).is_err());
    }

    #[test]
    fn rejects_what_does_not_fit_the_table() {
        assert!(gather_row_prefixes(&TABLE, [2, 5], None, &[1]).is_err());
        assert!(gather_row_prefixes(&TABLE, [3, 0], None, &[]).is_err());
        assert!(gather_row_prefixes(&TABLE, [0, 4], None, &[]).is_err());
        assert!(gather_row_prefixes(&TABLE, [usize::MAX, 2], None, &[]).is_err());
        assert!(gather_row_prefixes(&TABLE, [3, 4], None, &[5]).is_err());
        assert!(gather_row_prefixes(&TABLE, [3, 4], None, &[1, 1, 1, 1]).is_err());
        assert!(gather_row_prefixes(&TABLE, [3, 4], Some(&[3]), &[1]).is_err());
        assert!(gather_row_prefixes(&TABLE, [3, 4], Some(&[0, 1]), &[1]).is_err());
    }
}
