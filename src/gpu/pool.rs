//! `GpuPool`: every device of a supervisor, which sub-slots are in use, the fence, re-creation
//! and close.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::contain::{BackendCall, Guard};
use super::device::{Current, Doomed, Generation, GpuDevice};
use super::error::GpuError;
use super::handles::JobHandles;
use super::job::{JobGpu, JobGpuInner};
use super::options::{FencePolicy, GpuOptions, ScratchPolicy};
use crate::gpu_info::{GpuDeviceInfo, GpuDeviceState};

/// A device whose close (`GpuPool::close_within`) could not be proven within its bound: its
/// remaining work had not completed, or the backend panicked while waiting or destroying it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unclosed {
    /// The device's index.
    pub(crate) device: usize,
    /// Why, for logs and reports.
    pub(crate) reason: String,
}

/// A device lost under a fence: its index, and why.
pub(crate) struct LostDevice {
    pub(crate) device: usize,
    pub(crate) reason: String,
}

/// How a lease's GPU fence ended badly.
pub(crate) enum FenceFailure {
    /// The work did not complete within the bound: the slot is quarantined until the wait,
    /// which goes on, ends; `still_waiting` says how (the work completed, or the device was
    /// lost meanwhile: a late end is no proof by itself).
    Timeout {
        after: Duration,
        still_waiting: futures_util::future::BoxFuture<'static, Result<(), LostDevice>>,
    },
    /// The device was lost (or its backend panicked): the slot is quarantined until the device
    /// is replaced.
    Lost(LostDevice),
}

/// Called (off the mailbox) when a lost device has been replaced, or given up.
pub(crate) type ReplacedHook = Box<dyn Fn(usize) + Send + Sync>;

/// Every device of a supervisor, and which sub-slots are in use.
pub(crate) struct GpuPool {
    opts: GpuOptions,
    devices: Vec<Arc<GpuDevice>>,
    busy: Mutex<Vec<Vec<bool>>>,
    replaced: OnceLock<ReplacedHook>,
    /// Set by `close_within`: nothing is re-created after it. `Relaxed` throughout: the flag
    /// publishes no other memory, and a re-creation that misses it (one already past the check
    /// when the close begins) installs a device that the pool's `Drop` lets go of.
    closed: AtomicBool,
    guard: Guard,
}

impl std::fmt::Debug for GpuPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuPool")
            .field("devices", &self.devices)
            .finish_non_exhaustive()
    }
}

/// Where a lease runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Placement {
    pub(crate) device: usize,
    pub(crate) sub: usize,
}

/// A new wgpu instance on `backends`, and its adapters. Each call makes its own instance: on
/// GL, that is what gives a device an EGL context of its own (see `recreate`).
async fn enumerate(
    guard: &Guard,
    backends: wgpu::Backends,
    device: usize,
) -> Result<Vec<wgpu::Adapter>, GpuError> {
    guard
        .run_async(BackendCall::Enumerate, device, async move {
            if backends.contains(wgpu::Backends::VULKAN) {
                keep_vulkan_driver_loaded();
            }
            let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
            desc.backends = backends;
            // The adapters (and the devices requested from them) keep what they need of the
            // instance alive; the handle itself can go.
            wgpu::Instance::new(desc).enumerate_adapters(backends).await
        })
        .await
        .map_err(GpuError::CreateFailed)
}

/// The backends to look at first, and those looked at only if the first fall short: GL last,
/// in an instance of its own.
fn passes(backends: wgpu::Backends) -> (wgpu::Backends, wgpu::Backends) {
    let first = backends.difference(wgpu::Backends::GL);
    if first.is_empty() {
        (backends, wgpu::Backends::empty())
    } else {
        (first, backends.intersection(wgpu::Backends::GL))
    }
}

/// How adapters are preferred (lowest first): hardware before software, then by backend in the
/// order the platforms prefer them (`platform_backends`: DX12 before Vulkan on Windows, GL
/// last everywhere). wgpu lists Vulkan before DX12, so the order must be stated here.
fn rank(info: &wgpu::AdapterInfo) -> (bool, u8) {
    let backend = match info.backend {
        wgpu::Backend::Metal | wgpu::Backend::Dx12 => 0,
        wgpu::Backend::Gl => 2,
        _ => 1,
    };
    (info.device_type == wgpu::DeviceType::Cpu, backend)
}

