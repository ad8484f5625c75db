//! Non-blocking submission for code that cannot `.await`: a game or render loop submits a job
//! and polls its handle once a frame.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::core::Withdrawal;
use super::waiting::Submitted;
use crate::error::{AcquireError, JobError};
use crate::sink::Sink;

/// A job submitted with [`Supervisor::submit`](crate::Supervisor::submit). Poll it without
/// blocking; cancel it; or drop it, which cancels the job (as dropping a `run` future does).
/// Whatever happens, the job goes through the whole release pipeline on the supervisor's
/// runtime.
///
/// The job is in the supervisor's queue from the moment `submit` returns: jobs submitted one
/// after another are served in that order (within a priority class), and a
/// [`Supervisor::cancel`](crate::Supervisor::cancel) sent afterwards finds it. No task waits
/// for it: the handle itself holds the answer's channel. A cancellation through the job's own
/// token (from [`JobSpec::with_cancel`](crate::JobSpec::with_cancel)), or an acquire timeout
/// that has passed, is seen by the supervisor when it would grant the job (it is then refused,
/// and its slot goes on), and by the handle each time it is polled (which withdraws the job at
/// once).
#[must_use = "dropping a JobHandle cancels its job"]
pub struct JobHandle<T, E> {
    job_id: String,
    cancel: CancellationToken,
    state: Mutex<State<T, E>>,
    /// The job has been asked to leave the queue (cancelled or timed out while waiting).
    withdrawn: AtomicBool,
    detached: bool,
    /// Where a cleanup failure goes when the handle is dropped with the result unread.
    sink: Sink,
}

enum State<T, E> {
    /// Queued, running or releasing: the supervisor's answer has not been read yet.
    Waiting(Box<Submitted<T, E>>),
    /// The answer is in, not yet taken.
    Ready(Result<T, JobError<E>>),
    Taken,
}

impl<T, E> JobHandle<T, E> {
    pub(crate) fn submitted(
        job_id: String,
        cancel: CancellationToken,
        sink: Sink,
        job: Submitted<T, E>,
    ) -> Self {
        Self {
            job_id,
            cancel,
            state: Mutex::new(State::Waiting(Box::new(job))),
            withdrawn: AtomicBool::new(false),
            detached: false,
            sink,
        }
    }

    /// A handle whose job ended before it was queued (its token was already cancelled, or the
    /// supervisor had stopped).
    pub(crate) fn ended(
        job_id: String,
        cancel: CancellationToken,
        sink: Sink,
        result: Result<T, JobError<E>>,
    ) -> Self {
        Self {
            job_id,
            cancel,
            state: Mutex::new(State::Ready(result)),
            withdrawn: AtomicBool::new(true),
            detached: false,
            sink,
        }
    }

    /// The job's id.
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Whether the job's result is ready (the release pipeline has finished, or the supervisor
    /// is gone), or was taken. Never blocks. Once it says `true`,
    /// [`try_take`](Self::try_take) gives the result, unless it was taken already.
    pub fn is_finished(&self) -> bool {
        let mut state = self.state.lock();
        self.look(&mut state);
        !matches!(*state, State::Waiting(_))
    }

    /// Takes the result if it is ready; `None` while the job is still queued, running or
    /// releasing, and after the result has been taken. Never blocks.
    ///
    /// A supervisor whose runtime is gone answers `SUPERVISOR_STOPPED`.
    pub fn try_take(&mut self) -> Option<Result<T, JobError<E>>> {
        let mut state = self.state.lock();
        self.look(&mut state);
        match std::mem::replace(&mut *state, State::Taken) {
            State::Ready(result) => Some(result),
            other => {
                *state = other;
                None
            }
        }
    }

