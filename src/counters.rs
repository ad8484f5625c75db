//! What the supervisor's machinery costs per operation, counted for leasehold's own benches:
//! messages into the supervisor's inbox, the doorbells that wake it, and the tasks leasehold
//! spawns (worker actors, drivers, blocking-pool closures, broker calls, keepers), and the
//! wakes of its machinery (polls). Counted only
//! with feature `fault-injection` (which the crate's own tests and benches turn on); in any
//! other build every counter is a no-op that compiles away.

#[cfg(feature = "fault-injection")]
mod imp {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    use parking_lot::Mutex;

    /// One thread's counters: each thread counts in its own cache line, so that counting never
    /// makes two threads contend (the benches measure with it on).
    #[derive(Default)]
    #[repr(align(64))]
    pub(super) struct Local {
        pub(super) messages: AtomicU64,
        pub(super) rings: AtomicU64,
        pub(super) tasks: AtomicU64,
        pub(super) polls: AtomicU64,
    }

    /// Every thread's counters (threads that ended keep theirs here).
    static ALL: Mutex<Vec<Arc<Local>>> = Mutex::new(Vec::new());

    thread_local! {
        static LOCAL: Arc<Local> = {
            let local = Arc::new(Local::default());
            ALL.lock().push(Arc::clone(&local));
            local
        };
    }

    #[inline]
    pub(super) fn bump(which: fn(&Local) -> &AtomicU64) {
        // Only this thread writes its counters: a load and a store, no read-modify-write.
        let _ = LOCAL.try_with(|local| {
            let counter = which(local);
            counter.store(counter.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        });
    }

    pub(super) fn sum(which: fn(&Local) -> &AtomicU64) -> u64 {
        ALL.lock()
            .iter()
            .map(|local| which(local).load(Ordering::Relaxed))
            .sum()
    }
}

/// A message went into a supervisor's inbox.
#[inline]
pub(crate) fn message() {
    #[cfg(feature = "fault-injection")]
    imp::bump(|l| &l.messages);
}

/// A doorbell (a ractor message) was sent to a supervisor actor.
#[inline]
pub(crate) fn ring() {
    #[cfg(feature = "fault-injection")]
    imp::bump(|l| &l.rings);
}

/// leasehold spawned a task (an actor's task, a tokio task, a blocking-pool closure).
#[inline]
pub(crate) fn task() {
    #[cfg(feature = "fault-injection")]
    imp::bump(|l| &l.tasks);
}

/// One wake of leasehold's machinery: a supervisor's turn (a batch drained from its inbox), a
/// poll of a worker's job or of a driver, a temp dir's removal on the blocking pool, an answer
/// sent to a caller (which wakes it).
#[inline]
pub(crate) fn poll() {
    #[cfg(feature = "fault-injection")]
    imp::bump(|l| &l.polls);
}

/// `fut`, with every poll counted (see [`poll`]).
pub(crate) async fn polled<F: std::future::Future>(fut: F) -> F::Output {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(move |cx| {
        poll();
        fut.as_mut().poll(cx)
    })
    .await
}

/// What every supervisor in the process has counted so far: unstable test support (feature
/// `fault-injection`) for leasehold's own benches, not covered by semantic versioning.
#[cfg(feature = "fault-injection")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Messages into supervisors' inboxes.
    pub messages: u64,
    /// Doorbells (ractor messages) that woke a supervisor actor.
    pub rings: u64,
    /// Tasks leasehold spawned.
    pub tasks: u64,
    /// Wakes of leasehold's machinery: supervisor turns (batches drained from an inbox), polls
    /// of workers' jobs and of drivers, temp dir removals on the blocking pool, and answers
    /// sent to callers (each wakes its caller; the caller's first poll, which sends the
    /// request, is not counted).
    pub polls: u64,
}

#[cfg(feature = "fault-injection")]
impl Counts {
    /// The counts now.
    pub fn now() -> Self {
        Self {
            messages: imp::sum(|l| &l.messages),
            rings: imp::sum(|l| &l.rings),
            tasks: imp::sum(|l| &l.tasks),
            polls: imp::sum(|l| &l.polls),
        }
    }

    /// What was counted since `earlier`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            messages: self.messages - earlier.messages,
            rings: self.rings - earlier.rings,
            tasks: self.tasks - earlier.tasks,
            polls: self.polls - earlier.polls,
        }
    }
}
