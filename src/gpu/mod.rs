//! GPU devices owned by the supervisor (feature `gpu`).
//!
//! The pool creates every device once, at start. A GPU slot is a *sub-slot* of one device:
//! `slots_per_device` per device, each with scratch buffers of its own that are reused from one
//! lease to the next only after the previous lease's GPU work has completed. The supervisor
//! places a new lease on the least-loaded device (bookkeeping only, in its mailbox); the worker
//! checks the device out before the body runs (re-creating a lost device on the way, one creator
//! at a time, with backoff); after the worker has physically ended, the release waits for every
//! submission made on the device's queue before that point (a blocking poll on the blocking pool,
//! never in the supervisor's mailbox).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;

type AdapterFilter = Arc<dyn Fn(&wgpu::AdapterInfo) -> bool + Send + Sync>;

/// Which GPUs a supervisor owns and how it shares them.
#[derive(Clone)]
pub struct GpuOptions {
    backends: wgpu::Backends,
    allow_software: bool,
    slots_per_device: u32,
    max_devices: usize,
    adapter_filter: Option<AdapterFilter>,
    fence_timeout: Duration,
    scratch_bytes: u64,
    recreate_attempts: u32,
    recreate_backoff: Duration,
    fence_policy: FencePolicy,
}

/// What a lease's release waits for on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum FencePolicy {
    /// Everything submitted on the device's queue before the fence (default): covers work a
    /// job submitted directly on the queue, at the price of also waiting for other slots' work
    /// queued before it when a device has several slots.
    #[default]
    Queue,
    /// Only the submissions made through [`JobGpu::submit`]: for jobs that never submit on the
    /// queue directly. A job that submitted nothing through it is not waited for at all.
    Recorded,
}

impl Default for GpuOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl GpuOptions {
    /// Vulkan and GL backends, software adapters accepted, one device, one slot per device,
    /// a 10 s fence bound, 1 MiB of scratch per slot, five re-creation attempts from 50 ms apart.
    pub fn new() -> Self {
        Self {
            backends: wgpu::Backends::VULKAN | wgpu::Backends::GL,
            allow_software: true,
            slots_per_device: 1,
            max_devices: 1,
            adapter_filter: None,
            fence_timeout: Duration::from_secs(10),
            scratch_bytes: 1 << 20,
            recreate_attempts: 5,
            recreate_backoff: Duration::from_millis(50),
            fence_policy: FencePolicy::Queue,
        }
    }

    /// Which wgpu backends to look at.
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

    /// How many devices to open at most (default 1): the first acceptable adapters, hardware
    /// before software.
    pub fn max_devices(mut self, n: usize) -> Self {
        self.max_devices = n;
        self
    }

    /// Only adapters for which `filter` returns `true`.
    pub fn adapter_filter(
        mut self,
        filter: impl Fn(&wgpu::AdapterInfo) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.adapter_filter = Some(Arc::new(filter));
        self
    }

    /// How long the release waits for a lease's GPU work before quarantining the slot.
    pub fn fence_timeout(mut self, timeout: Duration) -> Self {
        self.fence_timeout = timeout;
        self
    }

    /// What a lease's release waits for on the GPU (default [`FencePolicy::Queue`]).
    pub fn fence_policy(mut self, policy: FencePolicy) -> Self {
        self.fence_policy = policy;
        self
    }

    /// Size of each slot's scratch storage buffer (and of its readback buffer).
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

    fn accepts(&self, info: &wgpu::AdapterInfo) -> bool {
        (self.allow_software || info.device_type != wgpu::DeviceType::Cpu)
            && self.adapter_filter.as_ref().is_none_or(|f| f(info))
    }
}

impl fmt::Debug for GpuOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuOptions")
            .field("backends", &self.backends)
            .field("allow_software", &self.allow_software)
            .field("slots_per_device", &self.slots_per_device)
            .field("max_devices", &self.max_devices)
            .field("adapter_filter", &self.adapter_filter.is_some())
            .field("fence_timeout", &self.fence_timeout)
            .field("scratch_bytes", &self.scratch_bytes)
            .finish()
    }
}

/// A GPU failure of the pool.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum GpuError {
    /// No acceptable adapter was found (`GPU_UNAVAILABLE`).
    NoAdapter,
    /// A device could not be created (`GPU_UNAVAILABLE`).
    CreateFailed(String),
    /// The device was lost (`LEASE_GPU_DEVICE_LOST`).
    DeviceLost(String),
}

