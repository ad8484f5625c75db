//! What the supervisor shows of its GPU devices: the type `gpu::` builds and `Supervisor::gpu_devices`
//! returns, below both (and there without the `gpu` feature, where the list is empty).

/// A GPU device of the supervisor, as [`Supervisor::gpu_devices`](crate::Supervisor::gpu_devices)
/// lists it: a snapshot of the pool's own bookkeeping, read without a message to the actor.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuDeviceInfo {
    /// Its index (a lease's [`LeaseInfo::gpu_device`](crate::LeaseInfo::gpu_device)).
    pub index: usize,
    /// The adapter's name (`llvmpipe (LLVM 15.0.6, 256 bits)`, a GPU's model).
    pub adapter: String,
    /// The wgpu backend (`Vulkan`, `Gl`, `Metal`, `Dx12`).
    pub backend: String,
    /// The engine created it and handed it over (`GpuOptions::adopt`).
    pub adopted: bool,
    /// Its sub-slots, and how many of them serve a lease now (from the placement to the
    /// release, after the fence).
    pub sub_slots: u32,
    /// See [`sub_slots`](Self::sub_slots).
    pub in_use: u32,
    /// How many times it has been created or installed: 1 at start, one more per re-creation
    /// (or per replacement the engine handed over).
    pub generation: u64,
    /// Why its current generation is lost, while it is.
    pub lost: Option<String>,
    /// Given up for good: re-creation failed every attempt.
    pub given_up: bool,
}
