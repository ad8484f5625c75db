//! A flood: ten thousand jobs through four slots with every kind of fault mixed in, checked
//! against records the test keeps itself (a per-slot occupancy board, a per-job record, the
//! broker's own book), never against the supervisor's counters alone.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::io;
use std::path::Path;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::{Arc, Once, OnceLock};
use std::time::Duration;

use common::{Plan, TestBroker};
use leasehold::{
    BodyErrorKind, CancellationToken, JobError, JobSpec, Supervisor, WorkerContext, codes,
};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinError};
use tracing::field::{Field, Visit};
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

const JOBS: usize = 10_000;
const SLOTS: usize = 4;
/// Every panic the test injects carries this mark; the panic hook keeps them quiet.
const PANIC_MARK: &str = "flood: injected panic";

/// What job `i` is made to do, by its index alone (10% cancelled in four ways, 5% panics,
/// 10% body errors; release failures are chosen by lease id, see [`release_fails`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    /// Returns `Ok(i)`.
    None,
    /// Returns `Err`.
    BodyError,
    /// The body itself panics.
    PanicBody,
    /// A tracked blocking closure panics; the body still returns `Ok`.
    PanicBlocking,
    /// A tracked sibling task (never awaited) panics; the body still returns `Ok`.
    PanicSibling,
    /// Its token is cancelled after every job has queued and before any slot is free.
    CancelQueued,
    /// Its token is cancelled when the job three places ahead starts: it races with its grant.
    CancelRacing,
    /// Its token is cancelled once its body runs; the body waits for `ctx.cancelled()`.
    CancelRunning,
    /// The task holding its `run` future is aborted while it waits for a slot.
    AbortQueued,
    /// The task holding its `run` future is aborted once its body runs.
    AbortRunning,
}

/// The job whose start triggers the cancellation of a `CancelRacing` job is this far ahead.
const RACE_LEAD: usize = 3;

fn fault(i: usize) -> Fault {
    match i % 100 {
        0 | 1 => Fault::CancelQueued,
        2..=4 => Fault::CancelRunning,
        5 => Fault::AbortQueued,
        6 | 7 => Fault::AbortRunning,
        // Triggered by jobs 47 and 48, which are plain jobs (they always start).
        50 | 51 => Fault::CancelRacing,
        10..=12 => Fault::PanicBody,
        13 => Fault::PanicBlocking,
        14 => Fault::PanicSibling,
        15..=24 => Fault::BodyError,
        _ => Fault::None,
    }
}

/// The broker fails the release of 5% of the lease ids (it frees the slot underneath).
fn release_fails(lease_id: u64) -> bool {
    lease_id % 20 == 7
}

/// The test's own record of who is inside a slot: set by a body on entry, cleared when the body
/// and every tracked task that holds a clone of its [`Occupant`] have ended.
#[derive(Default)]
struct Board {
    busy: [AtomicBool; SLOTS],
    running: AtomicUsize,
    max_running: AtomicUsize,
    /// Entries into a slot that was still occupied, or out of range.
    violations: AtomicUsize,
    next_start: AtomicU64,
}

struct Occupant {
    board: Arc<Board>,
    slot: usize,
}

impl Occupant {
    fn enter(board: &Arc<Board>, slot: u32) -> Arc<Self> {
        let running = board.running.fetch_add(1, SeqCst) + 1;
        board.max_running.fetch_max(running, SeqCst);
        let slot = slot as usize;
        if slot >= SLOTS || board.busy[slot].swap(true, SeqCst) {
            board.violations.fetch_add(1, SeqCst);
        }
        Arc::new(Self {
            board: Arc::clone(board),
            slot,
        })
    }
}

impl Drop for Occupant {
    fn drop(&mut self) {
        if self.slot < SLOTS {
            self.board.busy[self.slot].store(false, SeqCst);
        }
        self.board.running.fetch_sub(1, SeqCst);
    }
}

/// What job `i`'s body saw, written on entry.
#[derive(Default)]
struct Record {
    started: AtomicBool,
    lease_id: AtomicU64,
    start_seq: AtomicU64,
}

/// Shared by the submitting test, the bodies and the canceller.
struct Flood {
    board: Arc<Board>,
    records: Vec<Record>,
    tokens: Vec<CancellationToken>,
    aborts: Vec<OnceLock<AbortHandle>>,
}

