//! One error type per operation, each with a stable code.
//!
//! Every operation says what went wrong in a type of its own, and every error type answers `code()`
//! with one of the stable strings of [`codes`]. A code names what happened; the type keeps every
//! part of it, so that nothing is lost when two things fail at once:
//!
//! | type | returned by | codes |
//! |---|---|---|
//! | [`StartError`] | [`SupervisorBuilder::start`](crate::SupervisorBuilder::start) | `SUPERVISOR_START_FAILED` |
//! | [`AcquireError`] | [`Supervisor::acquire`](crate::Supervisor::acquire), `acquire_many`, `try_acquire`; inside [`JobError::Acquire`] | the `LEASE_ACQUIRE_*` codes, `LEASE_SLOT_COUNT_INVALID`, `LEASE_NO_SLOT_FREE`, `LEASE_BROKER_UNSUPPORTED`, `SUPERVISOR_STOPPED` |
//! | [`JobError<E>`](JobError) | [`Supervisor::run`](crate::Supervisor::run), [`JobHandle`](crate::JobHandle) (`submit`, `spawn_job`) | the code of the part that failed, or `LEASE_BODY_AND_CLEANUP_FAILED` |
//! | [`PrepareError`] | inside [`JobError::Unprepared`]; [`WorkerContext::try_temp_dir`](crate::WorkerContext::try_temp_dir) | `LEASE_PREPARE_FAILED` |
//! | [`BodyError<E>`](BodyError) | inside [`JobError::Body`] and [`JobError::BodyAndCleanup`] | `LEASE_BODY_FAILED`, `LEASE_BODY_PANICKED`, `LEASE_BODY_CANCELLED`, `LEASE_DELIVERY_UNKNOWN`, `LEASE_LOST` |
//! | [`CleanupError`] | [`Lease::release`](crate::Lease::release); inside [`JobError::Cleanup`] and [`JobError::BodyAndCleanup`]; the error sink | the `LEASE_CLEANUP_*` codes, `LEASE_GPU_DEVICE_LOST`, `SUPERVISOR_STOPPED` |
//! | [`ShutdownError`] | [`Supervisor::shutdown`](crate::Supervisor::shutdown) | `SUPERVISOR_STOPPED` |
//! | [`ResizeError`] | [`Supervisor::resize`](crate::Supervisor::resize) | `LEASE_SLOT_COUNT_INVALID`, `LEASE_BROKER_UNSUPPORTED`, `SUPERVISOR_STOPPED` |
//! | [`SupervisorStopped`] | the control calls: `cancel`, `quarantined`, `reclaim_quarantined`, `waiters`, `lease_desk` | `SUPERVISOR_STOPPED` |
//! | [`LeaseReleased`] | a [`Lease`](crate::Lease)'s `slot_id`, `lease_id`, `token`, `tokens` | `LEASE_RELEASED` |
//!
//! Beside them, where their operation lives: [`InvalidJob`] (`JobSpec::new`),
//! [`PathRefused`](crate::PathRefused) (`ctx.path(..)`),
//! [`ProcessError`](crate::process::ProcessError) (child processes),
//! [`ReleaseError`](crate::ReleaseError) (the lease desk), [`ActorJobError`](crate::ActorJobError)
//! (a job actor's own failure, inside `JobError`), [`StaleToken`](crate::StaleToken) (fencing),
//! [`BrokerError`] (what a broker answers) and `GpuError` (feature
//! `gpu`).
//!
//! # Which failure wins
//!
//! A job's own failures are decided only after the body and every task it spawned through its
//! context have ended, in this order: delivery-unknown > lease lost > cancellation > panic > an
//! ordinary error. [`BodyError::kind`] says which won, and the others are kept beside it (the
//! body's own error, every panic message). A cleanup failure never replaces the body's: when both
//! fail, [`JobError::BodyAndCleanup`] holds both. A cleanup failure nobody is left to hear (a
//! dropped [`Lease`](crate::Lease), a dropped `run` future) goes to the error sink, the
//! `render_slot.release.failed.count` metric and a `tracing` error event (see
//! [`Supervisor`](crate::Supervisor#what-happens-when)).
//!
//! # Shape
//!
//! Every error type implements `Debug`, `Display` and [`std::error::Error`] (`JobError<E>` and
//! `BodyError<E>` when `E` does), and is `Send + Sync`, checked at compile time. Display strings
//! are lowercase without a full stop; a cause is shown through [`std::error::Error::source`], never
//! repeated in `Display`. The types that may grow are `#[non_exhaustive]`.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::broker::{BrokerError, SlotToken};
use crate::job::InvalidJob;

