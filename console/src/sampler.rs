//! The sampler: ten times a second it reads the supervisor's synchronous snapshots
//! ([`Supervisor::leases`] and [`Supervisor::stats`], neither of which sends the actor a
//! message), updates the timeline and the observed outcomes, and publishes one JSON frame that
//! every open event stream and the snapshot route serve as it is. One sampler per console,
//! whatever the number of browsers.
//!
//! The quarantine reasons and the waiting callers are what the snapshots do not carry: a
//! separate poller asks [`Supervisor::quarantined`] and [`Supervisor::waiters`] (each a message
//! to the actor) at most once per [`QUARANTINE_POLL_INTERVAL`](super::QUARANTINE_POLL_INTERVAL),
//! and only while a slot is quarantined, or a caller waits. It runs apart from the sampler so
//! that a busy actor never delays a frame.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::charts::Charts;
use super::outcomes::{Ended, Outcome, Outcomes, RECENT, Timings};
use super::timeline::{Held, Segment, Timeline};
use super::{MAX_LANES, QUARANTINE_POLL_INTERVAL, SAMPLE_INTERVAL, TIMELINE_WINDOW};
use leasehold::{
    GpuDeviceState, LeaseInfo, LeaseKind, LeasePhase, Priority, QuarantinedSlot, Stats, Supervisor,
    WaiterInfo, WaitingFor,
};

/// The quarantine reasons last heard from the supervisor, by lease id.
pub(crate) type Reasons = Arc<Mutex<HashMap<u64, QuarantinedSlot>>>;

/// The waiting callers last heard from the supervisor, in the order they are served, and when
/// they were asked for.
pub(crate) type Waiters = Arc<Mutex<Listing>>;

/// One answer of [`Supervisor::waiters`].
#[derive(Debug, Default)]
pub(crate) struct Listing {
    /// When it was asked for: a caller granted a slot since is not waiting any more, though
    /// the listing still has it.
    pub(crate) asked: Option<Instant>,
    /// The callers, in the order they are served.
    pub(crate) rows: Vec<WaiterInfo>,
}

impl Listing {
    /// The listed callers that still wait as far as `leases` (a snapshot taken just before
    /// `now`) shows: the listing is about a second old, the lease table is not, and a job whose
    /// lease started after the listing was asked for holds its slot now, whatever the listing
    /// says. (A job of the same id that held its slot before the listing was asked for is
    /// another caller: it stays listed.)
    pub(crate) fn still_waiting<'a>(
        &'a self,
        leases: &[LeaseInfo],
        now: Instant,
    ) -> impl Iterator<Item = &'a WaiterInfo> + 'a {
        let asked = self.asked;
        let granted: HashSet<Arc<str>> = leases
            .iter()
            .filter(|l| {
                // Its start as seen from `now`, which is after the snapshot: never too early.
                asked.is_some_and(|asked| now.checked_sub(l.held_for).is_some_and(|s| s >= asked))
            })
            .filter_map(|l| l.job_id.clone())
            .collect();
        self.rows
            .iter()
            .filter(move |w| w.job_id.as_ref().is_none_or(|job| !granted.contains(job)))
    }
}

/// The label of an explicit lease's lane and timeline segment (its holder has no job id).
const EXPLICIT: &str = "explicit lease";

/// How many of the waiting callers each frame lists (the first served); `/api/queue` has the
/// rest, with a search.
pub(crate) const QUEUE_ROWS: usize = 8;

/// How far back the charts go, in seconds.
const CHARTS_WINDOW_S: u64 = 300;

/// How many job ids the sampler remembers from the queue listing (for their wait), at most.
const WAITED_KEPT: usize = 4096;

/// A lease as the previous sample saw it.
struct Seen {
    job_id: Option<Arc<str>>,
    slot: u32,
    phase: LeasePhase,
    held: std::time::Duration,
    /// Its phases and proofs as sampled so far.
    timings: Timings,
    /// What its release still waited for at the previous sample.
    pending: Vec<WaitingFor>,
}

