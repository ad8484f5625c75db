//! The supervisor actor: a thin, effectful shell around the pure [`LeaseTable`].
//!
//! Only this actor mutates the slot table. It never awaits a broker or the file system inside
//! its mailbox: broker futures get one inline poll (the in-process broker answers there) and
//! otherwise run in a task that reports back by message; temp dirs are removed on the blocking
//! pool. The one await in a handler is the worker actor's spawn, which returns as soon as the
//! worker's `pre_start` (a move of its arguments) is done.

use std::collections::HashMap;
use std::io;
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, MessagingErr, SupervisionEvent};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Span;

use super::messages::{CancelReason, PendingJob, ReleaseReply, RunOutcome, SupMsg, WaiterKind};
use super::state::{
    Edge, LeaseKey, LeaseKind, LeaseTable, Phase, ReleaseOutcome, WaiterId, shrink_map,
};
use super::stats::{Published, SharedStats, metric_names};
use super::{QuarantinedSlot, ReclaimReport, ShutdownReport};
use crate::broker::{AcquireRequest, BrokerError, BrokerEvent, DynBroker, SlotToken, poll_once};
use crate::error::{AcquireError, CleanupError, CleanupErrorKind};
use crate::lease::Lease;
use crate::process::{ProcessPolicy, Unproven};
use crate::sink::{ErrorSink, OrphanedFailure};
use crate::worker::{JobShared, WorkerActor, WorkerArgs, WorkerContext};

/// Settings fixed at start.
pub(crate) struct Config {
    pub(crate) cleanup_timeout: Duration,
    pub(crate) cancel_grace: Duration,
    pub(crate) drain_timeout: Option<Duration>,
    pub(crate) work_root: PathBuf,
    pub(crate) error_sink: Option<ErrorSink>,
    pub(crate) process_policy: ProcessPolicy,
    #[cfg(feature = "gpu")]
    pub(crate) gpu: Option<Arc<crate::gpu::GpuPool>>,
}

pub(crate) struct SupervisorActor;

pub(crate) struct SupArgs {
    /// The table's capacity: the broker's, capped by the GPU pool's sub-slots.
    pub(crate) capacity: Option<u32>,
    pub(crate) broker: Arc<dyn DynBroker>,
    pub(crate) config: Arc<Config>,
    pub(crate) stats: Arc<SharedStats>,
    pub(crate) owned_root: Option<tempfile::TempDir>,
    /// Random per supervisor (see `AcquireRequest::origin`).
    pub(crate) origin: u64,
}

/// A lease's keep-alive task, and whom its loss concerns.
struct Renewal {
    task: tokio::task::AbortHandle,
    target: LostTarget,
}

enum LostTarget {
    /// The job is cancelled and reports `LEASE_LOST`.
    Job(Arc<JobShared>),
    /// The explicit lease's `lost()` signal.
    Lease(CancellationToken),
    /// The job's worker has ended: only logged (the slot may be taken elsewhere before this
    /// process's release; fencing covers that).
    Logged,
}

struct Waiter {
    /// Carries the caller's span.
    kind: WaiterKind,
    since: Instant,
}

/// Why a slot is quarantined, and what would prove it clean.
enum Quarantine {
    /// Tracked tasks outlived the drain bound; released on its own once they end.
    Draining { reason: String },
    /// The temp dir could not be removed; removal is retried on reclaim.
    Scratch { reason: String },
    /// Processes could not be proven gone; re-checked on reclaim.
    Processes {
        reason: String,
        evidence: Vec<Unproven>,
    },
    /// The lease's GPU device was lost; released once it is replaced (or given up).
    #[cfg(feature = "gpu")]
    GpuLost { reason: String, device: usize },
}

impl Quarantine {
    fn reason(&self) -> &str {
        match self {
            Self::Draining { reason }
            | Self::Scratch { reason }
            | Self::Processes { reason, .. } => reason,
            #[cfg(feature = "gpu")]
            Self::GpuLost { reason, .. } => reason,
        }
    }
}

struct RunningJob {
    job_id: Arc<str>,
    shared: Arc<JobShared>,
    /// Taken when the caller has been answered (at the end, or early on quarantine).
    reply: Option<oneshot::Sender<RunOutcome>>,
    temp_dir: PathBuf,
    #[cfg(feature = "gpu")]
    placement: Option<crate::gpu::Placement>,
}

pub(crate) struct SupState {
    table: LeaseTable,
    broker: Arc<dyn DynBroker>,
    config: Arc<Config>,
    stats: Arc<SharedStats>,
    /// What was last stored into `stats`.
    published: Published,
    waiters: HashMap<WaiterId, Waiter>,
    jobs: HashMap<LeaseKey, RunningJob>,
    workers: HashMap<ActorId, LeaseKey>,
    release_replies: HashMap<LeaseKey, Vec<ReleaseReply>>,
    quarantine: HashMap<LeaseKey, Quarantine>,
    shutdown_replies: Vec<oneshot::Sender<ShutdownReport>>,
    report: ShutdownReport,
    next_request: u64,
    /// Set at the shutdown deadline: broker acquires still in flight are no longer waited for.
    abandon_pending: bool,
    /// The GPU devices are being closed (at shutdown), or have been.
    #[cfg(feature = "gpu")]
    gpu_closing: bool,
    #[cfg(feature = "gpu")]
    gpu_closed: bool,
    owned_root: Option<tempfile::TempDir>,
    /// Keep-alive tasks of leases held from a broker that [`renews`](crate::SlotBroker::renews),
    /// aborted when the lease's release begins.
    renewals: HashMap<LeaseKey, Renewal>,
    /// Random per supervisor: with the request id, a key unique among every supervisor that
    /// shares a broker.
    origin: u64,
}