/// Stable error codes, as listed in the public contract: what `code()` returns on leasehold's
/// error types.
///
/// A code never changes meaning; a new one may be added. Every constant in this module is listed in
/// the first table; the error types that live elsewhere have codes of their own, in the second and
/// third.
///
/// # The supervisor's codes
///
/// `err.code()` on a [`JobError`] returns one of these (so do the errors of the
/// other operations, in the second column):
///
/// | code | error types | when |
/// |---|---|---|
/// | `JOB_INVALID` | `InvalidJob` (`JobSpec::new`), `JobError::Invalid` | the `JobSpec` was rejected at the boundary; nothing was acquired |
/// | `LEASE_ACQUIRE_CANCELLED` | `AcquireError`, `JobError::Acquire` | the caller cancelled while waiting for a slot; nothing leaked |
/// | `LEASE_ACQUIRE_TIMEOUT` | `AcquireError`, `JobError::Acquire` | no slot within the acquire timeout |
/// | `LEASE_ACQUIRE_FAILED` | `AcquireError`, `JobError::Acquire` | the broker refused or failed, or returned a token the supervisor refuses; no release was invented |
/// | `LEASE_PREPARE_FAILED` | `PrepareError`, `JobError::Unprepared` | a slot was granted, but the job could not be prepared to run (its GPU device could not be made usable, no GPU sub-slot was usable, its worker could not be spawned); no body ran and the slot went back through the pipeline (`cleanup_error()` keeps the release's own failure, if any). Also `ctx.try_temp_dir()`'s error (`PrepareError::TempDir`) when the temp dir, made on first use, could not be made (a work root that is not a directory, cannot be written, is full or busy): the body runs on, `ctx.temp_dir()` returns a path that does not exist, the run keeps its own result, and no slot is quarantined for the dir that never existed |
/// | `LEASE_BODY_FAILED` | `BodyError`, `JobError::Body` | the body returned `Err(E)`; cleanup succeeded |
/// | `LEASE_BODY_PANICKED` | `BodyError`, `JobError::Body` | the body, or a task it spawned through its context, panicked; cleanup succeeded |
/// | `LEASE_BODY_CANCELLED` | `BodyError`, `JobError::Body` | the job was cancelled (wins over an ordinary error or a panic); cleanup succeeded |
/// | `LEASE_DELIVERY_UNKNOWN` | `BodyError`, `JobError::Body` | the body called `ctx.mark_delivery_unknown(..)`: an external effect may or may not have happened (wins over everything) |
/// | `LEASE_LOST` | `BodyError`, `JobError::Body` | the broker could not keep the lease alive (a distributed broker's TTL may lapse, or has): the job was cancelled at once; wins over everything but `LEASE_DELIVERY_UNKNOWN`, and over a value the body returned anyway (`body_error().lease_lost()` says why) |
/// | `LEASE_CLEANUP_TIMEOUT` | `CleanupError`, `JobError::Cleanup` | the body succeeded; the release did not finish within the cleanup timeout |
/// | `LEASE_CLEANUP_FAILED` | `CleanupError`, `JobError::Cleanup` | the body succeeded; the release failed |
/// | `LEASE_CLEANUP_UNCONFIRMED` | `CleanupError`, `JobError::Cleanup` | physical completion could not be proven in its bound (GPU fence included); the slot is quarantined |
/// | `LEASE_GPU_DEVICE_LOST` | `CleanupError` (kind `GpuDeviceLost`), `JobError::Cleanup`; `GpuError::DeviceLost` (third table) | the lease's GPU device was lost: `JobError::Cleanup`, or `cleanup_error()` under `LEASE_BODY_AND_CLEANUP_FAILED`; the slot is quarantined until the device is re-created |
/// | `LEASE_BODY_AND_CLEANUP_FAILED` | `JobError::BodyAndCleanup` | both failed; `body_error()` and `cleanup_error()` both return `Some` |
/// | `SUPERVISOR_STOPPED` | `AcquireError`, `CleanupError`, `ResizeError`, `ShutdownError`, `SupervisorStopped` | the supervisor has shut down (or its runtime is gone); nothing was acquired. The control calls (`cancel`, `quarantined`, `reclaim_quarantined`, `waiters`, `lease_desk`) answer it as `SupervisorStopped` |
/// | `SUPERVISOR_START_FAILED` | `StartError` | `start()` refused the configuration (no slots, zero capacity, a zero duration, unusable work root, no runtime), the broker's `attach` panicked (`StartError::BrokerAttach`), or (`StartError::Gpu`) could not open the GPU devices |
/// | `LEASE_SLOT_COUNT_INVALID` | `AcquireError`, `ResizeError` | a multi-slot request asked for 0 slots or for more than the capacity (also when a `resize` lowers the capacity below a request still waiting), or `resize(0)`; nothing was acquired |
/// | `LEASE_NO_SLOT_FREE` | `AcquireError` | `try_acquire` found every slot held, or callers waiting ahead; nothing was acquired or queued |
/// | `LEASE_BROKER_UNSUPPORTED` | `AcquireError`, `ResizeError` | a multi-slot lease, `try_acquire` or `resize` on a broker other than the supervisor's in-process pool (`EtcdBroker`, a custom broker); nothing was asked of the broker |
/// | `LEASE_NOT_HELD` | `ReleaseError` (the lease desk's `LeaseMsg::Release`) | that actor holds no lease of that id through the desk (another actor's, never granted, or already released); nothing was released |
/// | `LEASE_FENCED` | `StaleToken` (`FencingGuard::check`) | the token is older than one the guard already accepted: its lease was lost and the slot has a newer holder. Never a `JobError` code itself |
///
/// # Codes of the lease, the context and the broker
///
/// These error types keep their code next to them, not in this module:
///
/// | code | type | when |
/// |---|---|---|
/// | `LEASE_RELEASED` | `LeaseReleased` from `Lease::slot_id()`, `lease_id()`, `token()`, `tokens()`; `GpuError::LeaseEnded` from a `JobGpu` kept past its lease | the lease's release has begun (or it was lost): its token may already be someone else's |
/// | `JOB_PATH_REFUSED` | `PathRefused` (`PathRefused::CODE`) from `ctx.path(..)`; `ProcessError::Path` from `ctx.spawn_process(..)` | the path is absolute, has a `..` component, is empty, goes through a symlink that leaves the temp dir or dangles, or cannot be inspected (`PathRefused::reason()`); nothing was read, written or run |
/// | `PROCESS_SPAWN_FAILED` | `ProcessError::Spawn` from `ctx.spawn_process(..)` | the program could not be started (on Windows: never started, job processes need Unix process groups) |
/// | `PROCESS_WAIT_FAILED` | `ProcessError::Wait` from `JobProcess::wait()` | the child's exit status could not be read |
/// | `BROKER_PANICKED` | `BrokerError` (`BrokerError::PANICKED`, kind `Panicked`) | a broker call panicked; the supervisor caught it. It reaches the caller inside `LEASE_ACQUIRE_FAILED` or `LEASE_CLEANUP_FAILED` (`BrokerError::code()` is otherwise the broker's own code, if it gave one) |
///
/// A body that passes one of the context's errors on with `?` ends `LEASE_BODY_FAILED`, with it as
/// `body_error().error()`.
///
/// # Codes of the GPU pool (feature `gpu`)
///
/// `GpuError` is never a `JobError` code itself; it travels inside another error, or answers
/// `Supervisor::replace_device` itself:
///
/// | code | type | surfaced as |
/// |---|---|---|
/// | `GPU_UNAVAILABLE` | `GpuError::NoAdapter` (no acceptable adapter), `GpuError::CreateFailed` (a device could not be created or re-created) | `SUPERVISOR_START_FAILED` through `StartError::Gpu` from `start()`; `LEASE_PREPARE_FAILED` through `PrepareError::Gpu` from `run`; itself from `replace_device` when the new device refused the scratch buffers (nothing was installed) |
/// | `LEASE_GPU_DEVICE_LOST` | `GpuError::DeviceLost` | `LEASE_PREPARE_FAILED` through `PrepareError::Gpu`, when a job's checkout finds the device gone |
/// | `GPU_REPLACE_REFUSED` | `GpuError::ReplaceRefused` | itself, from `replace_device`: no GPU, no device of that index, a device leasehold opened itself (it re-creates those), or a supervisor that has shut down; nothing was installed |
///
/// `GPU_UNAVAILABLE` and `GPU_REPLACE_REFUSED` are not constants of this module; a lease whose
/// device is lost while it holds it reports `LEASE_GPU_DEVICE_LOST` through its `CleanupError`,
/// as in the first table.
pub mod codes {
    /// The job spec was rejected at the boundary; nothing was acquired.
    pub const JOB_INVALID: &str = "JOB_INVALID";
    /// The caller cancelled while waiting for a slot; nothing leaked.
    pub const LEASE_ACQUIRE_CANCELLED: &str = "LEASE_ACQUIRE_CANCELLED";
    /// No slot within the acquire timeout.
    pub const LEASE_ACQUIRE_TIMEOUT: &str = "LEASE_ACQUIRE_TIMEOUT";
    /// The broker refused or failed; no release was invented.
    pub const LEASE_ACQUIRE_FAILED: &str = "LEASE_ACQUIRE_FAILED";
    /// The body returned `Err(E)`; cleanup succeeded.
    pub const LEASE_BODY_FAILED: &str = "LEASE_BODY_FAILED";
    /// The body (or a task it spawned through its context) panicked; cleanup succeeded.
    pub const LEASE_BODY_PANICKED: &str = "LEASE_BODY_PANICKED";
    /// The job was cancelled; cleanup succeeded.
    pub const LEASE_BODY_CANCELLED: &str = "LEASE_BODY_CANCELLED";
    /// The body reported that an external effect may or may not have happened.
    pub const LEASE_DELIVERY_UNKNOWN: &str = "LEASE_DELIVERY_UNKNOWN";
    /// The body succeeded; the release did not finish within the cleanup timeout.
    pub const LEASE_CLEANUP_TIMEOUT: &str = "LEASE_CLEANUP_TIMEOUT";
    /// The body succeeded; the release failed.
    pub const LEASE_CLEANUP_FAILED: &str = "LEASE_CLEANUP_FAILED";
    /// Physical completion could not be proven in its bound; the slot is quarantined.
    pub const LEASE_CLEANUP_UNCONFIRMED: &str = "LEASE_CLEANUP_UNCONFIRMED";
    /// Both the body and the cleanup failed.
    pub const LEASE_BODY_AND_CLEANUP_FAILED: &str = "LEASE_BODY_AND_CLEANUP_FAILED";
    /// The supervisor has shut down (or its runtime is gone).
    pub const SUPERVISOR_STOPPED: &str = "SUPERVISOR_STOPPED";
    /// The GPU device of the lease was lost; the slot is quarantined until the device is
    /// replaced.
    pub const LEASE_GPU_DEVICE_LOST: &str = "LEASE_GPU_DEVICE_LOST";
    /// The supervisor could not start with this configuration.
    pub const SUPERVISOR_START_FAILED: &str = "SUPERVISOR_START_FAILED";
    /// The lease could not be kept alive (a distributed broker's TTL may lapse, or has): the
    /// job was cancelled at once; its writes may be refused by fencing.
    pub const LEASE_LOST: &str = "LEASE_LOST";
    /// A fencing token older than one already accepted was refused.
    pub const LEASE_FENCED: &str = "LEASE_FENCED";
    /// A request for 0 slots, or for more slots than the capacity (a multi-slot lease, a
    /// resize to 0); nothing was acquired.
    pub const LEASE_SLOT_COUNT_INVALID: &str = "LEASE_SLOT_COUNT_INVALID";
    /// `try_acquire` found no slot free (or callers waiting ahead); nothing was acquired.
    pub const LEASE_NO_SLOT_FREE: &str = "LEASE_NO_SLOT_FREE";
    /// The broker cannot serve this request (a multi-slot lease, `try_acquire` or a resize on a
    /// broker other than the supervisor's in-process pool); nothing was acquired.
    pub const LEASE_BROKER_UNSUPPORTED: &str = "LEASE_BROKER_UNSUPPORTED";
    /// A release by message named a lease that actor does not hold through the lease desk;
    /// nothing was released.
    pub const LEASE_NOT_HELD: &str = "LEASE_NOT_HELD";
    /// A job was granted its slot but could not be prepared to run (its GPU device, its
    /// worker); no body ran and the slot went back through the release pipeline. Also the code
    /// of the error [`WorkerContext::try_temp_dir`](crate::WorkerContext::try_temp_dir) returns
    /// when the job's temp dir (made on first use) could not be made.
    pub const LEASE_PREPARE_FAILED: &str = "LEASE_PREPARE_FAILED";
}

