//! The worker under the deterministic simulation (`jepsen-style-tests sim --decoders real`).
//!
//! The simulation runs real [`crate::worker::Worker`]s on one thread, on a paused tokio clock,
//! and needs every schedule to be a function of its seed. Three things of a worker would not be:
//! model work on tokio's blocking pool (another thread, finishing at a wall-clock moment), the
//! session ids (drawn from the process's random hash keys), and the history's wall-clock times.
//! [`enter`] switches all three, for the calling thread only, until [`leave`]:
//! - model work runs inline on the task that asked for it, then the task sleeps `step` of
//!   simulated time (what the step cost);
//! - session ids count up from 1;
//! - history times are microseconds of simulated time since `origin`.
//!
//! Nothing else changes: production never calls [`enter`], and a thread that did not call it
//! behaves as production.

use std::cell::RefCell;
use std::time::Duration;

struct Mode {
    step: Duration,
    origin: tokio::time::Instant,
    next_session: u64,
}

thread_local! {
    static MODE: RefCell<Option<Mode>> = const { RefCell::new(None) };
}

/// Workers on this thread run simulated from now on (see the module's text): model work inline
/// followed by `step` of simulated time, session ids from 1, history times since `origin`.
pub fn enter(step: Duration, origin: tokio::time::Instant) {
    MODE.with(|m| {
        *m.borrow_mut() = Some(Mode {
            step,
            origin,
            next_session: 1,
        })
    });
}

/// Back to production behaviour on this thread.
pub fn leave() {
    MODE.with(|m| *m.borrow_mut() = None);
}

/// Whether this thread runs simulated; the simulated cost of one model call if so.
pub(crate) fn step() -> Option<Duration> {
    MODE.with(|m| m.borrow().as_ref().map(|m| m.step))
}

/// The next session id, when simulated.
pub(crate) fn session_id() -> Option<u64> {
    MODE.with(|m| {
        m.borrow_mut().as_mut().map(|m| {
            let id = m.next_session;
            m.next_session += 1;
            id
        })
    })
}

/// Microseconds of simulated time since the origin, when simulated.
pub(crate) fn now_us() -> Option<u64> {
    MODE.with(|m| m.borrow().as_ref().map(|m| m.origin.elapsed().as_micros() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn simulated_ids_and_times_come_from_the_simulation_and_end_with_it() {
        assert_eq!(step(), None);
        enter(Duration::from_millis(3), tokio::time::Instant::now());
        assert_eq!(session_id(), Some(1));
        assert_eq!(session_id(), Some(2));
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(now_us(), Some(5_000));
        assert_eq!(step(), Some(Duration::from_millis(3)));
        leave();
        assert_eq!((step(), session_id(), now_us()), (None, None, None));
    }
}