pub(crate) struct Sampler {
    sup: Supervisor,
    t0: Instant,
    actions: bool,
    /// The console listens beyond loopback: the page warns.
    exposed: bool,
    timeline: Timeline,
    outcomes: Outcomes,
    reasons: Reasons,
    waiters: Waiters,
    seen: HashMap<u64, Seen>,
    /// The wait of job ids the queue listing showed, until their lease is seen.
    waited: HashMap<Arc<str>, u64>,
    /// Per second, the last minutes (`/api/timeline` carries them).
    charts: Charts,
    explicit: Arc<str>,
}

impl Sampler {
    pub(crate) fn new(
        sup: Supervisor,
        t0: Instant,
        (actions, exposed): (bool, bool),
        outcomes: Outcomes,
        (reasons, waiters): (Reasons, Waiters),
    ) -> Self {
        Self {
            sup,
            t0,
            actions,
            exposed,
            timeline: Timeline::new(TIMELINE_WINDOW.as_millis() as u64),
            outcomes,
            reasons,
            waiters,
            seen: HashMap::new(),
            waited: HashMap::new(),
            charts: Charts::new(CHARTS_WINDOW_S),
            explicit: Arc::from(EXPLICIT),
        }
    }

    /// Takes one sample and returns the frame, as JSON.
    pub(crate) fn sample(&mut self) -> String {
        let now = Instant::now();
        let now_ms = now.saturating_duration_since(self.t0).as_millis() as u64;
        let stats = self.sup.stats();
        let leases = self.sup.leases();
        // After the snapshot: a lease's start seen from here is never earlier than its grant.
        let taken = Instant::now();
        self.charts.queue(now_ms, stats.waiting);

        // The waits the queue listing shows, for the job ids whose lease is not seen yet.
        for w in self.waiters.lock().rows.iter() {
            if let Some(job) = &w.job_id
                && (self.waited.len() < WAITED_KEPT || self.waited.contains_key(job))
            {
                self.waited
                    .insert(Arc::clone(job), w.waited.as_millis() as u64);
            }
        }

        // Observed ends: a job's lease in the previous sample and not in this one.
        let current: HashMap<u64, &LeaseInfo> = leases.iter().map(|l| (lease_id(l), l)).collect();
        let mut carried: HashMap<u64, Seen> = HashMap::new();
        for (id, was) in std::mem::take(&mut self.seen) {
            if current.contains_key(&id) {
                carried.insert(id, was);
                continue;
            }
            if let Some(job_id) = was.job_id {
                let mut timings = was.timings;
                // What it still waited for at the last sample was done by now.
                for still in &was.pending {
                    timings.proofs.push((still.to_string(), now_ms));
                }
                timings.ended_ms = now_ms;
                let drained = timings
                    .draining_ms
                    .map(|d| timings.releasing_ms.unwrap_or(now_ms).saturating_sub(d));
                self.charts.ended(now_ms, drained);
                self.outcomes.log().observed(
                    Ended {
                        job_id,
                        slot: was.slot,
                        held: was.held,
                        last_phase: phase_name(was.phase),
                        timings,
                    },
                    now,
                );
            }
        }
        for l in &leases {
            let id = lease_id(l);
            let mut timings = match carried.remove(&id) {
                Some(was) => {
                    let mut timings = was.timings;
                    for done in was.pending.iter().filter(|w| !l.waiting_for.contains(w)) {
                        timings.proofs.push((done.to_string(), now_ms));
                    }
                    timings
                }
                None => {
                    let waited_ms = l.job_id.as_ref().and_then(|j| self.waited.remove(j));
                    self.charts.started(now_ms, waited_ms);
                    Timings {
                        started_ms: now_ms.saturating_sub(l.held_for.as_millis() as u64),
                        waited_ms,
                        kind: kind_name(l.kind),
                        gpu_device: l.gpu_device,
                        lease_id: id,
                        ..Timings::default()
                    }
                }
            };
            match l.phase {
                LeasePhase::Draining | LeasePhase::Quarantined => {
                    timings.draining_ms.get_or_insert(now_ms);
                }
                LeasePhase::Releasing => {
                    timings.draining_ms.get_or_insert(now_ms);
                    timings.releasing_ms.get_or_insert(now_ms);
                }
                _ => {}
            }
            self.seen.insert(
                id,
                Seen {
                    job_id: l.job_id.clone(),
                    slot: l.slot_id,
                    phase: l.phase,
                    held: l.held_for,
                    timings,
                    pending: l.waiting_for.clone(),
                },
            );
        }

        let held: Vec<Held> = leases
            .iter()
            .flat_map(|l| {
                let holder = l
                    .job_id
                    .clone()
                    .unwrap_or_else(|| Arc::clone(&self.explicit));
                let color = color(l);
                slots_of(l).map(move |slot| Held {
                    slot,
                    color,
                    holder: Arc::clone(&holder),
                })
            })
            .collect();
        self.timeline.sample(now_ms, &held);

        let meta = Meta {
            now_ms,
            actions: self.actions,
            exposed: self.exposed,
            resizable: self.sup.can_resize(),
            history: self.outcomes.log().version(),
            gpu: gpu_views(&self.sup, &leases),
        };
        let reasons = self.reasons.lock().clone();
        let recent = self.outcomes.log().recent(RECENT);
        // What the poller last heard, while someone still waits, less the callers this frame's
        // lanes show holding a slot (read under its lock, not copied: the frame takes only the
        // first rows and the count).
        let listed = self.waiters.lock();
        let waiters: Vec<&WaiterInfo> = if stats.waiting > 0 {
            listed.still_waiting(&leases, taken).collect()
        } else {
            Vec::new()
        };
        let frame = build_frame(
            meta,
            (&stats, &leases),
            (&reasons, &waiters),
            &self.timeline,
            recent,
        );
        drop(listed);
        serde_json::to_string(&frame).expect("a frame always serializes")
    }

