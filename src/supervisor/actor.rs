//! The supervisor actor: the effectful shell around the pure [`Core`].
//!
//! It turns each message into an [`Input`], applies it, and performs the [`Effect`]s the core
//! returns, in order. It keeps only what the core cannot hold (reply channels, bodies, task
//! handles, the process evidence to re-check, job ids) and decides nothing: it never reads the
//! core's state to choose what to do (`tests/behaviour/architecture.rs` checks that no file of
//! the shell does). Its turn awaits nothing: every call into code leasehold did not write goes
//! through `crate::outside` (a broker future gets one inline poll under `catch_unwind`, and
//! otherwise it runs in a caught, bounded task that reports back by message; the in-process pool
//! is not called here at all: the core owns it); temp dirs are made by the worker and removed
//! by a task of their own when the core asks; GPU fences run in the driver and the devices are
//! closed on a thread of their own; a job's driver task spawns its worker.
//!
//! This file is the shell itself: the actor's handlers, each message turned into an input, and
//! the dispatch of each effect to the room that performs it. The rooms own their state and
//! methods, one concern each, and hand back what the core must hear rather than reach into the
//! shell: [`brokerage`] (broker acquires, releases, renewals and the close), [`jobs`] (the
//! running jobs: a worker's start, the driver that reports its physical end, the temp dir's
//! removal), [`ending`] (shutdown's timers, the GPU close, the report, what is dropped at the
//! end) and [`rooms`] (reply channels and spans, the turn's answers, the publisher, the batch
//! clock); [`config`] holds the settings they share.

use std::mem;
use std::sync::Arc;
#[cfg(test)]
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tracing::Span;

use super::core::{
    Answer, ControlId, Core, CoreConfig, Effect, Holder, Input, LeaseKey, Proof, QuarantineEntry,
    RecheckFor, Rechecked, Reply, StopTally, WaiterId, Want,
};
use super::inbox::{Inbox, Ring};
use super::messages::{Control, PendingJob, RunOutcome, SupMsg, WaiterKind};
use super::reports::{EndDrop, LastReport, QuarantinedSlot, ReclaimReport, WaiterInfo};
use super::stats::SharedStats;
use super::table::LeaseTable;
use crate::broker::{BrokerEvent, SlotToken};
use crate::error::{AcquireError, CleanupError};
use crate::lease::{Lease, LeaseCell, ReleaseReply};
use crate::outside;

mod brokerage;
mod config;
mod ending;
mod jobs;
mod rooms;

pub(crate) use brokerage::BrokerPort;
use brokerage::Brokerage;
pub(crate) use config::Config;
use ending::EndState;
use jobs::{JobStart, Jobs};
use rooms::{
    Answers, BATCH_KEEP, BatchClock, ControlReply, Explicit, Grant, Kept, Outgoing, Publisher,
    Replies, Since, Waiter, take_from,
};

pub(crate) struct SupervisorActor;

pub(crate) struct SupArgs {
    /// The core's setup: capacity (the broker's, capped by the GPU pool's sub-slots), pool,
    /// renewals.
    pub(crate) core: CoreConfig,
    pub(crate) broker: BrokerPort,
    pub(crate) config: Arc<Config>,
    pub(crate) stats: Arc<SharedStats>,
    /// Where the shutdown's report is kept for a later `shutdown()` call.
    pub(crate) last_report: Arc<LastReport>,
    pub(crate) inbox: Arc<Inbox>,
    pub(crate) table: Arc<LeaseTable>,
    pub(crate) owned_root: Option<tempfile::TempDir>,
    /// Random per supervisor (see `AcquireRequest::origin`).
    pub(crate) origin: u64,
}

