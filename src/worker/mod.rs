//! The worker: an actor linked to the supervisor that runs one job body, and the
//! [`WorkerContext`] through which the body spawns tracked work.
//!
//! A worker never returns its slot. It only ends; the supervisor proves the end physically (the
//! actor task's join handle, every tracked task) before it touches the temp dir or the broker.
//! What the worker tells the supervisor goes through [`JobReports`], which the supervisor
//! implements: the worker knows nothing of the supervisor above it.

mod actor;
mod context;
mod shared;

pub(crate) use actor::{BoxedBody, WorkerActor, WorkerArgs};
pub use context::WorkerContext;

pub(crate) use shared::JobShared;

use crate::error::PrepareError;
use crate::process::Evidence;

/// What a job's machinery (its context, its process keepers, its worker) reports about its
/// lease to whoever runs it: the supervisor implements it, each report an input to its core.
pub(crate) trait JobReports: Send + Sync + 'static {
    /// A job started a process group (its leader's pid, also the group's id): the slot now
    /// waits for it too. Returns the group's key, for [`process_ended`](Self::process_ended).
    fn process_started(&self, pid: u32) -> u64;

    /// A process group's keeper ended: the group proven empty (`None`), or what is known of
    /// what may remain.
    fn process_ended(&self, process: u64, unproven: Option<Box<dyn Evidence>>);

    /// The worker could not prepare the job: no body runs.
    #[cfg_attr(not(feature = "gpu"), allow(dead_code))]
    fn unprepared(&self, why: PrepareError);
}
