//! Shutdown (invariant 8): refuse everyone waiting, cancel every job whatever its phase,
//! revoke and release every explicit lease, abort tasks that outlive the cancel grace (and, at
//! the deadline, whatever still runs), quarantine what the deadline finds unproven, close the
//! GPU devices, and stop once nothing is left that would end on its own.

use super::Core;
use super::protocol::{Abandon, Effect, RecheckFor, StopTally};
use super::record::{Holder, Proof, Stop, Why};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GpuClose {
    NotNeeded,
    Pending,
    Closing,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Serving,
    Stopping {
        gpu: GpuClose,
        deadline_passed: bool,
    },
    Stopped,
}

/// Where the supervisor is in its life, and what its shutdown did.
#[derive(Debug)]
pub(super) struct Ending {
    stage: Stage,
    /// The supervisor owns GPU devices (close them at shutdown).
    gpu: bool,
    pub(super) tally: StopTally,
}

impl Ending {
    pub(super) fn new(gpu: bool) -> Self {
        Self {
            stage: Stage::Serving,
            gpu,
            tally: StopTally::default(),
        }
    }

    pub(super) fn is_serving(&self) -> bool {
        self.stage == Stage::Serving
    }

    fn is_stopping(&self) -> bool {
        matches!(self.stage, Stage::Stopping { .. })
    }
}

impl Core {
    pub(super) fn shutdown(&mut self) {
        if !self.ending.is_serving() {
            return;
        }
        self.ending.stage = Stage::Stopping {
            gpu: if self.ending.gpu {
                GpuClose::Pending
            } else {
                GpuClose::NotNeeded
            },
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
            *gpu = GpuClose::Closed;
        }
    }

    /// Shutdown finishes once no lease holds it (see `LeaseRecord::holds_shutdown`), no
    /// re-check is out, and the GPU devices are closed.
    pub(super) fn maybe_stopped(&mut self) {
        let Stage::Stopping {
            gpu,
            deadline_passed,
        } = self.ending.stage
        else {
            return;
        };
        if self.rechecks > 0 || self.book.any(|r| r.holds_shutdown(deadline_passed)) {
            return;
        }
        match gpu {
            GpuClose::Pending => {
                self.ending.stage = Stage::Stopping {
                    gpu: GpuClose::Closing,
                    deadline_passed,
                };
                self.fx.push(Effect::CloseGpu);
            }
            GpuClose::Closing => {}
            GpuClose::NotNeeded | GpuClose::Closed => {
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
