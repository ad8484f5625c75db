//! The history of job ends: what the embedder reports through [`Outcomes`] (a job's stable
//! code and its errors) and what the console observes itself (a job's lease leaving the lease
//! table, with the times of its phases and proofs as sampled), merged into one row per job end,
//! in a ring of a configurable size.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

use leasehold::JobError;

/// How many job ends the history keeps by default (the newest); see
/// [`ConsoleBuilder::history`](crate::ConsoleBuilder::history).
pub const DEFAULT_HISTORY: usize = 1000;

/// How many of the newest job ends each frame carries (the rest: `/api/history`).
pub(crate) const RECENT: usize = 8;

/// An observation that comes this soon after a report of the same job id is that job's end
/// (the report came first: the caller heard before the sampler looked).
const MERGE_WINDOW: Duration = Duration::from_secs(10);

/// How much earlier than its lease's start (as last sampled) a report may be and still be this
/// lease's end.
const START_SLACK: Duration = Duration::from_secs(1);

/// Longer error texts are cut to this many characters.
const MAX_DETAIL: usize = 300;

/// A cheap-clone handle that feeds the console's "last outcomes" list with each job's stable
/// code.
///
/// The supervisor's public API has no feed of job results (a result goes to the job's own
/// caller), so the console sees a job end only as its lease leaving
/// [`Supervisor::leases`](leasehold::Supervisor::leases), sampled ten times a second, without the
/// code. A caller that hands its results to [`record`](Self::record) gets the code shown on
/// that row (`OK` for a success), and a row for every job, also one too short to be sampled or
/// one that never got a slot. Optional: without it the list still shows every job end the
/// console observed, marked "code not reported".
///
/// # Examples
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use leasehold::{JobSpec, Supervisor};
/// use leasehold_console::Console;
///
/// let sup = Supervisor::builder().slots(2).start().await?;
/// let console = Console::builder(sup.clone()).start().await?;
/// let outcomes = console.outcomes();
/// let result = sup
///     .run(JobSpec::new("bake-1")?, |_ctx| async { Ok::<_, std::io::Error>(7) })
///     .await;
/// outcomes.record("bake-1", &result);
/// console.shutdown().await?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Outcomes {
    log: Arc<OutcomeLog>,
}

impl fmt::Debug for Outcomes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Outcomes")
            .field("rows", &self.log.rows.lock().len())
            .finish()
    }
}

