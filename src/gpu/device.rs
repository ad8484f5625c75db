//! One device of the pool: its current generation (device, queue, per sub-slot scratch), each
//! generation's own loss, and everything that creates, zeroes or lets go of its wgpu objects.

use std::fmt;
use std::sync::{Arc, Weak};

use futures_util::FutureExt;
use parking_lot::Mutex;

use super::contain::{BackendCall, Guard};
use super::error::GpuError;
use super::handles::{JobHandles, SlotScratch};

/// One installed device of a pool's device index: its number (1 for the first, one more per
/// re-creation or replacement), the adapter it runs on, and its own loss. A lease keeps the
/// generation it checked out: replacing the device does not make the old one lost (its leases
/// are fenced on it until they end), and a loss marks only the generation it happened to.
pub(super) struct Generation {
    pub(super) number: u64,
    /// The device's own adapter (`wgpu::Device::adapter_info`): a replacement from another
    /// adapter or backend is reported as what it is.
    pub(super) info: wgpu::AdapterInfo,
    /// Why it is lost (its device-lost callback, or a backend panic in a call on it).
    lost: Mutex<Option<String>>,
}

impl Generation {
    fn new(number: u64, info: wgpu::AdapterInfo) -> Self {
        Self {
            number,
            info,
            lost: Mutex::new(None),
        }
    }

    /// Why this generation can no longer be used, if it cannot.
    pub(super) fn loss(&self) -> Option<String> {
        self.lost.lock().clone()
    }

    pub(super) fn is_lost(&self) -> bool {
        self.lost.lock().is_some()
    }
}

impl fmt::Debug for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Generation")
            .field("number", &self.number)
            .field("backend", &self.info.backend)
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// What the pool holds of a device's current generation.
pub(super) struct Current {
    pub(super) generation: Arc<Generation>,
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    /// One per sub-slot, created with the generation (a new device comes with new, zeroed
    /// scratch).
    pub(super) scratch: Vec<SlotScratch>,
}

/// The state of one device.
pub(super) struct DevState {
    /// `None` before the first install and after `close`.
    pub(super) current: Option<Current>,
    /// The number of the latest generation installed (0 before the first).
    pub(super) installed: u64,
    /// No more re-creation attempts will be made.
    pub(super) dead: bool,
}

impl DevState {
    /// The current generation, if it is installed and not lost.
    pub(super) fn usable(&self) -> Option<&Current> {
        self.current.as_ref().filter(|c| !c.generation.is_lost())
    }
}

pub(crate) struct GpuDevice {
    pub(super) index: usize,
    /// The adapter of its first generation: leasehold re-creates the devices it opened itself
    /// on that adapter. What a generation runs on is its own [`Generation::info`].
    pub(super) info: wgpu::AdapterInfo,
    /// The engine created it ([`GpuOptions::adopt`](super::GpuOptions::adopt)): never
    /// re-created, destroyed or waited on at close; a loss waits for the engine's replacement.
    pub(super) adopted: bool,
    /// Woken when a new generation is installed (checkouts waiting on a lost adopted device).
    pub(super) installed: tokio::sync::Notify,
    /// One replacement of an adopted device at a time (the engine's calls may race).
    pub(super) replacing: Mutex<()>,
    pub(super) state: Mutex<DevState>,
    /// One creator at a time; the others wait and then see the new device.
    pub(super) create_lock: tokio::sync::Mutex<()>,
    pub(super) guard: Guard,
    slots: usize,
    scratch_size: u64,
}

impl fmt::Debug for GpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuDevice")
            .field("index", &self.index)
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .finish()
    }
}

/// How zeroing a sub-slot's scratch went (a backend panic is the `Err` around it).
pub(super) enum Zeroing {
    /// The clear of both buffers was submitted.
    Submitted,
    /// wgpu refused the clear (a validation error, captured): the scratch may still hold the
    /// last lease's data.
    Refused(String),
}