    /// Reads the answer into `state` if it has come; withdraws a job that should leave the
    /// queue (cancelled, or past its acquire timeout).
    fn look(&self, state: &mut State<T, E>) {
        let State::Waiting(job) = state else { return };
        match job.try_answer() {
            Some(outcome) => *state = State::Ready(job.conclude(outcome)),
            None => {
                if let Some(why) = job.leaving()
                    && !self.withdrawn.swap(true, Ordering::Relaxed)
                {
                    job.withdraw(why);
                }
            }
        }
    }

    /// Requests cancellation (cooperative, as [`JobSpec::with_cancel`](crate::JobSpec::with_cancel)):
    /// a job still queued leaves the queue at once; a running one sees its token cancelled.
    /// The result still arrives, after the release pipeline. Never blocks.
    pub fn cancel(&self) {
        self.cancel.cancel();
        let mut state = self.state.lock();
        self.look(&mut state);
    }

    /// Whether cancellation has been requested.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Lets the job run to its end even though the handle is dropped (its result is then
    /// discarded; a cleanup failure goes to the error sink). The supervisor stays up until the
    /// job has ended. A job still waiting for a slot leaves the queue at its acquire timeout,
    /// or when its token is cancelled, as an awaited one does.
    pub fn detach(mut self)
    where
        T: Send + 'static,
        E: Send + 'static,
    {
        self.detached = true;
        let state = self.state.get_mut();
        match std::mem::replace(state, State::Taken) {
            State::Waiting(job) => job.detach(self.job_id.clone()),
            // An answer already read: dropping the handle reports a cleanup failure in it.
            ready => *state = ready,
        }
    }

    /// Resolves once the job should leave the queue (cancelled, or past its acquire timeout),
    /// having asked the supervisor to take it out (ignored if it was granted meanwhile);
    /// never, once its answer is in. For a caller that awaits something other than the handle
    /// (`spawn_job` awaits its actor's start).
    pub(crate) async fn withdraw_when_due(&self) {
        let deadline = match &*self.state.lock() {
            State::Waiting(job) => job.deadline,
            _ => None,
        };
        let timeout = async {
            match deadline {
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = timeout => {}
            () = self.cancel.cancelled() => {}
        }
        let mut state = self.state.lock();
        self.look(&mut state);
    }

    /// Waits for the result (for async code that holds a handle).
    ///
    /// # Cancel safety
    ///
    /// Dropping this future drops the handle, which cancels the job.
    pub async fn join(mut self) -> Result<T, JobError<E>> {
        // The job stays in the handle while it is awaited: dropping this future drops the
        // handle with it, which cancels the job.
        let result = match self.state.get_mut() {
            State::Waiting(job) => {
                let outcome = job.wait().await;
                job.conclude(outcome)
            }
            State::Ready(_) => match std::mem::replace(self.state.get_mut(), State::Taken) {
                State::Ready(result) => return result,
                _ => unreachable!("matched Ready"),
            },
            State::Taken => return Err(JobError::Acquire(AcquireError::Stopped)),
        };
        *self.state.get_mut() = State::Taken;
        result
    }
}

impl<T, E> Drop for JobHandle<T, E> {
    fn drop(&mut self) {
        match std::mem::replace(self.state.get_mut(), State::Taken) {
            State::Taken | State::Ready(Ok(_)) => {}
            // Read and not taken: a cleanup failure in it has nobody else to reach
            // (invariant 7).
            State::Ready(Err(err)) => {
                if let Some(cleanup) = err.cleanup_error() {
                    self.sink.report(Some(self.job_id.clone()), cleanup.clone());
                }
            }
            State::Waiting(job) => {
                if !self.detached {
                    self.cancel.cancel();
                    if !self.withdrawn.swap(true, Ordering::Relaxed) {
                        job.withdraw(Withdrawal::Cancelled);
                    }
                }
                // An answer already in, unread, is reported here. Otherwise the supervisor
                // finds the channel closed when it answers, and reports a cleanup failure
                // itself: exactly one of the two sees it.
                job.orphan(&self.job_id);
            }
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
