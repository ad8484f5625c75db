//! The end of a supervisor: shutdown's timers, the GPU pool's bounded close, and the end's state:
//! what its report gathers and what is dropped when the actor stops.

use std::mem;
use std::sync::Arc;
use std::time::Duration;

use super::config::Config;
#[cfg(feature = "gpu")]
use crate::outside;
use crate::supervisor::core::{Input, StopTally};
use crate::supervisor::inbox::Inbox;
use crate::supervisor::messages::SupMsg;
use crate::supervisor::reports::{
    EndDrop, LastReport, QuarantinedSlot, ShutdownReport, UnclosedDevice,
};
use crate::supervisor::stats::Stats;

/// Reports the end of the cancel grace and the shutdown's deadline as inputs.
pub(super) fn arm_shutdown_timers(inbox: &Arc<Inbox>, grace: Duration, bound: Duration) {
    let inbox = Arc::clone(inbox);
    tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        if grace < bound {
            tokio::time::sleep(grace).await;
            if inbox.send(SupMsg::Input(Input::ShutdownGraceOver)).is_err() {
                return;
            }
        }
        tokio::time::sleep_until(start + bound).await;
        let _ = inbox.send(SupMsg::Input(Input::ShutdownDeadline));
    });
}

/// Closes the GPU devices off the mailbox, bounded, the outcome reported as
/// `SupMsg::GpuClosed`. `false` when there are none to close (the shell applies
/// `Input::GpuClosed` itself).
#[cfg(feature = "gpu")]
pub(super) fn close_gpu(config: &Config, inbox: &Arc<Inbox>) -> bool {
    let Some(gpu) = &config.hosts.gpu else {
        return false;
    };
    let bound = config.cleanup_timeout;
    let (gpu, inbox) = (Arc::clone(gpu), Arc::clone(inbox));
    // The close bounds itself; this bound is for a close that would not, and the panic
    // catch for a driver that panics while closing.
    let _ = outside::spawn(
        move || gpu.close(bound),
        Some(bound + bound / 10),
        move |outcome| {
            let unclosed = outcome.fold(
                |closed| closed,
                |panic| Err(format!("the devices' close panicked: {panic}")),
                |_| Err("the devices' close did not end within its bound".to_owned()),
            );
            let _ = inbox.send(SupMsg::GpuClosed { unclosed });
        },
    );
    true
}

/// Without the `gpu` feature there are no devices to close.
#[cfg(not(feature = "gpu"))]
pub(super) fn close_gpu(_config: &Config, _inbox: &Arc<Inbox>) -> bool {
    false
}

/// What the end of the supervisor reports and keeps.
pub(super) struct EndState {
    /// GPU devices the shutdown could not prove idle.
    unclosed: Vec<UnclosedDevice>,
    /// Why the broker's close at shutdown failed, timed out or panicked.
    broker_close_failed: Option<crate::broker::BrokerError>,
    owned_root: Option<tempfile::TempDir>,
    /// Whether the owned work root is kept, as the core said when it stopped.
    keep_root: Option<bool>,
    /// Where the shutdown's report is kept for a later `shutdown()` call.
    last_report: Arc<LastReport>,
}

impl EndState {
    pub(super) fn new(owned_root: Option<tempfile::TempDir>, last_report: Arc<LastReport>) -> Self {
        Self {
            unclosed: Vec::new(),
            broker_close_failed: None,
            owned_root,
            keep_root: None,
            last_report,
        }
    }

    /// The GPU close has reported (see [`close_gpu`]).
    pub(super) fn gpu_closed(&mut self, unclosed: Result<Vec<(usize, String)>, String>) {
        let unclosed = match unclosed {
            Ok(devices) => devices
                .into_iter()
                .map(|(device, reason)| UnclosedDevice::new(Some(device), reason))
                .collect(),
            Err(reason) => vec![UnclosedDevice::new(None, reason)],
        };
        for device in unclosed {
            tracing::error!(device = ?device.device, reason = %device.reason, "gpu device not proven idle at shutdown");
            self.unclosed.push(device);
        }
    }

    /// The broker's close has reported.
    pub(super) fn broker_closed(&mut self, failed: Option<crate::broker::BrokerError>) {
        self.broker_close_failed = failed;
    }

    /// The core has stopped: the shutdown's report, kept for a later `shutdown()` call.
    pub(super) fn report(
        &mut self,
        tally: StopTally,
        unproven: Vec<QuarantinedSlot>,
        keep_work_root: bool,
        stats: Stats,
    ) -> ShutdownReport {
        self.keep_root = Some(keep_work_root);
        let report = ShutdownReport {
            refused_waiters: tally.refused_waiters,
            cancelled_jobs: tally.cancelled_jobs,
            released_leases: tally.released_leases,
            quarantined: unproven.len(),
            unproven,
            unclosed_devices: mem::take(&mut self.unclosed),
            broker_close_failed: self.broker_close_failed.take(),
            stats,
            // Filled in by `shutdown`, which waits for the end's drops within its bound.
            outlived: Vec::new(),
        };
        self.last_report.set(report.clone());
        report
    }

    /// Hands what the actor still holds to be dropped off its task (see `EndDrops`), the owned
    /// work root's removal among them unless it is kept (`keep`, asked only when the core has
    /// not said).
    pub(super) fn dispose(&mut self, mut drops: Vec<EndDrop>, keep: impl FnOnce() -> bool) {
        let keep = self.keep_root.unwrap_or_else(keep);
        if let Some(root) = self.owned_root.take() {
            if keep {
                // Quarantined temp dirs are evidence (and a dir a job still uses is not
                // removed under it): keep them.
                let kept = root.keep();
                tracing::warn!(root = %kept.display(), "work root kept: it holds quarantined temp dirs");
            } else {
                drops.push(("the work root's removal", each([root])));
            }
        }
        self.last_report.drops.dispose(drops);
    }
}

/// Values to drop one by one at the end (see `EndDrops`).
pub(super) fn each<T: Send + 'static>(
    values: impl IntoIterator<Item = T>,
) -> Vec<Box<dyn std::any::Any + Send>> {
    values
        .into_iter()
        .map(|v| Box::new(v) as Box<dyn std::any::Any + Send>)
        .collect()
}
