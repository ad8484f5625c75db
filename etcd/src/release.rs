//! Release: one transaction that hands the slot straight to the queue's head (or deletes it
//! when nobody waits), and the background settlement of a release whose answer was lost.
//!
//! The transaction compares the slot key's mod revision with the token (so a retry after a lost
//! answer, or a late copy, does nothing once the slot has moved on). Then a chain of nested
//! transactions over the oldest waiters this broker knows of (`heads`, at most [`CHAIN_MAX`]):
//! the first of them still waiting (its queue key at the create revision, and under the lease,
//! that the list says) gets the slot: its slot key written under the waiter's session, its
//! queue key deleted and the grant written into its marker, all at one revision (the new
//! token). The grant names the waiters after the grantee that this broker knew (at most
//! `NEXT_MAX`): the grantee's own release chains over them without a read. The grantee's
//! process hears of the grant from that marker's event, and nobody else hears of it at all.
//! Last, "if nobody waits, delete the slot". The releaser's own marker goes (or becomes a
//! tombstone) in the same transaction. So a release with waiters is one transaction, one raft
//! proposal, with no read of the queue, and one watch event.
//!
//! When this broker knows of no waiter (an idle pool), the release is the plain one: "if the
//! slot is the token's and nobody waits, delete it", with the reads in its other branch.
//!
//! A slot never sits free while someone waits. Any waiter older than those known does not
//! exist (the queue only grows at its young end, and grants follow its order; a list of the
//! oldest waiters read at one time, or a grant's list of those after its grantee, joined with
//! another such list, still names every waiter older than its last), so a stale list only risks
//! a chain that finds nobody left: then the slot is still the token's, the last link reads who
//! waits now, and a second transaction hands off (two consensus rounds, the only case that
//! costs more than one). What keeps `heads` fresh without any event of other processes'
//! grants: the list each grant to this broker names, the forgetting of every waiter older than
//! one of its own that was granted (they were served first) or than the one its release handed
//! to, and a read of the oldest waiters (serializable, on one member, off the release's path)
//! when a grant leaves fewer than a chain's worth known. A release that knows of no waiter at
//! all while that read is on its way waits for it (bounded): with holds shorter than a round
//! trip it would otherwise find someone waiting only by a read of its own, and hand off in a
//! second transaction.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};
use tokio::time::{Instant, sleep};

use super::error::{EtcdError, EtcdErrorKind, Fail};
use super::layout::{MarkerState, Waiter, oldest_waiters, raws};
use super::records::{Claim, Held};
use super::session::{Settling, SettlingRequest};
use super::txn::{gets, txn_shape};
use crate::inner::Inner;
use leasehold::{BrokerError, SlotToken};

/// How a give-back ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum GaveBack {
    /// This call's transaction moved the slot on.
    Released,
    /// The slot no longer carried the token when read: an earlier attempt (whose answer was
    /// lost) moved it on, or it went with the session.
    Gone,
}

/// Settles a release in the background when the release future is dropped or fails with an
/// unknown outcome.
struct ReleaseGuard {
    inner: Arc<Inner>,
    token: SlotToken,
    entry: Option<Held>,
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if let Some(entry) = self.entry.take() {
            self.inner.settle_in_background(self.token, entry);
        }
    }
}