/// Whether a GL adapter could still be among the `own` chosen: fewer than `own` hardware
/// adapters were found (a GL adapter ranks below every other hardware adapter and above every
/// software one).
fn short_of_hardware<'a>(found: impl Iterator<Item = &'a wgpu::AdapterInfo>, own: usize) -> bool {
    found
        .filter(|info| info.device_type != wgpu::DeviceType::Cpu)
        .count()
        < own
}

/// Keeps the Vulkan loader and its drivers loaded for the rest of the process, with one
/// instance that is never dropped.
///
/// Without it, the last device and instance a supervisor drops take the driver's library out of
/// the process (the loader `dlclose`s it), and a driver that registered thread-exit destructors
/// on threads that called into it crashes the process when such a thread ends later: seen as a
/// SIGSEGV at thread exit on NVIDIA's driver (580, on an H200) after a supervisor's shutdown.
/// One idle `VkInstance` costs next to nothing; on a machine without a Vulkan loader it is an
/// instance without backends.
fn keep_vulkan_driver_loaded() {
    static KEPT: OnceLock<wgpu::Instance> = OnceLock::new();
    KEPT.get_or_init(|| {
        let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
        desc.backends = wgpu::Backends::VULKAN;
        wgpu::Instance::new(desc)
    });
}

impl GpuPool {
    /// Installs the adopted devices (indices `0..`), then opens up to `own_devices` acceptable
    /// adapters, hardware first.
    pub(crate) async fn open(opts: GpuOptions) -> Result<Self, GpuError> {
        let guard = Guard::new(opts.backend_hook.clone());
        let slots = opts.slots_per_device as usize;
        let mut devices: Vec<Arc<GpuDevice>> = Vec::new();
        // The next device, at the next index.
        let device = |devices: &[Arc<GpuDevice>], info, adopted| {
            Arc::new(GpuDevice::new(
                devices.len(),
                info,
                adopted,
                guard.clone(),
                slots,
                opts.scratch_size(),
            ))
        };
        for adopted in &opts.adopted {
            let dev = device(&devices, adopted.info.clone(), true);
            dev.install(adopted.device.clone(), adopted.queue.clone())?;
            tracing::info!(index = dev.index, adapter = %dev.info.name, backend = ?dev.info.backend, "adopted gpu device ready");
            devices.push(dev);
        }
        let own = opts.own_devices();
        if own > 0 {
            // GL in an instance of its own, made only when it could be chosen: a device never
            // keeps another backend's instance alive, so dropping a Vulkan device never tears
            // down EGL (on NVIDIA's driver, an EGL teardown beside another thread's
            // `vkDestroyDevice` hung both).
            let (first, then) = passes(opts.backends);
            // Each adapter's info read once: the filter, the count and the sort all look at it.
            let acceptable = |found: Vec<wgpu::Adapter>| {
                found
                    .into_iter()
                    .map(|a| (a.get_info(), a))
                    .filter(|(info, _)| opts.accepts(info))
                    .collect::<Vec<_>>()
            };
            let mut adapters = acceptable(enumerate(&guard, first, devices.len()).await?);
            if !then.is_empty() && short_of_hardware(adapters.iter().map(|(info, _)| info), own) {
                adapters.extend(acceptable(enumerate(&guard, then, devices.len()).await?));
            }
            adapters.sort_by_key(|(info, _)| rank(info));
            adapters.truncate(own);
            for (info, adapter) in adapters {
                let dev = device(&devices, info, false);
                dev.open_on(&adapter).await?;
                tracing::info!(index = dev.index, adapter = %dev.info.name, backend = ?dev.info.backend, "gpu device ready");
                devices.push(dev);
            }
        }
        if devices.is_empty() {
            return Err(GpuError::NoAdapter);
        }
        let busy = vec![vec![false; slots]; devices.len()];
        Ok(Self {
            opts,
            devices,
            busy: Mutex::new(busy),
            replaced: OnceLock::new(),
            closed: AtomicBool::new(false),
            guard,
        })
    }

