//! What a job's body, its sibling tasks and its caller share.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::process::Unproven;

/// Per-job record written by the worker and its tracked tasks, read by `run` only after the
/// whole release pipeline has finished (so after every writer has ended).
#[derive(Debug)]
pub(crate) struct JobShared {
    /// The job's own token: a child of the caller's token, cancelled also when the `run` future
    /// is dropped or the supervisor shuts down.
    pub(crate) cancel: CancellationToken,
    /// Allocated on the first write: most jobs never write any, and a queued job holds this
    /// record for as long as it waits.
    records: Mutex<Option<Box<Records>>>,
    started: AtomicBool,
}

/// What a job's body and tasks may record (see the accessors of [`JobShared`]).
#[derive(Debug, Default)]
struct Records {
    panics: Vec<String>,
    delivery_unknown: Option<String>,
    /// The broker could not keep the lease alive (why).
    lease_lost: Option<String>,
    /// Process groups the job's keepers could not prove gone.
    unproven: Vec<Unproven>,
    /// The job's GPU, once checked out (read by the driver for the release fence).
    #[cfg(feature = "gpu")]
    gpu: Option<crate::gpu::JobGpu>,
    /// The job's GPU device was lost (device index, reason).
    #[cfg(feature = "gpu")]
    gpu_lost: Option<(usize, String)>,
    /// The job's GPU device could not be made usable; the body did not run.
    #[cfg(feature = "gpu")]
    gpu_unavailable: Option<crate::gpu::GpuError>,
}

impl JobShared {
    pub(crate) fn new(cancel: CancellationToken) -> Self {
        Self {
            cancel,
            records: Mutex::new(None),
            started: AtomicBool::new(false),
        }
    }

    /// Writes a record, allocating the records on the first write.
    fn write<R>(&self, f: impl FnOnce(&mut Records) -> R) -> R {
        f(self.records.lock().get_or_insert_with(Box::default))
    }

    /// Reads (or takes) a record; `R::default()` when nothing was ever written.
    fn read<R: Default>(&self, f: impl FnOnce(&mut Records) -> R) -> R {
        self.records
            .lock()
            .as_deref_mut()
            .map(f)
            .unwrap_or_default()
    }

    pub(crate) fn record_panic(&self, payload: &(dyn Any + Send)) {
        let msg = if let Some(s) = payload.downcast_ref::<&'static str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "non-string panic payload".to_owned()
        };
        self.write(|r| r.panics.push(msg));
    }

    pub(crate) fn mark_delivery_unknown(&self, reason: String) {
        // The first reason is kept: it is the effect that was first in doubt.
        self.write(|r| {
            r.delivery_unknown.get_or_insert(reason);
        });
    }

    /// Records that the lease was lost; the first reason is kept.
    pub(crate) fn mark_lease_lost(&self, reason: String) {
        self.write(|r| {
            r.lease_lost.get_or_insert(reason);
        });
    }

    pub(crate) fn take_lease_lost(&self) -> Option<String> {
        self.read(|r| r.lease_lost.take())
    }

    pub(crate) fn mark_unproven(&self, evidence: Unproven) {
        self.write(|r| r.unproven.push(evidence));
    }

    /// Read by the supervisor once the worker and every tracked task (keepers included) ended.
    pub(crate) fn take_unproven(&self) -> Vec<Unproven> {
        self.read(|r| std::mem::take(&mut r.unproven))
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn set_gpu(&self, gpu: crate::gpu::JobGpu) {
        self.write(|r| r.gpu = Some(gpu));
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn gpu(&self) -> Option<crate::gpu::JobGpu> {
        self.read(|r| r.gpu.clone())
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn mark_gpu_lost(&self, device: usize, reason: String) {
        self.write(|r| r.gpu_lost = Some((device, reason)));
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn take_gpu_lost(&self) -> Option<(usize, String)> {
        self.read(|r| r.gpu_lost.take())
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn set_gpu_unavailable(&self, err: crate::gpu::GpuError) {
        self.write(|r| r.gpu_unavailable = Some(err));
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn take_gpu_unavailable(&self) -> Option<crate::gpu::GpuError> {
        self.read(|r| r.gpu_unavailable.take())
    }

    pub(crate) fn take_panics(&self) -> Vec<String> {
        self.read(|r| std::mem::take(&mut r.panics))
    }

    pub(crate) fn take_delivery_unknown(&self) -> Option<String> {
        self.read(|r| r.delivery_unknown.take())
    }

    // Relaxed is enough: the flag is read after the worker has been joined (a happens-before
    // edge through the supervisor's messages), or, when the supervisor died, only as a hint.
    pub(crate) fn mark_started(&self) {
        self.started.store(true, Ordering::Relaxed);
    }

    pub(crate) fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }
}
