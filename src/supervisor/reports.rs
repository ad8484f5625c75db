//! What the supervisor reports to its callers: a shutdown's report, the quarantined slots, a
//! reclaim's findings.

use std::sync::Arc;
use std::time::Duration;

use super::stats::Stats;
use crate::broker::SlotToken;
use crate::job::Priority;

/// What [`Supervisor::shutdown`](crate::Supervisor::shutdown) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Callers that were still waiting for a slot and heard `SUPERVISOR_STOPPED`.
    pub refused_waiters: usize,
    /// Running jobs that were cancelled (and then waited for).
    pub cancelled_jobs: usize,
    /// Explicit leases still held, released by the supervisor on their holders' behalf.
    pub released_leases: usize,
    /// Slots left in quarantine (their temp dirs are kept); one entry each in `unproven`.
    pub quarantined: usize,
    /// The quarantined slots, each with what could not be proven (a task that ignored
    /// cancellation past the shutdown bound, a process group that would not die, GPU work
    /// that never completed, a temp dir that could not be removed).
    pub unproven: Vec<QuarantinedSlot>,
    /// GPU devices (feature `gpu`) whose remaining work could not be proven done when they
    /// were closed: each was left to finish on a thread of its own.
    pub unclosed_devices: Vec<UnclosedDevice>,
    /// Why the broker's close failed, did not end within the cleanup timeout, or panicked
    /// (kind [`BrokerErrorKind::Panicked`](crate::BrokerErrorKind::Panicked)); `None` when it
    /// closed (or had nothing to close). Either way the shutdown went on: what the broker still
    /// held is left to its own expiry.
    pub broker_close_failed: Option<crate::broker::BrokerError>,
    /// The counters at the end.
    pub stats: Stats,
    /// What the supervisor was still dropping when the shutdown's bound ran out, and was not
    /// waited for: values leasehold did not write whose `Drop` had not returned (`"the
    /// broker"`, `"the jobs still queued"`), the removal of its own work root, or its own task.
    /// Empty when everything ended within the bound.
    pub outlived: Vec<String>,
}

/// The report of the shutdown that stopped the supervisor, kept for a later `shutdown()` call
/// (the actor writes it once, right before it stops), and what the supervisor drops at its
/// end.
#[derive(Debug, Default)]
pub(crate) struct LastReport {
    report: parking_lot::Mutex<Option<ShutdownReport>>,
    pub(crate) drops: Arc<EndDrops>,
}

impl LastReport {
    pub(crate) fn set(&self, report: ShutdownReport) {
        *self.report.lock() = Some(report);
    }

    pub(crate) fn get(&self) -> Option<ShutdownReport> {
        self.report.lock().clone()
    }
}

/// What the supervisor still holds at its end that leasehold did not write (the broker, the
/// closures of jobs that never ran) or that touches the file system (its own work root): each
/// is dropped off the actor's task, on the blocking pool, under the panic catch, so that a
/// `Drop` that blocks holds neither the actor nor `shutdown` past its bound. `shutdown` waits
/// for them within its bound, and names in its report what is still being dropped.
#[derive(Debug, Default)]
pub(crate) struct EndDrops {
    pending: parking_lot::Mutex<Vec<&'static str>>,
    done: tokio::sync::Notify,
}

