//! The end of a supervisor: shutdown's timers, the GPU pool's bounded close, the report and
//! what is dropped when the actor stops; and how a quarantined slot is described.

use std::mem;
use std::sync::Arc;

use super::Shell;
use super::brokerage::BrokerPort;
use crate::broker::{BrokerError, LocalBroker};
use crate::outside;
use crate::supervisor::core::{Input, QuarantineEntry};
use crate::supervisor::messages::SupMsg;
use crate::supervisor::reports::{EndDrop, ShutdownReport};

impl Shell {
    pub(super) fn arm_shutdown_timers(&mut self) {
        let inbox = Arc::clone(&self.inbox);
        let (grace, bound) = (self.config.cancel_grace, self.config.shutdown_timeout);
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

    pub(super) fn close_gpu(&mut self) {
        #[cfg(feature = "gpu")]
        if let Some(gpu) = &self.config.hosts.gpu {
            let bound = self.config.cleanup_timeout;
            let (gpu, inbox) = (Arc::clone(gpu), Arc::clone(&self.inbox));
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
            return;
        }
        self.core.apply(Input::GpuClosed);
    }

    /// Closes the broker under the cleanup timeout, off the mailbox (the in-process pool has
    /// nothing to close). A failure, a timeout or a panic is logged, goes to the shutdown's
    /// report, and the shutdown goes on.
    pub(super) fn close_broker(&mut self) {
        let BrokerPort::Dyn(broker) = &self.brokerage.port else {
            return self.core.apply(Input::BrokerClosed);
        };
        let broker = Arc::clone(broker);
        let (bound, inbox) = (self.config.cleanup_timeout, Arc::clone(&self.inbox));
        let _ = outside::spawn(
            move || broker.close_boxed(),
            Some(bound),
            move |outcome| {
                let failed = outcome.fold(
                    Result::err,
                    |panic| {
                        Some(BrokerError::panicked(format!(
                            "the broker's close panicked: {panic}"
                        )))
                    },
                    |bound| {
                        Some(BrokerError::timeout(format!(
                            "the broker's close did not end within {bound:?}"
                        )))
                    },
                );
                if let Some(error) = &failed {
                    tracing::error!(%error, "the broker's close at shutdown failed; what it held is left to its expiry");
                }
                let _ = inbox.send(SupMsg::BrokerClosed { failed });
            },
        );
    }

    pub(super) fn stopped(
        &mut self,
        tally: crate::supervisor::core::StopTally,
        quarantine: Vec<QuarantineEntry>,
        keep_work_root: bool,
    ) {
        // The jobs' and leases' callers hear before the shutdown's caller does.
        self.publish();
        self.send_answers();
        self.end.keep_root = Some(keep_work_root);
        let report = ShutdownReport {
            refused_waiters: tally.refused_waiters,
            cancelled_jobs: tally.cancelled_jobs,
            released_leases: tally.released_leases,
            quarantined: quarantine.len(),
            unproven: self.describe(quarantine),
            unclosed_devices: mem::take(&mut self.end.unclosed),
            broker_close_failed: self.end.broker_close_failed.take(),
            stats: self.publisher.stats.snapshot(),
            // Filled in by `shutdown`, which waits for the end's drops within its bound.
            outlived: Vec::new(),
        };
        for reply in self.answers.shutdown_replies.drain(..) {
            let _ = reply.send(report.clone());
        }
        self.end.last_report.set(report);
        self.inbox.close();
        self.myself.stop(None);
    }

    /// Drops everything the actor still holds: queued mail, waiters, renewals, broker acquires,
    /// the broker. Idempotent. What leasehold did not write (the broker, the closures of jobs
    /// that never ran) and the work root's removal are dropped off the actor's task (see
    /// `EndDrops`): the actor's end never waits for them.
    pub(super) fn stop_everything(&mut self) {
        // Answers of an unfinished turn still reach their callers.
        self.send_answers();
        let mut drops: Vec<EndDrop> = Vec::new();
        let queued = self.inbox.close_taking();
        if !queued.is_empty() {
            drops.push(("the jobs still in the inbox", each(queued)));
        }
        self.brokerage.abort_all();
        // Waiters still queued hear SUPERVISOR_STOPPED when their reply senders drop (with
        // their jobs' closures, off this task).
        if !self.kept.waiters.is_empty() {
            let waiters = self.kept.waiters.drain().map(|(_, w)| w);
            drops.push(("the jobs still queued", each(waiters)));
        }
        if let BrokerPort::Dyn(_) = &self.brokerage.port {
            // The supervisor has stopped: the port is never called again.
            let local = BrokerPort::Local(Arc::new(LocalBroker::new(0)));
            let broker = mem::replace(&mut self.brokerage.port, local);
            drops.push(("the broker", each([broker])));
        }
        self.answers.controls.clear();
        // Nobody keeps the table up to date any more: what it still shows is what stays held,
        // the quarantined slots.
        self.publisher.table.retain_quarantined();
        let keep = self
            .end
            .keep_root
            .unwrap_or_else(|| self.core.abandon().keep_work_root);
        if let Some(root) = self.end.owned_root.take() {
            if keep {
                // Quarantined temp dirs are evidence (and a dir a job still uses is not
                // removed under it): keep them.
                let kept = root.keep();
                tracing::warn!(root = %kept.display(), "work root kept: it holds quarantined temp dirs");
            } else {
                drops.push(("the work root's removal", each([root])));
            }
        }
        self.end.last_report.drops.dispose(drops);
    }
}

/// Values to drop one by one at the end (see `EndDrops`).
fn each<T: Send + 'static>(
    values: impl IntoIterator<Item = T>,
) -> Vec<Box<dyn std::any::Any + Send>> {
    values
        .into_iter()
        .map(|v| Box::new(v) as Box<dyn std::any::Any + Send>)
        .collect()
}
