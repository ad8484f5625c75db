//! Where failures go when no caller is left to hear them.

use std::fmt;
use std::sync::Arc;

use crate::broker::SlotToken;
use crate::error::CleanupError;

/// A cleanup failure that had no caller left: a dropped [`Lease`](crate::Lease), a `run` future
/// dropped before its release finished, a late release of a quarantined slot.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct OrphanedFailure {
    /// The job, when the lease belonged to one.
    pub job_id: Option<String>,
    /// The token concerned.
    pub token: SlotToken,
    /// What failed.
    pub error: CleanupError,
}

impl fmt::Display for OrphanedFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.job_id {
            Some(job) => write!(f, "job {job} ({}): {}", self.token, self.error),
            None => write!(f, "{}: {}", self.token, self.error),
        }
    }
}

/// The user's error sink: called on the supervisor's task, so it must be quick and must not
/// block (hand the failure to a channel if it needs I/O).
pub(crate) type ErrorSink = Arc<dyn Fn(&OrphanedFailure) + Send + Sync>;

/// Reports a cleanup failure that has no caller left: a `tracing` error event, then the user's
/// error sink (a panicking sink is caught: it must not take the supervisor down). The
/// `render_slot.release.failed.count` metric is counted where the release ended.
pub(crate) fn report_orphaned(
    sink: Option<&ErrorSink>,
    job_id: Option<String>,
    error: CleanupError,
) {
    let Some(token) = error.token() else {
        tracing::error!(job_id = job_id.as_deref(), code = error.code(), %error, "cleanup failed with no caller left");
        return;
    };
    tracing::error!(job_id = job_id.as_deref(), %token, code = error.code(), %error, "cleanup failed with no caller left");
    if let Some(sink) = sink {
        let failure = OrphanedFailure {
            job_id,
            token,
            error,
        };
        if let Err(panic) = crate::outside::call(|| sink(&failure)) {
            tracing::error!(%panic, "the error sink panicked");
        }
    }
}