/// Why [`Supervisor::acquire`](crate::Supervisor::acquire) (or the acquire step of a job) ended
/// without a slot. Nothing was leaked in any case.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum AcquireError {
    /// The caller cancelled while waiting.
    Cancelled,
    /// No slot within the acquire timeout.
    TimedOut {
        /// The timeout that ran out.
        after: Duration,
    },
    /// The broker refused or failed, or returned a token the supervisor refuses.
    Failed(BrokerError),
    /// The supervisor has shut down or its runtime is gone.
    Stopped,
    /// 0 slots asked for, or more than the capacity (at the request, or after a resize lowered
    /// the capacity below it).
    SlotCount {
        /// The slots asked for.
        wanted: u32,
        /// The capacity then.
        capacity: u32,
    },
    /// [`try_acquire`](crate::Supervisor::try_acquire): no slot was free, or callers were
    /// waiting ahead.
    NoSlotFree,
    /// The broker cannot serve this request: what was asked.
    Unsupported(&'static str),
}

impl AcquireError {
    /// `LEASE_ACQUIRE_CANCELLED`, `LEASE_ACQUIRE_TIMEOUT`, `LEASE_ACQUIRE_FAILED`,
    /// `SUPERVISOR_STOPPED`, `LEASE_SLOT_COUNT_INVALID`, `LEASE_NO_SLOT_FREE` or
    /// `LEASE_BROKER_UNSUPPORTED`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::SlotCount { .. } => codes::LEASE_SLOT_COUNT_INVALID,
            Self::NoSlotFree => codes::LEASE_NO_SLOT_FREE,
            Self::Unsupported(_) => codes::LEASE_BROKER_UNSUPPORTED,
            Self::Cancelled => codes::LEASE_ACQUIRE_CANCELLED,
            Self::TimedOut { .. } => codes::LEASE_ACQUIRE_TIMEOUT,
            Self::Failed(_) => codes::LEASE_ACQUIRE_FAILED,
            Self::Stopped => codes::SUPERVISOR_STOPPED,
        }
    }
}

