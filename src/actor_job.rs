//! Job actors: an engine's own [`ractor::Actor`] as the holder of a slot, for exactly its
//! lifetime ([`Supervisor::spawn_job`](crate::Supervisor::spawn_job)).
//!
//! A job actor is an ordinary job whose body hosts the actor: the slot goes through the same
//! queue and the same release pipeline as a closure job. The body spawns a `Watch` (a tiny
//! actor that is the job actor's supervisor) linked under the job's worker, which is linked to
//! the supervisor, and spawns the user's actor linked under the watch (wrapped
//! in `Guarded`, which records a panic in any callback before ractor turns it into
//! `ActorFailed`), and then waits for the actor's task to end (its ractor join handle resolves
//! only once the task is gone, state dropped) and for the watch to have handled the terminal
//! supervision event (which carries the state of a normal stop, dropped there). Only then does
//! the body end, so the worker's own exit (the pipeline's first proof) implies the actor's.
//! Cancellation (the job's token, [`Supervisor::cancel`](crate::Supervisor::cancel), dropping
//! the handle, shutdown) stops the actor, then kills it after the cancel grace.

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::oneshot;

use crate::worker::{JobShared, WorkerContext};

/// The reason a job actor is stopped with when its job is cancelled (or the supervisor shuts
/// down); it is killed if still running a cancel grace later.
pub const CANCEL_STOP_REASON: &str = "leasehold: job cancelled";

/// How a job actor ended when it stopped on its own (its job's success value).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActorExit {
    reason: Option<String>,
}

impl ActorExit {
    /// The reason given to `stop` (`None` for `myself.stop(None)`).
    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }
}

/// Why a job actor's job did not succeed (the `E` of its [`JobError`](crate::JobError)). The
/// stable code comes from the [`JobError`](crate::JobError): a handler's panic is
/// `LEASE_BODY_PANICKED` (its message in [`BodyError::panics`](crate::BodyError::panics)), a
/// stop or kill through cancellation or shutdown is `LEASE_BODY_CANCELLED`, the rest
/// `LEASE_BODY_FAILED`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ActorJobError {
    /// The actor never started: its arguments closure or `pre_start` failed (or panicked), or
    /// ractor refused the spawn.
    StartFailed(String),
    /// A callback (`post_start`, `handle`, `handle_supervisor_evt`, `post_stop`) returned an
    /// error or panicked.
    Failed(String),
    /// The job was cancelled (or the supervisor shut down): the actor was stopped, and killed
    /// when it was still running a cancel grace later.
    Cancelled {
        /// Whether it had to be killed.
        killed: bool,
    },
    /// The actor was killed (or its task dropped) by something other than its job's
    /// cancellation; its `post_stop` did not run.
    Killed(Option<String>),
}

impl fmt::Display for ActorJobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::StartFailed(why) => write!(f, "the job actor did not start: {why}"),
            Self::Failed(why) => write!(f, "the job actor failed: {why}"),
            Self::Cancelled { killed: false } => f.write_str("the job actor was stopped on cancel"),
            Self::Cancelled { killed: true } => {
                f.write_str("the job actor was killed after the cancel grace")
            }
            Self::Killed(Some(why)) => write!(f, "the job actor was killed ({why})"),
            Self::Killed(None) => f.write_str("the job actor was killed"),
        }
    }
}

impl std::error::Error for ActorJobError {}

/// The user's actor, with every callback's panic recorded in the job's record before ractor
/// sees it (ractor turns panics and returned errors alike into `ActorFailed`).
struct Guarded<A> {
    actor: A,
    shared: Arc<JobShared>,
    /// Set once `post_stop` has returned: the actor stopped, it was not killed.
    stopped: Arc<AtomicBool>,
}