type Outcome = Result<Result<u32, JobError<io::Error>>, JoinError>;

/// What the error sink heard: job id, lease id, code.
type Orphaned = (Option<String>, u64, &'static str);

/// The supervisor's own record of the grant order: the lease id of each "slot granted" event,
/// in the order the supervisor emitted them (one actor, so one order). Lease ids alone do not
/// name the grant order: a token that a job refuses at its grant (cancelled in that instant)
/// goes on to the longest waiter left, behind grants made in the same turn with later lease ids.
#[derive(Clone, Default)]
struct GrantLog(Arc<Mutex<Vec<u64>>>);

impl GrantLog {
    /// Installs the log as this test binary's global subscriber (the supervisor runs on the
    /// runtime's worker threads, so a thread-local default would not see it).
    fn install() -> Self {
        let log = Self::default();
        tracing::subscriber::set_global_default(tracing_subscriber::registry().with(log.clone()))
            .expect("the flood binary installs one subscriber");
        log
    }
}

impl<S: Subscriber> Layer<S> for GrantLog {
    fn register_callsite(&self, meta: &'static Metadata<'static>) -> Interest {
        // leasehold's events and `enabled!` hints down to DEBUG; no spans (none are needed).
        if !meta.is_span()
            && meta.target().starts_with("leasehold")
            && *meta.level() <= Level::DEBUG
        {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        #[derive(Default)]
        struct Grant {
            granted: bool,
            lease_id: Option<u64>,
        }
        impl Visit for Grant {
            fn record_u64(&mut self, field: &Field, value: u64) {
                if field.name() == "lease_id" {
                    self.lease_id = Some(value);
                }
            }
            fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.granted = format!("{value:?}") == "slot granted";
                }
            }
        }
        let mut grant = Grant::default();
        event.record(&mut grant);
        if let (true, Some(lease)) = (grant.granted, grant.lease_id) {
            self.0.lock().push(lease);
        }
    }
}

/// Keeps the injected panics out of the output; every other panic reaches the default hook.
fn silence_injected_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let msg = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str));
            if !msg.is_some_and(|m| m.contains(PANIC_MARK)) {
                default(info);
            }
        }));
    });
}

/// Waits (yielding, never sleeping) until `done` holds; fails after a generous bound.
async fn wait_until(what: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        while !done() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {}", what());
}

/// Job `i`'s body: enter the board, do a little real work in tracked tasks, then fail as told.
async fn body(
    i: usize,
    ctx: WorkerContext,
    flood: Arc<Flood>,
    started: mpsc::UnboundedSender<usize>,
) -> Result<u32, io::Error> {
    let seq = flood.board.next_start.fetch_add(1, SeqCst);
    let occupant = Occupant::enter(&flood.board, ctx.slot_id());
    let record = &flood.records[i];
    record.lease_id.store(ctx.lease_id(), SeqCst);
    record.start_seq.store(seq, SeqCst);
    record.started.store(true, SeqCst);
    // The canceller acts on starts (its own cancellations and the racing ones).
    let _ = started.send(i);
    let kind = fault(i);

    let dir = ctx.temp_dir().to_path_buf();
    let occ = Arc::clone(&occupant);
    let panic_blocking = kind == Fault::PanicBlocking;
    let written = ctx.spawn_blocking(move || {
        let _occ = occ;
        let path = dir.join("frame.bin");
        let payload = u32::try_from(i).unwrap().to_le_bytes().repeat(64);
        std::fs::write(&path, &payload)?;
        assert!(
            !panic_blocking,
            "{PANIC_MARK} in the blocking closure of job {i}"
        );
        let back = std::fs::read(&path)?;
        if back != payload {
            return Err(io::Error::other(format!("job {i}: read back other bytes")));
        }
        Ok::<_, io::Error>(back.len())
    });
    if i.is_multiple_of(3) {
        let (occ, dir) = (Arc::clone(&occupant), ctx.temp_dir().to_path_buf());
        let side = ctx.spawn(async move {
            let _occ = occ;
            std::fs::write(dir.join("side.txt"), format!("job {i}"))
        });
        // Every other one is never awaited: the slot must wait for it all the same.
        if i.is_multiple_of(2) {
            side.await.map_err(io::Error::other)??;
        }
    }
    if kind == Fault::PanicSibling {
        let occ = Arc::clone(&occupant);
        ctx.spawn(async move {
            let _occ = occ;
            panic!("{PANIC_MARK} in a sibling task of job {i}");
        });
    }
    match written.await {
        Ok(done) => {
            done?;
        }
        Err(_) if panic_blocking => {}
        Err(e) => return Err(io::Error::other(e)),
    }

    let value = u32::try_from(i).unwrap();
    match kind {
        Fault::BodyError => Err(io::Error::other(format!("job {i} failed"))),
        Fault::PanicBody => panic!("{PANIC_MARK} in the body of job {i}"),
        Fault::CancelRunning | Fault::AbortRunning => {
            ctx.cancelled().await;
            Err(io::Error::other(format!("job {i} stopped")))
        }
        Fault::CancelRacing if ctx.is_cancelled() => {
            Err(io::Error::other(format!("job {i} saw its cancellation")))
        }
        _ => Ok(value),
    }
}

