//! Shutdown (invariant 8): refuse everyone waiting, cancel every job whatever its phase,
//! revoke and release every explicit lease, abort tasks that outlive the cancel grace (and, at
//! the deadline, whatever still runs), quarantine what the deadline finds unproven; once
//! nothing is left that would end on its own, close the GPU devices, then the broker (a
//! distributed broker gives up its session), and stop.

use super::Core;
use super::protocol::{Abandon, Effect, RecheckFor};
use super::record::{Holder, Proof, Stop, Why};

use super::ending::{Close, Stage};

impl Core {
    pub(super) fn shutdown(&mut self) {
        if !self.ending.is_serving() {
            return;
        }
        self.ending.stage = Stage::Stopping {
            gpu: if self.ending.gpu {
                Close::Pending
            } else {
                Close::NotNeeded
            },
            broker: Close::Pending,
            deadline_passed: false,
        };
        // Their tokens (a gathering head's) go back through `admit`, which no longer grants.
        self.ending.tally.refused_waiters += self.refuse_everyone();
        for key in self
            .book
            .keys_where(|r| r.holder == Holder::Job && r.stop == Stop::Running)
        {
            self.cancel_for_shutdown(key);
        }
        for key in self
            .book
            .keys_where(|r| r.holder == Holder::Explicit && !r.is_releasing())
        {
            self.ending.tally.released_leases += 1;
            self.fx.push(Effect::Cancel {
                key,
                holder: Holder::Explicit,
                lost: None,
            });
            self.start_release(key);
        }
        self.fx.push(Effect::ArmShutdownTimers);
        // What is clean now is released rather than reported.
        self.recheck(RecheckFor::Shutdown);
    }

    /// Aborts the tracked async tasks of every job that still owes them.
    fn abort_tasks(&mut self) {
        for key in self
            .book
            .keys_where(|r| r.holder == Holder::Job && r.owed.owes(Proof::TasksJoined))
        {
            self.fx.push(Effect::AbortTasks { key });
        }
    }

    pub(super) fn shutdown_grace_over(&mut self) {
        if self.ending.is_stopping() {
            self.abort_tasks();
        }
    }

    pub(super) fn shutdown_deadline(&mut self) {
        let Stage::Stopping {
            deadline_passed, ..
        } = &mut self.ending.stage
        else {
            return;
        };
        *deadline_passed = true;
        // Here too, not only at the grace (which may be longer than the bound): nothing the
        // supervisor started outlives its shutdown unaborted.
        self.abort_tasks();
        for key in self.book.keys_where(|r| !r.is_releasing()) {
            let Some(r) = self.book.get(key) else {
                continue;
            };
            let late: Vec<Proof> = r
                .owing()
                .filter(|p| !r.reasons.iter().any(|x| x.proof == *p))
                .collect();
            for proof in late {
                let detail = format!(
                    "{} not proven done when the shutdown bound passed",
                    proof.describe()
                );
                self.missing(key, proof, Why::Late, detail, None);
            }
        }
    }

    pub(super) fn gpu_closed(&mut self) {
        if let Stage::Stopping { gpu, .. } = &mut self.ending.stage {
            *gpu = Close::Closed;
        }
    }

    pub(super) fn broker_closed(&mut self) {
        if let Stage::Stopping { broker, .. } = &mut self.ending.stage {
            *broker = Close::Closed;
        }
    }

    /// Shutdown finishes once no lease holds it (see `LeaseRecord::holds_shutdown`), no
    /// re-check is out, the GPU devices are closed, and then the broker.
    pub(super) fn maybe_stopped(&mut self) {
        let Stage::Stopping {
            gpu,
            broker,
            deadline_passed,
        } = self.ending.stage
        else {
            return;
        };
        if self.rechecks > 0 || self.book.any(|r| r.holds_shutdown(deadline_passed)) {
            return;
        }
        let next = |gpu, broker| Stage::Stopping {
            gpu,
            broker,
            deadline_passed,
        };
        match (gpu, broker) {
            (Close::Pending, _) => {
                self.ending.stage = next(Close::Closing, broker);
                self.fx.push(Effect::CloseGpu);
            }
            (Close::Closing, _) | (_, Close::Closing) => {}
            (_, Close::Pending) => {
                self.ending.stage = next(gpu, Close::Closing);
                self.fx.push(Effect::CloseBroker);
            }
            (Close::NotNeeded | Close::Closed, Close::NotNeeded | Close::Closed) => {
                self.ending.stage = Stage::Stopped;
                let quarantine = self.quarantine_entries();
                self.fx.push(Effect::Stopped {
                    tally: self.ending.tally,
                    keep_work_root: !quarantine.is_empty(),
                    quarantine,
                });
            }
        }
    }

