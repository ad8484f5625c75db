//! A caller waiting for the actor's answer: [`await_reply`], which withdraws the waiter on a
//! cancellation or a timeout and keeps listening, and [`Submitted`], a job in the queue as its
//! caller holds it (`run` awaits it, a [`JobHandle`](super::JobHandle) polls it).

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::core::{WaiterId, Withdrawal};
use super::inbox::Inbox;
use super::messages::{RunOutcome, SupMsg};
use super::state::Inner;
use crate::error::{AcquireError, BodyEnd, BodyError, CleanupError, JobError};
use crate::worker::JobShared;

/// A job in the supervisor's queue (or running, or releasing), as its caller holds it: the
/// answer's channel, the body's result, and what is needed to read them (`run` awaits it; a
/// [`JobHandle`](super::JobHandle) polls it).
pub(crate) struct Submitted<T, E> {
    /// Keeps the supervisor up while the job's answer is awaited.
    pub(super) sup: Arc<Inner>,
    pub(super) waiter: WaiterId,
    pub(super) answer: oneshot::Receiver<RunOutcome>,
    pub(super) shared: Arc<JobShared>,
    pub(super) body: oneshot::Receiver<Result<T, E>>,
    pub(super) cancel: CancellationToken,
    /// When the job stops waiting for a slot (the acquire timeout).
    pub(super) deadline: Option<tokio::time::Instant>,
}

impl<T, E> Submitted<T, E> {
    /// The answer, if it has come (`Some(Err(()))`: the supervisor is gone).
    pub(crate) fn try_answer(&mut self) -> Option<Result<RunOutcome, ()>> {
        match self.answer.try_recv() {
            Ok(outcome) => Some(Ok(outcome)),
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(())),
            Err(oneshot::error::TryRecvError::Empty) => None,
        }
    }

    /// Why the job should leave the queue now, if it should: cancelled, or past its acquire
    /// timeout.
    pub(crate) fn leaving(&self) -> Option<Withdrawal> {
        if self.cancel.is_cancelled() {
            return Some(Withdrawal::Cancelled);
        }
        let deadline = self.deadline?;
        (tokio::time::Instant::now() >= deadline)
            .then(|| Withdrawal::TimedOut(self.sup.acquire_timeout.unwrap_or_default()))
    }

    /// Asks the supervisor to take the job out of the queue (ignored once it was granted).
    pub(crate) fn withdraw(&self, why: Withdrawal) {
        let _ = self.sup.inbox.send(SupMsg::Withdraw {
            waiter: self.waiter,
            why,
        });
    }

    /// Waits for the answer: a cancellation or the acquire timeout withdraws the job, and the
    /// wait goes on (a grant made before the deadline that won the race is never lost; the
    /// supervisor refuses a job it would grant once its deadline has passed).
    pub(crate) async fn wait(&mut self) -> Result<RunOutcome, ()> {
        let timeout = self
            .deadline
            .map(|d| d.saturating_duration_since(tokio::time::Instant::now()));
        let cancel = self.cancel.clone();
        await_reply(
            &self.sup.inbox,
            self.waiter,
            &mut self.answer,
            Some(&cancel),
            timeout,
        )
        .await
        .map_err(drop)
    }

    /// Lets the job run to its end with nobody holding it: a task (on the supervisor's
    /// runtime) keeps the supervisor up until the answer comes, withdraws the job from the
    /// queue when it is cancelled or its acquire timeout passes (as [`wait`](Self::wait)
    /// does), and reports a cleanup failure in the answer.
    pub(crate) fn detach(mut self, job_id: String)
    where
        T: Send + 'static,
        E: Send + 'static,
    {
        let runtime = self.sup.runtime.clone();
        crate::counters::task();
        drop(runtime.spawn(async move {
            if let Ok(RunOutcome::Finished {
                cleanup: Err(err), ..
            }) = self.wait().await
            {
                self.sup.sink.report(Some(job_id), err);
            }
        }));
    }

    /// The job's handle is gone with the answer unread: a cleanup failure in an answer already
    /// in is reported here (otherwise the supervisor reports it when its answer finds nobody).
    pub(crate) fn orphan(mut self, job_id: &str) {
        if let Ok(RunOutcome::Finished {
            cleanup: Err(err), ..
        }) = self.answer.try_recv()
        {
            self.sup.sink.report(Some(job_id.to_owned()), err);
        }
    }

    /// The job's result from the supervisor's answer (`Err(())`: the supervisor is gone), its
    /// body's own result and what its context recorded.
    pub(crate) fn conclude(&mut self, outcome: Result<RunOutcome, ()>) -> Result<T, JobError<E>> {
        let cancelled = self.cancel.is_cancelled();
        let cleanup = match outcome {
            // A broker failure that raced the job's cancellation: the job was cancelled.
            Ok(RunOutcome::NotGranted(err)) => {
                return Err(JobError::Acquire(match *err {
                    AcquireError::Failed(_) if cancelled => AcquireError::Cancelled,
                    other => other,
                }));
            }
            // No body ran: the job could not be prepared, and its slots went back.
            Ok(RunOutcome::Finished {
                unprepared: Some(why),
                cleanup,
            }) => {
                return Err(JobError::Unprepared {
                    why: *why,
                    cleanup: cleanup.err(),
                });
            }
            Ok(RunOutcome::Finished {
                unprepared: None,
                cleanup,
            }) => cleanup,
            // The supervisor died (its runtime is gone): nothing more can be proven.
            Err(()) if !self.shared.started() => {
                return Err(JobError::Acquire(AcquireError::Stopped));
            }
            Err(()) => Err(CleanupError::stopped(None)),
        };
        // Every writer of `shared` and `body` has ended: the worker and its tracked tasks were
        // joined before the supervisor answered (or the slot was quarantined, in which case
        // late sibling reports are not waited for).
        let (value, error) = match self.body.try_recv() {
            Ok(Ok(v)) => (Some(v), None),
            Ok(Err(e)) => (None, Some(e)),
            Err(_) => (None, None),
        };
        let failure = BodyError::decide(BodyEnd {
            produced_value: value.is_some(),
            error,
            panics: self.shared.take_panics(),
            delivery_unknown: self.shared.take_delivery_unknown(),
            lease_lost: self.shared.take_lease_lost(),
            cancel_requested: cancelled,
        });
        match (failure, cleanup) {
            (None, Ok(())) => Ok(value.expect("no failure means the body returned a value")),
            (None, Err(cleanup)) => Err(JobError::Cleanup(cleanup)),
            (Some(body), Ok(())) => Err(JobError::Body(body)),
            (Some(body), Err(cleanup)) => Err(JobError::BodyAndCleanup { body, cleanup }),
        }
    }
}