/// Acts on body starts: cancels or aborts the running ones told to, and cancels the racing job
/// `RACE_LEAD` places behind the one that started.
async fn canceller(flood: Arc<Flood>, mut started: mpsc::UnboundedReceiver<usize>) {
    while let Some(k) = started.recv().await {
        match fault(k) {
            Fault::CancelRunning => flood.tokens[k].cancel(),
            Fault::AbortRunning => flood.aborts[k].get().expect("abort handle set").abort(),
            _ => {}
        }
        let j = k + RACE_LEAD;
        if j < JOBS && fault(j) == Fault::CancelRacing {
            flood.tokens[j].cancel();
        }
    }
}

/// Checks one job's result against its fault class and what its body saw. Returns the lease id
/// of a cleanup failure the caller heard, if any.
fn check_outcome(i: usize, outcome: Outcome, record: &Record) -> Result<Option<u64>, String> {
    let kind = fault(i);
    let started = record.started.load(SeqCst);
    let lease = record.lease_id.load(SeqCst);
    let failing = started && release_fails(lease);
    let must_start = !matches!(
        kind,
        Fault::CancelQueued | Fault::AbortQueued | Fault::CancelRacing
    );
    if must_start && !started {
        return Err(format!("{kind:?} job never started: {outcome:?}"));
    }
    if matches!(kind, Fault::CancelQueued | Fault::AbortQueued) && started {
        return Err(format!("{kind:?} job started after it was withdrawn"));
    }
    let result = match (kind, outcome) {
        (Fault::AbortQueued | Fault::AbortRunning, Err(join)) if join.is_cancelled() => {
            return Ok(None);
        }
        (_, Err(join)) => return Err(format!("{kind:?} job's task ended with {join:?}")),
        (_, Ok(result)) => result,
    };
    let err = match result {
        Ok(v) if v as usize == i => {
            let allowed = matches!(kind, Fault::None) || (kind == Fault::CancelRacing && started);
            return match (allowed, failing) {
                (true, false) => Ok(None),
                _ => Err(format!(
                    "{kind:?} job returned Ok (release failing: {failing})"
                )),
            };
        }
        Ok(v) => return Err(format!("{kind:?} job returned the value {v}")),
        Err(err) => err,
    };
    let code = err.code();
    let body_kind = err.body_error().map(|b| b.kind());
    let expected_body = match kind {
        Fault::None => None,
        Fault::BodyError => Some(BodyErrorKind::Failed),
        Fault::PanicBody | Fault::PanicBlocking | Fault::PanicSibling => {
            Some(BodyErrorKind::Panicked)
        }
        Fault::CancelRunning => Some(BodyErrorKind::Cancelled),
        Fault::CancelQueued => {
            return if code == codes::LEASE_ACQUIRE_CANCELLED {
                Ok(None)
            } else {
                Err(format!("{kind:?} job ended {code}: {err:?}"))
            };
        }
        Fault::CancelRacing if !started => {
            return if code == codes::LEASE_ACQUIRE_CANCELLED {
                Ok(None)
            } else {
                Err(format!("unstarted {kind:?} job ended {code}: {err:?}"))
            };
        }
        // Granted before the cancellation: it either finished (Ok, handled above) or saw it.
        Fault::CancelRacing => body_kind.map(|_| BodyErrorKind::Cancelled),
        Fault::AbortQueued | Fault::AbortRunning => {
            return Err(format!("{kind:?} job's task was not aborted: {err:?}"));
        }
    };
    let expected_code = match (expected_body, failing) {
        (None, false) => return Err(format!("{kind:?} job failed: {err:?}")),
        (None, true) => codes::LEASE_CLEANUP_FAILED,
        (Some(BodyErrorKind::Failed), false) => codes::LEASE_BODY_FAILED,
        (Some(BodyErrorKind::Panicked), false) => codes::LEASE_BODY_PANICKED,
        (Some(BodyErrorKind::Cancelled), false) => codes::LEASE_BODY_CANCELLED,
        (Some(_), false) => unreachable!("no delivery-unknown is injected"),
        (Some(_), true) => codes::LEASE_BODY_AND_CLEANUP_FAILED,
    };
    if code != expected_code || body_kind != expected_body {
        return Err(format!(
            "{kind:?} job (release failing: {failing}) ended {code}, expected {expected_code} \
             with body {expected_body:?}: {err:?}"
        ));
    }
    if body_kind == Some(BodyErrorKind::Panicked) {
        let panics = err.body_error().unwrap().panics();
        if !panics.iter().any(|p| p.contains(PANIC_MARK)) {
            return Err(format!("{kind:?} job lost its panic message: {panics:?}"));
        }
    }
    match err.cleanup_error() {
        None => Ok(None),
        Some(cleanup) => {
            let token = cleanup.token().map(|t| t.lease_id());
            if cleanup.code() != codes::LEASE_CLEANUP_FAILED || token != Some(lease) {
                return Err(format!(
                    "{kind:?} job's cleanup error names {token:?}, not lease {lease}: {err:?}"
                ));
            }
            Ok(Some(lease))
        }
    }
}