impl GpuError {
    /// `GPU_UNAVAILABLE` or `LEASE_GPU_DEVICE_LOST`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoAdapter | Self::CreateFailed(_) => "GPU_UNAVAILABLE",
            Self::DeviceLost(_) => "LEASE_GPU_DEVICE_LOST",
        }
    }
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoAdapter => f.write_str("no acceptable gpu adapter"),
            Self::CreateFailed(m) => write!(f, "gpu device creation failed: {m}"),
            Self::DeviceLost(m) => write!(f, "gpu device lost: {m}"),
        }
    }
}

impl std::error::Error for GpuError {}

/// One slot's scratch: a storage buffer the job may use for anything, and a mappable readback
/// buffer of the same size. Reused by the slot's next lease only after this lease's GPU work
/// has completed.
#[derive(Debug, Clone)]
pub struct SlotScratch {
    /// `STORAGE | COPY_SRC | COPY_DST`.
    pub storage: wgpu::Buffer,
    /// `MAP_READ | COPY_DST`.
    pub readback: wgpu::Buffer,
}

/// The GPU of a job's lease: the device its slot belongs to, shared (cheap clones), never
/// created per job.
#[derive(Debug, Clone)]
pub struct JobGpu {
    inner: Arc<JobGpuInner>,
}

#[derive(Debug)]
struct JobGpuInner {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    scratch: SlotScratch,
    device_index: usize,
    generation: u64,
    submissions: AtomicU64,
    /// The latest submission made through the context.
    last: Mutex<Option<wgpu::SubmissionIndex>>,
    owner: Arc<GpuDevice>,
}

impl JobGpu {
    /// The device (shared with the other slots of the same device).
    pub fn device(&self) -> &wgpu::Device {
        &self.inner.device
    }

    /// The device's queue. Work submitted on it directly is covered too: the release waits for
    /// everything submitted on this queue before the worker ended.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.inner.queue
    }

    /// Which adapter the device runs on.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.inner.info
    }

    /// Which of the supervisor's devices.
    pub fn device_index(&self) -> usize {
        self.inner.device_index
    }

    /// This slot's scratch buffers.
    pub fn scratch(&self) -> &SlotScratch {
        &self.inner.scratch
    }

    /// Submits command buffers on the device's queue and records the submission for the
    /// lease's release fence.
    pub fn submit<I: IntoIterator<Item = wgpu::CommandBuffer>>(
        &self,
        buffers: I,
    ) -> wgpu::SubmissionIndex {
        let index = self.inner.queue.submit(buffers);
        self.inner.submissions.fetch_add(1, Ordering::Relaxed);
        *self.inner.last.lock() = Some(index.clone());
        index
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

/// The state of one device.
struct DevState {
    handles: Option<(wgpu::Device, wgpu::Queue)>,
    generation: u64,
    lost: Option<String>,
    /// No more attempts will be made.
    dead: bool,
    /// Per sub-slot scratch of the current generation.
    scratch: Vec<Option<SlotScratch>>,
}

pub(crate) struct GpuDevice {
    index: usize,
    info: wgpu::AdapterInfo,
    state: Mutex<DevState>,
    /// One creator at a time; the others wait and then see the new device.
    create_lock: tokio::sync::Mutex<()>,
}

impl fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuDevice")
            .field("index", &self.index)
            .field("adapter", &self.info.name)
            .finish()
    }
}

/// How a lease's GPU fence ended badly.
pub(crate) enum FenceFailure {
    /// The work did not complete within the bound: the slot is quarantined until the wait,
    /// which goes on, ends.
    Timeout {
        after: Duration,
        still_waiting: futures_util::future::BoxFuture<'static, ()>,
    },
    /// The device was lost: the slot is quarantined until the device is replaced.
    Lost { device: usize, reason: String },
}

/// Called (off the mailbox) when a lost device has been replaced.
pub(crate) type ReplacedHook = Box<dyn Fn(usize) + Send + Sync>;

/// Every device of a supervisor, and which sub-slots are in use.
pub(crate) struct GpuPool {
    instance: wgpu::Instance,
    opts: GpuOptions,
    devices: Vec<Arc<GpuDevice>>,
    busy: Mutex<Vec<Vec<bool>>>,
    replaced: OnceLock<ReplacedHook>,
}

impl fmt::Debug for GpuPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuPool")
            .field("devices", &self.devices)
            .finish()
    }
}

