//! The API boundary: a job is validated before anything is acquired.

use std::fmt;

use tokio_util::sync::CancellationToken;

/// Longest job id accepted by [`JobSpec::new`].
pub const MAX_JOB_ID_LEN: usize = 128;

/// A validated description of one job: its id and, optionally, a cancellation token, a
/// [`Priority`] and a number of slots.
///
/// The id must match `^[A-Za-z0-9_.:-]{1,128}$`. It names the job in traces and metrics and
/// prefixes its temp dir, which is always a fresh directory strictly inside the work root
/// (`.` and `..` are valid ids and cannot escape it).
///
/// # Examples
///
/// ```
/// use leasehold::JobSpec;
///
/// let job = JobSpec::new("render-0001")?;
/// assert_eq!(job.id(), "render-0001");
/// assert_eq!(JobSpec::new("a/b").unwrap_err().code(), "JOB_INVALID");
/// # Ok::<(), leasehold::InvalidJob>(())
/// ```
#[derive(Debug, Clone)]
pub struct JobSpec {
    id: String,
    cancel: Option<CancellationToken>,
    priority: Priority,
    slots: u32,
}

/// How many grants a waiter of one class lets pass to higher classes that arrived after it,
/// per class between them, before it is served (see [`Priority`]).
pub const PRIORITY_AGING_GRANTS: u64 = 8;

/// A waiter's priority class: [`High`](Self::High), [`Normal`](Self::Normal) (the default) or
/// [`Low`](Self::Low).
///
/// Waiters are served FIFO within a class. Across classes, a waiter that joins the queue when
/// the supervisor has made `g` grants gets the deadline `g + rank × PRIORITY_AGING_GRANTS`
/// (rank 0 for `High`, 1 for `Normal`, 2 for `Low`), and the waiter with the earliest deadline
/// is served next (the earlier caller on a tie). So a higher class overtakes a lower one, but
/// starvation is bounded: a `Low` waiter is overtaken only by waiters already queued when it
/// arrived and by those that arrive within the next `2 × PRIORITY_AGING_GRANTS` grants (a
/// `Normal` waiter: within the next `PRIORITY_AGING_GRANTS`). With one class in use the queue
/// is plain FIFO.
///
/// A waiter that needs several slots (see [`JobSpec::with_slots`]) holds the head of the queue
/// once it is chosen: the slots freed while it gathers go to it, whatever arrives meanwhile.
///
/// # Examples
///
/// ```
/// use leasehold::{JobSpec, Priority};
///
/// let preview = JobSpec::new("preview-7")?.with_priority(Priority::High);
/// assert_eq!(preview.priority(), Priority::High);
/// assert_eq!(JobSpec::new("bake")?.priority(), Priority::Normal);
/// # Ok::<(), leasehold::InvalidJob>(())
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Priority {
    /// Served first (interactive work: the frame the player waits for).
    High,
    /// The default.
    #[default]
    Normal,
    /// Served last, within the aging bound (background bakes).
    Low,
}

impl Priority {
    /// How many classes there are.
    pub(crate) const COUNT: usize = 3;

    /// 0 for the highest class.
    pub(crate) fn rank(self) -> usize {
        match self {
            Self::High => 0,
            Self::Normal => 1,
            Self::Low => 2,
        }
    }
}

impl JobSpec {
    /// Validates `id` and builds a spec with no cancellation token.
    ///
    /// # Errors
    ///
    /// [`InvalidJob`] (code `JOB_INVALID`) when the id is empty, longer than
    /// [`MAX_JOB_ID_LEN`] bytes, or holds a character outside `A-Za-z0-9_.:-`.
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidJob> {
        let id = id.into();
        validate_id(&id)?;
        Ok(Self {
            id,
            cancel: None,
            priority: Priority::Normal,
            slots: 1,
        })
    }

    /// Attaches a cancellation token. Cancelling it is a *request*: the body sees it through
    /// [`WorkerContext::cancelled`](crate::WorkerContext::cancelled), and the slot still returns
    /// only after the worker has physically finished.
    #[must_use]
    pub fn with_cancel(mut self, token: CancellationToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// Sets the job's priority class (default [`Priority::Normal`]).
    #[must_use]
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = priority;
        self
    }

