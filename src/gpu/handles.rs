//! The wgpu handles a lease holds: a sub-slot's scratch buffers and a job's device, queue and
//! scratch. Plain data, so that the device (which makes them) and the job (which holds them)
//! both depend on this file and not on each other.

/// One slot's scratch: a storage buffer the job may use for anything, and a mappable readback
/// buffer of the same size. The same buffers serve the sub-slot's leases one after another; by
/// default ([`ScratchPolicy::Zeroed`](crate::ScratchPolicy)) both are cleared to zero when a
/// lease takes them, by a clear queued after everything earlier leases submitted.
#[derive(Debug, Clone)]
pub struct SlotScratch {
    /// `STORAGE | COPY_SRC | COPY_DST`.
    pub storage: wgpu::Buffer,
    /// `MAP_READ | COPY_DST`.
    pub readback: wgpu::Buffer,
}

impl SlotScratch {
    pub(super) fn same_buffers(&self, other: &SlotScratch) -> bool {
        self.storage == other.storage && self.readback == other.readback
    }
}

/// The wgpu handles a `JobGpu` holds, let go of only through
/// `GpuDevice::release_job_handles`.
pub(super) struct JobHandles {
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) scratch: SlotScratch,
}