/// Values the supervisor drops at its end (each on its own: one whose drop panics must not
/// unwind through the others), and what to call them if they outlive the bound.
pub(crate) type EndDrop = (&'static str, Vec<Box<dyn std::any::Any + Send>>);

/// One item of [`EndDrops::dispose`]: dropping it drops its values (each under the panic
/// catch) and then marks it done, wherever that happens (on the blocking pool, or wherever a
/// runtime shutting down drops the closure that was to run it).
struct Disposal {
    name: &'static str,
    values: Vec<Box<dyn std::any::Any + Send>>,
    owner: Arc<EndDrops>,
}

impl Drop for Disposal {
    fn drop(&mut self) {
        for value in std::mem::take(&mut self.values) {
            crate::outside::dispose(value);
        }
        let mut pending = self.owner.pending.lock();
        if let Some(at) = pending.iter().position(|p| *p == self.name) {
            pending.remove(at);
        }
        if pending.is_empty() {
            self.owner.done.notify_waiters();
        }
    }
}

impl EndDrops {
    /// Drops each of `items` off this thread, each on its own (so that one that blocks holds
    /// no other); inline when no runtime is left.
    pub(crate) fn dispose(self: &Arc<Self>, items: Vec<EndDrop>) {
        self.pending
            .lock()
            .extend(items.iter().map(|(name, _)| *name));
        let runtime = tokio::runtime::Handle::try_current().ok();
        for (name, values) in items {
            let one = Disposal {
                name,
                values,
                owner: Arc::clone(self),
            };
            match &runtime {
                Some(runtime) => {
                    crate::counters::task();
                    // A runtime that is shutting down drops the closure without running it:
                    // `Disposal`'s own `Drop` then does the same work where it is dropped.
                    drop(runtime.spawn_blocking(move || drop(one)));
                }
                None => drop(one),
            }
        }
    }

    /// Waits until everything handed to [`dispose`](Self::dispose) is dropped, or `deadline`;
    /// what is still being dropped then.
    pub(crate) async fn wait_until(&self, deadline: tokio::time::Instant) -> Vec<String> {
        loop {
            let done = self.done.notified();
            tokio::pin!(done);
            done.as_mut().enable();
            let pending = self.pending.lock().clone();
            if pending.is_empty() {
                return Vec::new();
            }
            if tokio::time::timeout_at(deadline, done).await.is_err() {
                return self
                    .pending
                    .lock()
                    .iter()
                    .map(|p| (*p).to_owned())
                    .collect();
            }
        }
    }
}

/// A GPU device a shutdown could not prove idle (see [`ShutdownReport::unclosed_devices`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct UnclosedDevice {
    /// The device's index; `None` when the close as a whole did not report (it panicked, or did
    /// not end within its bound), so that no device is known idle.
    pub device: Option<usize>,
    /// Why.
    pub reason: String,
}

impl UnclosedDevice {
    pub(crate) fn new(device: Option<usize>, reason: String) -> Self {
        Self { device, reason }
    }
}

/// A quarantined slot: held, not reusable, with the reason it could not be declared clean. A
/// quarantined k-slot lease is k of these, one per slot, with the same job and reason.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QuarantinedSlot {
    /// The slot's token (still held from the broker).
    pub token: SlotToken,
    /// The job that held it.
    pub job_id: Option<String>,
    /// Why its physical completion is not proven.
    pub reason: String,
}

/// What [`Supervisor::reclaim_quarantined`](crate::Supervisor::reclaim_quarantined) found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReclaimReport {
    /// Slots whose every re-check succeeded (every slot of a multi-slot lease): each process
    /// group proven empty, each temp dir retried and removed. Their tokens are being released.
    pub reclaimed: Vec<SlotToken>,
    /// Slots still quarantined, one entry per slot, with the reason: a re-check that failed
    /// again (a temp dir that still cannot be removed, a process group still alive), or a
    /// proof the reclaim cannot re-check (GPU work, a lost device). The report is given once
    /// every retried removal has ended, so it matches what
    /// [`Supervisor::quarantined`](crate::Supervisor::quarantined) lists then.
    pub still_quarantined: Vec<QuarantinedSlot>,
}

/// A caller waiting for slots, as [`Supervisor::waiters`](crate::Supervisor::waiters) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WaiterInfo {
    /// The job's id (`None` for an explicit `acquire`).
    pub job_id: Option<Arc<str>>,
    /// The class it waits in.
    pub priority: Priority,
    /// How many slots it asked for.
    pub slots: u32,
    /// Of those, how many it holds already: a multi-slot request at the head of the queue
    /// gathers its slots as they come back.
    pub gathered: u32,
    /// How long it has waited (zero for one that joined in the supervisor's current turn).
    pub waited: Duration,
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Set when dropped.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[test]
    fn what_a_runtime_that_is_gone_never_runs_is_dropped_and_done_at_once() {
        let gone = tokio::runtime::Runtime::new().unwrap();
        let handle = gone.handle().clone();
        drop(gone);
        let drops = Arc::new(EndDrops::default());
        let dropped = Arc::new(AtomicBool::new(false));
        {
            // The handle is still current (as in a task the ending runtime drops), but its
            // blocking pool is gone: tokio drops the closure without running it.
            let _current = handle.enter();
            drops.dispose(vec![(
                "the broker",
                vec![Box::new(Flag(Arc::clone(&dropped))) as Box<dyn std::any::Any + Send>],
            )]);
        }
        assert!(dropped.load(Ordering::SeqCst));
        // Done at once, not at the deadline: the paused clock would otherwise jump to it.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        rt.block_on(async {
            let start = tokio::time::Instant::now();
            let outlived = drops.wait_until(start + Duration::from_secs(30)).await;
            assert!(outlived.is_empty(), "{outlived:?}");
            assert_eq!(tokio::time::Instant::now(), start);
        });
    }
}