    /// Asks for `slots` slots at once (default 1): the job starts only when it holds all of
    /// them, and releases them together once it has physically finished. While it waits at the
    /// head of the queue, the slots freed go to it (head-of-line blocking, as with tokio's
    /// `Semaphore::acquire_many`). Supported by the supervisor's in-process pool; a job asking
    /// for 0 slots or for more than the capacity is refused with `LEASE_SLOT_COUNT_INVALID`,
    /// and one asking for more than 1 from another broker with `LEASE_BROKER_UNSUPPORTED`.
    /// The job's context lists every token ([`WorkerContext::tokens`](crate::WorkerContext::tokens)).
    /// With GPU devices the job still gets one GPU placement: its other slots count against the
    /// capacity (so nothing is over-subscribed) but carry no device of their own.
    #[must_use]
    pub fn with_slots(mut self, slots: u32) -> Self {
        self.slots = slots;
        self
    }

    /// The job id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The job's priority class.
    pub fn priority(&self) -> Priority {
        self.priority
    }

    /// How many slots the job asks for.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// The caller's cancellation token, if one was attached.
    pub fn cancel_token(&self) -> Option<&CancellationToken> {
        self.cancel.as_ref()
    }

    pub(crate) fn into_parts(self) -> JobParts {
        JobParts {
            id: self.id,
            cancel: self.cancel,
            priority: self.priority,
            slots: self.slots,
        }
    }
}

/// A spec taken apart by `run`.
pub(crate) struct JobParts {
    pub(crate) id: String,
    pub(crate) cancel: Option<CancellationToken>,
    pub(crate) priority: Priority,
    pub(crate) slots: u32,
}

fn validate_id(id: &str) -> Result<(), InvalidJob> {
    if id.is_empty() {
        return Err(InvalidJob::new(InvalidJobReason::Empty));
    }
    if id.len() > MAX_JOB_ID_LEN {
        return Err(InvalidJob::new(InvalidJobReason::TooLong(id.len())));
    }
    if let Some(c) = id
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
    {
        return Err(InvalidJob::new(InvalidJobReason::BadChar(c)));
    }
    Ok(())
}

/// A job id refused at the boundary; nothing was acquired. Stable code: `JOB_INVALID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidJob {
    reason: InvalidJobReason,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum InvalidJobReason {
    Empty,
    TooLong(usize),
    BadChar(char),
}

impl InvalidJob {
    /// The stable code `"JOB_INVALID"`.
    pub const CODE: &'static str = "JOB_INVALID";

    fn new(reason: InvalidJobReason) -> Self {
        Self { reason }
    }

    /// Always `"JOB_INVALID"`.
    pub fn code(&self) -> &'static str {
        Self::CODE
    }
}

impl fmt::Display for InvalidJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.reason {
            InvalidJobReason::Empty => f.write_str("invalid job id: empty"),
            InvalidJobReason::TooLong(n) => {
                write!(
                    f,
                    "invalid job id: {n} bytes, at most {MAX_JOB_ID_LEN} allowed"
                )
            }
            InvalidJobReason::BadChar(c) => {
                write!(
                    f,
                    "invalid job id: character {c:?} is not in [A-Za-z0-9_.:-]"
                )
            }
        }
    }
}

impl std::error::Error for InvalidJob {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet_and_dot_ids() {
        for id in ["render-0001", ".", "..", "a:b_c.d-e", &"x".repeat(128)] {
            assert!(JobSpec::new(id).is_ok(), "{id:?} should be valid");
        }
    }

    #[test]
    fn refuses_empty_long_and_foreign_characters() {
        for id in ["", "a/b", "../x", "a b", "é", "a\0b", &"x".repeat(129)] {
            let err = JobSpec::new(id).unwrap_err();
            assert_eq!(err.code(), "JOB_INVALID", "{id:?}");
        }
    }
}
