//! Non-blocking submission for code that cannot `.await`: a game or render loop submits a job
//! and polls its handle once a frame.

use std::fmt;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::error::{AcquireError, JobError};
use crate::sink::ErrorSink;

/// A job submitted with [`Supervisor::submit`](crate::Supervisor::submit). Poll it without
/// blocking; cancel it; or drop it, which cancels the job (as dropping a `run` future does).
/// Whatever happens, the job goes through the whole release pipeline on the supervisor's
/// runtime.
#[must_use = "dropping a JobHandle cancels its job"]
pub struct JobHandle<T, E> {
    job_id: String,
    cancel: CancellationToken,
    result: oneshot::Receiver<Result<T, JobError<E>>>,
    taken: bool,
    detached: bool,
    /// Where a cleanup failure goes when the handle is dropped with the result unread.
    sink: Option<ErrorSink>,
}

impl<T, E> JobHandle<T, E> {
    pub(crate) fn new(
        job_id: String,
        cancel: CancellationToken,
        result: oneshot::Receiver<Result<T, JobError<E>>>,
        sink: Option<ErrorSink>,
    ) -> Self {
        Self {
            job_id,
            cancel,
            result,
            taken: false,
            detached: false,
            sink,
        }
    }

    /// The job's id.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Whether the job's result is ready (the release pipeline has finished), or was taken.
    /// Never blocks.
    pub fn is_finished(&self) -> bool {
        self.taken || !self.result.is_empty() || self.result.is_terminated()
    }

    /// Takes the result if it is ready; `None` while the job is still queued, running or
    /// releasing, and after the result has been taken. Never blocks.
    ///
    /// A supervisor whose runtime is gone answers `SUPERVISOR_STOPPED`.
    pub fn try_take(&mut self) -> Option<Result<T, JobError<E>>> {
        if self.taken {
            return None;
        }
        match self.result.try_recv() {
            Ok(result) => {
                self.taken = true;
                Some(result)
            }
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => {
                self.taken = true;
                Some(Err(JobError::Acquire(AcquireError::Stopped)))
            }
        }
    }

    /// Requests cancellation (cooperative, as [`JobSpec::with_cancel`](crate::JobSpec::with_cancel)).
    /// The result still arrives, after the release pipeline. Never blocks.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Whether cancellation has been requested.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Lets the job run to its end even though the handle is dropped (its result is then
    /// discarded; a cleanup failure goes to the error sink).
    pub fn detach(mut self) {
        self.detached = true;
    }

    /// Waits for the result (for async code that holds a handle).
    ///
    /// # Cancel safety
    ///
    /// Dropping this future drops the handle, which cancels the job.
    pub async fn join(mut self) -> Result<T, JobError<E>> {
        if self.taken {
            return Err(JobError::Acquire(AcquireError::Stopped));
        }
        let result = (&mut self.result)
            .await
            .unwrap_or(Err(JobError::Acquire(AcquireError::Stopped)));
        self.taken = true;
        result
    }
}

impl<T, E> Drop for JobHandle<T, E> {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        if !self.detached {
            self.cancel.cancel();
        }
        // The job may have finished before the handle went away, its result unread: a cleanup
        // failure in it has nobody else to reach (invariant 7). Otherwise the receiver closes
        // here and the job's own task reports it when its result cannot be delivered: exactly
        // one of the two sees it.
        if let Ok(Err(err)) = self.result.try_recv()
            && let Some(cleanup) = err.cleanup_error()
        {
            crate::sink::report_orphaned(
                self.sink.as_ref(),
                Some(self.job_id.clone()),
                cleanup.clone(),
            );
        }
    }
}

impl<T, E> fmt::Debug for JobHandle<T, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobHandle")
            .field("job_id", &self.job_id)
            .field("finished", &self.is_finished())
            .field("cancelled", &self.is_cancelled())
            .finish()
    }
}
