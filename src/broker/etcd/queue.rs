//! Queue and waiting: FIFO by the queue key's create revision, work-conserving and herd-free.
//!
//! A waiter watches only its predecessor (the next older queue key) and its own request
//! marker. Only the head (no predecessor) looks at the holders, and only for slots freed
//! without a hand-off (a holder's session expired): a release normally hands its slot straight
//! to the head in the same transaction (see `release`), which writes the grant into the head's
//! marker, so the grantee learns it from one watch event. Per release: one grant event, one
//! predecessor event for the next waiter, one look (a read) by it; no waiter re-reads the pool.
//! When the head finds several slots free it claims one and grants the others to the waiters
//! behind it, in queue order, in parallel transactions (one round trip).
//!
//! A waiter keeps its place through outages and leader elections (its calls retry on any
//! member, without a bound) and fails only when etcd says its session expired.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use etcd_client::{
    Compare, CompareOp, EventType, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    WatchFilterType, WatchOptions, WatchStream,
};
use futures_util::future::join_all;
use tokio::time::{Instant, sleep};

use super::Inner;
use super::acquire::{Grant, gets, txn_shape};
use super::error::{EtcdError, EtcdErrorKind, Fail};
use super::layout::{Marker, MarkerState, Waiter};
use super::session::Session;

/// A place in the queue.
#[derive(Debug, Clone)]
pub(super) struct Ticket {
    pub(super) rk: u64,
    /// The queue key's create revision: the place.
    pub(super) rev: i64,
    pub(super) session: Arc<Session>,
}

/// What a waiter read about itself at one revision.
#[derive(Debug, Clone)]
pub(super) struct Look {
    pub(super) revision: i64,
    /// Its request marker.
    pub(super) marker: Option<Marker>,
    /// Whether its queue key exists.
    pub(super) queued: bool,
    /// The next older waiter, if any.
    pub(super) predecessor: Option<Waiter>,
    /// How many slot keys exist.
    pub(super) held: i64,
}

/// What a waiter does next, decided from a [`Look`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Next {
    /// It holds `slot`, granted at `revision`.
    Granted { slot: u32, revision: i64 },
    /// Its marker is gone: its session expired (or someone deleted its records).
    Gone,
    /// Its marker says waiting but its queue key is gone: someone else deleted it.
    Broken,
    /// Its marker is a tombstone: it was given up.
    Abandoned,
    /// It is the head; `maybe_free` when fewer slots are held than the pool has.
    Head { maybe_free: bool },
    /// It waits behind `predecessor` (a request key).
    Behind { predecessor: u64 },
}

/// Pure: what a waiter does next.
pub(super) fn decide(look: &Look, capacity: u32) -> Next {
    let Some(marker) = look.marker else {
        return Next::Gone;
    };
    match marker.state {
        MarkerState::Granted { slot } => Next::Granted {
            slot,
            revision: marker.mod_rev,
        },
        MarkerState::Abandoned => Next::Abandoned,
        MarkerState::Waiting if !look.queued => Next::Broken,
        MarkerState::Waiting => match &look.predecessor {
            Some(p) => Next::Behind { predecessor: p.rk },
            None => Next::Head {
                maybe_free: look.held < i64::from(capacity),
            },
        },
    }
}

/// Watch ids on a waiter's stream (client-chosen).
const WATCH_MARKER: i64 = 1;
const WATCH_NEXT: i64 = 2;

/// What the waiter's stream watches besides its own marker.
#[derive(Debug, Clone, Copy)]
enum Watching {
    /// The predecessor's queue key.
    Predecessor(u64),
    /// Deletions of slot keys (the head only).
    Frees,
}