    /// The per-slot timeline of the last minute and the charts of the last five, as JSON
    /// (`/api/timeline`: the page asks for it about once a second, so that the frames stay
    /// small).
    pub(crate) fn timeline_json(&mut self) -> String {
        let now_ms = Instant::now()
            .saturating_duration_since(self.t0)
            .as_millis() as u64;
        let view = TimelineView {
            now_ms,
            charts: self.charts.view(now_ms),
            window_ms: self.timeline.window_ms(),
            lanes: self
                .timeline
                .slots()
                .map(|slot| TimelineLane {
                    slot,
                    segments: self.timeline.segments(slot).collect(),
                })
                .collect(),
        };
        serde_json::to_string(&view).expect("a timeline always serializes")
    }
}

fn lease_id(l: &LeaseInfo) -> u64 {
    l.tokens.first().map_or(0, |t| t.lease_id())
}

/// Every slot a lease holds (the first one alone when it lists no tokens).
fn slots_of(l: &LeaseInfo) -> impl Iterator<Item = u32> + '_ {
    let first = l.tokens.is_empty().then_some(l.slot_id);
    first
        .into_iter()
        .chain(l.tokens.iter().map(|t| t.slot_id()))
}

fn phase_name(phase: LeasePhase) -> &'static str {
    match phase {
        LeasePhase::Running => "running",
        LeasePhase::Draining => "draining",
        LeasePhase::Releasing => "releasing",
        LeasePhase::Quarantined => "quarantined",
        // A phase a later leasehold adds, before this console knows its name.
        _ => "other",
    }
}

/// The colour class, as in render_farm's timeline.png: run (steel blue); draining while GPU
/// work is owed (dark orange); draining otherwise (amber); the broker release (green); and
/// quarantined (red, which timeline.png has no use for).
fn color(l: &LeaseInfo) -> &'static str {
    match l.phase {
        LeasePhase::Running => "run",
        LeasePhase::Draining if l.waiting_for.contains(&WaitingFor::GpuFence) => "drain-gpu",
        LeasePhase::Draining => "drain",
        LeasePhase::Releasing => "release",
        LeasePhase::Quarantined => "quarantined",
        _ => "other",
    }
}

