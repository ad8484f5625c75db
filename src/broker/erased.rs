//! Type erasure for [`SlotBroker`] (its methods return `impl Future`, so it is not `dyn`-safe).

use std::sync::Arc;

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