impl Inner {
    /// Gives `token` back (see [`SlotBroker::release`](leasehold::SlotBroker::release)).
    ///
    /// From the moment the token leaves `held` until its give-back has ended (or been handed
    /// to [`settle_in_background`](Self::settle_in_background)), its request is marked as
    /// settling: an acquire that reuses the request id is refused (`ETCD_REQUEST_SETTLING`)
    /// instead of finding in etcd the grant being given back, and handing it out again.
    pub(super) async fn release(self: &Arc<Self>, token: SlotToken) -> Result<(), BrokerError> {
        // Marked settling before the token leaves `held`, under its lock (`held`, then
        // `settling_requests`): an acquire of the same request finds the token or the mark,
        // never neither. Dropped last, after `guard` (declared later) has handed over to a
        // background settle, which marks the request itself first.
        let (entry, _settling_request) = {
            let mut held = self.held.lock();
            match held.get(&token).map(|e| e.rk) {
                Some(rk) => {
                    let request = SettlingRequest::new(self, rk);
                    (held.remove(&token), Some(request))
                }
                None => (None, None),
            }
        };
        let Some(entry) = entry else {
            if self.forgotten.lock().contains(&token) {
                // Given back by the broker after a TTL nobody kept it alive.
                return Ok(());
            }
            return Err(EtcdError::new(
                EtcdErrorKind::NotOurs,
                format!("{token} was not granted by this broker, or was already released"),
            )
            .into_broker());
        };
        // The slot index is this broker's to hand out again (see `park`).
        self.releases.fetch_add(1, Ordering::AcqRel);
        self.released.notify_waiters();
        self.hint.store(token.slot_id(), Ordering::Relaxed);
        if entry.claim == Claim::Expired {
            return Ok(()); // the broker gave it back already
        }
        if entry.lost {
            // Lost means lost: `keep_alive` told the holder, whose job ended for it. The slot
            // is not its any more (or will not be once the session lapses), so the release
            // answers now instead of retrying against an etcd that may not answer for
            // `retry_for`; the slot is given back in the background if etcd still has it under
            // this token, and counted as an orphan that expired if it went with the session.
            tracing::info!(%token, "release of a lost etcd lease answered at once; settled in the background");
            self.settle_in_background(token, entry);
            return Ok(());
        }
        let mut guard = ReleaseGuard {
            inner: Arc::clone(self),
            token,
            entry: Some(entry.clone()),
        };
        let deadline = Instant::now() + self.retry_for;
        match self.give_back(token, &entry, None, deadline).await {
            Ok(_) => {
                guard.entry = None;
                Ok(())
            }
            Err(Fail::Ambiguous(m)) => Err(BrokerError::delivery_unknown(format!(
                "release of {token} unanswered: {m}; retried in the background, else the slot goes with the session's ttl"
            ))
            .with_code("ETCD_UNAVAILABLE")),
            // The session is gone, and the slot key with it.
            Err(Fail::NotFound) => {
                guard.entry = None;
                Ok(())
            }
            Err(Fail::Fatal(e)) => Err(e.into_broker()),
        }
    }

