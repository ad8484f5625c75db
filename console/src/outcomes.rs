//! The last outcomes: what the embedder reports through [`Outcomes`] (a job's stable code) and
//! what the console observes itself (a job's lease leaving the lease table), merged into one
//! row per job end.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::time::Instant;

use leasehold::JobError;

/// How many outcomes the page shows (the newest).
pub(crate) const KEPT: usize = 50;

/// A report and an observation of the same job id this close together are one job's end.
const MERGE_WINDOW: Duration = Duration::from_secs(10);

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
    pub(crate) fn new(t0: Instant) -> Self {
        Self {
            log: Arc::new(OutcomeLog {
                t0,
                rows: Mutex::new(VecDeque::new()),
            }),
        }
    }

    /// Records a job's result under its id: `OK` for `Ok`, else the error's stable
    /// [`code`](JobError::code) with its text (the body's own error `E` included). Never
    /// blocks on the supervisor (one short lock of the console's own list).
    pub fn record<T, E: fmt::Display>(&self, job_id: &str, result: &Result<T, JobError<E>>) {
        match result {
            Ok(_) => self.log.reported(job_id, "OK", None),
            Err(err) => {
                // What failed, then each part's own account: "job got no slot: ...",
                // "job failed: job cancelled", "...: job body failed; cleanup unconfirmed ...".
                let mut parts: Vec<String> = Vec::new();
                if let Some(acquire) = err.acquire_error() {
                    parts.push(acquire.to_string());
                }
                if let Some(body) = err.body_error() {
                    match body.error() {
                        Some(own) => parts.push(format!("{body}: {own}")),
                        None => parts.push(body.to_string()),
                    }
                }
                if let Some(cleanup) = err.cleanup_error() {
                    parts.push(cleanup.to_string());
                }
                let detail = if parts.is_empty() {
                    err.to_string()
                } else {
                    format!("{err}: {}", parts.join("; "))
                };
                self.log.reported(job_id, err.code(), Some(detail));
            }
        }
    }

    pub(crate) fn log(&self) -> &OutcomeLog {
        &self.log
    }
}

/// One row of the list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Outcome {
    /// When it was first known (reported or observed), in ms since the console started.
    pub(crate) at_ms: u64,
    #[serde(serialize_with = "super::json::arc_str")]
    pub(crate) job_id: Arc<str>,
    /// The stable code (`OK` for a success); `None` until the embedder reports it.
    #[serde(serialize_with = "super::json::opt_arc_str")]
    pub(crate) code: Option<Arc<str>>,
    pub(crate) detail: Option<String>,
    /// The slot its lease held, when the console saw it.
    pub(crate) slot: Option<u32>,
    /// How long its lease was held, as last seen.
    pub(crate) held_ms: Option<u64>,
    /// The phase its lease was last seen in before it left the table.
    pub(crate) last_phase: Option<&'static str>,
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
}

pub(crate) struct OutcomeLog {
    t0: Instant,
    rows: Mutex<VecDeque<Outcome>>,
}

impl OutcomeLog {
    fn new_row(&self, job_id: Arc<str>, now: Instant) -> Outcome {
        Outcome {
            at_ms: now.saturating_duration_since(self.t0).as_millis() as u64,
            job_id,
            code: None,
            detail: None,
            slot: None,
            held_ms: None,
            last_phase: None,
            at: now,
            reported: false,
            observed: false,
        }
    }

