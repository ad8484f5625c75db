//! The broker's view of the pool's slot keys: one watch of the `slot/` range on the broker's
//! shared stream (see `watches`), while the broker has waiters.
//!
//! What its events are used for:
//! - a deletion (a slot freed without a hand-off: a holder's session expired, a release found
//!   the queue empty just before a waiter joined) bumps `frees`, which makes the waiters look;
//! - a put is the slot key as a grant wrote it: a waiter whose marker says it was granted that
//!   slot at that revision checks the grant against it (`Layout::confirm_grant`, the same check
//!   as against a read of the slot key) instead of reading the slot key — one round trip less
//!   on every hand-off. A waiter that has not seen its slot's event soon after its marker's (a
//!   marker nobody granted, a watch set up again, a slot that moved on since) reads the slot key
//!   as before;
//! - a put also says which request was just granted a slot: it leaves `heads`, the oldest
//!   waiters a release chains over, so that the cache stays fresh between its reads.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{Event, EventType, WatchOptions};
use tokio::time::{Instant, sleep, timeout_at};
use tokio_util::sync::CancellationToken;

use super::Inner;
use super::error::EtcdError;
use super::layout::{Confirmed, Marker, MarkerState, Raw};
use super::layout::{Layout, Waiter};
use super::watches;

/// How long a waiter whose marker says it was granted waits for its slot key's event (sent by
/// etcd together with the marker's) before it reads the slot key instead.
const SLOT_EVENT_WAIT: Duration = Duration::from_millis(100);
/// How long the slot watch is kept without users.
const LINGER: Duration = Duration::from_secs(1);
/// How many recent grants the view remembers, to prune a cache of waiters read before them.
const SERVED: usize = 1024;

/// What the slot watch has seen.
#[derive(Debug, Default)]
pub(super) struct SlotView {
    /// The task whose watch is in place (`None`: none is).
    task: Option<u64>,
    /// Bumped whenever the watch is set up (again): events before it may be missing.
    epoch: u64,
    /// The last event per slot index since the watch was set up: its revision, and the key as
    /// written (`None`: deleted).
    latest: HashMap<u32, (i64, Option<Written>)>,
    /// Request keys granted a slot lately, oldest first, and the revision of each one's last
    /// grant.
    served: VecDeque<u64>,
    served_at: HashMap<u64, i64>,
}

/// A slot key as a put event carried it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Written {
    key: Vec<u8>,
    value: Vec<u8>,
    lease: i64,
    create_rev: i64,
    mod_rev: i64,
}

impl Written {
    fn raw(&self) -> Raw<'_> {
        Raw {
            key: &self.key,
            value: &self.value,
            lease: self.lease,
            create_rev: self.create_rev,
            mod_rev: self.mod_rev,
        }
    }
}

/// What the view says about a grant of `slot` at a marker's revision.
#[derive(Debug)]
enum Seen {
    /// The slot key's event at that revision, checked like a read of it.
    Checked(Result<Confirmed, EtcdError>),
    /// The slot key changed since: only a read can say where it stands now.
    Moved,
    /// No event of the slot at or after that revision yet.
    NotYet,
}

impl SlotView {
    /// Pure: a grant written into request `rk`'s marker (already read as under `session`),
    /// against the last event of its slot.
    fn check(&self, layout: &Layout, rk: u64, session: i64, marker: &Marker, slot: u32) -> Seen {
        match self.latest.get(&slot) {
            Some((rev, Some(kv))) if *rev == marker.mod_rev => {
                Seen::Checked(layout.confirm_grant(rk, session, marker, Some(kv.raw())))
            }
            Some((rev, _)) if *rev >= marker.mod_rev => Seen::Moved,
            _ => Seen::NotYet,
        }
    }
}