impl Actor for SupervisorActor {
    type Msg = SupMsg;
    type State = SupState;
    type Arguments = SupArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SupMsg>,
        args: SupArgs,
    ) -> Result<SupState, ActorProcessingErr> {
        #[cfg(feature = "gpu")]
        if let Some(pool) = &args.config.gpu {
            let me = myself.clone();
            pool.set_replaced_hook(Box::new(move |device| {
                let _ = me.send_message(SupMsg::GpuReplaced { device });
            }));
        }
        #[cfg(not(feature = "gpu"))]
        let _ = myself;
        Ok(SupState {
            table: LeaseTable::new(args.capacity),
            broker: args.broker,
            config: args.config,
            stats: args.stats,
            published: Published::default(),
            waiters: HashMap::new(),
            jobs: HashMap::new(),
            workers: HashMap::new(),
            release_replies: HashMap::new(),
            quarantine: HashMap::new(),
            shutdown_replies: Vec::new(),
            report: ShutdownReport::default(),
            next_request: 1,
            abandon_pending: false,
            #[cfg(feature = "gpu")]
            gpu_closing: false,
            #[cfg(feature = "gpu")]
            gpu_closed: false,
            owned_root: args.owned_root,
            renewals: HashMap::new(),
            origin: args.origin,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SupMsg>,
        msg: SupMsg,
        state: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        state.on_message(&myself, msg).await;
        state.settle(&myself).await;
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<SupMsg>,
        evt: SupervisionEvent,
        state: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        let id = match evt {
            SupervisionEvent::ActorTerminated(cell, last_state, _) => {
                // On a normal stop ractor moves the worker's state into this event. It is dropped
                // here, before the event counts as one of the two proofs of physical exit.
                drop(last_state);
                cell.get_id()
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                // Not expected (the worker catches its body's panics), and not proof of anything
                // on its own: ractor may deliver this before the worker's state is dropped, which
                // is why the join handle is awaited too.
                tracing::error!(error = %err, "worker actor failed");
                cell.get_id()
            }
            _ => return Ok(()),
        };
        if let Some(key) = state.workers.remove(&id)
            && state.table.note_worker_end(key, false)
        {
            state.proofs_complete(&myself, key);
        }
        state.settle(&myself).await;
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<SupMsg>,
        state: &mut SupState,
    ) -> Result<(), ActorProcessingErr> {
        // Waiters still queued (the actor is stopping for another reason than shutdown) hear
        // SUPERVISOR_STOPPED when their reply senders drop with the state.
        for (_, renewal) in state.renewals.drain() {
            renewal.task.abort();
        }
        if let Some(root) = state.owned_root.take()
            && state.table.quarantined() > 0
        {
            // Quarantined temp dirs are evidence: keep them.
            let kept = root.keep();
            tracing::warn!(root = %kept.display(), "work root kept: it holds quarantined temp dirs");
        }
        Ok(())
    }
}

impl SupState {
    async fn on_message(&mut self, myself: &ActorRef<SupMsg>, msg: SupMsg) {
        match msg {
            SupMsg::Acquire { waiter, kind } => {
                if self.table.enqueue(waiter) {
                    let since = Instant::now();
                    self.waiters.insert(waiter, Waiter { kind, since });
                } else {
                    reply_not_started(kind, AcquireError::Stopped);
                }
            }
            SupMsg::Cancel { waiter, reason } => self.cancel_waiter(waiter, reason),
            SupMsg::BrokerAcquired { result } => self.on_acquired(myself, result).await,
            SupMsg::WorkerExited { key } => self.on_worker_exited(myself, key),
            SupMsg::DrainTimedOut { key, after } => self.on_unconfirmed(
                key,
                format!(
                    "tasks spawned through the worker context were still running {after:?} after the worker ended; the slot stays quarantined until they end"
                ),
            ),
            SupMsg::ScratchRemoved { key, result } => self.on_scratch_removed(myself, key, result),
            SupMsg::Release { key, reply } => self.on_release_request(myself, key, reply),
            SupMsg::BrokerReleased {
                key,
                result,
                started,
            } => self.finish_release(key, result, started),
            SupMsg::Shutdown { reply } => self.begin_shutdown(myself, reply),
            SupMsg::ShutdownDeadline => self.abandon_pending = true,
            SupMsg::Quarantined { reply } => {
                let _ = reply.send(self.list_quarantine());
            }
            SupMsg::Reclaim { reply } => self.reclaim(myself, reply),
            #[cfg(feature = "gpu")]
            SupMsg::GpuReplaced { device } => self.on_gpu_replaced(myself, device),
            #[cfg(feature = "gpu")]
            SupMsg::GpuClosed => self.gpu_closed = true,
            SupMsg::Unconfirmed { key, detail } => self.on_unconfirmed(key, detail),
            SupMsg::LeaseLost { key, reason } => self.on_lease_lost(key, reason),
            SupMsg::Broker(BrokerEvent::OrphanExpired { lease_id }) => {
                tracing::warn!(lease_id, "an orphaned lease expired at the broker");
                self.table.note_orphan_expired();
                metrics::counter!(metric_names::ORPHAN_EXPIRED_COUNT).increment(1);
                self.stats.publish(&self.table, &mut self.published);
            }
        }
    }

    /// After every message: start the broker acquires the queue needs, publish stats (what
    /// changed), give back the capacity a flood left, and finish a shutdown that has nothing
    /// left to wait for.
    async fn settle(&mut self, myself: &ActorRef<SupMsg>) {
        self.pump(myself).await;
        self.stats.publish(&self.table, &mut self.published);
        SharedStats::publish_gauges(&self.table);
        self.shrink_idle();
        self.maybe_finish_shutdown(myself);
    }

    /// Returns the memory of maps that have emptied out (after a flood drains): amortised O(1),
    /// since a map is only rebuilt once it has lost three quarters of its capacity.
    fn shrink_idle(&mut self) {
        shrink_map(&mut self.waiters, SHRINK_FLOOR);
        shrink_map(&mut self.jobs, SHRINK_FLOOR);
        shrink_map(&mut self.workers, SHRINK_FLOOR);
        shrink_map(&mut self.release_replies, SHRINK_FLOOR);
        shrink_map(&mut self.quarantine, SHRINK_FLOOR);
        self.table.shrink_idle();
    }

    fn cancel_waiter(&mut self, waiter: WaiterId, reason: CancelReason) {
        if self.table.cancel_waiter(waiter)
            && let Some(w) = self.waiters.remove(&waiter)
        {
            self.refuse(w.kind, reason.into_error());
        }
    }

    /// Answers a waiter that gets no slot, after publishing the figures it may read next.
    fn refuse(&mut self, kind: WaiterKind, err: AcquireError) {
        self.stats.publish(&self.table, &mut self.published);
        reply_not_started(kind, err);
    }

    fn pop_live_waiter(&mut self) -> Option<Waiter> {
        let id = self.table.pop_waiter()?;
        self.waiters.remove(&id)
    }

    /// Issues the broker acquires the queue needs. A broker that answers on the first poll is
    /// handled inline, which may free room for more: hence the loop.
    async fn pump(&mut self, myself: &ActorRef<SupMsg>) {
        loop {
            let n = self.table.requests_to_issue();
            if n == 0 {
                return;
            }
            let mut ready = Vec::new();
            for _ in 0..n {
                let request_id = self.next_request;
                self.next_request += 1;
                let job_id = self
                    .table
                    .head()
                    .and_then(|w| match &self.waiters.get(&w)?.kind {
                        WaiterKind::Job(job) => Some(Arc::clone(&job.job_id)),
                        WaiterKind::Lease { .. } => None,
                    });
                let request =
                    AcquireRequest::new(request_id, job_id.as_deref()).with_origin(self.origin);
                let mut fut = Arc::clone(&self.broker).acquire_boxed(request);
                match poll_once(&mut fut) {
                    Poll::Ready(result) => ready.push(result),
                    Poll::Pending => {
                        let me = myself.clone();
                        let broker = Arc::clone(&self.broker);
                        let timeout = self.config.cleanup_timeout;
                        tokio::spawn(async move {
                            let result = fut.await;
                            let msg = SupMsg::BrokerAcquired { result };
                            if let Err(MessagingErr::SendErr(SupMsg::BrokerAcquired {
                                result: Ok(token),
                            })) = me.send_message(msg)
                            {
                                // The supervisor stopped while this acquire was in flight: nobody
                                // can hold the token, so it goes straight back, exactly once.
                                release_orphan(broker, token, timeout).await;
                            }
                        });
                    }
                }
            }
            if ready.is_empty() {
                return;
            }
            for result in ready {
                self.on_acquired(myself, result).await;
            }
        }
    }

    async fn on_acquired(
        &mut self,
        myself: &ActorRef<SupMsg>,
        result: Result<SlotToken, BrokerError>,
    ) {
        let token = match result {
            Ok(token) => token,
            Err(err) => {
                self.table.request_failed();
                // Tokens are fungible and so are failures: the longest waiter hears it. A waiter
                // that has already left (or whose job is cancelled) absorbs it instead: it has
                // its answer, and every other waiter is still covered by its own request.
                if let Some(w) = self.pop_live_waiter() {
                    let span = w.kind.span().clone();
                    let _e = span.enter();
                    tracing::warn!(error = %err, "slot acquire failed");
                    let err = match &w.kind {
                        WaiterKind::Job(job) if job.shared.cancel.is_cancelled() => {
                            AcquireError::Cancelled
                        }
                        _ => AcquireError::Failed(err),
                    };
                    self.refuse(w.kind, err);
                }
                return;
            }
        };
        if let Err(refused) = self.table.token_arrived(token) {
            // Not released: releasing a duplicate could free the live holder's slot.
            tracing::error!(%refused, "refusing a token from the broker");
            if let Some(w) = self.pop_live_waiter() {
                let err = BrokerError::invalid_response(refused.to_string());
                self.refuse(w.kind, AcquireError::Failed(err));
            }
            return;
        }
        loop {
            let Some(waiter) = self.pop_live_waiter() else {
                // Nobody waits any more: the token goes straight back, exactly once.
                let key = self.table.grant(token, LeaseKind::Surplus);
                self.apply(key, Edge::ReleaseRequested);
                self.start_release(myself, key, token);
                return;
            };
            match waiter.kind {
                WaiterKind::Lease { reply, span } => {
                    if reply.is_closed() {
                        continue;
                    }
                    let key = self.table.grant(token, LeaseKind::Explicit);
                    record_grant(&span, waiter.since, token);
                    let lost = self.broker.renews().then(CancellationToken::new);
                    if let Some(signal) = &lost {
                        let target = LostTarget::Lease(signal.clone());
                        self.start_renewal(myself, key, token, target);
                    }
                    self.stats.publish(&self.table, &mut self.published);
                    let lease = Lease::new(key, token, myself.clone(), lost);
                    if let Err(Ok(lease)) = reply.send(Ok(lease)) {
                        // The caller left between the check and the send: release it here.
                        lease.defuse();
                        self.apply(key, Edge::ReleaseRequested);
                        self.start_release(myself, key, token);
                    }
                    return;
                }
                WaiterKind::Job(job) => {
                    // A grant racing with the caller's cancellation goes to the next waiter.
                    if job.shared.cancel.is_cancelled() || job.reply.is_closed() {
                        self.refuse(WaiterKind::Job(job), AcquireError::Cancelled);
                        continue;
                    }
                    let key = self.table.grant(token, LeaseKind::Job);
                    record_grant(&job.span, waiter.since, token);
                    self.start_job(myself, key, token, *job).await;
                    return;
                }
            }
        }
    }

    async fn start_job(
        &mut self,
        myself: &ActorRef<SupMsg>,
        key: LeaseKey,
        token: SlotToken,
        job: PendingJob,
    ) {
        let PendingJob {
            job_id,
            shared,
            body,
            reply,
            span,
        } = job;
        span.record("slot_id", token.slot_id());
        span.record("lease_id", token.lease_id());
        if self.broker.renews() {
            self.start_renewal(myself, key, token, LostTarget::Job(Arc::clone(&shared)));
        }
        let made = tempfile::Builder::new()
            .prefix(&format!("{job_id}-"))
            .tempdir_in(&self.config.work_root);
        let temp_dir = match made {
            Ok(dir) => dir.keep(),
            Err(err) => {
                let _e = span.enter();
                tracing::error!(error = %err, "could not create the job's temp dir");
                let _ = reply.send(RunOutcome::NotStarted(AcquireError::Scratch(Arc::new(err))));
                self.apply(key, Edge::ReleaseRequested);
                self.start_release(myself, key, token);
                return;
            }
        };
        #[cfg(feature = "gpu")]
        let placement = match &self.config.gpu {
            Some(pool) => match pool.place() {
                Some(p) => Some((Arc::clone(pool), p)),
                None => {
                    let _ = std::fs::remove_dir_all(&temp_dir);
                    let err = crate::gpu::GpuError::CreateFailed("no usable gpu slot".into());
                    let _ = reply.send(RunOutcome::NotStarted(AcquireError::Gpu(err)));
                    self.apply(key, Edge::ReleaseRequested);
                    self.start_release(myself, key, token);
                    return;
                }
            },
            None => None,
        };
        let tracker = TaskTracker::new();
        let ctx = WorkerContext::new(
            token,
            Arc::clone(&job_id),
            temp_dir.clone(),
            Arc::clone(&shared),
            tracker.clone(),
            span,
            self.config.process_policy,
        );
        let args = WorkerArgs {
            body,
            ctx,
            shared: Arc::clone(&shared),
            grace: self.config.cancel_grace,
            #[cfg(feature = "gpu")]
            gpu: placement.clone(),
        };
        match Actor::spawn_linked(None, WorkerActor, args, myself.get_cell()).await {
            Ok((worker, join)) => {
                self.workers.insert(worker.get_id(), key);
                #[cfg(feature = "gpu")]
                let gpu_placement = placement.as_ref().map(|(_, p)| *p);
                #[cfg(feature = "gpu")]
                let gpu = placement.map(|(pool, _)| (pool, Arc::clone(&shared)));
                self.jobs.insert(
                    key,
                    RunningJob {
                        job_id,
                        shared,
                        reply: Some(reply),
                        temp_dir,
                        #[cfg(feature = "gpu")]
                        placement: gpu_placement,
                    },
                );
                let driver = Driver {
                    join,
                    tracker,
                    sup: myself.clone(),
                    key,
                    drain_timeout: self.config.drain_timeout,
                    #[cfg(feature = "gpu")]
                    gpu,
                };
                tokio::spawn(driver.run());
            }
            Err(err) => {
                // The worker's pre_start only moves its arguments, so the body never ran.
                tracing::error!(error = %err, "could not spawn the worker actor");
                #[cfg(feature = "gpu")]
                if let Some((pool, p)) = &placement {
                    pool.free(*p);
                }
                let _ = std::fs::remove_dir_all(&temp_dir);
                let err = BrokerError::new(format!("worker spawn failed: {err}"));
                let _ = reply.send(RunOutcome::NotStarted(AcquireError::Failed(err)));
                self.apply(key, Edge::ReleaseRequested);
                self.start_release(myself, key, token);
            }
        }
    }

    /// Keeps the lease alive while it is held, when the broker needs that. A loss cancels the
    /// lease's job at once and marks its result `LEASE_LOST`; renewal stops when the release
    /// begins (so a quarantined slot, whose work may still run, keeps its lease).
    fn start_renewal(
        &mut self,
        myself: &ActorRef<SupMsg>,
        key: LeaseKey,
        token: SlotToken,
        target: LostTarget,
    ) {
        let lost = Arc::clone(&self.broker).keep_alive_boxed(token);
        let me = myself.clone();
        let task = tokio::spawn(async move {
            let err = lost.await;
            // Judged by the actor: renewal may have been stopped since.
            let _ = me.send_message(SupMsg::LeaseLost {
                key,
                reason: err.to_string(),
            });
        });
        self.renewals.insert(
            key,
            Renewal {
                task: task.abort_handle(),
                target,
            },
        );
    }

    /// Renewal ends: the lease's release begins (or the actor stops).
    fn stop_renewal(&mut self, key: LeaseKey) {
        if let Some(renewal) = self.renewals.remove(&key) {
            renewal.task.abort();
        }
    }

    /// The broker could not keep a lease alive. Acted on only while its renewal still runs:
    /// a loss reported after the worker ended (or the release began) changes nothing.
    fn on_lease_lost(&mut self, key: LeaseKey, reason: String) {
        let Some(renewal) = self.renewals.remove(&key) else {
            return;
        };
        let token = self.table.get(key).map(|r| r.token);
        let job_id = self.jobs.get(&key).map(|j| j.job_id.to_string());
        tracing::error!(?token, job_id, %reason, "lease lost: it could not be kept alive");
        match renewal.target {
            LostTarget::Job(shared) => {
                shared.mark_lease_lost(reason);
                shared.cancel.cancel();
            }
            LostTarget::Lease(signal) => signal.cancel(),
            LostTarget::Logged => {}
        }
    }

    /// Both proofs of the worker's end are in: remove its temp dir off the mailbox.
    fn remove_scratch(&mut self, myself: &ActorRef<SupMsg>, key: LeaseKey) {
        let Some(job) = self.jobs.get(&key) else {
            return;
        };
        let path = job.temp_dir.clone();
        let me = myself.clone();
        tokio::task::spawn_blocking(move || {
            let result = match std::fs::remove_dir_all(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                other => other,
            };
            let _ = me.send_message(SupMsg::ScratchRemoved { key, result });
        });
    }

    /// Both proofs of the worker's end are in: remove the temp dir, unless the slot is held in
    /// quarantine for something only `reclaim_quarantined` can re-check.
    fn proofs_complete(&mut self, myself: &ActorRef<SupMsg>, key: LeaseKey) {
        match self.quarantine.get(&key) {
            Some(Quarantine::Processes { .. } | Quarantine::Scratch { .. }) => return,
            // Released here only if the device was already replaced (or given up) before this
            // last proof came in; otherwise `on_gpu_replaced` releases it.
            #[cfg(feature = "gpu")]
            Some(Quarantine::GpuLost { device, .. }) => {
                let settled = self.config.gpu.as_ref().is_some_and(|g| g.settled(*device));
                if !settled {
                    return;
                }
                self.quarantine.remove(&key);
            }
            _ => {}
        }
        self.remove_scratch(myself, key);
    }

    fn on_worker_exited(&mut self, myself: &ActorRef<SupMsg>, key: LeaseKey) {
        let unproven = self
            .jobs
            .get(&key)
            .map(|j| j.shared.take_unproven())
            .unwrap_or_default();
        // The worker and its tracked tasks (keepers included) have ended, either way. The lease
        // is still renewed until its release begins (the slot is not free before that, here or
        // at the broker), but a loss from now on can no longer concern the job's result.
        if let Some(renewal) = self.renewals.get_mut(&key) {
            renewal.target = LostTarget::Logged;
        }
        let both_proofs = self.table.note_worker_end(key, true);
        #[cfg(feature = "gpu")]
        if let Some((device, reason)) = self.jobs.get(&key).and_then(|j| j.shared.take_gpu_lost()) {
            self.quarantine_gpu_lost(key, device, reason);
            if both_proofs {
                // The device may already have been replaced by another lease's checkout.
                self.proofs_complete(myself, key);
            }
            return;
        }
        if unproven.is_empty() {
            if both_proofs {
                self.proofs_complete(myself, key);
            }
            return;
        }
        // Processes may still run in the temp dir: keep both, never declare the slot clean.
        let Some((token, _)) = self.enter_quarantine(key) else {
            return;
        };
        let reason = unproven
            .iter()
            .map(|u| u.reason.as_str())
            .collect::<Vec<_>>()
            .join("; ");
        self.quarantine.insert(
            key,
            Quarantine::Processes {
                reason: reason.clone(),
                evidence: unproven,
            },
        );
        self.answer_job_early(key, CleanupError::unconfirmed(token, reason, None));
    }

    fn on_scratch_removed(
        &mut self,
        myself: &ActorRef<SupMsg>,
        key: LeaseKey,
        result: io::Result<()>,
    ) {
        let Some(record) = self.table.get(key) else {
            return;
        };
        let (token, phase) = (record.token, record.phase);
        match result {
            Ok(()) => {
                if phase == Phase::Quarantined {
                    self.quarantine.remove(&key);
                    tracing::info!(%token, "quarantined slot proven clean late; releasing it");
                }
                if self.apply(key, Edge::Drained) {
                    self.start_release(myself, key, token);
                }
            }
            Err(err) => {
                let path = self
                    .jobs
                    .get(&key)
                    .map(|j| j.temp_dir.display().to_string());
                let detail = format!("temp dir {} could not be removed", path.unwrap_or_default());
                if phase == Phase::Draining {
                    self.apply(key, Edge::Unconfirmed);
                }
                self.quarantine.insert(
                    key,
                    Quarantine::Scratch {
                        reason: detail.clone(),
                    },
                );
                self.answer_job_early(key, CleanupError::unconfirmed(token, detail, Some(err)));
            }
        }
    }

    /// Moves a lease whose physical end is not proven into quarantine (through `Draining` if
    /// its body had not been seen to end). Returns its token, and whether it was newly
    /// quarantined (`false`: it already was); `None` for a lease that is not live.
    fn enter_quarantine(&mut self, key: LeaseKey) -> Option<(SlotToken, bool)> {
        let record = self.table.get(key)?;
        let token = record.token;
        if record.phase == Phase::Granted {
            self.apply(key, Edge::BodyEnded);
        }
        let newly = self.table.get(key).map(|r| r.phase) == Some(Phase::Draining);
        if newly {
            self.apply(key, Edge::Unconfirmed);
        }
        Some((token, newly))
    }

    /// The worker's physical end is late (tracked tasks past the drain bound, GPU work past the
    /// fence bound): quarantine now, tell the caller; the slot is released when it does end.
    fn on_unconfirmed(&mut self, key: LeaseKey, detail: String) {
        if let Some((token, true)) = self.enter_quarantine(key) {
            self.quarantine.insert(
                key,
                Quarantine::Draining {
                    reason: detail.clone(),
                },
            );
            self.answer_job_early(key, CleanupError::unconfirmed(token, detail, None));
        }
    }

    /// Tells the job's caller (or, with no caller left, the sink) that cleanup is unconfirmed.
    fn answer_job_early(&mut self, key: LeaseKey, err: CleanupError) {
        self.stats.publish(&self.table, &mut self.published);
        let job = self.jobs.get_mut(&key);
        let job_id = job.as_ref().map(|j| j.job_id.to_string());
        let reply = job.and_then(|j| j.reply.take());
        let undelivered = match reply {
            Some(reply) => match reply.send(RunOutcome::Finished { cleanup: Err(err) }) {
                Ok(()) => None,
                Err(RunOutcome::Finished { cleanup: Err(err) }) => Some(err),
                Err(_) => None,
            },
            None => Some(err),
        };
        if let Some(err) = undelivered {
            self.sink(job_id, err);
        }
    }

    fn list_quarantine(&self) -> Vec<QuarantinedSlot> {
        let mut out: Vec<_> = self
            .quarantine
            .iter()
            .filter_map(|(key, q)| {
                let record = self.table.get(*key)?;
                (record.phase == Phase::Quarantined).then(|| QuarantinedSlot {
                    token: record.token,
                    job_id: self.jobs.get(key).map(|j| j.job_id.to_string()),
                    reason: q.reason().to_owned(),
                })
            })
            .collect();
        out.sort_by_key(|q| q.token.lease_id());
        out
    }

    /// Checks every quarantined slot again; those now proven clean go through the rest of the
    /// pipeline (temp dir removal, broker release).
    fn reclaim(&mut self, myself: &ActorRef<SupMsg>, reply: oneshot::Sender<ReclaimReport>) {
        let mut report = ReclaimReport::default();
        let keys: Vec<LeaseKey> = self.quarantine.keys().copied().collect();
        for key in keys {
            let Some(record) = self.table.get(key) else {
                self.quarantine.remove(&key);
                continue;
            };
            let (token, exited) = (record.token, record.exited && record.event_seen);
            let job_id = self.jobs.get(&key).map(|j| j.job_id.to_string());
            let still = match self.quarantine.get_mut(&key).expect("listed") {
                Quarantine::Draining { reason } => Some(reason.clone()),
                Quarantine::Scratch { .. } => None,
                Quarantine::Processes { evidence, .. } => {
                    let reasons: Vec<_> =
                        evidence.iter_mut().filter_map(Unproven::recheck).collect();
                    (!reasons.is_empty()).then(|| reasons.join("; "))
                }
                // Released when the device is replaced (or given up for good).
                #[cfg(feature = "gpu")]
                Quarantine::GpuLost { reason, .. } => Some(reason.clone()),
            };
            match still {
                Some(reason) => report.still_quarantined.push(QuarantinedSlot {
                    token,
                    job_id,
                    reason,
                }),
                None if exited || matches!(self.quarantine[&key], Quarantine::Scratch { .. }) => {
                    report.reclaimed.push(token);
                    self.remove_scratch(myself, key);
                }
                None => report.still_quarantined.push(QuarantinedSlot {
                    token,
                    job_id,
                    reason: "the worker has not been proven to have exited".into(),
                }),
            }
        }
        let _ = reply.send(report);
    }

    #[cfg(feature = "gpu")]
    fn quarantine_gpu_lost(&mut self, key: LeaseKey, device: usize, reason: String) {
        let Some((token, _)) = self.enter_quarantine(key) else {
            return;
        };
        let detail = format!("gpu device {device} lost: {reason}");
        self.quarantine.insert(
            key,
            Quarantine::GpuLost {
                reason: detail.clone(),
                device,
            },
        );
        let err = CleanupError::with_kind(CleanupErrorKind::GpuDeviceLost, token, detail);
        self.answer_job_early(key, err);
        if let Some(pool) = &self.config.gpu {
            // The slot is needed back: re-create the device now (one creator, with backoff).
            pool.recreate_in_background(device);
        }
    }

    /// A lost device was replaced (or given up for good): its quarantined slots, whose GPU work
    /// died with the old device, continue through the pipeline.
    #[cfg(feature = "gpu")]
    fn on_gpu_replaced(&mut self, myself: &ActorRef<SupMsg>, device: usize) {
        let keys: Vec<LeaseKey> = self
            .quarantine
            .iter()
            .filter(|(_, q)| matches!(q, Quarantine::GpuLost { device: d, .. } if *d == device))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let proven = self
                .table
                .get(key)
                .is_some_and(|r| r.exited && r.event_seen);
            if proven {
                self.quarantine.remove(&key);
                self.remove_scratch(myself, key);
            }
        }
    }

    fn on_release_request(
        &mut self,
        myself: &ActorRef<SupMsg>,
        key: LeaseKey,
        reply: Option<ReleaseReply>,
    ) {
        let Some(record) = self.table.get(key) else {
            // Already released (by an earlier call, or at shutdown): a no-op.
            if let Some(reply) = reply {
                let _ = reply.send(Ok(()));
            }
            return;
        };
        let (token, phase, kind) = (record.token, record.phase, record.kind);
        match (phase, kind) {
            (Phase::Granted, LeaseKind::Explicit) => {
                self.apply(key, Edge::ReleaseRequested);
                self.release_replies.entry(key).or_default().extend(reply);
                self.start_release(myself, key, token);
            }
            (Phase::Releasing, LeaseKind::Explicit) => {
                self.release_replies.entry(key).or_default().extend(reply);
            }
            _ => {
                if let Some(reply) = reply {
                    let _ = reply.send(Ok(()));
                }
            }
        }
    }

    /// Starts the broker release of `token` under the cleanup timeout. The timeout is the
    /// supervisor's own: no caller's cancellation reaches this task.
    fn start_release(&mut self, myself: &ActorRef<SupMsg>, key: LeaseKey, token: SlotToken) {
        self.stop_renewal(key);
        let started = Instant::now();
        let mut fut = Arc::clone(&self.broker).release_boxed(token);
        match poll_once(&mut fut) {
            Poll::Ready(result) => {
                let result = result.map_err(|e| CleanupError::broker(token, e));
                self.finish_release(key, result, started);
            }
            Poll::Pending => {
                let timeout = self.config.cleanup_timeout;
                let me = myself.clone();
                tokio::spawn(async move {
                    let result = match tokio::time::timeout(timeout, fut).await {
                        Ok(Ok(())) => Ok(()),
                        Ok(Err(e)) => Err(CleanupError::broker(token, e)),
                        Err(_) => Err(CleanupError::timeout(token, timeout)),
                    };
                    let _ = me.send_message(SupMsg::BrokerReleased {
                        key,
                        result,
                        started,
                    });
                });
            }
        }
    }

    fn finish_release(
        &mut self,
        key: LeaseKey,
        result: Result<(), CleanupError>,
        started: Instant,
    ) {
        let Some(record) = self.table.get(key) else {
            return;
        };
        let kind = record.kind;
        let outcome = match &result {
            Ok(()) => ReleaseOutcome::Ok,
            Err(e) if e.kind() == CleanupErrorKind::Timeout => ReleaseOutcome::TimedOut,
            Err(_) => ReleaseOutcome::Failed,
        };
        if !self.apply(key, Edge::Released(outcome)) {
            return;
        }
        metrics::histogram!(metric_names::RELEASE_DURATION_MS)
            .record(started.elapsed().as_secs_f64() * 1e3);
        metrics::counter!(metric_names::RELEASE_COUNT).increment(1);
        if result.is_err() {
            metrics::counter!(metric_names::RELEASE_FAILED_COUNT).increment(1);
        }
        self.stats.publish(&self.table, &mut self.published);
        match kind {
            LeaseKind::Job => {
                let job = self.jobs.remove(&key);
                #[cfg(feature = "gpu")]
                if let (Some(pool), Some(p)) =
                    (&self.config.gpu, job.as_ref().and_then(|j| j.placement))
                {
                    // The fence has passed: the sub-slot and its scratch may serve the next lease.
                    pool.free(p);
                }
                let job_id = job.as_ref().map(|j| j.job_id.to_string());
                let undelivered = match job.and_then(|mut j| j.reply.take()) {
                    Some(reply) => match reply.send(RunOutcome::Finished { cleanup: result }) {
                        Err(RunOutcome::Finished { cleanup: Err(err) }) => Some(err),
                        _ => None,
                    },
                    None => result.err(),
                };
                if let Some(err) = undelivered {
                    self.sink(job_id, err);
                }
            }
            LeaseKind::Explicit => {
                let replies = self.release_replies.remove(&key).unwrap_or_default();
                let mut heard = false;
                for reply in replies {
                    heard |= reply.send(result.clone()).is_ok();
                }
                if !heard && let Err(err) = result {
                    self.sink(None, err);
                }
            }
            LeaseKind::Surplus => {
                if let Err(err) = result {
                    self.sink(None, err);
                }
            }
        }
    }

    fn begin_shutdown(
        &mut self,
        myself: &ActorRef<SupMsg>,
        reply: Option<oneshot::Sender<ShutdownReport>>,
    ) {
        if !self.table.is_stopping() {
            for waiter in self.table.begin_stop() {
                if let Some(w) = self.waiters.remove(&waiter) {
                    self.report.refused_waiters += 1;
                    self.refuse(w.kind, AcquireError::Stopped);
                }
            }
            if self.table.pending() > 0 {
                // A broker acquire that never answers must not hold the shutdown forever.
                let me = myself.clone();
                let deadline = self.config.cleanup_timeout;
                tokio::spawn(async move {
                    tokio::time::sleep(deadline).await;
                    let _ = me.send_message(SupMsg::ShutdownDeadline);
                });
            }
            let held: Vec<_> = self
                .table
                .keys()
                .map(|(k, r)| (k, r.token, r.phase, r.kind))
                .collect();
            for (key, token, phase, kind) in held {
                match (phase, kind) {
                    (Phase::Granted, LeaseKind::Job) => {
                        if let Some(job) = self.jobs.get(&key) {
                            job.shared.cancel.cancel();
                            self.report.cancelled_jobs += 1;
                        }
                    }
                    (Phase::Granted, LeaseKind::Explicit) => {
                        // The holder's later release() or drop is then a no-op.
                        self.report.released_leases += 1;
                        self.apply(key, Edge::ReleaseRequested);
                        self.start_release(myself, key, token);
                    }
                    _ => {}
                }
            }
        }
        self.shutdown_replies.extend(reply);
    }

    fn maybe_finish_shutdown(&mut self, myself: &ActorRef<SupMsg>) {
        // Quarantined slots cannot be waited for (they may never be proven clean); they are
        // reported instead.
        let waiting_on_broker = self.table.pending() > 0 && !self.abandon_pending;
        if !self.table.is_stopping() || waiting_on_broker || self.table.active() > 0 {
            return;
        }
        #[cfg(feature = "gpu")]
        if let Some(pool) = &self.config.gpu
            && !self.gpu_closed
        {
            // Every lease has been released (so every fence has passed), but a quarantined one's
            // work may still run: wait for it and destroy the devices on the blocking pool, then
            // come back here.
            if !self.gpu_closing {
                self.gpu_closing = true;
                let (pool, me) = (Arc::clone(pool), myself.clone());
                tokio::task::spawn_blocking(move || {
                    pool.close();
                    let _ = me.send_message(SupMsg::GpuClosed);
                });
            }
            return;
        }
        self.report.quarantined = self.table.quarantined();
        self.report.stats = self.stats.snapshot();
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(self.report.clone());
        }
        self.stats.mark_shut_down();
        myself.stop(None);
    }

    /// Applies an edge; an illegal one is a bug, logged, and changes nothing.
    fn apply(&mut self, key: LeaseKey, edge: Edge) -> bool {
        match self.table.apply(key, edge) {
            Ok(_) => true,
            Err(illegal) => {
                tracing::error!(%illegal, key, "lease state machine refused an edge");
                debug_assert!(false, "{illegal}");
                false
            }
        }
    }

    /// A cleanup failure with no caller left: error sink, metric (counted by the caller of this),
    /// and a tracing error event.
    fn sink(&self, job_id: Option<String>, error: CleanupError) {
        let Some(token) = error.token() else { return };
        tracing::error!(job_id = job_id.as_deref(), %token, code = error.code(), %error, "cleanup failed with no caller left");
        if let Some(sink) = &self.config.error_sink {
            let failure = OrphanedFailure {
                job_id,
                token,
                error,
            };
            // A panicking sink must not take the supervisor (and every slot) down with it.
            if std::panic::catch_unwind(AssertUnwindSafe(|| sink(&failure))).is_err() {
                tracing::error!("the error sink panicked");
            }
        }
    }
}