fn dir_entries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

/// Ten thousand jobs through four slots: every job is queued one at a time behind four held
/// leases (so the queue order is known), then the leases go and the flood runs with cancelled,
/// aborted, panicking and failing jobs and failing releases mixed in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_jobs_with_faults_leak_nothing_never_double_grant_and_stay_fifo() {
    silence_injected_panics();
    let grant_log = GrantLog::install();
    let broker = TestBroker::new(SLOTS as u32);
    // The broker's own word on which releases it failed (never a panic inside the broker).
    let injected: Arc<Mutex<Vec<u64>>> = Arc::default();
    {
        let injected = Arc::clone(&injected);
        broker.on_release(move |lease_id| {
            if release_fails(lease_id) {
                injected.lock().push(lease_id);
                Plan::Fail
            } else {
                Plan::Ok
            }
        });
    }
    let orphaned: Arc<Mutex<Vec<Orphaned>>> = Arc::default();
    let root = tempfile::tempdir().unwrap();
    let sup = {
        let orphaned = Arc::clone(&orphaned);
        Supervisor::builder()
            .broker(broker.clone())
            .work_root(root.path())
            .error_sink(move |f| {
                orphaned
                    .lock()
                    .push((f.job_id.clone(), f.token.lease_id(), f.error.code()));
            })
            .start()
            .await
            .unwrap()
    };

    let flood = Arc::new(Flood {
        board: Arc::default(),
        records: (0..JOBS).map(|_| Record::default()).collect(),
        tokens: (0..JOBS).map(|_| CancellationToken::new()).collect(),
        aborts: (0..JOBS).map(|_| OnceLock::new()).collect(),
    });
    let (started_tx, started_rx) = mpsc::unbounded_channel();
    let canceller = tokio::spawn(canceller(Arc::clone(&flood), started_rx));

    // Hold every slot, so that each job queues, in index order.
    let mut leases = Vec::new();
    for _ in 0..SLOTS {
        leases.push(sup.acquire().await.unwrap());
    }
    let submit = std::time::Instant::now();
    let mut handles = Vec::with_capacity(JOBS);
    for i in 0..JOBS {
        let spec = JobSpec::new(format!("flood-{i}"))
            .unwrap()
            .with_cancel(flood.tokens[i].clone());
        let (sup2, flood2, tx) = (sup.clone(), Arc::clone(&flood), started_tx.clone());
        let handle =
            tokio::spawn(async move { sup2.run(spec, move |ctx| body(i, ctx, flood2, tx)).await });
        flood.aborts[i].set(handle.abort_handle()).unwrap();
        handles.push(handle);
        wait_until(
            || format!("job {i} to queue: {:?}", sup.stats()),
            || sup.stats().waiting == i + 1,
        )
        .await;
    }
    drop(started_tx);
    let submitted_in = submit.elapsed();

    // Withdraw some while every slot is still held: these can never be granted.
    let mut withdrawn = 0;
    for i in 0..JOBS {
        match fault(i) {
            Fault::CancelQueued => flood.tokens[i].cancel(),
            Fault::AbortQueued => flood.aborts[i].get().unwrap().abort(),
            _ => continue,
        }
        withdrawn += 1;
    }
    wait_until(
        || format!("the withdrawals: {:?}", sup.stats()),
        || sup.stats().waiting == JOBS - withdrawn,
    )
    .await;
    assert_eq!(broker.held(), SLOTS);
    assert_eq!(flood.board.next_start.load(SeqCst), 0, "a body ran early");

    // Open the gates.
    let run = std::time::Instant::now();
    let mut lease_ids = BTreeSet::new();
    let mut heard_by_holders = BTreeSet::new();
    for mut lease in leases {
        let id = lease.lease_id().unwrap();
        lease_ids.insert(id);
        match lease.release().await {
            Ok(()) => assert!(!release_fails(id), "lease {id}: injected failure lost"),
            Err(e) => {
                assert!(release_fails(id), "lease {id}: {e}");
                heard_by_holders.insert(id);
            }
        }
    }

    let mut failures = Vec::new();
    let mut heard_by_callers = BTreeSet::new();
    for (i, handle) in handles.into_iter().enumerate() {
        let outcome = handle.await;
        match check_outcome(i, outcome, &flood.records[i]) {
            Ok(Some(lease)) => {
                heard_by_callers.insert(lease);
            }
            Ok(None) => {}
            Err(why) => failures.push(format!("job {i}: {why}")),
        }
    }
    assert!(
        failures.is_empty(),
        "{} jobs ended wrong, first ones: {:#?}",
        failures.len(),
        &failures[..failures.len().min(20)]
    );

    // Aborted jobs are finished by the supervisor on its own; wait for the last of them.
    wait_until(
        || {
            format!(
                "quiescence: {:?}, broker holds {}",
                sup.stats(),
                broker.held()
            )
        },
        || {
            let s = sup.stats();
            s.active == 0 && s.waiting == 0 && broker.held() == 0
        },
    )
    .await;
    let ran_in = run.elapsed();
    tokio::time::timeout(Duration::from_secs(30), canceller)
        .await
        .expect("the canceller ends once every body is gone")
        .unwrap();

    // (1) Capacity and no double grant, by the test's own board and the broker's book.
    let board = &flood.board;
    assert_eq!(board.violations.load(SeqCst), 0, "a slot was entered twice");
    assert!(board.max_running.load(SeqCst) <= SLOTS, "over capacity");
    assert_eq!(
        board.running.load(SeqCst),
        0,
        "an occupant outlived its job"
    );
    assert!(board.busy.iter().all(|b| !b.load(SeqCst)));
    assert!(broker.max_held() <= SLOTS);

    // (4) FIFO: grants follow the queue, in the supervisor's own grant order (see `GrantLog`).
    // Body *start* order is not the grant order: four granted workers may begin in any order on
    // a multi-thread runtime; lease id order is not either (a token a racing cancellation
    // refused goes on to a later waiter).
    let started: Vec<(usize, u64)> = flood
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.started.load(SeqCst))
        .map(|(i, r)| (i, r.lease_id.load(SeqCst)))
        .collect();
    let job_of: HashMap<u64, usize> = started.iter().map(|&(i, l)| (l, i)).collect();
    let granted: Vec<usize> = grant_log
        .0
        .lock()
        .iter()
        .filter_map(|lease| job_of.get(lease).copied())
        .collect();
    assert_eq!(
        granted.len(),
        started.len(),
        "a started job's grant was not logged exactly once"
    );
    for pair in granted.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        assert!(
            a < b,
            "grant order broke FIFO: job {a} was granted before job {b}, which queued earlier"
        );
    }
    let inversions =
        |seq: &dyn Fn(usize) -> u64| granted.windows(2).filter(|p| seq(p[0]) > seq(p[1])).count();
    let start_inversions = inversions(&|i| flood.records[i].start_seq.load(SeqCst));
    let lease_inversions = inversions(&|i| flood.records[i].lease_id.load(SeqCst));
    for &(i, lease) in &started {
        assert!(lease_ids.insert(lease), "job {i} reused lease {lease}");
    }

    // (3) Nothing leaked, one release per token, every failure accounted for exactly once.
    let stats = sup.stats();
    broker.assert_quiescent(stats);
    assert_eq!(stats.waiting, 0);
    assert_eq!(stats.quarantined, 0, "{stats:?}");
    assert_eq!(stats.acquired_total, broker.acquire_calls(), "{stats:?}");
    assert_eq!(
        stats.acquired_total,
        stats.released_total + stats.release_failed_total,
        "{stats:?}"
    );
    let injected_calls = injected.lock().clone();
    let injected: BTreeSet<u64> = injected_calls.iter().copied().collect();
    assert_eq!(injected.len(), injected_calls.len(), "a lease failed twice");
    let expected_failures: BTreeSet<u64> = (1..=stats.acquired_total)
        .filter(|&l| release_fails(l))
        .collect();
    assert_eq!(
        injected, expected_failures,
        "every granted lease id released once"
    );
    assert_eq!(
        stats.release_failed_total,
        injected.len() as u64,
        "{stats:?}"
    );
    // Who heard each injected failure: the lease holder, the job's caller, or (no caller left:
    // an aborted job, or a token nobody waited for any more) the error sink.
    let orphaned = orphaned.lock().clone();
    let mut heard_by_sink = BTreeSet::new();
    for (job_id, lease, code) in &orphaned {
        assert_eq!(*code, codes::LEASE_CLEANUP_FAILED);
        assert!(heard_by_sink.insert(*lease), "lease {lease} sunk twice");
        match job_of.get(lease) {
            Some(&i) => {
                assert_eq!(
                    fault(i),
                    Fault::AbortRunning,
                    "job {i}'s failure went to the sink"
                );
                assert_eq!(job_id.as_deref(), Some(format!("flood-{i}").as_str()));
            }
            None => assert!(job_id.is_none(), "lease {lease} of {job_id:?} never ran"),
        }
    }
    let heard: BTreeSet<u64> = heard_by_holders
        .iter()
        .chain(&heard_by_callers)
        .chain(&heard_by_sink)
        .copied()
        .collect();
    assert_eq!(
        heard_by_holders.len() + heard_by_callers.len() + heard_by_sink.len(),
        heard.len(),
        "a failure was reported twice"
    );
    let swallowed: Vec<_> = injected.difference(&heard).collect();
    let invented: Vec<_> = heard.difference(&injected).collect();
    assert!(
        swallowed.is_empty() && invented.is_empty(),
        "release failures swallowed (lease ids): {swallowed:?}; reported but never injected: \
         {invented:?}"
    );
    // Every aborted running job with a failing release went to the sink (its caller was gone).
    let aborted_running_failing = started
        .iter()
        .filter(|&&(i, l)| fault(i) == Fault::AbortRunning && release_fails(l))
        .count();
    let sunk_with_job = orphaned.iter().filter(|(job, ..)| job.is_some()).count();
    assert_eq!(sunk_with_job, aborted_running_failing, "{orphaned:?}");

    // Every temp dir is gone: the work root (ours) is empty.
    let left = dir_entries(root.path());
    assert!(left.is_empty(), "temp dirs left behind: {left:?}");

    let report = sup.shutdown().await.unwrap();
    assert_eq!(report.refused_waiters, 0, "{report:?}");
    assert_eq!(report.cancelled_jobs, 0, "{report:?}");
    assert_eq!(report.released_leases, 0, "{report:?}");
    assert_eq!(report.quarantined, 0, "{report:?}");

    let count = |f: Fault| (0..JOBS).filter(|&i| fault(i) == f).count();
    let racing_started = started
        .iter()
        .filter(|&&(i, _)| fault(i) == Fault::CancelRacing)
        .count();
    eprintln!(
        "flood: {JOBS} jobs queued in {submitted_in:?}, ran in {ran_in:?}; {} bodies started \
         ({racing_started} of {} racing cancellations lost to the grant), {} release failures \
         ({} heard by callers, {} by the sink), max {} bodies at once; against grant order, \
         {start_inversions} start-order and {lease_inversions} lease-id inversions",
        started.len(),
        count(Fault::CancelRacing),
        injected.len(),
        heard_by_callers.len(),
        heard_by_sink.len(),
        board.max_running.load(SeqCst),
    );
}
