//! What a job borrows: `JobGpu` (its lease's device, queue and scratch).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::contain::BackendCall;
use super::device::{Generation, GpuDevice, Zeroing};
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
    /// The generation of the device the lease checked out: its fence waits there, and only
    /// its own loss fails the lease.
    pub(super) generation: Arc<Generation>,
    /// Clear the scratch when the job takes it ([`ScratchPolicy::Zeroed`](super::ScratchPolicy)).
    zero: bool,
    /// The scratch the job took (`JobGpu::scratch`), once it has: cleared first, or new
    /// buffers when the old ones could not be cleared; `Err` when neither could be done.
    taken: OnceLock<Result<SlotScratch, GpuError>>,
    /// Whether the job took the queue (`JobGpu::queue`): only then can it have submitted on it
    /// directly. Read by the fence after the worker and its tasks have ended (joining them
    /// orders every store before the load: `Relaxed`).
    queue_taken: AtomicBool,
    /// A count the job reads back; it publishes nothing else (`Relaxed`).
    submissions: AtomicU64,
    /// The latest submission made through the context, and whether the lease's fence has
    /// begun (then nothing more is submitted or handed out: see [`JobGpuInner::end`]).
    last: Mutex<Last>,
    pub(super) owner: Arc<GpuDevice>,
}

