#![doc = include_str!("../../docs/gpu.md")]

// The code behind the page:
//
// GPU devices owned by the supervisor (feature `gpu`).
//
// The pool creates every device once, at start, or adopts the devices the engine created
// ([`GpuOptions::adopt`]: never re-created, destroyed or drained by leasehold; a lost one waits
// for the engine's replacement). Each installed device is a *generation* of its index, with
// its own adapter info and its own loss: a lease keeps the generation it checked out, is
// fenced on it, and fails only if that generation is lost. A GPU slot is a *sub-slot* of one
// device: `slots_per_device` per device, each with scratch buffers of its own that are (by
// default) cleared to zero when a lease takes them, by a clear queued before the lease's own
// work. The supervisor places a new lease on the least-loaded device (bookkeeping only, in
// its mailbox); the worker checks the device out before the body runs (re-creating a lost
// device on the way, one creator at a time, with backoff); after the worker has physically
// ended, the release waits for the lease's GPU work per the fence policy (a blocking poll on
// the blocking pool, never in the supervisor's mailbox), and not at all for a lease that has
// none.
//
// Containment: every wgpu call here that can panic (polls and waits, submissions, device and
// buffer creation, clears, drops of handles that may be a device's last) runs inside a guard
// (`contain`), and a panic is a loss of the device. Files:
//
// - `options.rs`: [`GpuOptions`], [`FencePolicy`], [`ScratchPolicy`], the platform's backends;
// - `error.rs`: [`GpuError`];
// - `handles.rs`: [`SlotScratch`] and the handles a job holds (plain data);
// - `job.rs`: [`JobGpu`], what a job borrows;
// - `device.rs`: one device, its generations (each with its adapter info and its own loss),
//   scratch creation and zeroing, and `Doomed` (handles dropped inside the guard, a panic
//   marking their generation lost);
// - `pool.rs`: `GpuPool` (placement, checkout, re-creation, fence, close);
// - `contain.rs`: the panic guard and the fault-injection hook.

mod contain;
mod device;
mod error;
mod handles;
mod job;
mod options;
mod pool;

#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use contain::BackendCall;
pub use error::GpuError;
pub use handles::SlotScratch;
pub use job::JobGpu;
pub use options::{FencePolicy, GpuOptions, ScratchPolicy};
pub(crate) use pool::{FenceFailure, GpuPool, LostDevice, Placement};