    /// The newest row of that job id that still lacks `which` and is recent enough to be the
    /// same end.
    fn find<'a>(
        rows: &'a mut VecDeque<Outcome>,
        job_id: &str,
        now: Instant,
        which: impl Fn(&Outcome) -> bool,
    ) -> Option<&'a mut Outcome> {
        rows.iter_mut().rev().find(|row| {
            &*row.job_id == job_id
                && !which(row)
                && now.saturating_duration_since(row.at) <= MERGE_WINDOW
        })
    }

    fn push(rows: &mut VecDeque<Outcome>, row: Outcome) {
        rows.push_back(row);
        while rows.len() > KEPT {
            rows.pop_front();
        }
    }

    pub(crate) fn reported(&self, job_id: &str, code: &str, detail: Option<String>) {
        let now = Instant::now();
        let detail = detail.map(|d| match d.char_indices().nth(MAX_DETAIL) {
            Some((cut, _)) => format!("{}...", &d[..cut]),
            None => d,
        });
        let mut rows = self.rows.lock();
        let row = match Self::find(&mut rows, job_id, now, |r| r.reported) {
            Some(row) => row,
            None => {
                let row = self.new_row(Arc::from(job_id), now);
                Self::push(&mut rows, row);
                rows.back_mut().expect("just pushed")
            }
        };
        row.code = Some(Arc::from(code));
        row.detail = detail;
        row.reported = true;
    }

    pub(crate) fn observed(&self, ended: Ended, now: Instant) {
        let mut rows = self.rows.lock();
        let row = match Self::find(&mut rows, &ended.job_id, now, |r| r.observed) {
            Some(row) => row,
            None => {
                let row = self.new_row(Arc::clone(&ended.job_id), now);
                Self::push(&mut rows, row);
                rows.back_mut().expect("just pushed")
            }
        };
        row.slot = Some(ended.slot);
        row.held_ms = Some(ended.held.as_millis() as u64);
        row.last_phase = Some(ended.last_phase);
        row.observed = true;
    }

    /// The rows, newest first.
    pub(crate) fn snapshot(&self) -> Vec<Outcome> {
        self.rows.lock().iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold::{AcquireError, JobError};

    fn ended(job: &str) -> Ended {
        Ended {
            job_id: Arc::from(job),
            slot: 1,
            held: Duration::from_millis(1500),
            last_phase: "draining",
        }
    }

    #[test]
    fn a_report_and_an_observation_of_one_job_make_one_row_in_either_order() {
        let outcomes = Outcomes::new(Instant::now());
        let log = outcomes.log();
        outcomes.record("a", &Ok::<_, JobError<std::io::Error>>(()));
        log.observed(ended("a"), Instant::now());
        log.observed(ended("b"), Instant::now());
        let err: Result<(), JobError<std::io::Error>> =
            Err(JobError::Acquire(AcquireError::Cancelled));
        outcomes.record("b", &err);
        let rows = log.snapshot();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(&*rows[0].job_id, "b");
        assert_eq!(rows[0].code.as_deref(), Some("LEASE_ACQUIRE_CANCELLED"));
        assert_eq!(rows[0].slot, Some(1));
        assert_eq!(rows[0].held_ms, Some(1500));
        assert_eq!(&*rows[1].job_id, "a");
        assert_eq!(rows[1].code.as_deref(), Some("OK"));
        assert_eq!(rows[1].last_phase, Some("draining"));
    }

    #[test]
    fn a_second_run_of_the_same_id_is_a_row_of_its_own() {
        let outcomes = Outcomes::new(Instant::now());
        let log = outcomes.log();
        log.observed(ended("a"), Instant::now());
        outcomes.record("a", &Ok::<_, JobError<std::io::Error>>(()));
        log.observed(ended("a"), Instant::now());
        let rows = log.snapshot();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!(rows[0].code, None);
        assert_eq!(rows[1].code.as_deref(), Some("OK"));
    }

    #[test]
    fn the_list_keeps_the_newest_rows() {
        let outcomes = Outcomes::new(Instant::now());
        for i in 0..(KEPT + 5) {
            outcomes.record(&format!("j{i}"), &Ok::<_, JobError<std::io::Error>>(()));
        }
        let rows = outcomes.log().snapshot();
        assert_eq!(rows.len(), KEPT);
        assert_eq!(&*rows[0].job_id, format!("j{}", KEPT + 4));
    }
}
