//! `GpuOptions` and the policies it carries.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::contain::BackendHook;

type AdapterFilter = Arc<dyn Fn(&wgpu::AdapterInfo) -> bool + Send + Sync>;

/// What the engine is asked for when a device it handed over is lost: its index and why.
pub(super) type ReplacementFor =
    Arc<dyn Fn(usize, &str) -> Option<(wgpu::Device, wgpu::Queue)> + Send + Sync>;

/// A device the engine created and handed over with [`GpuOptions::adopt`].
#[derive(Clone, Debug)]
pub(super) struct Adopted {
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    pub(super) info: wgpu::AdapterInfo,
}

/// Which GPUs a supervisor owns and how it shares them.
#[derive(Clone)]
pub struct GpuOptions {
    pub(super) backends: wgpu::Backends,
    pub(super) allow_software: bool,
    pub(super) slots_per_device: u32,
    /// Devices the supervisor opens itself: `None` means 1 without adopted devices, 0 with.
    max_devices: Option<usize>,
    pub(super) adopted: Vec<Adopted>,
    pub(super) replacement_for: Option<ReplacementFor>,
    adapter_filter: Option<AdapterFilter>,
    pub(super) fence_timeout: Duration,
    pub(super) scratch_bytes: u64,
    pub(super) recreate_attempts: u32,
    pub(super) recreate_backoff: Duration,
    pub(super) fence_policy: FencePolicy,
    pub(super) scratch_policy: ScratchPolicy,
    pub(super) backend_hook: Option<BackendHook>,
}

/// What a lease's release waits for on the GPU. Under either policy, a lease with no GPU work
/// (nothing submitted through [`JobGpu::submit`](crate::JobGpu::submit), and with `Queue` its
/// queue never taken) releases without a call into the GPU backend: no poll, no submission, no
/// wait. A loss of its device already known fails a lease all the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FencePolicy {
    /// A lease that took its queue ([`JobGpu::queue`](crate::JobGpu::queue)) is waited for up
    /// to everything submitted on the device's queue before its fence (default): that covers
    /// work it submitted directly on the queue and writes it left pending, at the price of also
    /// waiting for other slots' (and, on an adopted device, the engine's) work queued before
    /// it. A lease that never took its queue is waited for up to its last submission through
    /// [`JobGpu::submit`](crate::JobGpu::submit), and what the queue runs before it.
    #[default]
    Queue,
    /// Only the submissions made through [`JobGpu::submit`](crate::JobGpu::submit): for jobs
    /// that never submit on the queue directly. A job that submitted nothing through it is not
    /// waited for at all.
    Recorded,
}

/// What happens to a slot's scratch buffers between two leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ScratchPolicy {
    /// Both scratch buffers are cleared to zero when a lease takes them
    /// ([`JobGpu::scratch`](crate::JobGpu::scratch)), by a clear submitted on the device's
    /// queue: after everything earlier leases submitted, before anything the lease submits
    /// after the take (default). No lease ever reads what an earlier holder left, whether its
    /// writes had completed, were still running, or left the readback buffer mapped. A lease
    /// that never takes its scratch costs no clear, and no lease's release waits for one.
    #[default]
    Zeroed,
    /// The scratch is handed on as the previous lease left it (a mapping it left on the
    /// readback buffer included). Only for jobs that overwrite every byte of scratch they read;
    /// saves the clear of both buffers when a lease takes them.
    Reused,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self::new()
    }
}

/// The backends this build can open, in the order a platform prefers them: Vulkan and GL
/// (EGL) on Linux and other Unixes, Metal on Apple platforms, DX12, Vulkan and GL (WGL) on
/// Windows. `Cargo.toml` enables exactly these wgpu backends per target.
pub(super) fn platform_backends() -> wgpu::Backends {
    if cfg!(target_vendor = "apple") {
        wgpu::Backends::METAL
    } else if cfg!(windows) {
        wgpu::Backends::DX12 | wgpu::Backends::VULKAN | wgpu::Backends::GL
    } else {
        wgpu::Backends::VULKAN | wgpu::Backends::GL
    }
}

