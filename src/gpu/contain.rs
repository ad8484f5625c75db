//! Containment (DESIGN.md invariant 9): every wgpu call of the pool that can panic runs inside
//! a [`Guard`], and a panic comes back as a message the caller turns into a device loss. wgpu
//! handles the pool lets go of travel as [`Doomed`], whose drop is guarded too and, when they
//! may be the last handles of a device generation, happens on the blocking pool.

use std::future::Future;
use std::sync::Arc;

/// Where the pool calls into the GPU backend (feature `fault-injection`, for leasehold's own
/// fault-injection tests; see `GpuOptions::backend_hook`).
#[cfg_attr(not(feature = "fault-injection"), allow(unreachable_pub))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum BackendCall {
    /// Creating a wgpu instance and enumerating its adapters (at start, at re-creation).
    Enumerate,
    /// Requesting a device from an adapter (at start, at re-creation).
    RequestDevice,
    /// Creating a sub-slot's scratch buffers.
    CreateScratch,
    /// A submission through `JobGpu::submit` or `JobGpu::try_submit`.
    Submit,
    /// The fence's non-blocking poll.
    FencePoll,
    /// The fence's own empty submission (`FencePolicy::Queue`, for a lease that took its
    /// queue).
    FenceSubmit,
    /// The fence's blocking wait.
    FenceWait,
    /// Zeroing a sub-slot's scratch when a lease takes it: a clear of both buffers, submitted.
    ZeroScratch,
    /// Dropping wgpu handles that may be the last ones of a device generation.
    Drop,
    /// Waiting for a device's remaining work and destroying it at shutdown.
    Close,
}

/// A test's fault-injection hook: `(call, device index, sub-slot)`.
pub(crate) type BackendHook = Arc<dyn Fn(BackendCall, usize, Option<usize>) + Send + Sync>;

/// Runs backend calls under `catch_unwind`, with the test hook (if any) just before each.
#[derive(Clone, Default)]
pub(super) struct Guard {
    hook: Option<BackendHook>,
}

impl Guard {
    pub(super) fn new(hook: Option<BackendHook>) -> Self {
        Self { hook }
    }

    /// Runs one backend call. A panic in it (the backend's own, or one from a callback the call
    /// ran: map and work-done callbacks run inside polls and submissions) comes back as its
    /// message; the caller marks the device lost, so the state the panic may have left behind
    /// is never used by the pool again (which is what makes `AssertUnwindSafe` sound here).
    pub(super) fn run<T>(
        &self,
        call: BackendCall,
        device: usize,
        sub: Option<usize>,
        f: impl FnOnce() -> T,
    ) -> Result<T, String> {
        // Through leasehold's one way of calling code it did not write.
        crate::outside::call(|| {
            if let Some(hook) = &self.hook {
                hook(call, device, sub);
            }
            f()
        })
        .map_err(|message| describe(call, &message))
    }

    /// [`run`](Self::run) for an async backend call (enumeration, device requests).
    pub(super) async fn run_async<F: Future>(
        &self,
        call: BackendCall,
        device: usize,
        fut: F,
    ) -> Result<F::Output, String> {
        let hook = self.hook.clone();
        crate::outside::caught(async move {
            if let Some(hook) = hook {
                hook(call, device, None);
            }
            fut.await
        })
        .await
        .map_err(|message| describe(call, &message))
    }
}

fn describe(call: BackendCall, message: &str) -> String {
    format!("the gpu backend panicked ({call:?}): {message}")
}
