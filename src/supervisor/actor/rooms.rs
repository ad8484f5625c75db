//! The shell's rooms: each holds a few fields and does one job. The handlers in `actor.rs`
//! move between them; none of them decides anything (the core does).

use std::mem;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::ActorId;
use rustc_hash::FxHashMap;
use tokio::sync::oneshot;

use super::jobs::Jobs;
use crate::error::{AcquireError, CleanupError};
use crate::lease::{Lease, LeaseCell, ReleaseReply};
use crate::process::Evidence;
use crate::supervisor::core::{
    ControlId, Core, LeaseKey, ProcessKey, WaiterId, shrink_map as shrink,
};
use crate::supervisor::messages::{RunOutcome, WaiterKind};
use crate::supervisor::reports::{QuarantinedSlot, ReclaimReport, ShutdownReport, WaiterInfo};
use crate::supervisor::stats::{Metrics, Published, SharedStats};
use crate::supervisor::table::{Extra, LeaseTable};

/// Takes `key` out of `map`, looking only when the map holds something: a lease's end clears
/// its entry from several maps, most of them empty on the hot path (no job runs beside an
/// explicit lease, the pool renews nothing).
pub(super) fn take_from<K: Eq + std::hash::Hash, V>(
    map: &mut FxHashMap<K, V>,
    key: &K,
) -> Option<V> {
    if map.is_empty() {
        return None;
    }
    map.remove(key)
}

/// The most slots the turn's vectors (the batch, the answers, the touched rows) keep between
/// drains.
pub(super) const BATCH_KEEP: usize = 64;

/// What the shell keeps that the core cannot hold, beside the running jobs (`Jobs`): the
/// callers' reply channels and spans, the explicit leases' cells, the process evidence to
/// re-check and the pids to show.
#[derive(Default)]
pub(super) struct Kept {
    /// The callers waiting for a grant, by id (see [`arriving`](Self::arriving) for the one
    /// whose request is being applied).
    pub(super) waiters: FxHashMap<WaiterId, Waiter>,
    /// The caller whose request is being applied, until its effects are performed: one served
    /// at once (the common case when slots are free) never enters `waiters`. Only
    /// [`Kept::arrive`], [`Kept::take_waiter`], [`Kept::waiter`] and [`Kept::settle_arrival`]
    /// touch it; it is empty between messages.
    arriving: Option<(WaiterId, Waiter)>,
    pub(super) explicit: FxHashMap<LeaseKey, Explicit>,
    pub(super) evidence: FxHashMap<(LeaseKey, ProcessKey), Box<dyn Evidence>>,
    /// Leader pid of each process group a live job started, by process key.
    pub(super) pids: FxHashMap<ProcessKey, u32>,
}

impl Kept {
    /// How many callers and explicit leases it holds (read between messages, when no caller
    /// is arriving).
    pub(super) fn load(&self) -> usize {
        self.waiters.len() + self.explicit.len()
    }

    /// Keeps a caller whose request is about to be applied (see [`arriving`](Self::arriving)).
    /// One request is applied at a time, and [`settle_arrival`](Self::settle_arrival) follows
    /// each: the slot is empty here.
    pub(super) fn arrive(&mut self, waiter: WaiterId, kept: Waiter) {
        debug_assert!(self.arriving.is_none(), "one request is applied at a time");
        self.arriving = Some((waiter, kept));
    }

    /// The request has been applied and its effects performed: a caller not served yet joins
    /// the others. Whether one did.
    pub(super) fn settle_arrival(&mut self) -> Option<WaiterId> {
        let (waiter, kept) = self.arriving.take()?;
        self.waiters.insert(waiter, kept);
        Some(waiter)
    }

    /// Takes a waiting caller out (it is served or refused).
    pub(super) fn take_waiter(&mut self, waiter: WaiterId) -> Option<Waiter> {
        match &self.arriving {
            Some((id, _)) if *id == waiter => self.arriving.take().map(|(_, kept)| kept),
            _ => self.waiters.remove(&waiter),
        }
    }

    /// A waiting caller.
    pub(super) fn waiter(&self, waiter: WaiterId) -> Option<&Waiter> {
        match &self.arriving {
            Some((id, kept)) if *id == waiter => Some(kept),
            _ => self.waiters.get(&waiter),
        }
    }