/// `job`, `explicit`, or the lowercase name of a holder kind added later.
fn kind_name(kind: LeaseKind) -> String {
    format!("{kind:?}").to_lowercase()
}

#[derive(Serialize)]
struct Frame {
    now_ms: u64,
    actions: bool,
    /// Listening beyond loopback (the page shows a warning).
    exposed: bool,
    stats: StatsView,
    queue: QueueView,
    lanes: Vec<Lane>,
    quarantined: Vec<QuarantineRow>,
    /// The newest job ends (the history: `/api/history`).
    outcomes: Vec<Outcome>,
    /// Changes whenever the history does: the page asks `/api/history` again then.
    history: u64,
    /// The supervisor's GPU devices (none without GPU slots).
    gpu: Vec<GpuView>,
    /// Whether `resize` can work here (the in-process pool): the page offers it only then.
    resizable: bool,
}

/// A GPU device: its sub-slots in use, the leases whose release waits for its fence now, and
/// how often it was lost and re-created (or replaced by the engine).
#[derive(Serialize)]
struct GpuView {
    index: usize,
    adapter: String,
    backend: String,
    adopted: bool,
    sub_slots: u32,
    in_use: u32,
    fence_waits: usize,
    recreated: u64,
    lost: Option<String>,
    given_up: bool,
}

#[derive(Serialize)]
struct StatsView {
    capacity: Option<usize>,
    held_slots: usize,
    active: usize,
    draining: usize,
    waiting: usize,
    quarantined: usize,
    acquired_total: u64,
    released_total: u64,
    release_failed_total: u64,
    orphan_expired_total: u64,
}

impl From<&Stats> for StatsView {
    fn from(s: &Stats) -> Self {
        Self {
            capacity: s.capacity,
            held_slots: s.held_slots,
            active: s.active,
            draining: s.draining,
            waiting: s.waiting,
            quarantined: s.quarantined,
            acquired_total: s.acquired_total,
            released_total: s.released_total,
            release_failed_total: s.release_failed_total,
            orphan_expired_total: s.orphan_expired_total,
        }
    }
}

/// The queue: `Stats::waiting`, and the first callers as [`Supervisor::waiters`] last listed
/// them (`listed`: a list was heard since the queue last emptied; `/api/queue` has them all).
#[derive(Serialize)]
struct QueueView {
    waiting: usize,
    listed: bool,
    /// How many callers the last listing had.
    listed_count: usize,
    waiters: Vec<WaiterView>,
}

#[derive(Serialize)]
pub(crate) struct WaiterView {
    #[serde(serialize_with = "super::json::opt_arc_str")]
    job_id: Option<Arc<str>>,
    priority: &'static str,
    slots: u32,
    gathered: u32,
    waited_ms: u64,
}

impl From<&WaiterInfo> for WaiterView {
    fn from(w: &WaiterInfo) -> Self {
        Self {
            job_id: w.job_id.clone(),
            priority: priority_name(w.priority),
            slots: w.slots,
            gathered: w.gathered,
            waited_ms: w.waited.as_millis() as u64,
        }
    }
}

/// The waiting callers of the last listing that still wait (`leases`, a snapshot taken just
/// before `now`, shows none of them granted since) whose job id contains `search`, in the
/// order they are served, at most `limit`; and how many still wait of those listed.
pub(crate) fn search_waiters(
    waiters: &Waiters,
    (leases, now): (&[LeaseInfo], Instant),
    search: &str,
    limit: usize,
) -> (Vec<WaiterView>, usize) {
    let listing = waiters.lock();
    let waiting: Vec<&WaiterInfo> = listing.still_waiting(leases, now).collect();
    let found = waiting
        .iter()
        .filter(|w| w.job_id.as_deref().unwrap_or(EXPLICIT).contains(search))
        .take(limit)
        .map(|w| WaiterView::from(*w))
        .collect();
    (found, waiting.len())
}

fn priority_name(p: Priority) -> &'static str {
    match p {
        Priority::High => "high",
        Priority::Low => "low",
        _ => "normal",
    }
}

