//! Guides: how-tos that span several types, one page each.
//!
//! The reference lives with the types and modules: [`Supervisor`](crate::Supervisor) (the
//! release pipeline, shutdown, what happens when), [`broker`](crate::broker) (custom brokers and
//! their conformance suite), [`process`](crate::process) (child processes) and
//! [`error`](crate::error) (the error types and their [codes](crate::codes)). These pages show
//! how the parts are used together; every example on them is a doctest.
//!
//! | page | what it shows |
//! |---|---|
//! | [`quickstart`] | the API in one screen: a job, a failing job, a cancelled job, a shutdown |
//! | [`explicit_lease`] | a [`Lease`](crate::Lease) for code that cannot put its work in a closure |
//! | [`frame_loop`] | a game loop that never awaits: [`submit`](crate::Supervisor::submit) and a [`JobHandle`](crate::JobHandle) polled once a frame |
//! | [`job_actors`] | an engine's own ractor actors as jobs, and leases by message |
//! | [`pool_controls`] | the lease table, cancel by id, priorities, several slots, try, resize |
//! | [`metrics`] | the `render_slot.*` metrics, Prometheus, the job spans |
//! | [`console`] | the live web console (crate `leasehold-console`) |
//! | [`etcd`] | slots shared by processes on several hosts (crate `leasehold-etcd`) |
//! | [`troubleshooting`] | no GPU adapter, a slot that stays quarantined |
//!
//! The pages are the files of the repository's `docs/` folder.

#[doc = include_str!("../docs/quickstart.md")]
pub mod quickstart {}

#[doc = include_str!("../docs/explicit_lease.md")]
pub mod explicit_lease {}

#[doc = include_str!("../docs/frame_loop.md")]
pub mod frame_loop {}

#[doc = include_str!("../docs/job_actors.md")]
pub mod job_actors {}

#[doc = include_str!("../docs/pool_controls.md")]
pub mod pool_controls {}

#[doc = include_str!("../docs/metrics.md")]
pub mod metrics {}

#[doc = include_str!("../docs/console.md")]
pub mod console {}

#[doc = include_str!("../docs/etcd.md")]
pub mod etcd {}

#[doc = include_str!("../docs/troubleshooting.md")]
pub mod troubleshooting {}
