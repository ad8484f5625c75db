//! What a job borrows: `JobGpu` (its lease's device, queue and scratch).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use super::contain::BackendCall;
use super::device::GpuDevice;
use super::error::GpuError;
use super::handles::{JobHandles, SlotScratch};

/// The GPU of a job's lease: the device its slot belongs to, shared (cheap clones), never
/// created per job.
///
/// Safe to drop anywhere, including an async worker or the supervisor's mailbox: the last clone
/// drops the wgpu handles inside a panic guard (a backend panic there marks the device lost), and
/// when they may be the last handles of a replaced device, on tokio's blocking pool.
#[derive(Debug, Clone)]
pub struct JobGpu {
    pub(super) inner: Arc<JobGpuInner>,
}

pub(super) struct JobGpuInner {
    /// Always `Some` until `drop` takes it.
    handles: Option<JobHandles>,
    pub(super) sub: usize,
    pub(super) generation: u64,
    /// A count the job reads back; it publishes nothing else (`Relaxed`).
    submissions: AtomicU64,
    /// Whether the job asked for its scratch (`JobGpu::scratch`): a lease that never did cannot
    /// have written it, and its release skips the clear.
    scratch_used: AtomicBool,
    /// The latest submission made through the context.
    pub(super) last: Mutex<Option<wgpu::SubmissionIndex>>,
    pub(super) owner: Arc<GpuDevice>,
}

impl std::fmt::Debug for JobGpuInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobGpu")
            .field("device", &self.owner)
            .field("sub", &self.sub)
            .field("generation", &self.generation)
            .field("submissions", &self.submissions.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl JobGpuInner {
    pub(super) fn new(
        owner: Arc<GpuDevice>,
        sub: usize,
        generation: u64,
        handles: JobHandles,
    ) -> Self {
        Self {
            handles: Some(handles),
            sub,
            generation,
            submissions: AtomicU64::new(0),
            scratch_used: AtomicBool::new(false),
            last: Mutex::new(None),
            owner,
        }
    }

    pub(super) fn handles(&self) -> &JobHandles {
        self.handles
            .as_ref()
            .expect("a JobGpu's handles are taken only by its drop")
    }

    pub(super) fn device_index(&self) -> usize {
        self.owner.index
    }

    /// Read by the fence, after the worker and its tasks have ended: joining them orders every
    /// `scratch()` call before this load, so `Relaxed` is enough.
    pub(super) fn scratch_used(&self) -> bool {
        self.scratch_used.load(Ordering::Relaxed)
    }
}

impl Drop for JobGpuInner {
    fn drop(&mut self) {
        if let Some(handles) = self.handles.take() {
            self.owner
                .release_job_handles(self.generation, self.sub, handles);
        }
    }
}

impl JobGpu {
    /// The device (shared with the other slots of the same device).
    pub fn device(&self) -> &wgpu::Device {
        &self.inner.handles().device
    }

    /// The device's queue. Work submitted on it directly is covered too: the release waits for
    /// everything submitted on this queue before the worker ended.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.handles().queue
    }

    /// Which adapter the device runs on (its `backend` says Vulkan, GL, Metal or DX12).
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.owner.info
    }

    /// Which of the supervisor's devices.
    pub fn device_index(&self) -> usize {
        self.inner.device_index()
    }

    /// This slot's scratch buffers. With [`ScratchPolicy::Zeroed`](crate::ScratchPolicy) (the
    /// default), a lease that calls this has both buffers cleared after its fence; one that
    /// never does, has nothing of its own in them.
    pub fn scratch(&self) -> &SlotScratch {
        self.inner.scratch_used.store(true, Ordering::Relaxed);
        &self.inner.handles().scratch
    }

    /// Submits command buffers on the device's queue and records the submission for the
    /// lease's release fence.
    ///
    /// # Panics
    ///
    /// If the GPU backend panics in the submission: the device is marked lost first (the lease
    /// then ends with `LEASE_GPU_DEVICE_LOST` and the device is re-created), and the panic
    /// continues into the job. [`try_submit`](Self::try_submit) returns it as an error instead.
    pub fn submit<I: IntoIterator<Item = wgpu::CommandBuffer>>(
        &self,
        buffers: I,
    ) -> wgpu::SubmissionIndex {
        match self.try_submit(buffers) {
            Ok(index) => index,
            Err(err) => panic!("{err}"),
        }
    }

    /// [`submit`](Self::submit), with a panic of the GPU backend returned as
    /// [`GpuError::DeviceLost`] (the device is marked lost, as with any loss).
    ///
    /// # Errors
    ///
    /// [`GpuError::DeviceLost`] when the backend panicked in the submission.
    pub fn try_submit<I: IntoIterator<Item = wgpu::CommandBuffer>>(
        &self,
        buffers: I,
    ) -> Result<wgpu::SubmissionIndex, GpuError> {
        let inner = &self.inner;
        let submitted = inner.owner.guard.run(
            BackendCall::Submit,
            inner.device_index(),
            Some(inner.sub),
            || inner.handles().queue.submit(buffers),
        );
        match submitted {
            Ok(index) => {
                inner.submissions.fetch_add(1, Ordering::Relaxed);
                *inner.last.lock() = Some(index.clone());
                Ok(index)
            }
            Err(message) => {
                inner.owner.mark_lost(inner.generation, message.clone());
                Err(GpuError::DeviceLost(message))
            }
        }
    }

    /// How many submissions were made through [`submit`](Self::submit).
    pub fn submissions(&self) -> u64 {
        self.inner.submissions.load(Ordering::Relaxed)
    }

    /// Which creation of the device this is (1 at start, one more per re-creation).
    pub(crate) fn generation(&self) -> u64 {
        self.inner.generation
    }
}