#[derive(Serialize)]
struct Lane {
    slot: u32,
    lease: Option<LaneLease>,
}

#[derive(Serialize)]
struct LaneLease {
    lease_id: u64,
    #[serde(serialize_with = "super::json::opt_arc_str")]
    job_id: Option<Arc<str>>,
    kind: String,
    phase: &'static str,
    color: &'static str,
    held_ms: u64,
    waiting_for: Vec<String>,
    priority: String,
    slots: Vec<u32>,
    gpu_device: Option<usize>,
    child_pids: Vec<u32>,
    /// For a quarantined lease: why, once the poller has heard it.
    reason: Option<String>,
}

#[derive(Serialize)]
struct QuarantineRow {
    slot: u32,
    lease_id: u64,
    job_id: Option<String>,
    reason: Option<String>,
    held_ms: Option<u64>,
}

#[derive(Serialize)]
struct TimelineView<'a> {
    now_ms: u64,
    /// Per second, the last five minutes.
    charts: super::charts::ChartsView,
    window_ms: u64,
    lanes: Vec<TimelineLane<'a>>,
}

#[derive(Serialize)]
struct TimelineLane<'a> {
    slot: u32,
    segments: Vec<&'a Segment>,
}

/// What a frame says beside the leases: the console's own state and the supervisor's devices.
struct Meta {
    now_ms: u64,
    actions: bool,
    exposed: bool,
    resizable: bool,
    history: u64,
    gpu: Vec<GpuView>,
}

/// Per GPU device: its state, and the leases whose release waits for its fence now.
fn gpu_views(sup: &Supervisor, leases: &[LeaseInfo]) -> Vec<GpuView> {
    sup.gpu_devices()
        .into_iter()
        .map(|d| GpuView {
            fence_waits: leases
                .iter()
                .filter(|l| {
                    l.gpu_device == Some(d.index)
                        && l.phase == LeasePhase::Draining
                        && l.waiting_for.contains(&WaitingFor::GpuFence)
                })
                .count(),
            index: d.index,
            adapter: d.adapter,
            backend: d.backend,
            adopted: d.adopted,
            sub_slots: d.sub_slots,
            in_use: d.in_use,
            recreated: d.generation.saturating_sub(1),
            given_up: matches!(d.state, GpuDeviceState::GivenUp { .. }),
            lost: d.state.lost_reason().map(str::to_owned),
        })
        .collect()
}

