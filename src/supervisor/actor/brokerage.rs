//! Where tokens come from and where they go back: the shell's side of the broker. An in-process
//! broker is called directly; any other broker's future is polled once in the mailbox and, when
//! it is not ready, finished in a task of its own that reports back through the inbox (never
//! awaited in the mailbox). Its answers are inputs to the core, which decides what follows.

use super::*;

/// Where tokens come from. The in-process broker is called directly (no boxed future, no
/// poll); any other broker through its object-safe face.
#[derive(Clone)]
pub(crate) enum BrokerPort {
    Local(Arc<LocalBroker>),
    Dyn(Arc<dyn DynBroker>),
}

impl BrokerPort {
    pub(crate) fn capacity(&self) -> Option<u32> {
        match self {
            Self::Local(b) => Some(b.slots()),
            Self::Dyn(b) => b.capacity(),
        }
    }

    pub(crate) fn as_dyn(&self) -> Arc<dyn DynBroker> {
        match self {
            Self::Local(b) => Arc::clone(b) as Arc<dyn DynBroker>,
            Self::Dyn(b) => Arc::clone(b),
        }
    }
}

impl Shell {
    pub(super) fn broker_acquire(&mut self, request: RequestId, for_waiter: Option<WaiterId>) {
        let result = match &self.broker {
            // Answers at once (the core asks only while a slot is free).
            BrokerPort::Local(local) => local.take(),
            BrokerPort::Dyn(broker) => {
                let job_id =
                    for_waiter
                        .and_then(|w| self.waiters.get(&w))
                        .and_then(|w| match &w.kind {
                            WaiterKind::Job(job) => Some(Arc::clone(&job.job_id)),
                            WaiterKind::Lease { .. } => None,
                        });
                let req = AcquireRequest::for_job(request, job_id).with_origin(self.origin);
                let mut fut = Arc::clone(broker).acquire_boxed(req);
                match poll_once(&mut fut) {
                    Poll::Ready(result) => result,
                    Poll::Pending => {
                        let inbox = Arc::clone(&self.inbox);
                        let broker = Arc::clone(broker);
                        let timeout = self.config.cleanup_timeout;
                        crate::counters::task();
                        let task = tokio::spawn(async move {
                            let result = fut.await;
                            if let Err(SupMsg::Acquired {
                                result: Ok(token), ..
                            }) = inbox.send(SupMsg::Acquired { request, result })
                            {
                                // The supervisor stopped while this acquire was in flight:
                                // nobody can hold the token, so it goes straight back, once.
                                release_orphan(broker, token, timeout).await;
                            }
                        });
                        self.acquires.insert(request, task.abort_handle());
                        return;
                    }
                }
            }
        };
        self.core.apply(Input::Acquired { request, result });
    }

    /// Keeps the lease alive while it is held, when the broker needs that.
    pub(super) fn start_renewal(&mut self, key: LeaseKey, token: SlotToken) {
        let lost = self.broker.as_dyn().keep_alive_boxed(token);
        let inbox = Arc::clone(&self.inbox);
        crate::counters::task();
        let task = tokio::spawn(async move {
            let err = lost.await;
            // Judged by the core: renewal may have been stopped since.
            let _ = inbox.send(SupMsg::Input(Input::LeaseLost {
                key,
                reason: err.to_string(),
            }));
        });
        self.renewals.insert(key, task.abort_handle());
    }

    /// Releases `token` under the cleanup timeout, which is the supervisor's own: no caller's
    /// cancellation reaches it.
    pub(super) fn broker_release(&mut self, key: LeaseKey, token: SlotToken) {
        let result = match &self.broker {
            BrokerPort::Local(local) => local.give(token),
            BrokerPort::Dyn(broker) => {
                let mut fut = Arc::clone(broker).release_boxed(token);
                match poll_once(&mut fut) {
                    Poll::Ready(result) => result,
                    Poll::Pending => {
                        let (timeout, started) = (self.config.cleanup_timeout, self.now());
                        let inbox = Arc::clone(&self.inbox);
                        crate::counters::task();
                        tokio::spawn(async move {
                            let result = match tokio::time::timeout(timeout, fut).await {
                                Ok(Ok(())) => Ok(()),
                                Ok(Err(e)) => Err(CleanupError::broker(token, e)),
                                Err(_) => Err(CleanupError::timeout(token, timeout)),
                            };
                            let _ = inbox.send(SupMsg::Released {
                                key,
                                result,
                                started,
                            });
                        });
                        return;
                    }
                }
            }
        };
        // Answered inline, within this turn: no time passed that the batch clock could see.
        let result = result.map_err(|e| CleanupError::broker(token, e));
        self.record_release(Duration::ZERO, &result);
        self.core.apply(Input::Released { key, result });
    }
}

/// Releases a token that arrived after the supervisor stopped, under the cleanup timeout.
async fn release_orphan(broker: Arc<dyn DynBroker>, token: SlotToken, timeout: Duration) {
    match tokio::time::timeout(timeout, broker.release_boxed(token)).await {
        Ok(Ok(())) => {
            tracing::info!(%token, "released a token granted after the supervisor stopped")
        }
        Ok(Err(error)) => {
            tracing::error!(%token, %error, "could not release a token granted after the supervisor stopped")
        }
        Err(_) => {
            tracing::error!(%token, ?timeout, "release of a token granted after the supervisor stopped timed out")
        }
    }
}