    pub(crate) fn set_replaced_hook(&self, hook: ReplacedHook) {
        let _ = self.replaced.set(hook);
    }

    /// GPU sub-slots in all.
    pub(crate) fn capacity(&self) -> u32 {
        self.devices.len() as u32 * self.opts.slots_per_device
    }

    /// Places a lease on the least-loaded device that is not dead and has a free sub-slot;
    /// an adopted device that is lost only when no other device has a free sub-slot (its
    /// checkout then waits for the engine's replacement).
    pub(crate) fn place(&self) -> Option<Placement> {
        let mut busy = self.busy.lock();
        let dead: Vec<bool> = self.devices.iter().map(|d| d.state.lock().dead).collect();
        let awaiting: Vec<bool> = self
            .devices
            .iter()
            .zip(&dead)
            .map(|(d, dead)| *dead || (d.adopted && !d.usable()))
            .collect();
        let placement = least_loaded(&busy, &awaiting).or_else(|| least_loaded(&busy, &dead))?;
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
        let (handles, generation) = {
            let s = dev.state.lock();
            let current = s
                .usable()
                .ok_or_else(|| GpuError::DeviceLost("device gone".into()))?;
            let handles = JobHandles {
                device: current.device.clone(),
                queue: current.queue.clone(),
                scratch: current.scratch[placement.sub].clone(),
            };
            (handles, Arc::clone(&current.generation))
        };
        Ok(JobGpu {
            inner: Arc::new(JobGpuInner::new(
                Arc::clone(dev),
                placement.sub,
                generation,
                handles,
                self.opts.scratch_policy == ScratchPolicy::Zeroed,
            )),
        })
    }

