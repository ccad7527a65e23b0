//! The async runtime openraft runs on in the simulation ([`crate::sim_raft`]): tokio on one
//! thread with openraft's `DeterministicRng` (seeded draws), and one replacement that makes the
//! schedule a function of the seed: a watch channel ([`DetWatch`]) that wakes its waiters in
//! the order they started waiting.
//!
//! Why: tokio's `watch` spreads waiters over eight `Notify` shards chosen by the runtime's
//! random generator, and wakes shard by shard, so two tasks waiting on one channel (openraft's
//! replication streams on the leader's progress) run in a different order from one run to the
//! next; fixing that generator needs `--cfg tokio_unstable` for the whole build. Everything else
//! (tasks, timers, mpsc, oneshot, mutex) is tokio's, already deterministic on one thread with a
//! paused clock.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};
use std::task::{Poll, Waker};
use std::time::Duration;

use openraft::rt::watch::SendError;
use openraft::rt::{AsyncRuntime, OptionalSend, OptionalSync, RecvError, Watch, WatchReceiver, WatchSender};

type Det = openraft::rt::deterministic_rng::DeterministicRng<openraft::impls::TokioRuntime>;

/// openraft's runtime for the simulation: [`Det`] with [`DetWatch`].
#[derive(Debug)]
pub struct SimRt(Det);

impl SimRt {
    /// Runs `f` with `seed` as the root of the random draws of every task it spawns.
    pub fn scope<F: Future>(seed: u64, f: F) -> impl Future<Output = F::Output> {
        Det::scope(seed, f)
    }
}

impl AsyncRuntime for SimRt {
    type JoinError = <Det as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <Det as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <Det as AsyncRuntime>::Sleep;
    type Instant = <Det as AsyncRuntime>::Instant;
    type TimeoutError = <Det as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <Det as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = <Det as AsyncRuntime>::ThreadLocalRng;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        Det::spawn(future)
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        Det::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        Det::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(duration: Duration, future: F) -> Self::Timeout<R, F> {
        Det::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(deadline: Self::Instant, future: F) -> Self::Timeout<R, F> {
        Det::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        Det::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        Det::thread_rng()
    }

    type Mpsc = <Det as AsyncRuntime>::Mpsc;
    type Watch = DetWatch;
    type Oneshot = <Det as AsyncRuntime>::Oneshot;
    type Mutex<T: OptionalSend + 'static> = <Det as AsyncRuntime>::Mutex<T>;

    fn new(threads: usize) -> Self {
        SimRt(Det::new(threads))
    }

    fn block_on<F, T>(&mut self, future: F) -> T
    where
        F: Future<Output = T>,
    {
        self.0.block_on(future)
    }
}

// ------------------------------------------------------------------------------ watch

/// A watch channel whose waiters wake in the order they registered.
pub struct DetWatch;

struct Shared<T> {
    value: RwLock<T>,
    meta: Mutex<Meta>,
    receivers: AtomicUsize,
}

#[derive(Default)]
struct Meta {
    version: u64,
    senders: usize,
    /// Waiting receivers' wakers, in the order they started waiting.
    wakers: Vec<Waker>,
}

impl<T> Shared<T> {
    fn meta(&self) -> std::sync::MutexGuard<'_, Meta> {
        self.meta.lock().expect("watch meta")
    }

    /// A new version: every waiter wakes, in order.
    fn bump(&self) {
        let wakers = {
            let mut m = self.meta();
            m.version += 1;
            std::mem::take(&mut m.wakers)
        };
        for w in wakers {
            w.wake();
        }
    }
}

pub struct DetSender<T> {
    shared: Arc<Shared<T>>,
}

pub struct DetReceiver<T> {
    shared: Arc<Shared<T>>,
    seen: u64,
}