/// Withdraws a waiter (and cancels its job) when the waiting future is dropped.
pub(super) struct WaitGuard<'a> {
    inbox: &'a Inbox,
    waiter: WaiterId,
    cancel: Option<CancellationToken>,
    armed: bool,
}

impl<'a> WaitGuard<'a> {
    pub(super) fn new(
        inbox: &'a Inbox,
        waiter: WaiterId,
        cancel: Option<CancellationToken>,
    ) -> Self {
        Self {
            inbox,
            waiter,
            cancel,
            armed: true,
        }
    }

    pub(super) fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for WaitGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        if let Some(cancel) = &self.cancel {
            cancel.cancel();
        }
        let _ = self.inbox.send(SupMsg::Withdraw {
            waiter: self.waiter,
            why: Withdrawal::Cancelled,
        });
    }
}

/// Waits for the supervisor's answer. Cancellation and the acquire timeout do not abandon the
/// wait: they ask the supervisor to withdraw the waiter and keep listening, so a grant that won
/// the race is never lost (for a job, the answer is then the job's own result; a job reached by
/// a grant only after its deadline is refused by the supervisor, `LEASE_ACQUIRE_TIMEOUT`).
pub(super) async fn await_reply<T>(
    inbox: &Inbox,
    waiter: WaiterId,
    rx: &mut oneshot::Receiver<T>,
    cancel: Option<&CancellationToken>,
    timeout: Option<Duration>,
) -> Result<T, oneshot::error::RecvError> {
    if cancel.is_none() && timeout.is_none() {
        return rx.await;
    }
    // Only what is configured exists: the timer is boxed and made only when an acquire timeout
    // is set, so that an untimed wait (the common case, and a flood's) carries no `Sleep`.
    let mut timer = timeout.map(|t| Box::pin(tokio::time::sleep(t)));
    let mut cancelled = pin!(cancel.map(CancellationToken::cancelled));
    loop {
        // Biased: the reply first, then the cancellation, then the timer. A source that fired
        // is dropped and the wait goes on.
        let next = poll_fn(|cx| {
            if let Poll::Ready(reply) = Pin::new(&mut *rx).poll(cx) {
                return Poll::Ready(Err(reply));
            }
            if let Some(fut) = cancelled.as_mut().as_pin_mut()
                && fut.poll(cx).is_ready()
            {
                cancelled.set(None);
                return Poll::Ready(Ok(Withdrawal::Cancelled));
            }
            if let Some(sleep) = timer.as_mut()
                && sleep.as_mut().poll(cx).is_ready()
            {
                timer = None;
                return Poll::Ready(Ok(Withdrawal::TimedOut(timeout.unwrap_or_default())));
            }
            Poll::Pending
        })
        .await;
        match next {
            Err(reply) => return reply,
            // If the supervisor is gone, `rx` resolves with an error on the next turn.
            Ok(why) => {
                let _ = inbox.send(SupMsg::Withdraw { waiter, why });
            }
        }
    }
}