/// Where a lease runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) device: usize,
    pub(crate) sub: usize,
}

impl GpuPool {
    /// Opens up to `max_devices` acceptable adapters, hardware first.
    pub(crate) async fn open(opts: GpuOptions) -> Result<Self, GpuError> {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = opts.backends;
        let instance = wgpu::Instance::new(desc);
        let mut adapters: Vec<_> = instance
            .enumerate_adapters(opts.backends)
            .await
            .into_iter()
            .filter(|a| opts.accepts(&a.get_info()))
            .collect();
        adapters.sort_by_key(|a| {
            (
                a.get_info().device_type == wgpu::DeviceType::Cpu,
                a.get_info().backend != wgpu::Backend::Vulkan,
            )
        });
        adapters.truncate(opts.max_devices.max(1));
        if adapters.is_empty() {
            return Err(GpuError::NoAdapter);
        }
        let mut devices = Vec::new();
        for (index, adapter) in adapters.into_iter().enumerate() {
            let info = adapter.get_info();
            let dev = Arc::new(GpuDevice {
                index,
                info,
                state: Mutex::new(DevState {
                    handles: None,
                    generation: 0,
                    lost: None,
                    dead: false,
                    scratch: vec![None; opts.slots_per_device as usize],
                }),
                create_lock: tokio::sync::Mutex::new(()),
            });
            let (device, queue) = request(&adapter).await?;
            install(&dev, device, queue);
            tracing::info!(index, adapter = %dev.info.name, backend = ?dev.info.backend, "gpu device ready");
            devices.push(dev);
        }
        let busy = vec![vec![false; opts.slots_per_device as usize]; devices.len()];
        Ok(Self {
            instance,
            opts,
            devices,
            busy: Mutex::new(busy),
            replaced: OnceLock::new(),
        })
    }

    pub(crate) fn set_replaced_hook(&self, hook: ReplacedHook) {
        let _ = self.replaced.set(hook);
    }

    /// GPU sub-slots in all.
    pub(crate) fn capacity(&self) -> u32 {
        self.devices.len() as u32 * self.opts.slots_per_device
    }

    /// Places a lease on the least-loaded device that is not dead and has a free sub-slot.
    pub(crate) fn place(&self) -> Option<Placement> {
        let mut busy = self.busy.lock();
        let dead: Vec<bool> = self.devices.iter().map(|d| d.state.lock().dead).collect();
        let placement = least_loaded(&busy, &dead)?;
        busy[placement.device][placement.sub] = true;
        Some(placement)
    }

    /// The sub-slot may serve another lease (called after its fence, at the release).
    pub(crate) fn free(&self, placement: Placement) {
        self.busy.lock()[placement.device][placement.sub] = false;
    }

    /// The device and scratch for a placed lease, re-creating a lost device first.
    pub(crate) async fn checkout(&self, placement: Placement) -> Result<JobGpu, GpuError> {
        let dev = &self.devices[placement.device];
        self.ensure_ready(dev).await?;
        let mut state = dev.state.lock();
        let (device, queue) = state
            .handles
            .clone()
            .ok_or_else(|| GpuError::DeviceLost("device gone".into()))?;
        let generation = state.generation;
        let scratch = state.scratch[placement.sub]
            .get_or_insert_with(|| make_scratch(&device, self.opts.scratch_bytes, placement))
            .clone();
        drop(state);
        Ok(JobGpu {
            inner: Arc::new(JobGpuInner {
                device,
                queue,
                info: dev.info.clone(),
                scratch,
                device_index: placement.device,
                generation,
                submissions: AtomicU64::new(0),
                last: Mutex::new(None),
                owner: Arc::clone(dev),
            }),
        })
    }