impl fmt::Display for AcquireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cancelled => f.write_str("acquire cancelled while waiting for a slot"),
            Self::TimedOut { after } => write!(f, "no slot within {after:?}"),
            Self::Failed(_) => f.write_str("slot acquire failed"),
            Self::Stopped => f.write_str("supervisor stopped"),
            Self::SlotCount { wanted, capacity } => write!(
                f,
                "{wanted} slots asked for; a lease takes 1 to {capacity} slots here"
            ),
            Self::NoSlotFree => f.write_str("no slot free"),
            Self::Unsupported(what) => write!(f, "the broker does not support {what}"),
        }
    }
}

impl std::error::Error for AcquireError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Failed(e) => Some(e),
            _ => None,
        }
    }
}

/// Why a job that was granted its slot could not be prepared to run (no body ran; the slot went
/// back through the release pipeline), or, for [`TempDir`](Self::TempDir), why the temp dir the
/// body asked for could not be made (the body runs on; see
/// [`WorkerContext::try_temp_dir`](crate::WorkerContext::try_temp_dir)). Code:
/// `LEASE_PREPARE_FAILED`.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum PrepareError {
    /// The job's temp dir could not be made under the work root (returned by
    /// [`WorkerContext::try_temp_dir`](crate::WorkerContext::try_temp_dir); a job's result
    /// never carries it, since the body runs whether or not it could be made).
    TempDir(Arc<io::Error>),
    /// The job's GPU device could not be made usable (feature `gpu`).
    #[cfg(feature = "gpu")]
    Gpu(crate::gpu::GpuError),
    /// No GPU sub-slot was usable for the job (every device lost or given up).
    NoGpuSlot,
    /// The job's worker actor could not be spawned.
    WorkerSpawn(String),
}