    pub(super) fn shrink(&mut self) {
        shrink(&mut self.waiters);
        shrink(&mut self.explicit);
        shrink(&mut self.evidence);
        shrink(&mut self.pids);
    }
}

/// The turn's answers, sent once every effect of the turn shows (invariant 11), and where the
/// control calls' answers go.
pub(super) struct Answers {
    /// Explicit leases handed over in this turn: sent first (the freed slot reaches the next
    /// waiter before the caller of the job that held it hears, DESIGN.md section 2).
    pub(super) grants: Vec<Grant>,
    pub(super) outbox: Vec<Outgoing>,
    pub(super) controls: FxHashMap<ControlId, ControlReply>,
    pub(super) next_control: ControlId,
    /// Replies to a `release` of a lease already gone (answered `Ok` by the core).
    pub(super) late_replies: Vec<(LeaseKey, ReleaseReply)>,
    pub(super) shutdown_replies: Vec<oneshot::Sender<ShutdownReport>>,
}

impl Default for Answers {
    fn default() -> Self {
        Self {
            grants: Vec::new(),
            outbox: Vec::new(),
            controls: FxHashMap::default(),
            next_control: ControlId(1),
            late_replies: Vec::new(),
            shutdown_replies: Vec::new(),
        }
    }
}

impl Answers {
    /// Keeps a control call's reply channel until the core answers it.
    pub(super) fn control(&mut self, reply: ControlReply) -> ControlId {
        let control = self.next_control.take();
        self.controls.insert(control, reply);
        control
    }

    pub(super) fn shrink(&mut self) {
        shrink(&mut self.controls);
        self.late_replies.shrink_to(BATCH_KEEP);
        self.grants.shrink_to(BATCH_KEEP);
        self.outbox.shrink_to(BATCH_KEEP);
    }
}

/// What a caller can read without a message: the lease table, `Stats`, the gauges and the
/// counters. The actor is their only writer; it brings them up to date before any answer
/// leaves.
pub(super) struct Publisher {
    pub(super) stats: Arc<SharedStats>,
    pub(super) published: Published,
    pub(super) metrics: Metrics,
    /// The live lease table (this actor is its only writer).
    pub(super) table: Arc<LeaseTable>,
    /// Leases whose row is brought up to date at the next publication (kept for its capacity,
    /// which it trades with the core's list at each publication).
    pub(super) touched: Vec<LeaseKey>,
}

impl Publisher {
    pub(super) fn new(stats: Arc<SharedStats>, table: Arc<LeaseTable>, pool: bool) -> Self {
        Self {
            stats,
            published: Published::default(),
            metrics: Metrics::register(pool),
            table,
            touched: Vec::new(),
        }
    }

    /// Brings the touched rows, the figures, the gauges and the acquire counter up to date.
    pub(super) fn publish(&mut self, core: &mut Core, kept: &Kept, jobs: &Jobs) {
        self.sync_table(core, kept, jobs);
        let figures = core.figures();
        self.stats.publish(figures, &mut self.published);
        self.metrics.publish(&figures);
    }

    /// Brings the rows of the leases the core touched since the last call up to date.
    fn sync_table(&mut self, core: &mut Core, kept: &Kept, jobs: &Jobs) {
        core.take_touched(&mut self.touched);
        if self.touched.is_empty() {
            return;
        }
        let mut touched = mem::take(&mut self.touched);
        // The clock is read once per publication, and only for a new row.
        let mut now = None;
        for key in touched.drain(..) {
            let lease = core.view(key);
            let extra = Extra {
                job_id: &|| jobs.running.get(&key).map(|j| Arc::clone(&j.job_id)),
                holder: &|| kept.explicit.get(&key).and_then(|e| e.holder),
                pid: &|p| kept.pids.get(&p).copied(),
            };
            self.table.update(key, lease, extra, || {
                *now.get_or_insert_with(tokio::time::Instant::now)
            });
        }
        self.touched = touched;
    }

    /// Warns once about each lease held past `threshold`, naming what it waits for.
    pub(super) fn report_held_too_long(&mut self, threshold: Duration) {
        for info in self
            .table
            .newly_held_too_long(threshold, tokio::time::Instant::now())
        {
            self.metrics.held_too_long.increment(1);
            let waiting_for = info
                .waiting_for
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            tracing::warn!(
                job_id = info.job_id.as_deref().unwrap_or("(explicit lease)"),
                slot_id = info.slot_id,
                held_ms = info.held_for.as_millis() as u64,
                phase = ?info.phase,
                waiting_for = %if waiting_for.is_empty() { "its holder".to_owned() } else { waiting_for },
                "a lease has been held too long"
            );
        }
    }

