//! The supervisor actor: the effectful shell around the pure [`Core`].
//!
//! It turns each message into an [`Input`], applies it, and performs the [`Effect`]s the core
//! returns, in order. It keeps only what the core cannot hold (reply channels, bodies, task
//! handles, the process evidence to re-check) and decides nothing. It never awaits a broker,
//! the file system or a GPU inside its mailbox: a broker future gets one inline poll (the
//! in-process broker is called directly) and otherwise runs in a task that reports back by
//! message; temp dirs are made by the worker and removed by the job's driver; GPU fences run in
//! the driver and the devices are closed on a thread of their own. The one await in a handler is
//! a worker actor's spawn, which returns once its `pre_start` (a move of its arguments) is done.

use std::mem;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

use ractor::{Actor, ActorId, ActorProcessingErr, ActorRef, SupervisionEvent};
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;
use tokio::task::{AbortHandle, JoinHandle};
use tokio_util::task::TaskTracker;
use tracing::Span;

use super::core::{
    Core, Effect, Holder, Input, LeaseKey, Proof, Proofs, RequestId, WaiterId, Want,
};
use super::hosts::Hosts;
use super::inbox::{Inbox, Ring};
use super::messages::{PendingJob, ReleaseReply, RunOutcome, SupMsg, WaiterKind};
use super::stats::{Metrics, Published, SharedStats};
use super::{QuarantinedSlot, ReclaimReport, Reporter, ShutdownReport, UnclosedDevice};
use crate::broker::{
    AcquireRequest, BrokerError, BrokerEvent, DynBroker, LocalBroker, SlotToken, poll_once,
};
use crate::error::{AcquireError, CleanupError};
use crate::lease::{Lease, LeaseCell};
use crate::process::{Evidence, ProcessPolicy};
use crate::sink::ErrorSink;
use crate::worker::{JobShared, WorkerActor, WorkerArgs};

/// Settings fixed at start.
pub(crate) struct Config {
    pub(crate) cleanup_timeout: Duration,
    pub(crate) cancel_grace: Duration,
    pub(crate) drain_timeout: Option<Duration>,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) work_root: Arc<PathBuf>,
    pub(crate) error_sink: Option<ErrorSink>,
    pub(crate) process_policy: ProcessPolicy,
    pub(crate) hosts: Hosts,
}

/// Where tokens come from. The in-process broker is called directly (no boxed future, no
/// poll); any other broker through its object-safe face.
#[derive(Clone)]
pub(crate) enum BrokerPort {
    Local(Arc<LocalBroker>),
    Dyn(Arc<dyn DynBroker>),
}

impl BrokerPort {
    pub(crate) fn capacity(&self) -> Option<u32> {
        match self {
            Self::Local(b) => Some(b.slots()),
            Self::Dyn(b) => b.capacity(),
        }
    }

    pub(crate) fn as_dyn(&self) -> Arc<dyn DynBroker> {
        match self {
            Self::Local(b) => Arc::clone(b) as Arc<dyn DynBroker>,
            Self::Dyn(b) => Arc::clone(b),
        }
    }
}

pub(crate) struct SupervisorActor;

pub(crate) struct SupArgs {
    /// The table's capacity: the broker's, capped by the GPU pool's sub-slots.
    pub(crate) capacity: Option<u32>,
    pub(crate) broker: BrokerPort,
    pub(crate) config: Arc<Config>,
    pub(crate) stats: Arc<SharedStats>,
    pub(crate) inbox: Arc<Inbox>,
    pub(crate) owned_root: Option<tempfile::TempDir>,
    /// Random per supervisor (see `AcquireRequest::origin`).
    pub(crate) origin: u64,
}

/// A job granted a slot, to start (its worker's spawn is awaited).
struct JobStart {
    key: LeaseKey,
    token: SlotToken,
    job: Box<PendingJob>,
}

struct Waiter {
    /// Carries the caller's span.
    kind: WaiterKind,
    since: Since,
}

/// When a waiter joined the queue: in the batch being handled (its clock not read yet: a grant
/// within the same batch waited no time), or at a time read when its batch ended.
#[derive(Clone, Copy)]
enum Since {
    ThisBatch,
    At(Instant),
}

/// What the shell keeps for a running job.
struct JobRt {
    job_id: Arc<str>,
    shared: Arc<JobShared>,
    /// Taken when the caller has been answered (at the end, or early on quarantine).
    reply: Option<oneshot::Sender<RunOutcome>>,
    /// Why the job could not start (its caller hears this, once the token is back).
    not_started: Option<AcquireError>,
    #[cfg(feature = "gpu")]
    placement: Option<crate::gpu::Placement>,
}

/// What the shell keeps for an explicit lease.
struct Explicit {
    /// Shared with the `Lease`: revoked by shutdown, or lost.
    cell: Arc<LeaseCell>,
    /// `release` calls waiting for the broker's answer (usually one).
    replies: Vec<ReleaseReply>,
}

