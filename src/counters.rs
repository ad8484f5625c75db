//! What the supervisor's machinery costs per operation, counted for leasehold's own benches:
//! messages into the supervisor's inbox, the doorbells that wake it, and the tasks leasehold
//! spawns (worker actors, drivers, blocking-pool closures, broker calls, keepers). Counted only
//! with feature `fault-injection` (which the crate's own tests and benches turn on); in any
//! other build every counter is a no-op that compiles away.

#[cfg(feature = "fault-injection")]
mod imp {
    use std::sync::atomic::{AtomicU64, Ordering};

    pub(super) static MESSAGES: AtomicU64 = AtomicU64::new(0);
    pub(super) static RINGS: AtomicU64 = AtomicU64::new(0);
    pub(super) static TASKS: AtomicU64 = AtomicU64::new(0);

    #[inline]
    pub(super) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn read(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }
}

/// A message went into a supervisor's inbox.
#[inline]
pub(crate) fn message() {
    #[cfg(feature = "fault-injection")]
    imp::bump(&imp::MESSAGES);
}

/// A doorbell (a ractor message) was sent to a supervisor actor.
#[inline]
pub(crate) fn ring() {
    #[cfg(feature = "fault-injection")]
    imp::bump(&imp::RINGS);
}

/// leasehold spawned a task (an actor's task, a tokio task, a blocking-pool closure).
#[inline]
pub(crate) fn task() {
    #[cfg(feature = "fault-injection")]
    imp::bump(&imp::TASKS);
}

/// What every supervisor in the process has counted so far (feature `fault-injection`, for
/// leasehold's own benches; not part of the API).
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Messages into supervisors' inboxes.
    pub messages: u64,
    /// Doorbells (ractor messages) that woke a supervisor actor.
    pub rings: u64,
    /// Tasks leasehold spawned.
    pub tasks: u64,
}

#[cfg(feature = "fault-injection")]
impl Counts {
    /// The counts now.
    pub fn now() -> Self {
        Self {
            messages: imp::read(&imp::MESSAGES),
            rings: imp::read(&imp::RINGS),
            tasks: imp::read(&imp::TASKS),
        }
    }

    /// What was counted since `earlier`.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            messages: self.messages - earlier.messages,
            rings: self.rings - earlier.rings,
            tasks: self.tasks - earlier.tasks,
        }
    }
}