impl PrepareError {
    /// Always `LEASE_PREPARE_FAILED`.
    pub fn code(&self) -> &'static str {
        codes::LEASE_PREPARE_FAILED
    }
}

impl fmt::Display for PrepareError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TempDir(_) => f.write_str("could not create the job's temp dir"),
            #[cfg(feature = "gpu")]
            Self::Gpu(_) => f.write_str("the slot's gpu device is unavailable"),
            Self::NoGpuSlot => f.write_str("no usable gpu sub-slot"),
            Self::WorkerSpawn(why) => write!(f, "could not spawn the job's worker: {why}"),
        }
    }
}

impl std::error::Error for PrepareError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::TempDir(e) => Some(&**e),
            #[cfg(feature = "gpu")]
            Self::Gpu(e) => Some(e),
            Self::NoGpuSlot | Self::WorkerSpawn(_) => None,
        }
    }
}

/// What went wrong in cleanup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CleanupErrorKind {
    /// The broker release did not finish within the cleanup timeout.
    Timeout,
    /// The broker release failed.
    Failed,
    /// Physical completion (worker exit, tracked tasks, temp dir removal) could not be proven
    /// within its bound; the slot is quarantined, never declared clean.
    Unconfirmed,
    /// The supervisor was gone before the release could finish.
    SupervisorStopped,
    /// The lease's GPU device was lost; the slot is quarantined until it is replaced.
    GpuDeviceLost,
}

/// A release that did not finish cleanly. Cloneable: one failure may be reported to several
/// places (the caller and the error sink never both, but repeated `release` calls may share it).
/// One pointer wide: it travels in every release's answer, and a failure is the rare case.
#[derive(Debug, Clone)]
pub struct CleanupError {
    inner: Box<CleanupInner>,
}

#[derive(Debug, Clone)]
struct CleanupInner {
    kind: CleanupErrorKind,
    token: Option<SlotToken>,
    detail: Option<String>,
    source: Option<CleanupSource>,
}

#[derive(Debug, Clone)]
enum CleanupSource {
    Broker(BrokerError),
    Io(Arc<io::Error>),
}

impl CleanupError {
    fn from_parts(
        kind: CleanupErrorKind,
        token: Option<SlotToken>,
        detail: Option<String>,
        source: Option<CleanupSource>,
    ) -> Self {
        Self {
            inner: Box::new(CleanupInner {
                kind,
                token,
                detail,
                source,
            }),
        }
    }

    pub(crate) fn timeout(token: SlotToken, after: Duration) -> Self {
        Self::from_parts(
            CleanupErrorKind::Timeout,
            Some(token),
            Some(format!("release of {token} took longer than {after:?}")),
            None,
        )
    }

    pub(crate) fn broker(token: SlotToken, err: BrokerError) -> Self {
        Self::from_parts(
            CleanupErrorKind::Failed,
            Some(token),
            None,
            Some(CleanupSource::Broker(err)),
        )
    }

    pub(crate) fn unconfirmed(token: SlotToken, detail: String, io: Option<io::Error>) -> Self {
        Self::from_parts(
            CleanupErrorKind::Unconfirmed,
            Some(token),
            Some(detail),
            io.map(|e| CleanupSource::Io(Arc::new(e))),
        )
    }

    /// The I/O error behind it (an unremovable temp dir).
    pub(crate) fn with_io(mut self, io: io::Error) -> Self {
        self.inner.source = Some(CleanupSource::Io(Arc::new(io)));
        self
    }

    pub(crate) fn with_kind(kind: CleanupErrorKind, token: SlotToken, detail: String) -> Self {
        Self::from_parts(kind, Some(token), Some(detail), None)
    }

    pub(crate) fn stopped(token: Option<SlotToken>) -> Self {
        Self::from_parts(CleanupErrorKind::SupervisorStopped, token, None, None)
    }

    /// What went wrong.
    pub fn kind(&self) -> CleanupErrorKind {
        self.inner.kind
    }

    /// `LEASE_CLEANUP_TIMEOUT`, `LEASE_CLEANUP_FAILED`, `LEASE_CLEANUP_UNCONFIRMED`,
    /// `LEASE_GPU_DEVICE_LOST` or `SUPERVISOR_STOPPED`.
    pub fn code(&self) -> &'static str {
        match self.inner.kind {
            CleanupErrorKind::Timeout => codes::LEASE_CLEANUP_TIMEOUT,
            CleanupErrorKind::Failed => codes::LEASE_CLEANUP_FAILED,
            CleanupErrorKind::Unconfirmed => codes::LEASE_CLEANUP_UNCONFIRMED,
            CleanupErrorKind::SupervisorStopped => codes::SUPERVISOR_STOPPED,
            CleanupErrorKind::GpuDeviceLost => codes::LEASE_GPU_DEVICE_LOST,
        }
    }

    /// The token whose release failed, when known.
    pub fn token(&self) -> Option<SlotToken> {
        self.inner.token
    }

    /// The broker's error, when the broker release failed.
    pub fn broker_error(&self) -> Option<&BrokerError> {
        match &self.inner.source {
            Some(CleanupSource::Broker(e)) => Some(e),
            _ => None,
        }
    }
}

