//! What a job's body, its sibling tasks and its caller share.

use std::any::Any;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering, fence};

use parking_lot::Mutex;
use tokio::task::AbortHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::{TaskTracker, task_tracker::TaskTrackerToken};

use crate::error::PrepareError;
use crate::hosts::TempDirHost;
use crate::paths::TempDir;

/// Per-job record written by the worker and its tracked tasks, read by `run` only after the
/// whole release pipeline has finished (so after every writer has ended).
#[derive(Debug)]
pub(crate) struct JobShared {
    /// The job's own token: a child of the caller's token, cancelled also when the `run` future
    /// is dropped or the supervisor shuts down.
    pub(crate) cancel: CancellationToken,
    /// Allocated on the first write: most jobs never write any, and a queued job holds this
    /// record for as long as it waits.
    records: Mutex<Option<Box<Records>>>,
    /// `QUEUED`, `STARTED` (the body was called) or `CLOSED` (every tracked task has ended).
    stage: AtomicU8,
}

/// Numbers the paths handed out when a temp dir could not be made.
static UNMADE: AtomicU64 = AtomicU64::new(0);

const QUEUED: u8 = 0;
const STARTED: u8 = 1;
const CLOSED: u8 = 2;

/// What a job's body and tasks may record (see the accessors of [`JobShared`]).
#[derive(Debug, Default)]
struct Records {
    panics: Vec<String>,
    delivery_unknown: Option<String>,
    /// The broker could not keep the lease alive (why).
    lease_lost: Option<String>,
    /// Tracked async tasks, aborted at shutdown once the cancel grace has passed.
    tasks: Vec<AbortHandle>,
    /// The body applies the cancel-then-grace rule itself (a job actor's host, which stops
    /// then kills the actor): the worker must not drop it after the grace.
    stops_itself: bool,
    /// The job's temp dir, once the job asked for one (made, or the path handed out when making
    /// failed). Kept here, allocated with the records on first use, so that a job waiting for
    /// its slot pays nothing for it. None is made once the job is `CLOSED`.
    temp_dir: Option<TempDir>,
    /// The job's GPU, once checked out (read by the driver for the release fence).
    #[cfg(feature = "gpu")]
    gpu: Option<crate::gpu::JobGpu>,
}

impl JobShared {
    pub(crate) fn new(cancel: CancellationToken) -> Self {
        Self {
            cancel,
            records: Mutex::new(None),
            stage: AtomicU8::new(QUEUED),
        }
    }

    /// Writes a record, allocating the records on the first write.
    fn write<R>(&self, f: impl FnOnce(&mut Records) -> R) -> R {
        f(self.records.lock().get_or_insert_with(Box::default))
    }

    /// Reads (or takes) a record; `R::default()` when nothing was ever written.
    fn read<R: Default>(&self, f: impl FnOnce(&mut Records) -> R) -> R {
        self.records
            .lock()
            .as_deref_mut()
            .map(f)
            .unwrap_or_default()
    }

    /// Records a panic the job's own code will still see (its payload is re-raised to it).
    pub(crate) fn record_panic(&self, payload: &(dyn Any + Send)) {
        let msg = crate::outside::panic_message(payload);
        self.write(|r| r.panics.push(msg));
    }

    /// Records a panic nobody else will see, and disposes of its payload (whose drop may panic
    /// too: see `outside::dispose`).
    pub(crate) fn record_caught(&self, payload: Box<dyn Any + Send>) {
        let msg = crate::outside::message_of(payload);
        self.write(|r| r.panics.push(msg));
    }

    pub(crate) fn mark_delivery_unknown(&self, reason: String) {
        // The first reason is kept: it is the effect that was first in doubt.
        self.write(|r| {
            r.delivery_unknown.get_or_insert(reason);
        });
    }

    /// Records that the lease was lost; the first reason is kept.
    pub(crate) fn mark_lease_lost(&self, reason: String) {
        self.write(|r| {
            r.lease_lost.get_or_insert(reason);
        });
    }

    /// The body stops its own work on cancellation, within the grace (a job actor's host).
    pub(crate) fn set_stops_itself(&self) {
        self.write(|r| r.stops_itself = true);
    }

    pub(crate) fn stops_itself(&self) -> bool {
        self.read(|r| r.stops_itself)
    }

    pub(crate) fn take_lease_lost(&self) -> Option<String> {
        self.read(|r| r.lease_lost.take())
    }

