//! Where the core's shutdown stands ([`Ending`]): serving, stopping (and the close it waits
//! for), stopped. What the shutdown does is in `shutdown.rs`.

use super::protocol::StopTally;

/// A close at the end of shutdown (the GPU devices', the broker's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Close {
    NotNeeded,
    Pending,
    Closing,
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Stage {
    Serving,
    Stopping {
        gpu: Close,
        broker: Close,
        deadline_passed: bool,
    },
    Stopped,
}

/// Where the supervisor is in its life, and what its shutdown did.
#[cfg_attr(test, derive(Clone))]
#[derive(Debug)]
pub(super) struct Ending {
    pub(super) stage: Stage,
    /// The supervisor owns GPU devices (close them at shutdown).
    pub(super) gpu: bool,
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

    pub(super) fn is_stopping(&self) -> bool {
        matches!(self.stage, Stage::Stopping { .. })
    }
}
