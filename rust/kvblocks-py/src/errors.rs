//! The one mapping from core errors to the Python classes of `kvblocks.errors`.
//!
//! The exception classes live in pure Python (so the scheduler and the ops can raise
//! them without the extension); each class is imported once and cached.

use kvblocks_core::KvError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

const ERRORS_MODULE: &str = "kvblocks.errors";

static INVALID_ARGUMENT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static OUT_OF_BLOCKS: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static UNKNOWN_SEQUENCE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static DUPLICATE_SEQUENCE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static SEQUENCE_STATE: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static INVARIANT_VIOLATION: PyOnceLock<Py<PyType>> = PyOnceLock::new();

/// Build an instance of the `kvblocks.errors` class `name` (cached in `cell`) with `message`.
fn new_error(cell: &'static PyOnceLock<Py<PyType>>, name: &str, message: String) -> PyErr {
    Python::attach(|py| match cell.import(py, ERRORS_MODULE, name) {
        Ok(class) => PyErr::from_type(class.clone(), (message,)),
        // The errors module failed to import: surface that failure, with the message chained.
        Err(import_error) => import_error,
    })
}

/// Convert a core error into the matching `kvblocks.errors` exception.
pub(crate) fn to_py_err(err: KvError) -> PyErr {
    let message = err.to_string();
    match err {
        KvError::InvalidArgument(_) => {
            new_error(&INVALID_ARGUMENT, "InvalidArgumentError", message)
        }
        KvError::OutOfBlocks(_) => new_error(&OUT_OF_BLOCKS, "OutOfBlocksError", message),
        KvError::UnknownSequence(_) => {
            new_error(&UNKNOWN_SEQUENCE, "UnknownSequenceError", message)
        }
        KvError::DuplicateSequence(_) => {
            new_error(&DUPLICATE_SEQUENCE, "DuplicateSequenceError", message)
        }
        KvError::SequenceState(_) => new_error(&SEQUENCE_STATE, "SequenceStateError", message),
        KvError::InvariantViolation(_) => {
            new_error(&INVARIANT_VIOLATION, "InvariantViolationError", message)
        }
    }
}

/// An `InvalidArgumentError` raised by the binding itself (bad type, rank, range).
pub(crate) fn invalid_argument(message: String) -> PyErr {
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