/// The slot watch's users and task.
#[derive(Debug, Default)]
pub(super) struct SlotsCtl {
    users: usize,
    /// Bumped each time the last user leaves (see `SlotsUser`'s drop).
    idle: u64,
    next_task: u64,
    stop: Option<CancellationToken>,
}

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

    /// Checks a grant written into a waiter's marker (already read as the waiter's own) against
    /// its slot key's event at the marker's revision. `None` when the view cannot say (no event
    /// of that slot at that revision within `SLOT_EVENT_WAIT`, the slot moved on since, or the
    /// watch was set up again meanwhile): the caller reads the slot key instead.
    pub(super) async fn confirm_seen(
        &self,
        rk: u64,
        session: i64,
        marker: &Marker,
    ) -> Option<Result<Confirmed, EtcdError>> {
        let MarkerState::Granted { slot } = marker.state else {
            return None;
        };
        let mut changed = self.slot_seen.subscribe();
        let deadline = Instant::now() + SLOT_EVENT_WAIT;
        let mut epoch = None;
        loop {
            {
                let view = self.slot_view.lock();
                if view.task.is_none() || *epoch.get_or_insert(view.epoch) != view.epoch {
                    return None;
                }
                match view.check(&self.layout, rk, session, marker, slot) {
                    Seen::Checked(checked) => return Some(checked),
                    Seen::Moved => return None,
                    Seen::NotYet => {}
                }
            }
            match timeout_at(deadline, changed.changed()).await {
                Ok(Ok(())) => {}
                _ => return None,
            }
        }
    }

    /// Whether waiter `w` was granted a slot (as the slot watch saw lately) after it joined the
    /// queue: its queue key is gone. (A request that joins again after its grant is a waiter
    /// again.)
    pub(super) fn served_lately(&self, w: &Waiter) -> bool {
        self.slot_view
            .lock()
            .served_at
            .get(&w.rk)
            .is_some_and(|at| *at > w.create_rev)
    }

    /// The watch (of task `task`) is in place again: what it saw before may be incomplete.
    fn slots_restarted(&self, task: u64) {
        {
            let mut view = self.slot_view.lock();
            view.task = Some(task);
            view.epoch += 1;
            view.latest.clear();
        }
        self.slot_seen.send_modify(|n| *n += 1);
        // A slot may have been freed while there was no watch.
        self.frees.send_modify(|n| *n += 1);
    }

    /// The watch of task `task` ended (unless a newer task's is in place).
    fn slots_stopped(&self, task: u64) {
        let mut view = self.slot_view.lock();
        if view.task == Some(task) {
            view.task = None;
            view.epoch += 1;
            view.latest.clear();
        }
    }

    /// Takes in one batch of the slot watch's events; `true` if it saw a grant.
    fn slots_seen(&self, events: &[Event]) -> bool {
        let mut freed = false;
        let mut granted = Vec::new();
        {
            let mut view = self.slot_view.lock();
            for event in events {
                let Some(kv) = event.kv() else { continue };
                let deleted = event.event_type() == EventType::Delete;
                freed |= deleted;
                let Some(index) = self.layout.slot_index(kv.key()) else {
                    continue; // not a slot key: a waiter that counts it inspects it
                };
                let written = (!deleted).then(|| Written {
                    key: kv.key().to_vec(),
                    value: kv.value().to_vec(),
                    lease: kv.lease(),
                    create_rev: kv.create_revision(),
                    mod_rev: kv.mod_revision(),
                });
                view.latest.insert(index, (kv.mod_revision(), written));
                if !deleted && let Ok(holder) = self.layout.holder(kv) {
                    granted.push((holder.rk, holder.mod_rev));
                    if view.served_at.insert(holder.rk, holder.mod_rev).is_none() {
                        view.served.push_back(holder.rk);
                    }
                    while view.served.len() > SERVED {
                        if let Some(old) = view.served.pop_front() {
                            view.served_at.remove(&old);
                        }
                    }
                }
            }
        }
        if !granted.is_empty() {
            let mut heads = self.heads.lock();
            let before = heads.len();
            heads.retain(|w| {
                !granted
                    .iter()
                    .any(|(rk, at)| *rk == w.rk && *at > w.create_rev)
            });
            self.pruned
                .fetch_add(before - heads.len(), std::sync::atomic::Ordering::Relaxed);
        }
        self.slot_seen.send_modify(|n| *n += 1);
        if freed {
            self.frees.send_modify(|n| *n += 1);
        }
        !granted.is_empty()
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
            opened = hub.watch(prefix, WatchOptions::new().with_prefix()) => opened,
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
                        Some(watches::Seen::Events(events)) => {
                            if me.slots_seen(&events) {
                                me.heads_for_next_release();
                            }
                        }
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

#[cfg(test)]
mod tests {
    use super::*;

    const SESSION: i64 = 7;

    fn granted(slot: u32, mod_rev: i64) -> Marker {
        Marker {
            state: MarkerState::Granted { slot },
            lease: SESSION,
            mod_rev,
        }
    }

    fn put(
        layout: &Layout,
        slot: u32,
        rk: u64,
        lease: i64,
        mod_rev: i64,
    ) -> (i64, Option<Written>) {
        (
            mod_rev,
            Some(Written {
                key: layout.slot_key(slot).into_bytes(),
                value: layout.holder_value(rk).into_bytes(),
                lease,
                create_rev: mod_rev,
                mod_rev,
            }),
        )
    }

    fn code(seen: Seen) -> &'static str {
        match seen {
            Seen::Checked(Ok(Confirmed::Held)) => "held",
            Seen::Checked(Ok(Confirmed::Missing)) => "missing",
            Seen::Checked(Err(e)) => e.code(),
            Seen::Moved => "moved",
            Seen::NotYet => "not yet",
        }
    }

    #[test]
    fn a_grant_is_confirmed_only_by_its_slot_keys_put_at_the_markers_revision() {
        let layout = Layout::new("leasehold", "p", 4);
        let mut view = SlotView::default();
        // Nothing seen of slot 2 yet: wait (then read).
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "not yet"
        );
        // An older event of the slot says nothing about this grant.
        view.latest.insert(2, put(&layout, 2, 9, 8, 30));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "not yet"
        );
        // The grant's own put: held.
        view.latest.insert(2, put(&layout, 2, 5, SESSION, 40));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "held"
        );
        // A put at that revision that is not this request's grant, under this session: refused.
        view.latest.insert(2, put(&layout, 2, 6, SESSION, 40));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "ETCD_CORRUPT_RECORD"
        );
        view.latest.insert(2, put(&layout, 2, 5, SESSION + 1, 40));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "ETCD_CORRUPT_RECORD"
        );
        // The slot moved on (or was deleted) since: only a read can say.
        view.latest.insert(2, put(&layout, 2, 5, SESSION, 41));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "moved"
        );
        view.latest.insert(2, (41, None));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "moved"
        );
        // A delete at the marker's revision is no grant either.
        view.latest.insert(2, (40, None));
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &granted(2, 40), 2)),
            "moved"
        );
    }

    #[test]
    fn a_marker_under_another_lease_is_refused_whatever_the_slot_key_says() {
        let layout = Layout::new("leasehold", "p", 4);
        let mut view = SlotView::default();
        view.latest.insert(1, put(&layout, 1, 5, SESSION, 40));
        let forged = Marker {
            lease: SESSION + 1,
            ..granted(1, 40)
        };
        assert_eq!(
            code(view.check(&layout, 5, SESSION, &forged, 1)),
            "ETCD_CORRUPT_RECORD"
        );
    }
}