/// Map capacity kept however empty a map gets.
const SHRINK_FLOOR: usize = 64;

fn reply_not_started(kind: WaiterKind, err: AcquireError) {
    match kind {
        WaiterKind::Lease { reply, .. } => {
            let _ = reply.send(Err(err));
        }
        WaiterKind::Job(job) => {
            let _ = job.reply.send(RunOutcome::NotStarted(err));
        }
    }
}

fn record_grant(span: &Span, since: Instant, token: SlotToken) {
    let waited_ms = since.elapsed().as_secs_f64() * 1e3;
    metrics::counter!(metric_names::ACQUIRE_COUNT).increment(1);
    metrics::histogram!(metric_names::ACQUIRE_DURATION_MS).record(waited_ms);
    let _e = span.enter();
    tracing::debug!(
        slot_id = token.slot_id(),
        lease_id = token.lease_id(),
        waited_ms,
        "slot granted"
    );
}

/// Releases a token that arrived after the supervisor stopped, under the cleanup timeout.
async fn release_orphan(broker: Arc<dyn DynBroker>, token: SlotToken, timeout: Duration) {
    match tokio::time::timeout(timeout, broker.release_boxed(token)).await {
        Ok(Ok(())) => {
            tracing::info!(%token, "released a token granted after the supervisor stopped")
        }
        Ok(Err(error)) => {
            tracing::error!(%token, %error, "could not release a token granted after the supervisor stopped")
        }
        Err(_) => {
            tracing::error!(%token, ?timeout, "release of a token granted after the supervisor stopped timed out")
        }
    }
}