fn build_frame(
    meta: Meta,
    (stats, leases): (&Stats, &[LeaseInfo]),
    (reasons, waiters): (&HashMap<u64, QuarantinedSlot>, &[&WaiterInfo]),
    timeline: &Timeline,
    outcomes: Vec<Outcome>,
) -> Frame {
    // The lanes: every slot below the capacity (up to MAX_LANES), every slot held now, every
    // slot with something on the timeline (a slot above a lowered capacity, or a broker's
    // own slot ids).
    let mut slots: BTreeSet<u32> = (0..stats.capacity.unwrap_or(0).min(MAX_LANES) as u32).collect();
    slots.extend(leases.iter().flat_map(slots_of));
    slots.extend(timeline.slots());
    let by_slot: HashMap<u32, &LeaseInfo> = leases
        .iter()
        .flat_map(|l| slots_of(l).map(move |s| (s, l)))
        .collect();
    let lanes = slots
        .iter()
        .map(|&slot| Lane {
            slot,
            lease: by_slot.get(&slot).map(|l| {
                let id = lease_id(l);
                LaneLease {
                    lease_id: id,
                    job_id: l.job_id.clone(),
                    kind: kind_name(l.kind),
                    phase: phase_name(l.phase),
                    color: color(l),
                    held_ms: l.held_for.as_millis() as u64,
                    waiting_for: l.waiting_for.iter().map(ToString::to_string).collect(),
                    priority: format!("{:?}", l.priority).to_lowercase(),
                    slots: slots_of(l).collect(),
                    gpu_device: l.gpu_device,
                    child_pids: l.child_pids.clone(),
                    reason: reasons.get(&id).map(|q| q.reason.clone()),
                }
            }),
        })
        .collect();

    // Quarantined slots: those the lease table shows, with the reason once heard; and any the
    // supervisor listed that the table no longer shows (until the next poll says otherwise).
    let mut quarantined: Vec<QuarantineRow> = leases
        .iter()
        .filter(|l| l.phase == LeasePhase::Quarantined)
        .map(|l| {
            let id = lease_id(l);
            let q = reasons.get(&id);
            QuarantineRow {
                slot: l.slot_id,
                lease_id: id,
                job_id: l.job_id.as_deref().map(str::to_owned),
                reason: q.map(|q| q.reason.clone()),
                held_ms: Some(l.held_for.as_millis() as u64),
            }
        })
        .collect();
    for (id, q) in reasons {
        if !quarantined.iter().any(|row| row.lease_id == *id) && stats.quarantined > 0 {
            quarantined.push(QuarantineRow {
                slot: q.token.slot_id(),
                lease_id: *id,
                job_id: q.job_id.clone(),
                reason: Some(q.reason.clone()),
                held_ms: None,
            });
        }
    }
    quarantined.sort_by_key(|row| (row.slot, row.lease_id));

    Frame {
        now_ms: meta.now_ms,
        actions: meta.actions,
        exposed: meta.exposed,
        stats: StatsView::from(stats),
        queue: QueueView {
            waiting: stats.waiting,
            listed: !waiters.is_empty(),
            listed_count: waiters.len(),
            waiters: waiters
                .iter()
                .take(QUEUE_ROWS)
                .map(|w| WaiterView::from(*w))
                .collect(),
        },
        lanes,
        quarantined,
        outcomes,
        history: meta.history,
        gpu: meta.gpu,
        resizable: meta.resizable,
    }
}

/// How many frames per timeline (`/api/timeline`): about once a second.
const TIMELINE_EVERY: u32 = 10;

/// Samples every [`SAMPLE_INTERVAL`] until `stop`, publishing each frame, and the timeline
/// every [`TIMELINE_EVERY`] frames.
pub(crate) async fn run(
    mut sampler: Sampler,
    (frames, timelines): (watch::Sender<Arc<str>>, watch::Sender<Arc<str>>),
    stop: CancellationToken,
) {
    // The first frame was taken at start: the next one an interval later.
    let mut tick = tokio::time::interval_at(Instant::now() + SAMPLE_INTERVAL, SAMPLE_INTERVAL);
    // A late tick (a loaded runtime) is skipped, not made up in a burst.
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let mut n = 0u32;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let frame = sampler.sample();
        frames.send_replace(Arc::from(frame));
        n += 1;
        if n.is_multiple_of(TIMELINE_EVERY) {
            timelines.send_replace(Arc::from(sampler.timeline_json()));
        }
    }
}