/// The supervisor actor's state: the pure core, and around it the shell's rooms, each with a
/// few fields and one job.
pub(crate) struct Shell {
    core: Core,
    inbox: Arc<Inbox>,
    myself: ActorRef<Ring>,
    config: Arc<Config>,
    /// Calls into the broker and what runs of them (see [`brokerage`]).
    brokerage: Brokerage,
    /// What only the shell can hold for waiters and explicit leases.
    kept: Kept,
    /// The running jobs: their workers, their ends, their temp dirs' removals.
    jobs: Jobs,
    /// The turn's answers, held until their effects show.
    answers: Answers,
    /// The lease table, `Stats`, the gauges and the counters, brought up to date before any
    /// answer leaves.
    publisher: Publisher,
    /// The batch's clock and its waiters' join times.
    batch_clock: BatchClock,
    /// What the end of the supervisor reports and keeps.
    end: EndState,
    /// The batch being handled (kept for its capacity).
    batch: Vec<SupMsg>,
    /// The most leases and waiters at once since the maps were last shrunk.
    peak: usize,
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
                let _ = inbox.send(SupMsg::Input(Input::DeviceReplaced { device, generation }));
            }));
        }
        if let Some(threshold) = args.config.held_warning {
            spawn_held_ticker(Arc::clone(&args.inbox), threshold);
        }
        // The in-process pool's releases happen in the core: their metrics come from its counts.
        let pool = matches!(args.broker, BrokerPort::Pool);
        let brokerage = Brokerage::new(
            args.broker,
            args.origin,
            Arc::clone(&args.inbox),
            args.config.cleanup_timeout,
        );
        let jobs = Jobs::new(
            Arc::clone(&args.inbox),
            Arc::clone(&args.config),
            myself.get_cell(),
        );
        Ok(Shell {
            core: Core::new(args.core),
            inbox: args.inbox,
            myself,
            config: args.config,
            brokerage,
            kept: Kept::default(),
            jobs,
            answers: Answers::default(),
            publisher: Publisher::new(args.stats, args.table, pool),
            batch_clock: BatchClock::new(),
            end: EndState::new(args.owned_root, args.last_report),
            batch: Vec::new(),
            peak: 0,
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
            crate::counters::poll();
            for msg in batch.drain(..) {
                state.on_message(msg);
            }
            // A flood's batch is large once; its memory is not kept for ever (the inbox swaps
            // this vector in as its queue at the next drain).
            if batch.capacity() > BATCH_KEEP {
                batch.shrink_to(BATCH_KEEP);
            }
            state.batch = batch;
            state.settle();
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
        #[cfg(test)]
        state
            .publisher
            .stats
            .supervision_events
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(test))]
        let _ = state;
        match evt {
            // A worker unlinks from the supervisor before it ends (its driver proves its end
            // from the join handle), so a worker's event reaches us only if it was killed while
            // linked: it carries no state, and proves nothing.
            SupervisionEvent::ActorTerminated(cell, last_state, _) => {
                drop(last_state);
                tracing::debug!(actor = %cell.get_id(), "a linked actor ended");
            }
            SupervisionEvent::ActorFailed(cell, err) => {
                tracing::error!(actor = %cell.get_id(), error = %err, "a linked actor failed");
            }
            _ => {}
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
    fn apply(&mut self, input: Input) {
        self.core.apply(input);
        self.perform_all();
    }

    /// Performs every effect queued; whether there was one.
    fn perform_all(&mut self) -> bool {
        let mut any = false;
        while let Some(effect) = self.core.pop_effect() {
            any = true;
            self.perform(effect);
        }
        any
    }

    /// After each batch: a shutdown that has nothing left to wait for ends, then stats, gauges
    /// and the lease table are brought up to date, and only then do this turn's callers hear.
    fn settle(&mut self) {
        loop {
            loop {
                self.core.settle();
                if !self.perform_all() {
                    break;
                }
            }
            self.publish();
            // Every freed slot has been handed on, and every effect is visible: the callers
            // hear. A lease whose caller has left meanwhile goes back to the core: once more.
            if !self.send_answers() {
                break;
            }
        }
        // Memory a flood left behind goes back once it has drained (nothing waits, nothing is
        // held): checked then, not after every batch.
        let load = self.kept.load() + self.jobs.running.len();
        self.peak = self.peak.max(load);
        if load == 0 && self.peak > SHRINK_AFTER {
            self.peak = 0;
            self.core.shrink_idle();
            self.kept.shrink();
            self.jobs.shrink();
            self.brokerage.shrink();
            self.answers.shrink();
            self.publisher.shrink();
            // A flood's first batch can bring tens of thousands of waiters at once.
            self.batch_clock.fresh.shrink_to(BATCH_KEEP);
            self.inbox.shrink();
        }
    }

    /// Brings everything a caller can read up to date: the lease table's touched rows, the
    /// figures `Stats` shows, the gauges and the acquire counter. Before every answer, so that
    /// a caller who has just been answered reads all of them with its effect included
    /// (invariant 11).
    fn publish(&mut self) {
        self.publisher
            .publish(&mut self.core, &self.kept, &self.jobs);
        #[cfg(test)]
        self.publisher.stats.shell_entries.store(
            (self.kept.load() + self.jobs.running.len() + self.brokerage.renewing()) as u64,
            Ordering::Relaxed,
        );
    }

    fn on_message(&mut self, msg: SupMsg) {
        let input = match msg {
            SupMsg::Acquire { waiter, kind, ask } => {
                debug_assert_eq!(
                    ask.want,
                    match kind {
                        WaiterKind::Lease { .. } => Want::Lease,
                        WaiterKind::Job(_) => Want::Job,
                    }
                );
                self.kept.arrive(
                    waiter,
                    Waiter {
                        kind,
                        since: Since::THIS_BATCH,
                    },
                );
                self.apply(Input::Enqueue { waiter, ask });
                // Still waiting: stamped with the batch's time when it ends.
                if let Some(waiter) = self.kept.settle_arrival() {
                    self.batch_clock.fresh.push(waiter);
                }
                return;
            }
            SupMsg::Control(control) => self.control_input(control),
            SupMsg::HeldTick => {
                self.report_held_too_long();
                return;
            }
            // What a job's end hands back is applied in this turn, its effects performed with
            // the batch's (the core settles first).
            SupMsg::Joined { key } => {
                if let Some(input) = self.jobs.worker_joined(key) {
                    self.core.apply(input);
                }
                return;
            }
            SupMsg::RemovalRang { key } => {
                if let Some(input) = self.jobs.poll_removal(key) {
                    self.core.apply(input);
                }
                return;
            }
            SupMsg::WorkerSpawned { key, result } => {
                return self.jobs.worker_spawned(key, result);
            }
            SupMsg::Withdraw { waiter, why } => Input::Withdraw { waiter, why },
            SupMsg::Release { key, reply } => {
                if let Some(reply) = reply {
                    match self.kept.explicit.get_mut(&key) {
                        Some(lease) => lease.replies.push(reply),
                        None => self.answers.late_replies.push((key, reply)),
                    }
                }
                Input::ReleaseRequested { key }
            }
            SupMsg::Shutdown { reply } => {
                self.answers.shutdown_replies.extend(reply);
                Input::Shutdown
            }
            SupMsg::Acquired { request, result } => {
                self.brokerage.acquire_ended(request);
                Input::Acquired { request, result }
            }
            SupMsg::Released {
                key,
                result,
                started,
            } => {
                let took = self.now().saturating_duration_since(started);
                self.record_release(took);
                Input::Released { key, result }
            }
            SupMsg::Broker(BrokerEvent::OrphanExpired { lease_id }) => {
                tracing::warn!(lease_id, "an orphaned lease expired at the broker");
                Input::OrphanExpired
            }
            SupMsg::Input(input) => input,
            SupMsg::ProcessStarted { key, process, pid } => {
                self.kept.pids.insert(process, pid);
                Input::ProcessStarted { key, process }
            }
            SupMsg::ProcessEnded {
                key,
                process,
                unproven,
            } => match unproven {
                None => {
                    self.kept.pids.remove(&process);
                    Input::ProvenOne {
                        key,
                        proof: Proof::Process(process),
                    }
                }
                Some(evidence) => {
                    let detail = evidence.reason().to_owned();
                    self.kept.evidence.insert((key, process), evidence);
                    Input::Unproven {
                        key,
                        proof: Proof::Process(process),
                        detail,
                    }
                }
            },
            SupMsg::GpuClosed { unclosed } => {
                self.end.gpu_closed(unclosed);
                Input::GpuClosed
            }
            SupMsg::BrokerClosed { failed } => {
                self.end.broker_closed(failed);
                Input::BrokerClosed
            }
        };
        self.apply(input);
    }

    /// A control call as an input; its reply channel is kept until the core answers.
    fn control_input(&mut self, control: Control) -> Input {
        match control {
            Control::Cancel { job_id, reply } => {
                // The shell's look-up of what it alone knows (job ids); the core decides.
                let mut waiters: Vec<WaiterId> = self
                    .kept
                    .waiters
                    .iter()
                    .filter(
                        |(_, w)| matches!(&w.kind, WaiterKind::Job(job) if *job.job_id == *job_id),
                    )
                    .map(|(id, _)| *id)
                    .collect();
                waiters.sort_unstable();
                let mut leases: Vec<LeaseKey> = self
                    .jobs
                    .running
                    .iter()
                    .filter(|(_, job)| *job.job_id == *job_id)
                    .map(|(key, _)| *key)
                    .collect();
                leases.sort_unstable();
                Input::CancelById {
                    control: self.answers.control(ControlReply::Cancel(reply)),
                    waiters: waiters.into(),
                    leases: leases.into(),
                }
            }
            Control::Resize { slots, reply } => Input::Resize {
                control: self.answers.control(ControlReply::Resize(reply)),
                slots,
            },
            Control::Quarantined { reply } => Input::ListQuarantine {
                control: self.answers.control(ControlReply::Quarantined(reply)),
            },
            Control::Reclaim { reply } => Input::Reclaim {
                control: self.answers.control(ControlReply::Reclaim(reply)),
            },
            Control::Waiters { reply } => Input::ListWaiters {
                control: self.answers.control(ControlReply::Waiters(reply)),
            },
        }
    }

    /// Performs one effect (none awaits: a job's start spawns its driver, which spawns the
    /// worker).
    fn perform(&mut self, effect: Effect) {
        match effect {
            Effect::Acquire {
                request,
                for_waiter,
            } => {
                let kept = &self.kept;
                let job_id = || {
                    for_waiter
                        .and_then(|w| kept.waiter(w))
                        .and_then(|w| match &w.kind {
                            WaiterKind::Job(job) => Some(Arc::clone(&job.job_id)),
                            WaiterKind::Lease { .. } => None,
                        })
                };
                if let Some(result) = self.brokerage.acquire(request, job_id) {
                    self.core.apply(Input::Acquired { request, result });
                }
            }
            Effect::AbortAcquire { request } => self.brokerage.abort_acquire(request),
            Effect::Deliver {
                waiter,
                key,
                token,
                more,
            } => self.deliver(waiter, key, token, more),
            Effect::Refuse { waiter, error } => self.refuse(waiter, error),
            Effect::StartRenewal { key, token } => self.brokerage.start_renewal(key, token),
            Effect::StopRenewal { key } => self.brokerage.stop_renewal(key),
            Effect::Cancel { key, holder, lost } => self.cancel(key, holder, lost),
            Effect::LostAfterExit { key, reason } => {
                tracing::warn!(%key, %reason, "lease lost after its worker ended; the slot is still held here until its release");
            }
            Effect::RecreateDevice { device } => {
                if let Some(input) = jobs::recreate_device(&self.config, device) {
                    self.core.apply(input);
                }
            }
            Effect::AbortTasks { key } => {
                if let Some(job) = self.jobs.running.get(&key) {
                    let n = job.shared.abort_tasks();
                    if n > 0 {
                        tracing::warn!(job_id = %job.job_id, tasks = n, "shutdown aborted tracked tasks still running");
                    }
                }
            }
            Effect::RemoveTempDir { key, dir } => {
                if let Some(input) = self.jobs.remove_temp_dir(key, dir) {
                    self.core.apply(input);
                }
            }
            Effect::Release { key, token } => {
                let clock = &mut self.batch_clock;
                if let Some(result) = self.brokerage.release(key, token, || clock.now()) {
                    // Answered inline, within this turn: no time passed that the batch clock
                    // could see.
                    self.record_release(Duration::ZERO);
                    self.core.apply(Input::Released { key, result });
                }
            }
            Effect::Answer { key, answer } => self.answer(key, answer),
            Effect::Sink { key, error } => {
                let job_id = self.jobs.running.get(&key).map(|j| j.job_id.to_string());
                self.sink(job_id, error);
            }
            Effect::Forget { key } => self.forget(key),
            Effect::Recheck {
                checks,
                leases,
                purpose,
            } => self.recheck(checks, leases, purpose),
            Effect::Reply { control, reply } => self.reply(control, reply),
            Effect::ArmShutdownTimers => ending::arm_shutdown_timers(
                &self.inbox,
                self.config.cancel_grace,
                self.config.shutdown_timeout,
            ),
            Effect::CloseGpu => {
                if !ending::close_gpu(&self.config, &self.inbox) {
                    self.core.apply(Input::GpuClosed);
                }
            }
            Effect::CloseBroker => {
                if !self.brokerage.close() {
                    self.core.apply(Input::BrokerClosed);
                }
            }
            Effect::Stopped {
                tally,
                quarantine,
                keep_work_root,
            } => self.stopped(tally, quarantine, keep_work_root),
            Effect::OrphanCounted => self.publisher.metrics.orphan_expired.increment(1),
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
    }

    fn deliver(
        &mut self,
        waiter: WaiterId,
        key: LeaseKey,
        token: SlotToken,
        more: Box<[SlotToken]>,
    ) {
        let Some(Waiter { kind, since }) = self.kept.take_waiter(waiter) else {
            tracing::error!(%waiter, "a grant for a waiter the shell does not know");
            return self.core.apply(Input::Undelivered { key });
        };
        match kind {
            WaiterKind::Lease {
                reply,
                span,
                holder,
            } => {
                if reply.is_closed() {
                    return self.core.apply(Input::Undelivered { key });
                }
                self.record_grant(span.get(), since, token, 1 + more.len());
                let cell = Arc::new(LeaseCell::new());
                self.kept.explicit.insert(
                    key,
                    Explicit {
                        cell: Arc::clone(&cell),
                        replies: Replies::new(),
                        holder: holder.map(|h| *h),
                    },
                );
                let home = Arc::clone(&self.inbox) as Arc<dyn crate::lease::LeaseReturn>;
                let lease = Lease::new(key.0, (token, more), home, cell);
                // Handed over with the turn's other answers, once the table, `Stats`, the
                // gauges and the counters show it.
                self.answers.grants.push(Grant { key, reply, lease });
            }
            WaiterKind::Job(job) => {
                // A grant racing with the caller's cancellation (the caller has left), or
                // reaching a job past its acquire timeout that nobody withdrew (its caller does
                // not watch the clock): refused, answered with the turn's other answers, and
                // the slot goes on.
                let refused = if job.shared.cancel.is_cancelled() || job.reply.is_closed() {
                    Some(AcquireError::Cancelled)
                } else {
                    job.deadline
                        .filter(|when| tokio::time::Instant::now() >= *when)
                        .map(|_| AcquireError::TimedOut {
                            after: self.config.acquire_timeout.unwrap_or_default(),
                        })
                };
                if let Some(error) = refused {
                    self.answers.outbox.push(Outgoing::Refused {
                        kind: WaiterKind::Job(job),
                        error,
                    });
                    return self.core.apply(Input::Undelivered { key });
                }
                self.record_grant(job.span.get(), since, token, 1 + more.len());
                let started = self.jobs.start(JobStart {
                    key,
                    token,
                    more,
                    job,
                });
                self.core.apply(started);
            }
        }
    }

    /// A caller that gets no slot hears why with this turn's other answers (see [`Outgoing`]).
    fn refuse(&mut self, waiter: WaiterId, error: AcquireError) {
        let Some(Waiter { kind, .. }) = self.kept.take_waiter(waiter) else {
            return;
        };
        let span = match &kind {
            WaiterKind::Lease { span, .. } => span.get(),
            WaiterKind::Job(job) => job.span.get(),
        };
        if let AcquireError::Failed(err) = &error {
            let _e = span.enter();
            tracing::warn!(error = %err, "slot acquire failed");
        }
        self.answers.outbox.push(Outgoing::Refused { kind, error });
    }

    fn cancel(&mut self, key: LeaseKey, holder: Holder, lost: Option<String>) {
        match holder {
            Holder::Job => {
                if let Some(job) = self.jobs.running.get(&key) {
                    if let Some(reason) = lost {
                        tracing::error!(job_id = %job.job_id, %reason, "lease lost: it could not be kept alive");
                        job.shared.mark_lease_lost(reason);
                    }
                    job.shared.cancel.cancel();
                }
            }
            Holder::Explicit => {
                if let Some(lease) = self.kept.explicit.get(&key) {
                    if let Some(reason) = &lost {
                        tracing::error!(%key, %reason, "lease lost: it could not be kept alive");
                    }
                    lease.cell.revoke(lost.is_some());
                }
            }
            Holder::Surplus => {}
        }
    }

    /// Answers the caller (sent once the turn has handed freed slots on: see [`Outgoing`]).
    fn answer(&mut self, key: LeaseKey, answer: Answer) {
        match answer {
            Answer::Job {
                unprepared,
                cleanup,
            } => {
                let Some(job) = self.jobs.running.get_mut(&key) else {
                    return;
                };
                let job_id = Arc::clone(&job.job_id);
                match job.reply.take() {
                    Some(reply) => self.answers.outbox.push(Outgoing::Job {
                        job_id,
                        reply,
                        outcome: RunOutcome::Finished {
                            unprepared,
                            cleanup,
                        },
                    }),
                    None => {
                        if let Err(err) = cleanup {
                            self.sink(Some(job_id.to_string()), err);
                        }
                    }
                }
            }
            Answer::Released(result) => {
                let mut replies = self
                    .kept
                    .explicit
                    .get_mut(&key)
                    .map(|lease| mem::take(&mut lease.replies))
                    .unwrap_or_default();
                if !self.answers.late_replies.is_empty() {
                    let (late, rest) = mem::take(&mut self.answers.late_replies)
                        .into_iter()
                        .partition(|(k, _)| *k == key);
                    self.answers.late_replies = rest;
                    replies.extend(late.into_iter().map(|(_, r): (LeaseKey, ReleaseReply)| r));
                }
                self.answers
                    .outbox
                    .push(Outgoing::Release { replies, result });
            }
        }
    }

    /// A control call's answer, in the public types (with what the shell alone knows: job ids).
    fn reply(&mut self, control: ControlId, reply: Reply) {
        let Some(to) = self.answers.controls.remove(&control) else {
            return;
        };
        let send: Box<dyn FnOnce() + Send> = match (to, reply) {
            (ControlReply::Cancel(tx), Reply::Cancelled(found)) => Box::new(move || {
                let _ = tx.send(found);
            }),
            (ControlReply::Resize(tx), Reply::Resized(result)) => Box::new(move || {
                let _ = tx.send(result);
            }),
            (ControlReply::Quarantined(tx), Reply::Quarantine(entries)) => {
                let list = self.describe(entries);
                Box::new(move || {
                    let _ = tx.send(list);
                })
            }
            (ControlReply::Waiters(tx), Reply::Waiters(entries)) => {
                let now = self.batch_clock.now_nanos();
                let list: Vec<WaiterInfo> = entries
                    .iter()
                    .map(|e| {
                        let waiter = self.kept.waiter(e.waiter);
                        WaiterInfo {
                            job_id: waiter.and_then(|w| match &w.kind {
                                WaiterKind::Job(job) => Some(Arc::clone(&job.job_id)),
                                WaiterKind::Lease { .. } => None,
                            }),
                            priority: e.priority,
                            slots: e.slots,
                            gathered: e.gathered,
                            waited: waiter.map_or(Duration::ZERO, |w| w.since.waited(now)),
                        }
                    })
                    .collect();
                Box::new(move || {
                    let _ = tx.send(list);
                })
            }
            (ControlReply::Reclaim(tx), Reply::Reclaimed { reclaimed, still }) => {
                let report = ReclaimReport {
                    reclaimed: reclaimed.into(),
                    still_quarantined: self.describe(still.into()),
                };
                Box::new(move || {
                    let _ = tx.send(report);
                })
            }
            (_, reply) => {
                tracing::error!(?reply, "a control answer of the wrong kind");
                return;
            }
        };
        self.answers.outbox.push(Outgoing::Control(send));
    }

    /// The core has stopped: every caller hears, then the shutdown's callers get the report,
    /// and the actor stops.
    fn stopped(
        &mut self,
        tally: StopTally,
        quarantine: Vec<QuarantineEntry>,
        keep_work_root: bool,
    ) {
        // The jobs' and leases' callers hear before the shutdown's caller does.
        self.publish();
        self.send_answers();
        let unproven = self.describe(quarantine);
        let stats = self.publisher.stats.snapshot();
        let report = self.end.report(tally, unproven, keep_work_root, stats);
        for reply in self.answers.shutdown_replies.drain(..) {
            let _ = reply.send(report.clone());
        }
        self.inbox.close();
        self.myself.stop(None);
    }

    /// Drops everything the actor still holds: queued mail, waiters, renewals, broker acquires,
    /// the broker. Idempotent. What leasehold did not write (the broker, the closures of jobs
    /// that never ran) and the work root's removal are dropped off the actor's task (see
    /// `EndDrops`): the actor's end never waits for them.
    fn stop_everything(&mut self) {
        // Answers of an unfinished turn still reach their callers.
        self.send_answers();
        let mut drops: Vec<EndDrop> = Vec::new();
        let queued = self.inbox.close_taking();
        if !queued.is_empty() {
            drops.push(("the jobs still in the inbox", ending::each(queued)));
        }
        self.brokerage.abort_all();
        // Waiters still queued hear SUPERVISOR_STOPPED when their reply senders drop (with
        // their jobs' closures, off this task): also one whose request was being applied when
        // the turn was cut short.
        self.kept.settle_arrival();
        if !self.kept.waiters.is_empty() {
            let waiters = self.kept.waiters.drain().map(|(_, w)| w);
            drops.push(("the jobs still queued", ending::each(waiters)));
        }
        if let Some(broker) = self.brokerage.take_foreign() {
            drops.push(("the broker", ending::each([broker])));
        }
        self.answers.controls.clear();
        // Nobody keeps the table up to date any more: what it still shows is what stays held,
        // the quarantined slots.
        self.publisher.table.retain_quarantined();
        let core = &mut self.core;
        self.end.dispose(drops, || core.abandon().keep_work_root);
    }

    /// The quarantined slots, as users see them.
    fn describe(&self, entries: Vec<QuarantineEntry>) -> Vec<QuarantinedSlot> {
        entries
            .into_iter()
            .map(|e| QuarantinedSlot {
                token: e.token,
                job_id: self.jobs.running.get(&e.key).map(|j| j.job_id.to_string()),
                reason: e.reason,
            })
            .collect()
    }

    /// Sends the answers of this turn. Called at the end of [`settle`](Self::settle), once every
    /// freed slot has gone to the next waiter (or back to the broker) and the stats and the
    /// lease table show every effect, and before a shutdown's report.
    pub(super) fn send_answers(&mut self) -> bool {
        let mut undelivered = false;
        // Grants first: the next waiter has its slot before the job that freed it is answered.
        // (A turn usually has answers of one kind only: the other list is not walked.)
        if !self.answers.grants.is_empty() {
            undelivered = self.send_grants();
        }
        if self.answers.outbox.is_empty() {
            return undelivered;
        }
        // Taken and put back: the vector keeps its capacity (no allocation per answer).
        let mut outbox = mem::take(&mut self.answers.outbox);
        for answer in outbox.drain(..) {
            crate::counters::poll();
            match answer {
                Outgoing::Job {
                    job_id,
                    reply,
                    outcome,
                } => {
                    if let Err(RunOutcome::Finished {
                        cleanup: Err(err), ..
                    }) = reply.send(outcome)
                    {
                        self.sink(Some(job_id.to_string()), err);
                    }
                }
                Outgoing::Release { replies, result } => {
                    // Every reply is sent to (no short circuit): each caller hears the answer.
                    let mut heard = false;
                    for reply in replies {
                        heard |= reply.send(result.clone()).is_ok();
                    }
                    if !heard && let Err(err) = result {
                        self.sink(None, err);
                    }
                }
                Outgoing::Refused { kind, error } => match kind {
                    WaiterKind::Lease { reply, .. } => {
                        let _ = reply.send(Err(error));
                    }
                    WaiterKind::Job(job) => {
                        let PendingJob { reply, body, .. } = *job;
                        let _ = reply.send(RunOutcome::NotGranted(Box::new(error)));
                        // The job's closure is the user's: never dropped in the supervisor's
                        // turn.
                        outside::dispose_off_turn(body);
                    }
                },
                Outgoing::Control(send) => send(),
            }
        }
        self.answers.outbox = outbox;
        undelivered
    }

    /// Hands over the explicit leases granted in this turn; whether a caller had left (its
    /// lease went back to the core).
    fn send_grants(&mut self) -> bool {
        let mut undelivered = false;
        let mut grants = mem::take(&mut self.answers.grants);
        for Grant { key, reply, lease } in grants.drain(..) {
            // Each answer wakes its caller: counted here, where it is sent, so that the
            // caller's future carries nothing for it.
            crate::counters::poll();
            if let Err(Ok(lease)) = reply.send(Ok(lease)) {
                // The caller left before the hand-over: nobody saw it. Its tokens go back in
                // hand (to the next waiter), in another pass of the turn.
                lease.defuse();
                self.kept.explicit.remove(&key);
                self.core.apply(Input::Undelivered { key });
                undelivered = true;
            }
        }
        self.answers.grants = grants;
        undelivered
    }

    fn forget(&mut self, key: LeaseKey) {
        if let Some(job) = take_from(&mut self.jobs.running, &key) {
            #[cfg(feature = "gpu")]
            if let (Some(gpu), Some(p)) = (&self.config.hosts.gpu, job.placement) {
                // Every proof is in (the fence among them): the sub-slot may serve again.
                gpu.free(p);
            }
            drop(job);
        }
        take_from(&mut self.kept.explicit, &key);
        self.brokerage.stop_renewal(key);
        if !self.kept.evidence.is_empty() {
            self.kept.evidence.retain(|(k, _), _| *k != key);
        }
    }

    /// Warns once about each lease held past the threshold, naming what it waits for.
    fn report_held_too_long(&mut self) {
        if let Some(threshold) = self.config.held_warning {
            self.publisher.report_held_too_long(threshold);
        }
    }

    /// Re-checks what the core asked for (non-blocking system calls, inline) and reports every
    /// outcome at once.
    fn recheck(
        &mut self,
        checks: Box<[(LeaseKey, Proof)]>,
        leases: Box<[LeaseKey]>,
        purpose: RecheckFor,
    ) {
        let results = checks
            .into_iter()
            .map(|(key, proof)| {
                // Only process groups keep evidence; the core refuses a re-check of anything else.
                let evidence = match proof {
                    Proof::Process(process) => self
                        .kept
                        .evidence
                        .get_mut(&(key, process))
                        .map(|evidence| (process, evidence)),
                    _ => None,
                };
                let outcome = match evidence {
                    Some((process, evidence)) => {
                        let outcome = evidence.recheck();
                        if outcome.is_ok() {
                            self.kept.evidence.remove(&(key, process));
                            self.kept.pids.remove(&process);
                        }
                        outcome
                    }
                    None => Err(format!("no evidence kept for {}", proof.describe())),
                };
                Rechecked {
                    key,
                    proof,
                    outcome,
                }
            })
            .collect();
        self.core.apply(Input::Rechecked {
            results,
            leases,
            purpose,
        });
    }

    /// The batch's time, read once per batch when first needed.
    fn now(&mut self) -> Instant {
        self.batch_clock.now()
    }

    /// A batch of messages has been handled: its waiters get its time.
    fn end_batch(&mut self) {
        self.batch_clock.end_batch(&mut self.kept.waiters);
    }

    fn record_grant(&mut self, span: &Span, since: Since, token: SlotToken, slots: usize) {
        let waited_ms = if since.is_this_batch() {
            0.0
        } else {
            since.waited(self.batch_clock.now_nanos()).as_secs_f64() * 1e3
        };
        // The count itself is published with `Stats::acquired_total` (one definition).
        self.publisher.metrics.acquire_ms.record(waited_ms);
        if tracing::enabled!(tracing::Level::DEBUG) {
            let _e = span.enter();
            tracing::debug!(
                slot_id = token.slot_id(),
                lease_id = token.lease_id(),
                slots,
                waited_ms,
                "slot granted"
            );
        }
    }

    /// A broker release's time (its count comes from the core's counters, at publication).
    fn record_release(&self, took: Duration) {
        self.publisher
            .metrics
            .release_ms
            .record(took.as_secs_f64() * 1e3);
    }

    /// A cleanup failure with no caller left: the error sink and a tracing error event.
    fn sink(&self, job_id: Option<String>, error: CleanupError) {
        self.config.sink.report(job_id, error);
    }
}

/// Rings the held-too-long check a few times per threshold, for as long as the supervisor lives.
fn spawn_held_ticker(inbox: Arc<Inbox>, threshold: Duration) {
    let period = (threshold / 4).max(Duration::from_millis(1));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            if inbox.send(SupMsg::HeldTick).is_err() {
                return;
            }
        }
    });
}

/// Inputs the core refused, ever (the simulation test demands none).
#[cfg(test)]
pub(crate) static ILLEGAL_INPUTS: AtomicU64 = AtomicU64::new(0);

#[cfg(test)]
mod since_tests {
    use super::*;

    #[test]
    fn a_waiters_join_time_measures_its_wait_from_the_batch_it_joined_in() {
        let ms = |n: u64| n * 1_000_000;
        let joined = Since::at(ms(5));
        assert_eq!(joined.waited(ms(7)), Duration::from_millis(2));
        // Joined at the epoch itself: still a time, not "this batch".
        assert_eq!(Since::at(0).waited(ms(7)), Duration::from_millis(7));
        assert_eq!(Since::THIS_BATCH.waited(ms(7)), Duration::ZERO);
        // A clock read before the join (never, with one monotonic clock): no wait, not a panic.
        assert_eq!(joined.waited(ms(3)), Duration::ZERO);
        // Past what 64 bits of nanoseconds hold: still a time.
        assert!(!Since::at(u64::MAX).is_this_batch());
    }
}
