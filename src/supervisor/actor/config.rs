//! The supervisor actor's settings, fixed at start and shared by its rooms.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::hosts::Hosts;
use crate::process::ProcessPolicy;
use crate::sink::Sink;

/// Settings fixed at start.
pub(crate) struct Config {
    pub(crate) cleanup_timeout: Duration,
    pub(crate) cancel_grace: Duration,
    pub(crate) drain_timeout: Option<Duration>,
    pub(crate) shutdown_timeout: Duration,
    pub(crate) work_root: Arc<PathBuf>,
    pub(crate) sink: Sink,
    pub(crate) process_policy: ProcessPolicy,
    pub(crate) hosts: Hosts,
    /// Warn once about a lease held at least this long.
    pub(crate) held_warning: Option<Duration>,
    /// The acquire timeout: a job a grant reaches past its deadline is refused with it.
    pub(crate) acquire_timeout: Option<Duration>,
}