impl std::fmt::Debug for JobGpuInner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobGpu")
            .field("device", &self.owner)
            .field("sub", &self.sub)
            .field("generation", &self.generation.number)
            .field("submissions", &self.submissions.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// See [`JobGpuInner::last`].
#[derive(Default)]
struct Last {
    index: Option<wgpu::SubmissionIndex>,
    ended: bool,
}

impl JobGpuInner {
    /// The lease's fence begins: from now on a clone kept past the job submits nothing and
    /// gets no scratch ([`GpuError::LeaseEnded`]). The latest submission made before, which
    /// the fence waits for: a submission holds the same lock while it is made, so none can
    /// slip in between.
    pub(super) fn end(&self) -> Option<wgpu::SubmissionIndex> {
        let mut last = self.last.lock();
        last.ended = true;
        last.index.clone()
    }

    fn ended(&self) -> bool {
        self.last.lock().ended
    }

    pub(super) fn new(
        owner: Arc<GpuDevice>,
        sub: usize,
        generation: Arc<Generation>,
        handles: JobHandles,
        zero: bool,
    ) -> Self {
        Self {
            handles: Some(handles),
            sub,
            generation,
            zero,
            taken: OnceLock::new(),
            queue_taken: AtomicBool::new(false),
            submissions: AtomicU64::new(0),
            last: Mutex::new(Last::default()),
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

    /// Whether the job took the queue (see `queue_taken`).
    pub(super) fn queue_taken(&self) -> bool {
        self.queue_taken.load(Ordering::Relaxed)
    }

    /// The job's first take of its scratch: cleared on the queue before anything the job
    /// submits after it, or replaced by new buffers if wgpu refuses the clear. A backend panic
    /// is a loss of the lease's device generation.
    fn take_scratch(&self) -> Result<SlotScratch, GpuError> {
        let h = self.handles();
        if !self.zero {
            return Ok(h.scratch.clone());
        }
        let owner = &self.owner;
        match owner.zero_scratch(self.sub, &h.device, &h.queue, &h.scratch) {
            Ok(Zeroing::Submitted) => Ok(h.scratch.clone()),
            Ok(Zeroing::Refused(why)) => owner
                .replace_scratch(&self.generation, self.sub, &h.device, &why)
                .map_err(GpuError::DeviceLost),
            Err(message) => {
                owner.mark_lost(&self.generation, message.clone());
                Err(GpuError::DeviceLost(message))
            }
        }
    }
}

impl Drop for JobGpuInner {
    fn drop(&mut self) {
        if let Some(handles) = self.handles.take() {
            let taken = self.taken.take().and_then(Result::ok);
            self.owner
                .release_job_handles(&self.generation, self.sub, handles, taken);
        }
    }
}

impl JobGpu {
    /// The device (shared with the other slots of the same device).
    pub fn device(&self) -> &wgpu::Device {
        &self.inner.handles().device
    }

    /// The device's queue. Work submitted on it directly is covered too: with
    /// [`FencePolicy::Queue`](crate::FencePolicy) (the default), the release of a lease that
    /// took its queue waits for everything submitted on it before the worker ended.
    pub fn queue(&self) -> &wgpu::Queue {
        self.inner.queue_taken.store(true, Ordering::Relaxed);
        &self.inner.handles().queue
    }

    /// Which adapter the device runs on (its `backend` says Vulkan, GL, Metal or DX12): the
    /// device's own, also after the engine replaced a device with one from another adapter.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.generation.info
    }

    /// Which of the supervisor's devices.
    pub fn device_index(&self) -> usize {
        self.inner.device_index()
    }

    /// This slot's scratch buffers. With [`ScratchPolicy::Zeroed`](crate::ScratchPolicy) (the
    /// default), the first call clears both buffers: a clear submitted on the device's queue,
    /// so it runs before anything the job submits after it, after anything an earlier lease
    /// left on the queue, and without the release waiting for it. A lease that never calls
    /// this costs no clear.
    ///
    /// The first call submits on the queue, as [`submit`](Self::submit) does: on GL it waits
    /// for the device's context, which another thread's blocking poll may hold.
    ///
    /// # Panics
    ///
    /// If the GPU backend panicked in the clear, or the scratch could neither be cleared nor
    /// replaced by new buffers: the device is marked lost first (the lease then ends with
    /// `LEASE_GPU_DEVICE_LOST`), and the panic continues into the job (it is never handed
    /// scratch that may hold another lease's data). Also on a clone kept past its lease
    /// ([`GpuError::LeaseEnded`]). [`try_scratch`](Self::try_scratch) returns it as an error
    /// instead.
    pub fn scratch(&self) -> &SlotScratch {
        match self.try_scratch() {
            Ok(scratch) => scratch,
            Err(err) => panic!("{err}"),
        }
    }

    /// [`scratch`](Self::scratch), with a failure returned as [`GpuError::DeviceLost`] (the
    /// device is marked lost, as with any loss). Every call after the first answers the same.
    ///
    /// # Errors
    ///
    /// [`GpuError::DeviceLost`] when the backend panicked in the clear, or the scratch could
    /// neither be cleared nor replaced. [`GpuError::LeaseEnded`] (`LEASE_RELEASED`) on a clone
    /// kept past its lease: the sub-slot's scratch may already be another lease's.
    pub fn try_scratch(&self) -> Result<&SlotScratch, GpuError> {
        if self.inner.ended() {
            return Err(GpuError::LeaseEnded);
        }
        self.inner
            .taken
            .get_or_init(|| self.inner.take_scratch())
            .as_ref()
            .map_err(Clone::clone)
    }

    /// Submits command buffers on the device's queue and records the submission for the
    /// lease's release fence.
    ///
    /// # Panics
    ///
    /// If the GPU backend panics in the submission: the device is marked lost first (the lease
    /// then ends with `LEASE_GPU_DEVICE_LOST` and the device is re-created), and the panic
    /// continues into the job. Also on a clone kept past its lease ([`GpuError::LeaseEnded`]).
    /// [`try_submit`](Self::try_submit) returns it as an error instead.
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
    /// [`GpuError::LeaseEnded`] (`LEASE_RELEASED`) on a clone kept past its lease: its fence
    /// has begun, and nothing submitted after it would be waited for.
    pub fn try_submit<I: IntoIterator<Item = wgpu::CommandBuffer>>(
        &self,
        buffers: I,
    ) -> Result<wgpu::SubmissionIndex, GpuError> {
        let inner = &self.inner;
        // Held while the submission is made: the fence's start (`end`) comes before it, and
        // refuses it, or after it, and waits for it.
        let mut last = inner.last.lock();
        if last.ended {
            return Err(GpuError::LeaseEnded);
        }
        let submitted = inner.owner.guard.run(
            BackendCall::Submit,
            inner.device_index(),
            Some(inner.sub),
            || inner.handles().queue.submit(buffers),
        );
        match submitted {
            Ok(index) => {
                inner.submissions.fetch_add(1, Ordering::Relaxed);
                last.index = Some(index.clone());
                Ok(index)
            }
            Err(message) => {
                inner.owner.mark_lost(&inner.generation, message.clone());
                Err(GpuError::DeviceLost(message))
            }
        }
    }

    /// How many submissions were made through [`submit`](Self::submit).
    pub fn submissions(&self) -> u64 {
        self.inner.submissions.load(Ordering::Relaxed)
    }

    /// Which creation of the device this is (1 at start, one more per re-creation or
    /// replacement).
    pub(crate) fn generation(&self) -> u64 {
        self.inner.generation.number
    }
}
