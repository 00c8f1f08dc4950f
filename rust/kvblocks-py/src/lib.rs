//! `kvblocks._core`: the Python extension module over the `kvblocks-core` crate.
//!
//! A thin layer: argument conversion ([`args`]), the one error mapping ([`errors`]),
//! the manager behind a mutex ([`manager`]), prompt hashing ([`hashing`]), events and
//! `AllocStatus` as frozen classes, and BLAKE3 for the tiers ([`blake3_hasher`]).
//! The Python contract is `python/kvblocks/_core.pyi` (checked by `mypy.stubtest`).

mod alloc_status;
mod args;
mod batch_allocation;
mod blake3_hasher;
mod block_table_delta;
mod errors;
mod events;
mod group_spec;
mod hashing;
mod manager;
mod row_prefixes;

use pyo3::prelude::*;

/// The compiled block manager of kvblocks (see ``kvblocks/_core.pyi`` for the API).
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::import_classes(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<alloc_status::AllocStatus>()?;
    m.add_class::<batch_allocation::BatchAllocation>()?;
    m.add_class::<blake3_hasher::Blake3>()?;
    m.add_class::<block_table_delta::BlockTableDelta>()?;
    m.add_class::<events::BlockStored>()?;
    m.add_class::<events::BlockRemoved>()?;
    m.add_class::<events::AllBlocksCleared>()?;
    m.add_class::<hashing::BlockHasher>()?;
    m.add_class::<group_spec::GroupSpec>()?;
    m.add_class::<manager::KVCacheManager>()?;
    m.add_function(wrap_pyfunction!(row_prefixes::gather_row_prefixes, m)?)?;
    m.add_function(wrap_pyfunction!(blake3_hasher::blake3_derive_key, m)?)?;
    Ok(())
}
