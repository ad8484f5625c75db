//! The broker's view of the pool's slot deletions: one watch of the `slot/` range on the
//! broker's shared stream, for deletions only (`NoPut`), while the broker has waiters.
//!
//! A deletion is a slot freed without a hand-off (a holder's session expired, a release found
//! the queue empty just before a waiter joined): it bumps `frees`, which makes the waiters look.
//! A hand-off writes the slot key (a put), which this watch does not carry: the grantee hears of
//! its grant from its own marker's event alone, and no other process hears of it at all. So a
//! hand-off is one transaction and one event, to one process.

use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Event, EventType, WatchFilterType, WatchOptions};
use tokio::time::sleep;
use tokio_util::sync::CancellationToken;

use super::layout::Layout;
use super::watches::{self, event_kind};
use crate::inner::Inner;

/// How long the slot watch is kept without users.
const LINGER: Duration = Duration::from_secs(1);

/// One user of the broker's slot watch; the last one stops it.
pub(super) struct SlotsUser {
    inner: Arc<Inner>,
}

impl Drop for SlotsUser {
    fn drop(&mut self) {
        let mut ctl = self.inner.slots_ctl.lock();
        ctl.users -= 1;
        if ctl.users > 0 || ctl.stop.is_none() {
            return;
        }
        // Kept a while without users: a broker whose waiters come and go (one slot, a waiter
        // granted and the next job's acquire joining) keeps one watch instead of setting one
        // up per lease. Stopped when no user came back by then.
        ctl.idle += 1;
        let idle = ctl.idle;
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            if let Some(stop) = ctl.stop.take() {
                stop.cancel();
            }
            return;
        };
        let inner = Arc::downgrade(&self.inner);
        rt.spawn(async move {
            sleep(LINGER).await;
            if let Some(me) = inner.upgrade() {
                let mut ctl = me.slots_ctl.lock();
                if ctl.users == 0
                    && ctl.idle == idle
                    && let Some(stop) = ctl.stop.take()
                {
                    stop.cancel();
                }
            }
        });
    }
}

impl SlotsUser {
    /// Waits (at most `bound`) until the slot watch is in place.
    pub(super) async fn ready(&self, bound: Duration) {
        let mut seen = self.inner.slot_seen.subscribe();
        let _ = tokio::time::timeout(bound, async {
            while self.inner.slot_view.lock().task.is_none() {
                if seen.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
    }
}

impl Inner {
    /// Registers a user of the slot watch, starting it if it does not run.
    pub(super) fn slots_user(self: &Arc<Self>) -> SlotsUser {
        let mut ctl = self.slots_ctl.lock();
        ctl.users += 1;
        if ctl.stop.is_none()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let stop = CancellationToken::new();
            ctl.stop = Some(stop.clone());
            ctl.next_task += 1;
            rt.spawn(watch_slots(Arc::downgrade(self), stop, ctl.next_task));
        }
        SlotsUser {
            inner: Arc::clone(self),
        }
    }

    /// The watch (of task `task`) is in place again: a slot may have been freed while there
    /// was none.
    fn slots_restarted(&self, task: u64) {
        self.slot_view.lock().task = Some(task);
        self.slot_seen.send_modify(|n| *n += 1);
        self.frees.send_modify(|n| *n += 1);
    }

    /// The watch of task `task` ended (unless a newer task's is in place).
    fn slots_stopped(&self, task: u64) {
        let mut view = self.slot_view.lock();
        if view.task == Some(task) {
            view.task = None;
        }
    }

    /// Takes in one batch of the slot watch's events (deletions only): the waiters look.
    fn slots_seen(&self, events: &[Event]) {
        if a_slot_freed(&self.layout, events) {
            self.frees.send_modify(|n| *n += 1);
        }
    }
}

/// Watches the slot keys for the broker's waiters, from now, on the broker's shared stream, until
/// `stop`; set up again whenever the stream is.
async fn watch_slots(inner: Weak<Inner>, stop: CancellationToken, task: u64) {
    let mut backoff = Duration::from_millis(20);
    loop {
        let (hub, prefix) = match inner.upgrade() {
            Some(me) => (Arc::clone(&me.hub), me.layout.slot_prefix()),
            None => return,
        };
        let opened = tokio::select! {
            () = stop.cancelled() => break,
            opened = hub.watch(
                prefix,
                WatchOptions::new()
                    .with_prefix()
                    .with_filters([WatchFilterType::NoPut]),
                None,
            ) => opened,
        };
        drop(hub);
        let mut watch = match opened {
            Ok(watch) => watch,
            Err(_) => {
                tokio::select! {
                    () = stop.cancelled() => break,
                    () = sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_millis(500));
                continue;
            }
        };
        backoff = Duration::from_millis(20);
        match inner.upgrade() {
            Some(me) => me.slots_restarted(task),
            None => return,
        }
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                seen = watch.seen.recv() => {
                    let Some(me) = inner.upgrade() else { return };
                    match seen {
                        Some(watches::Seen::Events(events)) => me.slots_seen(&events),
                        // Set up again on a new stream (or cancelled by etcd).
                        Some(watches::Seen::Reset) => me.slots_restarted(task),
                        // The hub dropped the watch (the broker is going).
                        None => {
                            me.slots_stopped(task);
                            return;
                        }
                    }
                }
            }
        }
        if stop.is_cancelled() {
            break;
        }
    }
    if let Some(me) = inner.upgrade() {
        me.slots_stopped(task);
    }
}

/// Whether a batch of the slot watch's events may have freed a slot: a deletion of a slot key, or
/// an event of a kind this broker does not know on one (a read decides, so a false alarm costs
/// only a look).
fn a_slot_freed(layout: &Layout, events: &[Event]) -> bool {
    events.iter().any(|e| {
        matches!(event_kind(e), Some(EventType::Delete) | None)
            && e.kv()
                .is_some_and(|kv| layout.slot_index(kv.key()).is_some())
    })
}

#[cfg(test)]
mod tests {
    use etcd_client::proto::{PbEvent, PbKeyValue};

    use super::*;

    fn event(kind: i32, key: String) -> Event {
        Event(PbEvent {
            r#type: kind,
            kv: Some(PbKeyValue {
                key: key.into_bytes(),
                ..PbKeyValue::default()
            }),
            prev_kv: None,
        })
    }

    #[test]
    fn an_event_of_a_kind_the_client_does_not_know_is_a_possible_free_not_a_panic() {
        let layout = Layout::new("leasehold", "p", 8);
        let (put, delete, unknown) = (0, 1, 7);
        assert!(!a_slot_freed(&layout, &[event(put, layout.slot_key(3))]));
        assert!(a_slot_freed(&layout, &[event(delete, layout.slot_key(3))]));
        assert!(!a_slot_freed(&layout, &[event(delete, "elsewhere".into())]));
        let odd = event(unknown, layout.slot_key(3));
        assert!(a_slot_freed(&layout, std::slice::from_ref(&odd)));
        // What the broker no longer calls: etcd-client's own reading panics on that kind.
        let panicked = std::panic::catch_unwind(|| odd.event_type()).is_err();
        assert!(
            panicked,
            "etcd-client reads an unknown kind without panicking now"
        );
    }
}