    /// Makes the job's temp dir under `root` (the context calls it once, on first use, and
    /// keeps the answer). Refused once the job is closed (its driver has seen every tracked
    /// task end). When making fails, the path handed out instead (which does not exist) is
    /// recorded all the same, so that whatever the body might make there is removed with the
    /// job.
    pub(crate) fn make_temp_dir(
        &self,
        host: &dyn TempDirHost,
        root: &Path,
        job_id: &str,
    ) -> Result<PathBuf, (PathBuf, PrepareError)> {
        // Under the records' lock, which the driver takes after closing the job to read what
        // to remove: a dir made here is either seen by the driver, or never made.
        let mut records = self.records.lock();
        let unmade = || {
            let n = UNMADE.fetch_add(1, Ordering::Relaxed);
            root.join(format!("{job_id}.unmade-{n}"))
        };
        if self.is_closed() {
            let asked = records.as_deref().and_then(|r| r.temp_dir.as_ref());
            let path = asked.map_or_else(unmade, |dir| dir.path.to_path_buf());
            let err = io::Error::other("the job's lease has ended: no temp dir is made for it");
            return Err((path, PrepareError::TempDir(Arc::new(err))));
        }
        let (path, result) = match host.create(root, job_id) {
            Ok(path) => (path, None),
            Err(err) => (unmade(), Some(PrepareError::TempDir(Arc::new(err)))),
        };
        let records = records.get_or_insert_with(Box::default);
        records.temp_dir = Some(TempDir {
            path: path.clone().into_boxed_path(),
            made: result.is_none(),
        });
        match result {
            None => Ok(path),
            Some(err) => Err((path, err)),
        }
    }

    /// The job's temp dir, if it asked for one (what its driver reports once the job is
    /// closed: nothing more is made after that).
    pub(crate) fn temp_dir(&self) -> Option<TempDir> {
        self.read(|r| r.temp_dir.clone())
    }

    /// Records a tracked task, to abort at shutdown. Handles of finished tasks are dropped now
    /// and then, so a job that spawns many short tasks keeps few.
    pub(crate) fn track_abort(&self, handle: AbortHandle) {
        self.write(|r| {
            if r.tasks.len() >= 32 && r.tasks.len().is_power_of_two() {
                r.tasks.retain(|t| !t.is_finished());
            }
            r.tasks.push(handle);
        });
    }

    /// Aborts every tracked async task still running (shutdown, after the cancel grace).
    pub(crate) fn abort_tasks(&self) -> usize {
        let tasks = self.read(|r| std::mem::take(&mut r.tasks));
        let running = tasks.iter().filter(|t| !t.is_finished()).count();
        for task in tasks {
            task.abort();
        }
        running
    }

    #[cfg(feature = "gpu")]
    pub(crate) fn set_gpu(&self, gpu: crate::gpu::JobGpu) {
        self.write(|r| r.gpu = Some(gpu));
    }

    /// Taken by the job's driver for the fence, which drops it there: wgpu handles are never
    /// dropped in the supervisor's mailbox.
    #[cfg(feature = "gpu")]
    pub(crate) fn take_gpu(&self) -> Option<crate::gpu::JobGpu> {
        self.read(|r| r.gpu.take())
    }

    pub(crate) fn take_panics(&self) -> Vec<String> {
        self.read(|r| std::mem::take(&mut r.panics))
    }

    pub(crate) fn take_delivery_unknown(&self) -> Option<String> {
        self.read(|r| r.delivery_unknown.take())
    }

    // Relaxed is enough for `started`: it is read after the worker has been joined (a
    // happens-before edge through the supervisor's messages), or, when the supervisor died,
    // only as a hint. The close is ordered against a start by the fences of `close_if_idle`
    // and `admit`.
    pub(crate) fn mark_started(&self) {
        self.stage.store(STARTED, Ordering::Relaxed);
    }

    pub(crate) fn started(&self) -> bool {
        self.stage.load(Ordering::Relaxed) != QUEUED
    }

    /// Closes the lease to new work once `tracker` (the job's tracked tasks) is empty, and says
    /// whether it still is after the close: `false` when a start through a context kept past
    /// the job got in first, which the caller waits for before it tries again.
    ///
    /// Paired with [`admit`](Self::admit): the close is stored before the tracker is read, and
    /// a start counts itself in the tracker before it reads the close, each with a `SeqCst`
    /// fence between. So of a close and a start that race, either the start sees the close
    /// (and starts nothing), or the close sees the start (and is waited out).
    pub(crate) fn close_if_idle(&self, tracker: &TaskTracker) -> bool {
        self.stage.store(CLOSED, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        tracker.is_empty()
    }

    /// Admits a start under the lease (a tracked task, a blocking closure, a process): a token
    /// that counts as a tracked task until the start is tracked itself, or `None` once the
    /// lease is closed to new work (see [`close_if_idle`](Self::close_if_idle)).
    pub(crate) fn admit(&self, tracker: &TaskTracker) -> Option<TaskTrackerToken> {
        let token = tracker.token();
        fence(Ordering::SeqCst);
        (!self.is_closed()).then_some(token)
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.stage.load(Ordering::Relaxed) == CLOSED
    }
}