impl GpuOptions {
    /// The platform's backends (Vulkan and GL on Linux, Metal on macOS, DX12, Vulkan and GL on
    /// Windows) unless `WGPU_BACKEND` names others (`WGPU_BACKEND=gl` forces GL, as wgpu's own
    /// tools do); software adapters accepted, one device, one slot per device, a 10 s fence
    /// bound, 1 MiB of scratch per buffer, zeroed between leases, five re-creation attempts
    /// from 50 ms apart.
    pub fn new() -> Self {
        Self {
            backends: wgpu::Backends::from_env().unwrap_or_else(platform_backends),
            allow_software: true,
            slots_per_device: 1,
            max_devices: None,
            adopted: Vec::new(),
            replacement_for: None,
            adapter_filter: None,
            fence_timeout: Duration::from_secs(10),
            scratch_bytes: 1 << 20,
            recreate_attempts: 5,
            recreate_backoff: Duration::from_millis(50),
            fence_policy: FencePolicy::Queue,
            scratch_policy: ScratchPolicy::Zeroed,
            backend_hook: None,
        }
    }

    /// Which wgpu backends to look at (overrides `WGPU_BACKEND`). A backend this build does
    /// not include (see [Backends](crate::gpu#backends)) finds no adapter.
    pub fn backends(mut self, backends: wgpu::Backends) -> Self {
        self.backends = backends;
        self
    }

    /// Whether a software adapter (lavapipe, llvmpipe: device type `Cpu`) is acceptable.
    pub fn allow_software(mut self, allow: bool) -> Self {
        self.allow_software = allow;
        self
    }

    /// How many leases may use one device at once (default 1).
    pub fn slots_per_device(mut self, n: u32) -> Self {
        self.slots_per_device = n;
        self
    }

    /// How many devices the supervisor opens itself, at most: the first acceptable adapters,
    /// hardware before software. Default 1, or 0 once a device is [adopted](Self::adopt): an
    /// engine that hands its own device over gets no second one unless it asks.
    pub fn max_devices(mut self, n: usize) -> Self {
        self.max_devices = Some(n);
        self
    }

    /// Gives the supervisor sub-slots on a device the engine created and keeps using: the
    /// supervisor holds clones of `device` and `queue` (types from [`leasehold::wgpu`](crate::wgpu))
    /// and shares them among [`slots_per_device`](Self::slots_per_device) leases, with
    /// placement, the fence-gated release and scratch isolation as on its own devices. Call it
    /// once per device; adopted devices come first, in the order of the calls (indices 0, 1,
    /// ...), then the devices the supervisor opens itself ([`max_devices`](Self::max_devices),
    /// 0 by default once a device is adopted).
    ///
    /// What leasehold owns and what the engine keeps:
    /// - leasehold never re-creates, destroys or polls to completion a device it adopted: at
    ///   `shutdown()` it drops its clones and the engine keeps rendering with the device;
    /// - the queue is shared: the engine's own submissions are never counted against a lease.
    ///   With [`FencePolicy::Queue`] (the default) the fence of a lease that took its queue
    ///   also waits for engine work queued before it (bounded by
    ///   [`fence_timeout`](Self::fence_timeout)); [`FencePolicy::Recorded`] waits only for what
    ///   the job submitted through [`JobGpu::submit`](crate::JobGpu::submit), and neither
    ///   submits anything at the release (a lease's scratch is cleared when it takes it);
    /// - what jobs and [`Supervisor::gpu_devices`](crate::Supervisor::gpu_devices) report as
    ///   the adapter is the device's own (`wgpu::Device::adapter_info`), also after a
    ///   replacement from another adapter or backend; `info` is only logged;
    /// - leasehold sets the device's lost callback (wgpu keeps one per device), on a device it
    ///   accepts only (one [`Supervisor::replace_device`](crate::Supervisor::replace_device)
    ///   refuses is left as it came): the engine hears of a loss through
    ///   [`replacement_for_lost`](Self::replacement_for_lost). When an adopted device is lost,
    ///   the leases with GPU work on it end `LEASE_GPU_DEVICE_LOST` and their slots stay
    ///   quarantined until the engine hands a replacement over, through that callback or
    ///   `replace_device`; other devices keep serving meanwhile, and `shutdown()` does not wait
    ///   for the replacement: it reports those slots quarantined;
    /// - a replacement of a device that is not lost is allowed: leases already on the old
    ///   device keep its handles, are fenced on it, and end as usual (only a loss of that
    ///   device fails them).
    pub fn adopt(
        mut self,
        device: wgpu::Device,
        queue: wgpu::Queue,
        info: wgpu::AdapterInfo,
    ) -> Self {
        self.adopted.push(Adopted {
            device,
            queue,
            info,
        });
        self
    }