impl Inner {
    /// Waits in the queue until granted. Cancel safe in the sense the acquire guard needs: a
    /// dropped wait leaves its place to the guard's cleanup.
    pub(super) async fn wait(
        self: &Arc<Self>,
        ticket: Ticket,
        mut look: Look,
    ) -> Result<Grant, EtcdError> {
        loop {
            // Local releases so far: one after this can free an index the head could not take.
            let releases = self.releases.load(Ordering::Acquire);
            let watching = match decide(&look, self.layout.capacity()) {
                Next::Granted { slot, revision } => {
                    return Ok(Grant {
                        slot,
                        revision,
                        session: Arc::clone(&ticket.session),
                    });
                }
                Next::Gone => return Err(self.gone(&ticket).await),
                Next::Broken => {
                    return Err(EtcdError::new(
                        EtcdErrorKind::InvalidResponse,
                        format!(
                            "the queue key of request {:016x} was deleted by someone else",
                            ticket.rk
                        ),
                    ));
                }
                Next::Abandoned => {
                    return Err(EtcdError::new(
                        EtcdErrorKind::InvalidResponse,
                        format!("request {:016x} was given up while it waited", ticket.rk),
                    ));
                }
                Next::Head { maybe_free: true } => {
                    if let Some(grant) = self.claim_as_head(&ticket).await? {
                        return Ok(grant);
                    }
                    // Nothing this broker may take (or someone was quicker): look again,
                    // then watch.
                    let again = self.look(&ticket).await?;
                    if matches!(
                        decide(&again, self.layout.capacity()),
                        Next::Head { maybe_free: true }
                    ) && again.held == look.held
                    {
                        look = again;
                        Watching::Frees
                    } else {
                        look = again;
                        continue;
                    }
                }
                Next::Head { maybe_free: false } => Watching::Frees,
                Next::Behind { predecessor } => Watching::Predecessor(predecessor),
            };
            look = self
                .watch_for_change(&ticket, &look, watching, releases)
                .await?;
        }
    }

    /// Why a waiter's marker is gone: its session expired (etcd says so), or someone deleted
    /// its records.
    async fn gone(self: &Arc<Self>, ticket: &Ticket) -> EtcdError {
        let id = ticket.session.id;
        let ttl = self
            .endpoints
            .call(
                "check the session",
                Instant::now() + self.retry_for,
                |mut c| async move { c.lease_time_to_live(id, None).await },
            )
            .await;
        match ttl {
            Ok(resp) if resp.ttl() > 0 => EtcdError::new(
                EtcdErrorKind::InvalidResponse,
                format!(
                    "the records of request {:016x} were deleted by someone else",
                    ticket.rk
                ),
            ),
            _ => {
                self.forget_session(&ticket.session);
                ticket.session.expired_error("waiting in the queue")
            }
        }
    }