    /// Makes sure the device is usable: if it was lost, one caller re-creates it (with backoff)
    /// while the others wait for that caller.
    async fn ensure_ready(&self, dev: &Arc<GpuDevice>) -> Result<(), GpuError> {
        if dev.usable() {
            return Ok(());
        }
        if dev.adopted {
            return self.replacement(dev).await;
        }
        let _creator = dev.create_lock.lock().await;
        if dev.usable() {
            return Ok(());
        }
        if self.closed.load(Ordering::Relaxed) {
            return Err(GpuError::DeviceLost(format!(
                "device {} is closed",
                dev.index
            )));
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
                Ok(generation) => {
                    tracing::info!(
                        index = dev.index,
                        attempt,
                        generation = generation.number,
                        "lost gpu device re-created"
                    );
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

    /// An adopted device is never re-created: its checkout waits until the engine hands a
    /// replacement over (or the pool closes; the job's cancel ends the wait in the worker).
    async fn replacement(&self, dev: &Arc<GpuDevice>) -> Result<(), GpuError> {
        loop {
            let installed = dev.installed.notified();
            tokio::pin!(installed);
            installed.as_mut().enable();
            if dev.usable() {
                return Ok(());
            }
            if self.closed.load(Ordering::Relaxed) {
                return Err(GpuError::DeviceLost(format!(
                    "device {} is closed",
                    dev.index
                )));
            }
            installed.await;
        }
    }

    /// The engine's replacement for adopted device `index` (see
    /// [`Supervisor::replace_device`](crate::Supervisor::replace_device)): installed as its next
    /// generation, and the supervisor told (its quarantined slots on the device come back).
    pub(crate) fn replace(
        &self,
        index: usize,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Result<u64, GpuError> {
        let dev = self
            .devices
            .get(index)
            .ok_or_else(|| GpuError::ReplaceRefused(format!("there is no gpu device {index}")))?;
        if !dev.adopted {
            return Err(GpuError::ReplaceRefused(format!(
                "gpu device {index} was opened by leasehold, which re-creates it itself"
            )));
        }
        if self.closed.load(Ordering::Relaxed) {
            return Err(GpuError::ReplaceRefused(
                "the supervisor's gpu devices are closed".into(),
            ));
        }
        let generation = {
            let _one = dev.replacing.lock();
            dev.install(device, queue)?
        };
        tracing::info!(
            index,
            generation = generation.number,
            adapter = %generation.info.name,
            backend = ?generation.info.backend,
            "adopted gpu device replaced by the engine"
        );
        if let Some(hook) = self.replaced.get() {
            hook(index);
        }
        Ok(generation.number)
    }

    /// A fresh device on the same adapter, from a fresh wgpu instance.
    ///
    /// Why a fresh instance: on GL (EGL), every adapter enumerated from one instance shares
    /// that instance's one EGL context, each behind a lock of its own. The lost generation's
    /// handles live on in quarantined jobs and are dropped later, on other threads; a device
    /// from the same instance would make the same context current there while the new device
    /// uses it, and wgpu-hal panics on the `EGL_BAD_ACCESS` that follows (the family of
    /// gfx-rs/wgpu#5349). An instance per generation gives each its own context; Vulkan, Metal
    /// and DX12 do not mind either way.
    async fn recreate(&self, dev: &Arc<GpuDevice>) -> Result<Arc<Generation>, GpuError> {
        let adapter = enumerate(&self.guard, dev.info.backend.into(), dev.index)
            .await?
            .into_iter()
            .find(|a| {
                let i = a.get_info();
                i.name == dev.info.name
                    && i.backend == dev.info.backend
                    && i.device == dev.info.device
                    && i.vendor == dev.info.vendor
            })
            .ok_or(GpuError::NoAdapter)?;
        dev.open_on(&adapter).await
    }

    /// Starts re-creating a lost device in the background (its quarantined slots are waited for).
    /// For an adopted device: asks the engine's callback, if any, for a replacement.
    pub(crate) fn recreate_in_background(self: &Arc<Self>, device: usize) {
        let pool = Arc::clone(self);
        if pool.devices[device].adopted {
            let Some(ask) = pool.opts.replacement_for.clone() else {
                tracing::warn!(
                    index = device,
                    "adopted gpu device lost: its slots stay quarantined until the engine calls Supervisor::replace_device"
                );
                return;
            };
            let reason = pool.devices[device]
                .current_generation()
                .and_then(|g| g.loss())
                .unwrap_or_default();
            // The engine's code: on a blocking thread, its panic caught.
            crate::counters::task();
            drop(tokio::task::spawn_blocking(
                move || match crate::outside::call(|| ask(device, &reason)) {
                    Ok(Some((d, q))) => {
                        if let Err(e) = pool.replace(device, d, q) {
                            tracing::error!(index = device, error = %e, "the engine's replacement gpu device could not be installed");
                        }
                    }
                    Ok(None) => tracing::warn!(
                        index = device,
                        "adopted gpu device lost and no replacement yet: its slots stay quarantined until Supervisor::replace_device"
                    ),
                    Err(panic) => tracing::error!(
                        index = device,
                        panic,
                        "the engine's replacement callback for a lost gpu device panicked"
                    ),
                },
            ));
            return;
        }
        tokio::spawn(async move {
            let dev = Arc::clone(&pool.devices[device]);
            let _ = pool.ensure_ready(&dev).await;
        });
    }

    /// Waits, off the caller's thread, for the lease's GPU work (per the fence policy). A loss
    /// of the lease's device generation already known fails it at once. A lease with no GPU
    /// work to wait for (nothing submitted through its context, and under
    /// [`FencePolicy::Queue`] not even its queue taken) is released at once, without a call
    /// into the GPU backend: it neither polls for a loss nor waits. A backend panic in the wait
    /// is a loss of the device.
    pub(crate) async fn fence(&self, gpu: &JobGpu) -> Result<(), FenceFailure> {
        let inner = Arc::clone(&gpu.inner);
        // The lease's GPU use ends here, whatever follows: a clone kept past the job submits
        // nothing more and gets no scratch, and the latest submission before is waited for.
        let last = inner.end();
        let device = gpu.device_index();
        if let Some(reason) = inner.generation.loss() {
            return Err(FenceFailure::Lost(LostDevice { device, reason }));
        }
        let Some(wait) = FenceWait::of(&inner, self.opts.fence_policy, last) else {
            return Ok(());
        };
        crate::counters::task();
        let mut wait = tokio::task::spawn_blocking(move || {
            let result = fence_blocking(&inner, wait);
            if let Err(reason) = &result {
                inner.owner.mark_lost(&inner.generation, reason.clone());
            }
            (result, inner)
        });
        // What the wait proved, on time or late: the work completed, unless the wait failed
        // (a loss, a backend panic) or the device was lost meanwhile.
        let outcome = move |joined: Result<
            (Result<(), String>, Arc<JobGpuInner>),
            tokio::task::JoinError,
        >| {
            let (result, inner) = joined.map_err(|e| LostDevice {
                device,
                reason: e.to_string(),
            })?;
            if let Some(reason) = inner.generation.loss() {
                return Err(LostDevice { device, reason });
            }
            result.map_err(|reason| LostDevice { device, reason })
        };
        match tokio::time::timeout(self.opts.fence_timeout, &mut wait).await {
            Ok(joined) => outcome(joined).map_err(FenceFailure::Lost),
            Err(_) => Err(FenceFailure::Timeout {
                after: self.opts.fence_timeout,
                still_waiting: Box::pin(async move { outcome(wait.await) }),
            }),
        }
    }

    /// Waits at most `bound` for the remaining GPU work of every device leasehold opened (unless
    /// the device is lost), then destroys each of them, and lets go of the adopted ones; `gpu_device(i)` is `None` from the start of the call.
    /// Each device is waited for and destroyed on a thread of its own, so a device whose work
    /// never completes (a slot quarantined by the fence timeout) costs the caller `bound`, not
    /// forever: it is reported in the result and left to finish on that thread.
    pub(crate) fn close_within(&self, bound: Duration) -> Vec<Unclosed> {
        self.closed.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + bound;
        let (tx, rx) = std::sync::mpsc::channel();
        let mut unclosed = Vec::new();
        let mut pending = Vec::new();
        for dev in &self.devices {
            let Some(current) = dev.state.lock().current.take() else {
                continue;
            };
            let generation = Arc::clone(&current.generation);
            if dev.adopted {
                // The engine's device: leasehold lets go of its clones (every lease on it has
                // been fenced by now) and neither waits for the engine's work nor destroys it.
                Doomed::new(current, dev, &generation).drop_off_thread();
                continue;
            }
            // Whatever happens to the thread, the handles are dropped guarded.
            let doomed = Doomed::new(current, dev, &generation);
            let (dev2, tx) = (Arc::clone(dev), tx.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("leasehold-gpu-close-{}", dev.index))
                .spawn(move || {
                    let result = doomed.get().map_or(Ok(()), |c| drain_and_destroy(&dev2, c));
                    drop(doomed);
                    let _ = tx.send((dev2.index, result));
                });
            match spawned {
                Ok(thread) => pending.push((dev.index, thread)),
                Err(e) => unclosed.push(Unclosed {
                    device: dev.index,
                    reason: format!("could not start the close thread: {e}"),
                }),
            }
        }
        drop(tx);
        while !pending.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((device, result)) => {
                    if let Some(i) = pending.iter().position(|(d, _)| *d == device) {
                        // The thread has sent its last word and only returns now: join it, so
                        // that its thread-exit destructors (the driver's thread-locals) have
                        // run before the supervisor reports the device closed — never at the
                        // same time as the process's exit.
                        let (_, thread) = pending.swap_remove(i);
                        let _ = thread.join();
                    }
                    if let Err(reason) = result {
                        unclosed.push(Unclosed { device, reason });
                    }
                }
                Err(_) => break,
            }
        }
        unclosed.extend(pending.into_iter().map(|(device, _thread)| Unclosed {
            device,
            reason: format!(
                "gpu work still running {bound:?} into the close; the device is destroyed once it completes"
            ),
        }));
        unclosed
    }

    /// For tests and tools: the device of one index, if it is usable.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn device(&self, index: usize) -> Option<wgpu::Device> {
        let s = self.devices.get(index)?.state.lock();
        s.current.as_ref().map(|c| c.device.clone())
    }

    #[cfg(feature = "fault-injection")]
    pub(crate) fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// Every device as the pool knows it now (`Supervisor::gpu_devices`): what its current
    /// generation runs on, and that generation's loss.
    pub(crate) fn describe(&self) -> Vec<GpuDeviceInfo> {
        let busy = self.busy.lock().clone();
        self.devices
            .iter()
            .zip(busy)
            .map(|(dev, subs)| {
                let state = dev.state.lock();
                let current = state.current.as_ref().map(|c| &c.generation);
                let info = current.map_or(&dev.info, |g| &g.info);
                GpuDeviceInfo {
                    index: dev.index,
                    adapter: info.name.clone(),
                    backend: format!("{:?}", info.backend),
                    adopted: dev.adopted,
                    sub_slots: subs.len() as u32,
                    in_use: subs.iter().filter(|b| **b).count() as u32,
                    generation: state.installed,
                    state: match (state.dead, current) {
                        (true, current) => GpuDeviceState::GivenUp {
                            reason: current.and_then(|g| g.loss()),
                        },
                        // Every device has a generation from the pool's open until its close.
                        (false, None) => GpuDeviceState::Closed,
                        (false, Some(g)) => match g.loss() {
                            Some(reason) => GpuDeviceState::Lost { reason },
                            None => GpuDeviceState::Usable,
                        },
                    },
                }
            })
            .collect()
    }

    /// Whether a lost device has been dealt with: usable again, or given up for good.
    pub(crate) fn settled(&self, index: usize) -> bool {
        let s = self.devices[index].state.lock();
        s.usable().is_some() || s.dead
    }

    /// How many times the device has been created or replaced (1 at start).
    pub(crate) fn generation(&self, index: usize) -> Option<u64> {
        Some(self.devices.get(index)?.state.lock().installed)
    }

    /// Whether device `index` is the engine's ([`GpuOptions::adopt`]): only the engine can
    /// replace it when it is lost.
    pub(crate) fn adopted(&self, index: usize) -> bool {
        self.devices.get(index).is_some_and(|d| d.adopted)
    }
}

impl Drop for GpuPool {
    /// A pool dropped without `close` (a supervisor that never shut down) lets go of its
    /// devices guarded and off the dropping thread, like everything else here.
    fn drop(&mut self) {
        for dev in &self.devices {
            let current = dev.state.lock().current.take();
            if let Some(current) = current {
                let generation = Arc::clone(&current.generation);
                Doomed::new(current, dev, &generation).drop_off_thread();
            }
        }
    }
}

/// What a lease's fence waits for.
#[derive(Clone)]
enum FenceWait {
    /// Everything submitted on the queue so far: an empty submission, then a wait for it. The
    /// submission is ordered after everything submitted on this queue before it, through the
    /// context or not, and flushes pending `write_buffer`s.
    Queue,
    /// The lease's last submission through its context (and, the queue being in order,
    /// everything submitted before it).
    Recorded(wgpu::SubmissionIndex),
}

impl FenceWait {
    /// `None`: the lease has no GPU work to wait for. Read after the worker and every task it
    /// spawned have ended (their joins order the job's calls before these reads).
    fn of(
        inner: &JobGpuInner,
        policy: FencePolicy,
        last: Option<wgpu::SubmissionIndex>,
    ) -> Option<Self> {
        if policy == FencePolicy::Queue && inner.queue_taken() {
            // It may have submitted on the queue directly, or left writes pending.
            return Some(Self::Queue);
        }
        last.map(Self::Recorded)
    }
}

/// The fence's blocking part, on the blocking pool. `Err` means the device is lost (or its
/// backend panicked); the caller marks it so.
fn fence_blocking(inner: &JobGpuInner, wait: FenceWait) -> Result<(), String> {
    let dev = &inner.owner;
    let (index, sub) = (dev.index, inner.sub);
    let h = inner.handles();
    let guard = &dev.guard;
    let wait_for = match wait {
        FenceWait::Queue => {
            // A non-blocking poll first: it runs the device's maintenance, which is where a
            // loss (a driver reset, `destroy()`) is noticed and the loss callback fires, so that
            // the fence's own submission is never made on a device that is gone.
            let _ = guard.run(BackendCall::FencePoll, index, Some(sub), || {
                h.device.poll(wgpu::PollType::Poll)
            })?;
            if let Some(reason) = inner.generation.loss() {
                return Err(reason);
            }
            guard.run(BackendCall::FenceSubmit, index, Some(sub), || {
                h.queue.submit(std::iter::empty())
            })?
        }
        // No poll first: the wait runs the same maintenance (a loss it notices fires the loss
        // callback before it returns, and the caller checks the generation after it; a loss
        // known before is checked before the wait), and a device the driver has lost ends the
        // wait with an error (Vulkan's wait must return `VK_ERROR_DEVICE_LOST` in finite
        // time); one `destroy()`ed runs its submitted work to completion. One call into the
        // backend less per lease (on GL, one lock of the device's context less).
        FenceWait::Recorded(i) => i,
    };
    // No timeout here: wgpu-core 30.0.2 can panic in a timed wait that runs out while other
    // threads submit (gfx-rs/wgpu#9958). The bound is the caller's tokio timer.
    guard
        .run(BackendCall::FenceWait, index, Some(sub), || {
            h.device.poll(wgpu::PollType::Wait {
                submission_index: Some(wait_for),
                timeout: None,
            })
        })?
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// At close: waits for the device's remaining work (unless it is lost), then destroys it.
fn drain_and_destroy(dev: &GpuDevice, current: &Current) -> Result<(), String> {
    dev.guard.run(BackendCall::Close, dev.index, None, || {
        // Notice a loss first: a blocking wait on a lost device may never return.
        let _ = current.device.poll(wgpu::PollType::Poll);
        if !current.generation.is_lost() {
            let _ = current.device.poll(wgpu::PollType::wait_indefinitely());
        }
        current.device.destroy();
    })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn info(backend: wgpu::Backend, device_type: wgpu::DeviceType) -> wgpu::AdapterInfo {
        wgpu::AdapterInfo {
            name: format!("{backend:?} {device_type:?}"),
            vendor: 0,
            device: 0,
            device_type,
            device_pci_bus_id: String::new(),
            driver: String::new(),
            driver_info: String::new(),
            backend,
            subgroup_min_size: 0,
            subgroup_max_size: 0,
            transient_saves_memory: None,
            limit_bucket: None,
        }
    }

    #[test]
    fn gl_is_looked_at_last_in_an_instance_of_its_own() {
        use wgpu::Backends as B;
        assert_eq!(passes(B::VULKAN | B::GL), (B::VULKAN, B::GL));
        assert_eq!(
            passes(B::DX12 | B::VULKAN | B::GL),
            (B::DX12 | B::VULKAN, B::GL)
        );
        assert_eq!(passes(B::GL), (B::GL, B::empty()), "GL alone: one pass");
        assert_eq!(passes(B::VULKAN), (B::VULKAN, B::empty()));
        assert_eq!(passes(B::METAL), (B::METAL, B::empty()));
    }

    #[test]
    fn gl_is_looked_at_only_while_it_could_be_chosen() {
        use wgpu::{Backend, DeviceType};
        let gpu = || info(Backend::Vulkan, DeviceType::DiscreteGpu);
        let soft = || info(Backend::Vulkan, DeviceType::Cpu);
        // Hardware for every device wanted: no GL adapter could rank above it.
        assert!(!short_of_hardware([gpu()].iter(), 1));
        assert!(!short_of_hardware([soft(), gpu()].iter(), 1));
        assert!(!short_of_hardware([gpu(), gpu()].iter(), 2));
        // Short of hardware: a hardware GL adapter would rank above software, or fill a place.
        assert!(short_of_hardware([soft()].iter(), 1), "lavapipe alone");
        assert!(short_of_hardware([].iter(), 1), "nothing found");
        assert!(short_of_hardware([gpu(), soft()].iter(), 2));
        // The ranking the choice sorts by: hardware first, then GL last.
        let hw_gl = info(Backend::Gl, DeviceType::IntegratedGpu);
        let sw_gl = info(Backend::Gl, DeviceType::Cpu);
        let mut all = [sw_gl.clone(), soft(), hw_gl.clone(), gpu()];
        all.sort_by_key(rank);
        assert_eq!(all, [gpu(), hw_gl, soft(), sw_gl]);
        // On Windows, DX12 before Vulkan (wgpu lists Vulkan first), as `GpuOptions` says.
        let dx12 = info(Backend::Dx12, DeviceType::DiscreteGpu);
        let mut windows = [gpu(), dx12.clone()];
        windows.sort_by_key(rank);
        assert_eq!(windows, [dx12, gpu()]);
    }

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