impl Outcomes {
    pub(crate) fn new(t0: Instant, capacity: usize) -> Self {
        Self {
            log: Arc::new(OutcomeLog {
                t0,
                capacity: capacity.max(RECENT),
                rows: Mutex::new(VecDeque::new()),
                version: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    /// Records a job's result under its id: `OK` for `Ok`, else the error's stable
    /// [`code`](JobError::code) with its text (the body's own error `E` included). Never
    /// blocks on the supervisor (one short lock of the console's own list).
    pub fn record<T, E: fmt::Display>(&self, job_id: &str, result: &Result<T, JobError<E>>) {
        match result {
            Ok(_) => self.log.reported(job_id, "OK", Errors::default()),
            Err(err) => {
                let body = err.body_error().map(|body| match body.error() {
                    Some(own) => format!("{body}: {own}"),
                    None => body.to_string(),
                });
                let errors = Errors {
                    summary: Some(err.to_string()),
                    acquire: err.acquire_error().map(ToString::to_string),
                    body,
                    cleanup: err.cleanup_error().map(ToString::to_string),
                };
                self.log.reported(job_id, err.code(), errors);
            }
        }
    }

    pub(crate) fn log(&self) -> &OutcomeLog {
        &self.log
    }
}

/// What a failed job's result said, each part on its own (texts cut to a few hundred
/// characters).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Errors {
    /// The error's own summary.
    pub(crate) summary: Option<String>,
    /// Why it got no slot.
    pub(crate) acquire: Option<String>,
    /// The body's failure, with the body's own error.
    pub(crate) body: Option<String>,
    /// The cleanup's failure: next to the body's when both failed.
    pub(crate) cleanup: Option<String>,
}

/// When a lease's phases and proofs were first seen by the sampler (ms since the console
/// started; every 100 ms, so each is at most one sample late).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Timings {
    /// The lease first seen (its start, one sample late at most).
    pub(crate) started_ms: u64,
    /// How long the job waited for its slot, as the queue listing last showed it (listed about
    /// once a second: a lower bound), if it was seen waiting.
    pub(crate) waited_ms: Option<u64>,
    /// The body ended: the lease seen draining.
    pub(crate) draining_ms: Option<u64>,
    /// Each proof of the physical end, when it was first seen done (`worker`, `tracked tasks`,
    /// `GPU work`, `temp dir`, ...).
    pub(crate) proofs: Vec<(String, u64)>,
    /// The slot's release to the broker began.
    pub(crate) releasing_ms: Option<u64>,
    /// The lease gone from the table.
    pub(crate) ended_ms: u64,
    /// Its lease: `job` or `explicit`, and the GPU device it ran on.
    pub(crate) kind: String,
    pub(crate) gpu_device: Option<usize>,
    pub(crate) lease_id: u64,
}

/// One job end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Outcome {
    /// When it was first known (reported or observed), in ms since the console started.
    pub(crate) at_ms: u64,
    #[serde(serialize_with = "super::json::arc_str")]
    pub(crate) job_id: Arc<str>,
    /// The stable code (`OK` for a success); `None` until the embedder reports it.
    #[serde(serialize_with = "super::json::opt_arc_str")]
    pub(crate) code: Option<Arc<str>>,
    /// One line: the errors' summary.
    pub(crate) detail: Option<String>,
    /// Each part of a failure on its own.
    pub(crate) errors: Errors,
    /// The slot its lease held, when the console saw it.
    pub(crate) slot: Option<u32>,
    /// How long its lease was held, as last seen.
    pub(crate) held_ms: Option<u64>,
    /// The phase its lease was last seen in before it left the table.
    pub(crate) last_phase: Option<&'static str>,
    /// Its lease as sampled (when the console saw it).
    pub(crate) timings: Option<Timings>,
    #[serde(skip)]
    at: Instant,
    #[serde(skip)]
    reported: bool,
    #[serde(skip)]
    observed: bool,
}

/// An observed end: a job's lease gone from the table since the previous sample.
#[derive(Debug, Clone)]
pub(crate) struct Ended {
    pub(crate) job_id: Arc<str>,
    pub(crate) slot: u32,
    pub(crate) held: Duration,
    pub(crate) last_phase: &'static str,
    pub(crate) timings: Timings,
}

pub(crate) struct OutcomeLog {
    t0: Instant,
    capacity: usize,
    rows: Mutex<VecDeque<Outcome>>,
    /// One more at every change of the rows.
    version: std::sync::atomic::AtomicU64,
}

impl OutcomeLog {
    fn new_row(&self, job_id: Arc<str>, now: Instant) -> Outcome {
        Outcome {
            at_ms: now.saturating_duration_since(self.t0).as_millis() as u64,
            job_id,
            code: None,
            detail: None,
            errors: Errors::default(),
            slot: None,
            held_ms: None,
            last_phase: None,
            timings: None,
            at: now,
            reported: false,
            observed: false,
        }
    }

