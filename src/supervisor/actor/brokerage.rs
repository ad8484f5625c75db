//! Where tokens come from and where they go back: the shell's side of the broker. The
//! supervisor's own pool is not here: the core owns it and takes and gives its slots itself.
//! Any other broker is called through [`outside`]: built and polled
//! once in the mailbox under `catch_unwind` and, when it is not ready, finished in a task of its
//! own that reports back through the inbox (never awaited in the mailbox). Its answers, a panic
//! included, are inputs to the core, which decides what follows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use tokio::task::AbortHandle;

use crate::broker::{AcquireRequest, BrokerError, DynBroker, SlotToken};
use crate::error::CleanupError;
use crate::outside::{self, First, Outcome};
use crate::supervisor::core::{Input, LeaseKey, RequestId, shrink_map as shrink};
use crate::supervisor::inbox::Inbox;
use crate::supervisor::messages::SupMsg;

use super::rooms::take_from;

/// Where tokens come from: the supervisor's own pool, which the core owns (the shell never
/// calls it), or any other broker, called through its object-safe face.
#[derive(Clone)]
pub(crate) enum BrokerPort {
    Pool,
    Dyn(Arc<dyn DynBroker>),
}

/// What the shell answers when asked to call the pool, which only the core calls: a core
/// that owns its pool never asks, so this is a defect, answered as a failed call (never a
/// panic in the supervisor's turn).
fn not_the_shells() -> BrokerError {
    BrokerError::invalid_response("the supervisor's pool is the core's: the shell never calls it")
}

/// The broker and the calls into it that are still running: acquires the core may withdraw,
/// renewals it may stop. A call the broker answers in its first poll answers here, for the shell
/// to apply as an input; any other reports back through the inbox.
pub(super) struct Brokerage {
    pub(super) port: BrokerPort,
    /// Random per supervisor (see `AcquireRequest::origin`).
    origin: u64,
    /// Where calls finished in a task of their own report.
    inbox: Arc<Inbox>,
    /// A release's bound (the supervisor's cleanup timeout).
    release_timeout: Duration,
    acquires: FxHashMap<RequestId, AbortHandle>,
    renewals: FxHashMap<LeaseKey, AbortHandle>,
}

impl Brokerage {
    pub(super) fn new(
        port: BrokerPort,
        origin: u64,
        inbox: Arc<Inbox>,
        release_timeout: Duration,
    ) -> Self {
        Self {
            port,
            origin,
            inbox,
            release_timeout,
            acquires: FxHashMap::default(),
            renewals: FxHashMap::default(),
        }
    }

    /// Asks the broker for a token for `request` (for the job `job_id`, when a job waits for
    /// it). The answer, when the broker gave it in its first poll; otherwise it comes as
    /// `SupMsg::Acquired`.
    pub(super) fn acquire(
        &mut self,
        request: RequestId,
        job_id: impl FnOnce() -> Option<Arc<str>>,
    ) -> Option<Result<SlotToken, BrokerError>> {
        match &self.port {
            BrokerPort::Pool => Some(Err(not_the_shells())),
            BrokerPort::Dyn(broker) => {
                let req = AcquireRequest::for_job(request.0, job_id()).with_origin(self.origin);
                let make = || Arc::clone(broker).acquire_boxed(req);
                match outside::first_poll(make) {
                    First::Ended(outcome) => Some(acquired(outcome)),
                    First::Pending(fut) => {
                        let inbox = Arc::clone(&self.inbox);
                        let broker = Arc::clone(broker);
                        let timeout = self.release_timeout;
                        // Unbounded: a broker may queue for as long as the caller waits (the
                        // caller's own timeout or cancellation withdraws it, and the core
                        // aborts this call then).
                        let task = outside::finish(fut, None, move |outcome| {
                            let result = acquired(outcome);
                            if let Err(SupMsg::Acquired {
                                result: Ok(token), ..
                            }) = inbox.send(SupMsg::Acquired { request, result })
                            {
                                // The supervisor stopped while this acquire was in flight:
                                // nobody can hold the token, so it goes straight back, once.
                                release_orphan(broker, token, timeout);
                            }
                        });
                        self.acquires.insert(request, task);
                        None
                    }
                }
            }
        }
    }

    /// An acquire that finished in its own task has reported.
    pub(super) fn acquire_ended(&mut self, request: RequestId) {
        self.acquires.remove(&request);
    }

    /// Stops a broker acquire the core no longer wants.
    pub(super) fn abort_acquire(&mut self, request: RequestId) {
        if let Some(task) = self.acquires.remove(&request) {
            task.abort();
        }
    }