    /// Moves the slot of `token` on: to the oldest waiter, or free when nobody waits. The
    /// request's marker goes in the same transaction, or becomes a tombstone under the session
    /// `tombstone` (an acquire given up).
    ///
    /// Concurrent releases must not fight over one head: the transaction is a chain of nested
    /// transactions over the oldest waiters this broker last read (`heads`), and hands the slot
    /// to the first of them still waiting, all at one revision. Any waiter older than those read
    /// does not exist (the queue only grows at its young end), so a stale list only risks
    /// finding nobody left; the transaction's own read of the oldest waiters then serves a
    /// second one.
    pub(super) async fn give_back(
        self: &Arc<Self>,
        token: SlotToken,
        entry: &Held,
        tombstone: Option<i64>,
        deadline: Instant,
    ) -> Result<GaveBack, Fail> {
        let l = &self.layout;
        let marker = match tombstone {
            None => TxnOp::delete(l.request_key(entry.rk), None),
            Some(lease) => TxnOp::put(
                l.request_key(entry.rk),
                l.marker_value(MarkerState::Abandoned),
                Some(PutOptions::new().with_lease(lease)),
            ),
        };
        // Never itself: a holder read as a waiter before its grant (and its marker would be both
        // written and deleted by one link).
        let mut heads: Vec<Waiter> = self.heads.lock().clone();
        // The last read found only keys under `queue/` that are not queue keys: "nobody waits"
        // cannot be compared (etcd compares every key under the prefix), so the slot is
        // deleted without it. A waiter that joins meanwhile sees the deletion (see `slots`).
        let mut strays_only = false;
        // Bounded by the deadline (`retry_for`), not by a count: under a burst of load more
        // waiters than one read can be served before its retry lands.
        for attempt in 0u32.. {
            if attempt > 0 && Instant::now() >= deadline {
                break;
            }
            heads.retain(|w| w.rk != entry.rk);
            if heads.is_empty() && attempt == 0 && self.await_refresh(deadline).await {
                // A grant left this broker no waiter to chain over, and its read of who waits
                // was on its way: waited for, it saves the read and second transaction of a
                // release that finds someone waiting after all (a hold shorter than a round
                // trip ends before that read is back).
                heads = self.heads.lock().clone();
                heads.retain(|w| w.rk != entry.rk);
            }
            let chain: Vec<Waiter> = heads[..heads.len().min(CHAIN_MAX)].to_vec();
            if chain.is_empty() {
                // Nobody known to wait (an idle pool): the release of old, one comparison and
                // one deletion, or the reads that say why not.
                let txn = self.free_or_read(token, &marker, strays_only);
                let resp = self
                    .endpoints
                    .call("free the slot", deadline, |mut c| {
                        let txn = txn.clone();
                        async move { c.txn(txn).await }
                    })
                    .await?;
                if resp.succeeded() {
                    self.contended.store(false, Ordering::Relaxed);
                    return Ok(GaveBack::Released);
                }
                let reads = gets(&resp.op_responses());
                let [slot, oldest] = reads.as_slice() else {
                    return Err(Fail::Fatal(txn_shape("free the slot")));
                };
                match slot.kvs().first() {
                    Some(kv) if kv.mod_revision() == token.lease_id() as i64 => {}
                    _ => return Ok(GaveBack::Gone),
                }
                (heads, strays_only) = self.keep_heads(oldest).map_err(Fail::Fatal)?;
                continue;
            }
            let txn = self.hand_off(token, &heads, &marker, strays_only);
            let resp = self
                .endpoints
                .call("hand the slot on", deadline, |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await?;
            if !resp.succeeded() {
                // The slot no longer carries the token: an earlier attempt (whose answer was
                // lost) moved it on, or it went with the session.
                return Ok(GaveBack::Gone);
            }
            let outer = resp.op_responses();
            let (Some(etcd_client::TxnOpResponse::Txn(first)), Some(slots)) =
                (outer.first().cloned(), gets(&outer).first().cloned())
            else {
                return Err(Fail::Fatal(txn_shape("hand the slot on")));
            };
            // Walk down the chain to the link that ran, if one did: its waiter got the slot.
            let mut link = first;
            let mut depth = 0;
            while !link.succeeded() && depth < chain.len() {
                match link.op_responses().into_iter().next() {
                    Some(etcd_client::TxnOpResponse::Txn(next)) => {
                        link = next;
                        depth += 1;
                    }
                    _ => return Err(Fail::Fatal(txn_shape("hand the slot on"))),
                }
            }
            if depth < chain.len() {
                // Handed to `chain[depth]`; those before it had left the queue. The rest of the
                // list is this broker's next chain.
                let granted = chain[depth].clone();
                heads.retain(|w| w.create_rev > granted.create_rev);
                self.keep_after(granted.create_rev);
                if slots.count() < i64::from(self.layout.capacity()) {
                    self.fill_free_slots(granted.rk);
                }
                return Ok(GaveBack::Released);
            }
            if link.succeeded() {
                // Nobody waits: the slot was deleted.
                self.heads.lock().clear();
                self.contended.store(false, Ordering::Relaxed);
                return Ok(GaveBack::Released);
            }
            // Nobody in the chain waits any more, but someone does: the slot is still the
            // token's, and the last link read who waits now. Again, over them.
            let Some(oldest) = gets(&link.op_responses()).into_iter().next() else {
                return Err(Fail::Fatal(txn_shape("hand the slot on")));
            };
            (heads, strays_only) = self.keep_heads(&oldest).map_err(Fail::Fatal)?;
        }
        Err(Fail::Ambiguous(
            "the queue kept changing under the release".into(),
        ))
    }

    /// Waits (until `deadline`, at most twice the call timeout) for the background read of
    /// the oldest waiters, if one is on its way; whether one was.
    async fn await_refresh(&self, deadline: Instant) -> bool {
        let read = self.refreshed.notified();
        tokio::pin!(read);
        read.as_mut().enable();
        if !self.refreshing.load(Ordering::Acquire) {
            return false;
        }
        let bound = deadline.min(Instant::now() + self.rpc_timeout * 2);
        let _ = tokio::time::timeout_at(bound, read).await;
        true
    }

    /// The release's transaction when no waiter is known: if the slot still carries the token
    /// and nobody waits, delete it; else read the slot key and the oldest waiters.
    fn free_or_read(&self, token: SlotToken, marker: &TxnOp, strays_only: bool) -> Txn {
        let l = &self.layout;
        let slot_key = l.slot_key(token.slot_id());
        let mut when = vec![Compare::mod_revision(
            slot_key.clone(),
            CompareOp::Equal,
            token.lease_id() as i64,
        )];
        when.extend(self.nobody_waits(strays_only));
        Txn::new()
            .when(when)
            .and_then([TxnOp::delete(slot_key.clone(), None), marker.clone()])
            .or_else([
                TxnOp::get(slot_key, Some(GetOptions::new().with_keys_only())),
                self.oldest_read(),
            ])
    }

    /// "Nobody waits": no key under `queue/`. Left out when the last read found only keys
    /// there that are not queue keys: etcd compares every key under the prefix, so it could
    /// never hold (see `give_back`).
    fn nobody_waits(&self, strays_only: bool) -> Option<Compare> {
        (!strays_only).then(|| {
            Compare::version(self.layout.queue_prefix(), CompareOp::Equal, 0).with_prefix()
        })
    }

    /// A read of the oldest waiters, as many as a release's chain holds.
    pub(super) fn oldest_read(&self) -> TxnOp {
        TxnOp::get(
            self.layout.queue_prefix(),
            Some(oldest_waiters(HEADS_READ as i64)),
        )
    }

    /// The oldest waiters a transaction of this broker read (see [`oldest_read`]), kept as the
    /// next release's chain; with whether only keys that are not queue keys were read.
    ///
    /// [`oldest_read`]: Self::oldest_read
    pub(super) fn keep_heads(
        &self,
        oldest: &etcd_client::GetResponse,
    ) -> Result<(Vec<Waiter>, bool), EtcdError> {
        let read = self.layout.waiters(raws(oldest.kvs()))?;
        let strays_only = read.is_empty() && !oldest.kvs().is_empty();
        let mut heads = self.heads.lock();
        adopt(&mut heads, &read, !oldest.more());
        self.contended.store(!heads.is_empty(), Ordering::Relaxed);
        Ok((heads.clone(), strays_only))
    }

    /// This broker's release handed its slot to the waiter that joined at `granted`: it and
    /// every waiter older than it are served (grants follow the queue's order).
    fn keep_after(&self, granted: i64) {
        self.heads.lock().retain(|w| w.create_rev > granted);
    }

    /// The release's transaction. If the slot still carries the token: the chain over the
    /// first [`CHAIN_MAX`] waiters of `heads`, for each in order "if its queue key is still
    /// there, at the revision and under the lease listed, hand it the slot (its grant names the
    /// waiters after it that `heads` names), else try the next", and last "if nobody waits,
    /// delete the slot, else read who waits"; the request's marker goes (or becomes its
    /// tombstone); and a count of the keys under `slot/` (more than the slots held only when
    /// stray keys are there: a hint that slots sit free). Else, nothing.
    ///
    /// Every put sits in a nested transaction: etcd's NOSPACE alarm, which refuses a
    /// transaction with a put at its top level, lets a release through.
    fn hand_off(
        &self,
        token: SlotToken,
        heads: &[Waiter],
        marker: &TxnOp,
        strays_only: bool,
    ) -> Txn {
        let l = &self.layout;
        let slot_key = l.slot_key(token.slot_id());
        let chain = &heads[..heads.len().min(CHAIN_MAX)];
        let mut link = Txn::new()
            .when(Vec::from_iter(self.nobody_waits(strays_only)))
            .and_then([TxnOp::delete(slot_key.clone(), None)])
            .or_else([self.oldest_read()]);
        for (i, w) in chain.iter().enumerate().rev() {
            let under = || Some(PutOptions::new().with_lease(w.lease));
            let queue_key = l.queue_key(w.qk);
            link = Txn::new()
                .when([
                    Compare::create_revision(queue_key.clone(), CompareOp::Equal, w.create_rev),
                    Compare::lease(queue_key.clone(), CompareOp::Equal, w.lease),
                ])
                .and_then([
                    TxnOp::put(slot_key.clone(), l.holder_value(w.rk), under()),
                    TxnOp::delete(queue_key, None),
                    TxnOp::put(
                        l.request_key(w.rk),
                        l.grant_value(token.slot_id(), &heads[i + 1..]),
                        under(),
                    ),
                ])
                .or_else([TxnOp::txn(link)]);
        }
        Txn::new()
            .when([Compare::mod_revision(
                slot_key,
                CompareOp::Equal,
                token.lease_id() as i64,
            )])
            .and_then([
                TxnOp::txn(link),
                TxnOp::txn(Txn::new().and_then([marker.clone()])),
                TxnOp::get(
                    l.slot_prefix(),
                    Some(GetOptions::new().with_prefix().with_count_only()),
                ),
            ])
    }

    /// Reads the queue's oldest waiters into `heads`, off the release's path: one serializable
    /// read on one member (a stale answer only costs a link that fails); the waiters the slot
    /// watch saw served meanwhile are left out.
    pub(super) fn refresh_heads(self: &Arc<Self>) {
        #[cfg(feature = "fault-injection")]
        if self.hold_refreshes.load(Ordering::Relaxed) {
            return;
        }
        self.spawn_alone(
            |inner| &inner.refreshing,
            |me| async move {
                let prefix = me.layout.queue_prefix();
                let n = HEADS_READ as i64;
                let read = me
                    .endpoints
                    .call(
                        "read the queue's oldest waiters",
                        Instant::now() + me.rpc_timeout * 2,
                        |mut c| {
                            let prefix = prefix.clone();
                            async move {
                                c.get(prefix, Some(oldest_waiters(n).with_serializable()))
                                    .await
                            }
                        },
                    )
                    .await;
                if let Ok(resp) = read
                    && let Ok(waiters) = me.layout.waiters(raws(resp.kvs()))
                {
                    let mut heads = me.heads.lock();
                    adopt(&mut heads, &waiters, !resp.more());
                    me.contended.store(!heads.is_empty(), Ordering::Relaxed);
                }
            },
        );
    }

    /// Runs `work` in the background unless the run `busy` guards is still in flight (or no
    /// runtime is at hand); `busy` is cleared when it ends.
    fn spawn_alone<F>(
        self: &Arc<Self>,
        busy: fn(&Self) -> &AtomicBool,
        work: impl FnOnce(Arc<Self>) -> F,
    ) where
        F: Future<Output = ()> + Send + 'static,
    {
        if busy(self).swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            busy(self).store(false, Ordering::Release);
            return;
        };
        let me = Arc::clone(self);
        let work = work(Arc::clone(self));
        rt.spawn(async move {
            work.await;
            busy(&me).store(false, Ordering::Release);
            me.refreshed.notify_waiters();
        });
    }

