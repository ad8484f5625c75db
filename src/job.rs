//! The API boundary: a job is validated before anything is acquired.

use std::fmt;

use tokio_util::sync::CancellationToken;

/// Longest job id accepted by [`JobSpec::new`].
pub const MAX_JOB_ID_LEN: usize = 128;

/// A validated description of one job: its id and, optionally, a cancellation token.
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
        Ok(Self { id, cancel: None })
    }

    /// Attaches a cancellation token. Cancelling it is a *request*: the body sees it through
    /// [`WorkerContext::cancelled`](crate::WorkerContext::cancelled), and the slot still returns
    /// only after the worker has physically finished.
    #[must_use]
    pub fn with_cancel(mut self, token: CancellationToken) -> Self {
        self.cancel = Some(token);
        self
    }

    /// The job id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The caller's cancellation token, if one was attached.
    pub fn cancel_token(&self) -> Option<&CancellationToken> {
        self.cancel.as_ref()
    }

    pub(crate) fn into_parts(self) -> (String, Option<CancellationToken>) {
        (self.id, self.cancel)
    }
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
