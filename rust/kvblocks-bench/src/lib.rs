//! Empty: this crate holds only the core's criterion benches (`benches/core_ops.rs`, run
//! with `cargo bench -p kvblocks-bench`). They live outside `kvblocks-core` so that the
//! core's `cargo test` does not compile criterion and its dependencies (clap, regex, serde),
//! about a third of that build.