    /// The shell is dropped without a completed shutdown (its runtime went away): what to do
    /// with what it still holds.
    pub(crate) fn abandon(&self) -> Abandon {
        Abandon {
            keep_work_root: self.book.tally().leases > 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::protocol::{Ask, Effect, Input, LeaseKey, WaiterId, Want};
    use super::super::record::Proofs;
    use super::*;
    use crate::broker::SlotToken;

    fn effects(core: &mut Core) -> Vec<Effect> {
        core.settle();
        std::iter::from_fn(|| core.pop_effect()).collect()
    }

    /// A job on GPU device 0 whose body and tasks have ended and whose fence found the device
    /// lost (`lost` is the fence's input), on a core that owns GPU devices.
    fn lost_job(lost: impl FnOnce(LeaseKey) -> Input) -> (Core, LeaseKey) {
        let mut core = Core::on_broker(Some(1), false, true);
        core.apply(Input::Enqueue {
            waiter: WaiterId(1),
            ask: Ask::one(Want::Job),
        });
        let request = match effects(&mut core).as_slice() {
            [Effect::Acquire { request, .. }] => *request,
            other => panic!("expected one acquire, got {other:?}"),
        };
        core.apply(Input::Acquired {
            request,
            result: Ok(SlotToken::new(0, 1)),
        });
        let key = match effects(&mut core).as_slice() {
            [Effect::Deliver { key, .. }] => *key,
            other => panic!("expected a delivery, got {other:?}"),
        };
        core.apply(Input::Started {
            key,
            device: Some(0),
        });
        core.apply(Input::Proven {
            key,
            proofs: Proofs::JOINED.with(Proofs::TASKS),
        });
        core.apply(lost(key));
        core.apply(Input::Ended {
            key,
            proofs: Proofs::default(),
            dir: None,
        });
        effects(&mut core);
        assert_eq!(core.quarantined(), 1);
        (core, key)
    }

    /// Runs a shutdown as the shell would, answering every re-check and close at once and
    /// never reaching the deadline: the quarantine of the `Stopped` effect, if it stopped.
    fn shut_down(core: &mut Core) -> Option<usize> {
        core.apply(Input::Shutdown);
        for _ in 0..8 {
            for effect in effects(core) {
                match effect {
                    Effect::Recheck {
                        leases, purpose, ..
                    } => core.apply(Input::Rechecked {
                        results: Box::default(),
                        leases,
                        purpose,
                    }),
                    Effect::CloseGpu => core.apply(Input::GpuClosed),
                    Effect::CloseBroker => core.apply(Input::BrokerClosed),
                    Effect::Stopped { quarantine, .. } => return Some(quarantine.len()),
                    _ => {}
                }
            }
        }
        None
    }

    #[test]
    fn a_shutdown_reports_a_lease_lost_on_the_engines_device_without_waiting_for_a_replacement() {
        let (mut core, _) = lost_job(|key| Input::EngineDeviceLost {
            key,
            device: 0,
            generation: 1,
            reason: "destroyed".into(),
        });
        assert_eq!(
            shut_down(&mut core),
            Some(1),
            "stopped at once, the slot reported quarantined"
        );
    }

    #[test]
    fn a_shutdown_waits_until_its_deadline_for_a_device_leasehold_re_creates() {
        let (mut core, _) = lost_job(|key| Input::DeviceLost {
            key,
            device: 0,
            generation: 1,
            reason: "destroyed".into(),
        });
        assert_eq!(shut_down(&mut core), None, "the re-creation is waited for");
        core.apply(Input::ShutdownDeadline);
        assert_eq!(shut_down(&mut core), Some(1));
    }
}
