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

use leasehold::{BodyErrorKind, JobError};

use crate::ConsoleError;

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

/// The longest label [`JobNote::label`] takes, in characters.
pub const MAX_LABEL_LEN: usize = 32;

/// A cheap-clone handle that feeds the console's history with each job's stable code, and
/// with what the embedder says about it.
///
/// The supervisor's public API has no feed of job results (a result goes to the job's own
/// caller), so the console sees a job end only as its lease leaving
/// [`Supervisor::leases`](leasehold::Supervisor::leases), sampled ten times a second, without the
/// code. A caller that hands its results to [`record`](Self::record) gets the code shown on
/// that row (`OK` for a success), and a row for every job, also one too short to be sampled or
/// one that never got a slot. [`record_with`](Self::record_with) also takes the embedder's own
/// word on the job ([`JobNote`]): a label of its own (a job that returned early as `SKIPPED`),
/// a note, and the slot and lease the job held. Optional: without it the list still shows
/// every job end the console observed, marked "code not reported".
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

/// What an embedder says about a job's end beyond its `Result`, for
/// [`Outcomes::record_with`]: a label of its own, a note, and the slot and lease the job held.
///
/// - The **label** names how the job ended in the embedder's words: render_farm's `SKIPPED`
///   for a frame that was already rendered (its `Result` is `Ok`, its code `OK`). The history
///   shows the label in place of the code (the code stays in the row's detail, and the filter
///   by code finds either).
/// - The **note** is one line of the embedder's own (`frames/mandel.png already rendered`),
///   shown beside the row; cut to a few hundred characters.
/// - The **slot** and **lease** are what the job's body saw
///   ([`WorkerContext::slot_id`](leasehold::WorkerContext::slot_id),
///   [`WorkerContext::lease_id`](leasehold::WorkerContext::lease_id)): a job that ends within
///   one sample (0.1 s) is never seen holding its slot by the console, and shows it only so.
///   With the lease, the report and the console's own observation of that lease are one row
///   for certain.
///
/// # Examples
///
/// ```
/// use leasehold_console::JobNote;
///
/// let note = JobNote::new()
///     .label("SKIPPED")?
///     .note("frames/mandel.png already rendered")
///     .slot(1)
///     .lease(42);
/// assert_eq!(JobNote::new().label("not a label!").unwrap_err().code(), "CONSOLE_LABEL_INVALID");
/// # let _ = note;
/// # Ok::<(), leasehold_console::ConsoleError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobNote {
    label: Option<Arc<str>>,
    note: Option<String>,
    slot: Option<u32>,
    lease_id: Option<u64>,
}

impl JobNote {
    /// A note that says nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The embedder's label for how the job ended: 1 to [`MAX_LABEL_LEN`] ASCII letters,
    /// digits, `_` or `-` (it is shown where a stable code is, and filtered like one).
    ///
    /// # Errors
    ///
    /// [`ConsoleError::InvalidLabel`] (`CONSOLE_LABEL_INVALID`) for an empty or longer label,
    /// or one with another character.
    pub fn label(mut self, label: &str) -> Result<Self, ConsoleError> {
        if label.is_empty() || label.len() > MAX_LABEL_LEN {
            return Err(ConsoleError::InvalidLabel {
                why: "a label is 1 to 32 characters",
            });
        }
        if !label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        {
            return Err(ConsoleError::InvalidLabel {
                why: "a label is made of ASCII letters, digits, `_` and `-`",
            });
        }
        self.label = Some(Arc::from(label));
        Ok(self)
    }

    /// One line of the embedder's own about the job (cut to a few hundred characters).
    pub fn note(mut self, note: impl Into<String>) -> Self {
        self.note = Some(cut(note.into()));
        self
    }

    /// The slot the job held ([`WorkerContext::slot_id`](leasehold::WorkerContext::slot_id)).
    pub fn slot(mut self, slot: u32) -> Self {
        self.slot = Some(slot);
        self
    }

    /// The lease the job held ([`WorkerContext::lease_id`](leasehold::WorkerContext::lease_id)).
    pub fn lease(mut self, lease_id: u64) -> Self {
        self.lease_id = Some(lease_id);
        self
    }
}