impl fmt::Display for CleanupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.inner.kind {
            CleanupErrorKind::Timeout => "slot release timed out",
            CleanupErrorKind::Failed => "slot release failed",
            CleanupErrorKind::Unconfirmed => "cleanup unconfirmed, slot quarantined",
            CleanupErrorKind::SupervisorStopped => "supervisor stopped before the release finished",
            CleanupErrorKind::GpuDeviceLost => {
                "gpu device lost, slot quarantined until it is replaced"
            }
        };
        f.write_str(what)?;
        if let Some(detail) = &self.inner.detail {
            write!(f, ": {detail}")?;
        } else if let Some(token) = self.inner.token {
            write!(f, " ({token})")?;
        }
        Ok(())
    }
}

impl std::error::Error for CleanupError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.inner.source {
            Some(CleanupSource::Broker(e)) => Some(e),
            Some(CleanupSource::Io(e)) => Some(&**e),
            None => None,
        }
    }
}

/// How a job's own work failed (body, sibling tasks, cancellation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum BodyErrorKind {
    /// The body returned `Err(E)`.
    Failed,
    /// The body, or a task it spawned through its context, panicked.
    Panicked,
    /// The job was cancelled; wins over an ordinary failure or a panic.
    Cancelled,
    /// An external effect may or may not have happened; wins over everything.
    DeliveryUnknown,
    /// The lease could not be kept alive (a distributed broker's TTL may lapse, or has), so
    /// the job was cancelled at once. Wins over everything but delivery-unknown, and over a
    /// value the body returned anyway: work done after the loss may have overlapped the next
    /// holder's.
    LeaseLost,
}

/// The failure of a job's own work, decided only after the body and every task it spawned
/// through its context have ended. Keeps every part: the winning kind (delivery-unknown >
/// cancellation > panic or error) and whatever lost to it.
#[derive(Debug)]
pub struct BodyError<E> {
    kind: BodyErrorKind,
    error: Option<E>,
    panics: Vec<String>,
    delivery_unknown: Option<String>,
    lease_lost: Option<String>,
}

/// How a body ended, every part of it, before [`BodyError::decide`] picks the failure that
/// wins.
pub(crate) struct BodyEnd<E> {
    /// The body returned its value.
    pub(crate) produced_value: bool,
    /// The body's own error, if it returned one.
    pub(crate) error: Option<E>,
    /// What panicked: the body, or a task or blocking closure it spawned through its context.
    pub(crate) panics: Vec<String>,
    /// Why a delivery the job made may or may not have happened.
    pub(crate) delivery_unknown: Option<String>,
    /// Why the lease was lost while the body ran.
    pub(crate) lease_lost: Option<String>,
    /// The job's cancel was requested.
    pub(crate) cancel_requested: bool,
}

impl<E> BodyError<E> {
    /// Applies the priority ladder to how a body ended: delivery-unknown > lease lost >
    /// cancellation > panic > ordinary error.
    /// Returns `None` when the body produced its value and nothing failed (a cancellation
    /// request the body completed its work despite is not a failure). A body with no value, no
    /// error and no panic was dropped after the cancel grace: cancelled.
    pub(crate) fn decide(end: BodyEnd<E>) -> Option<Self> {
        let BodyEnd {
            produced_value,
            error,
            panics,
            delivery_unknown,
            lease_lost,
            cancel_requested,
        } = end;
        let kind = if delivery_unknown.is_some() {
            BodyErrorKind::DeliveryUnknown
        } else if lease_lost.is_some() {
            BodyErrorKind::LeaseLost
        } else if produced_value && panics.is_empty() {
            return None;
        } else if cancel_requested {
            BodyErrorKind::Cancelled
        } else if !panics.is_empty() {
            BodyErrorKind::Panicked
        } else if error.is_some() {
            BodyErrorKind::Failed
        } else {
            BodyErrorKind::Cancelled
        };
        Some(Self {
            kind,
            error,
            panics,
            delivery_unknown,
            lease_lost,
        })
    }

    /// Which failure won.
    pub fn kind(&self) -> BodyErrorKind {
        self.kind
    }

    /// `LEASE_BODY_FAILED`, `LEASE_BODY_PANICKED`, `LEASE_BODY_CANCELLED` or
    /// `LEASE_DELIVERY_UNKNOWN`.
    pub fn code(&self) -> &'static str {
        match self.kind {
            BodyErrorKind::Failed => codes::LEASE_BODY_FAILED,
            BodyErrorKind::Panicked => codes::LEASE_BODY_PANICKED,
            BodyErrorKind::Cancelled => codes::LEASE_BODY_CANCELLED,
            BodyErrorKind::DeliveryUnknown => codes::LEASE_DELIVERY_UNKNOWN,
            BodyErrorKind::LeaseLost => codes::LEASE_LOST,
        }
    }

    /// Why the lease was lost, when [`kind`](Self::kind) is [`BodyErrorKind::LeaseLost`].
    pub fn lease_lost(&self) -> Option<&str> {
        self.lease_lost.as_deref()
    }

    /// The body's own error, if it returned one (also when a higher-priority failure won).
    pub fn error(&self) -> Option<&E> {
        self.error.as_ref()
    }

    /// Takes the body's own error out.
    pub fn into_error(self) -> Option<E> {
        self.error
    }

    /// Panic messages of the body and of tasks it spawned through its context, in the order
    /// they happened.
    pub fn panics(&self) -> &[String] {
        &self.panics
    }

    /// The reason given to
    /// [`WorkerContext::mark_delivery_unknown`](crate::WorkerContext::mark_delivery_unknown), if any.
    pub fn delivery_unknown(&self) -> Option<&str> {
        self.delivery_unknown.as_deref()
    }
}