    /// Slots are free while waiters wait (freed without a hand-off: a session that expired, a
    /// release that found the queue empty just before waiters joined): grants them to the
    /// oldest waiters this broker knows of, after `served` (the one it just handed to), in the
    /// background. The queue's head would claim them too, but under contention the head is
    /// usually served by a hand-off before its own claim lands (three round trips), so free
    /// slots would stay free. Best effort: each grant compares the waiter's place and the slot's
    /// absence, so it races nobody's claim unsafely.
    fn fill_free_slots(self: &Arc<Self>, served: u64) {
        self.spawn_alone(
            |inner| &inner.filling,
            |me| async move {
                let l = &me.layout;
                let prefix = l.slot_prefix();
                let read = me
                .endpoints
                .call(
                    "read the holders",
                    Instant::now() + me.rpc_timeout * 2,
                    |mut c| {
                        let prefix = prefix.clone();
                        async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
                    },
                )
                .await;
                if let Ok(resp) = read
                    && let Ok(holders) = l.holders(raws(resp.kvs()))
                {
                    let local: Vec<u32> = me.held.lock().keys().map(|t| t.slot_id()).collect();
                    let free: Vec<u32> = (0..l.capacity())
                        .filter(|i| !holders.iter().any(|h| h.index == *i) && !local.contains(i))
                        .collect();
                    let waiters: Vec<Waiter> = me
                        .heads
                        .lock()
                        .iter()
                        .filter(|w| w.rk != served)
                        .take(free.len())
                        .cloned()
                        .collect();
                    let grants = waiters
                        .into_iter()
                        .zip(free)
                        .map(|(w, slot)| me.grant_to(w, slot));
                    futures_util::future::join_all(grants).await;
                }
            },
        );
    }