    /// Keeps the lease alive while it is held, when the broker needs that. The renewal ends
    /// only when the lease is lost (or the core stops it); a panic in it is a lost lease.
    pub(super) fn start_renewal(&mut self, key: LeaseKey, token: SlotToken) {
        let BrokerPort::Dyn(broker) = &self.port else {
            // The pool renews nothing, so its core never asks.
            let reason = not_the_shells().to_string();
            let _ = self
                .inbox
                .send(SupMsg::Input(Input::LeaseLost { key, reason }));
            return;
        };
        let broker = Arc::clone(broker);
        let inbox = Arc::clone(&self.inbox);
        let task = outside::spawn(
            move || broker.keep_alive_boxed(token),
            None,
            move |outcome| {
                let reason = outcome.fold(
                    |err| err.to_string(),
                    |panic| {
                        BrokerError::panicked(format!("the lease's renewal panicked: {panic}"))
                            .to_string()
                    },
                    |_| unreachable!("a renewal has no bound"),
                );
                // Judged by the core: renewal may have been stopped since.
                let _ = inbox.send(SupMsg::Input(Input::LeaseLost { key, reason }));
            },
        );
        self.renewals.insert(key, task);
    }

    /// How many leases are being renewed (tests).
    #[cfg(test)]
    pub(super) fn renewing(&self) -> usize {
        self.renewals.len()
    }

    /// Stops a lease's renewal.
    pub(super) fn stop_renewal(&mut self, key: LeaseKey) {
        if let Some(task) = take_from(&mut self.renewals, &key) {
            task.abort();
        }
    }

    /// Releases `token` under the release timeout, which is the supervisor's own: no caller's
    /// cancellation reaches it. The answer, when the broker gave it in its first poll;
    /// otherwise it comes as `SupMsg::Released`, with the time it started (`started`, read only
    /// then).
    pub(super) fn release(
        &mut self,
        key: LeaseKey,
        token: SlotToken,
        started: impl FnOnce() -> Instant,
    ) -> Option<Result<(), CleanupError>> {
        match &self.port {
            BrokerPort::Pool => Some(Err(CleanupError::broker(token, not_the_shells()))),
            BrokerPort::Dyn(broker) => {
                let timeout = self.release_timeout;
                match outside::first_poll(|| Arc::clone(broker).release_boxed(token)) {
                    First::Ended(outcome) => Some(released(token, timeout, outcome)),
                    First::Pending(fut) => {
                        let started = started();
                        let inbox = Arc::clone(&self.inbox);
                        let _ = outside::finish(fut, Some(timeout), move |outcome| {
                            let result = released(token, timeout, outcome);
                            let _ = inbox.send(SupMsg::Released {
                                key,
                                result,
                                started,
                            });
                        });
                        None
                    }
                }
            }
        }
    }

    /// Closes the broker under the release timeout, off the mailbox, the outcome reported as
    /// `SupMsg::BrokerClosed`. A failure, a timeout or a panic is logged, goes to the
    /// shutdown's report, and the shutdown goes on. `false` for the in-process pool, which has
    /// nothing to close (the shell applies `Input::BrokerClosed` itself).
    pub(super) fn close(&self) -> bool {
        let BrokerPort::Dyn(broker) = &self.port else {
            return false;
        };
        let broker = Arc::clone(broker);
        let (bound, inbox) = (self.release_timeout, Arc::clone(&self.inbox));
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
        true
    }

    /// The broker leasehold did not write, taken out to be dropped off the actor's task (the
    /// supervisor has stopped: the port is never called again).
    pub(super) fn take_foreign(&mut self) -> Option<BrokerPort> {
        if let BrokerPort::Pool = &self.port {
            return None;
        }
        Some(std::mem::replace(&mut self.port, BrokerPort::Pool))
    }

    /// Stops every call still running (the supervisor is gone).
    pub(super) fn abort_all(&mut self) {
        for (_, task) in self.renewals.drain() {
            task.abort();
        }
        for (_, task) in self.acquires.drain() {
            task.abort();
        }
    }

    pub(super) fn shrink(&mut self) {
        shrink(&mut self.acquires);
        shrink(&mut self.renewals);
    }
}

/// A broker acquire's answer; a panic is a failed acquire.
fn acquired(outcome: Outcome<Result<SlotToken, BrokerError>>) -> Result<SlotToken, BrokerError> {
    outcome.fold(
        |result| result,
        |panic| {
            Err(BrokerError::panicked(format!(
                "the broker's acquire panicked: {panic}"
            )))
        },
        |_| unreachable!("a broker acquire has no bound of its own"),
    )
}

/// A broker release's answer under `timeout`; a panic is a failed release.
fn released(
    token: SlotToken,
    timeout: Duration,
    outcome: Outcome<Result<(), BrokerError>>,
) -> Result<(), CleanupError> {
    outcome.fold(
        |result| result.map_err(|e| CleanupError::broker(token, e)),
        |panic| {
            let message = format!("the broker's release of {token} panicked: {panic}");
            Err(CleanupError::broker(token, BrokerError::panicked(message)))
        },
        |_| Err(CleanupError::timeout(token, timeout)),
    )
}

/// Releases a token that arrived after the supervisor stopped, under the cleanup timeout.
fn release_orphan(broker: Arc<dyn DynBroker>, token: SlotToken, timeout: Duration) {
    let _ = outside::spawn(
        move || broker.release_boxed(token),
        Some(timeout),
        move |outcome| match released(token, timeout, outcome) {
            Ok(()) => {
                tracing::info!(%token, "released a token granted after the supervisor stopped")
            }
            Err(error) => {
                tracing::error!(%token, %error, "could not release a token granted after the supervisor stopped")
            }
        },
    );
}
