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
mod broker;
#[cfg(feature = "conformance")]
#[cfg_attr(docsrs, doc(cfg(feature = "conformance")))]
pub mod conformance;
mod counters;
mod desk;
mod error;
mod fencing;
#[cfg(feature = "gpu")]
mod gpu;
mod hosts;
mod job;
mod job_handle;
mod lease;
mod outside;
mod paths;
mod process;
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
#[cfg_attr(docsrs, doc(cfg(feature = "fault-injection")))]
pub use counters::Counts;
pub use desk::{ActorLease, LeaseMsg, ReleaseError};
pub use error::{
    AcquireError, BodyError, BodyErrorKind, CleanupError, CleanupErrorKind, JobError,
    LeaseReleased, PrepareError, ResizeError, ShutdownError, StartError, SupervisorStopped, codes,
};
pub use fencing::{FencingGuard, StaleToken};
#[cfg(all(feature = "gpu", feature = "fault-injection"))]
pub use gpu::BackendCall;
#[cfg(feature = "gpu")]
pub use gpu::{FencePolicy, GpuError, GpuOptions, JobGpu, ScratchPolicy, SlotScratch};
pub use job::{InvalidJob, JobSpec, MAX_JOB_ID_LEN, PRIORITY_AGING_GRANTS, Priority};
pub use job_handle::JobHandle;
pub use lease::Lease;
pub use paths::{PathRefused, PathRefusedReason};
pub use process::{JobProcess, ProcessError, ProcessSpec};
pub use sink::OrphanedFailure;
pub use supervisor::{
    GpuDeviceInfo, LeaseInfo, LeaseKind, LeasePhase, QuarantinedSlot, ReclaimReport,
    ShutdownReport, SpawnedJob, Stats, Supervisor, SupervisorBuilder, UnclosedDevice, WaiterInfo,
    WaitingFor, metric_names,
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