impl GpuDevice {
    pub(super) fn new(
        index: usize,
        info: wgpu::AdapterInfo,
        adopted: bool,
        guard: Guard,
        slots: usize,
        scratch_size: u64,
    ) -> Self {
        Self {
            index,
            info,
            adopted,
            installed: tokio::sync::Notify::new(),
            replacing: Mutex::new(()),
            state: Mutex::new(DevState {
                current: None,
                installed: 0,
                dead: false,
            }),
            create_lock: tokio::sync::Mutex::new(()),
            guard,
            slots,
            scratch_size,
        }
    }

    /// Usable: installed, not closed, its current generation not lost.
    pub(super) fn usable(&self) -> bool {
        self.state.lock().usable().is_some()
    }

    /// The current generation, lost or not (`None` before the first install and after close).
    pub(super) fn current_generation(&self) -> Option<Arc<Generation>> {
        let s = self.state.lock();
        s.current.as_ref().map(|c| Arc::clone(&c.generation))
    }

    /// Marks `generation` lost (if it is not lost already): fences on it fail with
    /// `LEASE_GPU_DEVICE_LOST`, and if it is the current one, the next checkout re-creates the
    /// device (or, for an adopted one, waits for the engine's replacement). No other
    /// generation is touched.
    pub(super) fn mark_lost(&self, generation: &Generation, reason: String) {
        let mut lost = generation.lost.lock();
        if lost.is_none() {
            tracing::error!(index = self.index, generation = generation.number, %reason, "gpu device lost");
            *lost = Some(reason);
        }
    }

    /// Requests a device from `adapter` and makes it the current generation ([`install`](Self::install)).
    pub(super) async fn open_on(
        self: &Arc<Self>,
        adapter: &wgpu::Adapter,
    ) -> Result<Arc<Generation>, GpuError> {
        let request = async {
            let desc = wgpu::DeviceDescriptor {
                label: Some("leasehold"),
                required_limits: adapter.limits(),
                ..Default::default()
            };
            adapter.request_device(&desc).await
        };
        let (device, queue) = self
            .guard
            .run_async(BackendCall::RequestDevice, self.index, request)
            .await
            .map_err(GpuError::CreateFailed)?
            .map_err(|e| GpuError::CreateFailed(e.to_string()))?;
        self.install(device, queue)
    }