impl<A> Guarded<A> {
    async fn guard<T>(&self, fut: impl Future<Output = T>) -> T {
        match AssertUnwindSafe(fut).catch_unwind().await {
            Ok(value) => value,
            Err(payload) => {
                self.shared.record_panic(&*payload);
                std::panic::resume_unwind(payload)
            }
        }
    }
}

impl<A: Actor> Actor for Guarded<A> {
    type Msg = A::Msg;
    type State = A::State;
    type Arguments = A::Arguments;

    async fn pre_start(
        &self,
        myself: ActorRef<A::Msg>,
        args: A::Arguments,
    ) -> Result<A::State, ActorProcessingErr> {
        self.guard(self.actor.pre_start(myself, args)).await
    }

    async fn post_start(
        &self,
        myself: ActorRef<A::Msg>,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        self.guard(self.actor.post_start(myself, state)).await
    }

    async fn post_stop(
        &self,
        myself: ActorRef<A::Msg>,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        let result = self.guard(self.actor.post_stop(myself, state)).await;
        self.stopped.store(true, Ordering::Release);
        result
    }

    async fn handle(
        &self,
        myself: ActorRef<A::Msg>,
        message: A::Msg,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        self.guard(self.actor.handle(myself, message, state)).await
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<A::Msg>,
        message: SupervisionEvent,
        state: &mut A::State,
    ) -> Result<(), ActorProcessingErr> {
        self.guard(self.actor.handle_supervisor_evt(myself, message, state))
            .await
    }
}

/// How the job actor ended, as its supervision event said.
enum Exit {
    /// `ActorTerminated`, with its reason.
    Terminated(Option<String>),
    /// `ActorFailed`.
    Failed(String),
}

/// The job actor's supervisor: it handles the one terminal event, drops the state a normal stop
/// moved into it (in its own task, never in the supervisor's mailbox), then stops.
struct Watch;

impl Actor for Watch {
    type Msg = ();
    type State = Option<oneshot::Sender<Exit>>;
    type Arguments = oneshot::Sender<Exit>;

    async fn pre_start(
        &self,
        _myself: ActorRef<()>,
        exit: oneshot::Sender<Exit>,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(Some(exit))
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<()>,
        event: SupervisionEvent,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let exit = match event {
            SupervisionEvent::ActorTerminated(_, boxed_state, reason) => {
                // The job actor's state ends here, before this actor's task (and so the job's
                // body, and so its worker) can end.
                drop(boxed_state);
                Exit::Terminated(reason)
            }
            SupervisionEvent::ActorFailed(_, err) => Exit::Failed(err.to_string()),
            _ => return Ok(()),
        };
        if let Some(tx) = state.take() {
            let _ = tx.send(exit);
        }
        myself.stop(None);
        Ok(())
    }
}

