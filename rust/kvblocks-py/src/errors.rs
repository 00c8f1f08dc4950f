//! The one mapping from core errors to the Python classes of `kvblocks.errors`.
//!
//! The exception classes live in pure Python (so the scheduler and the ops can raise
//! them without the extension); `import_exception!` gives each a Rust type whose class
//! is imported once and cached.

use kvblocks_core::KvError;
use pyo3::prelude::*;
use pyo3::types::PyType;
use pyo3::{import_exception, PyTypeInfo};

/// Declare each `kvblocks.errors` class as an `import_exception!` type, and
/// `import_classes`, which imports them all while the module initialises.
///
/// `import_exception!` types panic when their class cannot be imported, and a lazily
/// raised error is only built after PyO3's panic guard, where a panic would abort the
/// process. Importing them at init, fallibly, turns a broken `kvblocks.errors` into an
/// `ImportError` of `kvblocks._core` and leaves the classes cached for every later raise.
macro_rules! error_classes {
    ($($class:ident),* $(,)?) => {
        $(import_exception!(kvblocks.errors, $class);)*

        /// Import every error class while the module initialises (see `error_classes!`).
        pub(crate) fn import_classes(py: Python<'_>) -> PyResult<()> {
            let module = py.import("kvblocks.errors")?;
            $(import_class::<$class>(&module, stringify!($class))?;)*
            Ok(())
        }
    };
}

error_classes!(
    InvalidArgumentError,
    OutOfBlocksError,
    UnknownSequenceError,
    DuplicateSequenceError,
    SequenceStateError,
    InvariantViolationError,
);

/// Check that `module.name` is a class, then fill `T`'s cache (which cannot fail now).
fn import_class<T: PyTypeInfo>(module: &Bound<'_, PyModule>, name: &str) -> PyResult<()> {
    module.getattr(name)?.cast_into::<PyType>()?;
    T::type_object(module.py());
    Ok(())
}

/// Convert a core error into the matching `kvblocks.errors` exception.
pub(crate) fn to_py_err(err: KvError) -> PyErr {
    let message = err.to_string();
    match err {
        KvError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        KvError::OutOfBlocks(_) => OutOfBlocksError::new_err(message),
        KvError::UnknownSequence(_) => UnknownSequenceError::new_err(message),
        KvError::DuplicateSequence(_) => DuplicateSequenceError::new_err(message),
        KvError::SequenceState(_) => SequenceStateError::new_err(message),
        KvError::InvariantViolation(_) => InvariantViolationError::new_err(message),
    }
}

/// An `InvalidArgumentError` raised by the binding itself (bad type, rank, range).
pub(crate) fn invalid_argument(message: String) -> PyErr {
    // Through the core error, so the message carries its `invalid argument: ` prefix.
    to_py_err(KvError::InvalidArgument(message))
}

/// `?`-friendly conversion of core results.
pub(crate) trait IntoPyResult<T> {
    /// Map the error through [`to_py_err`].
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, KvError> {
    #[inline]
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py_err)
    }
}