    pub(super) fn shrink(&mut self) {
        self.table.shrink();
        self.touched.shrink_to(BATCH_KEEP);
    }
}

/// The batch's clock, read at most once per batch and only when a wait or a release must be
/// measured across batches (an uncontended acquire and release read no clock at all), and the
/// join times of the waiters that came in the batch.
pub(super) struct BatchClock {
    pub(super) now: Option<Instant>,
    /// `now` as nanoseconds past `epoch`, worked out once per batch: a wait is then one
    /// subtraction of integers.
    nanos: Option<u64>,
    /// What waiters' join times are counted from (see [`Since`]).
    pub(super) epoch: Instant,
    /// Waiters that joined in this batch (stamped when it ends, if they still wait).
    pub(super) fresh: Vec<WaiterId>,
}

impl BatchClock {
    pub(super) fn new() -> Self {
        Self {
            now: None,
            nanos: None,
            epoch: Instant::now(),
            fresh: Vec::new(),
        }
    }

    /// The batch's time, read once per batch when first needed.
    pub(super) fn now(&mut self) -> Instant {
        *self.now.get_or_insert_with(Instant::now)
    }

    /// The batch's time as nanoseconds past the epoch (what [`Since`] counts in).
    pub(super) fn now_nanos(&mut self) -> u64 {
        if let Some(nanos) = self.nanos {
            return nanos;
        }
        let elapsed = self.now().saturating_duration_since(self.epoch).as_nanos();
        // Past 584 years: as far as 64 bits go (`Since::at` keeps it a time).
        let nanos = u64::try_from(elapsed).unwrap_or(u64::MAX);
        self.nanos = Some(nanos);
        nanos
    }

    /// A batch of messages has been handled: waiters that joined in it and still wait get its
    /// time (read only now, and only if there are any).
    pub(super) fn end_batch(&mut self, waiters: &mut FxHashMap<WaiterId, Waiter>) {
        if !self.fresh.is_empty() {
            let mut fresh = mem::take(&mut self.fresh);
            // Only callers still waiting are in `waiters`.
            if !waiters.is_empty() {
                let since = Since::at(self.now_nanos());
                for waiter in &fresh {
                    if let Some(w) = waiters.get_mut(waiter) {
                        w.since = since;
                    }
                }
            }
            fresh.clear();
            self.fresh = fresh;
        }
        self.now = None;
        self.nanos = None;
    }
}

pub(super) struct Waiter {
    /// Carries the caller's span.
    pub(super) kind: WaiterKind,
    pub(super) since: Since,
}

/// When a waiter joined the queue: 0 in the batch being handled (its clock not read yet: a
/// grant within the same batch waited no time), else the time read when its batch ended, as
/// nanoseconds past the shell's epoch, plus one. Eight bytes, held by every waiting caller.
#[derive(Clone, Copy)]
pub(super) struct Since(u64);

impl Since {
    pub(super) const THIS_BATCH: Self = Self(0);

    /// Joined in the batch being handled.
    pub(super) fn is_this_batch(self) -> bool {
        self.0 == 0
    }

    /// Joined at `nanos` past the shell's epoch.
    pub(super) fn at(nanos: u64) -> Self {
        Self(nanos.min(u64::MAX - 1) + 1)
    }

    /// How long before `now` (nanoseconds past the epoch) the waiter joined (zero within its
    /// batch).
    pub(super) fn waited(self, now: u64) -> Duration {
        match self.0 {
            0 => Duration::ZERO,
            n => Duration::from_nanos(now.saturating_sub(n - 1)),
        }
    }
}

/// An explicit lease handed over in this turn, held until its effects show.
pub(super) struct Grant {
    pub(super) key: LeaseKey,
    pub(super) reply: oneshot::Sender<Result<Lease, AcquireError>>,
    pub(super) lease: Lease,
}