pub(crate) struct Shell {
    core: Core,
    inbox: Arc<Inbox>,
    myself: ActorRef<Ring>,
    broker: BrokerPort,
    config: Arc<Config>,
    stats: Arc<SharedStats>,
    published: Published,
    waiters: FxHashMap<WaiterId, Waiter>,
    jobs: FxHashMap<LeaseKey, JobRt>,
    workers: FxHashMap<ActorId, LeaseKey>,
    explicit: FxHashMap<LeaseKey, Explicit>,
    /// Replies to a `release` of a lease already gone (answered `Ok` by the core).
    late_replies: Vec<(LeaseKey, ReleaseReply)>,
    metrics: Metrics,
    /// The batch's clock, read at most once per batch and only when a wait or a release must be
    /// measured across batches (an uncontended acquire and release read no clock at all).
    clock: Option<Instant>,
    /// Waiters that joined in this batch (stamped when it ends, if they still wait).
    fresh: Vec<WaiterId>,
    /// The most leases and waiters at once since the maps were last shrunk.
    peak: usize,
    renewals: FxHashMap<LeaseKey, AbortHandle>,
    acquires: FxHashMap<RequestId, AbortHandle>,
    evidence: FxHashMap<(LeaseKey, u64), Box<dyn Evidence>>,
    shutdown_replies: Vec<oneshot::Sender<ShutdownReport>>,
    /// GPU devices the shutdown could not prove idle.
    unclosed: Vec<UnclosedDevice>,
    reclaim_reply: Option<oneshot::Sender<ReclaimReport>>,
    owned_root: Option<tempfile::TempDir>,
    origin: u64,
    /// The batch being handled (kept for its capacity).
    batch: Vec<SupMsg>,
}

/// A flood this large (leases and waiters at once) is worth giving memory back after.
const SHRINK_AFTER: usize = 64;

/// At most this many drains of the inbox per doorbell; then the actor rings itself, so that
/// supervision events (worker ends) get their turn under a sustained load.
const DRAINS_PER_RING: usize = 4;

