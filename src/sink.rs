//! Where failures go when no caller is left to hear them.
//!
//! Each such failure becomes one `tracing` error event at once, and is handed to the user's
//! error sink off the caller's thread: the sink is code leasehold did not write, so it never
//! runs in the supervisor's turn nor in a caller's `Drop`. Failures wait in a bounded queue,
//! drained one at a time on tokio's blocking pool (so the sink is never called twice at once).
//! A sink that blocks or falls behind fills the queue; what does not fit is counted
//! (`render_slot.sink.dropped.count`) and logged, and nobody waits for it. A sink that panics is
//! caught: its panic is reported, and it is called again for the next failure.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::broker::SlotToken;
use crate::error::CleanupError;

/// A cleanup failure that had no caller left: a dropped [`Lease`](crate::Lease), a `run` future
/// dropped before its release finished, a late release of a quarantined slot.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OrphanedFailure {
    /// The job, when the lease belonged to one.
    pub job_id: Option<String>,
    /// The token concerned.
    pub token: SlotToken,
    /// What failed.
    pub error: CleanupError,
}

impl fmt::Display for OrphanedFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.job_id {
            Some(job) => write!(f, "job {job} ({}): {}", self.token, self.error),
            None => write!(f, "{}: {}", self.token, self.error),
        }
    }
}

/// The user's error sink, as the builder takes it.
pub(crate) type ErrorSink = Arc<dyn Fn(&OrphanedFailure) + Send + Sync>;

/// Failures the sink's queue holds before more are counted as dropped.
pub(crate) const SINK_QUEUE: usize = 1024;

/// Where a failure nobody hears is reported. Cheap to clone; without a user sink, only the
/// `tracing` event is made.
#[derive(Clone, Default)]
pub(crate) struct Sink {
    queue: Option<Arc<Queue>>,
}

struct Queue {
    user: ErrorSink,
    /// Rung each time a drain ends (the queue is empty and the sink has returned).
    idle: tokio::sync::Notify,
    /// The supervisor's runtime, whose blocking pool drains the queue.
    runtime: tokio::runtime::Handle,
    capacity: usize,
    state: Mutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    failures: VecDeque<OrphanedFailure>,
    /// A drain is running (or about to): it takes what is queued until nothing is left.
    draining: bool,
}

impl Queue {
    fn idle(&self) -> bool {
        !self.state.lock().draining
    }
}

impl Sink {
    /// A sink that hands failures to `user` (none without `user`), drained on `runtime`'s
    /// blocking pool.
    pub(crate) fn new(user: Option<ErrorSink>, runtime: tokio::runtime::Handle) -> Self {
        Self::with_capacity(user, runtime, SINK_QUEUE)
    }

    pub(crate) fn with_capacity(
        user: Option<ErrorSink>,
        runtime: tokio::runtime::Handle,
        capacity: usize,
    ) -> Self {
        Self {
            queue: user.map(|user| {
                Arc::new(Queue {
                    user,
                    idle: tokio::sync::Notify::new(),
                    runtime,
                    capacity,
                    state: Mutex::new(Waiting::default()),
                })
            }),
        }
    }

    /// Reports a cleanup failure that has no caller left: a `tracing` error event, then the
    /// user's sink, off this thread. Never blocks. The `render_slot.release.failed.count`
    /// metric is counted where the release ended.
    pub(crate) fn report(&self, job_id: Option<String>, error: CleanupError) {
        let Some(token) = error.token() else {
            tracing::error!(job_id = job_id.as_deref(), code = error.code(), %error, "cleanup failed with no caller left");
            return;
        };
        tracing::error!(job_id = job_id.as_deref(), %token, code = error.code(), %error, "cleanup failed with no caller left");
        let Some(queue) = &self.queue else { return };
        let failure = OrphanedFailure {
            job_id,
            token,
            error,
        };
        let start = {
            let mut state = queue.state.lock();
            if state.failures.len() >= queue.capacity {
                drop(state);
                metrics::counter!(crate::metric_names::SINK_DROPPED_COUNT).increment(1);
                tracing::warn!(%failure, "the error sink is behind (its queue is full): this failure was not handed to it");
                return;
            }
            state.failures.push_back(failure);
            !std::mem::replace(&mut state.draining, true)
        };
        if start {
            let drainer = Drainer {
                queue: Arc::clone(queue),
                ran: false,
            };
            crate::counters::task();
            drop(queue.runtime.spawn_blocking(move || drainer.run()));
        }
    }
}

impl Sink {
    /// Waits until every failure reported so far has been handed to the sink and the sink has
    /// returned, or `deadline`: whether it has (for `shutdown`, whose answer means they were).
    pub(crate) async fn drained_until(&self, deadline: tokio::time::Instant) -> bool {
        let Some(queue) = &self.queue else {
            return true;
        };
        loop {
            let idle = queue.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if queue.idle() {
                return true;
            }
            if tokio::time::timeout_at(deadline, idle).await.is_err() {
                return queue.idle();
            }
        }
    }
}