impl Outcomes {
    pub(crate) fn new(t0: Instant, capacity: usize) -> Self {
        Self {
            log: Arc::new(OutcomeLog {
                t0,
                capacity: capacity.max(RECENT),
                rows: Mutex::new(VecDeque::new()),
                next_seq: std::sync::atomic::AtomicU64::new(1),
                version: std::sync::atomic::AtomicU64::new(0),
            }),
        }
    }

    /// Records a job's result under its id: `OK` for `Ok`, else the error's stable
    /// [`code`](JobError::code) with its text (the body's own error `E` included). Never
    /// blocks on the supervisor (one short lock of the console's own list).
    pub fn record<T, E: fmt::Display>(&self, job_id: &str, result: &Result<T, JobError<E>>) {
        self.record_with(job_id, result, JobNote::default());
    }

    /// Records a job's result as [`record`](Self::record) does, with the embedder's own word
    /// on it: a label (shown in place of the code: `SKIPPED` for a job that returned early),
    /// a note, and the slot and lease the job held (see [`JobNote`]). Never blocks on the
    /// supervisor.
    ///
    /// # Examples
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use leasehold::{JobSpec, Supervisor};
    /// use leasehold_console::{Console, JobNote};
    ///
    /// let sup = Supervisor::builder().slots(1).start().await?;
    /// let console = Console::builder(sup.clone()).start().await?;
    /// let result = sup
    ///     .run(JobSpec::new("frame-7")?, |ctx| async move {
    ///         Ok::<_, std::io::Error>((ctx.slot_id(), ctx.lease_id()))
    ///     })
    ///     .await;
    /// let mut note = JobNote::new().label("SKIPPED")?.note("frames/7.png already rendered");
    /// if let Ok((slot, lease)) = &result {
    ///     note = note.slot(*slot).lease(*lease);
    /// }
    /// console.outcomes().record_with("frame-7", &result, note);
    /// console.shutdown().await?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub fn record_with<T, E: fmt::Display>(
        &self,
        job_id: &str,
        result: &Result<T, JobError<E>>,
        note: JobNote,
    ) {
        match result {
            Ok(_) => self.log.reported(job_id, "OK", Errors::default(), note),
            Err(err) => self.log.reported(job_id, err.code(), Errors::of(err), note),
        }
    }

    pub(crate) fn log(&self) -> &OutcomeLog {
        &self.log
    }
}