impl Actor for SupervisorActor {
    type Msg = Ring;
    type State = Shell;
    type Arguments = SupArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<Ring>,
        args: SupArgs,
    ) -> Result<Shell, ActorProcessingErr> {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = &args.config.hosts.gpu {
            let inbox = Arc::clone(&args.inbox);
            gpu.on_replaced(Box::new(move |device, generation| {
                let _ = inbox.send(SupMsg::DeviceReplaced { device, generation });
            }));
        }
        #[cfg(feature = "gpu")]
        let gpu = args.config.hosts.gpu.is_some();
        #[cfg(not(feature = "gpu"))]
        let gpu = false;
        Ok(Shell {
            core: match &args.broker {
                BrokerPort::Local(_) => Core::new(args.capacity, false, gpu).trusting_tokens(),
                BrokerPort::Dyn(b) => Core::new(args.capacity, b.renews(), gpu),
            },
            inbox: args.inbox,
            myself,
            broker: args.broker,
            config: args.config,
            stats: args.stats,
            published: Published::default(),
            waiters: FxHashMap::default(),
            jobs: FxHashMap::default(),
            workers: FxHashMap::default(),
            explicit: FxHashMap::default(),
            late_replies: Vec::new(),
            metrics: Metrics::register(),
            clock: None,
            fresh: Vec::new(),
            peak: 0,
            renewals: FxHashMap::default(),
            acquires: FxHashMap::default(),
            evidence: FxHashMap::default(),
            shutdown_replies: Vec::new(),
            unclosed: Vec::new(),
            reclaim_reply: None,
            owned_root: args.owned_root,
            origin: args.origin,
            batch: Vec::new(),
        })
    }

    async fn handle(
        &self,
        _myself: ActorRef<Ring>,
        _ring: Ring,
        state: &mut Shell,
    ) -> Result<(), ActorProcessingErr> {
        for _ in 0..DRAINS_PER_RING {
            let mut batch = mem::take(&mut state.batch);
            if !state.inbox.drain_into(&mut batch) {
                state.batch = batch;
                return Ok(());
            }
            for msg in batch.drain(..) {
                state.on_message(msg).await;
            }
            state.batch = batch;
            state.settle().await;
            state.end_batch();
        }
        // Mail may have arrived during the last drain; the doorbell is still marked rung.
        if !state.inbox.ring_again() {
            state.inbox.close();
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<Ring>,
        evt: SupervisionEvent,
        state: &mut Shell,
    ) -> Result<(), ActorProcessingErr> {
        let id = match evt {
            SupervisionEvent::ActorTerminated(cell, last_state, _) => {
                // On a normal stop ractor moves the worker's state into this event. It is dropped
                // here, before the event counts as a proof of the worker's physical end.
                drop(last_state);
                cell.get_id()
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                // Not expected (the worker catches its body's panics), and not proof of anything
                // on its own: ractor may deliver this before the worker's state is dropped, which
                // is why the join handle is a proof of its own.
                tracing::error!(error = %err, "worker actor failed");
                cell.get_id()
            }
            _ => return Ok(()),
        };
        if let Some(key) = state.workers.remove(&id) {
            state
                .apply(Input::ProvenOne {
                    key,
                    proof: Proof::EventHandled,
                })
                .await;
            state.settle().await;
            state.end_batch();
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<Ring>,
        state: &mut Shell,
    ) -> Result<(), ActorProcessingErr> {
        state.stop_everything();
        Ok(())
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        // Also reached when the runtime is dropped under a running supervisor (no `post_stop`):
        // everything queued or held is dropped with its reply senders, so no caller hangs.
        self.stop_everything();
    }
}

impl Shell {
    /// Applies one input and performs every effect it leads to.
    async fn apply(&mut self, input: Input) {
        self.core.apply(input);
        self.perform_all().await;
    }

    async fn perform_all(&mut self) {
        while let Some(effect) = self.core.pop_effect() {
            // Only a job's start awaits (its worker's spawn); every other effect is immediate.
            if let Some(start) = self.perform(effect) {
                // Boxed: the worker's spawn is a large future, and the rare one; every other
                // message's turn stays small.
                Box::pin(self.start_job(start)).await;
            }
        }
    }

    /// After each batch: the broker acquires the queue needs, stats and gauges, memory a flood
    /// left behind, the end of a shutdown.
    async fn settle(&mut self) {
        // Performing effects can free a slot (a job that could not start releases its token):
        // settle again until the core asks for nothing more.
        loop {
            self.core.settle();
            if !self.core.has_effects() {
                break;
            }
            self.perform_all().await;
        }
        self.publish();
        self.metrics.publish_gauges(&self.core);
        // Memory a flood left behind goes back once it has drained (nothing waits, nothing is
        // held): checked then, not after every batch.
        let load = self.core.waiting() + self.core.active();
        self.peak = self.peak.max(load);
        if load == 0 && self.peak > SHRINK_AFTER {
            self.peak = 0;
            self.core.shrink_idle();
            shrink(&mut self.waiters);
            shrink(&mut self.jobs);
            shrink(&mut self.workers);
            shrink(&mut self.explicit);
            shrink(&mut self.acquires);
            self.inbox.shrink();
        }
    }

    fn publish(&mut self) {
        self.stats.publish(&self.core, &mut self.published);
    }

    async fn on_message(&mut self, msg: SupMsg) {
        let input = match msg {
            SupMsg::Acquire { waiter, kind } => {
                let want = match kind {
                    WaiterKind::Lease { .. } => Want::Lease,
                    WaiterKind::Job(_) => Want::Job,
                };
                self.waiters.insert(
                    waiter,
                    Waiter {
                        kind,
                        since: Since::ThisBatch,
                    },
                );
                self.fresh.push(waiter);
                Input::Enqueue { waiter, want }
            }
            SupMsg::Withdraw { waiter, why } => Input::Withdraw { waiter, why },
            SupMsg::Release { key, reply } => {
                if let Some(reply) = reply {
                    match self.explicit.get_mut(&key) {
                        Some(lease) => lease.replies.push(reply),
                        None => self.late_replies.push((key, reply)),
                    }
                }
                Input::ReleaseRequested { key }
            }
            SupMsg::Shutdown { reply } => {
                self.shutdown_replies.extend(reply);
                if self.core.is_serving() {
                    // A shutdown first re-checks the quarantined slots, as a reclaim does: what
                    // can be proven clean now is released, the rest is reported.
                    self.apply(Input::ReclaimBegin).await;
                    self.apply(Input::ReclaimEnd).await;
                }
                Input::Shutdown
            }
            SupMsg::Quarantined { reply } => {
                let _ = reply.send(self.list_quarantine());
                return;
            }
            SupMsg::Reclaim { reply } => {
                self.reclaim_reply = Some(reply);
                // The core asks for each re-check (performed inline: non-blocking system
                // calls), then concludes.
                self.apply(Input::ReclaimBegin).await;
                Input::ReclaimEnd
            }
            SupMsg::Acquired { request, result } => {
                self.acquires.remove(&request);
                Input::Acquired { request, result }
            }
            SupMsg::Released {
                key,
                result,
                started,
            } => {
                let took = self.now().saturating_duration_since(started);
                self.record_release(took, &result);
                Input::Released { key, result }
            }
            SupMsg::LeaseLost { key, reason } => Input::LeaseLost { key, reason },
            SupMsg::Broker(BrokerEvent::OrphanExpired { lease_id }) => {
                tracing::warn!(lease_id, "an orphaned lease expired at the broker");
                Input::OrphanExpired
            }
            SupMsg::Proven { key, proofs } => Input::Proven { key, proofs },
            SupMsg::Late { key, proof, detail } => Input::Late { key, proof, detail },
            SupMsg::ProcessStarted { key, process } => Input::ProcessStarted { key, process },
            SupMsg::ProcessEnded {
                key,
                process,
                unproven,
            } => match unproven {
                None => Input::ProvenOne {
                    key,
                    proof: Proof::Process(process),
                },
                Some(evidence) => {
                    let detail = evidence.reason().to_owned();
                    self.evidence.insert((key, process), evidence);
                    Input::Unproven {
                        key,
                        proof: Proof::Process(process),
                        detail,
                    }
                }
            },
            SupMsg::ScratchRemoved { key, result } => match result {
                Ok(()) => Input::ProvenOne {
                    key,
                    proof: Proof::Scratch,
                },
                Err(error) => {
                    let path = self
                        .jobs
                        .get(&key)
                        .and_then(|j| j.shared.temp_dir().map(|p| p.display().to_string()))
                        .unwrap_or_default();
                    tracing::error!(%path, %error, "a job's temp dir could not be removed");
                    Input::ScratchFailed {
                        key,
                        detail: format!("temp dir {path} could not be removed"),
                        error,
                    }
                }
            },
            SupMsg::DeviceLost {
                key,
                device,
                generation,
                reason,
            } => Input::DeviceLost {
                key,
                device,
                generation,
                reason,
            },
            SupMsg::DeviceReplaced { device, generation } => {
                Input::DeviceReplaced { device, generation }
            }
            SupMsg::ShutdownGraceOver => Input::ShutdownGraceOver,
            SupMsg::ShutdownDeadline => Input::ShutdownDeadline,
            SupMsg::GpuClosed { unclosed } => {
                let unclosed = unclosed.unwrap_or_else(|| {
                    vec![(
                        usize::MAX,
                        "the devices' close did not end within its bound".into(),
                    )]
                });
                for (device, reason) in unclosed {
                    tracing::error!(device, %reason, "gpu device not proven idle at shutdown");
                    self.unclosed.push(UnclosedDevice::new(device, reason));
                }
                Input::GpuClosed
            }
        };
        self.apply(input).await;
    }

    /// Performs one effect; a job to start is handed back (its worker's spawn is awaited).
    fn perform(&mut self, effect: Effect) -> Option<JobStart> {
        match effect {
            Effect::Acquire {
                request,
                for_waiter,
            } => self.broker_acquire(request, for_waiter),
            Effect::AbortAcquires => {
                for (_, task) in self.acquires.drain() {
                    task.abort();
                }
            }
            Effect::Deliver { waiter, key, token } => return self.deliver(waiter, key, token),
            Effect::Refuse { waiter, error } => self.refuse(waiter, error),
            Effect::StartRenewal { key, token } => self.start_renewal(key, token),
            Effect::StopRenewal { key } => {
                if let Some(task) = self.renewals.remove(&key) {
                    task.abort();
                }
            }
            Effect::Cancel { key, holder, lost } => self.cancel(key, holder, lost),
            Effect::LostAfterExit { key, reason } => {
                tracing::warn!(key, %reason, "lease lost after its worker ended; the slot is still held here until its release");
            }
            Effect::RecreateDevice { device } => self.recreate_device(device),
            Effect::AbortTasks { key } => {
                if let Some(job) = self.jobs.get(&key) {
                    let n = job.shared.abort_tasks();
                    if n > 0 {
                        tracing::warn!(job_id = %job.job_id, tasks = n, "shutdown aborted tracked tasks still running after the cancel grace");
                    }
                }
            }
            Effect::RemoveScratch { key } => self.remove_scratch(key),
            Effect::Release { key, token } => self.broker_release(key, token),
            Effect::Answer { key, result } => self.answer(key, result),
            Effect::Sink { key, error } => {
                let job_id = self.jobs.get(&key).map(|j| j.job_id.to_string());
                self.sink(job_id, error);
            }
            Effect::Forget { key } => self.forget(key),
            Effect::Recheck { key, proof } => self.recheck(key, proof),
            Effect::Reclaimed { reclaimed, still } => {
                let report = ReclaimReport {
                    reclaimed,
                    still_quarantined: still.into_iter().filter_map(|k| self.describe(k)).collect(),
                };
                if let Some(reply) = self.reclaim_reply.take() {
                    let _ = reply.send(report);
                }
            }
            Effect::ArmShutdownTimers => self.arm_shutdown_timers(),
            Effect::CloseGpu => self.close_gpu(),
            Effect::Stopped => self.stopped(),
            Effect::OrphanCounted => self.metrics.orphan_expired.increment(1),
            Effect::TokenRefused(detail) => {
                tracing::error!(%detail, "refusing a token from the broker");
            }
            Effect::Illegal(detail) => {
                #[cfg(test)]
                ILLEGAL_INPUTS.fetch_add(1, Ordering::Relaxed);
                // A bug, never a reason to stop: the other slots keep serving.
                tracing::error!(%detail, "the supervisor's core refused an input");
            }
        }
        None
    }

    fn broker_acquire(&mut self, request: RequestId, for_waiter: Option<WaiterId>) {
        let job_id = for_waiter
            .and_then(|w| self.waiters.get(&w))
            .and_then(|w| match &w.kind {
                WaiterKind::Job(job) => Some(Arc::clone(&job.job_id)),
                WaiterKind::Lease { .. } => None,
            });
        let result = match &self.broker {
            // Answers at once (the core asks only while a slot is free).
            BrokerPort::Local(local) => local.take(),
            BrokerPort::Dyn(broker) => {
                let req = AcquireRequest::for_job(request, job_id).with_origin(self.origin);
                let mut fut = Arc::clone(broker).acquire_boxed(req);
                match poll_once(&mut fut) {
                    Poll::Ready(result) => result,
                    Poll::Pending => {
                        let inbox = Arc::clone(&self.inbox);
                        let broker = Arc::clone(broker);
                        let timeout = self.config.cleanup_timeout;
                        let task = tokio::spawn(async move {
                            let result = fut.await;
                            if let Err(SupMsg::Acquired {
                                result: Ok(token), ..
                            }) = inbox.send(SupMsg::Acquired { request, result })
                            {
                                // The supervisor stopped while this acquire was in flight:
                                // nobody can hold the token, so it goes straight back, once.
                                release_orphan(broker, token, timeout).await;
                            }
                        });
                        self.acquires.insert(request, task.abort_handle());
                        return;
                    }
                }
            }
        };
        self.core.apply(Input::Acquired { request, result });
    }

    fn deliver(&mut self, waiter: WaiterId, key: LeaseKey, token: SlotToken) -> Option<JobStart> {
        let Some(Waiter { kind, since }) = self.waiters.remove(&waiter) else {
            tracing::error!(waiter, "a grant for a waiter the shell does not know");
            self.core.apply(Input::Undelivered { key });
            return None;
        };
        match kind {
            WaiterKind::Lease { reply, span } => {
                if reply.is_closed() {
                    self.core.apply(Input::Undelivered { key });
                    return None;
                }
                self.record_grant(&span, since, token);
                let cell = Arc::new(LeaseCell::new());
                self.explicit.insert(
                    key,
                    Explicit {
                        cell: Arc::clone(&cell),
                        replies: Vec::new(),
                    },
                );
                self.publish();
                let lease = Lease::new(key, token, Arc::clone(&self.inbox), cell);
                if let Err(Ok(lease)) = reply.send(Ok(lease)) {
                    // The caller left between the check and the send: nobody saw it.
                    lease.defuse();
                    self.explicit.remove(&key);
                    self.core.apply(Input::Undelivered { key });
                }
                None
            }
            WaiterKind::Job(job) => {
                // A grant racing with the caller's cancellation goes to the next waiter.
                if job.shared.cancel.is_cancelled() || job.reply.is_closed() {
                    let _ = job
                        .reply
                        .send(RunOutcome::NotStarted(AcquireError::Cancelled));
                    self.core.apply(Input::Undelivered { key });
                    return None;
                }
                self.record_grant(&job.span, since, token);
                Some(JobStart { key, token, job })
            }
        }
    }

    async fn start_job(&mut self, start: JobStart) {
        let JobStart { key, token, job } = start;
        let PendingJob {
            job_id,
            shared,
            body,
            reply,
            span,
        } = *job;
        span.record("slot_id", token.slot_id());
        span.record("lease_id", token.lease_id());
        #[cfg(feature = "gpu")]
        let placement = match &self.config.hosts.gpu {
            Some(gpu) => match gpu.place() {
                Some(p) => Some(p),
                None => {
                    let err = crate::gpu::GpuError::CreateFailed("no usable gpu slot".into());
                    return self.not_started(key, job_id, shared, reply, AcquireError::Gpu(err));
                }
            },
            None => None,
        };
        let tracker = TaskTracker::new();
        let reporter = Reporter {
            inbox: Arc::clone(&self.inbox),
            key,
        };
        let args = WorkerArgs {
            body,
            token,
            job_id: Arc::clone(&job_id),
            work_root: Arc::clone(&self.config.work_root),
            shared: Arc::clone(&shared),
            tracker: tracker.clone(),
            span,
            policy: self.config.process_policy,
            grace: self.config.cancel_grace,
            hosts: self.config.hosts.clone(),
            reporter: reporter.clone(),
            #[cfg(feature = "gpu")]
            gpu: placement,
        };
        match Actor::spawn_linked(None, WorkerActor, args, self.myself.get_cell()).await {
            Ok((worker, join)) => {
                self.workers.insert(worker.get_id(), key);
                self.jobs.insert(
                    key,
                    JobRt {
                        job_id,
                        shared: Arc::clone(&shared),
                        reply: Some(reply),
                        not_started: None,
                        #[cfg(feature = "gpu")]
                        placement,
                    },
                );
                let driver = Driver {
                    join,
                    tracker,
                    shared,
                    reporter,
                    drain_timeout: self.config.drain_timeout,
                    #[cfg(feature = "gpu")]
                    gpu: self.config.hosts.gpu.clone(),
                    #[cfg(feature = "gpu")]
                    placement,
                };
                tokio::spawn(driver.run());
                #[cfg(feature = "gpu")]
                let device = placement.map(|p| p.device);
                #[cfg(not(feature = "gpu"))]
                let device = None;
                self.core.apply(Input::Started { key, device });
            }
            Err(err) => {
                // The worker's pre_start only moves its arguments, so the body never ran.
                tracing::error!(error = %err, "could not spawn the worker actor");
                #[cfg(feature = "gpu")]
                if let (Some(gpu), Some(p)) = (&self.config.hosts.gpu, placement) {
                    gpu.free(p);
                }
                let err = BrokerError::new(format!("worker spawn failed: {err}"));
                self.not_started(key, job_id, shared, reply, AcquireError::Failed(err));
            }
        }
    }

    /// A job that could not start: its token goes back, then its caller hears why.
    fn not_started(
        &mut self,
        key: LeaseKey,
        job_id: Arc<str>,
        shared: Arc<JobShared>,
        reply: oneshot::Sender<RunOutcome>,
        error: AcquireError,
    ) {
        self.jobs.insert(
            key,
            JobRt {
                job_id,
                shared,
                reply: Some(reply),
                not_started: Some(error),
                #[cfg(feature = "gpu")]
                placement: None,
            },
        );
        self.core.apply(Input::NotStarted { key });
    }

    fn refuse(&mut self, waiter: WaiterId, error: AcquireError) {
        let Some(Waiter { kind, .. }) = self.waiters.remove(&waiter) else {
            return;
        };
        self.publish();
        match kind {
            WaiterKind::Lease { reply, span } => {
                if let AcquireError::Failed(err) = &error {
                    let _e = span.enter();
                    tracing::warn!(error = %err, "slot acquire failed");
                }
                let _ = reply.send(Err(error));
            }
            WaiterKind::Job(job) => {
                let error = match error {
                    // A failure that races the job's cancellation: the job was cancelled.
                    AcquireError::Failed(_) if job.shared.cancel.is_cancelled() => {
                        AcquireError::Cancelled
                    }
                    other => other,
                };
                if let AcquireError::Failed(err) = &error {
                    let _e = job.span.enter();
                    tracing::warn!(error = %err, "slot acquire failed");
                }
                let _ = job.reply.send(RunOutcome::NotStarted(error));
            }
        }
    }

    /// Keeps the lease alive while it is held, when the broker needs that.
    fn start_renewal(&mut self, key: LeaseKey, token: SlotToken) {
        let lost = self.broker.as_dyn().keep_alive_boxed(token);
        let inbox = Arc::clone(&self.inbox);
        let task = tokio::spawn(async move {
            let err = lost.await;
            // Judged by the core: renewal may have been stopped since.
            let _ = inbox.send(SupMsg::LeaseLost {
                key,
                reason: err.to_string(),
            });
        });
        self.renewals.insert(key, task.abort_handle());
    }

    fn cancel(&mut self, key: LeaseKey, holder: Holder, lost: Option<String>) {
        match holder {
            Holder::Job => {
                if let Some(job) = self.jobs.get(&key) {
                    if let Some(reason) = lost {
                        tracing::error!(job_id = %job.job_id, %reason, "lease lost: it could not be kept alive");
                        job.shared.mark_lease_lost(reason);
                    }
                    job.shared.cancel.cancel();
                }
            }
            Holder::Explicit => {
                if let Some(lease) = self.explicit.get(&key) {
                    if let Some(reason) = &lost {
                        tracing::error!(key, %reason, "lease lost: it could not be kept alive");
                    }
                    lease.cell.revoke(lost.is_some());
                }
            }
            Holder::Surplus => {}
        }
    }

    #[cfg_attr(not(feature = "gpu"), allow(unused_variables))]
    fn recreate_device(&mut self, device: usize) {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = &self.config.hosts.gpu {
            if gpu.settled(device) {
                // Replaced (or given up) before the loss reached the core.
                let generation = gpu.generation(device);
                self.core
                    .apply(Input::DeviceReplaced { device, generation });
            } else {
                gpu.recreate(device);
            }
        }
    }

    fn remove_scratch(&mut self, key: LeaseKey) {
        let Some(job) = self.jobs.get(&key) else {
            return;
        };
        let Some(path) = job.shared.temp_dir().map(PathBuf::from) else {
            // The worker made no temp dir (it could not): nothing to remove.
            return self.core.apply(Input::ProvenOne {
                key,
                proof: Proof::Scratch,
            });
        };
        // Started exactly when the core says, in a task of its own: never in the mailbox.
        let removal = remove_scratch(
            Arc::clone(&self.config.hosts.scratch),
            path,
            self.config.cleanup_timeout,
            Reporter {
                inbox: Arc::clone(&self.inbox),
                key,
            },
        );
        tokio::spawn(removal);
    }

    /// Releases `token` under the cleanup timeout, which is the supervisor's own: no caller's
    /// cancellation reaches it.
    fn broker_release(&mut self, key: LeaseKey, token: SlotToken) {
        let result = match &self.broker {
            BrokerPort::Local(local) => local.give(token),
            BrokerPort::Dyn(broker) => {
                let mut fut = Arc::clone(broker).release_boxed(token);
                match poll_once(&mut fut) {
                    Poll::Ready(result) => result,
                    Poll::Pending => {
                        let (timeout, started) = (self.config.cleanup_timeout, self.now());
                        let inbox = Arc::clone(&self.inbox);
                        tokio::spawn(async move {
                            let result = match tokio::time::timeout(timeout, fut).await {
                                Ok(Ok(())) => Ok(()),
                                Ok(Err(e)) => Err(CleanupError::broker(token, e)),
                                Err(_) => Err(CleanupError::timeout(token, timeout)),
                            };
                            let _ = inbox.send(SupMsg::Released {
                                key,
                                result,
                                started,
                            });
                        });
                        return;
                    }
                }
            }
        };
        // Answered inline, within this turn: no time passed that the batch clock could see.
        let result = result.map_err(|e| CleanupError::broker(token, e));
        self.record_release(Duration::ZERO, &result);
        self.core.apply(Input::Released { key, result });
    }

    fn answer(&mut self, key: LeaseKey, result: Result<(), CleanupError>) {
        self.publish();
        if let Some(job) = self.jobs.get_mut(&key) {
            let job_id = Arc::clone(&job.job_id);
            let undelivered = match (job.reply.take(), job.not_started.take()) {
                // The caller hears why its job did not start; a failed release of the token it
                // never used has nobody else to go to.
                (Some(reply), Some(why)) => {
                    let _ = reply.send(RunOutcome::NotStarted(why));
                    result.err()
                }
                (Some(reply), None) => match reply.send(RunOutcome::Finished { cleanup: result }) {
                    Err(RunOutcome::Finished { cleanup: Err(err) }) => Some(err),
                    _ => None,
                },
                (None, _) => result.err(),
            };
            if let Some(err) = undelivered {
                self.sink(Some(job_id.to_string()), err);
            }
            return;
        }
        let mut replies = self
            .explicit
            .get_mut(&key)
            .map(|lease| mem::take(&mut lease.replies))
            .unwrap_or_default();
        if !self.late_replies.is_empty() {
            let (late, rest) = mem::take(&mut self.late_replies)
                .into_iter()
                .partition(|(k, _)| *k == key);
            self.late_replies = rest;
            replies.extend(late.into_iter().map(|(_, r): (LeaseKey, ReleaseReply)| r));
        }
        // Every reply is sent to (no short circuit): each caller hears the answer.
        let mut heard = false;
        for reply in replies {
            heard |= reply.send(result.clone()).is_ok();
        }
        if !heard && let Err(err) = result {
            self.sink(None, err);
        }
    }

    fn forget(&mut self, key: LeaseKey) {
        if let Some(job) = self.jobs.remove(&key) {
            #[cfg(feature = "gpu")]
            if let (Some(gpu), Some(p)) = (&self.config.hosts.gpu, job.placement) {
                // Every proof is in (the fence among them): the sub-slot may serve again.
                gpu.free(p);
            }
            drop(job);
        }
        self.explicit.remove(&key);
        if let Some(task) = self.renewals.remove(&key) {
            task.abort();
        }
        self.evidence.retain(|(k, _), _| *k != key);
    }

    fn recheck(&mut self, key: LeaseKey, proof: Proof) {
        let Proof::Process(process) = proof else {
            return;
        };
        let Some(evidence) = self.evidence.get_mut(&(key, process)) else {
            return;
        };
        match evidence.recheck() {
            None => {
                self.evidence.remove(&(key, process));
                self.core.apply(Input::ProvenOne { key, proof });
            }
            Some(detail) => self.core.apply(Input::Unproven { key, proof, detail }),
        }
    }

    fn arm_shutdown_timers(&mut self) {
        let inbox = Arc::clone(&self.inbox);
        let (grace, bound) = (self.config.cancel_grace, self.config.shutdown_timeout);
        tokio::spawn(async move {
            let start = tokio::time::Instant::now();
            if grace < bound {
                tokio::time::sleep(grace).await;
                if inbox.send(SupMsg::ShutdownGraceOver).is_err() {
                    return;
                }
            }
            tokio::time::sleep_until(start + bound).await;
            let _ = inbox.send(SupMsg::ShutdownDeadline);
        });
    }

    fn close_gpu(&mut self) {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = &self.config.hosts.gpu {
            let bound = self.config.cleanup_timeout;
            let (closing, inbox) = (gpu.close(bound), Arc::clone(&self.inbox));
            tokio::spawn(async move {
                // The close bounds itself; this bound is for a close that would not.
                let unclosed = tokio::time::timeout(bound + bound / 10, closing).await.ok();
                let _ = inbox.send(SupMsg::GpuClosed { unclosed });
            });
            return;
        }
        self.core.apply(Input::GpuClosed);
    }

    fn stopped(&mut self) {
        let tally = self.core.stop_tally();
        let unproven = self.list_quarantine();
        self.publish();
        let report = ShutdownReport {
            refused_waiters: tally.refused_waiters,
            cancelled_jobs: tally.cancelled_jobs,
            released_leases: tally.released_leases,
            quarantined: self.core.quarantined(),
            unproven,
            unclosed_devices: mem::take(&mut self.unclosed),
            stats: self.stats.snapshot(),
        };
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(report.clone());
        }
        self.stats.mark_shut_down();
        self.inbox.close();
        self.myself.stop(None);
    }

    /// Drops everything the actor still holds: queued mail, waiters, renewals, broker acquires.
    /// Idempotent.
    fn stop_everything(&mut self) {
        self.inbox.close();
        for (_, task) in self.renewals.drain() {
            task.abort();
        }
        for (_, task) in self.acquires.drain() {
            task.abort();
        }
        // Waiters still queued hear SUPERVISOR_STOPPED when their reply senders drop.
        self.waiters.clear();
        if let Some(root) = self.owned_root.take()
            && self.core.quarantined() > 0
        {
            // Quarantined temp dirs are evidence: keep them.
            let kept = root.keep();
            tracing::warn!(root = %kept.display(), "work root kept: it holds quarantined temp dirs");
        }
    }

    fn describe(&self, key: LeaseKey) -> Option<QuarantinedSlot> {
        let lease = self.core.lease(key)?;
        Some(QuarantinedSlot {
            token: lease.token(),
            job_id: self.jobs.get(&key).map(|j| j.job_id.to_string()),
            reason: lease
                .reasons()
                .iter()
                .map(|r| r.detail.as_str())
                .collect::<Vec<_>>()
                .join("; "),
        })
    }

    fn list_quarantine(&self) -> Vec<QuarantinedSlot> {
        let mut keys: Vec<LeaseKey> = self
            .core
            .leases()
            .filter(|(_, l)| l.phase() == super::core::Phase::Quarantined)
            .map(|(k, _)| k)
            .collect();
        keys.sort_unstable();
        let mut out: Vec<_> = keys.into_iter().filter_map(|k| self.describe(k)).collect();
        out.sort_by_key(|q| q.token.lease_id());
        out
    }

    /// The batch's time, read once per batch when first needed.
    fn now(&mut self) -> Instant {
        *self.clock.get_or_insert_with(Instant::now)
    }

    /// A batch of messages has been handled: waiters that joined in it and still wait get its
    /// time (read only now, and only if there are any).
    fn end_batch(&mut self) {
        if !self.fresh.is_empty() {
            if self.core.waiting() > 0 {
                let now = self.now();
                for waiter in self.fresh.drain(..) {
                    if let Some(w) = self.waiters.get_mut(&waiter) {
                        w.since = Since::At(now);
                    }
                }
            }
            self.fresh.clear();
        }
        self.clock = None;
    }

    fn record_grant(&mut self, span: &Span, since: Since, token: SlotToken) {
        let waited_ms = match since {
            Since::ThisBatch => 0.0,
            Since::At(t) => self.now().saturating_duration_since(t).as_secs_f64() * 1e3,
        };
        self.metrics.acquire_count.increment(1);
        self.metrics.acquire_ms.record(waited_ms);
        if tracing::enabled!(tracing::Level::DEBUG) {
            let _e = span.enter();
            tracing::debug!(
                slot_id = token.slot_id(),
                lease_id = token.lease_id(),
                waited_ms,
                "slot granted"
            );
        }
    }

    fn record_release(&self, took: Duration, result: &Result<(), CleanupError>) {
        self.metrics.release_ms.record(took.as_secs_f64() * 1e3);
        self.metrics.release_count.increment(1);
        if result.is_err() {
            self.metrics.release_failed.increment(1);
        }
    }

    /// A cleanup failure with no caller left: the error sink and a tracing error event.
    fn sink(&self, job_id: Option<String>, error: CleanupError) {
        crate::sink::report_orphaned(self.config.error_sink.as_ref(), job_id, error);
    }
}