    /// [`settle`](Self::settle) in a task `close` waits for (counted in `settling`).
    /// The request stays off limits until it ends: an acquire that reuses its request id would
    /// otherwise find the grant this settle is handing on (see `acquire`).
    pub(super) fn settle_in_background(self: &Arc<Self>, token: SlotToken, entry: Held) {
        // Dropped where no runtime is current: the broker's own (if it is gone, so is the
        // session's keeper, and the session lapses with the slot).
        let rt = tokio::runtime::Handle::try_current().unwrap_or_else(|_| self.rt.clone());
        let inner = Arc::clone(self);
        let settling = Settling::new(&inner);
        let request = SettlingRequest::new(&inner, entry.rk);
        self.tasks.spawn_on(
            async move {
                inner.settle(token, entry, true).await;
                drop(request);
                drop(settling);
            },
            &rt,
        );
    }

    /// Whether a release of request `rk` is still being settled.
    pub(super) fn settles(&self, rk: u64) -> bool {
        self.settling_requests.lock().contains_key(&rk)
    }

    /// Finishes giving a token back in the background, retrying while etcd does not answer.
    /// With `count_expiry` (a release whose outcome the supervisor did not learn), a slot found
    /// gone together with the session counts as an orphan that expired; a slot found gone while
    /// the session lives was moved on by the release's own earlier attempt, and counts as
    /// nothing more.
    pub(super) async fn settle(
        self: &Arc<Self>,
        token: SlotToken,
        entry: Held,
        count_expiry: bool,
    ) {
        // No give-up while the session lives: it is renewed until the broker closes, so a slot
        // left under it would stay held, by nobody, as long as the broker runs.
        let mut backoff = Duration::from_millis(100);
        let mut failures = 0u32;
        loop {
            if entry.session.is_expired() {
                self.gone_with_session(token, &entry, count_expiry);
                return;
            }
            if self.closing.is_cancelled() {
                return; // `close` revoked the session: the slot went with it
            }
            let deadline = Instant::now() + self.retry_for;
            match self.give_back(token, &entry, None, deadline).await {
                Ok(GaveBack::Released) => {
                    tracing::info!(%token, "etcd slot given back in the background");
                    return;
                }
                Ok(GaveBack::Gone) => {
                    if self.session_lives(&entry).await {
                        tracing::info!(%token, "an earlier release of this etcd slot had landed");
                    } else {
                        self.gone_with_session(token, &entry, count_expiry);
                    }
                    return;
                }
                Err(Fail::NotFound) => {
                    self.gone_with_session(token, &entry, count_expiry);
                    return;
                }
                Err(Fail::Fatal(e)) => {
                    failures += 1;
                    if failures == 1 || failures.is_power_of_two() {
                        tracing::error!(%token, error = %e, failures, "etcd slot not given back yet; retried while the session lives");
                    }
                }
                Err(Fail::Ambiguous(why)) => {
                    failures += 1;
                    if failures.is_power_of_two() && failures >= 8 {
                        tracing::warn!(%token, error = %why, failures, "etcd slot not given back yet; retried while the session lives");
                    }
                }
            }
            tokio::select! {
                () = sleep(backoff) => {}
                () = self.closing.cancelled() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
        }
    }

    /// Whether etcd still knows the entry's session (asked, not assumed).
    async fn session_lives(self: &Arc<Self>, entry: &Held) -> bool {
        let id = entry.session.id;
        let asked = self
            .endpoints
            .call(
                "check the session",
                Instant::now() + self.retry_for,
                |mut c| async move { c.lease_time_to_live(id, None).await },
            )
            .await;
        !matches!(asked, Ok(ref resp) if resp.ttl() <= 0) && !matches!(asked, Err(Fail::NotFound))
    }

    fn gone_with_session(&self, token: SlotToken, entry: &Held, count_expiry: bool) {
        if !count_expiry {
            return;
        }
        self.orphans_expired.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%token, "etcd slot whose release went unanswered expired with its session (its ttl ended it, not a release)");
        for events in self.events.lock().iter() {
            if events.origin() == 0 || events.origin() == entry.origin || entry.origin == 0 {
                events.orphan_expired(token.lease_id());
            }
        }
    }
}