impl<E> fmt::Display for BodyError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            BodyErrorKind::Failed => f.write_str("job body failed"),
            BodyErrorKind::Panicked => {
                write!(f, "job panicked: {}", self.panics.first().map_or("", |s| s))
            }
            BodyErrorKind::Cancelled => f.write_str("job cancelled"),
            BodyErrorKind::LeaseLost => write!(
                f,
                "lease lost, job cancelled: {}",
                self.lease_lost.as_deref().unwrap_or("")
            ),
            BodyErrorKind::DeliveryUnknown => write!(
                f,
                "delivery unknown: {}",
                self.delivery_unknown.as_deref().unwrap_or("")
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for BodyError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error
            .as_ref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// Why [`Supervisor::run`](crate::Supervisor::run) did not return the body's value. Keeps
/// everything; [`code`](Self::code) says which part failed.
#[derive(Debug)]
#[non_exhaustive]
pub enum JobError<E> {
    /// The job spec was refused at the boundary (`JOB_INVALID`).
    Invalid(InvalidJob),
    /// No slot was acquired; no body ran.
    Acquire(AcquireError),
    /// A slot was granted, but the job could not be prepared to run (`LEASE_PREPARE_FAILED`);
    /// no body ran, and the slot went back through the release pipeline, whose own failure,
    /// if any, is kept too.
    Unprepared {
        /// What could not be prepared.
        why: PrepareError,
        /// The release's failure, if it failed too.
        cleanup: Option<CleanupError>,
    },
    /// The job's own work failed; cleanup succeeded.
    Body(BodyError<E>),
    /// The job's own work succeeded; cleanup did not.
    Cleanup(CleanupError),
    /// Both failed (`LEASE_BODY_AND_CLEANUP_FAILED`).
    BodyAndCleanup {
        /// The job's own failure.
        body: BodyError<E>,
        /// The cleanup failure.
        cleanup: CleanupError,
    },
}

impl<E> JobError<E> {
    /// The stable code of the contract table.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Invalid(e) => e.code(),
            Self::Acquire(e) => e.code(),
            Self::Unprepared { why, .. } => why.code(),
            Self::Body(e) => e.code(),
            Self::Cleanup(e) => e.code(),
            Self::BodyAndCleanup { .. } => codes::LEASE_BODY_AND_CLEANUP_FAILED,
        }
    }

    /// The job's own failure, if any.
    pub fn body_error(&self) -> Option<&BodyError<E>> {
        match self {
            Self::Body(b) | Self::BodyAndCleanup { body: b, .. } => Some(b),
            _ => None,
        }
    }

    /// The cleanup failure, if any.
    pub fn cleanup_error(&self) -> Option<&CleanupError> {
        match self {
            Self::Cleanup(c)
            | Self::BodyAndCleanup { cleanup: c, .. }
            | Self::Unprepared {
                cleanup: Some(c), ..
            } => Some(c),
            _ => None,
        }
    }

    /// The acquire failure, if the job never got a slot.
    pub fn acquire_error(&self) -> Option<&AcquireError> {
        match self {
            Self::Acquire(a) => Some(a),
            _ => None,
        }
    }

    /// What could not be prepared, if the job got a slot but no body ran.
    pub fn prepare_error(&self) -> Option<&PrepareError> {
        match self {
            Self::Unprepared { why, .. } => Some(why),
            _ => None,
        }
    }
}

impl<E> fmt::Display for JobError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Invalid(_) => f.write_str("job refused"),
            Self::Acquire(_) => f.write_str("job got no slot"),
            Self::Unprepared { cleanup: None, .. } => f.write_str("job could not be prepared"),
            // Two causes: `source()` can return one, so both are named here.
            Self::Unprepared {
                why,
                cleanup: Some(cleanup),
            } => write!(
                f,
                "job could not be prepared ({why}) and its cleanup failed ({cleanup})"
            ),
            Self::Body(_) => f.write_str("job failed"),
            Self::Cleanup(_) => f.write_str("job succeeded but its cleanup failed"),
            // Two causes: `source()` can return one, so both are named here.
            Self::BodyAndCleanup { body, cleanup } => {
                write!(f, "job failed ({body}) and its cleanup failed ({cleanup})")
            }
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for JobError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Invalid(e) => Some(e),
            Self::Acquire(e) => Some(e),
            Self::Unprepared { why, cleanup: None } => Some(why),
            Self::Body(e) => Some(e),
            Self::Cleanup(e) => Some(e),
            Self::BodyAndCleanup { .. } | Self::Unprepared { .. } => None,
        }
    }
}