    /// Makes sure the device is usable: if it was lost, one caller re-creates it (with backoff)
    /// while the others wait for that caller.
    async fn ensure_ready(&self, dev: &Arc<GpuDevice>) -> Result<(), GpuError> {
        if dev.usable() {
            return Ok(());
        }
        let _creator = dev.create_lock.lock().await;
        if dev.usable() {
            return Ok(());
        }
        if dev.state.lock().dead {
            return Err(GpuError::CreateFailed(format!(
                "device {} could not be re-created",
                dev.index
            )));
        }
        let mut backoff = self.opts.recreate_backoff;
        let mut last = String::new();
        for attempt in 1..=self.opts.recreate_attempts {
            match self.recreate(dev).await {
                Ok((device, queue)) => {
                    install(dev, device, queue);
                    tracing::info!(index = dev.index, attempt, "lost gpu device re-created");
                    if let Some(hook) = self.replaced.get() {
                        hook(dev.index);
                    }
                    return Ok(());
                }
                Err(e) => {
                    tracing::warn!(index = dev.index, attempt, error = %e, "gpu device re-creation failed");
                    last = e.to_string();
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
            }
        }
        dev.state.lock().dead = true;
        if let Some(hook) = self.replaced.get() {
            // Tell the supervisor the device will not come back: its quarantined slots go.
            hook(dev.index);
        }
        Err(GpuError::CreateFailed(last))
    }

    /// A fresh device on the same adapter (an adapter serves one `request_device`).
    async fn recreate(&self, dev: &GpuDevice) -> Result<(wgpu::Device, wgpu::Queue), GpuError> {
        let adapter = self
            .instance
            .enumerate_adapters(self.opts.backends)
            .await
            .into_iter()
            .find(|a| {
                let i = a.get_info();
                i.name == dev.info.name
                    && i.backend == dev.info.backend
                    && i.device == dev.info.device
                    && i.vendor == dev.info.vendor
            })
            .ok_or(GpuError::NoAdapter)?;
        request(&adapter).await
    }

    /// Starts re-creating a lost device in the background (its quarantined slots are waited for).
    pub(crate) fn recreate_in_background(self: &Arc<Self>, device: usize) {
        let pool = Arc::clone(self);
        tokio::spawn(async move {
            let dev = Arc::clone(&pool.devices[device]);
            let _ = pool.ensure_ready(&dev).await;
        });
    }

    /// Waits, off the caller's thread, for every submission made on the lease's queue so far.
    pub(crate) async fn fence(&self, gpu: &JobGpu) -> Result<(), FenceFailure> {
        let inner = Arc::clone(&gpu.inner);
        let lost = |inner: &JobGpuInner| {
            let state = inner.owner.state.lock();
            (state.generation != inner.generation || state.lost.is_some()).then(|| {
                FenceFailure::Lost {
                    device: inner.device_index,
                    reason: state.lost.clone().unwrap_or_else(|| "replaced".into()),
                }
            })
        };
        if let Some(l) = lost(&inner) {
            return Err(l);
        }
        let policy = self.opts.fence_policy;
        let mut wait = tokio::task::spawn_blocking(move || {
            // A non-blocking poll first: it runs the device's maintenance, which is where a
            // loss (a driver reset, `destroy()`) is noticed and the loss callback fires. A
            // blocking wait on a device already lost may never return.
            let _ = inner.device.poll(wgpu::PollType::Poll);
            if lost(&inner).is_some() {
                return (Ok(wgpu::PollStatus::QueueEmpty), inner);
            }
            let index = match policy {
                // An empty submission is ordered after everything submitted on this queue
                // before it, through the context or not.
                FencePolicy::Queue => Some(inner.queue.submit(std::iter::empty())),
                FencePolicy::Recorded => inner.last.lock().clone(),
            };
            let Some(index) = index else {
                return (Ok(wgpu::PollStatus::QueueEmpty), inner);
            };
            // No timeout here: wgpu-core 30.0.2 can panic in a timed wait that runs out while
            // other threads submit (gfx-rs/wgpu#9958). The bound is the tokio timer below.
            let r = inner.device.poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            });
            (r, inner)
        });
        let joined = match tokio::time::timeout(self.opts.fence_timeout, &mut wait).await {
            Ok(joined) => joined,
            Err(_) => {
                return Err(FenceFailure::Timeout {
                    after: self.opts.fence_timeout,
                    still_waiting: Box::pin(async move {
                        let _ = wait.await;
                    }),
                });
            }
        };
        let (result, inner) = match joined {
            Ok(v) => v,
            Err(e) => {
                return Err(FenceFailure::Lost {
                    device: gpu.inner.device_index,
                    reason: e.to_string(),
                });
            }
        };
        if let Some(l) = lost(&inner) {
            return Err(l);
        }
        result.map(|_| ()).map_err(|e| FenceFailure::Lost {
            device: inner.device_index,
            reason: e.to_string(),
        })
    }

    /// Waits for all GPU work on every device, then destroys the devices (at shutdown, after
    /// every lease has been released).
    pub(crate) fn close(&self) {
        for dev in &self.devices {
            let handles = dev.state.lock().handles.take();
            if let Some((device, _queue)) = handles {
                // Notice a loss first: a blocking wait on a lost device may never return.
                let _ = device.poll(wgpu::PollType::Poll);
                if dev.state.lock().lost.is_none() {
                    let _ = device.poll(wgpu::PollType::wait_indefinitely());
                }
                device.destroy();
            }
        }
    }

    /// For tests and tools: the device of one index, if it is usable.
    pub(crate) fn device(&self, index: usize) -> Option<wgpu::Device> {
        self.devices
            .get(index)?
            .state
            .lock()
            .handles
            .as_ref()
            .map(|(d, _)| d.clone())
    }

    pub(crate) fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Whether a lost device has been dealt with: usable again, or given up for good.
    pub(crate) fn settled(&self, index: usize) -> bool {
        let dev = &self.devices[index];
        dev.usable() || dev.state.lock().dead
    }

    /// How many times the device has been created (1 at start, +1 per re-creation).
    pub(crate) fn generation(&self, index: usize) -> Option<u64> {
        Some(self.devices.get(index)?.state.lock().generation)
    }
}

