//! The supervisor: a cheap-clone handle ([`Supervisor`]) in front of one actor that owns every
//! slot token.

mod actor;
mod builder;
pub(crate) mod core;
mod desk;
#[cfg(test)]
mod fs_tests;
mod handle;
pub(crate) mod inbox;
mod job_handle;
#[cfg(test)]
mod keep_tests;
#[cfg(test)]
mod link_tests;
pub(crate) mod messages;
mod reporter;
mod reports;
#[cfg(test)]
mod sim_tests;
mod state;
mod stats;
mod table;
#[cfg(all(test, feature = "gpu"))]
mod turn_drop_tests;
mod waiting;

pub use builder::SupervisorBuilder;
pub use desk::{ActorLease, LeaseMsg, ReleaseError};
pub use handle::{SpawnedJob, Supervisor};
pub use job_handle::JobHandle;
pub use reports::{QuarantinedSlot, ReclaimReport, ShutdownReport, UnclosedDevice, WaiterInfo};
pub use stats::Stats;
pub use table::{LeaseInfo, LeaseKind, LeasePhase, WaitingFor};