/// Why [`SupervisorBuilder::start`](crate::SupervisorBuilder::start) failed.
/// Code: `SUPERVISOR_START_FAILED`.
#[derive(Debug)]
#[non_exhaustive]
pub enum StartError {
    /// Neither `.slots(n)` nor `.broker(b)` was given.
    NoBroker,
    /// The pool has no slot (`.slots(0)`, or a broker reporting capacity 0).
    ZeroCapacity,
    /// A duration that must be positive was zero.
    ZeroDuration(&'static str),
    /// The work root cannot be created or used.
    WorkRoot {
        /// The path that failed.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The supervisor actor could not be spawned (no tokio runtime, or ractor refused).
    Spawn(String),
    /// The broker's [`attach`](crate::SlotBroker::attach) panicked (the panic's message): the
    /// supervisor it was attached to has been stopped, and the broker is dropped with it.
    BrokerAttach(String),
    /// The GPU devices could not be opened.
    #[cfg(feature = "gpu")]
    Gpu(crate::gpu::GpuError),
}

impl StartError {
    /// Always `SUPERVISOR_START_FAILED`.
    pub fn code(&self) -> &'static str {
        codes::SUPERVISOR_START_FAILED
    }
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoBroker => f.write_str("no slots configured: call .slots(n) or .broker(b)"),
            Self::ZeroCapacity => f.write_str("the slot pool has no slot"),
            Self::ZeroDuration(what) => write!(f, "{what} must be positive"),
            Self::WorkRoot { path, .. } => write!(f, "unusable work root {}", path.display()),
            Self::Spawn(msg) => write!(f, "could not spawn the supervisor actor: {msg}"),
            Self::BrokerAttach(msg) => write!(f, "the broker's attach panicked: {msg}"),
            #[cfg(feature = "gpu")]
            Self::Gpu(_) => f.write_str("could not open the gpu devices"),
        }
    }
}

impl std::error::Error for StartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::WorkRoot { source, .. } => Some(source),
            #[cfg(feature = "gpu")]
            Self::Gpu(e) => Some(e),
            _ => None,
        }
    }
}

/// [`Supervisor::shutdown`](crate::Supervisor::shutdown) could not reach the supervisor (its
/// runtime is gone, or it died). Code: `SUPERVISOR_STOPPED`.
#[derive(Debug, Clone)]
pub struct ShutdownError {
    _priv: (),
}

impl ShutdownError {
    pub(crate) fn new() -> Self {
        Self { _priv: () }
    }

    /// Always `SUPERVISOR_STOPPED`.
    pub fn code(&self) -> &'static str {
        codes::SUPERVISOR_STOPPED
    }
}

impl fmt::Display for ShutdownError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("supervisor unreachable: it died or its runtime is gone")
    }
}

impl std::error::Error for ShutdownError {}

/// A control call ([`cancel`](crate::Supervisor::cancel),
/// [`quarantined`](crate::Supervisor::quarantined),
/// [`reclaim_quarantined`](crate::Supervisor::reclaim_quarantined),
/// [`lease_desk`](crate::Supervisor::lease_desk)) found the supervisor stopped: it has shut
/// down, or its runtime is gone. Code: `SUPERVISOR_STOPPED`.
#[derive(Debug, Clone)]
pub struct SupervisorStopped {
    _priv: (),
}

impl SupervisorStopped {
    pub(crate) fn new() -> Self {
        Self { _priv: () }
    }

    /// Always `SUPERVISOR_STOPPED`.
    pub fn code(&self) -> &'static str {
        codes::SUPERVISOR_STOPPED
    }
}

impl fmt::Display for SupervisorStopped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("supervisor stopped")
    }
}

impl std::error::Error for SupervisorStopped {}

/// Why [`Supervisor::resize`](crate::Supervisor::resize) changed nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResizeError {
    /// A capacity of 0 slots (code `LEASE_SLOT_COUNT_INVALID`).
    Zero,
    /// The supervisor's slots come from a broker other than its in-process pool (code
    /// `LEASE_BROKER_UNSUPPORTED`).
    Unsupported,
    /// The supervisor has shut down or is unreachable (code `SUPERVISOR_STOPPED`).
    Stopped,
}

impl ResizeError {
    /// `LEASE_SLOT_COUNT_INVALID`, `LEASE_BROKER_UNSUPPORTED` or `SUPERVISOR_STOPPED`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Zero => codes::LEASE_SLOT_COUNT_INVALID,
            Self::Unsupported => codes::LEASE_BROKER_UNSUPPORTED,
            Self::Stopped => codes::SUPERVISOR_STOPPED,
        }
    }
}

impl fmt::Display for ResizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Zero => f.write_str("a pool needs at least one slot"),
            Self::Unsupported => {
                f.write_str("only the supervisor's in-process pool can be resized")
            }
            Self::Stopped => f.write_str("supervisor stopped"),
        }
    }
}

impl std::error::Error for ResizeError {}

/// Use-after-release: the lease's release has begun, its token may belong to someone else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReleased {
    _priv: (),
}

impl LeaseReleased {
    pub(crate) fn new() -> Self {
        Self { _priv: () }
    }

    /// Always `LEASE_RELEASED`.
    pub fn code(&self) -> &'static str {
        "LEASE_RELEASED"
    }
}

impl fmt::Display for LeaseReleased {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("lease already released")
    }
}

impl std::error::Error for LeaseReleased {}

// Every error of the crate is `Send + Sync + 'static`.
const _: fn() = || {
    fn assert<T: std::error::Error + Send + Sync + 'static>() {}
    assert::<InvalidJob>();
    assert::<AcquireError>();
    assert::<CleanupError>();
    assert::<BrokerError>();
    assert::<StartError>();
    assert::<ShutdownError>();
    assert::<SupervisorStopped>();
    assert::<PrepareError>();
    assert::<LeaseReleased>();
    assert::<BodyError<io::Error>>();
    assert::<JobError<io::Error>>();
};
