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
    /// Whether it serves leases now.
    pub state: GpuDeviceState,
}

/// Whether a GPU device serves leases: usable, lost (being re-created, or, for an adopted
/// device, waiting for the engine's replacement), or given up for good.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuDeviceState {
    /// Its current generation serves leases.
    Usable,
    /// Its current generation is lost; its quarantined slots wait for a new one.
    Lost {
        /// Why (the driver's message, or the engine's `destroy()`).
        reason: String,
    },
    /// Re-creation failed every attempt (or the engine handed over no replacement when asked):
    /// no lease is placed on it again.
    GivenUp {
        /// Why its last generation was lost, when it was.
        reason: Option<String>,
    },
    /// Closed by the supervisor's shutdown.
    Closed,
}

impl GpuDeviceState {
    /// Whether it serves leases now.
    pub fn is_usable(&self) -> bool {
        matches!(self, Self::Usable)
    }

    /// Why its current generation is lost (also when it was given up after that loss).
    pub fn lost_reason(&self) -> Option<&str> {
        match self {
            Self::Usable | Self::Closed => None,
            Self::Lost { reason } => Some(reason),
            Self::GivenUp { reason } => reason.as_deref(),
        }
    }
}