/// Keeps `reasons` and `waiters` up to date: asks the supervisor (a message to its actor) for
/// the quarantined slots only while `Stats::quarantined` says a slot is quarantined, and for the
/// waiting callers only while `Stats::waiting` says one waits; each at most once per
/// [`QUARANTINE_POLL_INTERVAL`]. When a count drops to zero its list is cleared without asking.
pub(crate) async fn poll_actor(
    sup: Supervisor,
    (reasons, waiters): (Reasons, Waiters),
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(SAMPLE_INTERVAL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Skip);
    let (mut quarantine_asked, mut waiters_asked): (Option<Instant>, Option<Instant>) =
        (None, None);
    let due =
        |asked: Option<Instant>| asked.is_none_or(|at| at.elapsed() >= QUARANTINE_POLL_INTERVAL);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let stats = sup.stats();
        if stats.quarantined == 0 {
            let mut reasons = reasons.lock();
            if !reasons.is_empty() {
                reasons.clear();
            }
        } else if due(quarantine_asked) {
            quarantine_asked = Some(Instant::now());
            // `quarantined` is cancel safe (it only reads): dropping it at `stop` is fine.
            let listed = tokio::select! {
                () = stop.cancelled() => return,
                listed = sup.quarantined() => listed,
            };
            // An error means the supervisor has stopped: keep what was last heard.
            if let Ok(listed) = listed {
                *reasons.lock() = listed
                    .into_iter()
                    .map(|q| (q.token.lease_id(), q))
                    .collect();
            }
        }
        if stats.waiting == 0 {
            let mut waiters = waiters.lock();
            if !waiters.rows.is_empty() {
                *waiters = Listing::default();
            }
        } else if due(waiters_asked) {
            let asked = Instant::now();
            waiters_asked = Some(asked);
            // `waiters` is cancel safe too.
            let listed = tokio::select! {
                () = stop.cancelled() => return,
                listed = sup.waiters() => listed,
            };
            if let Ok(rows) = listed {
                *waiters.lock() = Listing {
                    asked: Some(asked),
                    rows,
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold::JobSpec;
    use tokio::sync::oneshot;

    /// A job held until its gate opens.
    fn held(
        sup: &Supervisor,
        id: &str,
    ) -> (
        oneshot::Sender<()>,
        leasehold::JobHandle<(), std::io::Error>,
    ) {
        let (gate, rx) = oneshot::channel::<()>();
        let handle = sup.submit(JobSpec::new(id).unwrap(), move |_ctx| async move {
            let _ = rx.await;
            Ok(())
        });
        (gate, handle)
    }

    async fn until_held(sup: &Supervisor, id: &str) {
        tokio::time::timeout(std::time::Duration::from_secs(20), async {
            while !sup.leases().iter().any(|l| l.job_id.as_deref() == Some(id)) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the job holds its slot");
    }

    /// The listing is a second old, the lease table is not: a job granted since the listing
    /// was asked for is not waiting, whatever the listing says; a job of the same id that held
    /// its slot before is another caller, and the waiting one stays listed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_granted_since_the_listing_is_not_listed_as_waiting() {
        let sup = Supervisor::builder().slots(2).start().await.unwrap();
        let (first_gate, first) = held(&sup, "render");
        until_held(&sup, "render").await;
        let (blocker_gate, blocker) = held(&sup, "blocker");
        until_held(&sup, "blocker").await;
        // A second run of the id "render" waits, and "bake" behind it.
        // (`submit` sends its request from a task of its own: each joins the queue before the
        // next is submitted, so that the queue's order is known.)
        let waiting = |n: usize| {
            let sup = sup.clone();
            async move {
                tokio::time::timeout(std::time::Duration::from_secs(20), async {
                    while sup.stats().waiting < n {
                        tokio::task::yield_now().await;
                    }
                })
                .await
                .expect("it waits");
            }
        };
        let (second_gate, second) = held(&sup, "render");
        waiting(1).await;
        let (bake_gate, bake) = held(&sup, "bake");
        waiting(2).await;
        let asked = Instant::now();
        let listing = Listing {
            asked: Some(asked),
            rows: sup.waiters().await.unwrap(),
        };
        let ids = |leases: &[LeaseInfo]| {
            listing
                .still_waiting(leases, Instant::now())
                .map(|w| w.job_id.as_deref().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&sup.leases()), ["render", "bake"]);
        // The blocker ends: the second "render" is granted its slot after the listing.
        blocker_gate.send(()).unwrap();
        blocker.join().await.unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(20), async {
            while sup
                .leases()
                .iter()
                .filter(|l| l.job_id.as_deref() == Some("render"))
                .count()
                < 2
            {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap();
        assert_eq!(ids(&sup.leases()), ["bake"], "granted since: not waiting");
        // Without a time of asking, nothing is taken for granted.
        let unknown = Listing {
            asked: None,
            rows: listing.rows.clone(),
        };
        assert_eq!(
            unknown.still_waiting(&sup.leases(), Instant::now()).count(),
            2
        );
        for gate in [first_gate, second_gate, bake_gate] {
            gate.send(()).unwrap();
        }
        for job in [first, second, bake] {
            job.join().await.unwrap();
        }
        sup.shutdown().await.unwrap();
    }
}