fn shrink<K: Eq + std::hash::Hash, V>(map: &mut FxHashMap<K, V>) {
    super::core::shrink_map(map);
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

/// Inputs the core refused, ever (the simulation test demands none).
#[cfg(test)]
pub(crate) static ILLEGAL_INPUTS: AtomicU64 = AtomicU64::new(0);

/// Process keys are unique in the process (any supervisor).
static NEXT_PROCESS: AtomicU64 = AtomicU64::new(1);

impl Reporter {
    fn send(&self, msg: SupMsg) {
        // A supervisor that is gone no longer waits for this.
        let _ = self.inbox.send(msg);
    }

    /// A job started a process group: its slot now waits for it too.
    pub(crate) fn process_started(&self) -> u64 {
        let process = NEXT_PROCESS.fetch_add(1, Ordering::Relaxed);
        self.send(SupMsg::ProcessStarted {
            key: self.key,
            process,
        });
        process
    }

    /// A process group's keeper ended.
    pub(crate) fn process_ended(&self, process: u64, unproven: Option<Box<dyn Evidence>>) {
        self.send(SupMsg::ProcessEnded {
            key: self.key,
            process,
            unproven,
        });
    }
}

/// Removes a temp dir (off the mailbox) and reports; past `bound` the slot is quarantined
/// until the removal ends.
async fn remove_scratch(
    host: Arc<dyn super::hosts::ScratchHost>,
    path: PathBuf,
    bound: Duration,
    reporter: Reporter,
) {
    let mut removal = host.remove(path);
    let result = match tokio::time::timeout(bound, &mut removal).await {
        Ok(result) => result,
        Err(_) => {
            reporter.send(SupMsg::Late {
                key: reporter.key,
                proof: Proof::Scratch,
                detail: format!("the temp dir was not removed within {bound:?}"),
            });
            removal.await
        }
    };
    reporter.send(SupMsg::ScratchRemoved {
        key: reporter.key,
        result,
    });
}

/// Awaits a job's physical end, outside the supervisor's mailbox, and reports each proof as
/// it comes: the worker's actor task (its join handle resolves only once the actor is fully
/// gone, state dropped), every task and blocking closure spawned through its context (process
/// keepers included), and (with a GPU) every submission made under the lease. It decides
/// nothing: what follows from the proofs is the core's.
struct Driver {
    join: JoinHandle<()>,
    tracker: TaskTracker,
    shared: Arc<JobShared>,
    reporter: Reporter,
    drain_timeout: Option<Duration>,
    #[cfg(feature = "gpu")]
    gpu: Option<Arc<dyn super::hosts::GpuHost>>,
    #[cfg(feature = "gpu")]
    placement: Option<crate::gpu::Placement>,
}

impl Driver {
    async fn run(self) {
        let key = self.reporter.key;
        let _ = self.join.await;
        let tracker = self.tracker;
        tracker.close();
        let mut proofs = Proofs::JOINED;
        if !tracker.is_empty() {
            // Tell the supervisor the body has ended; the tasks are waited for.
            self.reporter.send(SupMsg::Proven { key, proofs });
            proofs = Proofs::default();
            if let Some(after) = self.drain_timeout
                && tokio::time::timeout(after, tracker.wait()).await.is_err()
            {
                self.reporter.send(SupMsg::Late {
                    key,
                    proof: Proof::TasksJoined,
                    detail: format!(
                        "tasks spawned through the worker context were still running {after:?} after the worker ended"
                    ),
                });
            }
            tracker.wait().await;
        }
        self.shared.close();
        proofs = proofs.with(Proofs::TASKS);
        #[cfg(feature = "gpu")]
        if let (Some(gpu), Some(placement)) = (&self.gpu, self.placement) {
            use super::hosts::Fence;
            let job = self.shared.take_gpu();
            let mut fence = gpu.fence(placement, job).await;
            if let Fence::Late { detail, rest } = fence {
                self.reporter.send(SupMsg::Proven { key, proofs });
                proofs = Proofs::default();
                self.reporter.send(SupMsg::Late {
                    key,
                    proof: Proof::GpuFence,
                    detail,
                });
                fence = rest.await;
            }
            match fence {
                Fence::Done | Fence::Late { .. } => proofs = proofs.with(Proofs::GPU),
                Fence::Lost {
                    device,
                    generation,
                    reason,
                } => {
                    if !proofs.is_empty() {
                        self.reporter.send(SupMsg::Proven { key, proofs });
                        proofs = Proofs::default();
                    }
                    self.reporter.send(SupMsg::DeviceLost {
                        key,
                        device,
                        generation,
                        reason,
                    });
                }
            }
        }
        if !proofs.is_empty() {
            self.reporter.send(SupMsg::Proven { key, proofs });
        }
    }
}
