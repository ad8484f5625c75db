//! How a job's machinery (its context, its process keepers, its driver, its temp dir removal)
//! reports to the supervisor about one lease: messages through the inbox, each an input to the
//! core.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::core::{Input, LeaseKey, ProcessKey, Proofs};
use super::inbox::Inbox;
use super::messages::SupMsg;
use crate::error::PrepareError;
use crate::process::Evidence;
use crate::worker::JobReports;

/// Reports about one lease.
#[derive(Clone)]
pub(crate) struct Reporter {
    pub(crate) inbox: Arc<Inbox>,
    pub(crate) key: LeaseKey,
}

/// Process keys are unique in the process (any supervisor).
static NEXT_PROCESS: AtomicU64 = AtomicU64::new(1);

impl Reporter {
    pub(crate) fn send(&self, msg: SupMsg) {
        // A supervisor that is gone no longer waits for this.
        let _ = self.inbox.send(msg);
    }

    /// A report the core takes as it is.
    pub(crate) fn input(&self, input: Input) {
        self.send(SupMsg::Input(input));
    }

    /// The proofs gathered so far, if any, reported now (before a report that must follow
    /// them, or a wait that may be long); `proofs` starts empty again.
    pub(crate) fn proven_so_far(&self, proofs: &mut Proofs) {
        if !proofs.is_empty() {
            self.input(Input::Proven {
                key: self.key,
                proofs: std::mem::take(proofs),
            });
        }
    }
}

impl JobReports for Reporter {
    fn process_started(&self, pid: u32) -> u64 {
        let process = ProcessKey(NEXT_PROCESS.fetch_add(1, Ordering::Relaxed));
        self.send(SupMsg::ProcessStarted {
            key: self.key,
            process,
            pid,
        });
        process.0
    }

    fn process_ended(&self, process: u64, unproven: Option<Box<dyn Evidence>>) {
        self.send(SupMsg::ProcessEnded {
            key: self.key,
            process: ProcessKey(process),
            unproven,
        });
    }

    fn unprepared(&self, why: PrepareError) {
        self.input(Input::Unprepared { key: self.key, why });
    }
}
