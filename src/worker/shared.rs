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
    panics: Mutex<Vec<String>>,
    delivery_unknown: Mutex<Option<String>>,
    /// Process groups the job's keepers could not prove gone.
    unproven: Mutex<Vec<Unproven>>,
    /// The job's GPU, once checked out (read by the driver for the release fence).
    #[cfg(feature = "gpu")]
    gpu: Mutex<Option<crate::gpu::JobGpu>>,
    /// The job's GPU device was lost (device index, reason).
    #[cfg(feature = "gpu")]
    gpu_lost: Mutex<Option<(usize, String)>>,
    /// The job's GPU device could not be made usable; the body did not run.
    #[cfg(feature = "gpu")]
    gpu_unavailable: Mutex<Option<crate::gpu::GpuError>>,
    started: AtomicBool,
}

impl JobShared {
    pub(crate) fn new(cancel: CancellationToken) -> Self {
        Self {
            cancel,
            panics: Mutex::new(Vec::new()),
            delivery_unknown: Mutex::new(None),
            unproven: Mutex::new(Vec::new()),
            #[cfg(feature = "gpu")]
            gpu: Mutex::new(None),
            #[cfg(feature = "gpu")]
            gpu_lost: Mutex::new(None),
            #[cfg(feature = "gpu")]
            gpu_unavailable: Mutex::new(None),
            started: AtomicBool::new(false),
        }
    }

    pub(crate) fn record_panic(&self, payload: &(dyn Any + Send)) {
        let msg = if let Some(s) = payload.downcast_ref::<&'static str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "non-string panic payload".to_owned()
        };
        self.panics.lock().push(msg);
    }

    pub(crate) fn mark_delivery_unknown(&self, reason: String) {
        // The first reason is kept: it is the effect that was first in doubt.
        self.delivery_unknown.lock().get_or_insert(reason);
    }

    pub(crate) fn mark_unproven(&self, evidence: Unproven) {
        self.unproven.lock().push(evidence);
    }

    /// Read by the supervisor once the worker and every tracked task (keepers included) ended.
    pub(crate) fn take_unproven(&self) -> Vec<Unproven> {
        std::mem::take(&mut *self.unproven.lock())
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn set_gpu(&self, gpu: crate::gpu::JobGpu) {
        *self.gpu.lock() = Some(gpu);
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn gpu(&self) -> Option<crate::gpu::JobGpu> {
        self.gpu.lock().clone()
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn mark_gpu_lost(&self, device: usize, reason: String) {
        *self.gpu_lost.lock() = Some((device, reason));
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn take_gpu_lost(&self) -> Option<(usize, String)> {
        self.gpu_lost.lock().take()
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn set_gpu_unavailable(&self, err: crate::gpu::GpuError) {
        *self.gpu_unavailable.lock() = Some(err);
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn take_gpu_unavailable(&self) -> Option<crate::gpu::GpuError> {
        self.gpu_unavailable.lock().take()
    }

    pub(crate) fn take_panics(&self) -> Vec<String> {
        std::mem::take(&mut *self.panics.lock())
    }

    pub(crate) fn take_delivery_unknown(&self) -> Option<String> {
        self.delivery_unknown.lock().take()
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
