//! GPU devices owned by the supervisor (feature `gpu`).
//!
//! The pool creates every device once, at start, or adopts the devices the engine created
//! ([`GpuOptions::adopt`]: never re-created, destroyed or drained by leasehold; a lost one waits
//! for the engine's replacement). A GPU slot is a *sub-slot* of one device:
//! `slots_per_device` per device, each with scratch buffers of its own that are handed to the
//! next lease only after the previous lease's GPU work has completed, and (by default) cleared
//! to zero. The supervisor places a new lease on the least-loaded device (bookkeeping only, in
//! its mailbox); the worker checks the device out before the body runs (re-creating a lost
//! device on the way, one creator at a time, with backoff); after the worker has physically
//! ended, the release waits for every submission made on the device's queue before that point
//! and zeroes the scratch (blocking polls on the blocking pool, never in the supervisor's
//! mailbox).
//!
//! Containment: every wgpu call here that can panic (polls and waits, submissions, device and
//! buffer creation, clears, drops of handles that may be a device's last) runs inside a guard
//! (`contain`), and a panic is a loss of the device. Files:
//!
//! - `options.rs`: [`GpuOptions`], [`FencePolicy`], [`ScratchPolicy`], the platform's backends;
//! - `error.rs`: [`GpuError`];
//! - `handles.rs`: [`SlotScratch`] and the handles a job holds (plain data);
//! - `job.rs`: [`JobGpu`], what a job borrows;
//! - `device.rs`: one device, its generations, scratch creation and zeroing, loss marking, and
//!   `Doomed` (handles dropped inside the guard, a panic marking their generation lost);
//! - `pool.rs`: `GpuPool` (placement, checkout, re-creation, fence, close);
//! - `contain.rs`: the panic guard and the fault-injection hook.

mod contain;
mod device;
mod error;
mod handles;
mod job;
mod options;
mod pool;

#[cfg(feature = "fault-injection")]
pub use contain::BackendCall;
pub use error::GpuError;
pub use handles::SlotScratch;
pub use job::JobGpu;
pub use options::{FencePolicy, GpuOptions, ScratchPolicy};
pub(crate) use pool::{FenceFailure, GpuPool, Placement};

/// A device whose close (`GpuPool::close_within`) could not be proven within its bound: its
/// remaining work had not completed, or the backend panicked while waiting or destroying it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unclosed {
    /// The device's index.
    pub(crate) device: usize,
    /// Why, for logs and reports.
    pub(crate) reason: String,
}