/// The device with the most free sub-slots (the lowest index among equals), skipping dead
/// devices, and its first free sub-slot.
fn least_loaded(busy: &[Vec<bool>], dead: &[bool]) -> Option<Placement> {
    busy.iter()
        .enumerate()
        .filter(|(d, _)| !dead[*d])
        .filter_map(|(d, subs)| {
            let free = subs.iter().filter(|b| !**b).count();
            let first = subs.iter().position(|b| !*b)?;
            Some((free, d, first))
        })
        .max_by_key(|(free, d, _)| (*free, std::cmp::Reverse(*d)))
        .map(|(_, device, sub)| Placement { device, sub })
}

impl GpuDevice {
    fn usable(&self) -> bool {
        let s = self.state.lock();
        s.handles.is_some() && s.lost.is_none()
    }
}

async fn request(adapter: &wgpu::Adapter) -> Result<(wgpu::Device, wgpu::Queue), GpuError> {
    let desc = wgpu::DeviceDescriptor {
        label: Some("leasehold"),
        required_limits: adapter.limits(),
        ..Default::default()
    };
    adapter
        .request_device(&desc)
        .await
        .map_err(|e| GpuError::CreateFailed(e.to_string()))
}

/// Installs a new device generation and its loss callback.
fn install(dev: &Arc<GpuDevice>, device: wgpu::Device, queue: wgpu::Queue) {
    let generation = {
        let mut s = dev.state.lock();
        s.generation += 1;
        s.lost = None;
        s.scratch.iter_mut().for_each(|x| *x = None);
        s.handles = Some((device.clone(), queue));
        s.generation
    };
    let weak = Arc::downgrade(dev);
    device.set_device_lost_callback(move |reason, message| {
        if let Some(dev) = weak.upgrade() {
            let mut s = dev.state.lock();
            if s.generation == generation {
                tracing::error!(index = dev.index, ?reason, %message, "gpu device lost");
                s.lost = Some(format!("{reason:?}: {message}"));
            }
        }
    });
}

fn make_scratch(device: &wgpu::Device, bytes: u64, placement: Placement) -> SlotScratch {
    let label = format!("leasehold scratch d{}s{}", placement.device, placement.sub);
    SlotScratch {
        storage: device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(&label),
            size: bytes,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }),
        readback: device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(&label),
            size: bytes,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(device: usize, sub: usize) -> Option<Placement> {
        Some(Placement { device, sub })
    }

    #[test]
    fn a_new_lease_goes_to_the_least_loaded_device() {
        let busy = vec![vec![true, false, false], vec![false, false, false]];
        assert_eq!(least_loaded(&busy, &[false, false]), p(1, 0));
        let busy = vec![vec![true, false, false], vec![true, true, false]];
        assert_eq!(least_loaded(&busy, &[false, false]), p(0, 1));
    }

    #[test]
    fn equally_loaded_devices_fill_in_index_order() {
        let busy = vec![vec![false, true], vec![false, true]];
        assert_eq!(least_loaded(&busy, &[false, false]), p(0, 0));
    }

    #[test]
    fn full_and_dead_devices_are_skipped() {
        let busy = vec![vec![true, true], vec![false, false], vec![false, false]];
        assert_eq!(least_loaded(&busy, &[false, true, false]), p(2, 0));
        assert_eq!(least_loaded(&busy, &[false, true, true]), None);
    }
}
