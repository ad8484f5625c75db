//! What a job body gets: its slot, its temp dir, its cancellation, and tracked spawning.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use futures_util::FutureExt;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, Span};

use super::{JobReports, JobShared};
use crate::broker::SlotToken;
use crate::error::PrepareError;
use crate::hosts::TempDirHost;
use crate::paths::PathRefused;
use crate::process::{JobProcess, ProcessError, ProcessHost, ProcessPolicy, ProcessSpec};

/// The job body's view of its lease. Cheap to clone; clones may be moved into sibling tasks.
///
/// Everything spawned through [`spawn`](Self::spawn) and [`spawn_blocking`](Self::spawn_blocking)
/// is part of the worker's physical lifetime: the temp dir is removed and the slot returned only
/// after every such task and closure has returned, even when the job was cancelled and its body
/// has already ended. Work started any other way (`tokio::spawn`, `std::thread::spawn`) is not
/// tracked and must not touch the slot or the temp dir.
#[derive(Clone)]
pub struct WorkerContext {
    inner: Arc<Inner>,
}

struct Inner {
    token: SlotToken,
    /// The other tokens of a multi-slot job.
    more_tokens: Box<[SlotToken]>,
    job_id: Arc<str>,
    /// Where the temp dir is made, on first use.
    work_root: Arc<PathBuf>,
    temp_dirs: Arc<dyn TempDirHost>,
    /// The temp dir once asked for: its path, and why it could not be made.
    temp_dir: OnceLock<(PathBuf, Option<PrepareError>)>,
    shared: Arc<JobShared>,
    tracker: TaskTracker,
    span: Span,
    process_policy: ProcessPolicy,
    processes: Arc<dyn ProcessHost>,
    reporter: Arc<dyn JobReports>,
    /// The job's worker actor (a job actor's watch is linked under it).
    worker: ractor::ActorCell,
    #[cfg(feature = "gpu")]
    gpu: std::sync::OnceLock<crate::gpu::JobGpu>,
}

/// What a worker gives its job's context.
pub(crate) struct ContextParts {
    /// The job's first token.
    pub(crate) token: SlotToken,
    /// The other tokens of a multi-slot job.
    pub(crate) more_tokens: Box<[SlotToken]>,
    pub(crate) job_id: Arc<str>,
    /// Where the temp dir is made, on first use.
    pub(crate) work_root: Arc<PathBuf>,
    pub(crate) temp_dirs: Arc<dyn TempDirHost>,
    pub(crate) shared: Arc<JobShared>,
    /// Everything the body spawns through its context.
    pub(crate) tracker: TaskTracker,
    pub(crate) span: Span,
    pub(crate) process_policy: ProcessPolicy,
    pub(crate) processes: Arc<dyn ProcessHost>,
    pub(crate) reporter: Arc<dyn JobReports>,
    /// The job's worker actor.
    pub(crate) worker: ractor::ActorCell,
}

impl WorkerContext {
    pub(crate) fn new(parts: ContextParts) -> Self {
        let ContextParts {
            token,
            more_tokens,
            job_id,
            work_root,
            temp_dirs,
            shared,
            tracker,
            span,
            process_policy,
            processes,
            reporter,
            worker,
        } = parts;
        Self {
            inner: Arc::new(Inner {
                token,
                more_tokens,
                job_id,
                work_root,
                temp_dirs,
                temp_dir: OnceLock::new(),
                shared,
                tracker,
                span,
                process_policy,
                processes,
                reporter,
                worker,
                #[cfg(feature = "gpu")]
                gpu: std::sync::OnceLock::new(),
            }),
        }
    }

    /// How the job's machinery reports to the supervisor.
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    pub(crate) fn reporter(&self) -> &dyn JobReports {
        &*self.inner.reporter
    }

    /// Every token this job holds, the first one (its [`token`](Self::token)) first: more than
    /// one for a job given [`JobSpec::with_slots`](crate::JobSpec::with_slots).
    pub fn tokens(&self) -> Vec<SlotToken> {
        std::iter::once(self.inner.token)
            .chain(self.inner.more_tokens.iter().copied())
            .collect()
    }

    /// The slot this job holds (the first one, for a multi-slot job).
    pub fn slot_id(&self) -> u32 {
        self.inner.token.slot_id()
    }

    /// The lease id of this job's token (a fencing token for the brokers leasehold ships).
    pub fn lease_id(&self) -> u64 {
        self.inner.token.lease_id()
    }

    /// The whole token.
    pub fn token(&self) -> SlotToken {
        self.inner.token
    }

    /// The job's record (for a job actor's host).
    pub(crate) fn shared(&self) -> &Arc<JobShared> {
        &self.inner.shared
    }

    /// The job's worker actor (for a job actor's host).
    pub(crate) fn worker(&self) -> &ractor::ActorCell {
        &self.inner.worker
    }

    /// The job id given to [`JobSpec::new`](crate::JobSpec::new).
    pub fn job_id(&self) -> &str {
        &self.inner.job_id
    }