    /// Makes `device` and `queue` the current generation, with new scratch and its own loss
    /// callback, and wakes the checkouts waiting for it. Every backend call is guarded: a panic
    /// is an error here. A device refused here (its scratch could not be made) is left as it
    /// came: no loss callback of leasehold's is set on it, and the current generation is
    /// untouched. One installer at a time (`open`, the holder of `create_lock`, or a
    /// replacement the engine hands over under `replacing`).
    pub(super) fn install(
        self: &Arc<Self>,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Result<Arc<Generation>, GpuError> {
        let number = self.state.lock().installed + 1;
        let made = self
            .guard
            .run(BackendCall::CreateScratch, self.index, None, || {
                let info = device.adapter_info();
                (0..self.slots)
                    .map(|sub| make_scratch(&device, self.scratch_size, self.index, sub))
                    .collect::<Result<Vec<_>, _>>()
                    .map(|scratch| (info, scratch))
            });
        let (info, scratch) = match made {
            Ok(Ok(made)) => made,
            Ok(Err(e)) | Err(e) => {
                // Dropped guarded; a panic there marks a generation nobody installed.
                let orphan = Arc::new(Generation::new(number, self.info.clone()));
                Doomed::new((device, queue), self, &orphan).drop_off_thread();
                return Err(GpuError::CreateFailed(e));
            }
        };
        let generation = Arc::new(Generation::new(number, info));
        // Only now, once the device is accepted: the callback marks this generation alone, so
        // a device that is replaced later (or lost later) never marks its successor.
        let weak = Arc::downgrade(self);
        let marked = Arc::clone(&generation);
        let set = self
            .guard
            .run(BackendCall::CreateScratch, self.index, None, || {
                device.set_device_lost_callback(move |reason, message| {
                    let reason = format!("{reason:?}: {message}");
                    match weak.upgrade() {
                        Some(dev) => dev.mark_lost(&marked, reason),
                        None => *marked.lost.lock() = Some(reason),
                    }
                });
            });
        if let Err(e) = set {
            Doomed::new((device, queue, scratch), self, &generation).drop_off_thread();
            return Err(GpuError::CreateFailed(e));
        }
        let old = {
            let mut s = self.state.lock();
            s.installed = number;
            s.current.replace(Current {
                generation: Arc::clone(&generation),
                device,
                queue,
                scratch,
            })
        };
        if let Some(old) = old {
            let was = Arc::clone(&old.generation);
            Doomed::new(old, self, &was).drop_off_thread();
        }
        self.installed.notify_waiters();
        Ok(generation)
    }

    /// Lets go of a job's handles (and the scratch it took, if the take gave it new buffers).
    /// While they belong to the current generation, the pool holds the same device and
    /// scratch, so dropping them only lowers reference counts: that happens here, guarded,
    /// under the state lock (no one can take the pool's handles meanwhile). Otherwise they may
    /// be the last handles of an old generation: off the thread.
    pub(super) fn release_job_handles(
        self: &Arc<Self>,
        generation: &Arc<Generation>,
        sub: usize,
        handles: JobHandles,
        taken: Option<SlotScratch>,
    ) {
        let state = self.state.lock();
        let held = state.current.as_ref().is_some_and(|c| {
            Arc::ptr_eq(&c.generation, generation)
                && c.device == handles.device
                && c.scratch.get(sub).is_some_and(|s| {
                    s.same_buffers(&handles.scratch)
                        && taken.as_ref().is_none_or(|t| s.same_buffers(t))
                })
        });
        if held {
            let dropped = self
                .guard
                .run(BackendCall::Drop, self.index, Some(sub), move || {
                    drop((handles, taken))
                });
            drop(state);
            if let Err(message) = dropped {
                self.mark_lost(generation, message);
            }
        } else {
            drop(state);
            Doomed::new((handles, taken), self, generation).drop_off_thread();
        }
    }

    /// Clears both scratch buffers of a sub-slot and submits the clear (when a lease takes its
    /// scratch, before any work of its own). A mapping the previous lease left on the readback
    /// buffer (done or still pending) makes wgpu refuse the submission; it is ended then, and
    /// the clear tried once more (unmapping first every time would cost every take a
    /// validation error, since a buffer that is not mapped cannot be unmapped).
    pub(super) fn zero_scratch(
        &self,
        sub: usize,
        device: &wgpu::Device,
        queue: &wgpu::Queue,
        scratch: &SlotScratch,
    ) -> Result<Zeroing, String> {
        let clear = || {
            scoped(device, || {
                let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("leasehold scratch zeroing"),
                });
                encoder.clear_buffer(&scratch.storage, 0, None);
                encoder.clear_buffer(&scratch.readback, 0, None);
                queue.submit([encoder.finish()])
            })
        };
        self.guard
            .run(BackendCall::ZeroScratch, self.index, Some(sub), || {
                clear().or_else(|_| {
                    let unmap = device.push_error_scope(wgpu::ErrorFilter::Validation);
                    scratch.readback.unmap();
                    drop(unmap.pop());
                    clear()
                })
            })
            .map(|made| match made {
                Ok(_) => Zeroing::Submitted,
                Err(e) => Zeroing::Refused(e),
            })
    }

    /// New scratch buffers for sub-slot `sub` of `generation` (wgpu zero-initialises new
    /// buffers), made on `device` (the generation's): for a scratch wgpu refused to clear (a
    /// lease destroyed it). They replace the sub-slot's scratch while `generation` is the
    /// current one. If they cannot be made either, the generation is marked lost rather than
    /// hand the old contents on.
    pub(super) fn replace_scratch(
        self: &Arc<Self>,
        generation: &Arc<Generation>,
        sub: usize,
        device: &wgpu::Device,
        why: &str,
    ) -> Result<SlotScratch, String> {
        tracing::warn!(
            index = self.index,
            sub,
            reason = why,
            "gpu scratch could not be zeroed; replacing it"
        );
        let made = self
            .guard
            .run(BackendCall::CreateScratch, self.index, Some(sub), || {
                make_scratch(device, self.scratch_size, self.index, sub)
            });
        match made {
            Ok(Ok(fresh)) => {
                let old = {
                    let mut s = self.state.lock();
                    match &mut s.current {
                        Some(c) if Arc::ptr_eq(&c.generation, generation) => c
                            .scratch
                            .get_mut(sub)
                            .map(|slot| std::mem::replace(slot, fresh.clone())),
                        _ => None,
                    }
                };
                if let Some(old) = old {
                    Doomed::new(old, self, generation).drop_off_thread();
                }
                Ok(fresh)
            }
            Ok(Err(e)) | Err(e) => {
                let reason = format!(
                    "scratch of sub-slot {sub} could neither be zeroed ({why}) nor replaced ({e})"
                );
                self.mark_lost(generation, reason.clone());
                Err(reason)
            }
        }
    }
}