    /// Called when an adopted device is lost, with its index and the reason: the engine may
    /// return a replacement device and queue at once (`None`: it will call
    /// [`Supervisor::replace_device`](crate::Supervisor::replace_device) later, or never). It
    /// runs on a blocking thread, never in the supervisor's mailbox; a panic in it counts as
    /// `None`.
    pub fn replacement_for_lost(
        mut self,
        replacement: impl Fn(usize, &str) -> Option<(wgpu::Device, wgpu::Queue)> + Send + Sync + 'static,
    ) -> Self {
        self.replacement_for = Some(Arc::new(replacement));
        self
    }

    /// How many devices the supervisor opens itself (see [`max_devices`](Self::max_devices)).
    pub(super) fn own_devices(&self) -> usize {
        self.max_devices
            .unwrap_or(if self.adopted.is_empty() { 1 } else { 0 })
    }

    /// Only adapters for which `filter` returns `true`.
    pub fn adapter_filter(
        mut self,
        filter: impl Fn(&wgpu::AdapterInfo) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.adapter_filter = Some(Arc::new(filter));
        self
    }

    /// How long the release waits for a lease's GPU work before quarantining the slot; also
    /// the bound of the wait for each device's remaining work at shutdown.
    pub fn fence_timeout(mut self, timeout: Duration) -> Self {
        self.fence_timeout = timeout;
        self
    }

    /// What a lease's release waits for on the GPU (default [`FencePolicy::Queue`]).
    pub fn fence_policy(mut self, policy: FencePolicy) -> Self {
        self.fence_policy = policy;
        self
    }

    /// Whether a slot's scratch is zeroed between leases (default [`ScratchPolicy::Zeroed`]).
    pub fn scratch_policy(mut self, policy: ScratchPolicy) -> Self {
        self.scratch_policy = policy;
        self
    }

    /// Size of each slot's scratch storage buffer (and of its readback buffer), rounded up to a
    /// multiple of 4 bytes (wgpu's copy and clear alignment).
    pub fn scratch_bytes(mut self, bytes: u64) -> Self {
        self.scratch_bytes = bytes;
        self
    }

    /// Re-creation of a lost device: attempts, and the first delay between them (doubling).
    pub fn recreate_policy(mut self, attempts: u32, first_backoff: Duration) -> Self {
        self.recreate_attempts = attempts.max(1);
        self.recreate_backoff = first_backoff;
        self
    }

    /// Fault injection (feature `fault-injection`, for leasehold's own tests): `hook` runs
    /// inside the guard of every backend call the pool makes, just before the call; a hook that
    /// panics stands for a backend that panics there.
    #[cfg(feature = "fault-injection")]
    #[doc(hidden)]
    pub fn backend_hook(
        mut self,
        hook: impl Fn(super::contain::BackendCall, usize, Option<usize>) + Send + Sync + 'static,
    ) -> Self {
        self.backend_hook = Some(Arc::new(hook));
        self
    }

    pub(super) fn accepts(&self, info: &wgpu::AdapterInfo) -> bool {
        (self.allow_software || info.device_type != wgpu::DeviceType::Cpu)
            && self.adapter_filter.as_ref().is_none_or(|f| f(info))
    }

    /// The scratch size actually allocated: at least 4 bytes, a multiple of 4.
    pub(super) fn scratch_size(&self) -> u64 {
        self.scratch_bytes
            .max(wgpu::COPY_BUFFER_ALIGNMENT)
            .next_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT)
    }
}

impl fmt::Debug for GpuOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuOptions")
            .field("backends", &self.backends)
            .field("allow_software", &self.allow_software)
            .field("slots_per_device", &self.slots_per_device)
            .field("max_devices", &self.own_devices())
            .field("adopted", &self.adopted.len())
            .field("adapter_filter", &self.adapter_filter.is_some())
            .field("fence_timeout", &self.fence_timeout)
            .field("fence_policy", &self.fence_policy)
            .field("scratch_bytes", &self.scratch_bytes)
            .field("scratch_policy", &self.scratch_policy)
            .field("recreate_attempts", &self.recreate_attempts)
            .field("recreate_backoff", &self.recreate_backoff)
            .finish_non_exhaustive()
    }
}