/// An answer to a caller, held until the end of the turn: the pipeline hands the freed slot
/// to the next waiter (step 6) before the caller hears (step 7), and a control call is
/// answered only once `Stats` and the lease table show its effect (invariant 11).
pub(super) enum Outgoing {
    /// A job's `run`.
    Job {
        job_id: Arc<str>,
        reply: oneshot::Sender<RunOutcome>,
        outcome: RunOutcome,
    },
    /// The `release` calls of an explicit lease (none for a dropped one).
    Release {
        replies: Replies,
        result: Result<(), CleanupError>,
    },
    /// A caller that gets no slot.
    Refused {
        kind: WaiterKind,
        error: AcquireError,
    },
    /// A control call's answer.
    Control(Box<dyn FnOnce() + Send>),
}

/// What the shell keeps for an explicit lease.
/// The `release` calls waiting on one explicit lease: one inline, more on the heap.
pub(super) type Replies = smallvec::SmallVec<[ReleaseReply; 1]>;

pub(super) struct Explicit {
    /// Shared with the `Lease`: revoked by shutdown, or lost.
    pub(super) cell: Arc<LeaseCell>,
    /// `release` calls waiting for the broker's answer (usually one).
    pub(super) replies: Replies,
    /// The actor a lease desk lease is tied to.
    pub(super) holder: Option<ActorId>,
}

/// Where a control call's answer goes.
pub(super) enum ControlReply {
    Cancel(oneshot::Sender<bool>),
    Resize(oneshot::Sender<Result<u32, crate::error::ResizeError>>),
    Quarantined(oneshot::Sender<Vec<QuarantinedSlot>>),
    Waiters(oneshot::Sender<Vec<WaiterInfo>>),
    Reclaim(oneshot::Sender<ReclaimReport>),
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use rustc_hash::FxHashMap;
    use tokio::sync::oneshot;

    use crate::supervisor::actor::rooms::{BatchClock, Kept, Since, Waiter};
    use crate::supervisor::core::WaiterId;
    use crate::supervisor::messages::{KeptSpan, WaiterKind};

    fn waiter() -> Waiter {
        let (reply, _) = oneshot::channel();
        Waiter {
            kind: WaiterKind::Lease {
                reply,
                span: KeptSpan::new(tracing::Span::none()),
                holder: None,
            },
            since: Since::THIS_BATCH,
        }
    }

    #[test]
    fn a_caller_served_while_arriving_never_enters_the_map_and_one_still_waiting_does() {
        let mut kept = Kept::default();
        let (served, waiting) = (WaiterId(1), WaiterId(2));
        // Served within its own request's effects: found there, and gone after.
        kept.arrive(served, waiter());
        assert!(kept.waiter(served).is_some());
        assert!(kept.take_waiter(served).is_some());
        assert_eq!(kept.settle_arrival(), None);
        assert!(kept.waiters.is_empty());
        // Still waiting once its effects are performed: it joins the map, and is found there.
        kept.arrive(waiting, waiter());
        assert!(kept.waiter(served).is_none());
        assert_eq!(kept.settle_arrival(), Some(waiting));
        assert!(kept.waiters.contains_key(&waiting));
        assert!(kept.waiter(waiting).is_some());
        assert_eq!(kept.settle_arrival(), None);
        assert!(kept.take_waiter(waiting).is_some());
        assert!(kept.take_waiter(waiting).is_none());
        assert_eq!(kept.load(), 0);
    }

    #[test]
    fn a_batch_stamps_its_waiters_with_its_one_clock_read_and_the_next_batch_reads_again() {
        let ms = Duration::from_millis;
        let mut clock = BatchClock::new();
        let epoch = clock.epoch;
        let (w, gone) = (WaiterId(1), WaiterId(2));
        let mut waiters = FxHashMap::default();
        waiters.insert(w, waiter());
        // Both joined in this batch; `gone` was served within it (no longer waiting).
        clock.fresh.extend([w, gone]);
        clock.now = Some(epoch + ms(5));
        assert_eq!(clock.now_nanos(), 5_000_000);
        clock.end_batch(&mut waiters);
        assert!(clock.fresh.is_empty());
        let since = waiters[&w].since;
        assert!(!since.is_this_batch(), "stamped with its batch's time");
        // The next batch reads the clock anew: its waits are measured from the stamp.
        assert_eq!(clock.now, None);
        clock.now = Some(epoch + ms(12));
        assert_eq!(since.waited(clock.now_nanos()), ms(7));
        // And a batch that read no clock stamps nobody with a stale one.
        clock.end_batch(&mut waiters);
        assert_eq!(clock.now, None);
        clock.now = Some(epoch + ms(20));
        assert_eq!(clock.now_nanos(), 20_000_000);
    }
}