/// The longest chain (each link is about 250 bytes of the release's request, sent whether it
/// runs or not).
pub(super) const CHAIN_MAX: usize = 12;
/// How many of the oldest waiters a read takes: a chain's worth after this broker's own
/// grantee a few releases later. etcd reads the whole queue for a read sorted by create
/// revision, whatever its limit: a larger one only costs the answer's bytes.
const HEADS_READ: usize = 32;
/// The most waiters a broker keeps for its chains.
const HEADS_MAX: usize = 64;

/// Takes in `read`, the oldest waiters as a read found them (all of them when `complete`),
/// into the waiters this broker knows (`heads`, oldest first). Those known that are older than
/// the last one read and not among those read have left the queue (the read is its oldest, in
/// order); younger ones known from elsewhere (a grant's list) are kept after them.
pub(super) fn adopt(heads: &mut Vec<Waiter>, read: &[Waiter], complete: bool) {
    match read.last() {
        Some(last) if !complete => heads.retain(|w| w.create_rev > last.create_rev),
        _ => heads.clear(),
    }
    merge(heads, read);
}

/// Adds `more` to the waiters this broker knows (`heads`, oldest first, each once), keeping
/// the oldest [`HEADS_MAX`].
pub(super) fn merge(heads: &mut Vec<Waiter>, more: &[Waiter]) {
    heads.extend_from_slice(more);
    heads.sort_by_key(|w| (w.create_rev, w.qk));
    heads.dedup_by_key(|w| (w.create_rev, w.qk));
    heads.truncate(HEADS_MAX);
}
