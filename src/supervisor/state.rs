//! What every clone of a [`Supervisor`](super::Supervisor) handle shares ([`Inner`]: the
//! actor's inbox and the settings the handle applies itself), and what the builder hands a new
//! handle ([`Parts`]). The last clone's drop shuts the supervisor down.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;

use super::inbox::Inbox;
use super::messages::SupMsg;
use super::reports::LastReport;
use super::stats::SharedStats;
use super::table::LeaseTable;

/// The state behind every clone of one handle.
pub(crate) struct Inner {
    pub(super) inbox: Arc<Inbox>,
    pub(super) join: Mutex<Option<JoinHandle<()>>>,
    pub(super) stats: Arc<SharedStats>,
    pub(super) table: Arc<LeaseTable>,
    /// The report of the shutdown that stopped the actor, for a later `shutdown()` call.
    pub(super) last_report: Arc<LastReport>,
    pub(super) acquire_timeout: Option<Duration>,
    /// The shutdown's bound, which `shutdown` also holds what it waits for to.
    pub(super) shutdown_timeout: Duration,
    pub(super) next_waiter: AtomicU64,
    pub(super) work_root: PathBuf,
    /// The runtime the supervisor was started on, for `submit` from non-async code.
    pub(super) runtime: tokio::runtime::Handle,
    /// Where a cleanup failure whose handle is gone is reported (the same sink the actor
    /// reports to).
    pub(super) sink: crate::sink::Sink,
    /// How long a cancelled job actor may take to stop before it is killed.
    pub(super) cancel_grace: Duration,
    /// Its broker is the in-process pool, whose size `resize` changes.
    pub(super) resizable: bool,
    /// The lease desk's actor, spawned on first use (see `desk.rs`).
    pub(crate) desk: tokio::sync::OnceCell<ractor::ActorCell>,
    /// The GPU pool, for `replace_device` and the fault-injection accessors (the actor holds
    /// its own handle).
    #[cfg(feature = "gpu")]
    pub(super) gpu: Option<Arc<crate::gpu::GpuPool>>,
}

/// What the builder hands a new handle: the running actor's ends and the settings the handle
/// itself applies.
pub(super) struct Parts {
    pub(super) inbox: Arc<Inbox>,
    pub(super) join: JoinHandle<()>,
    pub(super) stats: Arc<SharedStats>,
    pub(super) table: Arc<LeaseTable>,
    pub(super) last_report: Arc<LastReport>,
    pub(super) acquire_timeout: Option<Duration>,
    pub(super) cancel_grace: Duration,
    pub(super) shutdown_timeout: Duration,
    pub(super) resizable: bool,
    pub(super) work_root: PathBuf,
    pub(super) sink: crate::sink::Sink,
    #[cfg(feature = "gpu")]
    pub(super) gpu: Option<Arc<crate::gpu::GpuPool>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Last handle gone: shut down, so that the actor does not outlive every way to reach it.
        let _ = self.inbox.send(SupMsg::Shutdown { reply: None });
        if let Some(desk) = self.desk.get() {
            desk.stop(None);
        }
    }
}