    /// The job's own temp dir, strictly inside the work root, made on the first call (by this
    /// context or any clone of it). It then exists while the worker lives and is removed only
    /// after the worker and all its tracked tasks have physically ended. A job that never
    /// asks for it (nor calls [`path`](Self::path) or [`spawn_process`](Self::spawn_process),
    /// which use it) costs no directory at all, and nothing is removed after it.
    ///
    /// When the directory cannot be made (the work root is full, or unwritable), the failure
    /// is logged and this returns a path under the work root that does not exist, so that the
    /// body's first file operation in it fails with the file system's own error; the cause,
    /// as a [`PrepareError::TempDir`] (`LEASE_PREPARE_FAILED`), is what
    /// [`try_temp_dir`](Self::try_temp_dir) returns. Whatever the body makes at that path is
    /// still removed with the job. A context kept past its job's end makes nothing.
    pub fn temp_dir(&self) -> &Path {
        &self.made_temp_dir().0
    }

    /// [`temp_dir`](Self::temp_dir), or why it could not be made.
    ///
    /// # Errors
    ///
    /// [`PrepareError::TempDir`] (code `LEASE_PREPARE_FAILED`) with the file system's error,
    /// the same on every call: the directory is made once or not at all. Also when the job's
    /// lease has ended before the first call (a context kept past its job).
    pub fn try_temp_dir(&self) -> Result<&Path, PrepareError> {
        match self.made_temp_dir() {
            (path, None) => Ok(path),
            (_, Some(err)) => Err(err.clone()),
        }
    }

    /// Makes the temp dir on the first call, in the caller's task (never in the supervisor's
    /// mailbox), and keeps the answer.
    fn made_temp_dir(&self) -> &(PathBuf, Option<PrepareError>) {
        let inner = &*self.inner;
        inner.temp_dir.get_or_init(|| {
            match inner
                .shared
                .make_temp_dir(&*inner.temp_dirs, &inner.work_root, &inner.job_id)
            {
                Ok(path) => (path, None),
                Err((path, err)) => {
                    let cause = match &err {
                        PrepareError::TempDir(io) => io.to_string(),
                        other => other.to_string(),
                    };
                    tracing::error!(path = %path.display(), error = %cause, "could not create the job's temp dir");
                    (path, Some(err))
                }
            }
        })
    }