/// A text cut to [`MAX_DETAIL`] characters.
fn cut(text: String) -> String {
    match text.char_indices().nth(MAX_DETAIL) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

/// An error's text with the sources its text does not already say, each once.
fn with_sources(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !more.is_empty() && !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// What a failed job's result said, each part on its own (texts cut to a few hundred
/// characters). Each part is one phrase: the most specific words for that failure, without
/// the generic words around it ("job failed: job body failed: ...").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub(crate) struct Errors {
    /// The error's own summary (`job failed`, `job got no slot`, ...).
    pub(crate) summary: Option<String>,
    /// Why it got no slot.
    pub(crate) acquire: Option<String>,
    /// Why it got a slot but no body ran.
    pub(crate) prepare: Option<String>,
    /// The body's failure: the body's own error, or what won over it (a panic, a lost lease).
    pub(crate) body: Option<String>,
    /// The cleanup's failure: next to the body's when both failed.
    pub(crate) cleanup: Option<String>,
}

impl Errors {
    fn of<E: fmt::Display>(err: &JobError<E>) -> Self {
        let body = err.body_error().map(|body| {
            let own = body.error().map(ToString::to_string);
            match (body.kind(), own) {
                // The code says failed or cancelled: the body's own words say the rest.
                (BodyErrorKind::Failed | BodyErrorKind::Cancelled, Some(own)) => own,
                (_, Some(own)) => format!("{body} (its error: {own})"),
                (_, None) => body.to_string(),
            }
        });
        let acquire = err.acquire_error().map(|e| with_sources(e));
        let prepare = err.prepare_error().map(|e| with_sources(e));
        let cleanup = err.cleanup_error().map(|e| with_sources(e));
        let summary = match err {
            JobError::Invalid(invalid) => format!("{err}: {invalid}"),
            _ => err.to_string(),
        };
        Self {
            summary: Some(summary),
            acquire,
            prepare,
            body,
            cleanup,
        }
    }

    fn cut(self) -> Self {
        Self {
            summary: self.summary.map(cut),
            acquire: self.acquire.map(cut),
            prepare: self.prepare.map(cut),
            body: self.body.map(cut),
            cleanup: self.cleanup.map(cut),
        }
    }

    /// One line: each part's phrase, or the summary when there is no part.
    fn line(&self) -> Option<String> {
        let parts: Vec<&str> = [&self.acquire, &self.prepare, &self.body, &self.cleanup]
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect();
        if parts.is_empty() {
            self.summary.clone()
        } else {
            Some(cut(parts.join("; ")))
        }
    }
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
    /// The row's place in the history: a later row has a larger one (the history's pages are
    /// cut at it, so that a page does not shift while newer rows arrive).
    pub(crate) seq: u64,
    /// When it was first known (reported or observed), in ms since the console started.
    pub(crate) at_ms: u64,
    #[serde(serialize_with = "super::json::arc_str")]
    pub(crate) job_id: Arc<str>,
    /// The stable code (`OK` for a success); `None` until the embedder reports it.
    #[serde(serialize_with = "super::json::opt_arc_str")]
    pub(crate) code: Option<Arc<str>>,
    /// The embedder's label ([`JobNote::label`]), shown in place of the code.
    #[serde(serialize_with = "super::json::opt_arc_str")]
    pub(crate) label: Option<Arc<str>>,
    /// The embedder's note ([`JobNote::note`]).
    pub(crate) note: Option<String>,
    /// One line: each error's phrase.
    pub(crate) detail: Option<String>,
    /// Each part of a failure on its own.
    pub(crate) errors: Errors,
    /// The slot its lease held, as the console saw it or the embedder said.
    pub(crate) slot: Option<u32>,
    /// Its lease, as the console saw it or the embedder said.
    pub(crate) lease_id: Option<u64>,
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
    /// The next row's `seq`.
    next_seq: std::sync::atomic::AtomicU64,
    /// One more at every change of the rows.
    version: std::sync::atomic::AtomicU64,
}

/// One page of the history: its rows, newest first, and where it stands.
#[derive(Debug, Serialize)]
pub(crate) struct Page {
    /// The rows of this page, newest first.
    pub(crate) rows: Vec<Outcome>,
    /// How many rows the history holds.
    pub(crate) total: usize,
    /// How many rows match the filter, in all.
    pub(crate) matched: usize,
    /// How many matching rows are newer than this page's first.
    pub(crate) newer: usize,
}

impl OutcomeLog {
    fn new_row(&self, job_id: Arc<str>, now: Instant) -> Outcome {
        Outcome {
            // Relaxed: a counter taken under the rows' lock, which orders it.
            seq: self
                .next_seq
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            at_ms: now.saturating_duration_since(self.t0).as_millis() as u64,
            job_id,
            code: None,
            label: None,
            note: None,
            detail: None,
            errors: Errors::default(),
            slot: None,
            lease_id: None,
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

    pub(crate) fn reported(&self, job_id: &str, code: &str, errors: Errors, note: JobNote) {
        let now = Instant::now();
        let errors = errors.cut();
        let detail = errors.line();
        let mut rows = self.rows.lock();
        // The end the console saw of this job id, if it has not been matched to a report yet:
        // the observation of the very lease the embedder names, or without one, a recent end
        // (a report comes when the caller hears, right after the lease left).
        let recent = |r: &Outcome| now.saturating_duration_since(r.at) <= MERGE_WINDOW;
        let same_lease = |r: &Outcome| match note.lease_id {
            Some(lease) => r.lease_id == Some(lease),
            None => recent(r),
        };
        let row = match Self::find(&mut rows, job_id, |r| r.reported, same_lease) {
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
        row.label = note.label;
        row.note = note.note;
        // What the console saw of the lease stands; the embedder's word fills what it did not.
        row.slot = row.slot.or(note.slot);
        row.lease_id = row.lease_id.or(note.lease_id);
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
        let lease = ended.timings.lease_id;
        // A report that names this lease is this lease's end. Else a report of this job id
        // made while its lease was held (and naming no other lease) is, however long the
        // lease stayed afterwards (a slot quarantined for minutes): the lease started `held`
        // before now, and a report of an earlier run came before that.
        // `held` is the previous sample's (up to a sample old), and a short job reports about
        // when its lease starts: a second of slack. A report of an earlier run of the same id
        // has its own observation already, or is older than that.
        let started = now.checked_sub(ended.held + START_SLACK).unwrap_or(self.t0);
        let belongs = |r: &Outcome| match r.lease_id {
            Some(reported) => reported == lease,
            None => r.at >= started,
        };
        let row = match Self::find(&mut rows, &ended.job_id, |r| r.observed, belongs) {
            Some(row) => row,
            None => {
                let row = self.new_row(Arc::clone(&ended.job_id), now);
                self.push(&mut rows, row);
                rows.back_mut().expect("just pushed")
            }
        };
        row.slot = Some(ended.slot);
        row.lease_id = Some(lease);
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

    /// One page of the rows whose code or label is `code` (`unreported`: no code yet) and
    /// whose job id contains `search`, newest first: at most `limit` of those older than the
    /// row `before` (all when `None`).
    pub(crate) fn query(
        &self,
        code: Option<&str>,
        search: &str,
        before: Option<u64>,
        limit: usize,
    ) -> Page {
        let rows = self.rows.lock();
        let matching = || {
            rows.iter()
                .rev()
                .filter(|r| match code {
                    None => true,
                    Some("unreported") => r.code.is_none(),
                    Some(code) => {
                        r.code.as_deref() == Some(code) || r.label.as_deref() == Some(code)
                    }
                })
                .filter(|r| r.job_id.contains(search))
        };
        let older = |r: &&Outcome| before.is_none_or(|b| r.seq < b);
        Page {
            rows: matching().filter(older).take(limit).cloned().collect(),
            total: rows.len(),
            matched: matching().count(),
            newer: matching().filter(|r| !older(r)).count(),
        }
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
        let ids = |page: &Page| {
            page.rows
                .iter()
                .map(|r| r.job_id.to_string())
                .collect::<Vec<_>>()
        };
        let all = log.query(None, "", None, 100);
        assert_eq!(
            (all.rows.len(), all.total, all.matched),
            (20, 20, 20),
            "the ring keeps 20"
        );
        assert_eq!(&*all.rows[0].job_id, "bake-24");
        let cancelled = log.query(Some("LEASE_ACQUIRE_CANCELLED"), "", None, 100);
        assert_eq!(
            ids(&cancelled),
            ["render-20", "render-15", "render-10", "render-5"]
        );
        let found = log.query(None, "bake-2", None, 100);
        assert_eq!(ids(&found), ["bake-24", "bake-23", "bake-22", "bake-21"]);
        assert_eq!(log.query(Some("unreported"), "", None, 100).rows.len(), 0);
        assert_eq!(log.query(None, "", None, 3).rows.len(), 3, "the limit");
    }

    /// A page is cut at a row, not at a count: rows that arrive while the user reads an older
    /// page do not shift it.
    #[test]
    fn a_page_of_older_rows_stays_put_while_newer_rows_arrive() {
        let outcomes = outcomes(100);
        let ok = Ok::<_, JobError<std::io::Error>>(());
        for i in 0..30 {
            outcomes.record(&format!("job-{i:02}"), &ok);
        }
        let log = outcomes.log();
        let first = log.query(None, "", None, 10);
        assert_eq!((first.newer, first.matched), (0, 30));
        let cursor = first.rows.last().unwrap().seq;
        let second = log.query(None, "", Some(cursor), 10);
        assert_eq!(&*second.rows[0].job_id, "job-19");
        assert_eq!(second.newer, 10, "rows 11-20 of 30");
        for i in 30..35 {
            outcomes.record(&format!("job-{i:02}"), &ok);
        }
        let again = log.query(None, "", Some(cursor), 10);
        assert_eq!(again.rows, second.rows, "the older page did not move");
        assert_eq!((again.newer, again.matched), (15, 35));
        // A filter counts its own rows: job-10..19 are all older than the cursor.
        let filtered = log.query(None, "job-1", Some(cursor), 5);
        assert_eq!(&*filtered.rows[0].job_id, "job-19");
        assert_eq!((filtered.newer, filtered.matched), (0, 10));
    }

    #[test]
    fn an_embedders_label_note_and_slot_show_on_the_row_and_its_lease_merges_exactly() {
        let outcomes = outcomes(DEFAULT_HISTORY);
        let log = outcomes.log();
        let note = JobNote::new()
            .label("SKIPPED")
            .unwrap()
            .note("frames/a.png already rendered")
            .slot(3)
            .lease(77);
        outcomes.record_with("frame-a", &Ok::<_, JobError<std::io::Error>>(()), note);
        // Another run of the same id, observed: its lease is not 77, so it is a row of its own.
        let mut other = ended("frame-a", Duration::from_secs(5));
        other.timings.lease_id = 78;
        log.observed(other, Instant::now());
        let mut same = ended("frame-a", Duration::from_secs(5));
        same.timings.lease_id = 77;
        same.slot = 3;
        log.observed(same, Instant::now());
        let rows = log.recent(10);
        assert_eq!(rows.len(), 2, "{rows:?}");
        let reported = rows.iter().find(|r| r.code.is_some()).unwrap();
        assert_eq!(reported.label.as_deref(), Some("SKIPPED"));
        assert_eq!(reported.code.as_deref(), Some("OK"));
        assert_eq!(
            reported.note.as_deref(),
            Some("frames/a.png already rendered")
        );
        assert_eq!((reported.slot, reported.lease_id), (Some(3), Some(77)));
        assert!(
            reported.timings.is_some(),
            "merged with its own lease's observation"
        );
        let observed = rows.iter().find(|r| r.code.is_none()).unwrap();
        assert_eq!(observed.lease_id, Some(78));
        // The filter by code finds the label too.
        assert_eq!(log.query(Some("SKIPPED"), "", None, 10).rows.len(), 1);
        // A job too short to be sampled shows the slot its body saw.
        outcomes.record_with(
            "short",
            &Ok::<_, JobError<std::io::Error>>(()),
            JobNote::new().slot(5),
        );
        assert_eq!(log.recent(1)[0].slot, Some(5));
    }

    #[test]
    fn labels_are_short_words_and_anything_else_is_refused_with_a_code() {
        for ok in [
            "SKIPPED",
            "ok",
            "retry-2",
            "A_B",
            &"X".repeat(MAX_LABEL_LEN),
        ] {
            assert!(JobNote::new().label(ok).is_ok(), "{ok}");
        }
        for bad in ["", "two words", "<b>", "é", &"X".repeat(MAX_LABEL_LEN + 1)] {
            let err = JobNote::new().label(bad).unwrap_err();
            assert_eq!(err.code(), "CONSOLE_LABEL_INVALID", "{bad:?}");
        }
    }

    /// "job failed: job body failed: scene file: ..." said three times that the job failed:
    /// each part is one phrase now.
    #[test]
    fn each_error_is_one_phrase_without_the_generic_words_around_it() {
        let outcomes = outcomes(DEFAULT_HISTORY);
        let log = outcomes.log();
        let acquire: Result<(), JobError<std::io::Error>> =
            Err(JobError::Acquire(AcquireError::TimedOut {
                after: Duration::from_secs(5),
            }));
        outcomes.record("late", &acquire);
        let row = log.recent(1).remove(0);
        assert_eq!(row.detail.as_deref(), Some("no slot within 5s"));
        assert_eq!(row.errors.summary.as_deref(), Some("job got no slot"));
    }
}
