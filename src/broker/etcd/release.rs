//! Release: one transaction that hands the slot straight to the queue's head (or deletes it
//! when nobody waits), and the background settlement of a release whose answer was lost.
//!
//! The hand-off compares the slot key's mod revision with the token (so a retry after a lost
//! answer, or a late copy, does nothing once the slot has moved on) and the head's queue key
//! with the place read; it writes the slot key under the head's session, deletes the head's
//! queue key and writes the grant into the head's marker, all at one revision: the new token.
//! A slot never sits free while someone waits.
//!
//! Uncontended, a release is one write. Under contention the broker first reads the head
//! (a read, not a consensus write) and then hands off; which of the two it starts with follows
//! what the last release or acquire saw.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp};
use tokio::time::{Instant, sleep};

use super::Inner;
use super::acquire::gets;
use super::error::{EtcdError, EtcdErrorKind, Fail};
use super::layout::{MarkerState, Waiter};
use super::session::{Claim, Held};
use crate::broker::{BrokerError, SlotToken};

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
        if let Some(entry) = self.entry.take()
            && let Ok(rt) = tokio::runtime::Handle::try_current()
        {
            let (inner, token) = (Arc::clone(&self.inner), self.token);
            let settling = Settling::new(&inner);
            rt.spawn(async move {
                inner.settle(token, entry, true).await;
                drop(settling);
            });
        }
    }
}

impl Inner {
    /// Gives `token` back (see [`SlotBroker::release`](crate::SlotBroker::release)).
    pub(super) async fn release(self: &Arc<Self>, token: SlotToken) -> Result<(), BrokerError> {
        let entry = self.held.lock().remove(&token);
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

    /// Moves the slot of `token` on: to the queue's head, or free when nobody waits. The
    /// request's marker goes in the same transaction, or becomes a tombstone under the session
    /// `tombstone` (an acquire given up).
    pub(super) async fn give_back(
        self: &Arc<Self>,
        token: SlotToken,
        entry: &Held,
        tombstone: Option<i64>,
        deadline: Instant,
    ) -> Result<GaveBack, Fail> {
        let l = &self.layout;
        let slot_key = l.slot_key(token.slot_id());
        let mine = token.lease_id() as i64;
        let marker = Some(match tombstone {
            None => TxnOp::delete(l.request_key(entry.rk), None),
            Some(lease) => TxnOp::put(
                l.request_key(entry.rk),
                l.marker_value(MarkerState::Abandoned),
                Some(PutOptions::new().with_lease(lease)),
            ),
        });
        let reads = [
            TxnOp::get(slot_key.clone(), Some(GetOptions::new().with_keys_only())),
            first_waiter(l.queue_prefix()),
        ];
        let mut head = if self.contended.load(Ordering::Relaxed) {
            self.read_head(deadline).await?
        } else {
            None
        };
        let mut rounds = 0;
        loop {
            rounds += 1;
            let txn = match &head {
                Some(w) => {
                    let under = || Some(PutOptions::new().with_lease(w.lease));
                    let mut ops = vec![
                        TxnOp::put(slot_key.clone(), l.holder_value(w.rk), under()),
                        TxnOp::delete(l.queue_key(w.rk), None),
                        TxnOp::put(
                            l.request_key(w.rk),
                            l.marker_value(MarkerState::Granted {
                                slot: token.slot_id(),
                            }),
                            under(),
                        ),
                    ];
                    ops.extend(marker.clone());
                    Txn::new()
                        .when([
                            Compare::mod_revision(slot_key.clone(), CompareOp::Equal, mine),
                            Compare::create_revision(
                                l.queue_key(w.rk),
                                CompareOp::Equal,
                                w.create_rev,
                            ),
                        ])
                        .and_then(ops)
                        .or_else(reads.clone())
                }
                None => {
                    let mut ops = vec![TxnOp::delete(slot_key.clone(), None)];
                    ops.extend(marker.clone());
                    Txn::new()
                        .when([
                            Compare::mod_revision(slot_key.clone(), CompareOp::Equal, mine),
                            Compare::version(l.queue_prefix(), CompareOp::Equal, 0).with_prefix(),
                        ])
                        .and_then(ops)
                        .or_else(reads.clone())
                }
            };
            let what = if head.is_some() {
                "hand the slot to the next waiter"
            } else {
                "free the slot"
            };
            let resp = match self
                .endpoints
                .call(what, deadline, |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                })
                .await
            {
                Ok(resp) => resp,
                // The head's session vanished between the read and the hand-off (a put under a
                // lease that no longer exists fails as a whole): look for the next head.
                Err(Fail::NotFound) if head.is_some() && rounds < 16 => {
                    head = self.read_head(deadline).await?;
                    continue;
                }
                Err(f) => return Err(f),
            };
            if resp.succeeded() {
                self.contended.store(head.is_some(), Ordering::Relaxed);
                return Ok(GaveBack::Released);
            }
            let reads = gets(&resp.op_responses());
            let [slot, first] = reads.as_slice() else {
                return Err(Fail::Fatal(super::acquire::txn_shape(what)));
            };
            match slot.kvs().first() {
                Some(kv) if kv.mod_revision() == mine => {}
                _ => return Ok(GaveBack::Gone),
            }
            head = match first.kvs().first() {
                Some(kv) => Some(l.waiter(kv).map_err(Fail::Fatal)?),
                None => None,
            };
            self.contended.store(head.is_some(), Ordering::Relaxed);
            if rounds >= 16 {
                return Err(Fail::Ambiguous(
                    "the queue kept changing under the release".into(),
                ));
            }
        }
    }

    /// The queue's head (oldest waiter), by a read.
    async fn read_head(self: &Arc<Self>, deadline: Instant) -> Result<Option<Waiter>, Fail> {
        let prefix = self.layout.queue_prefix();
        let resp = self
            .endpoints
            .call("read the queue's head", deadline, |mut c| {
                let prefix = prefix.clone();
                async move {
                    c.get(
                        prefix,
                        Some(
                            GetOptions::new()
                                .with_prefix()
                                .with_sort(SortTarget::Create, SortOrder::Ascend)
                                .with_limit(1),
                        ),
                    )
                    .await
                }
            })
            .await?;
        match resp.kvs().first() {
            Some(kv) => Ok(Some(self.layout.waiter(kv).map_err(Fail::Fatal)?)),
            None => Ok(None),
        }
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
        let give_up = Instant::now() + (self.ttl * 10).max(Duration::from_secs(60));
        let mut backoff = Duration::from_millis(100);
        loop {
            if entry.session.is_expired() {
                self.gone_with_session(token, &entry, count_expiry);
                return;
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
                    tracing::error!(%token, error = %e, "etcd slot cannot be given back; left to the session's ttl");
                    return;
                }
                Err(Fail::Ambiguous(_)) => {}
            }
            if Instant::now() >= give_up {
                tracing::warn!(%token, "etcd unreachable for too long: slot left to the session's ttl, not counted");
                return;
            }
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
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

/// Counts a give-back in progress in the background (see `EtcdBroker::settling`) while it
/// lives.
pub(super) struct Settling(Arc<Inner>);

impl Settling {
    pub(super) fn new(inner: &Arc<Inner>) -> Self {
        inner.settling.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(inner))
    }
}

impl Drop for Settling {
    fn drop(&mut self) {
        self.0.settling.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A read of the queue's oldest waiter.
fn first_waiter(queue_prefix: String) -> TxnOp {
    TxnOp::get(
        queue_prefix,
        Some(
            GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1),
        ),
    )
}