    /// Reads the waiter's marker, its queue key, its predecessor and how many slots are held,
    /// in one read, retried on any member while the session lives.
    pub(super) async fn look(self: &Arc<Self>, ticket: &Ticket) -> Result<Look, EtcdError> {
        let l = &self.layout;
        let txn = Txn::new().and_then([
            TxnOp::get(l.request_key(ticket.rk), None),
            TxnOp::get(
                l.queue_key(ticket.rk),
                Some(GetOptions::new().with_keys_only()),
            ),
            TxnOp::get(
                l.queue_prefix(),
                Some(
                    GetOptions::new()
                        .with_prefix()
                        .with_max_create_revision(ticket.rev - 1)
                        .with_sort(SortTarget::Create, SortOrder::Descend)
                        .with_limit(1),
                ),
            ),
            TxnOp::get(
                l.slot_prefix(),
                Some(GetOptions::new().with_prefix().with_count_only()),
            ),
        ]);
        let resp = self
            .patiently(ticket, "look at the queue", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let reads = gets(&resp.op_responses());
        let [marker, queued, predecessor, count] = reads.as_slice() else {
            return Err(txn_shape("look at the queue"));
        };
        let marker = match marker.kvs().first() {
            Some(kv) => Some(l.marker(kv)?),
            None => None,
        };
        let predecessor = match predecessor.kvs().first() {
            Some(kv) => Some(l.waiter(kv)?),
            None => None,
        };
        Ok(Look {
            revision,
            marker,
            queued: !queued.kvs().is_empty(),
            predecessor,
            held: count.count(),
        })
    }

    /// One call, retried without a bound while the waiter's session lives: a waiter keeps its
    /// place through an outage or a leader election.
    async fn patiently<T, F, Fut>(
        self: &Arc<Self>,
        ticket: &Ticket,
        what: &str,
        mut f: F,
    ) -> Result<T, EtcdError>
    where
        F: FnMut(etcd_client::Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, etcd_client::Error>>,
    {
        loop {
            if ticket.session.is_expired() {
                return Err(ticket.session.expired_error(what));
            }
            match self
                .endpoints
                .call(what, Instant::now() + self.retry_for, &mut f)
                .await
            {
                Ok(v) => return Ok(v),
                Err(Fail::Ambiguous(why)) => {
                    tracing::debug!(what, error = %why, "a waiter keeps its place while etcd does not answer");
                }
                Err(Fail::NotFound) => return Err(ticket.session.expired_error(what)),
                Err(Fail::Fatal(e)) => return Err(e),
            }
        }
    }

    /// The head's move when slots may be free: read the holders, claim a free slot, and grant
    /// the other free slots to the waiters behind, in order. `None` when it got nothing.
    async fn claim_as_head(self: &Arc<Self>, ticket: &Ticket) -> Result<Option<Grant>, EtcdError> {
        let l = &self.layout;
        let slots = self
            .patiently(ticket, "read the holders", |mut c| {
                let prefix = l.slot_prefix();
                async move { c.get(prefix, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        let taken: HashSet<u32> = l.holders(slots.kvs())?.iter().map(|h| h.index).collect();
        let local: HashSet<u32> = self.held.lock().keys().map(|t| t.slot_id()).collect();
        let free: Vec<u32> = (0..l.capacity())
            .filter(|i| !taken.contains(i) && !local.contains(i))
            .collect();
        match free.as_slice() {
            [] => Ok(None),
            [only] => self.claim(ticket, *only).await,
            _ => {
                let n = free.len() as i64;
                let first = self
                    .patiently(ticket, "read the queue's head", |mut c| {
                        let prefix = l.queue_prefix();
                        async move {
                            c.get(
                                prefix,
                                Some(
                                    GetOptions::new()
                                        .with_prefix()
                                        .with_sort(SortTarget::Create, SortOrder::Ascend)
                                        .with_limit(n),
                                ),
                            )
                            .await
                        }
                    })
                    .await?;
                let waiters = l.waiters(first.kvs())?;
                if waiters.first().map(|w| w.rk) != Some(ticket.rk) {
                    return self.claim(ticket, free[0]).await;
                }
                let others = waiters[1..]
                    .iter()
                    .zip(&free[1..])
                    .map(|(w, slot)| self.grant_to(w.clone(), *slot));
                let (mine, _) = futures_util::join!(self.claim(ticket, free[0]), join_all(others));
                mine
            }
        }
    }

    /// Claims `slot` for the waiter if it is still free and the waiter still queued.
    async fn claim(
        self: &Arc<Self>,
        ticket: &Ticket,
        slot: u32,
    ) -> Result<Option<Grant>, EtcdError> {
        let l = &self.layout;
        let under = || Some(PutOptions::new().with_lease(ticket.session.id));
        let txn = Txn::new()
            .when([
                Compare::create_revision(l.queue_key(ticket.rk), CompareOp::Equal, ticket.rev),
                Compare::create_revision(l.slot_key(slot), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(l.slot_key(slot), l.holder_value(ticket.rk), under()),
                TxnOp::delete(l.queue_key(ticket.rk), None),
                TxnOp::put(
                    l.request_key(ticket.rk),
                    l.marker_value(MarkerState::Granted { slot }),
                    under(),
                ),
            ]);
        // A retry after a lost answer fails the comparison (the queue key is gone); the look
        // that follows finds the grant in the marker.
        let resp = self
            .patiently(ticket, "claim a free slot", |mut c| {
                let txn = txn.clone();
                async move { c.txn(txn).await }
            })
            .await?;
        Ok(resp.succeeded().then(|| Grant {
            slot,
            revision: resp.header().map_or(0, |h| h.revision()),
            session: Arc::clone(&ticket.session),
        }))
    }

    /// Grants `slot` to `waiter` (another request, maybe of another process) if it is still
    /// free and the waiter still queued. Best effort: a failure leaves it to the next head.
    async fn grant_to(self: &Arc<Self>, waiter: Waiter, slot: u32) {
        let l = &self.layout;
        let under = || Some(PutOptions::new().with_lease(waiter.lease));
        let txn = Txn::new()
            .when([
                Compare::create_revision(
                    l.queue_key(waiter.rk),
                    CompareOp::Equal,
                    waiter.create_rev,
                ),
                Compare::create_revision(l.slot_key(slot), CompareOp::Equal, 0),
            ])
            .and_then([
                TxnOp::put(l.slot_key(slot), l.holder_value(waiter.rk), under()),
                TxnOp::delete(l.queue_key(waiter.rk), None),
                TxnOp::put(
                    l.request_key(waiter.rk),
                    l.marker_value(MarkerState::Granted { slot }),
                    under(),
                ),
            ]);
        let _ = self
            .endpoints
            .call(
                "grant a slot to the next waiter",
                Instant::now() + self.retry_for,
                |mut c| {
                    let txn = txn.clone();
                    async move { c.txn(txn).await }
                },
            )
            .await;
    }

    /// Watches the waiter's marker and `watching` from after `look`, and returns what the
    /// waiter should decide from next: the grant written into its marker, or a fresh look once
    /// its predecessor changed, a slot was freed, the stream broke or its member went down.
    async fn watch_for_change(
        self: &Arc<Self>,
        ticket: &Ticket,
        look: &Look,
        watching: Watching,
        releases: u64,
    ) -> Result<Look, EtcdError> {
        let Some((member, mut stream)) =
            self.open_watch(ticket, look.revision + 1, watching).await?
        else {
            return self.look(ticket).await;
        };
        let mut members = self.endpoints.subscribe();
        // A slot index this broker held may become free for it (its token released here after
        // etcd had already let it go): the head looks again. Armed before the stream is read.
        let released = self.released.notified();
        tokio::pin!(released);
        released.as_mut().enable();
        if matches!(watching, Watching::Frees) && self.releases.load(Ordering::Acquire) != releases
        {
            return self.look(ticket).await;
        }
        loop {
            tokio::select! {
                () = &mut released, if matches!(watching, Watching::Frees) => {
                    return self.look(ticket).await;
                }
                msg = stream.message() => {
                    let resp = match msg {
                        Ok(Some(resp)) if !resp.canceled() => resp,
                        // Cancelled (compacted past our revision), closed or broken: look again.
                        _ => return self.look(ticket).await,
                    };
                    for event in resp.events() {
                        let Some(kv) = event.kv() else { continue };
                        match resp.watch_id() {
                            WATCH_MARKER if event.event_type() == EventType::Put => {
                                let marker = self.layout.marker(kv)?;
                                if let MarkerState::Granted { .. } = marker.state {
                                    return Ok(Look {
                                        revision: kv.mod_revision(),
                                        marker: Some(marker),
                                        queued: false,
                                        predecessor: None,
                                        held: 0,
                                    });
                                }
                            }
                            WATCH_NEXT => {
                                if let Watching::Frees = watching
                                    && let Ok(holder_free) = self.freed_index(kv.key())
                                    && let Some(grant) = self.claim_freed(ticket, holder_free).await?
                                {
                                    return Ok(granted_look(&grant));
                                }
                                return self.look(ticket).await;
                            }
                            _ => return self.look(ticket).await,
                        }
                    }
                }
                _ = members.changed() => {
                    if self.endpoints.is_down(member) {
                        return self.look(ticket).await;
                    }
                }
                () = ticket.session.expired() => {
                    return Err(ticket.session.expired_error("waiting in the queue"));
                }
            }
        }
    }

    /// The slot index of a `slot/` key (from a deletion event).
    fn freed_index(&self, key: &[u8]) -> Result<u32, ()> {
        let prefix = self.layout.slot_prefix();
        key.strip_prefix(prefix.as_bytes())
            .and_then(|k| std::str::from_utf8(k).ok())
            .filter(|k| k.len() == 6)
            .and_then(|k| k.parse::<u32>().ok())
            .filter(|i| *i < self.layout.capacity())
            .ok_or(())
    }

    /// The head saw slot `index` freed: claims it at once unless this broker still holds a
    /// token for that index.
    async fn claim_freed(
        self: &Arc<Self>,
        ticket: &Ticket,
        index: u32,
    ) -> Result<Option<Grant>, EtcdError> {
        if self.held.lock().keys().any(|t| t.slot_id() == index) {
            return Ok(None);
        }
        self.claim(ticket, index).await
    }

    /// Opens the waiter's stream on a member that answers, retried while the session lives.
    /// `None` if the session expired meanwhile (the caller's look will say so).
    async fn open_watch(
        self: &Arc<Self>,
        ticket: &Ticket,
        from: i64,
        watching: Watching,
    ) -> Result<Option<(usize, WatchStream)>, EtcdError> {
        let l = &self.layout;
        let marker_key = l.request_key(ticket.rk);
        let (next_key, next) = match watching {
            Watching::Predecessor(rk) => (
                l.queue_key(rk),
                WatchOptions::new()
                    .with_start_revision(from)
                    .with_watch_id(WATCH_NEXT),
            ),
            Watching::Frees => (
                l.slot_prefix(),
                WatchOptions::new()
                    .with_prefix()
                    .with_filters([WatchFilterType::NoPut])
                    .with_start_revision(from)
                    .with_watch_id(WATCH_NEXT),
            ),
        };
        let mut backoff = Duration::from_millis(20);
        loop {
            if ticket.session.is_expired() {
                return Ok(None);
            }
            let opened = self
                .endpoints
                .call_on(
                    "watch the queue",
                    Instant::now() + self.retry_for,
                    |mut c| {
                        let (marker_key, next_key, next) =
                            (marker_key.clone(), next_key.clone(), next.clone());
                        async move {
                            let mut stream = c
                                .watch(
                                    marker_key,
                                    Some(
                                        WatchOptions::new()
                                            .with_start_revision(from)
                                            .with_watch_id(WATCH_MARKER),
                                    ),
                                )
                                .await?;
                            stream.watch(next_key, Some(next)).await?;
                            Ok(stream)
                        }
                    },
                )
                .await;
            match opened {
                Ok(found) => return Ok(Some(found)),
                Err(Fail::Ambiguous(why)) => {
                    tracing::debug!(error = %why, "a waiter keeps its place while etcd does not answer");
                }
                Err(Fail::NotFound) => return Ok(None),
                Err(Fail::Fatal(e)) => return Err(e),
            }
            sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }
}

/// The look that says "granted", for a grant the waiter made itself.
fn granted_look(grant: &Grant) -> Look {
    Look {
        revision: grant.revision,
        marker: Some(Marker {
            state: MarkerState::Granted { slot: grant.slot },
            lease: grant.session.id,
            mod_rev: grant.revision,
        }),
        queued: false,
        predecessor: None,
        held: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(
        marker: Option<MarkerState>,
        queued: bool,
        predecessor: Option<u64>,
        held: i64,
    ) -> Look {
        Look {
            revision: 10,
            marker: marker.map(|state| Marker {
                state,
                lease: 7,
                mod_rev: 9,
            }),
            queued,
            predecessor: predecessor.map(|rk| Waiter {
                rk,
                lease: 8,
                create_rev: 5,
            }),
            held,
        }
    }

    #[test]
    fn a_waiter_with_a_predecessor_watches_it_and_only_the_head_looks_at_the_holders() {
        assert_eq!(
            decide(&look(Some(MarkerState::Waiting), true, Some(3), 2), 2),
            Next::Behind { predecessor: 3 }
        );
        assert_eq!(
            decide(&look(Some(MarkerState::Waiting), true, None, 2), 2),
            Next::Head { maybe_free: false }
        );
        assert_eq!(
            decide(&look(Some(MarkerState::Waiting), true, None, 1), 2),
            Next::Head { maybe_free: true }
        );
    }

    #[test]
    fn a_grant_in_the_marker_wins_over_anything_else_the_look_says() {
        assert_eq!(
            decide(
                &look(Some(MarkerState::Granted { slot: 1 }), false, Some(3), 2),
                2
            ),
            Next::Granted {
                slot: 1,
                revision: 9
            }
        );
    }

    #[test]
    fn missing_or_inconsistent_records_end_the_wait() {
        assert_eq!(decide(&look(None, false, None, 0), 2), Next::Gone);
        assert_eq!(
            decide(&look(Some(MarkerState::Waiting), false, None, 0), 2),
            Next::Broken
        );
        assert_eq!(
            decide(&look(Some(MarkerState::Abandoned), false, None, 0), 2),
            Next::Abandoned
        );
    }
}