impl Watch for DetWatch {
    type Sender<T: OptionalSend + OptionalSync> = DetSender<T>;
    type Receiver<T: OptionalSend + OptionalSync> = DetReceiver<T>;
    type Ref<'a, T: OptionalSend + 'a> = RwLockReadGuard<'a, T>;

    fn channel<T: OptionalSend + OptionalSync>(init: T) -> (DetSender<T>, DetReceiver<T>) {
        let shared = Arc::new(Shared {
            value: RwLock::new(init),
            meta: Mutex::new(Meta {
                senders: 1,
                ..Meta::default()
            }),
            receivers: AtomicUsize::new(1),
        });
        (DetSender { shared: shared.clone() }, DetReceiver { shared, seen: 0 })
    }
}

impl<T> Clone for DetSender<T> {
    fn clone(&self) -> Self {
        self.shared.meta().senders += 1;
        DetSender {
            shared: self.shared.clone(),
        }
    }
}

impl<T> Drop for DetSender<T> {
    fn drop(&mut self) {
        let wakers = {
            let mut m = self.shared.meta();
            m.senders -= 1;
            if m.senders > 0 {
                return;
            }
            std::mem::take(&mut m.wakers)
        };
        // Closed: waiters wake to see it.
        for w in wakers {
            w.wake();
        }
    }
}

impl<T> DetReceiver<T> {
    /// Every sender is gone (for openraft's metrics: its core task ended, by a panic too).
    pub fn is_closed(&self) -> bool {
        self.shared.meta().senders == 0
    }
}

impl<T> Clone for DetReceiver<T> {
    fn clone(&self) -> Self {
        self.shared.receivers.fetch_add(1, Ordering::Relaxed);
        DetReceiver {
            shared: self.shared.clone(),
            seen: self.seen,
        }
    }
}

impl<T> Drop for DetReceiver<T> {
    fn drop(&mut self) {
        self.shared.receivers.fetch_sub(1, Ordering::Relaxed);
    }
}

impl<T: OptionalSend + OptionalSync> WatchSender<DetWatch, T> for DetSender<T> {
    /// As tokio's: refused (and the value not stored) when no receiver is left.
    fn send(&self, value: T) -> Result<(), SendError<T>> {
        if self.shared.receivers.load(Ordering::Relaxed) == 0 {
            return Err(SendError(value));
        }
        *self.shared.value.write().expect("watch value") = value;
        self.shared.bump();
        Ok(())
    }

    fn send_if_modified<F>(&self, modify: F) -> bool
    where
        F: FnOnce(&mut T) -> bool,
    {
        let modified = modify(&mut self.shared.value.write().expect("watch value"));
        if modified {
            self.shared.bump();
        }
        modified
    }

    fn borrow_watched(&self) -> RwLockReadGuard<'_, T> {
        self.shared.value.read().expect("watch value")
    }

    fn subscribe(&self) -> DetReceiver<T> {
        self.shared.receivers.fetch_add(1, Ordering::Relaxed);
        DetReceiver {
            shared: self.shared.clone(),
            seen: self.shared.meta().version,
        }
    }
}

impl<T: OptionalSend + OptionalSync> WatchReceiver<DetWatch, T> for DetReceiver<T> {
    async fn changed(&mut self) -> Result<(), RecvError> {
        std::future::poll_fn(|cx| {
            let mut m = self.shared.meta();
            if m.version != self.seen {
                self.seen = m.version;
                return Poll::Ready(Ok(()));
            }
            if m.senders == 0 {
                return Poll::Ready(Err(RecvError(())));
            }
            if !m.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                m.wakers.push(cx.waker().clone());
            }
            Poll::Pending
        })
        .await
    }

    fn borrow_watched(&self) -> RwLockReadGuard<'_, T> {
        self.shared.value.read().expect("watch value")
    }

    fn borrow_and_update(&mut self) -> RwLockReadGuard<'_, T> {
        self.seen = self.shared.meta().version;
        self.shared.value.read().expect("watch value")
    }
}
