//! Type erasure for [`SlotBroker`] (its methods return `impl Future`, so it is not `dyn`-safe)
//! and the poll-once fast path that lets an in-process broker answer without a task hop.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use futures_util::future::BoxFuture;

use super::{AcquireRequest, BrokerError, BrokerEvents, SlotBroker, SlotToken};

/// The object-safe face of a broker, used by the supervisor.
pub(crate) trait DynBroker: Send + Sync + 'static {
    fn acquire_boxed(
        self: Arc<Self>,
        request: AcquireRequest,
    ) -> BoxFuture<'static, Result<SlotToken, BrokerError>>;
    fn release_boxed(
        self: Arc<Self>,
        token: SlotToken,
    ) -> BoxFuture<'static, Result<(), BrokerError>>;
    fn capacity(&self) -> Option<u32>;
    fn renews(&self) -> bool;
    fn keep_alive_boxed(self: Arc<Self>, token: SlotToken) -> BoxFuture<'static, BrokerError>;
    fn attach(&self, events: BrokerEvents);
    fn close_boxed(self: Arc<Self>) -> BoxFuture<'static, Result<(), BrokerError>>;
}

impl<B: SlotBroker> DynBroker for B {
    fn acquire_boxed(
        self: Arc<Self>,
        request: AcquireRequest,
    ) -> BoxFuture<'static, Result<SlotToken, BrokerError>> {
        Box::pin(async move { SlotBroker::acquire(&*self, request).await })
    }

    fn release_boxed(
        self: Arc<Self>,
        token: SlotToken,
    ) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move { SlotBroker::release(&*self, token).await })
    }

    fn capacity(&self) -> Option<u32> {
        SlotBroker::capacity(self)
    }

    fn renews(&self) -> bool {
        SlotBroker::renews(self)
    }

    fn keep_alive_boxed(self: Arc<Self>, token: SlotToken) -> BoxFuture<'static, BrokerError> {
        Box::pin(async move { SlotBroker::keep_alive(&*self, token).await })
    }

    fn attach(&self, events: BrokerEvents) {
        SlotBroker::attach(self, events)
    }

    fn close_boxed(self: Arc<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move { SlotBroker::close(&*self).await })
    }
}

/// Polls `fut` once with a no-op waker.
///
/// Used by the supervisor so that a broker which answers at once (the `LocalBroker`) costs no
/// task spawn and no extra message. When it returns `Pending` the caller moves the same boxed
/// future into a task, whose first poll registers the real waker; a well-behaved future
/// re-registers on every poll, so the no-op waker of this first poll is never relied upon.
pub(crate) fn poll_once<T>(fut: &mut Pin<Box<dyn Future<Output = T> + Send>>) -> Poll<T> {
    let mut cx = Context::from_waker(Waker::noop());
    fut.as_mut().poll(&mut cx)
}