    /// The newest row of that job id that still lacks `which` and `belongs` to this end.
    fn find<'a>(
        rows: &'a mut VecDeque<Outcome>,
        job_id: &str,
        which: impl Fn(&Outcome) -> bool,
        belongs: impl Fn(&Outcome) -> bool,
    ) -> Option<&'a mut Outcome> {
        rows.iter_mut()
            .rev()
            .find(|row| &*row.job_id == job_id && !which(row) && belongs(row))
    }

    fn push(&self, rows: &mut VecDeque<Outcome>, row: Outcome) {
        rows.push_back(row);
        while rows.len() > self.capacity {
            rows.pop_front();
        }
    }

    pub(crate) fn reported(&self, job_id: &str, code: &str, errors: Errors) {
        let now = Instant::now();
        let cut = |d: String| match d.char_indices().nth(MAX_DETAIL) {
            Some((cut, _)) => format!("{}...", &d[..cut]),
            None => d,
        };
        let errors = Errors {
            summary: errors.summary.map(cut),
            acquire: errors.acquire.map(cut),
            body: errors.body.map(cut),
            cleanup: errors.cleanup.map(cut),
        };
        let detail = [&errors.acquire, &errors.body, &errors.cleanup]
            .into_iter()
            .flatten()
            .cloned()
            .collect::<Vec<_>>();
        let detail = match (&errors.summary, detail.is_empty()) {
            (None, _) => None,
            (Some(summary), true) => Some(summary.clone()),
            (Some(summary), false) => Some(cut(format!("{summary}: {}", detail.join("; ")))),
        };
        let mut rows = self.rows.lock();
        // The end the console saw of this job id, if it has not been matched to a report yet
        // and is recent (a report comes when the caller hears, right after the lease left).
        let recent = |r: &Outcome| now.saturating_duration_since(r.at) <= MERGE_WINDOW;
        let row = match Self::find(&mut rows, job_id, |r| r.reported, recent) {
            Some(row) => row,
            None => {
                let row = self.new_row(Arc::from(job_id), now);
                self.push(&mut rows, row);
                rows.back_mut().expect("just pushed")
            }
        };
        row.code = Some(Arc::from(code));
        row.detail = detail;
        row.errors = errors;
        row.reported = true;
        self.changed();
    }

    fn changed(&self) {
        // Relaxed: a counter the page compares; the rows themselves are read under their lock.
        self.version
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Changes whenever a row is added or completed.
    pub(crate) fn version(&self) -> u64 {
        self.version.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn observed(&self, ended: Ended, now: Instant) {
        let mut rows = self.rows.lock();
        // A report of this job id made while its lease was held is this lease's end, however
        // long the lease stayed afterwards (a slot quarantined for minutes): the lease started
        // `held` before now, and a report of an earlier run came before that.
        // `held` is the previous sample's (up to a sample old), and a short job reports about
        // when its lease starts: a second of slack. A report of an earlier run of the same id
        // has its own observation already, or is older than that.
        let started = now.checked_sub(ended.held + START_SLACK).unwrap_or(self.t0);
        let row = match Self::find(
            &mut rows,
            &ended.job_id,
            |r| r.observed,
            |r| r.at >= started,
        ) {
            Some(row) => row,
            None => {
                let row = self.new_row(Arc::clone(&ended.job_id), now);
                self.push(&mut rows, row);
                rows.back_mut().expect("just pushed")
            }
        };
        row.slot = Some(ended.slot);
        row.held_ms = Some(ended.held.as_millis() as u64);
        row.last_phase = Some(ended.last_phase);
        row.timings = Some(ended.timings);
        row.observed = true;
        self.changed();
    }

    /// The newest `n` rows, newest first.
    pub(crate) fn recent(&self, n: usize) -> Vec<Outcome> {
        self.rows.lock().iter().rev().take(n).cloned().collect()
    }

    /// The rows whose code is `code` (`unreported`: none yet) and whose job id contains
    /// `search`, newest first, at most `limit`; and how many rows the history holds.
    pub(crate) fn query(
        &self,
        code: Option<&str>,
        search: &str,
        limit: usize,
    ) -> (Vec<Outcome>, usize) {
        let rows = self.rows.lock();
        let matching = rows
            .iter()
            .rev()
            .filter(|r| match code {
                None => true,
                Some("unreported") => r.code.is_none(),
                Some(code) => r.code.as_deref() == Some(code),
            })
            .filter(|r| r.job_id.contains(search))
            .take(limit)
            .cloned()
            .collect();
        (matching, rows.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold::{AcquireError, JobError};

    fn ended(job: &str, held: Duration) -> Ended {
        Ended {
            job_id: Arc::from(job),
            slot: 1,
            held,
            last_phase: "draining",
            timings: Timings::default(),
        }
    }

    fn outcomes(capacity: usize) -> Outcomes {
        Outcomes::new(Instant::now(), capacity)
    }

    #[test]
    fn a_report_and_an_observation_of_one_job_make_one_row_in_either_order() {
        let outcomes = outcomes(DEFAULT_HISTORY);
        let log = outcomes.log();
        outcomes.record("a", &Ok::<_, JobError<std::io::Error>>(()));
        log.observed(ended("a", Duration::from_millis(1500)), Instant::now());
        log.observed(ended("b", Duration::from_millis(1500)), Instant::now());
        let err: Result<(), JobError<std::io::Error>> =
            Err(JobError::Acquire(AcquireError::Cancelled));
        outcomes.record("b", &err);
        let rows = log.recent(10);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(&*rows[0].job_id, "b");
        assert_eq!(rows[0].code.as_deref(), Some("LEASE_ACQUIRE_CANCELLED"));
        assert!(rows[0].errors.acquire.is_some(), "{rows:?}");
        assert_eq!(rows[0].slot, Some(1));
        assert_eq!(rows[0].held_ms, Some(1500));
        assert_eq!(&*rows[1].job_id, "a");
        assert_eq!(rows[1].code.as_deref(), Some("OK"));
        assert_eq!(rows[1].last_phase, Some("draining"));
    }

    /// A job reported at once and whose slot stayed quarantined for a minute before its lease
    /// left the table: one row, not two.
    #[test]
    fn a_job_quarantined_long_after_its_report_is_one_row() {
        let outcomes = outcomes(DEFAULT_HISTORY);
        let log = outcomes.log();
        let now = Instant::now();
        outcomes.record("slow", &Ok::<_, JobError<std::io::Error>>(()));
        log.observed(
            ended("slow", Duration::from_secs(65)),
            now + Duration::from_secs(60),
        );
        let rows = log.recent(10);
        assert_eq!(rows.len(), 1, "{rows:?}");
        assert_eq!(rows[0].code.as_deref(), Some("OK"));
        assert_eq!(rows[0].held_ms, Some(65_000));
    }

    #[test]
    fn a_second_run_of_the_same_id_is_a_row_of_its_own() {
        let outcomes = outcomes(DEFAULT_HISTORY);
        let log = outcomes.log();
        log.observed(ended("a", Duration::ZERO), Instant::now());
        outcomes.record("a", &Ok::<_, JobError<std::io::Error>>(()));
        // The second run's lease started after the first run's report.
        log.observed(
            ended("a", Duration::ZERO),
            Instant::now() + Duration::from_secs(1),
        );
        let rows = log.recent(10);
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(rows[0].code, None);
        assert_eq!(rows[1].code.as_deref(), Some("OK"));
    }

    #[test]
    fn the_history_keeps_the_newest_rows_and_answers_a_filter_and_a_search() {
        let outcomes = outcomes(20);
        let err: Result<(), JobError<std::io::Error>> =
            Err(JobError::Acquire(AcquireError::Cancelled));
        for i in 0..25 {
            if i % 5 == 0 {
                outcomes.record(&format!("render-{i}"), &err);
            } else {
                outcomes.record(&format!("bake-{i}"), &Ok::<_, JobError<std::io::Error>>(()));
            }
        }
        let log = outcomes.log();
        let (all, len) = log.query(None, "", 100);
        assert_eq!((all.len(), len), (20, 20), "the ring keeps 20");
        assert_eq!(&*all[0].job_id, "bake-24");
        let (cancelled, _) = log.query(Some("LEASE_ACQUIRE_CANCELLED"), "", 100);
        let ids: Vec<&str> = cancelled.iter().map(|r| &*r.job_id).collect();
        assert_eq!(ids, ["render-20", "render-15", "render-10", "render-5"]);
        let (found, _) = log.query(None, "bake-2", 100);
        let ids: Vec<&str> = found.iter().map(|r| &*r.job_id).collect();
        assert_eq!(ids, ["bake-24", "bake-23", "bake-22", "bake-21"]);
        assert_eq!(log.query(Some("unreported"), "", 100).0.len(), 0);
        assert_eq!(log.query(None, "", 3).0.len(), 3, "the limit");
    }
}