/// Runs `f` inside wgpu error scopes for every error filter: a wgpu error in it becomes an
/// `Err` instead of reaching the device's uncaptured-error handler (which panics by default).
pub(super) fn scoped<T>(device: &wgpu::Device, f: impl FnOnce() -> T) -> Result<T, String> {
    let internal = device.push_error_scope(wgpu::ErrorFilter::Internal);
    let memory = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let value = f();
    // Native wgpu resolves these futures at once; one that does not counts as an error.
    let mut first = None;
    for scope in [validation, memory, internal] {
        let error = match scope.pop().now_or_never() {
            Some(None) => None,
            Some(Some(e)) => Some(e.to_string()),
            None => Some("a wgpu error scope did not resolve".to_owned()),
        };
        first = first.or(error);
    }
    match first {
        None => Ok(value),
        Some(e) => Err(e),
    }
}

fn make_scratch(
    device: &wgpu::Device,
    bytes: u64,
    index: usize,
    sub: usize,
) -> Result<SlotScratch, String> {
    let label = format!("leasehold scratch d{index}s{sub}");
    scoped(device, || SlotScratch {
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
    })
}

/// wgpu handles on their way out. Dropping a `Doomed` drops them inside the guard; a panic is
/// reported as a loss of the generation they belong to (nothing else).
pub(super) struct Doomed<T> {
    value: Option<T>,
    owner: Weak<GpuDevice>,
    generation: Arc<Generation>,
}

impl<T> Doomed<T> {
    pub(super) fn new(value: T, owner: &Arc<GpuDevice>, generation: &Arc<Generation>) -> Self {
        Self {
            value: Some(value),
            owner: Arc::downgrade(owner),
            generation: Arc::clone(generation),
        }
    }

    /// The handles, until they are dropped.
    pub(super) fn get(&self) -> Option<&T> {
        self.value.as_ref()
    }
}

impl<T: Send + 'static> Doomed<T> {
    /// Drops the handles on tokio's blocking pool when a runtime is at hand, else right here.
    /// The last handles of a device generation may wait for the GPU (and on GL for the
    /// adapter's context lock, which a blocking poll on another thread holds): that must never
    /// happen on an async worker, least of all in the supervisor's mailbox. If the runtime is
    /// shutting down, tokio drops the closure unrun, and the `Doomed` inside it is dropped,
    /// guarded, on this thread.
    pub(super) fn drop_off_thread(self) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => drop(runtime.spawn_blocking(move || drop(self))),
            Err(_) => drop(self),
        }
    }
}

impl<T> Drop for Doomed<T> {
    fn drop(&mut self) {
        let Some(value) = self.value.take() else {
            return;
        };
        let owner = self.owner.upgrade();
        let guard = owner.as_ref().map(|o| o.guard.clone()).unwrap_or_default();
        let index = owner.as_ref().map_or(0, |o| o.index);
        if let Err(message) = guard.run(BackendCall::Drop, index, None, move || drop(value)) {
            match owner {
                Some(owner) => owner.mark_lost(&self.generation, message),
                None => *self.generation.lost.lock() = Some(message),
            }
        }
    }
}