    /// The GPU of this lease (feature `gpu`): the device its slot belongs to, its queue, adapter
    /// and the slot's scratch buffers. `None` when the supervisor owns no GPU.
    #[cfg(feature = "gpu")]
    pub fn gpu(&self) -> Option<&crate::gpu::JobGpu> {
        self.inner.gpu.get()
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn set_gpu(&self, gpu: crate::gpu::JobGpu) {
        let _ = self.inner.gpu.set(gpu);
    }

    /// Resolves `relative` inside the job's temp dir.
    ///
    /// # Errors
    ///
    /// [`PathRefused`] (code `JOB_PATH_REFUSED`) for an absolute path, a `..` component, or a
    /// symlink that leads out of the temp dir.
    pub fn path(&self, relative: impl AsRef<Path>) -> Result<PathBuf, PathRefused> {
        crate::paths::confine(self.temp_dir(), relative.as_ref())
    }

    /// Starts a child process as the leader of its own process group, in the job's temp dir,
    /// with every path of `spec` confined to it. The process is part of the worker's physical
    /// lifetime: the temp dir is removed and the slot returned only after the child has been
    /// reaped and its whole group proven empty, descendants that left the group included. On
    /// cancellation (or shutdown) the group gets `SIGTERM`, then `SIGKILL` after the process
    /// grace; if its absence cannot be proven, the slot is quarantined.
    ///
    /// # Errors
    ///
    /// [`ProcessError`]: `JOB_PATH_REFUSED` (nothing ran) or `PROCESS_SPAWN_FAILED` (also when
    /// the job's lease has already ended: a context kept past its job starts nothing).
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn_process(&self, spec: ProcessSpec) -> Result<JobProcess, ProcessError> {
        let inner = &*self.inner;
        // Counted as a tracked task until the keeper is: the lease cannot close meanwhile.
        let Some(_admitted) = inner.shared.admit(&inner.tracker) else {
            return Err(ProcessError::Spawn(std::io::Error::other(
                "the job's lease has ended: nothing more may start under it",
            )));
        };
        let dir = self
            .try_temp_dir()
            .map_err(|err| ProcessError::Spawn(std::io::Error::other(err)))?;
        let (process, keeper) =
            inner
                .processes
                .spawn(spec, dir, &inner.shared.cancel, inner.process_policy)?;
        // Reported before the keeper runs, and the keeper is a tracked task: the supervisor
        // hears of the group before it hears that the job's tasks have all ended.
        let id = inner.reporter.process_started(process.pid());
        let reporter = Arc::clone(&inner.reporter);
        crate::counters::task();
        inner.tracker.spawn(
            async move {
                let unproven = keeper.await;
                if let Some(evidence) = &unproven {
                    tracing::error!(reason = %evidence.reason(), "a job's processes could not be proven gone");
                }
                reporter.process_ended(id, unproven);
            }
            .instrument(inner.span.clone()),
        );
        Ok(process)
    }

    /// The span every part of this job runs in (`job_id`, `slot_id`, `lease_id`).
    pub fn span(&self) -> &Span {
        &self.inner.span
    }

    /// Whether cancellation has been requested (by the caller's token, by dropping the `run`
    /// future, or by shutdown).
    pub fn is_cancelled(&self) -> bool {
        self.inner.shared.cancel.is_cancelled()
    }

    /// Resolves when cancellation is requested. After the supervisor's cancel grace period the
    /// body future is dropped; tracked tasks and blocking closures are still awaited.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping this future has no effect, and it can be created again.
    pub async fn cancelled(&self) {
        self.inner.shared.cancel.cancelled().await
    }

    /// A clone of the job's cancellation token, for code that takes one. Cancelling it cancels
    /// this job (and only this job).
    pub fn cancellation_token(&self) -> CancellationToken {
        self.inner.shared.cancel.clone()
    }

    /// Declares that an external effect of this job may or may not have happened (an upload
    /// whose acknowledgement was lost, say). The job then ends `LEASE_DELIVERY_UNKNOWN`, which
    /// wins over cancellation and every other failure, so that nobody retries it blindly. The
    /// first reason is kept. Sibling tasks may call it through their clone of the context.
    pub fn mark_delivery_unknown(&self, reason: impl Into<String>) {
        self.inner.shared.mark_delivery_unknown(reason.into());
    }

    /// Spawns a tracked sibling task in the job's span. The slot waits for it, even after
    /// cancellation; only a shutdown aborts it, once the cancel grace has passed. A panic in it
    /// is recorded for the job's result (`LEASE_BODY_PANICKED` unless something of higher
    /// priority happened) and still reaches the returned handle.
    ///
    /// A context kept past its job (every task of the job has ended, and its slot may serve
    /// another lease) starts nothing: `fut` is dropped unpolled, and the handle resolves to a
    /// cancelled [`JoinError`](tokio::task::JoinError) (a panic one if `fut`'s `Drop` panics).
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        // Counted as a tracked task until the task is: the lease cannot close meanwhile.
        let Some(_admitted) = self.inner.shared.admit(&self.inner.tracker) else {
            return refused(fut);
        };
        let shared = Arc::clone(&self.inner.shared);
        let fut = fut.instrument(self.inner.span.clone());
        let handle = self.inner.tracker.spawn(async move {
            match AssertUnwindSafe(fut).catch_unwind().await {
                Ok(v) => v,
                Err(payload) => {
                    shared.record_panic(&*payload);
                    std::panic::resume_unwind(payload)
                }
            }
        });
        // Shutdown aborts tracked tasks that outlive the cancel grace (blocking closures cannot
        // be aborted: they are waited for, within the shutdown bound).
        self.inner.shared.track_abort(handle.abort_handle());
        handle
    }

    /// Runs a blocking closure on tokio's blocking pool, tracked like [`spawn`](Self::spawn):
    /// the temp dir and the slot wait for it to return, whatever happened to the body. A
    /// context kept past its job runs nothing: `f` is dropped uncalled, and the handle resolves
    /// to a cancelled [`JoinError`](tokio::task::JoinError) (a panic one if `f`'s `Drop`
    /// panics).
    ///
    /// # Panics
    ///
    /// When called outside a tokio runtime.
    pub fn spawn_blocking<F, R>(&self, f: F) -> JoinHandle<R>
    where
        F: FnOnce() -> R + Send + 'static,
        R: Send + 'static,
    {
        let Some(_admitted) = self.inner.shared.admit(&self.inner.tracker) else {
            return refused(f);
        };
        let shared = Arc::clone(&self.inner.shared);
        let span = self.inner.span.clone();
        self.inner.tracker.spawn_blocking(move || {
            let _entered = span.enter();
            match std::panic::catch_unwind(AssertUnwindSafe(f)) {
                Ok(v) => v,
                Err(payload) => {
                    shared.record_panic(&*payload);
                    std::panic::resume_unwind(payload)
                }
            }
        })
    }
}

/// The handle of a start refused because the job's lease has ended: a task that drops `value`
/// (the caller's future or closure, never run) and is aborted at once, so that the handle
/// resolves to an error: cancelled (or a panic, if `value`'s own `Drop` panicked).
fn refused<V: Send + 'static, R: Send + 'static>(value: V) -> JoinHandle<R> {
    tracing::warn!("a worker context kept past its job was asked to start work: refused");
    crate::counters::task();
    let handle = tokio::spawn(async move {
        drop(value);
        std::future::pending::<R>().await
    });
    handle.abort();
    handle
}

impl fmt::Debug for WorkerContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerContext")
            .field("job_id", &self.inner.job_id)
            .field("token", &self.inner.token)
            .field("temp_dir", &self.inner.temp_dir.get().map(|(path, _)| path))
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}
