// README.md is the crate's front page. Its links point to docs.rs and to the repository's files, so
// that they work on GitHub. The definitions below come first, and the first definition of a link
// wins: rustdoc takes these instead, intra-doc links that it checks, and absolute addresses for the
// repository's files. A link added to README.md gets its line here.
//! [`Supervisor`]: crate::Supervisor
//! [`Supervisor::run`]: crate::Supervisor::run
//! [`WorkerContext`]: crate::WorkerContext
//! [`Lease`]: crate::Lease
//! [`JobHandle`]: crate::JobHandle
//! [`FencingGuard`]: crate::FencingGuard
//! [`SlotBroker`]: crate::SlotBroker
//! [`LocalBroker`]: crate::LocalBroker
//! [`broker`]: crate::broker
//! [`process`]: crate::process
//! [`error`]: crate::error
//! [`codes`]: crate::codes
//! [quickstart]: crate::guide::quickstart
//! [explicit_lease]: crate::guide::explicit_lease
//! [frame_loop]: crate::guide::frame_loop
//! [job_actors]: crate::guide::job_actors
//! [pool_controls]: crate::guide::pool_controls
//! [metrics]: crate::guide::metrics
//! [console]: crate::guide::console
//! [etcd]: crate::guide::etcd
//! [troubleshooting]: crate::guide::troubleshooting
#![cfg_attr(feature = "gpu", doc = "[gpu]: crate::gpu")]
//! [gpu]: https://github.com/leasehold-rs/leasehold/blob/main/docs/gpu.md
//! [console-readme]: https://github.com/leasehold-rs/leasehold/blob/main/console/README.md
//! [etcd-readme]: https://github.com/leasehold-rs/leasehold/blob/main/etcd/README.md
//! [architecture]: https://github.com/leasehold-rs/leasehold/blob/main/ARCHITECTURE.md
//! [design]: https://github.com/leasehold-rs/leasehold/blob/main/DESIGN.md
//! [changelog]: https://github.com/leasehold-rs/leasehold/blob/main/CHANGELOG.md
//! [benchmarks]: https://github.com/leasehold-rs/leasehold/blob/main/BENCHMARKS.md
//! [contributing]: https://github.com/leasehold-rs/leasehold/blob/main/CONTRIBUTING.md
//!
#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(
    missing_docs,
    missing_debug_implementations,
    unreachable_pub,
    rust_2018_idioms
)]
#![deny(unused_must_use)]

mod actor_job;
pub mod broker;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod counters;
pub mod error;
mod fencing;
#[cfg(feature = "gpu")]
#[cfg_attr(docsrs, doc(cfg(feature = "gpu")))]
pub mod gpu;
mod gpu_info;
pub mod guide;
mod hosts;
mod job;
mod lease;
pub mod metric_names;
mod outside;
mod paths;
pub mod process;
mod sink;
mod supervisor;
mod worker;

pub use actor_job::{ActorExit, ActorJobError, CANCEL_STOP_REASON};
pub use broker::{
    AcquireRequest, BrokerError, BrokerErrorKind, BrokerEvent, BrokerEvents, LocalBroker,
    SlotBroker, SlotToken,
};
/// Unstable test support (feature `fault-injection`): counts of messages, doorbells and tasks
/// for leasehold's own benches. Not covered by semantic versioning.
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub use counters::Counts;
pub use error::{
    AcquireError, BodyError, BodyErrorKind, CleanupError, CleanupErrorKind, JobError,
    LeaseReleased, PrepareError, ResizeError, ShutdownError, StartError, SupervisorStopped, codes,
};
pub use fencing::{FencingGuard, StaleToken};
#[cfg(all(feature = "gpu", feature = "fault-injection"))]
#[doc(hidden)]
pub use gpu::BackendCall;
#[cfg(feature = "gpu")]
pub use gpu::{FencePolicy, GpuError, GpuOptions, JobGpu, ScratchPolicy, SlotScratch};
pub use gpu_info::{GpuDeviceInfo, GpuDeviceState};
pub use job::{InvalidJob, JobSpec, MAX_JOB_ID_LEN, PRIORITY_AGING_GRANTS, Priority};
pub use lease::Lease;
pub use paths::{PathRefused, PathRefusedReason};
pub use process::{JobProcess, ProcessError, ProcessSpec};
pub use sink::OrphanedFailure;
pub use supervisor::{
    ActorLease, JobHandle, LeaseInfo, LeaseKind, LeaseMsg, LeasePhase, QuarantinedSlot,
    ReclaimReport, ReleaseError, ShutdownReport, SpawnedJob, Stats, Supervisor, SupervisorBuilder,
    UnclosedDevice, WaiterInfo, WaitingFor,
};
/// Re-exported (feature `gpu`) so that jobs use exactly the wgpu the supervisor was built with.
#[cfg(feature = "gpu")]
pub use wgpu;
pub use worker::WorkerContext;

/// Re-exported so that job actors ([`Supervisor::spawn_job`]) and lease desk callers
/// ([`LeaseMsg`]) implement and call exactly the ractor the supervisor was built with.
pub use ractor;
/// Re-exported so that callers can build the token [`JobSpec::with_cancel`] takes.
pub use tokio_util::sync::CancellationToken;

impl<E> From<InvalidJob> for JobError<E> {
    fn from(err: InvalidJob) -> Self {
        JobError::Invalid(err)
    }
}
