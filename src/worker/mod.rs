//! The worker: an actor linked to the supervisor that runs one job body, and the
//! [`WorkerContext`] through which the body spawns tracked work.
//!
//! A worker never returns its slot. It only ends; the supervisor proves the end physically (the
//! actor task's join handle, the supervision event, every tracked task) before it touches the
//! temp dir or the broker.

mod actor;
mod context;
mod paths;
mod shared;

#[cfg(test)]
pub(crate) use actor::SPAWN_REFUSED_FOR_TEST;
pub(crate) use actor::{BoxedBody, WorkerActor, WorkerArgs};
pub use context::WorkerContext;
pub(crate) use paths::confine;
pub use paths::{PathRefused, PathRefusedReason};
pub(crate) use shared::JobShared;
