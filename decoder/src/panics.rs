//! Panics a caller expects and turns into an error (a third-party loader that panics on bad
//! input), told apart from bugs. The `tokenlog` binary's panic hook aborts the process on any
//! panic except one inside [`catch_expected`]: a panicked task must not leave a live process
//! with a dead service behind it (a server that no longer answers, a worker that no longer
//! steps while its leases are renewed).

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

thread_local! {
    static CATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, turning a panic in it into `Err` (like `catch_unwind`), and marks the panic as
/// expected for the panic hook while it runs.
pub fn catch_expected<R>(f: impl FnOnce() -> R) -> std::thread::Result<R> {
    let was = CATCHING.with(|c| c.replace(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    CATCHING.with(|c| c.set(was));
    r
}

/// Whether the panic being handled on this thread happens inside [`catch_expected`].
pub fn expected() -> bool {
    CATCHING.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_is_expected_and_caught_one_outside_is_not() {
        assert!(!expected());
        let r = catch_expected(|| {
            assert!(expected());
            panic!("bad weights")
        });
        assert!(r.is_err());
        assert!(!expected(), "the mark ends with the call");
        assert_eq!(catch_expected(|| 7).unwrap(), 7);
    }
}