/// Awaits the worker's physical end, outside the supervisor's mailbox: its actor task (the join
/// handle resolves only once the actor is fully gone, state dropped), then every task and
/// blocking closure spawned through its context, then (with a GPU) every submission made on its
/// device's queue before that point.
struct Driver {
    join: JoinHandle<()>,
    tracker: TaskTracker,
    sup: ActorRef<SupMsg>,
    key: LeaseKey,
    drain_timeout: Option<Duration>,
    #[cfg(feature = "gpu")]
    gpu: Option<(Arc<crate::gpu::GpuPool>, Arc<JobShared>)>,
}

impl Driver {
    async fn run(self) {
        let _ = self.join.await;
        let (tracker, sup, key) = (self.tracker, self.sup, self.key);
        tracker.close();
        match self.drain_timeout {
            Some(after) => {
                if tokio::time::timeout(after, tracker.wait()).await.is_err() {
                    let _ = sup.send_message(SupMsg::DrainTimedOut { key, after });
                    tracker.wait().await;
                }
            }
            None => tracker.wait().await,
        }
        #[cfg(feature = "gpu")]
        if let Some((pool, shared)) = &self.gpu
            && let Some(gpu) = shared.gpu()
        {
            use crate::gpu::FenceFailure;
            match pool.fence(&gpu).await {
                Ok(()) => {}
                Err(FenceFailure::Timeout {
                    after,
                    still_waiting,
                }) => {
                    let detail = format!(
                        "gpu work submitted under the lease had not completed {after:?} after the worker ended; the slot stays quarantined until it does"
                    );
                    let _ = sup.send_message(SupMsg::Unconfirmed { key, detail });
                    // The wait goes on: the slot is released as soon as the work completes.
                    let _ = still_waiting.await;
                }
                Err(FenceFailure::Lost { device, reason }) => shared.mark_gpu_lost(device, reason),
            }
        }
        let _ = sup.send_message(SupMsg::WorkerExited { key });
    }
}