/// The body of a job actor's job: see the module docs.
pub(crate) async fn host<A, F>(
    actor: A,
    args: F,
    started: oneshot::Sender<ActorRef<A::Msg>>,
    grace: Duration,
    ctx: WorkerContext,
) -> Result<ActorExit, ActorJobError>
where
    A: Actor,
    F: FnOnce(WorkerContext) -> A::Arguments + Send + 'static,
{
    let shared = Arc::clone(ctx.shared());
    // This body applies the stop-then-kill rule itself: the worker must not drop it (and with
    // it the wait for the actor) when the grace is over.
    shared.set_stops_itself();
    let (exit_tx, exit_rx) = oneshot::channel();
    // Linked under the job's worker (linked to the supervisor): supervisor → worker → watch →
    // job actor.
    crate::counters::task();
    let (watch, watch_join) = Actor::spawn_linked(None, Watch, exit_tx, ctx.worker().clone())
        .await
        .map_err(|e| ActorJobError::StartFailed(e.to_string()))?;
    let made = std::panic::catch_unwind(AssertUnwindSafe(|| args(ctx.clone())));
    let stopped = Arc::new(AtomicBool::new(false));
    let spawned = match made {
        Ok(args) => {
            let guarded = Guarded {
                actor,
                shared: Arc::clone(&shared),
                stopped: Arc::clone(&stopped),
            };
            // Spawned without waiting for `pre_start`, so that a cancellation reaches an actor
            // still starting: ractor handles a stop only once the actor runs, but a kill ends
            // `pre_start` (its future, and the arguments in it, are dropped in the start task).
            crate::counters::task();
            ractor::ActorRuntime::spawn_linked_instant(None, guarded, args, watch.get_cell())
                .map_err(|e| e.to_string())
        }
        Err(payload) => {
            shared.record_caught(payload);
            Err("the arguments closure panicked".to_owned())
        }
    };
    let (actor_ref, mut starting) = match spawned {
        Ok(spawned) => spawned,
        Err(why) => {
            // Nothing was linked to the watch: it ends now.
            watch.stop(None);
            let _ = watch_join.await;
            return Err(ActorJobError::StartFailed(why));
        }
    };
    // Cancellation: stop at once, kill at the grace. One deadline, however far the actor got.
    let mut kill_at: Option<tokio::time::Instant> = None;
    let mut killed = false;
    let start = tokio::select! {
        biased;
        start = &mut starting => start,
        () = ctx.cancelled() => {
            let deadline = tokio::time::Instant::now() + grace;
            kill_at = Some(deadline);
            actor_ref.stop(Some(CANCEL_STOP_REASON.to_owned()));
            match tokio::time::timeout_at(deadline, &mut starting).await {
                Ok(start) => start,
                Err(_) => {
                    tracing::warn!(?grace, "job actor still starting a cancel grace after its stop; killing it");
                    actor_ref.kill();
                    killed = true;
                    (&mut starting).await
                }
            }
        }
    };
    let mut join = match start {
        Ok(Ok(join)) => join,
        // `pre_start` failed, or was killed: the actor never linked to the watch, and its
        // start task (with whatever `pre_start` held) has ended.
        failed => {
            watch.stop(None);
            let _ = watch_join.await;
            drop(actor_ref);
            let why = match failed {
                Ok(Err(err)) => err.to_string(),
                Err(err) => err.to_string(),
                Ok(Ok(_)) => unreachable!("matched above"),
            };
            return Err(if kill_at.is_some() {
                ActorJobError::Cancelled { killed }
            } else {
                ActorJobError::StartFailed(why)
            });
        }
    };
    drop(watch);
    let _ = started.send(actor_ref.clone());
    let cancelled = kill_at.is_some()
        || tokio::select! {
            biased;
            _ = &mut join => false,
            () = ctx.cancelled() => true,
        };
    if cancelled {
        let deadline = *kill_at.get_or_insert_with(|| tokio::time::Instant::now() + grace);
        actor_ref.stop(Some(CANCEL_STOP_REASON.to_owned()));
        if tokio::time::timeout_at(deadline, &mut join).await.is_err() {
            tracing::warn!(
                ?grace,
                "job actor still running a cancel grace after its stop; killing it"
            );
            actor_ref.kill();
            killed = true;
            let _ = (&mut join).await;
        }
    }
    // The watch ends once it has handled the terminal event (the state of a normal stop is
    // dropped there).
    let _ = watch_join.await;
    drop(actor_ref);
    let cancelled = shared.cancel.is_cancelled();
    match exit_rx.await {
        Ok(Exit::Failed(why)) => Err(ActorJobError::Failed(why)),
        Ok(Exit::Terminated(_)) if cancelled => Err(ActorJobError::Cancelled { killed }),
        // `post_stop` ran: a stop (ractor skips it for a kill).
        Ok(Exit::Terminated(reason)) if stopped.load(Ordering::Acquire) => Ok(ActorExit { reason }),
        Ok(Exit::Terminated(reason)) => Err(ActorJobError::Killed(reason)),
        Err(_) => Err(ActorJobError::Killed(Some(
            "no supervision event arrived".to_owned(),
        ))),
    }
}