impl Queue {
    /// Calls the sink with each failure queued, in order, until none is left.
    fn drain(&self) {
        loop {
            let next = {
                let mut state = self.state.lock();
                match state.failures.pop_front() {
                    Some(failure) => failure,
                    None => {
                        state.draining = false;
                        drop(state);
                        self.idle.notify_waiters();
                        return;
                    }
                }
            };
            if let Err(panic) = crate::outside::call(|| (self.user)(&next)) {
                tracing::error!(%panic, failure = %next, "the error sink panicked");
            }
        }
    }
}

/// One drain on the blocking pool. A runtime that is shutting down drops it without running
/// it: what it was to hand over is then counted as dropped, and the queue is idle again (so
/// that `shutdown` does not wait for a drain that will never run).
struct Drainer {
    queue: Arc<Queue>,
    ran: bool,
}

impl Drainer {
    fn run(mut self) {
        self.queue.drain();
        self.ran = true;
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        if self.ran {
            return;
        }
        let lost = {
            let mut state = self.queue.state.lock();
            state.draining = false;
            std::mem::take(&mut state.failures)
        };
        self.queue.idle.notify_waiters();
        if !lost.is_empty() {
            metrics::counter!(crate::metric_names::SINK_DROPPED_COUNT).increment(lost.len() as u64);
            tracing::warn!(
                lost = lost.len(),
                "the runtime ended before the error sink was called: these failures were not handed to it"
            );
        }
    }
}

impl fmt::Debug for Sink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sink")
            .field("user", &self.queue.is_some())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;
    use crate::broker::BrokerError;

    fn failure(n: u32) -> CleanupError {
        CleanupError::broker(SlotToken::new(n, 1), BrokerError::new("refused"))
    }

    #[test]
    fn a_sink_that_blocks_fills_its_queue_and_what_does_not_fit_is_counted_never_waited_for() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let (entered_tx, entered) = mpsc::channel::<u32>();
        let (open_tx, open) = mpsc::channel::<()>();
        let open = std::sync::Mutex::new(open);
        let user: ErrorSink = Arc::new(move |f: &OrphanedFailure| {
            let _ = entered_tx.send(f.token.slot_id());
            // Blocks until the test lets it go.
            let _ = open.lock().unwrap().recv();
        });
        let sink = Sink::with_capacity(Some(user), rt.handle().clone(), 2);
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            sink.report(None, failure(0));
            // The sink has the first failure and blocks on it.
            assert_eq!(entered.recv().unwrap(), 0);
            // Two fit in the queue; the next two do not. None of these calls waits.
            for n in 1..=4 {
                sink.report(None, failure(n));
            }
        });
        let dropped: u64 = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == crate::metric_names::SINK_DROPPED_COUNT)
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => n,
                _ => 0,
            })
            .sum();
        assert_eq!(dropped, 2);
        for _ in 0..3 {
            open_tx.send(()).unwrap();
        }
        let drained = rt.block_on(
            sink.drained_until(tokio::time::Instant::now() + std::time::Duration::from_secs(30)),
        );
        assert!(drained);
        // In the order they were reported: the first, then the two the queue held.
        let heard: Vec<u32> = entered.try_iter().collect();
        assert_eq!(heard, [1, 2]);
    }

    #[test]
    fn a_failure_reported_after_the_runtime_is_gone_is_counted_dropped_and_never_waited_for() {
        let gone = tokio::runtime::Runtime::new().unwrap();
        let called = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&called);
        let user: ErrorSink = Arc::new(move |_: &OrphanedFailure| {
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let sink = Sink::new(Some(user), gone.handle().clone());
        drop(gone);
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        // The blocking pool is gone: tokio drops the drain without running it.
        metrics::with_local_recorder(&recorder, || sink.report(None, failure(3)));
        let dropped: u64 = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter(|(key, ..)| key.key().name() == crate::metric_names::SINK_DROPPED_COUNT)
            .map(|(.., value)| match value {
                DebugValue::Counter(n) => n,
                _ => 0,
            })
            .sum();
        assert_eq!(dropped, 1);
        // Idle at once, not at the deadline: the paused clock would otherwise jump to it.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let start = tokio::time::Instant::now();
            let deadline = start + std::time::Duration::from_secs(30);
            assert!(sink.drained_until(deadline).await);
            assert_eq!(tokio::time::Instant::now(), start);
        });
        assert!(!called.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn a_sink_that_panics_is_caught_and_called_again_for_the_next_failure() {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (tx, rx) = mpsc::channel::<u32>();
        let user: ErrorSink = Arc::new(move |f: &OrphanedFailure| {
            let _ = tx.send(f.token.slot_id());
            panic!("the sink panicked");
        });
        let sink = Sink::new(Some(user), rt.handle().clone());
        sink.report(None, failure(7));
        sink.report(None, failure(8));
        assert!(rt.block_on(
            sink.drained_until(tokio::time::Instant::now() + std::time::Duration::from_secs(30),)
        ));
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), [7, 8]);
    }
}
